"""What the report says about where it ran: machine, commit, library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The CPU flags of the units issue 29's targets are meant for: AMX's bf16 tiles, AVX-512's bf16
# dot products, AMX's f16 tiles. A CPU with none of them (AVX2 only) has no bf16 units.
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "amx_fp16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's flags in ``/proc/cpuinfo`` (or the ``cpuinfo`` text given); empty
    where there is none to read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def bf16_units(flags: set[str] | None = None) -> dict[str, bool]:
    """Each of ``BF16_FLAGS``: whether this CPU has it."""
    have = cpu_flags() if flags is None else flags
    return {f: f in have for f in BF16_FLAGS}


def bf16_product_path() -> str | None:
    """Which bf16 product path this project's CPU routines run (native or widened), in words,
    from ``ocannl.backends.cpu.native_products.describe()``; None where this checkout has no
    such module."""
    # THE PLACE FOR THE LINE naming the bf16 product path: report.render prints this beside the
    # CPU's bf16 units (``bf16_path`` in the run's info).
    try:
        from ocannl.backends.cpu import native_products  # type: ignore[attr-defined]
    except ImportError:
        return None
    return str(native_products.describe())


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def commit() -> str:
    """The checked-out commit, marked ``+dirty`` when the work tree has changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              check=False).stdout.strip()

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("ocannl", "numpy", "llvmlite", "scipy", "mkl", "torch", "ml-dtypes",
                "cupy-cuda12x"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def blas_in_use() -> str:
    """The library ocannl's CPU routines call for their products (``ocannl.backends.cpu.blas``:
    MKL on Intel CPUs where its wheel is installed, else NumPy's OpenBLAS)."""
    from ocannl.backends.cpu import blas

    return {"mkl": "Intel MKL (its sequential layer, on ocannl's threads)",
            "numpy": "NumPy's OpenBLAS", "scipy": "SciPy's OpenBLAS"}[blas.chosen().name]


def load_average() -> str:
    try:
        return " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def describe() -> dict[str, object]:
    mem = memory_gib()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory": f"{mem:.1f} GiB" if mem else "unknown",
        "platform": platform.platform(),
        "commit": commit(),
        "versions": versions(),
        "blas": blas_in_use(),
        "bf16_units": bf16_units(),
        "bf16_path": bf16_product_path(),
    }
