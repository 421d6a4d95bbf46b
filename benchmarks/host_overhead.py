"""Per-step host time of the mixed-precision recipes on a model too small for its routines to
matter: what the Python between the routine calls costs.

    PYTHONPATH=. .venv/bin/python benchmarks/host_overhead.py [--steps N] [--repeats R]

A 2 -> 4 -> 2 relu MLP at batch 2 with f16 cast twins and SGD. Each row is timed as the
minimum over ``--repeats`` blocks of ``--steps`` calls, the rows' blocks taking turns (the
machine's fast state, whatever the other processes do), every call through a lambda, in
microseconds a step: each routine called alone (``Routine.call``, the floor), ``Context.run``
of the static step, and the two recipes' ``step``: ``scaled_step`` (gradient routine,
checksum read, update routine, ``Loss_scaler.update``) and ``gated_step`` (one routine, the
host sampling every 16 steps). ``over its calls`` is a row less its routines' own calls:
the host's Python. The figures are in ``benchmarks/OBSTACLES.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import ocannl.tensor as T  # noqa: E402
from ocannl import Context, mixed_prec, nn_blocks, optim, train  # noqa: E402


def per_step_us(fs: list[Callable[[], object]], steps: int, repeats: int) -> list[float]:
    """Each callable's time a call, the minimum over ``repeats`` blocks of ``steps`` calls,
    the callables' blocks taking turns (so that each meets the machine's every state)."""
    best = [float("inf")] * len(fs)
    for _ in range(repeats):
        for k, f in enumerate(fs):
            t0 = time.perf_counter()
            for _ in range(steps):
                f()
            best[k] = min(best[k], time.perf_counter() - t0)
    return [b / steps * 1e6 for b in best]


def build(prec: str = "f16") -> tuple[Context, object, object, object]:
    x = T.term(np.zeros((2, 2)), label="x", prec=prec)
    y = T.term(np.zeros((2, 2)), label="y")
    logits, _ = mixed_prec.with_master_weights(prec=prec, f=lambda: nn_blocks.mlp(x, [4], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    ctx = Context.cpu()
    ctx = ctx.set_values(x, np.array([[0.5, -1.0], [1.5, 0.25]]))
    ctx = ctx.set_values(y, np.array([[1.0, 0.0], [0.0, 1.0]]))
    return ctx, x, y, loss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2_000, help="calls a timed block")
    ap.add_argument("--repeats", type=int, default=50, help="timed blocks of each")
    args = ap.parse_args(argv)

    ctx, _, _, loss = build()
    scaler = mixed_prec.Loss_scaler.create(init_scale=1024.0)
    static = (train.grad_update(loss, loss_scale=scaler.scale)
              + optim.SGD(0.01).update(loss, grad_unscale=scaler.unscale))
    ctx = train.init_params(ctx, loss)
    ctx, routine = ctx.compile(static)
    ctx = ctx.run(routine)
    call = routine.call
    timed: list[Callable[[], object]] = [lambda: call(), lambda: ctx.run(routine)]
    labels = ["static: Routine.call", "static: Context.run"]
    floors: dict[int, list[int]] = {1: [0]}  # row -> the rows of its routines' own calls

    for name, make in (("scaled_step", mixed_prec.scaled_step),
                       ("gated_step/16", mixed_prec.gated_step)):
        c, _, _, loss = build()
        sc = mixed_prec.Loss_scaler.create(init_scale=1024.0, growth_interval=10**9)
        recipe = make(sc, loss, optim.SGD(0.01))
        c = recipe.compile(c)
        c = train.init_params(c, loss)
        for _ in range(40):  # past the first, checked runs
            c = recipe.step(c)
        # The same computations compiled again (the same code, from the cache): their calls
        # are the floor under the recipe's step.
        comps = ([recipe.grad_comp, recipe.update_comp] if isinstance(recipe, mixed_prec.ScaledStep)
                 else [recipe.comp])
        rows = []
        for comp in comps:
            c, r = c.compile(comp)
            c = c.run(r)
            rows.append(len(timed))
            timed.append(lambda f=r.call: f())
            labels.append(f"{name}: {comp.label} call")
        floors[len(timed)] = rows
        timed.append(lambda rec=recipe, cc=c: rec.step(cc))
        labels.append(f"{name}: step")

    us = per_step_us(timed, args.steps, args.repeats)
    print(f"per step, min of {args.repeats} blocks of {args.steps} calls, blocks in turn (us):")
    for k, (label, t) in enumerate(zip(labels, us, strict=True)):
        over = f"  over its calls {t - sum(us[j] for j in floors[k]):6.3f}" if k in floors else ""
        print(f"  {label:44s} {t:7.3f}{over}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
