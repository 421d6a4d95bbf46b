"""The same bits on any number of ranks (issue 41, items 1 and 2): a global batch cut into a
fixed number of shards whose gradients are summed in one fixed tree order, whichever ranks
computed them (``ocannl.parallel.ShardTree``, ``DataParallel(shards=...)``).

Under ``mpiexec`` (tests/shard_worker.py): every state node, the scaler's and the recipe's
counters, the global losses and the loader's position are the same bits on 1 rank (in this
process), 2 and 4 ranks (4 shards), on 1 and 3 ranks with 6 shards (the optimizer state
sharded too), and on 1 and 8 ranks with 8 shards, synced batch norm included; a checkpoint written
by 4 ranks, resumed by 1, whose checkpoint 2 ranks resume, ends as the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shard_worker as SW
from test_parallel import _no_mpi, mpirun, ok

import ocannl.tensor as T
from ocannl import Context, Failure, nn_blocks, optim, parallel, train

WORKER = Path(__file__).resolve().parent / "shard_worker.py"
needs_mpi = pytest.mark.skipif(_no_mpi is not None, reason=str(_no_mpi))
COUNTERS = ("scale", "good_steps", "applied", "skipped", "windows", "skipped_windows", "loader")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def assert_same_run(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Every state node's bits, the counters, the loader's position and the global losses."""
    assert a["state_names"] == b["state_names"]
    differ = [n for n, x, y in zip(a["state_names"], a["state"], b["state"], strict=True)
              if x.dtype != y.dtype or not np.array_equal(_bits(x), _bits(y))]
    assert differ == []
    assert {k: a[k] for k in COUNTERS} == {k: b[k] for k in COUNTERS}
    assert np.array_equal(a["losses"], b["losses"], equal_nan=True)


def assert_one_rank_is_the_plain_run(**flags: bool) -> None:
    """The host gate with accumulation and the fused f16 gate with clipping, on one rank with
    ``flags`` (``zero``, ``overlap``) on: the plain run's every bit."""
    for v in ("adamw-fused-f16-clip", "amsgrad-host-f32-acc2"):
        assert_same_run(SW.run(parallel.SingleProcess(), v, **flags),
                        SW.run(parallel.SingleProcess(), v))


def results(out: Path, tag: str, variant: str, n: int) -> list[dict[str, Any]]:
    return [SW.load_result(out / f"{tag}-{variant}-rank{r}.npz") for r in range(n)]


# --- the tree, in one process -------------------------------------------------------------------


def test_the_tree_aligns_with_power_of_two_blocks_and_covers_any_block() -> None:
    tree = parallel.ShardTree(8)
    for ranks in (1, 2, 4, 8):
        k = 8 // ranks
        for r in range(ranks):
            assert tree.cover(r * k, (r + 1) * k) == [(r * k, (r + 1) * k)]
    six = parallel.ShardTree(6)
    assert [six.cover(2 * r, 2 * r + 2) for r in range(3)] == [
        [(0, 1), (1, 2)], [(2, 3), (3, 4)], [(4, 6)]]
    assert [six.cover(3 * r, 3 * r + 3) for r in range(2)] == [[(0, 3)], [(3, 6)]]
    # the order: ((0 + (1 + 2)) + (3 + (4 + 5))), from leaves or from any cover's partials
    leaves = {(i, i + 1): np.float32(v) for i, v in enumerate([1e8, 1.0, -1e8, 3.0, 0.5, 2.0])}
    want = (np.float32(1e8) + (np.float32(1.0) + np.float32(-1e8))) + \
        (np.float32(3.0) + (np.float32(0.5) + np.float32(2.0)))
    assert six.evaluate(leaves) == want
    partial = {(0, 3): six.evaluate(leaves, 0, 3), **{k: v for k, v in leaves.items()
                                                     if k[0] >= 3}}
    assert six.evaluate(partial) == want
    # into an array given, which may be one of the known ones (the shared-memory sum's own
    # buffer): the same bits, the array returned
    for node in (None, (0, 1), (5, 6)):
        arrays = {k: np.full(3, v, np.float32) for k, v in leaves.items()}
        into = np.zeros(3, np.float32) if node is None else arrays[node]
        got = six.evaluate(arrays, out=into)
        assert got is into and np.array_equal(into, np.full(3, want, np.float32))
    root = np.ones(3, np.float32)
    assert parallel.ShardTree(1).evaluate({(0, 1): root}, out=root) is root
    for bad in (np.zeros(4, np.float32), np.zeros(3, np.float64), [0.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match=r"out must be an array of the sum's shape \(3,\) "
                                             r"and dtype float32, got"):
            six.evaluate(arrays, out=bad)
        assert not np.any(bad)  # nothing written
    with pytest.raises(ValueError, match="shards must be an integer >= 1"):
        parallel.ShardTree(0)


def test_default_shards_keeps_enough_rows_per_shard() -> None:
    assert parallel.default_shards(256, min_rows=32) == 8
    assert parallel.default_shards(64, min_rows=16) == 4
    assert parallel.default_shards(16, min_rows=4, max_shards=8) == 4
    assert parallel.default_shards(12, min_rows=16) == 1
    assert parallel.default_shards(48, min_rows=8) == 4  # powers of two only
    with pytest.raises(ValueError, match="min_rows"):
        parallel.default_shards(64, min_rows=0)


def _mlp(rows: int) -> tuple:
    T.set_seed(0)
    x = T.term(np.zeros((rows, 2)), label="x")
    y = T.term(np.zeros((rows, 2)), label="y")
    logits, _ = nn_blocks.mlp(x, [8], 2)
    return x, y, nn_blocks.softmax_cross_entropy(logits, y)


def test_shard_settings_are_checked() -> None:
    x, y, loss = _mlp(4)
    two = _TwoRanks()
    with pytest.raises(ValueError, match="positive multiple of the number of ranks, 2, got 3"):
        parallel.DataParallel(two, loss, inputs=[x, y], shards=3)
    with pytest.raises(ValueError, match="fixed_order=False .* shards must be 2, got 4"):
        parallel.DataParallel(two, loss, inputs=[x, y], shards=4, fixed_order=False)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=2)
    ctx = dp.setup(Context.cpu())
    with pytest.raises(ValueError, match=r"x got 6 rows, expected this rank's block of 2 "
                                         r"shard\(s\) of 4 rows \(8\) or the global batch"):
        dp.set_batch(ctx, np.zeros((6, 2)), np.zeros((6, 2)))
    ctx, grads = ctx.compile(train.grad_update(loss))
    ctx = train.init_params(ctx, loss)
    ctx = ctx.set_values(x, np.ones((4, 2))).run(grads)
    with pytest.raises(ValueError, match="computes 2 shards: write each step's data with "
                                         "set_batch"):
        dp.reduce(ctx)
    ctx = dp.set_batch(ctx, np.ones((8, 2)), np.zeros((8, 2))).run(grads)
    with pytest.raises(ValueError, match="use_routines"):
        dp.reduce(ctx)


def test_an_input_without_an_axis_is_refused_by_name() -> None:
    """A batch is split along its inputs' first axis: an input with none is named."""
    x, y, loss = _mlp(4)
    temperature = T.term(np.float32(1.0), label="temperature")
    dp = parallel.DataParallel(parallel.SingleProcess(), loss * temperature,
                               inputs=[x, y, temperature], shards=2)
    ctx = dp.setup(Context.cpu())
    with pytest.raises(ValueError, match=r"input\(s\) \['temperature'\] have no axis"):
        dp.set_batch(ctx, np.zeros((8, 2)), np.zeros((8, 2)), np.float32(2.0))


def test_a_bad_value_in_a_later_shard_is_refused_before_anything_is_written() -> None:
    """set_batch checks every shard's values before it writes the first one: a class id out
    of range in the second shard is refused there, naming it, and the inputs and the pending
    shards stay as they were (reduce would otherwise stop halfway through the step)."""
    T.set_seed(0)
    x = T.term(np.zeros((4, 2)), label="x")
    ids = T.class_ids(batch_dims=(4,), num_classes=2, label="ids")
    logits, _ = nn_blocks.mlp(x, [8], 2)
    dp = parallel.DataParallel(parallel.SingleProcess(), nn_blocks.cross_entropy(logits, ids),
                               inputs=[x, ids], shards=2)
    ctx = dp.setup(Context.cpu())
    ctx = ctx.set_values(x, np.full((4, 2), 5.0)).set_values(ids, np.zeros(4))
    with pytest.raises(ValueError, match=r"class ids ids: value 7 at position \(2,\) is out "
                                         r"of range: expected an integer in \[0, 2\)"):
        dp.set_batch(ctx, np.ones((8, 2)), np.array([0, 1, 0, 1, 0, 1, 7, 0]))
    assert np.array_equal(ctx.get_values(x), np.full((4, 2), 5.0))
    assert np.array_equal(ctx.get_values(ids), np.zeros(4)) and dp._pending == []


class _TwoRanks(parallel.SingleProcess):  # a stand-in: rank 0 of 2
    size = 2


def _one_rank(shards: int) -> tuple:
    """One rank of ``shards`` shards of 4 rows over ``_mlp(4)``: its gradient routine
    compiled and in use, the parameters initialized. ``(x, y, loss, dp, ctx, grads)``."""
    x, y, loss = _mlp(4)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=shards)
    ctx = dp.setup(Context.cpu())
    ctx, grads = ctx.compile(train.grad_update(loss))
    dp.use_routines(grads)
    return x, y, loss, dp, train.init_params(ctx, loss), grads


def _each_shard(ctx: Context, grads: Any, loss: Any, x: Any, xb: np.ndarray, y: Any,
                yb: np.ndarray) -> list[list[np.ndarray]]:
    """Each 4-row shard's own gradients, computed one at a time through the inputs."""
    g = []
    for j in range(len(xb) // 4):
        ctx = ctx.set_values(x, xb[4 * j:4 * j + 4]).set_values(y, yb[4 * j:4 * j + 4])
        ctx = ctx.run(grads)
        g.append([ctx.get_values(p.grad).copy() for p in loss.params])
    return g


def test_one_rank_sums_its_shards_in_the_tree_order() -> None:
    """One rank, 4 shards: the gradients after reduce are ((g0 + g1) + (g2 + g3)) of the
    shards' own gradients, computed one at a time; the unscale is 1 / 4."""
    x, y, loss, dp, ctx, grads = _one_rank(4)
    ctx, update = ctx.compile(optim.SGD(0.1).update(loss, grad_unscale=dp.grad_unscale()))
    rng = np.random.default_rng(1)
    xb, yb = rng.normal(size=(16, 2)), np.eye(2)[rng.integers(0, 2, 16)]
    g = _each_shard(ctx, grads, loss, x, xb, y, yb)
    ctx = dp.set_batch(ctx, xb, yb).run(grads)
    ctx = dp.reduce(ctx)
    for k, p in enumerate(loss.params):
        want = (g[0][k] + g[1][k]) + (g[2][k] + g[3][k])
        assert np.array_equal(_bits(ctx.get_values(p.grad)), _bits(want))
    assert ctx.get_value(dp.grad_unscale()) == 0.25 and len(dp.shard_losses) == 4
    assert dp.step == 1 and dp.global_loss() == pytest.approx(np.mean(dp.shard_losses))
    # A second step (the shards' plan reused), then the routines replaced by ones seeding the
    # loss gradient with 4: every shard's gradient is then 4 times its own, bit for bit (the
    # plan follows use_routines: a stale one would run the old routines for shards 1..3).
    scale = T.term(np.array([4.0]), label="seed")
    ctx, scaled = ctx.compile(train.grad_update(loss, loss_scale=scale))
    for routine, factor in ((grads, 1.0), (scaled, 4.0)):
        dp.use_routines(routine)
        ctx = dp.reduce(dp.set_batch(ctx, xb, yb).run(routine))
        for k, p in enumerate(loss.params):
            want = [gj[k] * np.float32(factor) for gj in g]  # a power of two: exact
            assert np.array_equal(_bits(ctx.get_values(p.grad)),
                                  _bits((want[0] + want[1]) + (want[2] + want[3])))


def test_a_step_staged_in_one_context_is_refused_in_another_and_kept() -> None:
    """The later shards are staged in the context set_batch was given: a reduce (or another
    micro-batch) in another context is refused naming both, and the step is kept, so the
    reduce in the right context still gives the shards' bits. The caller's arrays may change
    after set_batch: the staged rows are the batch's as given."""
    x, y, loss, dp, ctx, grads = _one_rank(2)
    rng = np.random.default_rng(2)
    xb, yb = rng.normal(size=(8, 2)), np.eye(2)[rng.integers(0, 2, 8)]
    g = _each_shard(ctx, grads, loss, x, xb, y, yb)
    other = Context.cpu()
    given = xb.copy()
    ctx = dp.set_batch(ctx, given, yb).run(grads)
    given[...] = 0.0  # the caller reuses its array
    for call in (lambda: dp.reduce(other), lambda: dp.set_batch(other, xb, yb)):
        with pytest.raises(ValueError, match=r"got .*Context.*, but this step's data went to "
                                             r".*Context.* \(set_batch\): a step's micro-batches "
                                             r"and its reduce use one context"):
            call()
    assert len(dp._pending) == 1 and dp.step == 0 and other.mem() == 0  # nothing written
    ctx = dp.reduce(ctx)
    for k, p in enumerate(loss.params):
        assert np.array_equal(_bits(ctx.get_values(p.grad)), _bits(g[0][k] + g[1][k]))


def test_dropout_draws_are_keyed_by_the_global_row() -> None:
    """A draw over 8 rows with row_offset 8 is rows 8..15 of the same draw over 16 rows; a
    plain run (offset 0) draws what it drew before the offset existed."""
    def draw(rows: int, offset: float) -> np.ndarray:
        rng = T.Rng(3)
        u = rng.uniform(batch_dims=[rows], output_dims=[5])
        ctx, r = Context.cpu().compile(train.forward(u))
        ctx = ctx.set_values(rng.row_offset, offset)
        return ctx.run(r).get_values(u)

    whole = draw(16, 0.0)
    assert np.array_equal(draw(8, 8.0), whole[8:])
    assert np.array_equal(draw(8, 0.0), whole[:8])
    from ocannl.ir import ops

    idx = np.arange(16 * 5, dtype=np.float64).reshape(16, 5)
    assert np.array_equal(whole, ops.uniform_reference(3.0, 0.0, idx))


def test_a_checkpoint_of_another_shard_count_is_refused(tmp_path: Path) -> None:
    x, y, loss = _mlp(4)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=2)
    ctx = train.init_params(dp.setup(Context.cpu()), loss)
    params = [p.value for p in loss.params]
    from ocannl import checkpoint

    dp.save(tmp_path / "c.safetensors", ctx, params, checkpoint.Progress(step=3))
    x4, y4, loss4 = _mlp(2)
    dp4 = parallel.DataParallel(parallel.SingleProcess(), loss4, inputs=[x4, y4], shards=4)
    ctx4 = train.init_params(dp4.setup(Context.cpu()), loss4)
    with pytest.raises(Failure, match="written by a run with shards=2 fixed_order=True, this "
                                      "run has shards=4"):
        dp4.load(tmp_path / "c.safetensors", ctx4, [p.value for p in loss4.params])
    ctx, progress = dp.load(tmp_path / "c.safetensors", ctx, params)
    assert dp.step == 3 and progress.extra["data_parallel"] == "shards=2 fixed_order=True"


# --- under mpiexec ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every variant on one rank in this process, 4 shards (which also compiles, once, the
    code the ranks load from the cache); the run of 4 ranks checkpoints at step 5."""
    if _no_mpi:
        pytest.skip(_no_mpi)
    out = tmp_path_factory.mktemp("shards")
    refs = {v: SW.run(parallel.SingleProcess(), v, shards=4) for v in SW.VARIANTS}
    return {"out": out, "refs": refs}


@needs_mpi
def test_two_ranks_are_the_bits_of_one(one: dict[str, Any]) -> None:
    out = one["out"]
    ok(mpirun(2, "--out", out, "--tag", "two", script=WORKER, timeout=120))
    for v in SW.VARIANTS:
        for r in results(out, "two", v, 2):
            assert_same_run(r, one["refs"][v])
            # ranks on one node sum in memory they both map (DataParallel._shared_sum)
            assert r["shared_memory"] is True
        assert one["refs"][v]["skipped"] >= 1  # the injected step, skipped on any rank count
        assert one["refs"][v]["shared_memory"] is False


@needs_mpi
@pytest.mark.whole_machine  # four ranks on two cores: no other test's processes beside them
def test_four_ranks_are_the_bits_of_one_and_resume_on_one_then_two(one: dict[str, Any]
                                                                    ) -> None:
    out = one["out"]
    ck = out / "four.safetensors"
    ok(mpirun(4, "--out", out, "--tag", "four", "--save-at", "5", "--checkpoint", ck,
              script=WORKER, timeout=180))
    for v in SW.VARIANTS:
        for r in results(out, "four", v, 4):
            assert_same_run(r, one["refs"][v])
    # 4 ranks' checkpoint at step 5 (mid-window for the fused gate), resumed on 1 rank, which
    # checkpoints at step 6; that one resumed on 2 ranks
    ck1 = out / "one.safetensors"
    for v in SW.VARIANTS:
        res = SW.run(parallel.SingleProcess(), v, shards=4, save_at=6,
                     ckpt=ck1.with_suffix(f".{v}.safetensors"),
                     resume=ck.with_suffix(f".{v}.safetensors"))
        assert res["start"] == 5
        assert_same_run(res, one["refs"][v] | {"losses": res["losses"]})
        assert np.array_equal(res["losses"][5:], one["refs"][v]["losses"][5:], equal_nan=True)
    ok(mpirun(2, "--out", out, "--tag", "resumed", "--resume", ck1, script=WORKER,
              timeout=120))
    for v in SW.VARIANTS:
        for r in results(out, "resumed", v, 2):
            assert r["start"] == 6
            assert_same_run(r, one["refs"][v] | {"losses": r["losses"]})
            assert np.array_equal(r["losses"][6:], one["refs"][v]["losses"][6:],
                                  equal_nan=True)


def _ranks_are_the_bits_of_one(out: Path, ranks: int, shards: int, timeout: float,
                               *flags: str) -> None:
    """The fused f16 gate with clipping, and batch norm (per shard, and synced) with dropout, on
    ``ranks`` ranks and ``shards`` shards (``flags``: ``--zero``, the optimizer state sharded
    over the ranks; ``--overlap``, the exchange in buckets): each rank's run is one plain
    rank's, bit for bit."""
    variants = ["adamw-fused-f16-clip", "dropbn-host-f32", "syncbn-host-f32"]
    ok(mpirun(ranks, "--out", out, "--tag", f"r{ranks}", "--shards", str(shards), "--variants",
              ",".join(variants), *flags, script=WORKER, timeout=timeout))
    for v in variants:
        ref = SW.run(parallel.SingleProcess(), v, shards=shards)
        for r in results(out, f"r{ranks}", v, ranks):
            assert_same_run(r, ref)


@needs_mpi
@pytest.mark.whole_machine  # three ranks on two cores
def test_three_ranks_with_six_shards_are_the_bits_of_one(tmp_path: Path) -> None:
    """Two partial sums a rank, folded and exchanged bucket by bucket as the backward code
    writes them (overlap), and the optimizer state in three slices (ZeRO-1), which cut the
    parameters at uneven places."""
    _ranks_are_the_bits_of_one(tmp_path, 3, 6, 150, "--zero", "--overlap")


def test_the_loader_hands_a_rank_its_block_through_set_batch() -> None:
    """Loader(parallel=dp): the input nodes hold a shard; each batch goes to dp.set_batch,
    which writes the first shard of the rank's block and stages the others."""
    from ocannl import loader

    x, y, loss = _mlp(4)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=2)
    ctx = dp.setup(Context.cpu())
    data = np.arange(32, dtype=np.float64).reshape(16, 2)
    targets = np.eye(2)[np.arange(16) % 2]
    ld = loader.Loader([data, targets], [x, y], batch=8, shuffle=False, parallel=dp)
    ctx = ld.next(ctx)
    assert np.array_equal(ctx.get_values(x), data[:4])
    kept = dp._pending[0][0].views[1]  # the second shard's rows, staged in x's precision
    assert len(dp._pending) == 1 and np.array_equal(kept.reshape(4, 2), data[4:8])
    with pytest.raises(ValueError, match=r"expected \(2, 2\): 2 rows \(a shard: the batch over "
                                         r"4 shards\)"):
        x4, y4, loss4 = _mlp(4)
        dp4 = parallel.DataParallel(parallel.SingleProcess(), loss4, inputs=[x4, y4], shards=4)
        loader.Loader([data, targets], [x4, y4], batch=8, parallel=dp4)
    with pytest.raises(ValueError, match=r"rank=1, world=2 disagree with parallel= \(rank 0 "
                                         r"of 1\)"):
        loader.Loader([data, targets], [x, y], batch=8, rank=1, world=2, parallel=dp)


@needs_mpi
@pytest.mark.whole_machine  # eight ranks on two cores
def test_eight_ranks_with_eight_shards_are_the_bits_of_one(tmp_path: Path) -> None:
    """A shard a rank: each rank sums nothing of its own; the whole tree is the collectives',
    bucket by bucket (overlap)."""
    _ranks_are_the_bits_of_one(tmp_path, 8, 8, 300, "--overlap")
