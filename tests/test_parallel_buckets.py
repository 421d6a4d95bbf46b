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
from ocannl import Context, nn_blocks, optim, parallel, train
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
    (each summed in the memory both ranks map, a rank's half as soon as both have written
    it, between the parts of the last shard's backward code): one plain rank's bits."""
    ok(mpirun(2, "--out", tmp_path, "--tag", "over", "--overlap", script=TS.WORKER, timeout=120))
    for v in SW.VARIANTS:
        ref = SW.run(parallel.SingleProcess(), v)
        assert ref["shared_buckets"] == 0
        for r in TS.results(tmp_path, "over", v, 2):
            TS.assert_same_run(r, ref)
            assert r["shared_memory"] is True
            # synced batch norm buckets one shard a rank only (its statistics' exchanges cut
            # the routine); the others' every step sums two buckets or more
            synced = v.startswith("syncbn")
            assert (r["shared_buckets"] == 0) if synced else \
                (r["shared_buckets"] >= 2 * len(r["losses"])), (v, r["shared_buckets"])


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


def _same_plain(a: dict, b: dict) -> None:
    def plain(names: list[str]) -> list[str]:  # without the node ids
        return [n.rsplit("_", 1)[0] for n in names]

    assert plain(a["state_names"]) == plain(b["state_names"])
    for n, x, y in zip(a["state_names"], a["state"], b["state"], strict=True):
        assert np.array_equal(TS._bits(x), TS._bits(y)), n
    assert np.array_equal(TS._bits(np.asarray(a["losses"])), TS._bits(np.asarray(b["losses"])))


def test_the_update_waits_only_for_the_buckets_it_reads() -> None:
    """dp.compile_update with overlap: the update in dp.update_order, cut after each bucket's
    parameters; each part reads the gradients of its own bucket only (so it runs once that
    bucket is summed), and the run is the plain run's every bit."""
    plain = SW.run_plain(parallel.SingleProcess())
    assert plain["parts_read"] == []  # no overlap: the update is one routine
    over = SW.run_plain(parallel.SingleProcess(), overlap=True)
    assert over["buckets"] > 2
    assert over["parts_read"] == [[b] for b in range(over["buckets"])]
    _same_plain(over, plain)
    # ZeRO-1's update over 1-D parts: lowering fuses the loops of parts of one size (mlp_w0's
    # and mlp_w1's 32 elements), so a part may read two buckets; what it reads is found by
    # memory, and it waits for both
    zero = SW.run_plain(parallel.SingleProcess(), overlap=True, zero=True)
    assert zero["parts_read"] == [[0, 2], [1]]
    _same_plain(zero, plain)


def test_update_order_and_routine_are_checked() -> None:
    _, _, loss = TS._mlp(4)
    opt = optim.SGD(0.1)
    params = list(loss.params)
    with pytest.raises(ValueError, match=r"order must list each of the loss's 4 parameters "
                                         r"once; missing \['.*'\], not the loss's \[\], twice "
                                         r"\['.*'\]"):
        opt.update(loss, order=[params[0], *params[:-1]])
    assert opt.update(loss, order=params[::-1]).label  # every parameter once: accepted
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, overlap=True, bucket_bytes=64)
    with pytest.raises(ValueError, match=r"call setup\(ctx\) before asking for update_order"):
        dp.update_order  # noqa: B018
    with pytest.raises(ValueError, match=r"call setup\(ctx\) before compiling \(the update"):
        dp.compile_update(Context.cpu(), opt.update(loss))
    ctx = dp.setup(Context.cpu())
    assert [p.value.id for p in dp.update_order] == [p.value.id for p in params[::-1]]
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss))
    with pytest.raises(TypeError, match="update must be a Routine .*got str"):
        dp.run_and_reduce(ctx, grads, update="sgd")  # type: ignore[arg-type]


@needs_mpi
def test_two_ranks_update_as_their_buckets_arrive_with_the_bits_of_one(tmp_path: Path) -> None:
    """2 ranks of 2 shards, overlapped, the update run part by part as its buckets' sums
    arrive: one plain rank's bits."""
    ref = SW.run_plain(parallel.SingleProcess())
    # ZeRO-1: rank 0 updates mlp_w0 and mlp_b0 (two buckets, two parts), rank 1 mlp_w1 and
    # mlp_b1 (one bucket: its update is one routine)
    parts = {"plain": [[[0], [1], [2]]] * 2, "zero": [[[1], [2]], []]}
    for tag, more in (("plain", ()), ("zero", ("--zero",))):
        ok(mpirun(2, "--out", tmp_path, "--tag", tag, "--plain", "--overlap", "--steps", "6",
                  *more, script=TS.WORKER, timeout=120))
        for r in range(2):
            got = SW.load_result(tmp_path / f"{tag}-plain-rank{r}.npz")
            assert got["parts_read"] == parts[tag][r], (tag, r)
            _same_plain(got, ref)
