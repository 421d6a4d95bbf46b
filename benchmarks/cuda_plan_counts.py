"""Count the kernels of the CUDA plan of every benchmark step, from the pure plan (no GPU).

    .venv/bin/python benchmarks/cuda_plan_counts.py [--workloads mlp_wide ...]

For each workload and variant, the routines the CPU runner compiles are lowered for the CUDA
target (``plan.cuda_target()``) and planned; the kernels are counted by what they do: a cast
of a master into its cast twin (a group of copies from materialized wide nodes into local
16-bit ones: what a virtual twin makes unnecessary), a conversion (a copy between precisions
for a product: an f32 copy of a 16-bit operand, a 16-bit target rounded from its f32 result),
other kernels, and cuBLAS calls.
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


def counts(workload: str, variant: str) -> dict[str, int]:
    """The kernels of the CUDA plans of the routines ``variant``'s runner compiles."""
    from ocannl import context

    comps = []
    compile_ = context.Context.compile

    def capture(self: context.Context, comp: object, bindings: object = None) -> object:
        comps.append(comp)
        return compile_(self, comp, bindings)

    context.Context.compile = capture  # type: ignore[method-assign]
    try:
        make_runner(load(WORKLOADS[workload]), "ocannl", variant, "cpu").build()
    finally:
        context.Context.compile = compile_  # type: ignore[method-assign]
    out = {"twin": 0, "convert": 0, "other": 0, "gemm": 0, "kernels": 0, "cublas": 0}
    for comp in comps:
        code = lower(comp, cuda_target())
        for item in code:
            out[_kind(item)] += 1
        plan = plan_routine(code)
        out["kernels"] += sum(isinstance(s, Kernel) for s in plan.steps)
        out["cublas"] += sum(isinstance(s, GemmCall) for s in plan.steps)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = ap.parse_args(argv)
    print("| workload | variant | twin casts | conversions | other kernels | kernels | cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    for w in args.workloads:
        for v in VARIANTS:
            c = counts(w, v)
            print(f"| {w} | {v} | {c['twin']} | {c['convert']} | {c['other']} | {c['kernels']} "
                  f"| {c['cublas']} |", flush=True)


if __name__ == "__main__":
    main()
