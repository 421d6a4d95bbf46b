"""A workload's variants against its first, in one process, steps interleaved by block.

    .venv/bin/python benchmarks/ab_variants.py convnet f32,f16,f16-static,bf16 [--blocks 30]
        [--steps N]
    OCANNL_BF16_PRODUCTS=widened .venv/bin/python benchmarks/ab_variants.py convnet f32,bf16

Each variant's runner is built as ``run.py`` builds it, trains a few steps, then every block
runs ``--steps`` steps of each variant in turn (the order reversed every other block) and
records their mean. Printed per variant: the min and the median of its blocks and each over the
first variant's. On a machine whose speed drifts (a shared VM), the min of many short blocks
compares the variants at the same quiet moments; ``run.py``'s rounds give the report's p50s.
The second command holds the bf16 step to f32's where bf16 products are widened to f32
copies, as on a CPU without bf16 product units (``native_products.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fixtures import load  # noqa: E402
from benchmarks.runners import make_runner  # noqa: E402
from benchmarks.specs import VARIANTS, WORKLOADS  # noqa: E402

# Steps a block, per workload: a block of about 0.2-5 ms, short against the machine's drift.
STEPS = {"mlp_small": 200, "convnet": 50, "mlp_wide": 5, "gpt_mini": 5}


def blocks(workload: str, variants: list[str], count: int, steps: int
           ) -> dict[str, list[float]]:
    """Each variant's mean step time (seconds) in each of ``count`` blocks of ``steps``
    steps, the variants interleaved."""
    return timed(built(workload, variants), count, steps)


def built(workload: str, variants: list[str]) -> dict[str, object]:
    """Each variant's runner, built and past its first steps (checks, recasts, the pool)."""
    fx = load(WORKLOADS[workload])
    runners = {}
    for v in variants:
        r = make_runner(fx, "ocannl", v, "cpu")
        r.build()
        for i in range(5):
            r.step(i)
        runners[v] = r
    return runners


def timed(runners: dict[str, object], count: int, steps: int) -> dict[str, list[float]]:
    """:func:`blocks` over runners already built: ``count`` blocks, each ``steps`` steps of
    every runner in turn, the order reversed every other block."""
    variants = list(runners)
    out: dict[str, list[float]] = {v: [] for v in variants}
    for b in range(count):
        for v in variants if b % 2 == 0 else variants[::-1]:
            step = runners[v].step  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            for i in range(steps):
                step(i)
            out[v].append((time.perf_counter() - t0) / steps)
    return out


def checked_variants(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated variants of ``text``, or ``ap.error`` naming them: each one of
    ``specs.VARIANTS``, none twice."""
    variants = text.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or len(set(variants)) != len(variants):
        ap.error(f"variants must be distinct, each one of {sorted(VARIANTS)}: got {variants}")
    return variants


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("variants", help="comma-separated, the first the base: f32,f16,bf16")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--steps", type=int, default=0, help="steps a block (default: per workload)")
    args = ap.parse_args(argv)
    variants = checked_variants(ap, args.variants)
    if args.blocks < 1 or args.steps < 0:
        ap.error(f"--blocks must be >= 1 and --steps >= 0, got {args.blocks} and {args.steps}")
    times = blocks(args.workload, variants, args.blocks,
                   args.steps or STEPS.get(args.workload, 5))
    base = times[variants[0]]
    for v, t in times.items():
        lo, mid = min(t), statistics.median(t)
        print(f"{args.workload} {v:12s} min {lo * 1e6:10.2f} us  median {mid * 1e6:10.2f} us  "
              f"min / {variants[0]}'s {lo / min(base):.3f}x  median / {variants[0]}'s "
              f"{mid / statistics.median(base):.3f}x")
    return times


if __name__ == "__main__":
    main()
