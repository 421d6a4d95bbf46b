"""The one stand-in for ``cupy`` in the tests: NumPy arrays as device memory, and the kernel
emulator (:mod:`cuda_emu`) as the GPU, so the real backend (``Context.cuda()``, i.e.
:class:`~ocannl.backends.cuda.runtime.CupyCudaBackend`) runs on a machine without one.

It offers what the backend uses, with CuPy's signatures: ``cuda.runtime.getDeviceCount``,
``cuda.Device`` (a context manager making a device current), ``zeros`` / ``empty``,
``ndarray.set`` / ``get``, ``RawModule`` (``compile``, ``get_function``) and its kernels'
launches, and ``cublas.gemm``. Its checks are strict where CuPy would misbehave silently or
fail only on a GPU: ``set`` takes only an array of the buffer's dtype and shape; launch shapes
are tuples; every kernel argument and GEMM operand is a device array of the *current* device,
the device the module was compiled on; two kernels of a module never share a name.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
from cuda_emu import build_module

_current = [0]  # the current device, as a stack (cuda.Device is a context manager)
launches: list[tuple[str, int, int]] = []  # (function name, grid, block) of every launch


def current_device() -> int:
    return _current[-1]


class FakeArray(np.ndarray):
    """A "device" array: host memory tagged with its device, with CuPy's ``set`` / ``get``."""

    device_id: int

    def __array_finalize__(self, obj: Any) -> None:
        self.device_id = getattr(obj, "device_id", current_device())

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype or arr.shape != self.shape:
            raise TypeError(f"set: got {type(arr).__name__} {getattr(arr, 'dtype', '?')} "
                            f"{getattr(arr, 'shape', '?')}, buffer is {self.dtype} {self.shape}")
        np.copyto(self.view(np.ndarray), arr)

    def get(self, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> np.ndarray:
        return np.array(self.view(np.ndarray), copy=True)

    @property
    def data(self) -> Any:  # cupy.cuda.MemoryPointer's ``ptr``
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _device_array(arr: np.ndarray) -> FakeArray:
    out = arr.view(FakeArray)
    out.device_id = current_device()
    return out


def _check_on_current_device(what: str, arrays: tuple[Any, ...], device_id: int) -> None:
    for a in arrays:
        assert isinstance(a, FakeArray), f"{what}: {type(a).__name__} is not a device array"
        assert a.device_id == current_device() == device_id, (
            f"{what}: an array of device {a.device_id}, the current device is "
            f"{current_device()}, the code's device {device_id}")


class RawKernel:
    """A kernel of a compiled :class:`RawModule`, as ``get_function`` returns it."""

    def __init__(self, module: RawModule, name: str, run: Any) -> None:
        self.module, self.name, self._run = module, name, run

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, shared_mem: int = 0) -> None:
        assert isinstance(grid, tuple) and isinstance(block, tuple) and isinstance(args, tuple)
        _check_on_current_device(f"launch of {self.name}", args, self.module.device_id)
        launches.append((self.name, grid[0], block[0]))
        self._run(grid[0], block[0], tuple(a.view(np.ndarray) for a in args))


_NAMES = re.compile(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(")


class RawModule:
    """``cupy.RawModule(code=..., options=...)``: compiled (by g++) on ``compile()`` or on the
    first ``get_function``, for the device current at that time."""

    compiles = 0  # modules compiled since install()

    def __init__(self, code: str | None = None, *, path: str | None = None,
                 options: tuple = (), backend: str = "nvrtc", translate_cucomplex: bool = False,
                 enable_cooperative_groups: bool = False, name_expressions: Any = None,
                 jitify: Any = None) -> None:
        assert code is not None and path is None, "the backend compiles sources"
        assert isinstance(options, tuple) and all(isinstance(o, str) for o in options)
        self.code, self.options = code, options
        self._fns: dict[str, Any] | None = None
        self.device_id = -1

    def compile(self, log_stream: Any = None) -> None:
        if "#include" in self.code:
            incs = [o[2:] for o in self.options if o.startswith("-I")]
            assert any((Path(d) / "cuda_fp16.h").is_file() for d in incs), self.options
        names = _NAMES.findall(self.code)
        assert len(names) == len(set(names)), f"kernel names repeat in a module: {names}"
        self._fns = build_module(self.code)
        self.device_id = current_device()
        RawModule.compiles += 1

    def get_function(self, name: str) -> RawKernel:
        if self._fns is None:
            self.compile()
        assert self._fns is not None
        if name not in self._fns:
            raise KeyError(f"no kernel {name!r} in the module (has {sorted(self._fns)})")
        return RawKernel(self, name, self._fns[name])


def gemm(transa: str, transb: str, a: Any, b: Any, out: Any = None, alpha: float = 1.0,
         beta: float = 0.0) -> Any:
    """cupy.cublas.gemm: ``out = alpha * op(a) @ op(b) + beta * out`` (``beta == 0`` never
    reads ``out``, as cuBLAS)."""
    assert a.ndim == b.ndim == 2 and a.dtype == b.dtype and a.dtype.char in "fd"
    assert out is not None and out.dtype == a.dtype and out.flags.c_contiguous
    _check_on_current_device("gemm", (a, b, out), current_device())
    x = a.T if transa == "T" else a
    y = b.T if transb == "T" else b
    with np.errstate(invalid="ignore", over="ignore"):
        res = alpha * np.matmul(x.view(np.ndarray), y.view(np.ndarray))
        o = out.view(np.ndarray)
        if beta == 0.0:
            o[...] = res
        else:
            o[...] = res + beta * o
    return out


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        _current.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        _current.pop()

    def synchronize(self) -> None:
        return None


def _empty(n: int, dtype: Any = float) -> FakeArray:
    # NaN-filled floats: a kernel reading scratch nobody wrote shows up.
    dt = np.dtype(dtype)
    return _device_array(np.full(n, np.nan, dt) if dt.kind == "f" else np.zeros(n, dt))


def install(monkeypatch: Any, *, devices: int = 1, cublas: bool = True) -> types.ModuleType:
    """Put the fake ``cupy`` into ``sys.modules`` for the test's duration, with ``devices``
    devices and, unless ``cublas`` is False, ``cupy.cublas``; empties the backend's module
    cache so that every compile of the test is seen."""
    cp = types.ModuleType("cupy")
    cp.RawModule = RawModule
    cp.zeros = lambda n, dtype=float: _device_array(np.zeros(n, dtype))
    cp.empty = _empty
    runtime = types.SimpleNamespace(getDeviceCount=lambda: devices)
    cp.cuda = types.SimpleNamespace(runtime=runtime, Device=Device)
    RawModule.compiles = 0
    launches.clear()
    _current[:] = [0]
    monkeypatch.setitem(sys.modules, "cupy", cp)
    if cublas:
        mod = types.ModuleType("cupy.cublas")
        mod.gemm = gemm
        cp.cublas = mod
        monkeypatch.setitem(sys.modules, "cupy.cublas", mod)
    else:  # as CuPy 14 without the cuBLAS wheel: ``from cupy import cublas`` fails
        def missing(name: str) -> Any:
            if name == "cublas":
                raise ImportError("libcublas.so.12: cannot open shared object file "
                                  "(the fake cupy has no cuBLAS)")
            raise AttributeError(name)

        cp.__getattr__ = missing
        monkeypatch.delitem(sys.modules, "cupy.cublas", raising=False)
    from ocannl.backends.cuda.runtime import CupyCudaBackend

    monkeypatch.setattr(CupyCudaBackend, "_modules", {})
    monkeypatch.setattr(CupyCudaBackend, "_seen", set())
    return cp
