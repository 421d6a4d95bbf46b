"""Synced batch norm in a data-parallel step (issue 41, item 1): ``batch_norm(sync=True)``
normalizes a shard with the statistics of the global batch, exchanged inside the forward and
the backward code (``T.global_standardize``, ``parallel/synced.py``). On one rank computing
4 shards it is batch norm over the global batch (the per-shard default is not); the bits on
2 and 4 ranks, and a resume across rank counts, are ``test_parallel_shards.py``'s (the
``syncbn-host-f32`` variant of ``tests/shard_worker.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, mixed_prec, nn_blocks, optim, parallel, train
from ocannl.ir.assignments import Accum, Comp, Const, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

ROWS = 8
SHARDS = 4


def _model(rows: int, sync: bool) -> tuple[T.Tensor, T.Tensor, T.Tensor, Any]:
    """A small MLP with batch norm over ``rows`` rows, its parameters from seed 0."""
    T.set_seed(0)
    x = T.term(np.zeros((rows, 3)), label="x")
    y = T.term(np.zeros((rows, 2)), label="y")
    h, _ = nn_blocks.mlp(x, [6], 6, label="body")
    h, bn = nn_blocks.batch_norm(h, train=True, label="bn", sync=sync)
    logits, _ = nn_blocks.mlp(T.relu(h), [], 2, label="head")
    return x, y, nn_blocks.softmax_cross_entropy(logits, y), bn


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    # Shards of unlike statistics: their own means and spreads differ from the batch's.
    xs = rng.normal(size=(ROWS * SHARDS, 3)) * np.repeat([0.5, 1.0, 2.0, 4.0], ROWS)[:, None]
    xs += np.repeat([-2.0, 0.0, 1.0, 3.0], ROWS)[:, None]
    return xs, np.eye(2)[rng.integers(0, 2, ROWS * SHARDS)]


def _one_step_on_shards(sync: bool) -> dict[str, Any]:
    """One SGD step of the model over 4 shards on one rank: loss, gradients (of the global
    batch's mean loss), running statistics, parameters after."""
    x, y, loss, bn = _model(ROWS, sync)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=SHARDS)
    ctx = dp.setup(Context.cpu())
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss))
    dp.use_routines(grads)
    ctx, update = ctx.compile(optim.SGD(0.1).update(loss, grad_unscale=dp.grad_unscale()))
    ctx = train.init_params(ctx, loss)
    ctx = dp.set_batch(ctx, *_data())
    ctx = dp.run_and_reduce(ctx, grads)
    out = {"loss": dp.global_loss(),
           "grads": [ctx.get_values(p.grad) / SHARDS for p in loss.params],
           "stats": [ctx.get_values(bn.running_mean), ctx.get_values(bn.running_var)]}
    ctx = ctx.run(update)
    out["params"] = [ctx.get_values(p) for p in loss.params]
    return out


def _one_step_on_the_batch() -> dict[str, Any]:
    """The same step, the global batch in one plain run (per-batch batch norm)."""
    x, y, loss, bn = _model(ROWS * SHARDS, False)
    ctx, grads = Context.cpu().compile(train.grad_update(loss))
    ctx, update = ctx.compile(optim.SGD(0.1).update(loss))
    ctx = train.init_params(ctx, loss)
    xs, ys = _data()
    ctx = ctx.set_values(x, xs).set_values(y, ys).run(grads)
    out = {"loss": ctx.get_value(loss),
           "grads": [ctx.get_values(p.grad) for p in loss.params],
           "stats": [ctx.get_values(bn.running_mean), ctx.get_values(bn.running_var)]}
    ctx = ctx.run(update)
    out["params"] = [ctx.get_values(p) for p in loss.params]
    return out


def _furthest(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference over every compared array, relative to the largest value of
    its kind (a bias before batch norm has a gradient of zero up to rounding)."""
    worst = abs(a["loss"] - b["loss"]) / abs(b["loss"])
    for kind in ("grads", "stats", "params"):
        scale = max(float(np.max(np.abs(v))) for v in b[kind])
        worst = max(worst, *(float(np.max(np.abs(u - v))) / scale
                             for u, v in zip(a[kind], b[kind], strict=True)))
    return worst


def test_synced_batch_norm_over_shards_is_batch_norm_over_the_global_batch() -> None:
    """One rank, 4 shards of unlike statistics: with ``sync=True`` the loss, every gradient,
    the running statistics and the parameters after an SGD step are the plain run's over the
    32 rows within f32 rounding; with the per-shard default they are far from it."""
    whole = _one_step_on_the_batch()
    assert _furthest(_one_step_on_shards(sync=True), whole) < 2e-6
    assert _furthest(_one_step_on_shards(sync=False), whole) > 1e-2


def test_synced_batch_norm_needs_the_split_routine_and_one_micro_batch() -> None:
    """Refused with a message, before any exchange: a gradient routine compiled by the
    context alone (its statistics would be the shard's), ``reduce`` after ``ctx.run``, and
    gradient accumulation (each micro-batch's statistics would need exchanges of their
    own)."""
    x, y, loss, _ = _model(ROWS, True)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=2)
    ctx = dp.setup(Context.cpu())
    ctx, plain = ctx.compile(train.grad_update(loss))
    ctx = train.init_params(ctx, loss)
    ctx = dp.set_batch(ctx, *(a[:2 * ROWS] for a in _data()))
    with pytest.raises(ValueError, match=r"was not compiled by this DataParallel: with synced "
                                         r"batch norm compile the gradient routine with "
                                         r"dp.compile"):
        dp.run_and_reduce(ctx, plain)
    with pytest.raises(ValueError, match=r"run it through dp.run_and_reduce"):
        dp.reduce(ctx.run(plain))
    assert dp.step == 0 and dp.reductions == 0

    x, y, loss, _ = _model(ROWS, True)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y])
    ctx = dp.setup(Context.cpu())
    scaler = mixed_prec.Loss_scaler.create(init_scale=1.0)
    recipe = mixed_prec.scaled_step(scaler, loss, optim.SGD(0.1), reducer=dp, accumulate=2)
    with pytest.raises(ValueError, match=r"synced batch norm with gradient accumulation is not "
                                         r"supported"):
        dp.compile(ctx, recipe)


def test_a_split_that_would_hand_a_reader_the_unreplaced_values_is_refused() -> None:
    """``compile_split(..., replaced=True)``: ``b`` reads ``a`` between two writes of ``a``, so
    no cut after ``a``'s last write could give ``b`` the replaced values."""
    a = Tnode("a", (4,), Precision.f32)
    b = Tnode("b", (4,), Precision.f32)
    code = (Accum(a, (0,), "=", Const(1.0), (4,)),
            Accum(b, (0,), "=", apply("mul", Get(a, (0,)), Const(2.0)), (4,)),
            Accum(a, (0,), "+", Const(1.0), (4,)))
    comp = Comp(code, "early")
    with pytest.raises(ValueError, match=r"early: b_\d+ reads a_\d+ before the cut after which its "
                                         r"values are replaced"):
        Context.cpu().compile_split(comp, [[a]], replaced=True)
    _, parts, ready = Context.cpu().compile_split(comp, [[a]])  # not replaced: any cut goes
    assert ready == [0] and len(parts) == 1


def test_overlapped_buckets_between_the_exchanges_keep_the_bits() -> None:
    """One shard a rank with ``overlap=True``: the routine is cut at the statistics' sums and
    after each bucket of about a parameter, each bucket's exchange started between the parts;
    every bit of the run is the one without overlap."""
    import shard_worker as SW
    from test_parallel_shards import assert_same_run

    v = "syncbn-host-f32"
    assert_same_run(SW.run(parallel.SingleProcess(), v, shards=1, overlap=True),
                    SW.run(parallel.SingleProcess(), v, shards=1))
