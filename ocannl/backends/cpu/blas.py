"""The BLAS a CPU routine's products call: which library, the addresses of its Fortran-interface
``sgemm`` and ``dgemm`` (and of its 16-bit products, where it has them: MKL's
``gemm_bf16bf16f32`` and ``gemm_f16f16f32``, OpenBLAS's ``sbgemm``), the width of their integer
arguments, and its thread-count controls.

The choice (:func:`choose`, a function of the CPU's facts and of the libraries found),
``OCANNL_BLAS`` (``mkl``, ``numpy`` or ``scipy``), or by default:
- Intel's MKL (the ``mkl`` wheel, the ``mkl`` extra) on an Intel CPU, linked with its
  sequential layer: the pool's threads share a product, one MKL call each. On a 2-core
  Sapphire Rapids the step's five large products, each split over two threads as a routine
  splits them, took 0.83x of OpenBLAS's time (10.2 against 12.3 ms). Not chosen by default
  on other vendors' CPUs, where MKL's kernels are not its own vendor's;
- the OpenBLAS NumPy loaded (the library NumPy's ``@`` uses), found among the process's
  libraries by ``threadpoolctl`` (a manylinux wheel's bundled one, NumPy 1.x's or 2.x's, or a
  conda or system ``libopenblas``), its symbol names and integer width read from the library;
- SciPy's, whose thread count cannot be set.
A default that falls back (MKL refused on an Intel CPU, no OpenBLAS) says so in one
``RuntimeWarning`` naming why and what is used instead; a library asked for that is not there
is refused. A product of two threads can differ in its last bits from one thread's in either
library, for some shapes: its kernels are chosen by the size of each call.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ocannl.backends.cpu import host, link_group
from ocannl.backends.cpu.host import CpuFacts

CHOICES = ("mkl", "numpy", "scipy")


@dataclass(frozen=True)
class Blas:
    """``name``, one of ``CHOICES``; ``sgemm`` and ``dgemm``, addresses; ``int_bits``, 32
    (LP64) or 64 (ILP64); ``threads``, the addresses of ``int get(void)`` and ``void
    set(int)`` for its thread count, None where it cannot be set; ``path``, the library's
    file where one is known; ``products16``, its products of 16-bit operands into f32 (with
    ``sgemm``'s arguments, the operands' pointers to 16-bit values), by precision name
    (``"bf16"``, ``"f16"``): the routine's name and address."""

    name: str
    sgemm: int
    dgemm: int
    int_bits: int
    threads: tuple[int, int] | None
    path: str = ""
    products16: tuple[tuple[str, str, int], ...] = ()

    def product16(self, prec: str) -> tuple[str, int] | None:
        """The name and address of this library's product of ``prec`` operands, if any."""
        return next(((name, at) for p, name, at in self.products16 if p == prec), None)


_chosen: list[Blas] = []


def chosen() -> Blas:
    """The BLAS this process's routines call (decided once per process, for this CPU)."""
    if not _chosen:
        _chosen.append(choose(os.environ.get("OCANNL_BLAS", "").strip(), host.running()))
    return _chosen[0]


Finder = Callable[[], "Blas | str"]


def choose(choice: str, cpu: CpuFacts, *, find_mkl: Finder | None = None,
           find_openblas: Finder | None = None,
           find_scipy: Callable[[], Blas] | None = None) -> Blas:
    """The BLAS for ``choice`` (``OCANNL_BLAS``; ``""``: the default) on ``cpu``: MKL on an
    Intel CPU, else NumPy's OpenBLAS, else SciPy's. ``find_*`` find each library (a
    :class:`Blas`, or why it is not there, as a phrase); by default, in this process
    (:func:`mkl`, :func:`numpy_openblas`, :func:`scipy_blas`). ``ValueError`` for a choice
    that is none of ``CHOICES`` and for a library asked for that is not there."""
    if choice not in ("", *CHOICES):
        raise ValueError(f"OCANNL_BLAS={choice!r}: expected 'mkl' (Intel's MKL, from the "
                         "mkl wheel), 'numpy' (NumPy's OpenBLAS) or 'scipy'")
    refused = None  # why the default's first choices were not taken
    if choice == "mkl" or (not choice and cpu.intel):
        found = (find_mkl or mkl)()
        if isinstance(found, Blas):
            return found
        if choice == "mkl":
            raise ValueError(f"OCANNL_BLAS='mkl': {found}; unset it to use NumPy's OpenBLAS")
        refused = f"MKL refused on this Intel CPU ({found})"
    if choice in ("", "numpy"):
        openblas = (find_openblas or numpy_openblas)()
        if isinstance(openblas, Blas):
            if refused:
                _fell_back(f"{refused}; the products call NumPy's OpenBLAS "
                           f"({openblas.path}) instead")
            return openblas
        if choice == "numpy":
            raise ValueError(f"OCANNL_BLAS='numpy': {openblas}; unset it to use SciPy's BLAS")
        refused = f"{refused}, and {openblas}" if refused else openblas
    if refused:
        _fell_back(f"{refused}; the products call SciPy's BLAS instead, whose thread count "
                   "cannot be set (its own threads share each product)")
    return (find_scipy or scipy_blas)()


def scipy_blas() -> Blas:
    """SciPy's BLAS (SciPy is a dependency: always there)."""
    return Blas("scipy", _scipy("sgemm"), _scipy("dgemm"), 32, None)


_warned: set[str] = set()


def _fell_back(message: str) -> None:
    """One ``RuntimeWarning`` per process and message: the default BLAS was not available."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"ocannl: {message}", RuntimeWarning, stacklevel=4)


def mkl() -> Blas | str:
    """MKL from this environment's ``lib`` folder (the ``mkl`` wheel): its LP64 interface,
    sequential layer and core loaded as one group private to this project
    (``link_group.py``: PyTorch's own MKL would otherwise bind to ours). Where it cannot be,
    why, as a phrase: a part missing, another MKL's symbols already global in this process
    (ours would bind to its internals), or the loader refusing the group (a ``memfd`` that
    may not be mapped executable, say)."""
    if not link_group.supported():
        return (f"loading MKL as a private group needs Linux on x86-64 with memfd_create, not "
                f"{platform.system()} on {platform.machine()}")
    folder = Path(sys.prefix) / "lib"
    paths = _mkl_libraries(folder)
    if paths is None:
        return (f"no usable libmkl_intel_lp64, libmkl_sequential and libmkl_core under "
                f"{folder} (pip install mkl)")
    if _global_symbol("mkl_serv_get_max_threads"):
        return "another MKL's symbols are global in this process"
    try:
        lib = link_group.load(paths, "ocannl_mkl")
        found = lib.sgemm_, lib.dgemm_, lib.MKL_Get_Max_Threads, lib.MKL_Set_Num_Threads
    except (OSError, AttributeError) as err:
        return f"the loader refused {paths[0].parent}'s MKL libraries as a group: {err}"
    _first_call(found[0])
    s, d, get, set_ = (ctypes.cast(f, ctypes.c_void_p).value for f in found)
    return Blas("mkl", s, d, 32, (get, set_), str(paths[-1]),  # type: ignore[arg-type]
                _exported(lib, (("bf16", "gemm_bf16bf16f32_"), ("f16", "gemm_f16f16f32_"))))


def _exported(lib: ctypes.CDLL, wanted: tuple[tuple[str, str], ...]
              ) -> tuple[tuple[str, str, int], ...]:
    """``(precision, name, address)`` of each ``(precision, name)`` routine ``lib`` exports."""
    out = []
    for prec, name in wanted:
        f = getattr(lib, name, None)
        if f is not None:
            out.append((prec, name, ctypes.cast(f, ctypes.c_void_p).value or 0))
    return tuple(out)


_MKL_PARTS = ("libmkl_intel_lp64", "libmkl_sequential", "libmkl_core")


def _mkl_libraries(folder: Path) -> list[Path] | None:
    """The three libraries a sequential LP64 program links, of the newest version present
    of all three (``libmkl_core.so.3``: version ``.3``)."""
    versions = [{p.name[len(part) + 3:] for p in folder.glob(f"{part}.so*")} for part in
                _MKL_PARTS]
    common = set.intersection(*versions)
    if not common:
        return None
    # a tie of numbers (``.2`` and ``.2.x``) goes by the name: the same library whatever
    # the set's order (which the hash seed decides)
    newest = max(common, key=lambda v: (tuple(int(x) for x in v.split(".") if x.isdigit()), v))
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


# How OpenBLAS builds name their symbols: ``{prefix}sgemm_{suffix}`` (NumPy 2's wheel:
# ``scipy_sgemm_64_``; NumPy 1's: ``sgemm_64_``; conda's and distributions': ``sgemm_``).
_PREFIXES, _SUFFIXES = ("scipy_", ""), ("64_", "_64", "")


def numpy_openblas() -> Blas | str:
    """The OpenBLAS NumPy loaded, as ``threadpoolctl`` lists the process's libraries: one in
    NumPy's own folders first (a wheel's bundled copy), else the first listed (conda's or a
    distribution's shared ``libopenblas``). Where there is none, why, as a phrase."""
    import numpy
    from threadpoolctl import ThreadpoolController

    found = [c for c in ThreadpoolController().lib_controllers if c.internal_api == "openblas"]
    if not found:
        return "NumPy loaded no OpenBLAS (threadpoolctl lists no OpenBLAS in this process)"
    home = Path(numpy.__file__).resolve().parent
    mine = (home, home.parent / "numpy.libs")

    def numpys(path: str) -> bool:
        return any(Path(path).resolve().is_relative_to(folder) for folder in mine)

    found.sort(key=lambda c: not numpys(c.filepath))  # a stable sort: otherwise as listed
    return openblas(found[0].filepath)


def openblas(path: str) -> Blas | str:
    """The OpenBLAS at ``path``: its ``sgemm`` and ``dgemm`` under the build's symbol names,
    its integer width from its build configuration (``USE64BITINT``: ILP64), its thread
    controls. Where they are not found, why, as a phrase."""
    try:
        lib = ctypes.CDLL(path)  # already loaded (threadpoolctl found it): the same library
    except OSError as err:
        return f"the OpenBLAS at {path} does not load: {err}"
    for prefix in _PREFIXES:
        for suffix in _SUFFIXES:
            names = [f"{prefix}{name}{suffix}" for name in (
                "sgemm_", "dgemm_", "openblas_get_config", "openblas_get_num_threads",
                "openblas_set_num_threads")]
            try:
                s, d, config, get, set_ = (getattr(lib, n) for n in names)
            except AttributeError:
                continue
            config.restype = ctypes.c_char_p
            bits = 64 if b"USE64BITINT" in (config() or b"").split() else 32
            s, d, get, set_ = (ctypes.cast(f, ctypes.c_void_p).value for f in (s, d, get, set_))
            # sbgemm: built only with BUILD_BFLOAT16 (NumPy's wheels, so far, are not)
            sb = _exported(lib, (("bf16", f"{prefix}sbgemm_{suffix}"),))
            return Blas("numpy", s, d, bits, (get, set_), path, sb)  # type: ignore[arg-type]
    return (f"the OpenBLAS at {path} has no sgemm_, dgemm_, openblas_get_config and thread "
            f"controls under the names of known builds (prefixes {_PREFIXES}, suffixes "
            f"{_SUFFIXES})")


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
