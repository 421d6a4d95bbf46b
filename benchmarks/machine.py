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
    }
