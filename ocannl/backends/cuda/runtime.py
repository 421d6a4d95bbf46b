"""Running CUDA launch plans through CuPy: buffers, one NVRTC module per routine, cuBLAS GEMMs.

CuPy is imported only when a backend is created, so this module, :mod:`.plan` and the NVRTC
checks (:mod:`.nvrtc`) work on a machine with no GPU.

**Compile, bind, run.** :meth:`CupyCudaBackend.compile` turns lowered code into a launch plan
(:func:`~ocannl.backends.cuda.plan.plan_routine`) and compiles the plan's distinct kernels as
*one* ``cupy.RawModule`` (one NVRTC program per routine, each kernel renamed apart by
:func:`module_source`), cached per (device, options, module source) for the process.
:meth:`CupyCudaBackend.bind` then builds, once, a launch closure per step over the routine's
buffers and its own scratch buffers; running a bound routine is calling those closures under
the device's context, nothing else (launches are asynchronous; reads synchronise).

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

import functools
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
from ocannl.ir.lowering import Lowered, MatrixView
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


def _fmad_from_env() -> bool:
    value = os.environ.get("OCANNL_CUDA_FMAD", "1").strip().lower()
    if value in ("1", "true", "yes", "on", ""):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"OCANNL_CUDA_FMAD must be 0 or 1 (or true / false), got {value!r}")


def _matrix(buf: Any, v: MatrixView) -> tuple[Any, str]:
    """The stored matrix of a view and the cuBLAS op reading it as ``rows x cols``."""
    if v.transposed:
        return buf.reshape((v.cols, v.rows)), "T"
    return buf.reshape((v.rows, v.cols)), "N"


def _gemm_key(s: GemmCall) -> tuple:
    g = s.gemm
    return (g.rows, g.cols, g.inner, g.a.transposed, g.b.transposed, s.beta,
            g.a.node.prec.value, g.b.node.prec.value, g.assign.lhs.prec.value)


class CompiledPlan:
    """A routine's plan with its kernels loaded on the device: what ``compile`` returns and
    ``bind`` binds. Shared by every routine of the same code; each binding gets its own
    scratch buffers (split reductions' partial results)."""

    def __init__(self, backend: CupyCudaBackend, plan: Plan, nodes: Sequence[Tnode],
                 functions: dict[str, Any], names: dict[str, str]) -> None:
        self.backend = backend
        self.plan = plan
        self.nodes = tuple(nodes)
        self.functions = functions  # kernel source -> loaded function
        self.names = names  # kernel source -> its function name in the module
        self._pos = {n.id: k for k, n in enumerate(nodes)}

    def bind(self, buffers: tuple[Any, ...]) -> Callable[[], None]:
        """The routine over ``buffers`` (in ``nodes`` order): every launch built now."""
        if len(buffers) != len(self.nodes):
            raise ValueError(f"bind: {len(buffers)} buffers for {len(self.nodes)} nodes")
        be = self.backend
        pos = self._pos
        with be.device:
            scratch = [be.cp.empty(s.size, dtype=storage_dtype(s.prec))
                       for s in self.plan.scratch]
        launches: list[Callable[[], Any]] = []
        for step in self.plan.steps:
            if isinstance(step, Kernel):
                args = tuple(buffers[pos[n.id]] for n in step.nodes) + tuple(
                    scratch[s.slot] for s in step.scratch)
                launches.append(partial(self.functions[step.source], (step.grid,),
                                        (step.block,), args))
                continue
            g = step.gemm
            a, ta = _matrix(buffers[pos[g.a.node.id]], g.a)
            b, tb = _matrix(buffers[pos[g.b.node.id]], g.b)
            out = buffers[pos[g.assign.lhs.id]].reshape((g.rows, g.cols))
            launches.append(partial(be.cublas.gemm, ta, tb, a, b, out=out, beta=step.beta))
        steps = tuple(launches)
        device = be.device

        def run() -> None:
            with device:
                for launch in steps:
                    launch()

        run.launches = steps  # type: ignore[attr-defined]
        run.scratch = scratch  # type: ignore[attr-defined]  # alive while the routine is
        return run


class CupyCudaBackend:
    """Buffers are flat CuPy arrays on one device (see the module docstring for their dtypes);
    routines are :class:`CompiledPlan` s of kernel launches from one ``RawModule`` and cuBLAS
    calls. ``write`` copies in place, so the buffer's device pointer never changes and bound
    routines see new values without recompiling.

    ``fmad``: whether NVRTC may contract multiply-adds into FMAs (None: ``OCANNL_CUDA_FMAD``,
    default on); see the module docstring.
    """

    name = "cuda"
    # Compiled modules for the process: (device id, options, module source) -> (module,
    # {function name: function}).
    _modules: dict[tuple[int, tuple[str, ...], str], tuple[Any, dict[str, Any]]] = {}
    # Plans of GEMMs alone seen (device id, GEMM shapes): such a plan counts as compiled anew
    # the first time only.
    _seen: set[tuple] = set()

    def __init__(self, device_id: int = 0, *, fmad: bool | None = None) -> None:
        reason = cuda_unavailable_reason(device_id)
        if reason is not None:
            raise CudaUnavailable(f"Context.cuda(device_id={device_id}): no GPU is usable: "
                                  f"{reason}")
        import cupy

        from ocannl.backends.cuda.nvrtc import cuda_include_dir

        self.cp = cupy
        self.device_id = device_id
        self.device = cupy.cuda.Device(device_id)  # a context manager making it current
        self.fmad = _fmad_from_env() if fmad is None else bool(fmad)
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
        self.options: tuple[str, ...] = ((f"-I{inc}",) if inc else ()) + (
            () if self.fmad else ("--fmad=false",))
        wheels = CUDA_WHEELS.get(self.cuda_major or 0, CUDA_WHEELS[12])
        try:
            from cupy import cublas
        except ImportError as err:  # CuPy 14 wheels do not bundle cuBLAS
            self.cublas: Any = None
            self.cublas_missing = str(err)
            warnings.warn(f"ocannl: cuBLAS is not loadable ({err}); matrix products run as "
                          f"generated kernels (pip install {wheels['cublas']} for cuBLAS, "
                          f"{describe_cupy(cupy)})", RuntimeWarning, stacklevel=3)
        else:
            self.cublas = cublas
            self.cublas_missing = ""

    @property
    def target(self) -> Target:
        """What lowering may rely on here (``plan.cuda_target``): cuBLAS products when cuBLAS
        is loadable."""
        return cuda_target(self.cublas is not None)

    # --- buffers ------------------------------------------------------------------------------

    def alloc(self, node: Tnode) -> Any:
        with self.device:
            return self.cp.zeros(node.size, dtype=storage_dtype(node.prec))

    def write(self, node: Tnode, buf: Any, host: np.ndarray) -> None:
        values = to_storage(node, host)
        with self.device:
            buf.set(values)

    def read(self, node: Tnode, buf: Any) -> np.ndarray:
        with self.device:
            return from_storage(node, buf.get())

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
        return CompiledPlan(self, plan, nodes, functions, names), compiled_anew

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

    def bind(self, compiled: CompiledPlan, buffers: tuple[Any, ...]) -> Callable[[], None]:
        return compiled.bind(buffers)

    def synchronize(self) -> None:
        """Wait for every launched kernel (for timings; reads synchronise by themselves)."""
        self.device.synchronize()
