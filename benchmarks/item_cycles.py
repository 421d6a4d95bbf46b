"""Where a CPU step's time goes, inside the step: each lowered item's time-stamp counter ticks
as the steps run it, for one or more variants of a workload built in one process and stepped in
turn (blocks of steps, their order turned each block).

    .venv/bin/python -m benchmarks.item_cycles mlp_small f32,f16-static,f16 [--blocks 200]
        [--steps 5] [--top 10]

``profile_items.py`` times each item as a routine of its own: a call's cost (about 0.1 us)
floors a small item's time there, and each item finds the caches as the item before it left
them in that run, not in the step. Here the routines are the step's own, compiled to count
(``CpuBackend.count_item_cycles``: two counter reads and an addition per item, about 25 ticks;
each routine compiled anew into a scratch cache): an item that a variant makes slower by what
it leaves in the caches shows it (mlp_wide's f16 update after a checksum pass). Ticks are the
counter's, not the core's cycles; compare them between items and variants of one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def counted_runs(workload: str, variants: list[str], blocks: int, steps: int
                 ) -> dict[str, tuple[list[tuple[int, str]], float]]:
    """Per variant: (ticks a step, item) for every item of its routines, and its wall time a
    step in seconds."""
    from benchmarks.ab_variants import built, timed
    from benchmarks.profile_items import describe
    from ocannl.backends.cpu.backend import CpuBackend

    CpuBackend.count_item_cycles()
    runners = built(workload, variants)
    # The routines each runner's context compiled (a context's own record of them).
    routines = {v: [x for x in r.ctx._routines if x.compiled.cycles is not None]
                for v, r in runners.items()}
    for rs in routines.values():
        for x in rs:
            x.compiled.cycles[:] = 0  # the first steps' left out
    times = timed(runners, blocks, steps)
    total = blocks * steps
    out = {}
    for v in variants:
        items = [(int(c) // total, describe(item)) for x in routines[v]
                 for c, item in zip(x.compiled.cycles, x.lowered, strict=True)]
        out[v] = (items, sum(times[v]) / blocks)
    return out


def main(argv: list[str] | None = None) -> None:
    from benchmarks.ab_variants import checked_variants
    from benchmarks.specs import WORKLOADS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("variants", help="comma-separated: f32,f16-static,f16")
    p.add_argument("--blocks", type=int, default=100)
    p.add_argument("--steps", type=int, default=5, help="steps a block")
    p.add_argument("--top", type=int, default=10)
    a = p.parse_args(argv)
    variants = checked_variants(p, a.variants)
    if a.blocks < 1 or a.steps < 1 or a.top < 0:
        p.error(f"--blocks and --steps must be >= 1 and --top >= 0, got {a.blocks}, {a.steps} "
                f"and {a.top}")
    scratch = tempfile.mkdtemp(prefix="ocannl_item_cycles_")
    before = os.environ.get("OCANNL_CACHE_DIR")
    os.environ["OCANNL_CACHE_DIR"] = scratch  # counting code is never cached for others
    try:
        runs = counted_runs(a.workload, variants, a.blocks, a.steps)
    finally:
        if before is None:
            del os.environ["OCANNL_CACHE_DIR"]
        else:
            os.environ["OCANNL_CACHE_DIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)
    for v, (items, wall) in runs.items():
        ticks = sum(t for t, _ in items)
        products = sum(t for t, what in items if what.startswith("gemm "))
        print(f"{a.workload} {v}: {len(items)} items, {ticks:,} ticks a step in its items "
              f"(products {products:,}, the rest {ticks - products:,}); "
              f"{wall * 1e6:.1f} us a step")
        for t, what in sorted(items, reverse=True)[:a.top]:
            print(f"  {t:>12,}  {100 * t / max(ticks, 1):5.1f}%  {what}")


if __name__ == "__main__":
    main()
