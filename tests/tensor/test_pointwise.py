"""Pointwise ops of ``ocannl.tensor.pointwise`` beyond the arithmetic (``test_gradients.py``
has those, at f32 and f64): comparisons, ``where``, ``minimum`` / ``maximum``, ``abs``,
``erf`` and ``gelu`` (both forms). Values and gradients against PyTorch on hypothesis-drawn
shapes at f32 (relative 1e-5, magnitude-scaled: see ``torch_oracle``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch_oracle import (
    broadcast_operand,
    check_parity,
    few,
    param_of,
    run_forward,
    shapes,
    values,
    view_as_row_broadcast,
)

import ocannl.tensor as T
from ocannl import Context, Precision, train

F32 = Precision.f32


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
    run_forward(out, ctx)
    want = torch_fn(view_as_row_broadcast(torch.tensor(av), sa, out.shape),
                    view_as_row_broadcast(torch.tensor(bv), sb, out.shape)).double().numpy()
    np.testing.assert_array_equal(ctx.get_values(out), want.reshape(out.dims))


def test_comparisons_with_numbers_and_nan():
    a = T.param("a", output_dims=(4,), input_dims=())
    ctx = Context.cpu().set_values(a, [np.nan, 0.0, 1.0, 2.0])
    outs = {"lt": T.lt(a, 1.0), "ge": T.ge(1.0, a), "ne": T.ne(a, a), "eq": T.eq(a, a)}
    for t in outs.values():
        run_forward(t, ctx)
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
    """The exact gelu keeps Phi(x) as a local node of its own, in the precision it is computed
    in (f32 for bf16), which its gradient reads instead of computing erf again. The value and
    the gradient have the bits of the one-node formula."""
    from ocannl import Context
    from ocannl.ir.assignments import Const, apply
    from ocannl.ir.tnode import MemoryMode
    from ocannl.tensor import pointwise as P

    def one_node(a: T.Tensor) -> T.Tensor:
        def cdf(x):  # noqa: ANN001, ANN202
            return apply("mul", Const(0.5), apply("add", Const(1.0), apply(
                "erf", apply("mul", x, Const(P._INV_SQRT2)))))

        def pdf(x):  # noqa: ANN001, ANN202
            return apply("mul", Const(P._INV_SQRT_2PI),
                         apply("exp", apply("mul", Const(-0.5), apply("mul", x, x))))

        return P.pointwise("gelu", [a], lambda x: apply("mul", x[0], cdf(x[0])),
                           lambda x, v, g: [apply("mul", g, apply(
                               "add", cdf(x[0]), apply("mul", x[0], pdf(x[0]))))])

    xs = np.linspace(-5, 5, 301)
    out = []
    for f in (T.gelu, one_node):
        a = T.param("a", output_dims=xs.shape, input_dims=(), prec=prec)
        y = f(a)
        cdfs = [t for t in y.topo() if t.label == "gelu_cdf"]
        if f is T.gelu:
            assert len(cdfs) == 1
            assert all(t.value.memory_mode is MemoryMode.local and t.prec.value == "f32"
                       for t in cdfs)
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
