"""NVRTC without a GPU: compile CUDA C to PTX through ``libnvrtc`` and ctypes.

NVRTC is a plain host library (the ``nvidia-cuda-nvrtc-cu12`` wheel ships it), so generated
kernels can be checked by a real CUDA compiler on machines with no driver and no device. The
half and bfloat16 headers come from the ``nvidia-cuda-runtime-cu12`` wheel; under NVRTC
``cuda_fp16.h`` and ``cuda_bf16.h`` (with their ``.hpp`` parts) need no other header.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import os
from pathlib import Path


class NvrtcError(RuntimeError):
    """NVRTC is missing, or it rejected a program (the message carries the compiler log)."""


def _nvidia_roots() -> list[Path]:
    """The folders of the ``nvidia`` namespace package of NVIDIA's wheels, if any."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(root) for root in spec.submodule_search_locations]


def _wheel_dir(package: str, sub: str) -> Path | None:
    """``nvidia/<package>/<sub>`` of an installed NVIDIA wheel, if present."""
    for root in _nvidia_roots():
        d = root / package / sub
        if d.is_dir():
            return d
    return None


def _wheel_dirs(sub: str) -> list[Path]:
    """Every ``nvidia/*/<sub>`` folder: the CUDA 12 wheels keep one package per library
    (``nvidia/cuda_runtime/include``), the CUDA 13 ones share ``nvidia/cu13/include``."""
    return [d for root in _nvidia_roots() for d in sorted(root.glob(f"*/{sub}")) if d.is_dir()]


@functools.cache
def cuda_include_dir() -> str | None:
    """A folder holding ``cuda_fp16.h`` and ``cuda_bf16.h``, or None when none is found.

    Searched in order: the ``nvidia-cuda-runtime-cu12`` wheel, ``cuda.pathfinder`` (a CuPy
    dependency), any other NVIDIA wheel's include folder (CUDA 13's ``nvidia/cu13/include``),
    ``$CUDA_PATH/include``, ``/usr/local/cuda/include``.
    """
    candidates: list[Path] = []
    wheel = _wheel_dir("cuda_runtime", "include")
    if wheel is not None:
        candidates.append(wheel)
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(Path(found))
    except Exception:  # noqa: BLE001 - optional helper; any failure means "not found here"
        pass
    candidates += _wheel_dirs("include")
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for d in candidates:
        if (d / "cuda_fp16.h").is_file() and (d / "cuda_bf16.h").is_file():
            return str(d)
    return None


@functools.cache
def _lib() -> ctypes.CDLL:
    paths: list[str] = []
    wheel = _wheel_dir("cuda_nvrtc", "lib")
    for d in ([wheel] if wheel is not None else []) + _wheel_dirs("lib"):
        paths += [str(p) for p in sorted(d.glob("libnvrtc.so*")) if "builtins" not in p.name]
    found = ctypes.util.find_library("nvrtc")
    if found:
        paths.append(found)
    paths += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    errors = []
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError as err:
            errors.append(f"{p}: {err}")
            continue
        _declare(lib)
        return lib
    raise NvrtcError("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12); tried "
                     + "; ".join(errors or paths))


def _declare(lib: ctypes.CDLL) -> None:
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_int, vp, vp]
    lib.nvrtcCompileProgram.argtypes = [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.nvrtcGetProgramLogSize.argtypes = [vp, ctypes.POINTER(sz)]
    lib.nvrtcGetProgramLog.argtypes = [vp, ctypes.c_char_p]
    lib.nvrtcGetPTXSize.argtypes = [vp, ctypes.POINTER(sz)]
    lib.nvrtcGetPTX.argtypes = [vp, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(vp)]


def available() -> str | None:
    """None when NVRTC can be used here, else the reason it cannot."""
    try:
        _lib()
    except NvrtcError as err:
        return str(err)
    return None


def version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_lib().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(code: int, what: str, log: str = "") -> None:
    if code != 0:
        msg = _lib().nvrtcGetErrorString(code).decode()
        raise NvrtcError(f"{what} failed: {msg}" + (f"\n{log}" if log else ""))


def compile_ptx(source: str, arch: str = "compute_90", options: tuple[str, ...] = (),
                name: str = "kernel.cu", include_dirs: tuple[str, ...] | None = None
                ) -> tuple[str, str]:
    """Compile CUDA C to PTX for ``arch`` (e.g. ``compute_70``); returns ``(ptx, log)``.

    Raises :class:`NvrtcError` with the compiler log on any compile error. ``include_dirs``
    defaults to the folder of :func:`cuda_include_dir` when one is found.
    """
    lib = _lib()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None,
                                  None), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", *options]
        if include_dirs is None:
            found = cuda_include_dir()
            include_dirs = () if found is None else (found,)
        opts += [f"-I{d}" for d in include_dirs]
        raw = [o.encode() for o in opts]
        arr = (ctypes.c_char_p * len(raw))(*raw)
        code = lib.nvrtcCompileProgram(prog, len(raw), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(max(n.value, 1))
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        _check(code, f"nvrtcCompileProgram ({arch})", log)
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value.decode(), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
