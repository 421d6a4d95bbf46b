"""Where a CPU step's time goes: each lowered item of a workload's routines, timed alone.

    .venv/bin/python -m benchmarks.profile_items convnet f16 [--top 15] [--runs 50]

Builds the row's ocannl runner (as ``run.py`` does), trains a few steps, then compiles every
lowered item of its routines (a fill, a loop group, a GEMM) as a routine of its own, bound to
the same buffers, and runs ``--runs`` rounds: each feeds the next batch and runs every item
once, in order, as a step does (a recipe's host gate is not consulted: every routine runs).
Prints the items by their median time, with their share of the sum and what each one is.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def describe(item: object) -> str:
    """One line: the kind of item, what it writes and over how many points."""
    from ocannl.ir.lowering import Fill, Gemm

    if isinstance(item, Fill):
        return f"fill {item.node.name} ({item.node.size})"
    if isinstance(item, Gemm):
        precs = "/".join(n.prec.value for n in (item.assign.lhs, item.a.node, item.b.node))
        return (f"gemm {item.assign.lhs.name} {item.rows}x{item.inner} @ "
                f"{item.inner}x{item.cols} ({precs})")
    lead = item.lead
    kind = "reduction" if lead.red else "pointwise"
    names = ", ".join(n.assign.lhs.name for n in item.nests[:3])
    more = f" +{len(item.nests) - 3}" if len(item.nests) > 3 else ""
    return (f"{kind} x{len(item.nests)} [{names}{more}] par {lead.par_size} red {lead.red_size}"
            f" ({lead.assign.lhs.prec.value})")


def built(fx: object, variant: str) -> tuple[object, list]:
    """The row's ocannl runner on fixture ``fx``, built, with the computations its build
    compiled (its routines' source, for lowering again)."""
    from benchmarks.runners import make_runner
    from ocannl import Context

    comps = []
    compile_ = Context.compile

    def capture(self, comp, bindings=None):  # noqa: ANN001, ANN202 - a wrapper
        comps.append(comp)
        return compile_(self, comp, bindings)

    Context.compile = capture
    try:
        runner = make_runner(fx, "ocannl", variant, "cpu")
        runner.build()
    finally:
        Context.compile = compile_
    return runner, comps


def profile(workload: str, variant: str, runs: int) -> list[tuple[float, str]]:
    from benchmarks.fixtures import load
    from benchmarks.specs import WORKLOADS

    runner, comps = built(load(WORKLOADS[workload]), variant)
    for i in range(3):
        runner.step(i)
    ctx = runner.ctx
    items = []
    for comp in comps:
        for item in ctx.lower(comp):
            _, routine = ctx.compile_lowered("item", [item], local_check=False)
            items.append((describe(item), routine.call))
    # Every round feeds the next batch and runs every item once, in the routines' order, as
    # the steps do: the items see the values a step sees. Each item's time is the median of
    # its rounds: on a shared machine a mean takes in whatever else ran (convnet f32's items
    # once averaged 219 us in all beside a step of 171 us).
    spent: list[list[float]] = [[] for _ in items]
    for r in range(runs):
        runner.feed(3 + r)
        for k, (_, run) in enumerate(items):
            t0 = time.perf_counter()
            run()
            spent[k].append(time.perf_counter() - t0)
    out = [(statistics.median(t), what) for t, (what, _) in zip(spent, items, strict=True)]
    return sorted(out, reverse=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload")
    p.add_argument("variant")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--runs", type=int, default=50)
    a = p.parse_args(argv)
    rows = profile(a.workload, a.variant, a.runs)
    total = sum(t for t, _ in rows)
    print(f"{a.workload} {a.variant}: {len(rows)} items, {total * 1e3:.3f} ms in all")
    for t, what in rows[:a.top]:
        print(f"{t * 1e6:10.1f} us {100 * t / total:5.1f}%  {what}")


if __name__ == "__main__":
    main()
