"""The running CPU, read in one place: the facts every machine-dependent choice depends on.

Which BLAS (``blas.choose``), which routine multiplies 16-bit products
(``native_products.decide``), whether f16 converts with instructions, whether the vector
registers are cleared, which features LLVM compiles for (``jit.hardware_f16``, ``jit.has_avx``,
``jit.vector_bits``): each is a pure function of a :class:`CpuFacts` passed in, so a test can
hand it the facts of a CPU it does not run on (an Intel Xeon with AMX, an AMD EPYC with
AVX512-BF16, an AVX2-only one) and expect the same answer on every machine. :func:`running`
reads this machine's facts, once per process, and is the only reader of ``/proc/cpuinfo`` and
of LLVM's host description.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuFacts:
    """``machine``, the architecture (``platform.machine()`` in lower case: ``x86_64``,
    ``aarch64``); ``vendor``, ``/proc/cpuinfo``'s ``vendor_id`` (``GenuineIntel``,
    ``AuthenticAMD``; ``""`` where there is none); ``model``, its ``model name``, for
    reports; ``flags``, its feature flags (``avx2``, ``avx512_bf16``, ``amx_bf16``, ...);
    ``llvm_cpu`` and ``llvm_features``, LLVM's name for the CPU and its feature string as LLVM
    gives it (``"+avx,+f16c,-avx512f,..."``): what the JIT compiles for."""

    machine: str
    vendor: str
    flags: frozenset[str]
    llvm_features: str = ""
    llvm_cpu: str = "generic"
    model: str = ""

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "amd64")

    @property
    def intel(self) -> bool:
        """One of Intel's x86 CPUs (MKL's 16-bit kernels use 16-bit units only there)."""
        return self.x86 and self.vendor == "GenuineIntel"

    def llvm_has(self, feature: str) -> bool:
        """Whether LLVM's features enable ``feature`` (LLVM's name: ``f16c``, ``avx512fp16``)."""
        return f"+{feature}" in self.llvm_features.split(",")

    def describe(self) -> str:
        """The CPU in one phrase: model (or vendor) and architecture."""
        return f"{self.model or self.vendor or 'unknown CPU'} ({self.machine})"


def parse_cpuinfo(text: str) -> tuple[str, str, frozenset[str]]:
    """The first processor's ``vendor_id``, ``model name`` and ``flags`` in ``/proc/cpuinfo``
    text; empty where a field is missing."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block has ended
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return (fields.get("vendor_id", ""), fields.get("model name", ""),
            frozenset(fields.get("flags", "").split()))


@functools.cache
def running() -> CpuFacts:
    """This machine's CPU (read once per process)."""
    import llvmlite.binding as llvm

    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            vendor, model, flags = parse_cpuinfo(info.read())
    except OSError:
        vendor, model, flags = "", "", frozenset()
    return CpuFacts(machine=platform.machine().lower(), vendor=vendor, flags=flags,
                    llvm_features=llvm.get_host_cpu_features().flatten(),
                    llvm_cpu=llvm.get_host_cpu_name(), model=model or platform.processor())
