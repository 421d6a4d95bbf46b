"""Where a product of two bf16 operands should stop being computed inline and go to the BLAS's
bf16 routine: ``Target.inline_native_work``, measured.

For products of growing size (bf16 x bf16 into f32, columns a multiple of the inline kernel's
vector), one routine per kernel: inline (the bound set above the product) and native (the bound
set to 0), timed in interleaved rounds; the p50 of each and their ratio. The crossing is the
smallest product from which native is faster at every larger size measured.

Needs a native bf16 routine: the default where the CPU has bf16 units (MKL's on Intel's
CPUs, oneDNN's on others); elsewhere force one with ``OCANNL_BLAS=mkl
OCANNL_BF16_PRODUCTS=native`` (MKL then widens internally, so the figure is that CPU's, not a
bf16 unit's). Run it on a quiet machine::

    .venv/bin/python benchmarks/ab_native_products.py

Measured on a 2-core AMD EPYC with AVX512-BF16 (oneDNN 3.2.0): native from 65,536 on
(``onednn.INLINE_WORK``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

# Products below ``schedule.GEMM_SPLIT_FLOPS`` (2^18) multiply-adds: from there on a product is
# cut into parts over the threads, each a library call, whatever the inline bound says.
SHAPES = [(16, 16, 16), (16, 32, 32), (32, 32, 32), (32, 32, 48), (32, 48, 32), (48, 32, 32),
          (32, 32, 64), (64, 32, 32), (32, 64, 32), (48, 48, 48), (64, 32, 64), (64, 48, 64),
          (64, 64, 48), (48, 64, 64), (64, 64, 63)]


def routine(shape: tuple[int, int, int], bound: int):  # noqa: ANN201 - (ctx, routine)
    """A context and a routine computing ``c = a @ b`` (bf16 operands, f32 result) with the
    inline bound of native products set to ``bound``."""
    from ocannl import Context
    from ocannl.backends.cpu import jit
    from ocannl.ir.assignments import Accum, Comp, Get, apply
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode

    m, n, k = shape
    a, b = Tnode("a", (m, k), Precision.bf16), Tnode("b", (k, n), Precision.bf16)
    c = Tnode("c", (m, n), Precision.f32)
    comp = Comp((Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))),
                       (m, n, k), True),))
    rng = np.random.default_rng(0)
    ctx = Context.cpu().set_values(a, rng.normal(size=(m, k))).set_values(
        b, rng.normal(size=(k, n)))
    original = jit.target
    jit.target = lambda: replace(original(), inline_native_work=bound)  # type: ignore[assignment]
    try:
        ctx, r = ctx.compile(comp)
    finally:
        jit.target = original  # type: ignore[assignment]
    return ctx, r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20, help="calls per round and kernel")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if args.calls < 1:
        parser.error(f"--calls {args.calls}: expected at least 1")
    from ocannl import Context
    from ocannl.backends.cpu import jit

    if not jit.target().native_products:
        raise SystemExit(f"no native bf16 products here ({Context.cpu().describe()}): run "
                         "with OCANNL_BLAS=mkl OCANNL_BF16_PRODUCTS=native")
    print(Context.cpu().describe())
    print(f"{'m x n x k':>16} {'MACs':>10} {'inline us':>10} {'native us':>10} native/inline")
    wins = []
    from ocannl.ir.schedule import GEMM_SPLIT_FLOPS

    for shape in SHAPES:
        work = shape[0] * shape[1] * shape[2]
        if work >= GEMM_SPLIT_FLOPS:
            raise SystemExit(f"{shape}: shared over threads, a library call either way")
        kernels = {"inline": routine(shape, work), "native": routine(shape, 0)}
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name, (ctx, r) in kernels.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    ctx.run(r)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        inline, native = (statistics.median(times[k]) for k in ("inline", "native"))
        wins.append((work, native < inline))
        print(f"{'x'.join(map(str, shape)):>16} {work:>10} {inline:>10.2f} {native:>10.2f} "
              f"{native / inline:.2f}")
    crossing = next((w for k, (w, _) in enumerate(wins) if all(x for _, x in wins[k:])), None)
    print(f"native wins from {crossing} multiply-adds on" if crossing else
          "native never wins at every larger size measured")


if __name__ == "__main__":
    main()
