"""The GPU check's first step: is this machine's CUDA stack usable at all? (Not a test file.)

    python tests/backends/gpu_smoke.py

Prints CuPy's, the CUDA runtime's, the driver's, NVRTC's and cuBLAS's versions and the device,
then, each part on its own so that one run names every broken one: compiles one ``RawModule``
holding an f16 and a bf16 kernel with the backend's own options and headers, launches both and
checks their bits; runs ``cupy.cublas.gemm`` with ``beta=1`` (plain, transposed, one row)
against an f64 reference; round-trips every 16-bit pattern through ``Context.cuda()`` buffers.

Exit status: 0 all passed, 1 some part failed (each named), 2 no GPU (the reason printed).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from ocannl.backends.cuda.runtime import cuda_unavailable_reason  # noqa: E402

KERNELS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void smoke_f16(const __half* x, __half* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2half_rn(__half2float(x[i]) * 3.0f + 0.5f);
}
extern "C" __global__ void smoke_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(__bfloat162float(x[i]) * 3.0f + 0.5f);
}
"""


def _say(what: str, fn: Callable[[], object]) -> None:
    try:
        print(f"{what}: {fn()}")
    except Exception as err:  # noqa: BLE001 - say what is known, go on
        print(f"{what}: not available ({type(err).__name__}: {err})")


def versions() -> None:
    import cupy

    rt = cupy.cuda.runtime
    _say("CuPy", lambda: cupy.__version__)
    _say("CUDA runtime", rt.runtimeGetVersion)
    _say("CUDA driver", rt.driverGetVersion)
    _say("NVRTC", cupy.cuda.nvrtc.getVersion)

    def devices() -> str:
        rows = []
        for d in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(d)
            rows.append(f"[{d}] {p['name'].decode()}, compute capability {p['major']}."
                        f"{p['minor']}, {p['multiProcessorCount']} SMs, "
                        f"{p['totalGlobalMem'] / 2**30:.1f} GiB")
        return "; ".join(rows)

    _say("devices", devices)

    def cublas_version() -> int:
        from cupy import cublas  # noqa: F401
        from cupy_backends.cuda.libs import cublas as libcublas

        return libcublas.getVersion(cupy.cuda.device.get_cublas_handle())

    _say("cuBLAS", cublas_version)
    from ocannl.backends.cuda import nvrtc
    from ocannl.backends.cuda.runtime import cupy_nvrtc_major, describe_cupy

    _say("CuPy built for", lambda: describe_cupy(cupy))
    _say("NVRTC majors ocannl finds", nvrtc.majors)
    _say("cuda_fp16.h / cuda_bf16.h folder (of CuPy's NVRTC major)",
         lambda: nvrtc.cuda_include_dir(cupy_nvrtc_major(cupy)))


def kernels() -> None:
    import cupy

    from ocannl import Context

    backend = Context.cuda()._backend
    print(f"compile options: {backend.options} (CuPy appends -ftz=true)")
    module = cupy.RawModule(code=KERNELS, options=backend.options)
    module.compile()
    n = 1000
    x16 = np.linspace(-4, 4, n).astype(np.float16)
    xb = np.linspace(-4, 4, n).astype(ml_dtypes.bfloat16)
    for name, x, bits in (("smoke_f16", x16, x16.view(np.uint16)),
                          ("smoke_bf16", xb, xb.view(np.uint16))):
        xd = cupy.asarray(bits)
        yd = cupy.zeros_like(xd)
        module.get_function(name)(((n + 255) // 256,), (256,), (xd, yd, np.int32(n)))
        got = yd.get()
        want = (x.astype(np.float32) * np.float32(3) + np.float32(0.5)).astype(x.dtype)
        bad = np.flatnonzero(got != want.view(np.uint16))
        assert bad.size == 0, (
            f"{name}: {bad.size} of {n} values differ, first at {bad[0]}: got bits "
            f"{got[bad[0]]:#06x}, want {want.view(np.uint16)[bad[0]]:#06x}")
        print(f"{name}: {n} values bit-exact")


def gemm() -> None:
    import cupy
    from cupy import cublas

    rng = np.random.default_rng(0)
    for (m, k, n), ta, tb in (((64, 96, 48), "N", "N"), ((64, 96, 48), "T", "T"),
                              ((1, 300, 40), "N", "T"), ((40, 300, 1), "T", "N")):
        for dtype in (np.float32, np.float64):
            a = rng.normal(size=(m, k) if ta == "N" else (k, m)).astype(dtype)
            b = rng.normal(size=(k, n) if tb == "N" else (n, k)).astype(dtype)
            c = rng.normal(size=(m, n)).astype(dtype)
            out = cupy.asarray(c)
            cublas.gemm(ta, tb, cupy.asarray(a), cupy.asarray(b), out=out, beta=1.0)
            x = a.astype(np.float64).T if ta == "T" else a.astype(np.float64)
            y = b.astype(np.float64).T if tb == "T" else b.astype(np.float64)
            want = x @ y + c
            mag = np.abs(x) @ np.abs(y) + np.abs(c)
            u = 2.0**-24 if dtype == np.float32 else 2.0**-53
            err = np.abs(out.get() - want)
            tol = (16 + 4 * np.sqrt(k)) * u * mag
            assert (err <= tol).all(), (f"gemm {ta}{tb} {m}x{k}x{n} {np.dtype(dtype).name}: "
                                        f"max |err| / tol {np.max(err / tol):.3g}")
    print("cublas.gemm beta=1: f32 and f64, plain, transposed, one row, one column: within "
          "the f64 reference's magnitude-scaled tolerance")


def buffers() -> None:
    from ocannl import Context
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode

    ctx = Context.cuda()
    for prec in (Precision.f16, Precision.bf16):
        node = Tnode(f"smoke_{prec.value}", (65536,), prec)
        host = np.arange(65536, dtype=np.uint16).view(prec.numpy_dtype)
        ctx.set_values(node, host)
        assert ctx.get_values(node).tobytes() == host.tobytes(), f"{prec.value} round trip"
    print("Context.cuda() buffers: every f16 and bf16 bit pattern round-trips")


def main() -> int:
    reason = cuda_unavailable_reason()
    if reason is not None:
        print(f"smoke: no GPU: {reason}")
        try:
            versions()
        except Exception as err:  # noqa: BLE001 - whatever can be said about the stack
            print(f"versions: not available ({type(err).__name__}: {err})")
        return 2
    parts: list[tuple[str, Callable[[], None]]] = [
        ("versions", versions), ("kernels", kernels), ("gemm", gemm), ("buffers", buffers)]
    failed = []
    for name, part in parts:
        print(f"--- {name}", flush=True)
        try:
            part()
        except Exception:  # noqa: BLE001 - name every broken part in one run
            traceback.print_exc()
            failed.append(name)
    print(f"smoke: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
