"""What the fixed shard order costs a data-parallel step on one rank, against its floor, in one
process, steps interleaved (one thread, as ``data_parallel.py``'s rows).

    .venv/bin/python benchmarks/ab_shard_order.py [--workloads mlp_wide convnet gpt_mini]
        [--rounds 10] [--steps 20]

Two steps over the same global batch, ``DataParallel(SingleProcess)``: the order off (one shard,
the plain step's routine) and the order on (``data_parallel.shard_count`` shards, each shard's
gradient computed whole and the shards summed in the tree's order). The order on cannot do with
less than each shard's gradient routine run whole and the tree's additions of the gradient
buffer (S - 1 passes); its floor is the order-off step with its routine replaced by those:

    floor = off step - off routine + S x shard routine + the tree's S - 1 additions

each term the median of its own timings in the same rounds; the additions are timed as the
order-on step runs them (on buffers its routines have just written, not warm in a cache: on
mlp_wide 0.20 ms, where the same addition on two warm buffers took 0.09 ms), in steps of their
own after each round's, so the timed steps carry no timer of theirs. Printed per workload: the
p50 of each step, the routines and the additions, the order's cost (on / off, the p50 of the rounds'
ratios, with the p10-p90 spread), the floor's ratio to the order-off step, and the order-on
step over its floor.
"""

from __future__ import annotations

import os

for _var in ("OCANNL_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import fixtures, models  # noqa: E402
from benchmarks.data_parallel import shard_count, shard_model  # noqa: E402
from benchmarks.interleaved import interleaved  # noqa: E402
from benchmarks.specs import WORKLOADS, Workload  # noqa: E402
from ocannl import Context, parallel, train  # noqa: E402


def build(w: Workload, shards: int) -> dict[str, Any]:
    """A one-rank data-parallel step of ``w``: ``shards`` shards in the tree's order, or (0) one
    shard with the order off. Returns the step and the bare gradient routine's call."""
    fx = fixtures.load(w)
    targets = models.feed_targets(fx)
    count = shards or 1
    x, y, loss, layers = shard_model(w, fx, w.batch // count)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=count,
                               fixed_order=shards > 0)
    ctx = dp.setup(Context.cpu())
    opt = models.ocannl_optimizer(w)
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss))
    dp.use_routines(grads)
    ctx, update = dp.compile_update(ctx, opt.update(loss, grad_unscale=dp.grad_unscale()))
    ctx = models.set_ocannl_weights(ctx, layers, fx.weights)
    state = {"i": 0}

    def step() -> None:
        k = state["i"] % w.n_batches
        state["i"] += 1
        dp.set_batch(ctx, fx.x[k], targets[k])
        dp.run_and_reduce(ctx, grads, update=update)

    step()
    buf = ctx.device_buffer(dp.flat)
    return {"step": step, "routine": lambda: ctx.run(grads), "elements": int(buf.size),
            "dp": dp}


def timed(fn: Callable[[], object], calls: int) -> float:
    spent = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        spent.append(time.perf_counter() - t0)
    return statistics.median(spent)


def additions_in_step(step: Callable[[], None], calls: int, dp: Any) -> list[float]:
    """Per call of ``step``, the seconds its shard tree's additions took: the addition of
    ``dp``'s plain-step plans (made by the step's first run) wrapped for the calls, each
    addition timed where the step does it."""
    spent = [0.0]

    def add(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = np.add(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        return out

    plans = list(dp._blocks.values())
    if not plans:
        raise RuntimeError(f"{dp!r} made no plain-step plan: its additions cannot be timed")
    kept = [plan.add for plan in plans]
    for plan in plans:
        plan.add = add
    try:
        per_call = []
        for _ in range(calls):
            spent[0] = 0.0
            step()
            per_call.append(spent[0])
    finally:
        for plan, a in zip(plans, kept, strict=True):
            plan.add = a
    return per_call


def measure(w: Workload, rounds: int, steps: int) -> dict[str, float]:
    shards = shard_count(w)
    off, on = build(w, 0), build(w, shards)
    parts: dict[str, list[float]] = {"off_routine": [], "shard_routine": [], "add": []}
    ratios: list[float] = []
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        t, r = interleaved([off["step"], on["step"]], 1, steps)
        times[0] += t[0]
        times[1] += t[1]
        ratios += r
        parts["off_routine"].append(timed(off["routine"], steps))
        parts["shard_routine"].append(timed(on["routine"], steps))
        parts["add"].append(statistics.median(additions_in_step(on["step"], steps, on["dp"])))
    p = {k: statistics.median(v) for k, v in parts.items()}
    off_step, on_step = statistics.median(times[0]), statistics.median(times[1])
    floor = off_step - p["off_routine"] + shards * p["shard_routine"] + p["add"]
    q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else [ratios[0]] * 9
    return {"shards": shards, "off": off_step, "on": on_step, **p, "floor": floor,
            "cost": statistics.median(ratios), "cost_p10": q[0], "cost_p90": q[-1]}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["mlp_wide", "convnet", "gpt_mini"],
                    choices=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        ap.error(f"--rounds and --steps must be >= 1, got {args.rounds} and {args.steps}")

    def ms(s: float) -> str:
        return f"{s * 1e3:.3f} ms"

    rows = []
    for name in args.workloads:
        m = measure(WORKLOADS[name], args.rounds, args.steps)
        rows.append({"workload": name, **m})
        print(f"{name}: {m['shards']} shards; step off {ms(m['off'])}, on {ms(m['on'])}; "
              f"routine whole {ms(m['off_routine'])}, a shard's {ms(m['shard_routine'])}; "
              f"the additions {ms(m['add'])}")
        print(f"  order cost (on / off) {m['cost']:.3f}x (p10-p90 {m['cost_p10']:.3f}-"
              f"{m['cost_p90']:.3f}); floor / off {m['floor'] / m['off']:.3f}x; "
              f"on / floor {m['on'] / m['floor']:.3f}x")
    return rows


if __name__ == "__main__":
    main()
