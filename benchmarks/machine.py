"""What the report says about where it ran: machine, commit, library versions."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from ocannl.backends.cpu import host, native_products

REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    return host.running().model or platform.machine()


# The CPU flags of the units issue 29's targets are meant for: AMX's bf16 tiles, AVX-512's bf16
# dot products, AMX's f16 tiles (``native_products.UNITS``). A CPU with none of them (AVX2
# only) has no bf16 units.
BF16_FLAGS = tuple(f for flags in native_products.UNITS.values() for f in flags)


def bf16_units(flags: frozenset[str] | None = None) -> dict[str, bool]:
    """Each of ``BF16_FLAGS``: whether this CPU (or one with ``flags``) has it."""
    have = host.running().flags if flags is None else flags
    return {f: f in have for f in BF16_FLAGS}


def bf16_product_path() -> str:
    """Which path this project's CPU routines take for bf16 and f16 products (native or
    widened) and why, in words (``native_products.describe()``): the report prints it beside
    the CPU's bf16 units."""
    return native_products.describe()


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
