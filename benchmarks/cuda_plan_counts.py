"""Count the kernels of the CUDA plan of every benchmark step, from the pure plan (no GPU).

    .venv/bin/python benchmarks/cuda_plan_counts.py [--workloads mlp_wide ...]

For each workload and variant, the routines the CPU runner compiles are lowered for the CUDA
target (``plan.cuda_target()``) and planned; the kernels are counted by what they do: a cast
of a master into its cast twin (a group of copies from materialized wide nodes into local
16-bit ones: what a virtual twin makes unnecessary), a conversion (a copy between precisions
for a product: an f32 copy of a 16-bit operand, a 16-bit target rounded from its f32 result),
other kernels, and cuBLAS calls (those over batch axes: strided-batched). Around 16-bit
products: ``widen``, kernels making f32 copies of a product's 16-bit operands (none where both
operands are of one 16-bit precision: gemmEx takes them as stored), and ``round``, kernels
rounding a product's f32 result into its 16-bit target. ``graphs/step``: the routine calls of
the runner's first :data:`STEPS` steps (run on the CPU), per step: on CUDA each is one graph
launch (``runtime.BoundRoutine``), whatever its kernels and cuBLAS calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fixtures import load  # noqa: E402
from benchmarks.runners import make_runner  # noqa: E402
from benchmarks.specs import VARIANTS, WORKLOADS  # noqa: E402
from ocannl.backends.cuda.plan import GemmCall, Kernel, cuda_target, plan_routine  # noqa: E402
from ocannl.ir.assignments import Get  # noqa: E402
from ocannl.ir.lowering import Gemm, LoopGroup, Lowered, lower  # noqa: E402
from ocannl.ir.tnode import MemoryMode  # noqa: E402

STEPS = 16  # the f16-gated16 variant's host check comes every 16 steps


def _kind(item: Lowered) -> str:
    """What a lowered item does: "twin" (casts masters into twins), "convert" (only copies
    between precisions), "gemm", or "other"."""
    if not isinstance(item, LoopGroup):
        return "gemm" if isinstance(item, Gemm) else "other"
    copies = [n for n in item.nests if isinstance(n.assign.expr, Get) and not n.red
              and n.assign.expr.node.prec is not n.assign.lhs.prec]
    if len(copies) != len(item.nests):
        return "other"
    if all(n.assign.lhs.prec.is_narrow and n.assign.lhs.memory_mode is not MemoryMode.materialized
           and n.assign.expr.node.memory_mode is MemoryMode.materialized for n in copies):
        return "twin"
    return "convert"


def _around_products(code: list[Lowered]) -> tuple[int, int]:
    """(kernels widening a product's 16-bit operands, kernels rounding a product's f32 result
    into a 16-bit target) in lowered code."""
    operands = {v.node.id for g in code if isinstance(g, Gemm) for v in (g.a, g.b)}
    results = {g.assign.lhs.id for g in code if isinstance(g, Gemm)}
    widen = rounded = 0
    for item in code:
        if _kind(item) != "convert":
            continue
        assert isinstance(item, LoopGroup)
        pairs = [(n.assign.expr.node, n.assign.lhs) for n in item.nests
                 if isinstance(n.assign.expr, Get)]
        if any(src.prec.is_narrow and dst.id in operands for src, dst in pairs):
            widen += 1
        elif any(dst.prec.is_narrow and src.id in results for src, dst in pairs):
            rounded += 1
    return widen, rounded


def counts(workload: str, variant: str) -> dict[str, float]:
    """The kernels of the CUDA plans of the routines ``variant``'s runner compiles, and the
    routine calls per step of its first :data:`STEPS` steps."""
    from ocannl import context

    comps = []
    launching: set[int] = set()  # routines whose CUDA plan launches something
    compile_, run_ = context.Context.compile, context.Context.run
    calls = [0]

    def capture(self: context.Context, comp: object, bindings: object = None) -> object:
        comps.append(comp)
        out = compile_(self, comp, bindings)
        if plan_routine(lower(comp, cuda_target())).steps:
            launching.add(id(out[1]))
        return out

    def run(self: context.Context, routine: object) -> object:
        calls[0] += id(routine) in launching
        return run_(self, routine)

    context.Context.compile = capture  # type: ignore[method-assign]
    context.Context.run = run  # type: ignore[method-assign]
    try:
        runner = make_runner(load(WORKLOADS[workload]), "ocannl", variant, "cpu")
        runner.build()
        calls[0] = 0
        for i in range(STEPS):
            runner.step(i)
    finally:
        context.Context.compile = compile_  # type: ignore[method-assign]
        context.Context.run = run_  # type: ignore[method-assign]
    out: dict[str, float] = {"twin": 0, "convert": 0, "other": 0, "gemm": 0, "kernels": 0,
                             "cublas": 0, "batched": 0, "widen": 0, "round": 0}
    for comp in comps:
        code = lower(comp, cuda_target())
        for item in code:
            out[_kind(item)] += 1
        widen, rounded = _around_products(code)
        out["widen"] += widen
        out["round"] += rounded
        plan = plan_routine(code)
        out["kernels"] += sum(isinstance(s, Kernel) for s in plan.steps)
        out["cublas"] += sum(isinstance(s, GemmCall) for s in plan.steps)
        out["batched"] += sum(isinstance(s, GemmCall) and bool(s.gemm.batch)
                              for s in plan.steps)
    out["graphs_per_step"] = calls[0] / STEPS
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = ap.parse_args(argv)
    print("| workload | variant | twin casts | conversions | widen | round | other kernels "
          "| kernels | cuBLAS | batched | graphs/step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for w in args.workloads:
        for v in args.variants:
            c = counts(w, v)
            print(f"| {w} | {v} | {c['twin']} | {c['convert']} | {c['widen']} | {c['round']} "
                  f"| {c['other']} | {c['kernels']} | {c['cublas']} | {c['batched']} "
                  f"| {c['graphs_per_step']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
