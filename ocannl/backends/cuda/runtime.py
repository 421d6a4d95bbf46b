"""Running CUDA launch plans through CuPy: buffers, one NVRTC module per routine, cuBLAS GEMMs,
one CUDA graph launch per routine call.

CuPy is imported only when a backend is created, so this module, :mod:`.plan` and the NVRTC
checks (:mod:`.nvrtc`) work on a machine with no GPU.

**Compile, bind, run.** :meth:`CupyCudaBackend.compile` turns lowered code into a launch plan
(:func:`~ocannl.backends.cuda.plan.plan_routine`) and compiles the plan's distinct kernels as
*one* ``cupy.RawModule`` (one NVRTC program per routine, each kernel renamed apart by
:func:`module_source`), cached per (device, options, module source) for the process.
:meth:`CupyCudaBackend.bind` then builds, once, a launch closure per step over the routine's
buffers and its own scratch buffers (:class:`BoundRoutine`). Everything runs on the backend's
own stream: the first call captures the closures as a CUDA graph there, and every call is one
``graph.launch`` (``OCANNL_CUDA_GRAPHS=0``: the closures one by one; a capture that fails
falls back to that, saying so once). Launches are asynchronous; reads synchronise. Products
are ``gemmEx`` / ``gemmStridedBatchedEx`` calls on a cuBLAS handle of the backend's with its
own workspace (:class:`Blas`), 16-bit operands as stored into f32 results; TF32 only with
``OCANNL_CUDA_TF32=1``.

**Storage.** The backend owns its storage dtypes: f64 / f32 / f16 buffers are CuPy arrays of
those dtypes, bf16 buffers are ``uint16`` bit patterns (the kernels read both 16-bit kinds
through ``__half`` / ``__nv_bfloat16`` pointers). ``write`` rounds the host values once, from
the values given, into the storage dtype (:func:`ocannl.backends.rounding.to_precision`: a
plain ``astype(bfloat16)`` of f64 rounds twice, through f32) and copies them into the buffer in
place, so a bound routine's pointers never change; ``read`` copies the storage out as the
node's host dtype.

**Floating point on the GPU, against the CPU backend:**

- *Flush to zero.* CuPy appends ``-ftz=true`` to every NVRTC compile, after the caller's
  options, so it cannot be undone from here: f32 arithmetic flushes subnormal operands and
  results (magnitude below 2**-126, about 1.2e-38) to a zero of the same sign. That covers
  the f32 arithmetic on widened f16 / bf16 values: f16 subnormals (2**-24 to 2**-14) are normal
  once widened to f32 and survive, but bf16 subnormals (f32's exponent range) become 0 as soon
  as they take part in a sum or product. f64 arithmetic is not affected. Loads, stores and the
  16-bit conversion intrinsics move subnormals unchanged, so a copy or a cast keeps them. The
  CPU backend keeps subnormals (gradual underflow): values passing through that range
  differ, e.g. the smallest gradients of a bf16 model.
- *FMA contraction.* NVRTC contracts ``a * b + c`` into one fused multiply-add (``--fmad=true``
  is its default): one rounding instead of two, so such results differ from the CPU's (its
  LLVM code never contracts) by about an ulp of the terms, not of the result, where
  ``a * b`` and ``c`` cancel. cuBLAS uses FMA whatever the option says, and block reductions
  sum in another order than the CPU's loops, so the GPU never reproduces the CPU's bits for
  sums; results are compared with an f64 reference and a tolerance scaled by the magnitude of
  the summed terms. **Default: contraction on** (at least as accurate per operation, and what
  cuBLAS does anyway). ``CupyCudaBackend(fmad=False)``, or ``OCANNL_CUDA_FMAD=0`` in the
  environment for ``Context.cuda()``, compiles with ``--fmad=false``: every product rounds
  before it is added, as on the CPU, which brings elementwise kernels closer to the CPU's bits
  (transcendental functions still come from libdevice, not glibc). Its cost is **unmeasured**:
  no GPU has run this code yet; expected small for these memory-bound kernels.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import re
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import ml_dtypes
import numpy as np

from ocannl.backends.cuda.plan import GemmCall, Kernel, Plan, cuda_target, plan_routine
from ocannl.backends.rounding import to_precision
from ocannl.errors import require_bool
from ocannl.ir.lowering import Gemm, Lowered, batch_offsets
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import Tnode


class CudaUnavailable(RuntimeError):
    """No GPU is usable through CuPy; the message says why (no CuPy, no driver, no device)."""


# --- which CuPy, for which CUDA ------------------------------------------------------------------

# CuPy's wheels by CUDA major, and the wheels of the libraries the backend needs beside CuPy.
CUPY_WHEELS = {12: "cupy-cuda12x", 13: "cupy-cuda13x"}
CUDA_WHEELS = {12: {"headers": "nvidia-cuda-runtime-cu12", "cublas": "nvidia-cublas-cu12"},
               13: {"headers": "nvidia-cuda-runtime==13.*", "cublas": "nvidia-cublas==13.*"}}


@functools.cache
def cupy_distributions() -> dict[str, str]:
    """The installed CuPy wheels (``cupy-cuda12x``, ``cupy-cuda13x``, ...): name -> version."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "cupy" or name.startswith("cupy-cuda") or name.startswith("cupy-rocm"):
            out[name] = dist.version
    return dict(sorted(out.items()))


def _install_hint() -> str:
    return "pip install " + " or ".join(
        f"{w} (CUDA {m} driver)" for m, w in CUPY_WHEELS.items()) + "; nvidia-smi shows the " \
        "driver's CUDA version"


def cupy_cuda_major(cupy: Any) -> int | None:
    """The CUDA major CuPy was built for (its runtime's version), None when it cannot say."""
    try:
        return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - a stand-in or a broken install: unknown
        return None


def cupy_nvrtc_major(cupy: Any) -> int | None:
    """The major of the NVRTC CuPy compiles with (cuda-pathfinder may find another major's
    wheel first), None when it cannot say."""
    try:
        return int(cupy.cuda.nvrtc.getVersion()[0])
    except Exception:  # noqa: BLE001 - a stand-in, or no NVRTC: unknown
        return None


def describe_cupy(cupy: Any) -> str:
    """CuPy's version, wheel and CUDA major, e.g. ``CuPy 14.2.0 (cupy-cuda13x, CUDA 13)``."""
    major = cupy_cuda_major(cupy)
    wheels = ", ".join(cupy_distributions()) or "no CuPy wheel recorded"
    return (f"CuPy {getattr(cupy, '__version__', '?')} ({wheels}, "
            f"{'CUDA ' + str(major) if major else 'CUDA major unknown'})")


def cuda_unavailable_reason(device_id: int = 0) -> str | None:
    """None when ``Context.cuda(device_id)`` can work here, else why it cannot.

    Both ``cupy-cuda12x`` and ``cupy-cuda13x`` work; the one installed is used. Two CuPy wheels
    installed at once are refused: they write the same ``cupy`` package, so what imports is a
    mix of whichever pip wrote last.
    """
    wheels = cupy_distributions()
    if len(wheels) > 1:
        listed = " and ".join(f"{n} {v}" for n, v in wheels.items())
        return (f"{listed} are both installed; they share the cupy package, so which one "
                f"imports is not defined: pip uninstall all but the one for this machine's "
                f"CUDA driver")
    try:
        import cupy
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken CUDA install under it
        which = f" ({', '.join(wheels)} is installed)" if wheels else ""
        return f"CuPy is not installed or fails to import{which} ({err}); {_install_hint()}"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # noqa: BLE001 - CUDARuntimeError, or a driver library missing
        text = str(err)
        if "NoDevice" in text or "no CUDA-capable device" in text:
            return f"no CUDA device is visible ({text})"
        return f"no usable NVIDIA driver for {describe_cupy(cupy)} ({text})"
    if count == 0:
        return "no CUDA device is visible (the driver reports 0 devices)"
    if not 0 <= device_id < count:
        return f"device_id {device_id} is out of range: {count} CUDA device(s) visible"
    return None


# --- storage -------------------------------------------------------------------------------------

_STORAGE = {Precision.f64: np.dtype(np.float64), Precision.f32: np.dtype(np.float32),
            Precision.f16: np.dtype(np.float16), Precision.bf16: np.dtype(np.uint16)}


def storage_dtype(prec: Precision) -> np.dtype:
    """The dtype of a CUDA buffer of ``prec``: itself, except bf16 as ``uint16`` bit patterns
    (CuPy has no bfloat16)."""
    return _STORAGE[prec]


def to_storage(node: Tnode, host: np.ndarray) -> np.ndarray:
    """Flat host values as a contiguous array of the node's CUDA storage dtype, each rounded
    once from the value given (values already of the node's host dtype are copied bit for
    bit, NaN payloads included)."""
    host = np.asarray(host).reshape(-1)
    if host.dtype == node.prec.numpy_dtype:
        values = host
    else:
        values = to_precision(host, node.prec)
    if node.prec is Precision.bf16:
        values = values.view(np.uint16)
    return np.ascontiguousarray(values)


def from_storage(node: Tnode, stored: np.ndarray) -> np.ndarray:
    """A host copy of a CUDA buffer's contents as the node's host dtype (no copy of its own)."""
    return stored.view(ml_dtypes.bfloat16) if node.prec is Precision.bf16 else stored


# --- one module per routine ----------------------------------------------------------------------

_INCLUDE_LINE = re.compile(r"^#include\s*<[^>]+>\s*$", re.M)


def module_source(plan: Plan) -> tuple[str, dict[str, str]]:
    """One CUDA translation unit holding every distinct kernel of ``plan``, and the function
    name of each kernel source in it.

    Kernels keep their names but get their position appended (``ocannl_map`` becomes
    ``ocannl_map_3``): names must be unique within a module, and a plan repeats them. The
    ``#include`` lines of all kernels go once at the top. Pure: needs no GPU.
    """
    includes: dict[str, None] = {}
    bodies: list[str] = []
    names: dict[str, str] = {}
    for k in plan.kernels:
        if k.source in names:
            continue
        name = f"{k.name}_{len(names)}"
        for line in _INCLUDE_LINE.findall(k.source):
            includes[line.strip()] = None
        body = _INCLUDE_LINE.sub("", k.source).strip("\n")
        body, n = re.subn(rf"\b{re.escape(k.name)}\(", f"{name}(", body, count=1)
        if n != 1:
            raise ValueError(f"kernel {k.name}: no function of that name in its source:\n"
                             f"{k.source}")
        names[k.source] = name
        bodies.append(body)
    source = "\n".join(includes) + ("\n\n" if includes else "") + "\n\n".join(bodies) + "\n"
    return source, names


def _switch(name: str, default: bool) -> bool:
    """An on/off environment switch: ``0`` or ``1`` (unset or empty: ``default``); anything else
    is refused, naming the variable and the value."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value in ("0", "1"):
        return value == "1"
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def _fmad_from_env() -> bool:
    value = os.environ.get("OCANNL_CUDA_FMAD", "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"OCANNL_CUDA_FMAD must be 0 or 1 (or true / false), got {value!r}")


# --- products through cuBLAS ---------------------------------------------------------------------

# CUDA's data types (library_types.h): the storage of each precision as cuBLAS reads it.
CUDA_R_32F, CUDA_R_64F, CUDA_R_16F, CUDA_R_16BF = 0, 1, 2, 14
_CUDA_TYPE = {Precision.f32: CUDA_R_32F, Precision.f64: CUDA_R_64F, Precision.f16: CUDA_R_16F,
              Precision.bf16: CUDA_R_16BF}
WORKSPACE_BYTES = 32 << 20  # cuBLAS's advice for Hopper (4 MiB suffices before it)


class Blas:
    """One cuBLAS handle of a backend, on the backend's stream, with a workspace of its own:
    cuBLAS then allocates nothing while a routine is captured as a graph. Products use
    ``gemmEx`` / ``gemmStridedBatchedEx``: 16-bit operands as stored (``CUDA_R_16F`` /
    ``CUDA_R_16BF``) into an f32 result with ``CUBLAS_COMPUTE_32F`` (tensor cores, f32
    accumulation), f32 with ``CUBLAS_COMPUTE_32F`` (``CUBLAS_COMPUTE_32F_FAST_TF32`` where
    scheduling allowed it: ``Gemm.tf32``), f64 with ``CUBLAS_COMPUTE_64F``."""

    def __init__(self, backend: CupyCudaBackend, lib: Any) -> None:
        self.lib = lib
        with backend.device:
            self.handle = lib.create()
            lib.setStream(self.handle, backend.stream.ptr)
            lib.setPointerMode(self.handle, lib.CUBLAS_POINTER_MODE_HOST)
            lib.setMathMode(self.handle, lib.CUBLAS_DEFAULT_MATH)
            self.workspace = backend.cp.empty(WORKSPACE_BYTES, dtype=np.uint8)
            self.workspace_set = _set_workspace(lib, self.handle, self.workspace.data.ptr,
                                                WORKSPACE_BYTES, backend.cuda_major)
        self.gemm, self.gemm_strided = _gemm_entries(lib, backend.cuda_major)
        # alpha and beta, read from the host (when captured: at capture time)
        self.scalars = {p: (np.ones(1, p.numpy_dtype), np.zeros(1, p.numpy_dtype))
                        for p in (Precision.f32, Precision.f64)}

    def compute_type(self, result: Precision, tf32: bool) -> int:
        lib = self.lib
        if result is Precision.f64:
            return lib.CUBLAS_COMPUTE_64F
        if tf32:
            return lib.CUBLAS_COMPUTE_32F_FAST_TF32
        return lib.CUBLAS_COMPUTE_32F

    def calls(self, g: Gemm, beta: float, a: Any, b: Any, out: Any) -> list[Callable[[], None]]:
        """The calls computing ``g`` over device buffers ``a``, ``b`` and ``out`` (its views'
        nodes'): C = A @ B row-major is C^T = B^T A^T column-major, so cuBLAS's first operand
        is ``b``. One strided-batched call per point of the outer batch axes that do not fold
        into one stride (``Gemm.strided``, scheduling's)."""
        lib = self.lib
        res = g.assign.lhs.prec
        ops = g.a.node.prec
        one, zero = self.scalars[res]
        if beta not in (0.0, 1.0):
            raise ValueError(f"a product's beta is 0 (it sets) or 1 (it accumulates), not {beta}")
        alpha = one.ctypes.data
        beta_ptr = (zero if beta == 0.0 else one).ctypes.data
        ta = lib.CUBLAS_OP_T if g.b.transposed else lib.CUBLAS_OP_N
        tb = lib.CUBLAS_OP_T if g.a.transposed else lib.CUBLAS_OP_N
        at, ct = _CUDA_TYPE[ops], _CUDA_TYPE[res]
        compute = self.compute_type(res, g.tf32)
        isz, osz = ops.itemsize, res.itemsize
        pa, pb, pc = a.data.ptr, b.data.ptr, out.data.ptr
        outer, run = g.strided
        m, n, k = g.cols, g.rows, g.inner
        h = self.handle
        algo = lib.CUBLAS_GEMM_DEFAULT
        if run is None:
            return [partial(self.gemm, h, ta, tb, m, n, k, alpha, pb, at, g.b.ld, pa, at,
                            g.a.ld, beta_ptr, pc, ct, g.out_ld, compute, algo)]
        return [partial(self.gemm_strided, h, ta, tb, m, n, k, alpha,
                        pb + ob * isz, at, g.b.ld, run.b, pa + oa * isz, at, g.a.ld, run.a,
                        beta_ptr, pc + oo * osz, ct, g.out_ld, run.out, run.size, compute, algo)
                for oo, oa, ob in batch_offsets(outer)]


def _loaded_cublas(lib: Any, major: int | None) -> Any:
    """cuBLAS's own library, the copy CuPy loaded (``RTLD_NOLOAD``: never a second copy, whose
    functions would not know CuPy's handles); a library module may carry a stand-in for it
    (``lib.c_library``, the tests'). Raises ``OSError`` where it is not loaded."""
    own = getattr(lib, "c_library", None)
    if own is not None:
        return own
    return ctypes.CDLL(f"libcublas.so.{major or 12}", mode=os.RTLD_NOLOAD)


def _set_workspace(lib: Any, handle: int, ptr: int, size: int, major: int | None) -> bool:
    """Give the handle its workspace (``cublasSetWorkspace``): CuPy's cuBLAS module has no
    binding for it, so it is called in the cuBLAS library CuPy loaded, through ``ctypes``.
    False, warned, where that fails: captures may then fail, and the routines run eagerly,
    saying so."""
    try:
        status = _loaded_cublas(lib, major).cublasSetWorkspace_v2(
            ctypes.c_void_p(handle), ctypes.c_void_p(ptr), ctypes.c_size_t(size))
        if status != 0:
            raise RuntimeError(f"cublasSetWorkspace_v2 returned status {status}")
    except Exception as err:  # noqa: BLE001 - any failure: carry on without, saying so
        warnings.warn(f"ocannl: cannot give cuBLAS a workspace ({err}); products may not be "
                      f"captured in CUDA graphs", RuntimeWarning, stacklevel=4)
        return False
    return True


# cuBLAS's statuses (cublas_api.h), for its errors' messages.
CUBLAS_STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE",
                 8: "ARCH_MISMATCH", 11: "MAPPING_ERROR", 13: "EXECUTION_FAILED",
                 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED", 16: "LICENSE_ERROR"}
_I, _P, _L = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
# handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
# computeType, algo (the strided form adds each matrix's stride after its leading dimension
# and the batch count before computeType)
_GEMM_EX = (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I)
_GEMM_STRIDED_EX = (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _L, _P, _I, _I, _L, _P, _P, _I, _I,
                    _L, _I, _I, _I)


def _c_call(so: Any, name: str, argtypes: tuple[Any, ...]) -> Callable[..., None]:
    fn = getattr(so, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def call(*args: Any) -> None:
        status = fn(*args)
        if status != 0:
            raise RuntimeError(f"{name} returned CUBLAS_STATUS_"
                               f"{CUBLAS_STATUS.get(status, str(status))}")
    return call


def _gemm_entries(lib: Any, major: int | None) -> tuple[Callable[..., None], Callable[..., None]]:
    """``gemmEx`` and ``gemmStridedBatchedEx`` as cuBLAS's own C functions, on the stream the
    handle was given: CuPy's bindings set the handle's stream to the current one at every
    call, and refuse to while a stream is captured, so no routine with a product could be one
    graph through them. Where the library is not found, CuPy's bindings, and a routine with a
    product runs its launches one by one, saying so."""
    try:
        so = _loaded_cublas(lib, major)
        return (_c_call(so, "cublasGemmEx", _GEMM_EX),
                _c_call(so, "cublasGemmStridedBatchedEx", _GEMM_STRIDED_EX))
    except (OSError, AttributeError) as err:
        warnings.warn(f"ocannl: cuBLAS's own gemmEx is not reachable ({err}); products go "
                      f"through CuPy's bindings, which CUDA graphs cannot capture",
                      RuntimeWarning, stacklevel=4)
        return lib.gemmEx, lib.gemmStridedBatchedEx


def _gemm_key(s: GemmCall) -> tuple:
    g = s.gemm
    return (g.rows, g.cols, g.inner, g.a.transposed, g.b.transposed, s.beta, g.a.ld, g.b.ld,
            g.out_ld, g.batch, g.a.node.prec.value, g.b.node.prec.value,
            g.assign.lhs.prec.value)


# --- one launch per routine call -----------------------------------------------------------------


class BoundRoutine:
    """A routine over its buffers: every launch built once (:attr:`launches`, kernels and
    cuBLAS calls in plan order), run on the backend's stream.

    With graphs on (``OCANNL_CUDA_GRAPHS``, default 1) the first call captures the launches as
    a CUDA graph on that stream and every call, the first included, is one ``graph.launch``;
    the buffers are all allocated before (bind), so nothing allocates while capturing, and a
    buffer written between calls (``set_values``: an asynchronous copy on the same stream) is
    read by the next replay with no recapture. A failed capture runs that call's launches one
    by one and captures again at the next call (a library's first use may initialise something
    a capture refuses; the eager run did it); where the second capture fails too, the routine
    runs its launches one by one from then on, saying so once (a ``RuntimeWarning`` naming the
    routine and the reason)."""

    CAPTURE_TRIES = 2

    def __init__(self, label: str, backend: CupyCudaBackend, launches: tuple[Callable[[], Any],
                 ...], scratch: list[Any]) -> None:
        self.label = label
        self.launches = launches
        self.scratch = scratch  # alive while the routine is
        self.device = backend.device
        self.stream = backend.stream
        self.capture_mode = backend.capture_mode
        self.graph: Any = None
        self.eager = not backend.graphs or not launches
        self.fallback = ""  # why capture failed, when it did
        self.failures = 0

    def __call__(self) -> None:
        if self.graph is None and not self.eager:
            self._capture()
        graph = self.graph
        if graph is not None:
            with self.device:
                graph.launch(self.stream)
            return
        with self.device, self.stream:
            for launch in self.launches:
                launch()

    def _capture(self) -> None:
        """Record the launches as :attr:`graph` (nothing runs while capturing), or give up."""
        stream = self.stream
        with self.device, stream:
            try:
                stream.begin_capture(self.capture_mode)
            except Exception as err:  # noqa: BLE001 - any refusal: run eagerly, saying so
                self._give_up(err)
                return
            try:
                for launch in self.launches:
                    launch()
            except Exception as err:  # noqa: BLE001
                try:
                    stream.end_capture()
                except Exception:  # noqa: BLE001, S110 - the capture is void already
                    pass
                self._give_up(err)
                return
            try:
                self.graph = stream.end_capture()
            except Exception as err:  # noqa: BLE001
                self._give_up(err)

    def _give_up(self, err: Exception) -> None:
        self.failures += 1
        self.fallback = f"{type(err).__name__}: {err}"
        if self.failures < self.CAPTURE_TRIES:
            return  # this call runs eagerly; the next captures again
        self.eager = True
        warnings.warn(f"ocannl: routine {self.label}: CUDA graph capture failed "
                      f"({self.fallback}); it runs its {len(self.launches)} launches one by one",
                      RuntimeWarning, stacklevel=5)


class CompiledPlan:
    """A routine's plan with its kernels loaded on the device: what ``compile`` returns and
    ``bind`` binds. Shared by every routine of the same code; each binding gets its own
    scratch buffers (split reductions' partial results)."""

    def __init__(self, backend: CupyCudaBackend, plan: Plan, nodes: Sequence[Tnode],
                 functions: dict[str, Any], names: dict[str, str], label: str = "") -> None:
        self.backend = backend
        self.plan = plan
        self.nodes = tuple(nodes)
        self.functions = functions  # kernel source -> loaded function
        self.names = names  # kernel source -> its function name in the module
        self.label = label
        self._pos = {n.id: k for k, n in enumerate(nodes)}

    def bind(self, buffers: tuple[Any, ...]) -> BoundRoutine:
        """The routine over ``buffers`` (in ``nodes`` order): every launch built now."""
        if len(buffers) != len(self.nodes):
            raise ValueError(f"bind: {len(buffers)} buffers for {len(self.nodes)} nodes")
        be = self.backend
        pos = self._pos
        with be.device:
            scratch = [be.cp.empty(s.size, dtype=storage_dtype(s.prec))
                       for s in self.plan.scratch]
        blas = be.blas() if any(isinstance(s, GemmCall) for s in self.plan.steps) else None
        launches: list[Callable[[], Any]] = []
        for step in self.plan.steps:
            if isinstance(step, Kernel):
                args = tuple(buffers[pos[n.id]] for n in step.nodes) + tuple(
                    scratch[s.slot] for s in step.scratch)
                launches.append(partial(self.functions[step.source], (step.grid,),
                                        (step.block,), args))
                continue
            assert blas is not None
            g = step.gemm
            launches += blas.calls(g, step.beta, buffers[pos[g.a.node.id]],
                                   buffers[pos[g.b.node.id]], buffers[pos[g.assign.lhs.id]])
        return BoundRoutine(self.label, be, tuple(launches), scratch)


class CupyCudaBackend:
    """Buffers are flat CuPy arrays on one device (see the module docstring for their dtypes);
    routines are :class:`CompiledPlan` s of kernel launches from one ``RawModule`` and cuBLAS
    calls. ``write`` copies in place, so the buffer's device pointer never changes and bound
    routines see new values without recompiling.

    ``fmad``: whether NVRTC may contract multiply-adds into FMAs (None: ``OCANNL_CUDA_FMAD``,
    default on); see the module docstring. ``graphs``: whether routines run as CUDA graphs
    (None: ``OCANNL_CUDA_GRAPHS``, default on). ``tf32``: whether f32 products may round
    their operands to TF32 on tensor cores (None: ``OCANNL_CUDA_TF32``, default off).

    Everything (kernels, products, copies in and out) goes on one stream of the backend's, a
    blocking one: work on the legacy default stream (a communicator's, CuPy's) is ordered with
    it, and it can be captured.
    """

    name = "cuda"
    # Compiled modules for the process: (device id, options, module source) -> (module,
    # {function name: function}).
    _modules: dict[tuple[int, tuple[str, ...], str], tuple[Any, dict[str, Any]]] = {}
    # Plans of GEMMs alone seen (device id, GEMM shapes): such a plan counts as compiled anew
    # the first time only.
    _seen: set[tuple] = set()

    def __init__(self, device_id: int = 0, *, fmad: bool | None = None,
                 graphs: bool | None = None, tf32: bool | None = None) -> None:
        reason = cuda_unavailable_reason(device_id)
        if reason is not None:
            raise CudaUnavailable(f"Context.cuda(device_id={device_id}): no GPU is usable: "
                                  f"{reason}")
        import cupy

        from ocannl.backends.cuda.nvrtc import cuda_include_dir

        self.cp = cupy
        self.device_id = device_id
        self.device = cupy.cuda.Device(device_id)  # a context manager making it current
        self.fmad = _fmad_from_env() if fmad is None else require_bool("fmad", fmad)
        self.graphs = (_switch("OCANNL_CUDA_GRAPHS", True) if graphs is None
                       else require_bool("graphs", graphs))
        self.tf32 = (_switch("OCANNL_CUDA_TF32", False) if tf32 is None
                     else require_bool("tf32", tf32))
        with self.device:
            self.stream = cupy.cuda.Stream()
        # Thread-local: any unsafe call of this thread (an allocation, a synchronisation)
        # fails the capture instead of being silently left out of the graph.
        self.capture_mode = cupy.cuda.runtime.streamCaptureModeThreadLocal
        # The CUDA major CuPy was built for names the wheels to install; the headers go with
        # the NVRTC CuPy compiles with (cuda-pathfinder may load another major's wheel first).
        self.cuda_major = cupy_cuda_major(cupy)
        self.nvrtc_major = cupy_nvrtc_major(cupy)
        if self.nvrtc_major is not None and self.nvrtc_major != self.cuda_major:
            warnings.warn(f"ocannl: {describe_cupy(cupy)} compiles with NVRTC "
                          f"{self.nvrtc_major} (the first cuda-pathfinder found): its code "
                          f"needs a driver of CUDA {self.nvrtc_major} or later",
                          RuntimeWarning, stacklevel=3)
        inc = cuda_include_dir(self.nvrtc_major or self.cuda_major)
        self.include_dir = inc
        wheels = CUDA_WHEELS.get(self.cuda_major or 0, CUDA_WHEELS[12])
        self._blas: Blas | None = None
        try:
            cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
        except ImportError as err:  # CuPy 14 wheels do not bundle cuBLAS
            self.cublas: Any = None
            self.cublas_missing = str(err)
            warnings.warn(f"ocannl: cuBLAS is not loadable ({err}); matrix products run as "
                          f"generated kernels (pip install {wheels['cublas']} for cuBLAS, "
                          f"{describe_cupy(cupy)})", RuntimeWarning, stacklevel=3)
        else:
            self.cublas = cublas
            self.cublas_missing = ""

    def blas(self) -> Blas:
        """The backend's cuBLAS handle, made at the first routine with a product."""
        if self._blas is None:
            self._blas = Blas(self, self.cublas)
        return self._blas

    @property
    def target(self) -> Target:
        """What lowering may rely on here (``plan.cuda_target``): cuBLAS products when cuBLAS
        is loadable, contraction and TF32 as this backend was asked."""
        return cuda_target(self.cublas is not None, fma=self.fmad, tf32=self.tf32)

    @property
    def options(self) -> tuple[str, ...]:
        """NVRTC's options: the headers, and ``--fmad=false`` where the target record says no
        contraction (``Target.fma``)."""
        inc = self.include_dir
        return ((f"-I{inc}",) if inc else ()) + (() if self.target.fma else ("--fmad=false",))

    def describe(self) -> str:
        products = ("f16 and bf16 products through cuBLAS gemmEx with the operands as stored, "
                    f"f32 ones {'with TF32' if self.tf32 else 'in full f32'}"
                    if self.cublas is not None else
                    f"products as generated kernels (no cuBLAS: {self.cublas_missing})")
        return (f"cuda: device {self.device_id}, {describe_cupy(self.cp)}, NVRTC "
                f"{self.nvrtc_major or '?'}; {products}; CUDA graphs "
                f"{'on' if self.graphs else 'off (OCANNL_CUDA_GRAPHS=0)'}")

    # --- buffers ------------------------------------------------------------------------------

    def alloc(self, node: Tnode) -> Any:
        with self.device:
            return self.cp.zeros(node.size, dtype=storage_dtype(node.prec))

    def write(self, node: Tnode, buf: Any, host: np.ndarray) -> None:
        values = to_storage(node, host)
        with self.device:
            buf.set(values, stream=self.stream)  # ordered with the routines' launches

    def writer(self, node: Tnode, buf: Any) -> Callable[[np.ndarray], None]:
        return functools.partial(self.write, node, buf)

    def read(self, node: Tnode, buf: Any) -> np.ndarray:
        with self.device:
            return from_storage(node, buf.get(stream=self.stream))  # waits for the stream

    def reader(self, node: Tnode, buf: Any, pos: int) -> Callable[[], float]:
        one = buf[pos:pos + 1]
        return lambda: float(self.read(node, one)[0])  # waits for the device

    # --- routines -----------------------------------------------------------------------------

    def compile(self, label: str, code: list[Lowered], nodes: list[Tnode]
                ) -> tuple[CompiledPlan, bool]:
        plan = plan_routine(code)
        have = {n.id for n in nodes}
        for step in plan.steps:
            used = (step.nodes if isinstance(step, Kernel) else
                    (step.gemm.a.node, step.gemm.b.node, step.gemm.assign.lhs))
            for n in used:
                if n.id not in have:
                    raise ValueError(f"{label}: a step reads node {n.name}, which has no buffer "
                                     f"(memory mode {n.memory_mode.value})")
        gemms = tuple(_gemm_key(s) for s in plan.steps if isinstance(s, GemmCall))
        if gemms and self.cublas is None:
            raise CudaUnavailable(f"{label}: the code holds matrix products for cuBLAS, which is "
                                  f"not loadable ({self.cublas_missing}); lower it for "
                                  f"cuda_target(cublas=False)")
        functions: dict[str, Any] = {}
        names: dict[str, str] = {}
        if plan.kernels:
            source, names = module_source(plan)
            functions, compiled_anew = self._load(source, names)
        else:
            key = (self.device_id, gemms)
            compiled_anew = key not in self._seen
            self._seen.add(key)
        return CompiledPlan(self, plan, nodes, functions, names, label), compiled_anew

    def _load(self, source: str, names: dict[str, str]) -> tuple[dict[str, Any], bool]:
        """The module's functions by kernel source, and whether it was compiled anew."""
        key = (self.device_id, self.options, source)
        entry = self._modules.get(key)
        compiled_anew = entry is None
        if entry is None:
            if "#include" in source and self.include_dir is None:
                major = self.nvrtc_major or self.cuda_major
                wheel = CUDA_WHEELS.get(major or 0, CUDA_WHEELS[12])["headers"]
                raise CudaUnavailable(
                    f"a 16-bit kernel needs cuda_fp16.h / cuda_bf16.h of CUDA {major or '?'} "
                    f"(the NVRTC {describe_cupy(self.cp)} compiles with) and none was found: "
                    f"pip install {wheel}, or set CUDA_PATH")
            with self.device:
                module = self.cp.RawModule(code=source, options=self.options)
                module.compile()
                fns = {name: module.get_function(name) for name in names.values()}
            entry = self._modules[key] = (module, fns)
        fns = entry[1]
        return {src: fns[name] for src, name in names.items()}, compiled_anew

    def bind(self, compiled: CompiledPlan, buffers: tuple[Any, ...]) -> BoundRoutine:
        return compiled.bind(buffers)

    def synchronize(self) -> None:
        """Wait for every launched kernel (for timings; reads synchronise by themselves)."""
        self.device.synchronize()
