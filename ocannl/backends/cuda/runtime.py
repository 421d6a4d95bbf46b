"""Running CUDA launch plans through CuPy: buffers, kernels compiled by NVRTC, cuBLAS GEMMs.

CuPy is imported only when a backend is created, so :mod:`ocannl.backends.cuda.plan` and the
NVRTC checks work on a machine with no GPU.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ocannl.backends.base import host_to_storage, storage_to_host
from ocannl.backends.cuda.plan import GemmCall, Kernel, Plan, plan_routine
from ocannl.ir.lowering import Lowered, MatrixView
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

# --- running plans --------------------------------------------------------------------------


class CudaUnavailable(RuntimeError):
    """No GPU is usable through CuPy; the message says why (no CuPy, no driver, no device)."""


def cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """None when ``Context.cuda(device_id)`` can work here, else why it cannot."""
    try:
        import cupy
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken CUDA install under it
        return f"CuPy is not installed or fails to import ({err}); pip install cupy-cuda12x"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # noqa: BLE001 - CUDARuntimeError, or a driver library missing
        text = str(err)
        if "NoDevice" in text or "no CUDA-capable device" in text:
            return f"no CUDA device is visible ({text})"
        return f"no usable NVIDIA driver ({text})"
    if count == 0:
        return "no CUDA device is visible (the driver reports 0 devices)"
    if not 0 <= device_id < count:
        return f"device_id {device_id} is out of range: {count} CUDA device(s) visible"
    return None


def _storage_dtype(prec: Precision) -> Any:
    return {Precision.f64: np.float64, Precision.f32: np.float32, Precision.f16: np.float16,
            Precision.bf16: np.uint16}[prec]


def _matrix(buf: Any, v: MatrixView) -> tuple[Any, str]:
    """The stored matrix of a view and the cuBLAS op reading it as ``rows x cols``."""
    if v.transposed:
        return buf.reshape((v.cols, v.rows)), "T"
    return buf.reshape((v.rows, v.cols)), "N"


class Device:
    """What a routine needs from a device: kernels by source, buffers, a GEMM. The CuPy one is
    :class:`_CupyDevice`; tests substitute a CPU emulation to run the same plans."""

    def kernel(self, k: Kernel) -> tuple[Callable[..., None], bool]:
        """A launcher ``fn(grid, block, args)`` for the kernel, and whether it was compiled
        anew."""
        raise NotImplementedError

    def empty(self, size: int, prec: Precision) -> Any:
        raise NotImplementedError

    def gemm(self, transa: str, transb: str, a: Any, b: Any, out: Any, beta: float) -> None:
        """``out = op(a) @ op(b) + beta * out`` (2-D; ``out`` C-contiguous)."""
        raise NotImplementedError


class CudaRoutine:
    """A compiled plan: called with the routine's node buffers in order, it launches every
    step on the device's current stream (asynchronously; reads synchronise)."""

    def __init__(self, plan: Plan, nodes: Sequence[Tnode], device: Device) -> None:
        self.plan = plan
        self.device = device
        pos = {n.id: k for k, n in enumerate(nodes)}
        self.fresh = False
        self._launchers: list[Any] = []
        for step in plan.steps:
            if isinstance(step, Kernel):
                for n in step.nodes:
                    if n.id not in pos:
                        raise ValueError(f"kernel reads node {n.name}, which has no buffer "
                                         f"(memory mode {n.memory_mode.value})")
                fn, new = device.kernel(step)
                self.fresh |= new
                self._launchers.append(fn)
            else:
                for v in (step.gemm.a, step.gemm.b, step.gemm.assign.lhs):
                    n = v.node if isinstance(v, MatrixView) else v
                    if n.id not in pos:
                        raise ValueError(f"GEMM reads node {n.name}, which has no buffer")
                self._launchers.append(None)
        self._pos = pos
        self._scratch = [device.empty(s.size, s.prec) for s in plan.scratch]
        self._bound: tuple[Any, ...] | None = None
        self._calls: list[Callable[[], None]] = []

    def _bind(self, bufs: tuple[Any, ...]) -> None:
        calls: list[Callable[[], None]] = []
        scratch = self._scratch
        for step, fn in zip(self.plan.steps, self._launchers, strict=True):
            if isinstance(step, Kernel):
                args = tuple(bufs[self._pos[n.id]] for n in step.nodes) + tuple(
                    scratch[s.slot] for s in step.scratch)
                calls.append(_launch_call(fn, step.grid, step.block, args))
            else:
                g = step.gemm

                def src(v: MatrixView, slot: int | None) -> Any:
                    return bufs[self._pos[v.node.id]] if slot is None else scratch[slot]

                a, ta = _matrix(src(g.a, step.a_slot), g.a)
                b, tb = _matrix(src(g.b, step.b_slot), g.b)
                out_buf = (bufs[self._pos[g.assign.lhs.id]] if step.out_slot is None
                           else scratch[step.out_slot])
                out = out_buf.reshape((g.rows, g.cols))
                calls.append(_gemm_call(self.device, ta, tb, a, b, out, step.beta))
        self._calls = calls
        self._bound = bufs

    def __call__(self, *bufs: Any) -> None:
        bound = self._bound
        if bound is None or len(bound) != len(bufs) or any(
                x is not y for x, y in zip(bound, bufs, strict=True)):
            self._bind(bufs)
        for call in self._calls:
            call()


def _launch_call(fn: Callable[..., None], grid: int, block: int,
                 args: tuple[Any, ...]) -> Callable[[], None]:
    g, b = (grid,), (block,)
    return lambda: fn(g, b, args)


def _gemm_call(device: Device, ta: str, tb: str, a: Any, b: Any, out: Any,
               beta: float) -> Callable[[], None]:
    return lambda: device.gemm(ta, tb, a, b, out, beta)


class _CupyDevice(Device):
    """Kernels are ``cupy.RawKernel`` compiled once per (device, source) in the process."""

    _kernels: dict[tuple[int, str], Any] = {}

    def __init__(self, cupy: Any, device_id: int) -> None:
        self.cp = cupy
        self.device_id = device_id
        from ocannl.backends.cuda.nvrtc import cuda_include_dir

        inc = cuda_include_dir()
        self.options = (f"-I{inc}",) if inc else ()
        self.include_found = inc is not None
        try:
            from cupy import cublas
        except ImportError as err:  # CuPy 14 wheels do not bundle cuBLAS
            self.cublas = None
            self.cublas_missing = str(err)
        else:
            self.cublas = cublas
            self.cublas_missing = ""

    def kernel(self, k: Kernel) -> tuple[Callable[..., None], bool]:
        key = (self.device_id, k.source)
        fn = self._kernels.get(key)
        if fn is not None:
            return fn, False
        if "#include" in k.source and not self.include_found:
            raise CudaUnavailable(
                "a 16-bit kernel needs cuda_fp16.h / cuda_bf16.h and none was found: "
                "pip install nvidia-cuda-runtime-cu12, or set CUDA_PATH")
        fn = self.cp.RawKernel(k.source, k.name, options=self.options)
        fn.compile()
        self._kernels[key] = fn
        return fn, True

    def empty(self, size: int, prec: Precision) -> Any:
        return self.cp.empty(size, dtype=_storage_dtype(prec))

    def gemm(self, transa: str, transb: str, a: Any, b: Any, out: Any, beta: float) -> None:
        self.cublas.gemm(transa, transb, a, b, out=out, beta=beta)


class CupyCudaBackend:
    """Buffers are flat CuPy arrays on one device; routines are :class:`CudaRoutine` plans of
    ``RawKernel`` launches and cuBLAS calls. ``write`` copies in place, so the buffer's device
    pointer never changes and bound routines see new values without recompiling."""

    name = "cuda"

    def __init__(self, device_id: int = 0) -> None:
        reason = cuda_unavailable_reason(device_id)
        if reason is not None:
            raise CudaUnavailable(f"Context.cuda(device_id={device_id}): no GPU is usable: "
                                  f"{reason}")
        import cupy

        self.cp = cupy
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self._dev = _CupyDevice(cupy, device_id)
        self._seen: set[tuple[str, ...]] = set()
        self._said_cublas = False

    def alloc(self, node: Tnode) -> Any:
        with self._device:
            return self.cp.zeros(node.size, dtype=_storage_dtype(node.prec))

    def write(self, node: Tnode, buf: Any, host: np.ndarray) -> None:
        arr = host_to_storage(node, host)
        if arr.dtype != buf.dtype:
            arr = arr.view(buf.dtype)  # f16 bits as float16: same bytes
        with self._device:
            buf.set(np.ascontiguousarray(arr))

    def read(self, node: Tnode, buf: Any) -> np.ndarray:
        with self._device:
            host = buf.get()
        if node.prec.is_narrow:
            host = host.view(np.uint16)
        return storage_to_host(node, host).copy()

    def bind(self, compiled: Callable, buffers: tuple[Any, ...]) -> Callable[[], None]:
        return functools.partial(compiled, *buffers)

    @property
    def has_gemm(self) -> bool:
        """Whether lowering may hand matrix products to this backend (cuBLAS is loadable)."""
        if self._dev.cublas is None and not self._said_cublas:
            self._said_cublas = True
            warnings.warn(f"ocannl: cuBLAS is not loadable ({self._dev.cublas_missing}); "
                          "matrix products run as generated kernels (pip install "
                          "nvidia-cublas-cu12 for cuBLAS)", RuntimeWarning, stacklevel=4)
        return self._dev.cublas is not None

    def compile(self, label: str, code: list[Lowered], nodes: list[Tnode]) -> tuple[Callable, bool]:
        plan = plan_routine(code)
        with self._device:
            routine = CudaRoutine(plan, nodes, self._dev)
        key = tuple(plan.sources()) + tuple(repr(_gemm_key(s)) for s in plan.steps
                                            if isinstance(s, GemmCall))
        fresh = routine.fresh or key not in self._seen
        self._seen.add(key)
        device = self._device

        def run(*bufs: Any) -> None:
            with device:
                routine(*bufs)

        run.routine = routine  # type: ignore[attr-defined]
        return run, fresh

    def synchronize(self) -> None:
        """Wait for every launched kernel (for timings; reads synchronise by themselves)."""
        self._device.synchronize()


def _gemm_key(s: GemmCall) -> tuple:
    g = s.gemm
    return (g.rows, g.cols, g.inner, g.a.transposed, g.b.transposed, s.beta,
            g.a.node.prec.value, g.b.node.prec.value, g.assign.lhs.prec.value)
