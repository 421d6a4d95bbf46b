"""The product routines a CPU routine can call, each on one thread, in one process: the figures
behind ``native_products.py`` and ``onednn.py``.

    .venv/bin/python benchmarks/ab_routines.py [--rounds 10]

Per shape (m x n x k, f32 result): NumPy's ``sgemm`` (its OpenBLAS), MKL's ``sgemm``,
``gemm_bf16bf16f32`` and ``gemm_f16f16f32`` (where the ``mkl`` wheel loads), and oneDNN's
``dnnl_gemm_bf16bf16f32`` through the shim routines call (where the ``onednn`` wheel loads),
all through their Fortran interfaces, as a routine calls them; oneDNN's own ``dnnl_sgemm``
too, which no routine calls (a yardstick). Timed in interleaved rounds, after one warm-up
call each; printed: each one's GFLOP/s at its median time, and its result's largest distance
from the f64 product of the same (rounded) operands, relative to that product's largest
magnitude. Run it on a quiet machine: the CPU's name and bf16 flags head the output.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(1024, 1024, 1024), (256, 1024, 1024), (1024, 256, 1024), (128, 512, 512),
          (64, 64, 64)]
FORTRAN = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * 13))


def fortran_calls(m: int, n: int, k: int, int_bits: int, routines: dict[str, tuple[int, str]]
                  ) -> dict[str, tuple[Callable[[], None], np.ndarray, np.ndarray]]:
    """A call per routine (name -> (address, operand dtype name)) of ``c = a @ b`` in column
    major (``a``: m x k, ``b``: k x n), with its result array and the f64 product."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m), dtype=np.float32)  # column-major m x k
    b = rng.standard_normal((n, k), dtype=np.float32)  # column-major k x n
    integer = ctypes.c_int32 if int_bits == 32 else ctypes.c_int64
    ints = {v: integer(v) for v in (m, n, k)}
    one, zero, trans = ctypes.c_float(1.0), ctypes.c_float(0.0), ctypes.c_char(b"N")
    out = {}
    for name, (address, dtype) in routines.items():
        ops = [x.astype({"f32": np.float32, "bf16": ml_dtypes.bfloat16,
                         "f16": np.float16}[dtype]) for x in (a, b)]
        c = np.zeros((n, m), np.float32)
        exact = ops[1].astype(np.float64) @ ops[0].astype(np.float64)
        fn = FORTRAN(address)
        args = [ctypes.addressof(trans), ctypes.addressof(trans), ctypes.addressof(ints[m]),
                ctypes.addressof(ints[n]), ctypes.addressof(ints[k]), ctypes.addressof(one),
                ops[0].ctypes.data, ctypes.addressof(ints[m]), ops[1].ctypes.data,
                ctypes.addressof(ints[k]), ctypes.addressof(zero), c.ctypes.data,
                ctypes.addressof(ints[m])]
        keep = (ops, ints, one, zero, trans)  # what the addresses point into
        out[name] = ((lambda fn=fn, args=args, keep=keep: fn(*args)), c, exact)
    return out


def dnnl_sgemm(m: int, n: int, k: int
               ) -> tuple[Callable[[], None], np.ndarray, np.ndarray] | None:
    """oneDNN's row-major ``dnnl_sgemm`` on the same product, where its library loads."""
    from ocannl.backends.cpu import onednn

    path = Path(sys.prefix) / "lib" / onednn.LIBRARY
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    lib.omp_set_num_threads(1)
    d, f, p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.dnnl_sgemm.argtypes = [ctypes.c_char, ctypes.c_char, d, d, d, f, p, d, p, d, f, p, d]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = np.zeros((m, n), np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    return ((lambda: lib.dnnl_sgemm(b"N", b"N", m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data,
                                    n, 0.0, c.ctypes.data, n)), c, exact)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    from threadpoolctl import threadpool_limits

    from benchmarks.machine import bf16_units, cpu_model
    from ocannl.backends.cpu import blas, onednn

    print(f"{cpu_model()}; 16-bit units: {bf16_units()}")
    openblas = blas.numpy_openblas()
    mkl = blas.mkl()
    sets: list[tuple[int, dict[str, tuple[int, str]]]] = []
    if isinstance(openblas, blas.Blas):
        sets.append((openblas.int_bits, {"numpy sgemm": (openblas.sgemm, "f32")}))
    if isinstance(mkl, blas.Blas):
        found = {"mkl sgemm": (mkl.sgemm, "f32")}
        for prec in ("bf16", "f16"):
            routine = mkl.product16(prec)
            if routine:
                found[f"mkl {routine[0]}"] = (routine[1], prec)
        sets.append((mkl.int_bits, found))
    else:
        print(f"MKL: {mkl}")
    dnnl = onednn.bf16_product(32)
    if isinstance(dnnl, onednn.OneDnn):
        sets.append((32, {f"oneDNN {dnnl.version} bf16 (shim)": (dnnl.shim, "bf16")}))
    else:
        print(f"oneDNN: {dnnl}")
    with threadpool_limits(1):
        for m, n, k in SHAPES:
            calls = {name: call for bits, routines in sets
                     for name, call in fortran_calls(m, n, k, bits, routines).items()}
            yardstick = dnnl_sgemm(m, n, k)
            if yardstick:
                calls["oneDNN dnnl_sgemm (no routine calls it)"] = yardstick
            times: dict[str, list[float]] = {name: [] for name in calls}
            for call, _, _ in calls.values():
                call()  # warm-up
            for _ in range(args.rounds):
                for name, (call, _, _) in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
            print(f"{m} x {n} x {k}:")
            for name, (_, c, exact) in calls.items():  # c and exact: the same layout
                err = float(np.abs(c - exact).max() / np.abs(exact).max())
                rate = 2.0 * m * n * k / statistics.median(times[name]) / 1e9
                print(f"  {name:>42}: {rate:7.1f} GFLOP/s   rel. err {err:.1e}")


if __name__ == "__main__":
    main()
