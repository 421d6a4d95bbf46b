"""ZeRO-1 (issue 41, item 4): the optimizer state sharded by slices of the parameters' flat
layout, updated by its owner, the parameters gathered; the bits of the unsharded run, and
checkpoints that hold the whole state (written by sharded ranks, resumed unsharded, and back).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shard_worker as SW
from test_parallel import _no_mpi, mpirun, ok
from test_parallel_shards import (
    WORKER,
    _mlp,
    assert_one_rank_is_the_plain_run,
    assert_same_run,
    results,
)

import ocannl.tensor as T
from ocannl import Context, checkpoint, nn_blocks, optim, parallel, train
from ocannl.parallel.zero import OptimizerShard

needs_mpi = pytest.mark.skipif(_no_mpi is not None, reason=str(_no_mpi))


def _mlp_wide() -> Any:
    """mlp_wide's parameters (256 -> 1024 -> 1024 -> 10): nothing is allocated."""
    T.set_seed(0)
    x = T.term(np.zeros((4, 256)), label="x")
    logits, _ = nn_blocks.mlp(x, [1024, 1024], 10)
    return T.mean(logits)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_slices_cover_every_element_once_and_hold_a_share_each(size: int) -> None:
    loss = _mlp_wide()
    params = loss.params
    total = sum(p.value.size for p in params)
    owned: dict[int, list[tuple[int, int]]] = {p.value.id: [] for p in params}
    held = []
    for rank in range(size):
        shard = OptimizerShard(params, rank, size)
        assert shard.length % size == 0 and shard.per == shard.length // size
        held.append(sum(q.size for q in shard.parts))
        for q in shard.parts:
            assert q.value.dims == q.grad.dims == (q.size,)
            owned[q.param.value.id].append((q.start, q.start + q.size))
    for p in params:  # consecutive runs from 0 to the parameter's end, none twice
        runs = sorted(owned[p.value.id])
        assert runs[0][0] == 0 and runs[-1][1] == p.value.size
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    assert sum(held) == total
    assert max(held) <= total / size * 1.05  # the target: 1/N + 5%


def test_one_rank_with_sharded_state_is_the_unsharded_run() -> None:
    """One rank owns every element: the parts are the whole parameters as 1-D views, the
    update runs over them, the allgather is a no-op; every bit as the plain run's."""
    assert_one_rank_is_the_plain_run(zero=True)


def test_a_sharded_state_is_refused_where_it_would_go_wrong(tmp_path: Path) -> None:
    x, y, loss = _mlp(4)
    with pytest.raises(TypeError, match="shard_optimizer must be True or False, got 'yes'"):
        parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y],
                              shard_optimizer="yes")  # type: ignore[arg-type]
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y],
                               shard_optimizer=True)
    ctx = dp.setup(Context.cpu())
    ctx = train.init_params(ctx, loss)
    opt = optim.Adam(0.01)
    state = checkpoint.training_state(loss, opt)
    # before the update over the slice is built, no rank holds its slice of the state
    with pytest.raises(ValueError, match="build the optimizer's update over this rank's slice"):
        dp.save(tmp_path / "c.safetensors", ctx, state, checkpoint.Progress(step=0))
    assert not (tmp_path / "c.safetensors").exists()
    _, _, other = _mlp(4)
    with pytest.raises(ValueError, match="was cut from another model's parameters"):
        opt.update(other, shard=dp.optimizer_shard)
    # an update of the whole parameters, not the slice: the gather is refused
    ctx, grads = ctx.compile(train.grad_update(loss))
    dp.use_routines(grads)
    ctx, whole = ctx.compile(optim.SGD(0.1).update(loss, grad_unscale=dp.grad_unscale()))
    ctx = dp.set_batch(ctx, np.ones((4, 2)), np.eye(2)[[0, 1, 0, 1]]).run(grads)
    ctx = dp.reduce(ctx).run(whole)
    with pytest.raises(ValueError, match="no optimizer update was built over this rank's "
                                         "slice"):
        dp.after_update(ctx)
    # the slice's update, but no gather after it: the next step's reduce refuses
    ctx, update = ctx.compile(opt.update(loss, grad_unscale=dp.grad_unscale(),
                                         shard=dp.optimizer_shard))
    with pytest.raises(ValueError, match=r"call dp.after_update\(ctx, applied\) after the "
                                         r"optimizer's update"):
        dp.reduce(ctx)
    ctx = dp.after_update(ctx.run(update))
    with pytest.raises(TypeError, match="applied must be True or False, got 1"):
        dp.after_update(ctx, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already shards the state of"):
        optim.SGD(0.1).update(loss, shard=dp.optimizer_shard)


# --- under mpiexec ------------------------------------------------------------------------------


@needs_mpi
def test_two_ranks_with_sharded_state_are_the_bits_of_one_and_resume_either_way(
        tmp_path: Path) -> None:
    """Every variant on 2 ranks, each holding half the optimizer state (the parameters
    gathered in shared memory): the unsharded 1-rank run's bits; its checkpoint at step 5
    (the whole state, gathered) resumed by one unsharded rank, whose checkpoint at step 6 two
    sharded ranks resume: the uninterrupted run."""
    refs = {v: SW.run(parallel.SingleProcess(), v) for v in SW.VARIANTS}
    ck = tmp_path / "zero.safetensors"
    ok(mpirun(2, "--out", tmp_path, "--tag", "zero", "--zero", "--save-at", "5",
              "--checkpoint", ck, script=WORKER, timeout=120))
    for v in SW.VARIANTS:
        rs = results(tmp_path, "zero", v, 2)
        for r in rs:
            assert_same_run(r, refs[v])
            # the gradients' sum and the parameters' gather in memory both ranks map
            assert r["shared_memory"] is True
        # the optimizer's buffers are split, never held twice: about half each
        assert sum(r["state_bytes"] for r in rs) == refs[v]["state_bytes"]
        assert all(0 < r["state_bytes"] < refs[v]["state_bytes"] for r in rs)
    ck1 = tmp_path / "one.safetensors"
    for v in SW.VARIANTS:
        res = SW.run(parallel.SingleProcess(), v, save_at=6,
                     ckpt=ck1.with_suffix(f".{v}.safetensors"),
                     resume=ck.with_suffix(f".{v}.safetensors"))
        assert res["start"] == 5
        assert_same_run(res, refs[v] | {"losses": res["losses"]})
    ok(mpirun(2, "--out", tmp_path, "--tag", "back", "--zero", "--resume", ck1,
              script=WORKER, timeout=120))
    for v in SW.VARIANTS:
        for r in results(tmp_path, "back", v, 2):
            assert r["start"] == 6
            assert_same_run(r, refs[v] | {"losses": r["losses"]})
            assert np.array_equal(r["losses"][6:], refs[v]["losses"][6:], equal_nan=True)
