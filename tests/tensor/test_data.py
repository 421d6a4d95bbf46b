"""Data on the device (``ocannl.tensor.data``): class ids (validated, refused naming the value,
nothing written), ``one_hot`` and ``embedding`` (against PyTorch), and the counter-based random
draws with ``dropout``, bit for bit against the NumPy model of the hash
(``ops.uniform_reference``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch_oracle import (
    check_parity,
    few,
    run_forward,
    values,
)

import ocannl.tensor as T
from ocannl import Context, Precision, train
from ocannl.ir.ops import uniform_reference
from ocannl.tensor import Shape

F32 = Precision.f32


# --- class ids, one_hot, embedding ------------------------------------------------------------


@st.composite
def ids_and_table(draw):
    batch = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple))
    vocab = draw(st.integers(1, 6))
    dim = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=math.prod(batch),
                        max_size=math.prod(batch)))
    table = draw(values((vocab, dim), -2.0, 2.0))
    return np.array(ids).reshape(batch), vocab, dim, table


@few(8)
@given(case=ids_and_table())
def test_embedding_lookup_and_gradient_scatter_into_the_rows(case):
    ids_v, vocab, dim, table_v = case
    ids = T.class_ids(ids_v, num_classes=vocab)
    assert ids.dims == ids_v.shape and ids.shape.output == ()
    table = T.param("table", output_dims=(vocab, dim), input_dims=())
    out = T.embedding(ids, table)
    assert out.shape == Shape(ids_v.shape, (dim,), ())
    check_parity(out, lambda tt: F.embedding(torch.tensor(ids_v), tt), [(table, table_v)])


def test_embedding_at_gemm_size():
    """Large enough for the one-hot contraction and its gradient to go to BLAS."""
    rng = np.random.default_rng(0)
    ids_v = rng.integers(0, 300, size=(8, 16))
    table_v = rng.normal(size=(300, 24))
    ids = T.class_ids(ids_v, num_classes=300)
    table = T.param("table", output_dims=(300, 24), input_dims=())
    check_parity(T.embedding(ids, table), lambda tt: F.embedding(torch.tensor(ids_v), tt),
                 [(table, table_v)])


def test_one_hot():
    ids = T.class_ids([[2, 0], [1, 2]], num_classes=3)
    oh = T.one_hot(ids)
    assert oh.shape == Shape((2, 2), (3,), ()) and oh.grad is None
    ctx = run_forward(oh)
    np.testing.assert_array_equal(ctx.get_values(oh),
                                  np.eye(3)[[[2, 0], [1, 2]]])


BAD_IDS = [
    ([0, 3, 1], "value 3 at position (1,) is out of range: expected an integer in [0, 3)"),
    ([0, -1, 1], "value -1 at position (1,) is out of range"),
    ([0.0, 1.5, 1.0], "value 1.5 at position (1,) is not an integer"),
    ([0.0, 1.0, np.nan], "value nan at position (2,) is not an integer"),
    ([0.0, np.inf, 1.0], "value inf at position (1,) is not an integer"),
    ([True, False, True], "expected integers, got an array of dtype bool"),
    (["a", "b", "c"], "expected integers, got an array of dtype <U1"),
    ([0, 1], "got 2 ids of shape (2,), expected shape (3,)"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_IDS)
def test_bad_class_ids_are_refused_naming_the_value_and_nothing_changes(bad, message):
    with pytest.raises(ValueError) as err:
        T.class_ids(bad, num_classes=3, batch_dims=(3,), label="targets")
    assert message in str(err.value) and "targets" in str(err.value)
    ids = T.class_ids([2, 1, 0], num_classes=3, label="targets")
    oh = T.one_hot(ids)
    ctx = run_forward(oh)
    before = ctx.get_values(ids).copy()
    for set_ids in (lambda v: ids.set(ctx, v), lambda v: T.set_class_ids(ctx, ids, v)):
        with pytest.raises(ValueError) as err:
            set_ids(bad)
        assert message in str(err.value)
        np.testing.assert_array_equal(ctx.get_values(ids), before)
    ids.set(ctx, np.array([0, 0, 2]))  # valid ids are written
    np.testing.assert_array_equal(ctx.get_values(ids), [0, 0, 2])


def test_class_ids_construction_checks():
    with pytest.raises(ValueError, match="num_classes must be an integer >= 1, got 0"):
        T.class_ids([0], num_classes=0)
    with pytest.raises(ValueError, match="f32 holds integers exactly only below 16777216"):
        T.class_ids([0], num_classes=2**24 + 1)
    T.class_ids([2**24], num_classes=2**24 + 1, prec="f64")
    with pytest.raises(ValueError, match="give ids or batch_dims"):
        T.class_ids(num_classes=3)
    later = T.class_ids(num_classes=3, batch_dims=(2,))
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(T.one_hot(later)))
    with pytest.raises(ValueError, match="nothing has initialized"):
        ctx.run(r)
    later.set(ctx, [1, 2])
    ctx.run(r)
    with pytest.raises(TypeError, match="made by class_ids"):
        T.one_hot(T.term([1.0, 2.0]))


def test_set_values_validates_class_ids_and_changes_nothing_on_refusal():
    """``Context.set_values`` checks class ids too (``Tnode.check_values``): an id out of range
    or not an integer is refused naming it, and the buffer keeps its ids."""
    ids = T.class_ids([0, 1, 2], num_classes=3)
    table = T.param("table", output_dims=(3, 2), input_dims=())
    out = T.embedding(ids, table)
    ctx = Context.cpu().set_values(table, np.arange(6.0).reshape(3, 2))
    run_forward(out, ctx)
    for bad, what in (([2.0, 3.0, 0.0], "value 3.0 at position \\(1,\\) is out of range"),
                      ([2.0, 0.5, 0.0], "value 0.5 at position \\(1,\\) is not an integer")):
        with pytest.raises(ValueError, match=what):
            ctx.set_values(ids, bad)
        np.testing.assert_array_equal(ctx.get_values(ids), [0, 1, 2])
    ctx.set_values(ids, [2, 2, 0])
    ctx, r = ctx.compile(train.forward(out))
    ctx.run(r)
    np.testing.assert_array_equal(ctx.get_values(out), [[4.0, 5.0], [4.0, 5.0], [0.0, 1.0]])


# --- random draws and dropout -----------------------------------------------------------------


def test_uniform_draws_are_the_hash_of_seed_counter_and_index():
    rng = T.Rng(12345)
    u = rng.uniform(batch_dims=(3,), output_dims=(4, 5))
    assert u.prec is Precision.f64 and u.grad is None
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(u))
    index = np.arange(60).reshape(3, 4, 5)
    for step in range(3):
        ctx.run(r)
        got = ctx.get_values(u)
        np.testing.assert_array_equal(got, uniform_reference(12345.0, float(step), index))
        assert ctx.get_value(rng.counter) == step + 1
    assert np.all((got >= 0) & (got < 1)) and np.all(got * 2**24 == np.round(got * 2**24))
    # reproducible from (seed, counter): rewind the counter
    ctx.set_values(rng.counter, 1.0)
    ctx.run(r)
    np.testing.assert_array_equal(ctx.get_values(u), uniform_reference(12345.0, 1.0, index))
    # another seed, another stream
    ctx.set_values(rng.seed, 7.0)
    ctx.run(r)
    np.testing.assert_array_equal(ctx.get_values(u), uniform_reference(7.0, 2.0, index))


def test_the_hash_reference_is_uniform_and_uncorrelated():
    """The NumPy model of the hash (bit-exact with the generated code, above): mean, variance,
    lag-1 and cross-stream correlations, a 256-bin chi-square, each with a bound a correct
    uniform generator exceeds with probability below about 1e-9 at n = 2**20."""
    n = 2**20
    a = uniform_reference(0.0, 0.0, np.arange(n))
    b = uniform_reference(0.0, 1.0, np.arange(n))
    c = uniform_reference(1.0, 0.0, np.arange(n))
    z = 6.1  # two-sided normal quantile of 1e-9
    assert abs(a.mean() - 0.5) < z * math.sqrt(1 / 12 / n)
    assert abs(a.var() - 1 / 12) < z * math.sqrt(1 / 180 / n)
    for x, y in ((a[:-1], a[1:]), (a, b), (a, c)):
        assert abs(np.corrcoef(x, y)[0, 1]) < z / math.sqrt(n)
    counts, _ = np.histogram(a, bins=256, range=(0.0, 1.0))
    chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
    assert chi2 < 255 + z * math.sqrt(2 * 255) + 40  # normal approximation, generous tail


def test_draws_of_one_step_differ_between_tensors_and_shapes():
    rng = T.Rng(1)
    u1 = rng.uniform(output_dims=(6,))
    u2 = rng.uniform(output_dims=(6,))
    both = T.add(u1, u2)
    ctx = run_forward(both)
    assert not np.array_equal(ctx.get_values(u1), ctx.get_values(u2))
    assert ctx.get_value(rng.counter) == 2.0
    assert set(T.buffers(both)) == {rng.seed, rng.counter}


def test_rng_rejects_bad_seeds():
    for bad in (-1, 2**52, 1.5, True):
        with pytest.raises(ValueError, match="seed must be an integer in"):
            T.Rng(bad)


def _binomial_bound(n: int, p: float, log10_fail: float = -9.0) -> float:
    """A deviation of the count of successes from n p exceeded with probability below
    10**log10_fail (two-sided Chernoff-Hoeffding: 2 exp(-2 t^2 / n))."""
    return math.sqrt(n * (math.log(2) - log10_fail * math.log(10)) / 2)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_dropout_keeps_the_rate_scales_and_draws_a_new_mask_every_step(rate):
    """Each step's mask keeps ``1 - rate`` of the elements within a Hoeffding bound whose
    failure probability is below 1e-9; kept elements are scaled by 1 / (1 - rate) and get the
    gradient scaled alike; no two steps' masks are equal; the masks follow (seed, counter)."""
    shape = (64, 128)
    n = math.prod(shape)
    x = T.param("x", batch_dims=shape[:1], output_dims=shape[1:], input_dims=())
    rng = T.Rng(2024)
    y = T.dropout(x, rate=rate, rng=rng)
    loss = T.sum(y)
    ctx = Context.cpu().set_values(x, np.full(shape, 2.0))
    ctx, step = ctx.compile(train.grad_update(loss))
    index = np.arange(n).reshape(shape)
    masks = []
    scale = np.float32(1.0) / np.float32(1.0 - rate)
    for k in range(4):
        ctx.run(step)
        yv, gv = ctx.get_values(y), ctx.get_values(x.grad)
        kept = yv != 0
        masks.append(kept)
        assert abs(int(kept.sum()) - n * (1 - rate)) < _binomial_bound(n, 1 - rate)
        np.testing.assert_allclose(yv[kept], 2.0 / (1.0 - rate), rtol=1e-6)
        np.testing.assert_array_equal(gv, np.where(kept, scale, 0.0))
        want = uniform_reference(2024.0, float(k), index) >= np.float32(rate)
        np.testing.assert_array_equal(kept, want)
    for i in range(len(masks)):
        for j in range(i):
            assert not np.array_equal(masks[i], masks[j])


def test_dropout_rejects_bad_rates():
    x = T.param("x", output_dims=(3,), input_dims=())
    for bad in (-0.1, 1.0, "0.5"):
        with pytest.raises(ValueError, match="rate must be a number in"):
            T.dropout(x, rate=bad, rng=T.Rng(0))
    with pytest.raises(TypeError, match="rng must be an ocannl.tensor.Rng"):
        T.dropout(x, rate=0.5, rng=3)
