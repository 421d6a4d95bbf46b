"""Which 16-bit products the CPU's BLAS multiplies as stored, decided once per process.

A product of two bf16 (or two f16) operands is either *native*, one call of the BLAS's 16-bit
routine (MKL's ``gemm_bf16bf16f32`` / ``gemm_f16f16f32``, OpenBLAS's ``sbgemm``: 16-bit
operands, f32 accumulation and result), or *widened*: scheduling copies each operand into f32
and calls ``sgemm``. The result is exact either way; the native routine sums in another order
than ``sgemm``, and on a CPU with 16-bit units it is several times faster and needs no f32
copies. The default, by precision:

- bf16: native where the BLAS has the routine and the CPU has AMX-BF16 or AVX512-BF16
  (``/proc/cpuinfo`` flags ``amx_bf16``, ``avx512_bf16``). Elsewhere MKL runs its bf16 routine
  by widening internally, at about ``sgemm``'s rate (measured on an AVX2 AMD EPYC, one thread,
  1024^3: 72.9 against 69.6 GFLOP/s), so the default keeps the path it has always had.
- f16: native only where the CPU has AMX-FP16 (``amx_fp16``). On Sapphire Rapids, which has
  AVX512-FP16 but no AMX-FP16, MKL's f16 routine ran at 0.66x to 1.0x ``sgemm``'s rate.
  An f16 operand is never converted to bf16: that would change the numerics silently.

``OCANNL_BF16_PRODUCTS`` and ``OCANNL_F16_PRODUCTS`` (``native`` or ``widened``) force a path;
native is refused, named, where the BLAS has no such routine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ocannl.backends.cpu import blas
from ocannl.ir.ops import Precision

# The CPU flags under which each precision's native products are the default.
UNITS = {Precision.bf16: ("amx_bf16", "avx512_bf16"), Precision.f16: ("amx_fp16",)}
ENV = {Precision.bf16: "OCANNL_BF16_PRODUCTS", Precision.f16: "OCANNL_F16_PRODUCTS"}


@dataclass(frozen=True)
class ProductPath:
    """How products of two ``prec`` operands run: ``native`` or not, the BLAS routine
    (``routine``, ``address``; empty and 0 where widened) and why, as a phrase."""

    prec: Precision
    native: bool
    routine: str
    address: int
    why: str

    def describe(self) -> str:
        how = f"native ({self.routine})" if self.native else "widened to f32 copies (sgemm)"
        return f"{self.prec.value} products: {how}, {self.why}"


def decide(prec: Precision, flags: frozenset[str], library: blas.Blas,
           forced: str = "") -> ProductPath:
    """The path of ``prec`` products on a CPU with ``flags`` and the BLAS ``library``;
    ``forced``, the environment's choice (``""``: the default). ``ValueError`` naming the
    variable for a choice that is neither, and for native where the library has no routine."""
    name = ENV[prec]
    if forced not in ("", "native", "widened"):
        raise ValueError(f"{name}={forced!r}: expected 'native' (the BLAS's {prec.value} "
                         f"product) or 'widened' (f32 copies and sgemm)")
    found = library.product16(prec.value)
    units = [f for f in UNITS[prec] if f in flags]
    if forced == "native":
        if found is None:
            raise ValueError(f"{name}=native: the BLAS in use ({library.name}, "
                             f"{library.path or 'no file'}) has no {prec.value} product; "
                             f"install MKL (pip install mkl) and set OCANNL_BLAS=mkl, or unset "
                             f"{name}")
        why = f"as {name} asks" + ("" if units else
                                   f" (this CPU has no {' or '.join(UNITS[prec])})")
        return ProductPath(prec, True, found[0], found[1], why)
    if forced == "widened":
        return ProductPath(prec, False, "", 0, f"as {name} asks")
    if found is None:
        return ProductPath(prec, False, "", 0,
                           f"the BLAS in use ({library.name}) has no {prec.value} product")
    if not units:
        return ProductPath(prec, False, "", 0,
                           f"this CPU has no {' or '.join(UNITS[prec])} (its {library.name} "
                           f"{found[0]} would widen internally)")
    return ProductPath(prec, True, found[0], found[1], f"this CPU has {' and '.join(units)}")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's feature flags in ``/proc/cpuinfo`` (or in the ``cpuinfo`` text
    given); none where there is nothing to read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
                cpuinfo = info.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


_decided: dict[Precision, ProductPath] = {}


def paths() -> dict[Precision, ProductPath]:
    """Each 16-bit precision's path in this process (decided on first use, from the BLAS
    :func:`blas.chosen` picked, this CPU's flags and the environment)."""
    if not _decided:
        library, flags = blas.chosen(), cpu_flags()
        found = {p: decide(p, flags, library, os.environ.get(ENV[p], "").strip()) for p in ENV}
        _decided.update(found)  # all or nothing: a refused choice decides nothing
    return dict(_decided)


def native() -> frozenset[Precision]:
    """The precisions whose products run native here (``Target.native_products``)."""
    return frozenset(p for p, path in paths().items() if path.native)


def describe() -> str:
    """One line naming each 16-bit precision's product path here, and why."""
    return "; ".join(path.describe() for path in paths().values())
