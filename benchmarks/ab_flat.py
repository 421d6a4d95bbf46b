"""A flat loop group (``LoopGroup.flat``: one loop over its cells) on one thread against the
same group shared over the thread pool, by size: where ``FLAT_PARALLEL_CELLS`` belongs.

    .venv/bin/python benchmarks/ab_flat.py [--rounds 40] [--calls 20]

Three groups, each at 2^14 to 2^20 cells (rows of 256): an f16 -> f32 copy (scheduling's own
kind), an f16 ``relu(a + b)`` (vector arithmetic: its ops run in lanes) and an f32 ``exp``
(a libm call per cell: not lanes, shared from ``PARALLEL_POINTS`` as before). Each is compiled
twice on one context, once with the threshold at 0 (always shared) and once at 2^62 (never);
per round each side runs ``--calls`` calls, timed together, the side going first alternating by
round. Printed: each side's least time per call and the p50 of the rounds' ratios (shared /
one thread: under 1 means sharing wins).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = tuple(1 << k for k in range(14, 21))


def _group(kind: str, cells: int):  # noqa: ANN202 - a Comp and its nodes
    from ocannl.ir.assignments import Accum, Comp, Get, apply
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode

    dims = (cells // 256, 256)
    idx = (0, 1)
    f16, f32 = Precision.f16, Precision.f32
    if kind == "copy":
        a, out = Tnode("a", dims, f16), Tnode("out", dims, f32)
        e = Get(a, idx)
    elif kind == "add_relu":
        a, b, out = Tnode("a", dims, f16), Tnode("b", dims, f16), Tnode("out", dims, f16)
        e = apply("relu", apply("add", Get(a, idx), Get(b, idx)))
    else:
        a, out = Tnode("a", dims, f32), Tnode("out", dims, f32)
        e = apply("exp", Get(a, idx))
    return Comp((Accum(out, idx, "=", e, dims),))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args(argv)
    from benchmarks.machine import cpu_model, load_average
    from ocannl import Context
    from ocannl.backends.cpu import jit
    from ocannl.ir import schedule

    print(f"{cpu_model()}, {jit.target().threads} threads, load {load_average()}")
    print("| group | cells | one thread (us) | shared (us) | shared / one, p50 (p10-p90) |")
    print("|---|---|---|---|---|")
    for kind in ("copy", "add_relu", "exp"):
        for cells in SIZES:
            ctx = Context.cpu()
            routines = {}
            for side, least in (("one", 1 << 62), ("shared", 0)):
                schedule.FLAT_PARALLEL_CELLS = schedule.PARALLEL_POINTS = least
                ctx, routines[side] = ctx.compile(_group(kind, cells))
            best = {"one": float("inf"), "shared": float("inf")}
            ratios = []
            for r in range(a.rounds):
                took = {}
                for side in (("one", "shared") if r % 2 else ("shared", "one")):
                    call = routines[side].call
                    call()
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        call()
                    took[side] = (time.perf_counter() - t0) / a.calls
                    best[side] = min(best[side], took[side])
                ratios.append(took["shared"] / took["one"])
            q = statistics.quantiles(ratios, n=10)
            print(f"| {kind} | {cells} | {best['one'] * 1e6:.1f} | {best['shared'] * 1e6:.1f} | "
                  f"{statistics.median(ratios):.2f} ({q[0]:.2f}-{q[-1]:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
