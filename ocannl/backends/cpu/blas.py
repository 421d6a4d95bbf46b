"""The BLAS a CPU routine's products call: which library, the addresses of its Fortran-interface
``sgemm`` and ``dgemm``, the width of their integer arguments, and its thread-count controls.

The choice, ``OCANNL_BLAS`` (``mkl``, ``numpy`` or ``scipy``), or by default:
- Intel's MKL (the ``mkl`` wheel, the ``mkl`` extra) on an Intel CPU, linked with its
  sequential layer: the pool's threads share a product, one MKL call each. On a 2-core
  Sapphire Rapids the step's five large products, each split over two threads as a routine
  splits them, took 0.83x of OpenBLAS's time (10.2 against 12.3 ms). Not chosen by default
  on other vendors' CPUs, where MKL's kernels are not its own vendor's;
- NumPy's own OpenBLAS where its wheel bundles one (the library NumPy's ``@`` uses);
- SciPy's, whose thread count cannot be set.
A product of two threads can differ in its last bits from one thread's in either library, for
some shapes: its kernels are chosen by the size of each call.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ocannl.backends.cpu import link_group

CHOICES = ("mkl", "numpy", "scipy")


@dataclass(frozen=True)
class Blas:
    """``name``, one of ``CHOICES``; ``sgemm`` and ``dgemm``, addresses; ``int_bits``, 32
    (LP64) or 64 (ILP64); ``threads``, the addresses of ``int get(void)`` and ``void
    set(int)`` for its thread count, None where it cannot be set."""

    name: str
    sgemm: int
    dgemm: int
    int_bits: int
    threads: tuple[int, int] | None


_chosen: list[Blas] = []


def chosen() -> Blas:
    """The BLAS this process's routines call (decided once per process)."""
    if not _chosen:
        _chosen.append(_choose(os.environ.get("OCANNL_BLAS", "").strip()))
    return _chosen[0]


def _choose(choice: str) -> Blas:
    if choice not in ("", *CHOICES):
        raise ValueError(f"OCANNL_BLAS={choice!r}: expected 'mkl' (Intel's MKL, from the "
                         "mkl wheel), 'numpy' (NumPy's bundled OpenBLAS) or 'scipy'")
    if choice == "mkl" or (not choice and intel_cpu()):
        found = mkl()
        if found is not None:
            return found
        if choice == "mkl":
            raise ValueError("OCANNL_BLAS='mkl': no usable libmkl_intel_lp64, "
                             "libmkl_sequential and libmkl_core under "
                             f"{Path(sys.prefix) / 'lib'} (pip install mkl), or another "
                             "MKL's symbols are global in this process; unset it to use "
                             "NumPy's OpenBLAS")
    if choice in ("", "numpy"):
        found = numpy_openblas()
        if found is not None:
            return found
        if choice == "numpy":
            raise ValueError("OCANNL_BLAS='numpy': this NumPy bundles no OpenBLAS with the "
                             "routines needed (scipy_sgemm_64_); unset it to use SciPy's BLAS")
    return Blas("scipy", _scipy("sgemm"), _scipy("dgemm"), 32, None)


def intel_cpu() -> bool:
    """Whether this is an x86 CPU of Intel's (``GenuineIntel`` in ``/proc/cpuinfo``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() == "GenuineIntel"
    except OSError:
        pass
    return False


def mkl() -> Blas | None:
    """MKL from this environment's ``lib`` folder (the ``mkl`` wheel): its LP64 interface,
    sequential layer and core loaded as one group private to this project
    (``link_group.py``: PyTorch's own MKL would otherwise bind to ours). None where any is
    missing, or where another MKL's symbols are already global in this process (ours would
    bind to its internals)."""
    if not link_group.supported():
        return None
    paths = _mkl_libraries(Path(sys.prefix) / "lib")
    if paths is None or _global_symbol("mkl_serv_get_max_threads"):
        return None
    try:
        lib = link_group.load(paths, "ocannl_mkl")
        found = lib.sgemm_, lib.dgemm_, lib.MKL_Get_Max_Threads, lib.MKL_Set_Num_Threads
    except (OSError, AttributeError):
        return None
    _first_call(found[0])
    s, d, get, set_ = (ctypes.cast(f, ctypes.c_void_p).value for f in found)
    return Blas("mkl", s, d, 32, (get, set_))  # type: ignore[arg-type]


_MKL_PARTS = ("libmkl_intel_lp64", "libmkl_sequential", "libmkl_core")


def _mkl_libraries(folder: Path) -> list[Path] | None:
    """The three libraries a sequential LP64 program links, of the newest version present
    of all three (``libmkl_core.so.3``: version ``.3``)."""
    versions = [{p.name[len(part) + 3:] for p in folder.glob(f"{part}.so*")} for part in
                _MKL_PARTS]
    common = set.intersection(*versions)
    if not common:
        return None
    newest = max(common, key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))
    return [folder / f"{part}.so{newest}" for part in _MKL_PARTS]


def _global_symbol(name: str) -> bool:
    """Whether ``name`` is defined in this process's global scope."""
    libc = ctypes.CDLL(None)
    libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    return bool(libc.dlsym(None, name.encode()))


def _first_call(sgemm: Callable[..., object]) -> None:
    """One 1x1 product: MKL loads its kernels for this CPU (about 9 MiB resident, measured)
    on its first call. Made here, with the library's other set-up, rather than in a routine's
    first product: a step's time and memory are then the training's."""
    one, out = ctypes.c_float(1.0), ctypes.c_float(0.0)
    size, trans = ctypes.c_int32(1), ctypes.c_char(b"N")
    ref = ctypes.byref
    sgemm(ref(trans), ref(trans), ref(size), ref(size), ref(size), ref(one), ref(one), ref(size),
          ref(one), ref(size), ref(out), ref(out), ref(size))
    if out.value != 1.0:
        raise RuntimeError(f"MKL's sgemm computed 1 x 1 as {out.value}: its library is broken")


def numpy_openblas() -> Blas | None:
    """The OpenBLAS NumPy's wheel bundles (ILP64, ``scipy_``-prefixed symbols)."""
    import numpy

    folder = Path(numpy.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(folder.glob("libscipy_openblas64_*.so*")):
        try:
            lib = ctypes.CDLL(str(path))  # loaded with NumPy already: the same library
            found = lib.scipy_sgemm_64_, lib.scipy_dgemm_64_
        except (OSError, AttributeError):
            continue
        s, d = (ctypes.cast(f, ctypes.c_void_p).value for f in found)
        try:
            control = (ctypes.cast(lib.scipy_openblas_get_num_threads64_, ctypes.c_void_p).value,
                       ctypes.cast(lib.scipy_openblas_set_num_threads64_, ctypes.c_void_p).value)
        except AttributeError:
            control = None
        return Blas("numpy", s, d, 64, control)  # type: ignore[arg-type]
    return None


def _scipy(name: str) -> int:
    """The address of SciPy's Fortran-interface BLAS routine (``sgemm``, ``dgemm``)."""
    from scipy.linalg import cython_blas

    capsule = cython_blas.__pyx_capi__[name]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get_pointer(capsule, get_name(capsule))
