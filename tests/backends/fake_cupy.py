"""The one stand-in for ``cupy`` in the tests: NumPy arrays as device memory, and the kernel
emulator (:mod:`cuda_emu`) as the GPU, so the real backend (``Context.cuda()``, i.e.
:class:`~ocannl.backends.cuda.runtime.CupyCudaBackend`) runs on a machine without one.

It offers what the backend uses, with CuPy's signatures: ``cuda.runtime.getDeviceCount``,
``cuda.Device`` (a context manager making a device current), ``cuda.Stream`` (a context
manager making it current; ``begin_capture`` / ``end_capture`` returning a :class:`Graph`
whose ``launch`` replays what was recorded, in order), ``zeros`` / ``empty``, ``ndarray.set``
/ ``get``, ``RawModule`` (``compile``, ``get_function``) and its kernels' launches, and the
low-level cuBLAS of ``cupy_backends.cuda.libs.cublas`` (``create``, ``setStream``,
``setPointerMode``, ``setMathMode``, ``gemmEx``, ``gemmStridedBatchedEx``, the GEMMs setting the
handle's stream to the current one and refusing to while it is captured, as CuPy does), and, as
``c_library``, cuBLAS's own ``cublasGemmEx``, ``cublasGemmStridedBatchedEx`` and
``cublasSetWorkspace_v2``, which the backend reaches through ``ctypes``.

Its checks are strict where CuPy would misbehave silently or fail only on a GPU: ``set`` takes
only an array of the buffer's dtype and shape; launch shapes are tuples; every kernel argument
is a device array of the *current* device, the device the module was compiled on; two kernels
of a module never share a name. GEMMs take raw device pointers as cuBLAS does: each matrix
must lie inside one allocation of the data type named (16-bit operands as ``CUDA_R_16F`` /
``CUDA_R_16BF`` bit patterns into a ``CUDA_R_32F`` result with ``CUBLAS_COMPUTE_32F``), every
leading dimension must be at least the stored rows, and the product is computed in float32 (or
float64) from the exactly widened values, so a wrong type, leading dimension or transposition
fails or gives other values. During a capture it refuses, as CUDA does, an allocation, a
synchronizing call (``get``, a stream's or device's ``synchronize``), a launch on another
stream, and a GEMM on a handle with no workspace set (cuBLAS would allocate one);
``capture_failures`` makes ``end_capture`` fail on demand.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
from cuda_emu import build_module

_current = [0]  # the current device, as a stack (cuda.Device is a context manager)
launches: list[tuple[str, int, int]] = []  # (function name, grid, block) of every kernel run
# What the host submitted, in order: ("kernel", name), ("gemm", function name), ("graph", id),
# ("copy", "h2d"): a graph's launch is one entry however many steps it replays.
submissions: list[tuple[str, str]] = []
gemms: list[dict[str, Any]] = []  # the arguments of every GEMM run, captured or not
capture_failures: list[str] = []  # reasons the next end_captures fail with, one each


class CUDARuntimeError(RuntimeError):
    """As ``cupy_backends.cuda.api.runtime.CUDARuntimeError``."""


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
        _refuse_during_capture("ndarray.set from pageable host memory")
        submissions.append(("copy", "h2d"))
        copied.append(stream)
        np.copyto(self.view(np.ndarray), arr)

    def get(self, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> np.ndarray:
        _refuse_during_capture("ndarray.get (a synchronizing copy)")
        return np.array(self.view(np.ndarray), copy=True)

    @property
    def data(self) -> Any:  # cupy.cuda.MemoryPointer's ``ptr``
        return types.SimpleNamespace(ptr=self.ctypes.data)


copied: list[Any] = []  # the stream argument of every ``set``


def _device_array(arr: np.ndarray) -> FakeArray:
    _refuse_during_capture("an allocation (cudaMalloc)")
    out = arr.view(FakeArray)
    out.device_id = current_device()
    _allocations.append(out)
    return out


_allocations: list[FakeArray] = []  # every buffer allocated, for GEMMs' raw pointers


def _allocation_of(ptr: int) -> FakeArray:
    for a in _allocations:
        base = a.ctypes.data
        if base <= ptr < base + a.nbytes:
            return a
    raise AssertionError(f"pointer {ptr:#x} is in no device allocation")


# --- streams, capture and graphs -------------------------------------------------------------

_streams: dict[int, Stream] = {}
_current_stream: list[Stream | None] = []  # ``with stream:`` stack; empty: the legacy stream
_ptrs = itertools.count(0x1000)


def _capturing() -> Stream | None:
    return next((s for s in _streams.values() if s._capture is not None), None)


def _refuse_during_capture(what: str) -> None:
    s = _capturing()
    if s is not None:
        s._invalid = what
        raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} during stream "
                               f"capture")


def current_stream() -> Stream | None:
    """The stream work is submitted to now (None: the legacy default stream)."""
    return _current_stream[-1] if _current_stream else None


submitted: dict[int | None, int] = {}  # per stream's ptr (None: legacy), the work run there
# called with (the waiting stream's ptr, the event) at every wait_event (tests/fake_nccl.py)
wait_hooks: list[Any] = []


def _count(stream: Stream | None) -> None:
    key = None if stream is None else stream.ptr
    submitted[key] = submitted.get(key, 0) + 1


def _submit(stream: Stream | None, kind: str, name: str, run: Any) -> None:
    """Run ``run`` now on ``stream``, or record it there when the stream is capturing; work
    for any other stream while one captures is refused (the legacy stream's implicit
    synchronisation, or work escaping the graph)."""
    s = _capturing()
    if s is not None:
        if stream is not s:
            s._invalid = f"{kind} {name} on another stream"
            raise CUDARuntimeError(f"cudaErrorStreamCaptureImplicit: {kind} {name} on "
                                   f"{'the legacy stream' if stream is None else 'a stream'} "
                                   f"not being captured while a capture is under way")
        assert s._capture is not None
        s._capture.append((kind, name, run))
        return
    submissions.append((kind, name))
    _count(stream)
    run()


class Graph:
    """``cupy.cuda.graph.Graph``: the recorded steps, replayed in order by ``launch``."""

    _ids = itertools.count()

    def __init__(self, steps: list[tuple[str, str, Any]]) -> None:
        self.steps = tuple(steps)
        self.id = next(Graph._ids)
        self.launches = 0

    def launch(self, stream: Stream | None = None) -> None:
        stream = current_stream() if stream is None else stream
        _refuse_during_capture("a graph launch")
        submissions.append(("graph", str(self.id)))
        _count(stream)
        self.launches += 1
        for _, _, run in self.steps:
            run()


class Stream:
    """``cupy.cuda.Stream``: a context manager making it current; capture records the work
    submitted to it instead of running it."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 priority: int | None = None) -> None:
        assert not null and not ptds, "the backend makes a stream of its own"
        self.ptr = next(_ptrs)
        self.non_blocking = non_blocking
        self.device_id = current_device()
        self._capture: list[tuple[str, str, Any]] | None = None
        self._invalid = ""
        # what it has waited for (wait_event): per stream, how many of its submissions
        self.waited: dict[int | None, int] = {}
        _streams[self.ptr] = self

    def wait_event(self, event: Any) -> None:
        """Later work here follows what ``event`` covers (an event records, per stream, the
        submissions made there before it)."""
        _refuse_during_capture("Stream.wait_event on an event of outside the capture")
        for ptr, n in event.covers.items():
            self.waited[ptr] = max(self.waited.get(ptr, 0), n)
        for hook in wait_hooks:
            hook(self.ptr, event)

    def __enter__(self) -> Stream:
        _current_stream.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _current_stream.pop()

    def begin_capture(self, mode: int | None = None) -> None:
        if _capturing() is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: a capture is already under way")
        self._capture, self._invalid = [], ""
        self.capture_mode = mode

    def is_capturing(self) -> bool:
        return self._capture is not None

    def end_capture(self) -> Graph:
        if self._capture is None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is not capturing")
        steps, self._capture = self._capture, None
        if self._invalid:
            raise CUDARuntimeError(f"cudaErrorStreamCaptureInvalidated: {self._invalid}")
        if capture_failures:
            raise CUDARuntimeError(capture_failures.pop(0))
        return Graph(steps)

    def synchronize(self) -> None:
        _refuse_during_capture("Stream.synchronize")


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
        views = tuple(a.view(np.ndarray) for a in args)

        def run() -> None:
            launches.append((self.name, grid[0], block[0]))
            self._run(grid[0], block[0], views)

        _submit(current_stream(), "kernel", self.name, run)


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


# --- cuBLAS (cupy_backends.cuda.libs.cublas): raw pointers, as the library takes them -----------

# The values of CUDA's library_types.h and cublas_api.h.
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
_CUDA_DTYPE = {CUDA_R_32F: np.dtype(np.float32), CUDA_R_64F: np.dtype(np.float64),
               CUDA_R_16F: np.dtype(np.float16), CUDA_R_16BF: np.dtype(np.uint16)}
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_COMPUTE_64F = 68, 77, 70
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_DEFAULT_MATH = 0
# (A and B type, C type) -> the compute types cuBLAS takes for them in gemmEx.
_COMBINATIONS = {
    (CUDA_R_16F, CUDA_R_32F): {CUBLAS_COMPUTE_32F},
    (CUDA_R_16BF, CUDA_R_32F): {CUBLAS_COMPUTE_32F},
    (CUDA_R_32F, CUDA_R_32F): {CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32},
    (CUDA_R_64F, CUDA_R_64F): {CUBLAS_COMPUTE_64F},
}

_handles: dict[int, dict[str, Any]] = {}


def _create() -> int:
    _refuse_during_capture("cublasCreate")
    h = next(_ptrs)
    _handles[h] = {"stream": 0, "workspace": None, "device": current_device(),
                   "pointer_mode": CUBLAS_POINTER_MODE_HOST, "math_mode": CUBLAS_DEFAULT_MATH}
    return h


def _handle(h: int) -> dict[str, Any]:
    assert h in _handles, f"{h!r} is no cuBLAS handle"
    return _handles[h]


def _set_stream(h: int, stream: int) -> None:
    assert stream == 0 or stream in _streams, f"{stream:#x} is no stream"
    _handle(h)["stream"] = stream


def _set_workspace(h: int, ptr: int, size: int) -> None:
    a = _allocation_of(ptr)
    assert ptr + size <= a.ctypes.data + a.nbytes, "the workspace overruns its allocation"
    _handle(h)["workspace"] = (ptr, size)


def _set_pointer_mode(h: int, mode: int) -> None:
    assert mode == CUBLAS_POINTER_MODE_HOST, "the stand-in reads alpha and beta from the host"
    _handle(h)["pointer_mode"] = mode


def _set_math_mode(h: int, mode: int) -> None:
    _handle(h)["math_mode"] = mode


def _column_major(ptr: int, ctype: int, rows: int, cols: int, ld: int, what: str) -> np.ndarray:
    """The ``rows x cols`` column-major matrix at ``ptr`` (columns ``ld`` apart), as a view of
    the one allocation it must lie in, of the data type named."""
    assert ctype in _CUDA_DTYPE, f"{what}: data type {ctype} is not one the stand-in knows"
    assert ld >= max(1, rows), f"{what}: leading dimension {ld} < {rows} rows"
    a = _allocation_of(ptr)
    dt = _CUDA_DTYPE[ctype]
    assert a.dtype == dt, f"{what}: data type {dt} given for a {a.dtype} allocation"
    off, rem = divmod(ptr - a.ctypes.data, dt.itemsize)
    assert rem == 0, f"{what}: a pointer not aligned to its {dt} elements"
    last = off + (cols - 1) * ld + rows - 1
    assert last < a.size, f"{what}: the matrix ends at element {last} of {a.size}"
    flat = a.view(np.ndarray)
    return np.lib.stride_tricks.as_strided(flat[off:], shape=(rows, cols),
                                           strides=(dt.itemsize, ld * dt.itemsize))


def _widened(m: np.ndarray, ctype: int, compute: int) -> np.ndarray:
    if ctype == CUDA_R_16BF:
        return (m.astype(np.uint32) << 16).view(np.float32)
    if compute == CUBLAS_COMPUTE_64F:
        return m.astype(np.float64)
    out = m.astype(np.float32)
    if compute == CUBLAS_COMPUTE_32F_FAST_TF32:  # inputs rounded to 10 mantissa bits
        u = out.view(np.uint32)
        out = ((u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return out


def _gemm(name: str, handle: int, transa: int, transb: int, m: int, n: int, k: int,
          alpha: int, A: int, Atype: int, lda: int, sA: int, B: int, Btype: int, ldb: int,
          sB: int, beta: int, C: int, Ctype: int, ldc: int, sC: int, count: int,
          compute: int, algo: int) -> None:
    h = _handle(handle)
    assert h["device"] == current_device(), f"{name}: a handle of another device"
    assert Atype == Btype and compute in _COMBINATIONS.get((Atype, Ctype), set()), (
        f"{name}: A {Atype}, B {Btype}, C {Ctype} with compute type {compute} is not a "
        f"combination cuBLAS takes")
    assert transa in (CUBLAS_OP_N, CUBLAS_OP_T) and transb in (CUBLAS_OP_N, CUBLAS_OP_T)
    assert min(m, n, k, count) >= 1 and algo == CUBLAS_GEMM_DEFAULT
    scale = ctypes.c_double if compute == CUBLAS_COMPUTE_64F else ctypes.c_float
    a_val, b_val = scale.from_address(alpha).value, scale.from_address(beta).value
    stream = _streams.get(h["stream"]) if h["stream"] else None
    cap = _capturing()
    if cap is not None and h["workspace"] is None:
        cap._invalid = f"{name} with no workspace set"
        raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {name} on a handle with no "
                               f"workspace set allocates one during capture")
    item = _CUDA_DTYPE[Ctype].itemsize
    ops = []
    for j in range(count):  # every matrix checked now, read when run
        ar, ac = (m, k) if transa == CUBLAS_OP_N else (k, m)
        br, bc = (k, n) if transb == CUBLAS_OP_N else (n, k)
        ops.append((_column_major(A + j * sA * _CUDA_DTYPE[Atype].itemsize, Atype, ar, ac, lda,
                                  f"{name} A"),
                    _column_major(B + j * sB * _CUDA_DTYPE[Btype].itemsize, Btype, br, bc, ldb,
                                  f"{name} B"),
                    _column_major(C + j * sC * item, Ctype, m, n, ldc, f"{name} C")))
    gemms.append(dict(name=name, transa=transa, transb=transb, m=m, n=n, k=k, lda=lda,
                      ldb=ldb, ldc=ldc, Atype=Atype, Ctype=Ctype, compute=compute, count=count,
                      alpha=a_val, beta=b_val))

    def run() -> None:
        with np.errstate(invalid="ignore", over="ignore"):
            for a, b, c in ops:
                x = _widened(a, Atype, compute)
                y = _widened(b, Btype, compute)
                x = x if transa == CUBLAS_OP_N else x.T
                y = y if transb == CUBLAS_OP_N else y.T
                res = a_val * np.matmul(x, y)
                # beta == 0 never reads C, as cuBLAS
                c[...] = res if b_val == 0.0 else res + b_val * c

    _submit(stream, "gemm", name, run)


def _gemm_ex(handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, A: int,
             Atype: int, lda: int, B: int, Btype: int, ldb: int, beta: int, C: int, Ctype: int,
             ldc: int, computeType: int, algo: int) -> int:
    _gemm("gemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0,
          beta, C, Ctype, ldc, 0, 1, computeType, algo)
    return 0


def _gemm_strided_batched_ex(handle: int, transa: int, transb: int, m: int, n: int, k: int,
                             alpha: int, A: int, Atype: int, lda: int, strideA: int, B: int,
                             Btype: int, ldb: int, strideB: int, beta: int, C: int, Ctype: int,
                             ldc: int, strideC: int, batchCount: int, computeType: int,
                             algo: int) -> int:
    _gemm("gemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda,
          strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount,
          computeType, algo)
    return 0


def _c_set_workspace(handle: Any, ptr: Any, size: Any) -> int:
    _set_workspace(handle.value, ptr.value, size.value)
    return 0


def _cupy_binding(c_function: Any) -> Any:
    """A GEMM as CuPy's binding calls it: the handle's stream set to the current one first,
    which CuPy refuses while that stream is captured (its own message)."""

    def binding(handle: int, *args: Any) -> None:
        s = current_stream()
        if s is not None and s._capture is not None:
            raise NotImplementedError("calling cuBLAS API during stream capture is currently "
                                      "unsupported")
        _set_stream(handle, 0 if s is None else s.ptr)
        c_function(handle, *args)
    return binding


def _cublas_module() -> types.ModuleType:
    mod = types.ModuleType("cupy_backends.cuda.libs.cublas")
    for name in ("CUBLAS_OP_N", "CUBLAS_OP_T", "CUBLAS_COMPUTE_32F",
                 "CUBLAS_COMPUTE_32F_FAST_TF32", "CUBLAS_COMPUTE_64F", "CUBLAS_GEMM_DEFAULT",
                 "CUBLAS_POINTER_MODE_HOST", "CUBLAS_DEFAULT_MATH"):
        setattr(mod, name, globals()[name])
    mod.create = _create
    mod.setStream = _set_stream
    mod.setPointerMode = _set_pointer_mode
    mod.setMathMode = _set_math_mode
    mod.gemmEx = _cupy_binding(_gemm_ex)
    mod.gemmStridedBatchedEx = _cupy_binding(_gemm_strided_batched_ex)
    # cuBLAS's own C functions, which the backend reaches through ctypes in the library CuPy
    # loaded (statuses returned, the stream the handle was given)
    mod.c_library = types.SimpleNamespace(cublasGemmEx=_gemm_ex,
                                          cublasGemmStridedBatchedEx=_gemm_strided_batched_ex,
                                          cublasSetWorkspace_v2=_c_set_workspace)
    return mod

class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device

    def __enter__(self) -> Device:
        _current.append(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        _current.pop()

    def synchronize(self) -> None:
        _refuse_during_capture("Device.synchronize")


def _empty(n: int, dtype: Any = float) -> FakeArray:
    # NaN-filled floats: a kernel reading scratch nobody wrote shows up.
    dt = np.dtype(dtype)
    return _device_array(np.full(n, np.nan, dt) if dt.kind == "f" else np.zeros(n, dt))


def install(monkeypatch: Any, *, devices: int = 1, cublas: bool = True) -> types.ModuleType:
    """Put the fake ``cupy`` into ``sys.modules`` for the test's duration, with ``devices``
    devices and, unless ``cublas`` is False, ``cupy_backends.cuda.libs.cublas``; empties the
    backend's module cache so that every compile of the test is seen, and forgets every
    stream, handle, allocation and recorded launch of earlier tests."""
    cp = types.ModuleType("cupy")
    cp.RawModule = RawModule
    cp.zeros = lambda n, dtype=float: _device_array(np.zeros(n, dtype))
    cp.empty = _empty
    runtime = types.SimpleNamespace(getDeviceCount=lambda: devices, streamCaptureModeGlobal=0,
                                    streamCaptureModeThreadLocal=1, streamCaptureModeRelaxed=2,
                                    CUDARuntimeError=CUDARuntimeError)
    cp.cuda = types.SimpleNamespace(runtime=runtime, Device=Device, Stream=Stream, Graph=Graph)
    RawModule.compiles = 0
    for state in (launches, submissions, gemms, capture_failures, copied, _allocations,
                  _current_stream, submitted):
        state.clear()
    _streams.clear()
    _handles.clear()
    _current[:] = [0]
    monkeypatch.setitem(sys.modules, "cupy", cp)
    name = "cupy_backends.cuda.libs.cublas"
    if cublas:
        monkeypatch.setitem(sys.modules, name, _cublas_module())
    else:  # as CuPy 14 without the cuBLAS wheel: importing it fails
        monkeypatch.setitem(sys.modules, name, None)
    from ocannl.backends.cuda.runtime import CupyCudaBackend

    monkeypatch.setattr(CupyCudaBackend, "_modules", {})
    monkeypatch.setattr(CupyCudaBackend, "_seen", set())
    return cp
