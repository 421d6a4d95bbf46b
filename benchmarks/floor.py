"""A training step's floor on this machine: what no implementation of the step can beat.

    .venv/bin/python -m benchmarks.floor gpt_mini [--rounds 20]

The floor of a workload's f32 step is the sum of

- **its products at the library's own rate**: every product the step runs (read from the
  lowered code of this project's f32 step: the same shapes, operands stored the same way,
  batched products as NumPy's stacked ``matmul``), timed as NumPy computes them;
- **one pass over the bytes it must touch**: every buffer it must read or write at least once
  (the parameters, their gradients, the optimizer's state, the inputs, and the activations
  backprop reads), at the bandwidth of a NumPy copy of that many bytes (half read, half
  written), timed in the same rounds.

Transcendental work is not part of the floor (a library's exp is no faster than this
project's): :func:`transcendentals` counts it, to report beside the floor where it is a visible
part of a step (gpt_mini's erf and exp).

:class:`FloorInRounds` times both parts inside ``measure.time_steps``' interleaved rounds (the
yardstick of ``benchmarks/run.py``); run alone, this module times the workload's f32 step
against its floor in alternating rounds and prints the ratio.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fixtures import Fixture, load  # noqa: E402
from benchmarks.measure import SETTLE_S  # noqa: E402
from benchmarks.sgemm import SgemmInRounds  # noqa: E402
from benchmarks.specs import WORKLOADS, Product  # noqa: E402

TRANSCENDENTAL = ("exp", "log", "erf", "tanh", "sqrt", "sin", "cos")


@dataclass(frozen=True)
class StepShape:
    """What the floor of a step is made of: its products and the bytes it must touch, by
    kind (``touched``: name -> bytes), and its transcendental evaluations (op -> cells)."""

    products: tuple[Product, ...]
    touched: dict[str, int]
    transcendentals: dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(self.touched.values())

    @property
    def flops(self) -> int:
        return sum(p.flops for p in self.products)


def step_shape(fx: Fixture) -> StepShape:
    """The f32 step of ``fx``'s workload as this project lowers it for the CPU."""
    from benchmarks.profile_items import built
    from ocannl.ir.lowered import Gemm, nodes_of

    runner, comps = built(fx, "f32")
    code = [item for comp in comps for item in runner.ctx.lower(comp)]
    products = tuple(Product(g.rows, g.inner, g.cols, g.a.transposed, g.b.transposed,
                             batch=math.prod(b.size for b in g.batch))
                     for g in code if isinstance(g, Gemm))
    return StepShape(products, must_touch(runner.loss_t, nodes_of(code)),
                     transcendentals(code))


def must_touch(loss, nodes) -> dict[str, int]:  # noqa: ANN001 - a Tensor, Tnodes
    """Bytes of every buffer the step must read or write at least once, by kind: the buffers
    it holds between steps (parameters, gradients, optimizer state, inputs, the loss), and the
    activations backprop reads (forward values its code reads)."""
    from ocannl.ir.assignments import reads
    from ocannl.ir.tnode import MemoryMode

    def size(n) -> int:  # noqa: ANN001
        return n.size * n.prec.itemsize

    params = {p.value.id: p.value for p in loss.params}
    grads = {p.grad.id: p.grad for p in loss.params if p.grad is not None}
    held = {n.id: n for n in nodes if n.memory_mode is MemoryMode.materialized
            and n.id not in params and n.id not in grads}
    forward = {t.value.id: t.value for t in loss.topo() if t.kind == "op"}
    acts = {g.node.id: g.node for t in loss.topo() for a in t.backprop_code
            for g in reads(a.expr) if g.node.id in forward}
    return {"parameters": sum(map(size, params.values())),
            "gradients": sum(map(size, grads.values())),
            "optimizer state, inputs, loss": sum(map(size, held.values())),
            "activations backprop reads": sum(map(size, acts.values()))}


def transcendentals(code) -> dict[str, int]:  # noqa: ANN001 - lowered code
    """How many times a step evaluates each transcendental op (cells times occurrences)."""
    from ocannl.ir.assignments import Apply
    from ocannl.ir.expr import walk
    from ocannl.ir.lowered import LoopGroup

    out: dict[str, int] = {}
    for item in code:
        if not isinstance(item, LoopGroup):
            continue
        for n in item.nests:
            points = math.prod(n.space)
            for e in walk(n.assign.expr):
                if isinstance(e, Apply) and e.op in TRANSCENDENTAL:
                    out[e.op] = out.get(e.op, 0) + points
    return out


class FloorInRounds(SgemmInRounds):
    """NumPy's sgemm, a pass over a step's products and a copy of the bytes it must touch,
    each timed in every round of ``measure.time_steps``: the floor is the medians of the last
    two, summed."""

    def __init__(self, shape: StepShape, seed: int = 0) -> None:
        super().__init__(products=shape.products, seed=seed)
        self.shape = shape
        half = max(1, shape.bytes // 2 // 4)  # f32 cells read, and as many written
        self.src = np.random.default_rng(seed).standard_normal(half, dtype=np.float32)
        self.dst = np.empty_like(self.src)
        self.copy_samples: list[float] = []
        np.copyto(self.dst, self.src)

    def time(self) -> None:
        super().time()
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.copy_samples.append(time.perf_counter() - t0)

    def copy_time(self) -> float | None:
        return float(np.median(self.copy_samples)) if self.copy_samples else None

    def floor(self) -> float | None:
        """The step's floor in seconds, or None before any round."""
        p, c = self.products_time(), self.copy_time()
        return None if p is None or c is None else p + c

    def record(self) -> dict:
        """What the report keeps of the floor: its seconds, its parts, and it in words."""
        return {"floor_s": self.floor(), "products_s": self.products_time(),
                "copy_s": self.copy_time(), "bytes": self.shape.bytes,
                "touched": self.shape.touched, "flops": self.shape.flops,
                "transcendentals": self.shape.transcendentals, "note": self.describe()}

    def describe(self) -> str:
        """The floor and its parts, in words."""
        p, c, f = self.products_time(), self.copy_time(), self.floor()
        if f is None or p is None or c is None:
            return "floor not timed"
        s = self.shape
        trans = ", ".join(f"{op} {cells / 1e6:.2f} M" for op, cells in
                          sorted(s.transcendentals.items())) or "none"
        return (f"floor {f * 1e3:.3f} ms: {len(s.products)} products ({s.flops / 1e9:.2f} "
                f"GFLOP) at NumPy's rate {p * 1e3:.3f} ms + {s.bytes / 2**20:.1f} MiB at "
                f"{s.bytes / c / 1e9:.1f} GB/s {c * 1e3:.3f} ms; transcendental cells a step: "
                f"{trans}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10, help="timed steps a round, at least")
    args = ap.parse_args(argv)
    from benchmarks.runners import make_runner

    fx = load(WORKLOADS[args.workload])
    shape = step_shape(fx)
    floor = FloorInRounds(shape)
    runner = make_runner(fx, "ocannl", "f32", "cpu")
    runner.build()
    t0 = time.perf_counter()
    for i in range(5):
        runner.step(i)
    # at least 50 ms of steps a round: a short step's first ones after the pause are slower
    per = max(args.steps, int(0.05 / ((time.perf_counter() - t0) / 5)))
    samples = []
    for k in range(args.rounds):
        floor.time()
        time.sleep(SETTLE_S)  # NumPy's BLAS threads spin a while after its last call
        for i in range(2):  # the pool's threads and the clock wake up after the pause
            runner.step(i)
        for i in range(per):
            runner.feed(k * per + i)
            t0 = time.perf_counter()
            runner._step()
            samples.append(time.perf_counter() - t0)
    step = float(np.median(samples))
    f = floor.floor()
    assert f is not None
    print(f"{args.workload} f32 step p50 {step * 1e3:.3f} ms; {floor.describe()}; "
          f"step / floor {step / f:.3f}")
    print("  bytes: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in shape.touched.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
