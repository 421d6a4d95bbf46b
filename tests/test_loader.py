"""ocannl.loader: seeded shuffled epochs written into input nodes, the last partial batch
dropped or padded, a position that survives a checkpoint and refuses another data set, shards
of one permutation per rank, and no allocation of its own per step."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, Failure, checkpoint
from ocannl.loader import Loader

N, B = 23, 5
DATA = np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)
LABELS = np.arange(N) % 4


def _loader(batch: int = B, *, seed: int = 11, last: str = "drop", data=DATA, rank: int = 0,
            world: int = 1) -> tuple[Loader, T.Tensor, T.ClassIds]:
    local = batch // world
    x = T.term(np.zeros((local, 3)), label="x")
    y = T.class_ids(batch_dims=(local,), num_classes=4, label="y")
    return Loader([data, LABELS], [x, y], batch=batch, seed=seed, last=last, rank=rank,
                  world=world), x, y


def _batches(loader: Loader, x, y, steps: int, ctx=None) -> list[tuple[np.ndarray, np.ndarray]]:
    ctx = ctx or Context.cpu()
    out = []
    for _ in range(steps):
        ctx = loader.next(ctx)
        out.append((ctx.get_values(x).copy(), ctx.get_values(y).copy()))
    return out


def test_each_epoch_walks_the_permutation_of_seed_and_epoch_dropping_the_rest():
    loader, x, y = _loader()
    assert loader.steps_per_epoch == N // B == 4
    got = _batches(loader, x, y, 3 * 4)
    for epoch in range(3):
        perm = np.random.default_rng([11, epoch]).permutation(N)
        for k in range(4):
            rows = perm[k * B:(k + 1) * B]
            xs, ys = got[epoch * 4 + k]
            np.testing.assert_array_equal(xs, DATA[rows])
            np.testing.assert_array_equal(ys, LABELS[rows])
    assert loader.epoch == 2 and loader.step == 12
    assert not np.array_equal(got[0][0], got[4][0])  # a new order each epoch


def test_the_last_partial_batch_is_padded_when_asked():
    loader, x, y = _loader(last="pad")
    assert loader.steps_per_epoch == 5
    got = _batches(loader, x, y, 6)
    perm = np.random.default_rng([11, 0]).permutation(N)
    xs, ys = got[4]
    np.testing.assert_array_equal(xs[:3], DATA[perm[20:]])
    np.testing.assert_array_equal(xs[3:], 0)
    np.testing.assert_array_equal(ys[3:], 0)
    np.testing.assert_array_equal(got[5][0], DATA[np.random.default_rng([11, 1]).permutation(N)
                                                  [:B]])
    loader2, x2, y2 = _loader(last="pad")
    ctx = Context.cpu()
    counts = []
    for _ in range(5):
        ctx = loader2.next(ctx)
        counts.append(loader2.valid_rows)
    assert counts == [5, 5, 5, 5, 3]


def test_a_restored_position_continues_with_the_same_batches_through_a_checkpoint(tmp_path):
    whole, x, y = _loader()
    want = _batches(whole, x, y, 10)
    first, x1, y1 = _loader()
    ctx = Context.cpu()
    _batches(first, x1, y1, 6, ctx)
    path = tmp_path / "c.safetensors"
    p = T.term(np.ones(2), label="p")
    ctx = ctx.set_values(p, [1.0, 2.0])
    checkpoint.save(path, ctx, [p], checkpoint.Progress(step=6, epoch=first.epoch,
                                                         extra={"loader": first.save_state()}))
    resumed, x2, y2 = _loader()
    resumed.restore_state(checkpoint.read_progress(path).extra["loader"])
    assert (resumed.epoch, resumed.offset, resumed.step) == (1, 10, 6)
    got = _batches(resumed, x2, y2, 4)
    for (a, b), (c, d) in zip(got, want[6:], strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


@pytest.mark.parametrize(("change", "said"), [
    ({"data": DATA[:-1]}, "rows 23 in the checkpoint, 22 now"),
    ({"data": DATA + np.float32(1)}, "fingerprint"),
    ({"seed": 12}, "seed 11 in the checkpoint, 12 now"),
    ({"batch": 4}, "batch 5 in the checkpoint, 4 now"),
    ({"last": "pad"}, "last 'drop' in the checkpoint, 'pad' now"),
])
def test_a_position_from_another_data_set_or_order_is_refused_naming_it(change, said):
    saver, x, y = _loader()
    _batches(saver, x, y, 3)
    state = saver.save_state()
    kw = dict(change)
    data = kw.pop("data", DATA)
    labels = LABELS[:len(data)]
    batch = kw.pop("batch", B)
    x = T.term(np.zeros((batch, 3)), label="x")
    y = T.class_ids(batch_dims=(batch,), num_classes=4, label="y")
    other = Loader([data, labels], [x, y], batch=batch, seed=kw.pop("seed", 11), **kw)
    with pytest.raises(Failure, match=said):
        other.restore_state(state)
    assert (other.epoch, other.offset) == (0, 0)  # nothing changed


def test_malformed_states_are_refused():
    loader, _, _ = _loader()
    for bad, said in (("{", "not valid JSON"), ('{"format": "x"}', "expected 'ocannl.Loader/1'"),
                      ('{"format": "ocannl.Loader/1"}', "lacks")):
        with pytest.raises(Failure, match=said):
            loader.restore_state(bad)
    other, _, _ = _loader()
    s = other.save_state().replace('"offset": 0', '"offset": 3')
    with pytest.raises(Failure, match="offset 3 is not a batch boundary"):
        loader.restore_state(s)


def test_bad_construction_is_refused_naming_it():
    x = T.term(np.zeros((B, 3)), label="x")
    with pytest.raises(ValueError, match="batch 30 is larger than the data set's 23 rows"):
        Loader([DATA], [T.term(np.zeros((30, 3)), label="x30")], batch=30)
    with pytest.raises(ValueError, match="input x has dims \\(5, 3\\), expected \\(4, 3\\)"):
        Loader([DATA], [x], batch=4)
    with pytest.raises(ValueError, match="same number of rows"):
        Loader([DATA, LABELS[:-1]], [x, T.term(np.zeros(B), label="l")], batch=B)
    with pytest.raises(ValueError, match="last must be one of"):
        Loader([DATA], [x], batch=B, last="wrap")
    with pytest.raises(ValueError, match="6 rows does not split into 4 equal shards"):
        Loader([DATA], [x], batch=6, world=4)
    with pytest.raises(ValueError, match="rank 2 is not in \\[0, world=2\\)"):
        Loader([DATA], [x], batch=10, rank=2, world=2)
    with pytest.raises(ValueError, match="out of range"):
        Loader([LABELS + 4], [T.class_ids(batch_dims=(B,), num_classes=4)], batch=B)


def test_each_rank_reads_its_shard_of_the_same_global_batch():
    whole, x, y = _loader(batch=6)
    want = _batches(whole, x, y, 7)
    shards = [_batches(*_loader(batch=6, rank=r, world=3), 7) for r in range(3)]
    for k in range(7):
        np.testing.assert_array_equal(np.concatenate([s[k][0] for s in shards]), want[k][0])
        np.testing.assert_array_equal(np.concatenate([s[k][1] for s in shards]), want[k][1])


def test_a_step_allocates_nothing_of_its_own():
    big = np.random.default_rng(1).normal(size=(4096, 64)).astype(np.float32)
    x = T.term(np.zeros((256, 64)), label="xbig")
    loader = Loader([big], [x], batch=256, seed=3)
    ctx = loader.next(Context.cpu())  # the buffer is allocated at the first write
    tracemalloc.start()
    try:
        for _ in range(20):  # over an epoch boundary: the permutation is drawn once per epoch
            ctx = loader.next(ctx)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4096 * 8 + 4096, peak  # at most a permutation; a batch is 64 KiB
    last = loader.permutation(loader.epoch)[loader.offset - loader.batch:loader.offset]
    np.testing.assert_array_equal(ctx.get_values(x), big[last])


def test_sixteen_bit_inputs_are_rounded_once_as_set_values_rounds_them():
    x16 = T.term(np.zeros((B, 3)), label="x16", prec="f16")
    data = DATA.astype(np.float64) * 1000.123456789
    loader = Loader([data], [x16], batch=B, seed=2)
    ctx = loader.next(Context.cpu())
    rows = np.random.default_rng([2, 0]).permutation(N)[:B]
    direct = Context.cpu().set_values(x16, data[rows])
    np.testing.assert_array_equal(ctx.get_values(x16), direct.get_values(x16))


def test_without_shuffling_every_epoch_walks_the_rows_in_order():
    x = T.term(np.zeros((B, 3)), label="x")
    loader = Loader([DATA], [x], batch=B, shuffle=False)
    ctx = Context.cpu()
    for k in range(6):  # 4 batches an epoch, then the first two again
        ctx = loader.next(ctx)
        start = (k % 4) * B
        np.testing.assert_array_equal(ctx.get_values(x), DATA[start:start + B])


def test_a_target_node_given_twice_is_refused_naming_it():
    """Issue 38, 2: ``Loader([a, b], [x, x])`` would write ``a``, then ``b``, into ``x`` at
    every batch. Refused at construction, naming the node; its values are untouched."""
    x = T.term(np.zeros((B, 3)), label="x")
    ctx = Context.cpu().set_values(x, np.full((B, 3), 7.0))
    with pytest.raises(ValueError, match=r"Loader: inputs\[0\] and inputs\[1\] are the same "
                                         r"node x_\d+: each array needs an input node of its own"):
        Loader([DATA, DATA[::-1]], [x, x], batch=B)
    np.testing.assert_array_equal(ctx.get_values(x), np.full((B, 3), 7.0))
