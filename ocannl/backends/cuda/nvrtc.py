"""NVRTC without a GPU: compile CUDA C to PTX through ``libnvrtc`` and ctypes, CUDA 12 or 13.

NVRTC is a plain host library, so generated kernels can be checked by a real CUDA compiler on
machines with no driver and no device. Its wheels: ``nvidia-cuda-nvrtc-cu12`` (CUDA 12, under
``nvidia/cuda_nvrtc/lib``) and ``nvidia-cuda-nvrtc`` 13.x (CUDA 13, under ``nvidia/cu13/lib``);
the half and bfloat16 headers come from ``nvidia-cuda-runtime-cu12`` (``nvidia/cuda_runtime/
include``) and ``nvidia-cuda-runtime`` 13.x (``nvidia/cu13/include``). Both majors can be
installed side by side (different folders) and loaded in one process; every function takes a
``major`` to pick one, the newest found by default. Under NVRTC ``cuda_fp16.h`` and
``cuda_bf16.h`` (with their ``.hpp`` parts) need no other header.

NVRTC opens ``libnvrtc-builtins.so.<major>.<minor>`` by name when it compiles; the 13.0 wheel's
``libnvrtc`` cannot find the one beside it, so, as ``cuda-pathfinder`` does, the sibling of the
loaded library's real path is loaded first (the dynamic loader then reuses it by its soname).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path


class NvrtcError(RuntimeError):
    """NVRTC is missing, or it rejected a program (the message carries the compiler log)."""


# The pip wheels of each major: the compiler and its headers (what a missing one names).
WHEELS = {12: ("nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"),
          13: ("nvidia-cuda-nvrtc==13.*", "nvidia-cuda-runtime==13.*")}


def _nvidia_roots() -> list[Path]:
    """The folders of the ``nvidia`` namespace package of NVIDIA's wheels, if any."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(root) for root in spec.submodule_search_locations]


def _wheel_dirs(sub: str) -> list[Path]:
    """Every ``nvidia/*/<sub>`` folder: the CUDA 12 wheels keep one package per library
    (``nvidia/cuda_nvrtc/lib``), the CUDA 13 ones share ``nvidia/cu13/lib``."""
    return [d for root in _nvidia_roots() for d in sorted(root.glob(f"*/{sub}")) if d.is_dir()]


def _toolkit_dirs(sub: str) -> list[Path]:
    """``$CUDA_PATH/<sub>``, ``$CUDA_HOME/<sub>``, ``/usr/local/cuda/<sub>`` (where present)."""
    roots = [os.environ[e] for e in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(e)]
    return [Path(r) / sub for r in [*roots, "/usr/local/cuda"] if (Path(r) / sub).is_dir()]


_SONAME = re.compile(r"^libnvrtc\.so(\.\d+)*$")  # not libnvrtc-builtins, not libnvrtc.alt


def _library_candidates() -> list[str]:
    """Paths (or bare sonames, for the dynamic loader's own search) of every libnvrtc to try,
    wheels first."""
    paths: list[str] = []
    for d in _wheel_dirs("lib") + _toolkit_dirs("lib64") + _toolkit_dirs("lib"):
        paths += [str(p) for p in sorted(d.iterdir()) if _SONAME.match(p.name)]
    found = ctypes.util.find_library("nvrtc")
    return paths + ([found] if found else []) + ["libnvrtc.so.13", "libnvrtc.so.12"]


@dataclass(frozen=True)
class Library:
    """One loaded libnvrtc: its version, where it was found, and the ctypes handles (the
    builtins library it needs kept alive beside it)."""

    major: int
    minor: int
    path: str
    lib: ctypes.CDLL
    builtins: ctypes.CDLL | None


def _preload_builtins(path: str, major: int, minor: int) -> ctypes.CDLL | None:
    """Load ``libnvrtc-builtins.so.<major>.<minor>`` from beside ``path``'s real file, if it is
    there (see the module docstring); None when ``path`` is a bare soname or has no sibling."""
    if os.sep not in path:
        return None
    sibling = Path(os.path.realpath(path)).with_name(f"libnvrtc-builtins.so.{major}.{minor}")
    if not sibling.is_file():
        return None
    try:
        return ctypes.CDLL(str(sibling))
    except OSError:  # NVRTC's own search may still find one; a failure then names it
        return None


@functools.cache
def _libraries() -> tuple[dict[int, Library], tuple[str, ...]]:
    """The first libnvrtc found of each major, and why every candidate that failed did."""
    found: dict[int, Library] = {}
    errors: list[str] = []
    seen: set[str] = set()
    for p in _library_candidates():
        real = os.path.realpath(p) if os.sep in p else p
        if real in seen:
            continue
        seen.add(real)
        try:
            lib = ctypes.CDLL(p)
        except OSError as err:
            errors.append(f"{p}: {err}")
            continue
        _declare(lib)
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            errors.append(f"{p}: nvrtcVersion failed")
            continue
        if major.value not in found:
            found[major.value] = Library(major.value, minor.value, p, lib,
                                         _preload_builtins(p, major.value, minor.value))
    return found, tuple(errors)


def _install_hint() -> str:
    return " or ".join(f"pip install {w[0]} (CUDA {m})" for m, w in WHEELS.items())


def majors() -> tuple[int, ...]:
    """The CUDA majors of the NVRTC libraries found here, ascending (empty: none)."""
    return tuple(sorted(_libraries()[0]))


def library(major: int | None = None) -> Library:
    """The NVRTC of CUDA ``major`` (None: the newest found); :class:`NvrtcError` naming the
    wheel to install when there is none."""
    found, errors = _libraries()
    if major is None:
        if not found:
            raise NvrtcError(f"libnvrtc not found ({_install_hint()}); tried "
                             + "; ".join(errors or _library_candidates()))
        return found[max(found)]
    if major not in found:
        have = ", ".join(f"{m}.{lib.minor} ({lib.path})" for m, lib in sorted(found.items()))
        wheel = WHEELS.get(major, (f"the CUDA {major} NVRTC",))[0]
        raise NvrtcError(f"no NVRTC of CUDA {major} found (pip install {wheel}); found: "
                         f"{have or 'none'}")
    return found[major]


def _lib(major: int | None = None) -> ctypes.CDLL:
    return library(major).lib


def _declare(lib: ctypes.CDLL) -> None:
    vp, sz, ip = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcVersion.argtypes = [ip, ip]
    lib.nvrtcGetNumSupportedArchs.argtypes = [ip]
    lib.nvrtcGetSupportedArchs.argtypes = [ip]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_int, vp, vp]
    lib.nvrtcCompileProgram.argtypes = [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [vp, ctypes.POINTER(sz)]
    lib.nvrtcGetProgramLog.argtypes = [vp, ctypes.c_char_p]
    lib.nvrtcGetPTXSize.argtypes = [vp, ctypes.POINTER(sz)]
    lib.nvrtcGetPTX.argtypes = [vp, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(vp)]


def available(major: int | None = None) -> str | None:
    """None when NVRTC (of CUDA ``major``; None: any) can be used here, else why it cannot."""
    try:
        library(major)
    except NvrtcError as err:
        return str(err)
    return None


def version(major: int | None = None) -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    lib = library(major)
    return lib.major, lib.minor


def _check(lib: ctypes.CDLL, code: int, what: str, log: str = "") -> None:
    if code != 0:
        msg = lib.nvrtcGetErrorString(code).decode()
        raise NvrtcError(f"{what} failed: {msg}" + (f"\n{log}" if log else ""))


@functools.cache
def supported_archs(major: int | None = None) -> tuple[int, ...]:
    """The architectures NVRTC (of CUDA ``major``) compiles for, as NVRTC itself lists them
    (``nvrtcGetSupportedArchs``): e.g. 90 for ``compute_90``, ascending."""
    lib = _lib(major)
    n = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * n.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return tuple(sorted(archs))


def _arch_number(arch: str) -> int:
    m = re.fullmatch(r"(?:compute|sm)_(\d+)[af]?", arch)
    if m is None:
        raise ValueError(f"arch must be like 'compute_90' or 'sm_90', got {arch!r}")
    return int(m.group(1))


def _header_major(folder: Path) -> int | None:
    """The CUDA major of a header folder (``CUDART_VERSION`` in its ``cuda_runtime_api.h``),
    None when it does not say."""
    try:
        text = (folder / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return int(m.group(1)) // 1000 if m else None


@functools.cache
def cuda_include_dir(major: int | None = None) -> str | None:
    """A folder holding ``cuda_fp16.h`` and ``cuda_bf16.h`` (of CUDA ``major``, when given: the
    headers go with the compiler of the same major), or None when none is found.

    Searched in order: the NVIDIA wheels' include folders (``nvidia/cuda_runtime/include`` of
    CUDA 12, ``nvidia/cu13/include`` of CUDA 13), ``cuda.pathfinder`` (a CuPy dependency),
    ``$CUDA_PATH/include``, ``$CUDA_HOME/include``, ``/usr/local/cuda/include``. A folder whose
    major cannot be told is taken only when no ``major`` is asked for.
    """
    candidates: list[Path] = _wheel_dirs("include")
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # noqa: BLE001 - optional helper; any failure means "not found here"
        pass
    candidates += _toolkit_dirs("include")
    for d in candidates:
        if not ((d / "cuda_fp16.h").is_file() and (d / "cuda_bf16.h").is_file()):
            continue
        if major is None or _header_major(d) == major:
            return str(d)
    return None


def compile_ptx(source: str, arch: str = "compute_90", options: tuple[str, ...] = (),
                name: str = "kernel.cu", include_dirs: tuple[str, ...] | None = None,
                major: int | None = None) -> tuple[str, str]:
    """Compile CUDA C to PTX for ``arch`` (e.g. ``compute_90``) with the NVRTC of CUDA
    ``major`` (None: the newest found); returns ``(ptx, log)``.

    Raises :class:`NvrtcError` with the compiler log on any compile error, and before compiling
    when that NVRTC does not support ``arch`` (naming the ones it does). ``include_dirs``
    defaults to the folder of :func:`cuda_include_dir` of the same major when one is found.
    """
    found = library(major)
    lib = found.lib
    supported = supported_archs(found.major)
    if _arch_number(arch) not in supported:
        raise NvrtcError(f"NVRTC {found.major}.{found.minor} does not compile for {arch}; it "
                         f"supports compute_{supported[0]} to compute_{supported[-1]}: "
                         f"{', '.join(map(str, supported))}")
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0,
                                       None, None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", *options]
        if include_dirs is None:
            inc = cuda_include_dir(found.major)
            include_dirs = () if inc is None else (inc,)
        opts += [f"-I{d}" for d in include_dirs]
        raw = [o.encode() for o in opts]
        arr = (ctypes.c_char_p * len(raw))(*raw)
        code = lib.nvrtcCompileProgram(prog, len(raw), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(max(n.value, 1))
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        _check(lib, code, f"nvrtcCompileProgram (NVRTC {found.major}.{found.minor}, {arch})",
               log)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value.decode(), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
