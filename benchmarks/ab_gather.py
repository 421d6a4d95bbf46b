"""A scatter against its gather on the CPU backend (``lowering.gather_of``): input gradients of
a convolution and of a pool, lowered both ways, compiled, run interleaved in one process.

    .venv/bin/python benchmarks/ab_gather.py [--rounds 30] [--calls 50] [--threads 1 2]

Cases (f32, 64 images): convnet's second convolution's input gradient (4x4x8 images, 16
output channels, 3x3, "same" padding: 144 terms a cell), a small one (8x8x1 to 2 channels,
which im2col leaves direct on the CPU: 18 terms) and two between (8x8x2 to 4 and 8 channels:
36 and 72 terms) and a stride-2 one (8x8x2 to 16 channels: 36 terms a cell on average, in
4 phases), all without im2col; a 3x3 stride-1 average pool's input gradient
over 8x8x8 images. The scatter side lowers with ``CPU_GATHER_MAX_WASTE = 0`` (no gathers),
the gather side with the gather forced (waste limit 16, no least number of terms). Per round
each side runs ``--calls`` calls, timed one by one after one untimed call, the side going
first alternating by round.
Printed per case and thread count: each side's p50 call, the p50 of the rounds' ratios
(gather / scatter: under 1 means the gather wins) and its spread (p10-p90), and the largest
difference between the two sides' results (a gather sums each cell's terms in another order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.interleaved import interleaved  # noqa: E402
from ocannl import Context  # noqa: E402
from ocannl.backends.cpu import jit  # noqa: E402
from ocannl.ir import lowering  # noqa: E402
from ocannl.ir.assignments import Accum, Affine, Comp, Get, apply  # noqa: E402
from ocannl.ir.ops import Precision  # noqa: E402
from ocannl.ir.tnode import Tnode  # noqa: E402

F32 = Precision.f32


def conv_input_grad(b: int, h: int, c: int, o: int, k: int, pad: int, stride: int = 1
                    ) -> tuple[Comp, Tnode, list[Tnode]]:
    """``dx[b, s*oh + kh - p, s*ow + kw - p, c] =+ dy[b, oh, ow, o] * w[o, kh, kw, c]``."""
    oh = (h + 2 * pad - k) // stride + 1
    dx = Tnode("dx", (b, h, h, c), F32)
    dy, w = Tnode("dy", (b, oh, oh, o), F32), Tnode("w", (o, k, k, c), F32)
    space = (b, oh, oh, o, k, k, c)  # 0 b, 1 oh, 2 ow, 3 o, 4 kh, 5 kw, 6 c
    idx = (0, Affine(((stride, 1), (1, 4)), -pad), Affine(((stride, 2), (1, 5)), -pad), 6)
    a = Accum(dx, idx, "+", apply("mul", Get(dy, (0, 1, 2, 3)), Get(w, (3, 4, 5, 6))), space,
              reset=True)
    return Comp((a,), "conv_input_grad"), dx, [dy, w]


def pool_input_grad(b: int, h: int, c: int, k: int) -> tuple[Comp, Tnode, list[Tnode]]:
    """A stride-1 sum pool's input gradient: ``dx[b, oh + kh, ow + kw, c] =+ g[b, oh, ow, c]``."""
    oh = h - k + 1
    dx, g = Tnode("dx", (b, h, h, c), F32), Tnode("g", (b, oh, oh, c), F32)
    space = (b, oh, oh, k, k, c)
    idx = (0, Affine(((1, 1), (1, 3))), Affine(((1, 2), (1, 4))), 5)
    a = Accum(dx, idx, "+", Get(g, (0, 1, 2, 5)), space, reset=True)
    return Comp((a,), "pool_input_grad"), dx, [g]


CASES: dict[str, Callable[[], tuple[Comp, Tnode, list[Tnode]]]] = {
    "convnet conv1 dx (64x4x4x8, 16 ch, 3x3 same)": lambda: conv_input_grad(64, 4, 8, 16, 3, 1),
    "small conv dx (64x8x8x1, 2 ch, 3x3 same)": lambda: conv_input_grad(64, 8, 1, 2, 3, 1),
    "conv dx (64x8x8x2, 4 ch, 3x3 same)": lambda: conv_input_grad(64, 8, 2, 4, 3, 1),
    "conv dx (64x8x8x2, 8 ch, 3x3 same)": lambda: conv_input_grad(64, 8, 2, 8, 3, 1),
    "conv stride 2 dx (64x8x8x2, 16 ch, 3x3 pad 1)":
        lambda: conv_input_grad(64, 8, 2, 16, 3, 1, stride=2),
    "avg pool 3x3/1 dx (64x8x8x8)": lambda: pool_input_grad(64, 8, 8, 3),
}


def build(case: str, threads: int, gather: bool, seed: int = 0
          ) -> tuple[Callable[[], np.ndarray], Callable[[], None], bool]:
    """A context running ``case``'s routine lowered without im2col and with (or without)
    gathers on ``threads`` threads: a call that returns the result, a bare call, and whether
    the lowered code holds a gather."""
    comp, dx, inputs = CASES[case]()
    saved = (jit.threads, jit.target, lowering.CPU_GATHER_MAX_WASTE,
             lowering.CPU_GATHER_MIN_TERMS)
    plain_target = jit.target
    jit.threads = lambda: threads  # type: ignore[assignment]
    jit.target = lambda: replace(plain_target(), im2col=False)  # type: ignore[assignment]
    lowering.CPU_GATHER_MAX_WASTE = 16 if gather else 0
    lowering.CPU_GATHER_MIN_TERMS = 0
    try:
        ctx = Context.cpu()
        rng = np.random.default_rng(seed)
        for n in inputs:
            ctx.set_values(n, rng.normal(size=n.dims).astype(np.float32))
        has = any(nest.gather for nest in lowering.nests(lowering.lower(comp, jit.target())))
        ctx, routine = ctx.compile(comp)
    finally:
        (jit.threads, jit.target, lowering.CPU_GATHER_MAX_WASTE,
         lowering.CPU_GATHER_MIN_TERMS) = saved

    def result() -> np.ndarray:
        ctx.run(routine)
        return ctx.get_values(dx)

    return result, lambda: ctx.run(routine), has


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=50, help="timed calls per side and round")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args(argv)
    print(f"{args.rounds} rounds x {args.calls} calls a side (a shared machine: noisy)",
          flush=True)
    for case in args.cases:
        for threads in args.threads:
            sides = [build(case, threads, gather) for gather in (False, True)]
            if sides[0][2] or not sides[1][2]:
                raise SystemExit(f"{case}: the scatter side has a gather ({sides[0][2]}) or the "
                                 f"gather side none ({not sides[1][2]})")
            values = [s[0]().astype(np.float64) for s in sides]
            diff = float(np.max(np.abs(values[0] - values[1])))
            scale = float(np.max(np.abs(values[0])))
            times, ratios = interleaved([s[1] for s in sides], args.rounds, args.calls)
            ratios.sort()
            p10, p90 = ratios[len(ratios) // 10], ratios[(len(ratios) * 9) // 10]
            s_p50, g_p50 = (statistics.median(times[s]) * 1e6 for s in (0, 1))
            print(f"{case}, {threads} thread(s): scatter p50 {s_p50:.1f} us, gather p50 "
                  f"{g_p50:.1f} us; gather/scatter by round p50 {statistics.median(ratios):.3f} "
                  f"(p10 {p10:.3f}, p90 {p90:.3f}); max |diff| {diff:.3g} of max |dx| "
                  f"{scale:.3g}", flush=True)


if __name__ == "__main__":
    main()
