"""Overlap (issue 41, item 3): the gradients' exchange in buckets, each started as soon as the
backward code has written it; the same additions in the same order, so the same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import shard_worker as SW
import test_parallel_shards as TS
from test_parallel import _no_mpi, mpirun, ok

import ocannl.tensor as T
from ocannl import Context, nn_blocks, parallel, train
from ocannl.parallel.buckets import bucket_ranges

needs_mpi = pytest.mark.skipif(_no_mpi is not None, reason=str(_no_mpi))


def test_buckets_hold_whole_parameters_from_the_end_and_cover_the_buffer() -> None:
    offsets, sizes, length = [0, 64, 128, 1152], [40, 8, 1000, 10], 1162
    assert bucket_ranges(offsets, sizes, length, 4000) == [
        (128, 1162, [2, 3]), (0, 128, [0, 1])]
    assert bucket_ranges(offsets, sizes, length, 1) == [
        (1152, 1162, [3]), (128, 1152, [2]), (64, 128, [1]), (0, 64, [0])]
    assert bucket_ranges(offsets, sizes, length, 10**9) == [(0, 1162, [0, 1, 2, 3])]
    # ZeRO-1's padding at the end goes with the last bucket
    assert bucket_ranges([0], [5], 8, 4) == [(0, 8, [0])]


def test_a_routine_cut_after_its_gradients_is_the_whole_routine() -> None:
    """Context.compile_split: parts that end where each group was last written; run in
    order, the very bits of the whole routine (its local nodes shared across the parts)."""
    T.set_seed(0)
    x = T.term(np.random.default_rng(0).normal(size=(8, 4)), label="x")
    h, _ = nn_blocks.mlp(x, [16, 16], 3)
    loss = T.mean(h * h)
    comp = train.grad_update(loss)
    grads = [p.grad for p in loss.params]
    ctx = train.init_params(Context.cpu(), loss)
    ctx, whole = ctx.compile(comp)
    want = [np.array(ctx.run(whole).get_values(g), copy=True) for g in grads]
    ctx2 = Context.cpu()
    for p in loss.params:
        ctx2 = ctx2.set_values(p, ctx.get_values(p))
    ctx2, parts, ready = ctx2.compile_split(comp, [[g] for g in reversed(grads)])
    assert len(parts) > 2 and ready == sorted(ready)  # the last layer's gradient first
    for part in parts:
        ctx2 = ctx2.run(part)
    for g, w in zip(grads, want, strict=True):
        assert np.array_equal(TS._bits(ctx2.get_values(g)), TS._bits(w))
    with pytest.raises(TypeError, match="compile_split expects a Comp"):
        ctx2.compile_split(loss, [])  # type: ignore[arg-type]


def test_one_rank_overlapped_is_the_plain_run() -> None:
    TS.assert_one_rank_is_the_plain_run(overlap=True)


def test_overlap_settings_are_checked() -> None:
    _, _, loss = TS._mlp(4)
    with pytest.raises(TypeError, match="overlap must be True or False, got 'on'"):
        parallel.DataParallel(parallel.SingleProcess(), loss, overlap="on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_bytes must be an integer >= 1, got 0"):
        parallel.DataParallel(parallel.SingleProcess(), loss, overlap=True, bucket_bytes=0)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, overlap=True)
    with pytest.raises(ValueError, match=r"call setup\(ctx\) before compiling"):
        dp.compile_gradients(Context.cpu(), train.grad_update(loss))


@needs_mpi
def test_two_ranks_overlapped_are_the_bits_of_one(tmp_path: Path) -> None:
    """Every variant on 2 ranks, 2 shards each, the exchange in buckets of about a parameter
    (each an allreduce of two, started after the part of the last shard's backward code that
    completes it): one plain rank's bits."""
    ok(mpirun(2, "--out", tmp_path, "--tag", "over", "--overlap", script=TS.WORKER, timeout=120))
    for v in SW.VARIANTS:
        ref = SW.run(parallel.SingleProcess(), v)
        for r in TS.results(tmp_path, "over", v, 2):
            TS.assert_same_run(r, ref)


@needs_mpi
def test_with_the_order_off_buckets_sum_as_the_whole_buffer(tmp_path: Path) -> None:
    """MPI's own allreduce (fixed_order=False, a shard a rank): on 2 ranks each bucket's sum is
    one addition per element, so the bucketed exchange gives the whole buffer's bits."""
    v = "adamw-fused-f16-clip"
    for tag, flags in (("whole", ()), ("buckets", ("--overlap",))):
        ok(mpirun(2, "--out", tmp_path, "--tag", tag, "--shards", "2", "--order-off",
                  "--variants", v, *flags, script=TS.WORKER, timeout=120))
    whole = TS.results(tmp_path, "whole", v, 2)
    for r in TS.results(tmp_path, "buckets", v, 2):
        TS.assert_same_run(r, whole[0])
