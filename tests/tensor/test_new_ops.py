"""The ops beyond the MLP (``ocannl.tensor``): comparisons, ``where``, ``minimum`` /
``maximum``, ``min``, ``abs``, ``erf``, ``gelu`` (both forms), keepdims reductions, ``softmax`` /
``log_softmax``, class ids with ``one_hot`` and ``embedding``, and the counter-based random
draws with ``dropout``.

Values and gradients against PyTorch on hypothesis-drawn shapes at f32 (relative 1e-5,
magnitude-scaled: see ``torch_oracle``); the random draws against the NumPy model of the hash
(``ops.uniform_reference``), bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_oracle import (
    assert_close,
    broadcast_operand,
    check_parity,
    param_of,
    shapes,
    values,
    view_as_row_broadcast,
)

import ocannl.tensor as T
from ocannl import Context, Precision, train
from ocannl.ir.ops import uniform_reference
from ocannl.tensor import Shape

F32 = Precision.f32
EXAMPLES = 5


def few(n: int = EXAMPLES):
    return settings(max_examples=n, deadline=None)


def _run_forward(t: T.Tensor, ctx: Context | None = None) -> Context:
    ctx = ctx or Context.cpu()
    ctx, r = ctx.compile(train.forward(t))
    ctx.run(r)
    return ctx


# --- comparisons and where --------------------------------------------------------------------

COMPARISONS = {
    "lt": (T.lt, torch.lt), "le": (T.le, torch.le), "gt": (T.gt, torch.gt),
    "ge": (T.ge, torch.ge), "eq": (T.eq, torch.eq), "ne": (T.ne, torch.ne),
}


@pytest.mark.parametrize("op", list(COMPARISONS))
@few()
@given(data=st.data())
def test_comparisons_are_0_or_1_and_not_differentiable(op, data):
    result = data.draw(shapes(), label="result shape")
    sa = data.draw(broadcast_operand(result), label="a shape")
    sb = data.draw(broadcast_operand(result), label="b shape")
    # few distinct values, so that equal pairs occur
    av = data.draw(values(sa.dims, -1.0, 1.0), label="a").round()
    bv = data.draw(values(sb.dims, -1.0, 1.0), label="b").round()
    a, b = param_of("a", sa, F32), param_of("b", sb, F32)
    fn, torch_fn = COMPARISONS[op]
    out = fn(a, b)
    assert out.grad is None and out.prec is F32
    ctx = Context.cpu()
    ctx.set_values(a, av).set_values(b, bv)
    _run_forward(out, ctx)
    want = torch_fn(view_as_row_broadcast(torch.tensor(av), sa, out.shape),
                    view_as_row_broadcast(torch.tensor(bv), sb, out.shape)).double().numpy()
    np.testing.assert_array_equal(ctx.get_values(out), want.reshape(out.dims))


def test_comparisons_with_numbers_and_nan():
    a = T.param("a", output_dims=(4,), input_dims=())
    ctx = Context.cpu().set_values(a, [np.nan, 0.0, 1.0, 2.0])
    outs = {"lt": T.lt(a, 1.0), "ge": T.ge(1.0, a), "ne": T.ne(a, a), "eq": T.eq(a, a)}
    for t in outs.values():
        _run_forward(t, ctx)
    np.testing.assert_array_equal(ctx.get_values(outs["lt"]), [0, 1, 0, 0])
    np.testing.assert_array_equal(ctx.get_values(outs["ge"]), [0, 1, 1, 0])
    np.testing.assert_array_equal(ctx.get_values(outs["ne"]), [1, 0, 0, 0])
    np.testing.assert_array_equal(ctx.get_values(outs["eq"]), [0, 1, 1, 1])


@few(6)
@given(data=st.data())
def test_where_gradient_goes_to_the_branch_taken(data):
    result = data.draw(shapes(), label="result shape")
    sc = data.draw(broadcast_operand(result), label="cond shape")
    sa = data.draw(broadcast_operand(result), label="a shape")
    sb = data.draw(broadcast_operand(result), label="b shape")
    cv = data.draw(values(sc.dims, 0.0, 1.0), label="cond").round()
    av = data.draw(values(sa.dims, -2.0, 2.0), label="a")
    bv = data.draw(values(sb.dims, -2.0, 2.0), label="b")
    cond = T.term(cv, label="cond", batch_dims=sc.batch, output_dims=sc.output,
                  input_dims=sc.input)
    a, b = param_of("a", sa, F32), param_of("b", sb, F32)
    out = T.where(cond, a, b)
    shape = out.shape
    tc = view_as_row_broadcast(torch.tensor(cv), sc, shape).bool()
    check_parity(out, lambda ta, tb: torch.where(tc, view_as_row_broadcast(ta, sa, shape),
                                                 view_as_row_broadcast(tb, sb, shape)),
                 [(a, av), (b, bv)])


def test_where_with_a_number_branch_and_no_nan_from_the_other():
    a = T.param("a", output_dims=(3,), input_dims=())
    cond = T.term([1.0, 0.0, 1.0], label="c")
    out = T.where(cond, a, -np.inf)
    check_parity(T.exp(out), lambda ta: torch.exp(torch.where(torch.tensor([True, False, True]),
                                                              ta, float("-inf"))),
                 [(a, np.array([0.5, 2.0, -1.0]))])


# --- minimum / maximum / min / abs ------------------------------------------------------------


@pytest.mark.parametrize("op", ["minimum", "maximum"])
@few()
@given(data=st.data())
def test_pointwise_minimum_maximum(op, data):
    result = data.draw(shapes(), label="result shape")
    sa = data.draw(broadcast_operand(result), label="a shape")
    sb = data.draw(broadcast_operand(result), label="b shape")
    av = data.draw(values(sa.dims, -2.0, 2.0), label="a")
    bv = data.draw(values(sb.dims, -2.0, 2.0), label="b")
    a, b = param_of("a", sa, F32), param_of("b", sb, F32)
    out = getattr(T, op)(a, b)
    torch_fn = getattr(torch, op)
    check_parity(out, lambda ta, tb: torch_fn(view_as_row_broadcast(ta, sa, out.shape),
                                              view_as_row_broadcast(tb, sb, out.shape)),
                 [(a, av), (b, bv)])


def test_minimum_maximum_split_ties_like_torch():
    av, bv = np.array([1.0, 2.0, -3.0, 0.0]), np.array([1.0, -1.0, 4.0, 0.0])
    for op in ("minimum", "maximum"):
        a = T.param("a", output_dims=(4,), input_dims=())
        b = T.param("b", output_dims=(4,), input_dims=())
        check_parity(getattr(T, op)(a, b), getattr(torch, op), [(a, av), (b, bv)])


@st.composite
def reduction_axes(draw, shape: Shape):
    n = len(shape.dims)
    kind = draw(st.sampled_from(["all", "row", "positions"] if n else ["all", "row"]))
    if kind == "all":
        return None, list(range(n))
    if kind == "row":
        row = draw(st.sampled_from(["batch", "output", "input"]))
        off = shape.row_offsets()[row]
        return row, list(range(off, off + len(shape.row(row))))
    ks = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    return ks, sorted(ks)


def _torch_reduce(kind: str, x: torch.Tensor, axes: list[int], keepdim: bool) -> torch.Tensor:
    if not axes:
        return x * 1
    fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[kind]
    return fn(x, dim=axes, keepdim=keepdim)


@pytest.mark.parametrize("keepdims", [False, True], ids=["dropped", "kept"])
@pytest.mark.parametrize("kind", ["sum", "mean", "max", "min"])
@few(4)
@given(data=st.data())
def test_reductions_with_and_without_kept_axes(kind, keepdims, data):
    """``T.reduce`` (``T.min`` for min), reduced axes dropped or kept with size 1 in their
    rows. Integral values for max and min, so that ties occur (the gradient is shared evenly
    among them, as torch's ``amax`` / ``amin`` do)."""
    shape = data.draw(shapes(), label="shape")
    axes, positions = data.draw(reduction_axes(shape), label="axes")
    av = data.draw(values(shape.dims, -3.0, 3.0), label="a")
    if kind in ("max", "min"):
        av = np.round(av)
    a = param_of("a", shape, F32)
    out = T.reduce(a, kind, axes, keepdims=keepdims)
    if keepdims:
        assert out.dims == tuple(1 if k in positions else d for k, d in enumerate(shape.dims))
        assert len(out.shape.output) == len(shape.output)
    check_parity(out, lambda ta: _torch_reduce(kind, ta, positions, keepdims).reshape(out.dims),
                 [(a, av)])


@pytest.mark.parametrize("keepdims", [False, True], ids=["dropped", "kept"])
def test_min_shares_the_gradient_among_ties_like_torch_amin(keepdims):
    av = np.array([[1.0, -5.0, -5.0, 2.0], [3.0, 3.0, 3.0, 3.0], [0.5, 1.0, 2.0, 3.0]])
    a = T.param("a", batch_dims=(3,), output_dims=(4,), input_dims=())
    check_parity(T.min(a, "output", keepdims=keepdims),
                 lambda ta: torch.amin(ta, dim=1, keepdim=keepdims), [(a, av)])


def test_min_propagates_nan_like_torch():
    a = T.param("a", batch_dims=(2,), output_dims=(3,), input_dims=())
    m = T.min(a, "output")
    ctx = Context.cpu().set_values(a, [[1.0, np.nan, -2.0], [3.0, -1.0, 0.5]])
    _run_forward(m, ctx)
    np.testing.assert_array_equal(ctx.get_values(m), [np.nan, -1.0])


@few()
@given(data=st.data())
def test_abs(data):
    shape = data.draw(shapes(), label="shape")
    av = data.draw(values(shape.dims, 0.1, 3.0, nonzero=True), label="a")
    a = param_of("a", shape, F32)
    check_parity(T.abs(a), torch.abs, [(a, av)])


def test_abs_at_zero_has_zero_gradient_like_torch():
    a = T.param("a", output_dims=(4,), input_dims=())
    check_parity(T.abs(a), torch.abs, [(a, np.array([-1.5, 0.0, -0.0, 2.0]))])


# --- erf, gelu --------------------------------------------------------------------------------

SMOOTH = {
    "erf": (T.erf, torch.erf),
    "gelu": (T.gelu, F.gelu),
    "gelu_tanh": (lambda a: T.gelu(a, approximate="tanh"),
                  lambda ta: F.gelu(ta, approximate="tanh")),
}


@pytest.mark.parametrize("op", list(SMOOTH))
@few(6)
@given(data=st.data())
def test_erf_and_gelu(op, data):
    shape = data.draw(shapes(), label="shape")
    av = data.draw(values(shape.dims, -4.0, 4.0), label="a")
    a = param_of("a", shape, F32)
    fn, torch_fn = SMOOTH[op]
    check_parity(fn(a), torch_fn, [(a, av)])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_over_a_wide_range_against_torch_at_f64(approximate):
    """The formulas themselves, at f64 (1e-10): including the far tails."""
    xs = np.concatenate([np.linspace(-12, 12, 97), [-30.0, 30.0, 1e-8, -1e-8]])
    a = T.param("a", output_dims=xs.shape, input_dims=(), prec="f64")
    check_parity(T.gelu(a, approximate=approximate),
                 lambda ta: F.gelu(ta, approximate=approximate), [(a, xs)])


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_exact_gelu_reads_its_saved_cdf_with_the_bits_of_recomputing_it(prec):
    """At f32 the exact gelu keeps Phi(x) as a local node of its own, which its gradient
    reads instead of computing erf again; at 16 bits it stays one node. Either way the value
    and the gradient have the bits of the one-node formula."""
    from ocannl import Context, train
    from ocannl.ir.assignments import Const, apply
    from ocannl.ir.tnode import MemoryMode
    from ocannl.tensor import operations as O

    def one_node(a: T.Tensor) -> T.Tensor:
        def cdf(x):  # noqa: ANN001, ANN202
            return apply("mul", Const(0.5), apply("add", Const(1.0), apply(
                "erf", apply("mul", x, Const(O._INV_SQRT2)))))

        def pdf(x):  # noqa: ANN001, ANN202
            return apply("mul", Const(O._INV_SQRT_2PI),
                         apply("exp", apply("mul", Const(-0.5), apply("mul", x, x))))

        return O._elementwise("gelu", [a], lambda x: apply("mul", x[0], cdf(x[0])),
                              lambda x, v, g: [apply("mul", g, apply(
                                  "add", cdf(x[0]), apply("mul", x[0], pdf(x[0]))))])

    xs = np.linspace(-5, 5, 301)
    out = []
    for f in (T.gelu, one_node):
        a = T.param("a", output_dims=xs.shape, input_dims=(), prec=prec)
        y = f(a)
        cdfs = [t for t in y.topo() if t.label == "gelu_cdf"]
        if f is T.gelu:
            assert len(cdfs) == (0 if prec == "bf16" else 1)
            assert all(t.value.memory_mode is MemoryMode.local for t in cdfs)
        loss = T.sum(T.cast(y, "f32") * T.cast(y, "f32"))
        ctx = Context.cpu().set_values(a, xs)
        ctx, r = ctx.compile(train.grad_update(loss))
        ctx.run(r)
        out.append((ctx.get_values(loss).tobytes(), ctx.get_values(a.grad).tobytes()))
    assert out[0] == out[1]


def test_gelu_rejects_an_unknown_form():
    a = T.param("a", output_dims=(2,), input_dims=())
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', got 'fast'"):
        T.gelu(a, approximate="fast")


# --- softmax ----------------------------------------------------------------------------------


def _torch_softmax(x: torch.Tensor, axes: list[int], log: bool) -> torch.Tensor:
    if not axes:
        return x * 0.0 if log else x * 0.0 + 1.0
    z = x - torch.amax(x, dim=axes, keepdim=True).detach()
    lse = torch.log(torch.exp(z).sum(dim=axes, keepdim=True))
    return z - lse if log else torch.exp(z - lse)


def run_grad_update(out: T.Tensor, params: list[tuple[T.Tensor, np.ndarray]],
                    seed: int = 0) -> tuple[Context, np.ndarray]:
    """ocannl's side of a parity check: ``loss = sum(out * r)`` (``r`` uniform in [-1, 1]),
    forward and backprop. Returns the context and ``r`` as stored."""
    r = np.random.default_rng(seed).uniform(-1.0, 1.0, out.dims)
    r_t = T.term(r, batch_dims=out.shape.batch, output_dims=out.shape.output,
                 input_dims=out.shape.input, label="r", prec=out.prec)
    loss = T.sum(out * r_t)
    ctx = Context.cpu()
    for p, v in params:
        ctx.set_values(p, v)
    ctx, routine = ctx.compile(train.grad_update(loss))
    ctx.run(routine)
    return ctx, ctx.get_values(r_t).astype(np.float64)


def _torch_value_and_grad(fn, av: np.ndarray, r: np.ndarray,
                          dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    ta = torch.tensor(av, dtype=dtype, requires_grad=True)
    out = fn(ta)
    (out * torch.tensor(r, dtype=dtype)).sum().backward()
    return out.detach().double().numpy(), ta.grad.double().numpy()


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@few(6)
@given(data=st.data())
def test_softmax_over_drawn_axes(log, data):
    """Over all axes, a row, or any set of positions, with values up to 30 in magnitude (the
    max is subtracted: nothing overflows).

    A saturated softmax's gradient is a small difference of large terms (``s_i (g_i -
    sum_j g_j s_j)`` with ``s_i`` near 1), so every f32 implementation, torch's included, is
    off by about ``eps * s_i (|g_i| + sum_j |g_j| s_j)``; that is the magnitude the relative
    1e-5 applies to (as ``torch_oracle`` does for sums that cancel), against the f64 result,
    and torch's f32 result is held to the same bound."""
    shape = data.draw(shapes(), label="shape")
    axes, positions = data.draw(reduction_axes(shape), label="axes")
    av = data.draw(values(shape.dims, -30.0, 30.0), label="a")
    a = param_of("a", shape, F32)
    out = (T.log_softmax if log else T.softmax)(a, axes)
    assert out.dims == a.dims
    ctx, r = run_grad_update(out, [(a, av)])

    def fn(ta: torch.Tensor) -> torch.Tensor:
        return _torch_softmax(ta, positions, log)

    want, want_grad = _torch_value_and_grad(fn, av, r, torch.float64)
    t32, t32_grad = _torch_value_and_grad(fn, av, r, torch.float32)
    s = np.exp(_torch_softmax(torch.tensor(av), positions, True).numpy())
    g = np.abs(r)
    gs = (g * s).sum(axis=tuple(positions), keepdims=True) if positions else g * s
    if log:
        lse = np.abs(av - want)  # |log sum exp|, up to the max shift
        value_mag, grad_mag = np.abs(av) + lse, g + s * (g.sum(axis=tuple(positions),
                                                              keepdims=True) if positions else g)
    else:
        value_mag, grad_mag = np.abs(want), s * (g + gs)
    for got, got_grad, who in ((ctx.get_values(out), ctx.get_values(a.grad), "ocannl"),
                               (t32, t32_grad, "torch f32")):
        assert_close(got, want, 1e-5, f"{who} value", value_mag)
        assert_close(got_grad, want_grad, 1e-5, f"{who} gradient", grad_mag)


def test_softmax_single_axis_matches_torch_softmax_and_is_stable():
    av = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -999.0]])
    a = T.param("a", batch_dims=(2,), output_dims=(3,), input_dims=())
    check_parity(T.softmax(a, "output"), lambda ta: torch.softmax(ta, dim=1), [(a, av)])
    b = T.param("b", batch_dims=(2,), output_dims=(3,), input_dims=())
    check_parity(T.log_softmax(b, -1), lambda tb: torch.log_softmax(tb, dim=1), [(b, av)])


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
def test_standardize_is_the_composition_forward_and_torch_layer_norm_backward(prec):
    """``standardize`` (a layer norm without gain and bias) computes the composed
    ``(x - mean) / sqrt(var + eps)`` bit for bit, and its gradient matches torch's
    ``layer_norm``'s, rows of one value (gradient 0) and of nearly equal values included."""
    rng = np.random.default_rng(5)
    xv = np.float32(rng.normal(size=(3, 4, 6))).astype(np.float64)
    xv[0, 0] = np.float32(0.5 + 0.05 * np.arange(6))  # a narrow row: the gradient's sums cancel
    a = T.param("a", batch_dims=(3, 4), output_dims=(6,), input_dims=(), prec=prec)
    check_parity(T.standardize(a, "output", 1e-5),
                 lambda ta: F.layer_norm(ta, (6,), eps=1e-5), [(a, xv)])
    b = T.param("b", batch_dims=(3, 4), output_dims=(6,), input_dims=(), prec=prec)
    xc = b - T.reduce(b, "mean", "output", keepdims=True)
    composed = xc / T.sqrt(T.reduce(xc * xc, "mean", "output", keepdims=True) + 1e-5)
    one = T.standardize(b, "output")
    ctx = Context.cpu().set_values(b, xv)
    ctx, r = ctx.compile(train.forward(composed) + train.forward(one))
    ctx.run(r)
    assert ctx.get_values(one).tobytes() == ctx.get_values(composed).tobytes()
    c = T.param("c", batch_dims=(2,), output_dims=(1,), input_dims=(), prec=prec)
    ctx = check_parity(T.standardize(c, "output"), lambda tc: F.layer_norm(tc, (1,)),
                       [(c, np.array([[0.5], [-3.0]]))])
    assert not ctx.get_values(c.grad).any()


@pytest.mark.parametrize("axes", [None, [0, 2], [1]], ids=["all", "first-and-last", "middle"])
def test_standardize_over_any_axes_matches_torch(axes):
    """Over all axes, or axes that are not trailing, against torch's own mean and biased
    variance (its autograd through them gives the same gradient in exact arithmetic)."""
    xv = np.float32(np.random.default_rng(6).normal(size=(3, 4, 5))).astype(np.float64)
    a = T.param("a", batch_dims=(3,), output_dims=(4, 5), input_dims=())
    dims = [0, 1, 2] if axes is None else axes

    def torch_fn(ta: torch.Tensor) -> torch.Tensor:
        mean = ta.mean(dim=dims, keepdim=True)
        var = ((ta - mean) ** 2).mean(dim=dims, keepdim=True)
        return (ta - mean) / torch.sqrt(var + 1e-5)

    check_parity(T.standardize(a, axes), torch_fn, [(a, xv)])


def test_standardize_refuses_a_bad_eps_or_axis():
    a = T.param("a", batch_dims=(3,), output_dims=(4,), input_dims=())
    for eps in (-1.0, float("nan"), float("inf"), "1e-5", True):
        with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got"):
            T.standardize(a, "output", eps)
    with pytest.raises(ValueError, match="axis 5 out of range"):
        T.standardize(a, 5)
    with pytest.raises(ValueError, match="axis 5 out of range"):
        T.softmax(a, 5)


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
    ctx = _run_forward(oh)
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
    ctx = _run_forward(oh)
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
    _run_forward(out, ctx)
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
    ctx = _run_forward(both)
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
