"""A stand-in ``cupy`` module over NumPy and the kernel emulator, so the CUDA backend's own
CuPy-facing code (``CupyCudaBackend``: device checks, buffers, ``RawKernel`` compile and
launch, ``cublas.gemm``) runs on a machine without a GPU. Its signatures follow CuPy's; its
checks are strict where CuPy's behaviour would differ silently (dtypes of ``set``, launch
shapes given as tuples, contiguous GEMM output)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
from cuda_emu import build_library, launcher


class FakeArray(np.ndarray):
    """A "device" array: host memory, with CuPy's ``set`` / ``get``."""

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype or arr.shape != self.shape:
            raise TypeError(f"set: got {type(arr).__name__} {getattr(arr, 'dtype', '?')} "
                            f"{getattr(arr, 'shape', '?')}, buffer is {self.dtype} {self.shape}")
        np.copyto(self.view(np.ndarray), arr)

    def get(self, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> np.ndarray:
        return np.array(self.view(np.ndarray), copy=True)


def _device_array(arr: np.ndarray) -> FakeArray:
    return arr.view(FakeArray)


class RawKernel:
    """Records compiles; the first launch builds every kernel compiled so far at once."""

    registry: list[RawKernel] = []
    compiles = 0

    def __init__(self, code: str, name: str, options: tuple = (), backend: str = "nvrtc",
                 translate_cucomplex: bool = False, *, enable_cooperative_groups: bool = False,
                 jitify: Any = None) -> None:
        assert isinstance(options, tuple) and all(isinstance(o, str) for o in options)
        self.code, self.name, self.options = code, name, options
        self._run: Any = None

    def compile(self, log_stream: Any = None) -> None:
        if "#include" in self.code:
            incs = [o[2:] for o in self.options if o.startswith("-I")]
            assert any((Path(d) / "cuda_fp16.h").is_file() for d in incs), self.options
        RawKernel.compiles += 1
        RawKernel.registry.append(self)

    def __call__(self, grid: tuple, block: tuple, args: tuple, *, shared_mem: int = 0) -> None:
        assert isinstance(grid, tuple) and isinstance(block, tuple) and isinstance(args, tuple)
        if self._run is None:
            todo = [k for k in RawKernel.registry if k._run is None]
            assert self in todo, "launched before compile()"
            lib, index = build_library([k.code for k in todo])
            for k in todo:
                k._run = launcher(lib, index[k.code])
        for a in args:
            assert isinstance(a, FakeArray), type(a)
        self._run(grid[0], block[0], tuple(a.view(np.ndarray) for a in args))


def gemm(transa: str, transb: str, a: Any, b: Any, out: Any = None, alpha: float = 1.0,
         beta: float = 0.0) -> Any:
    """cupy.cublas.gemm: ``out = alpha * op(a) @ op(b) + beta * out``."""
    assert a.ndim == b.ndim == 2 and a.dtype == b.dtype and a.dtype.char in "fd"
    assert out is not None and out.dtype == a.dtype and out.flags.c_contiguous
    x = a.T if transa == "T" else a
    y = b.T if transb == "T" else b
    res = alpha * np.matmul(x.view(np.ndarray), y.view(np.ndarray))
    o = out.view(np.ndarray)
    if beta == 0.0:
        o[...] = res
    else:
        o[...] = res + beta * o
    return out


class _Device:
    def __init__(self, device_id: int = 0) -> None:
        self.id = device_id

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


def install(monkeypatch: Any, *, devices: int = 1, cublas: bool = True) -> types.ModuleType:
    """Put a fake ``cupy`` into ``sys.modules`` for the test's duration."""
    cp = types.ModuleType("cupy")
    cp.RawKernel = RawKernel
    cp.zeros = lambda n, dtype=float: _device_array(np.zeros(n, dtype))
    cp.empty = lambda n, dtype=float: _device_array(np.full(n, np.nan, dtype)
                                                    if np.dtype(dtype).kind == "f"
                                                    else np.zeros(n, dtype))
    runtime = types.SimpleNamespace(getDeviceCount=lambda: devices)
    cp.cuda = types.SimpleNamespace(runtime=runtime, Device=_Device)
    RawKernel.registry = []
    RawKernel.compiles = 0
    monkeypatch.setitem(sys.modules, "cupy", cp)
    if cublas:
        mod = types.ModuleType("cupy.cublas")
        mod.gemm = gemm
        cp.cublas = mod
        monkeypatch.setitem(sys.modules, "cupy.cublas", mod)
    else:
        monkeypatch.setitem(sys.modules, "cupy.cublas", None)  # import fails
    from ocannl.backends.cuda import runtime

    monkeypatch.setattr(runtime._CupyDevice, "_kernels", {})
    return cp
