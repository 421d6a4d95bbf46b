"""Gradient parity with PyTorch on CPU for every op of the tensor DSL, on hypothesis-drawn
shapes and values: relative 1e-5 at f32, 1e-10 at f64 (see ``torch_oracle``)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_oracle import (
    PRECS,
    TORCH_DTYPE,
    broadcast_operand,
    check_parity,
    param_of,
    reduction_axes,
    shapes,
    values,
    view_as_row_broadcast,
)

import ocannl.tensor as T
from ocannl import Precision
from ocannl.tensor import Shape

ids = {"ids": lambda p: p.value}


def drawn(f32: int = 6, f64: int = 3):
    """Run the test on ``f32`` (or ``f64``, by its ``prec`` argument) hypothesis examples, each
    drawing from ``data``. f64 runs fewer: they check the same code at another precision, and
    every example compiles a routine."""
    count = {Precision.f32: f32, Precision.f64: f64}

    def deco(body):
        def test(**kwargs):
            @settings(max_examples=count[kwargs["prec"]], deadline=None)
            @given(data=st.data())
            def run(data):
                body(data=data, **kwargs)

            run()

        sig = inspect.signature(body)
        test.__signature__ = sig.replace(parameters=[
            p for name, p in sig.parameters.items() if name != "data"])
        test.__name__, test.__doc__ = body.__name__, body.__doc__
        return test

    return deco


# --- pointwise binary ops with broadcasting ---------------------------------------------------

BINARY = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / b, lambda a, b: a / b),
}


@pytest.mark.parametrize("prec", PRECS, **ids)
@pytest.mark.parametrize("op", list(BINARY))
@drawn()
def test_binary_op_gradients(op, prec, data):
    result = data.draw(shapes(), label="result shape")
    sa = data.draw(broadcast_operand(result), label="a shape")
    sb = data.draw(broadcast_operand(result), label="b shape")
    av = data.draw(values(sa.dims, -2.0, 2.0), label="a")
    bv = data.draw(values(sb.dims, 0.5, 2.0, nonzero=True), label="b")
    a, b = param_of("a", sa, prec), param_of("b", sb, prec)
    ocannl_fn, torch_fn = BINARY[op]
    out = ocannl_fn(a, b)
    assert out.prec is prec
    check_parity(out, lambda ta, tb: torch_fn(view_as_row_broadcast(ta, sa, out.shape),
                                              view_as_row_broadcast(tb, sb, out.shape)),
                 [(a, av), (b, bv)])


@pytest.mark.parametrize("prec", PRECS, **ids)
def test_numbers_on_either_side(prec):
    """Python numbers lift to constants on the left and on the right of every operator."""
    rng = np.random.default_rng(3)
    av = rng.uniform(0.5, 2.0, (2, 3))
    a = T.param("a", batch_dims=(2,), output_dims=(3,), input_dims=(), prec=prec)
    out = (2.0 + a) * (a - 0.5) + (3 - a) / 4 - 1.5 / a + 2 * a ** 2 - (-a)
    check_parity(out,
                 lambda ta: (2.0 + ta) * (ta - 0.5) + (3 - ta) / 4 - 1.5 / ta + 2 * ta ** 2 - (-ta),
                 [(a, av)])


# --- unary ops --------------------------------------------------------------------------------

UNARY = {  # ocannl, torch, the domain drawn from
    "neg": (T.neg, torch.neg, (-3.0, 3.0)),
    "relu": (T.relu, torch.relu, (-3.0, 3.0)),
    "exp": (T.exp, torch.exp, (-3.0, 3.0)),
    "log": (T.log, torch.log, (0.1, 5.0)),
    "tanh": (T.tanh, torch.tanh, (-3.0, 3.0)),
    "sigmoid": (T.sigmoid, torch.sigmoid, (-5.0, 5.0)),
    "sqrt": (T.sqrt, torch.sqrt, (0.1, 5.0)),
}


@pytest.mark.parametrize("prec", PRECS, **ids)
@pytest.mark.parametrize("op", list(UNARY))
@drawn()
def test_unary_op_gradients(op, prec, data):
    fn, torch_fn, (lo, hi) = UNARY[op]
    shape = data.draw(shapes(), label="shape")
    av = data.draw(values(shape.dims, lo, hi), label="a")
    a = param_of("a", shape, prec)
    check_parity(fn(a), torch_fn, [(a, av)])


def test_relu_at_zero_has_zero_gradient_like_torch():
    av = np.array([-1.0, 0.0, -0.0, 2.0])
    a = T.param("a", output_dims=(4,), input_dims=())
    check_parity(T.relu(a), torch.relu, [(a, av)])


# Exponents over a signed domain (integral ones) and over positive bases only.
POWERS = [(2.0, True), (3.0, True), (-1.0, True), (0.5, False), (-1.5, False), (0.0, False)]


@pytest.mark.parametrize("prec", PRECS, **ids)
@pytest.mark.parametrize(("c", "signed"), POWERS)
@drawn(f32=3, f64=2)
def test_pow_by_constant_gradients(c, signed, prec, data):
    shape = data.draw(shapes(), label="shape")
    av = data.draw(values(shape.dims, 0.2, 3.0, nonzero=signed), label="a")
    a = param_of("a", shape, prec)
    check_parity(a ** c, lambda ta: ta ** c, [(a, av)])


def test_pow_rejects_a_tensor_exponent():
    a = T.param("a", output_dims=(2,), input_dims=())
    with pytest.raises(TypeError, match="exponent must be a constant number"):
        T.pow_const(a, a)


# --- contractions -----------------------------------------------------------------------------


def _torch_matmul(ta: torch.Tensor, sa: Shape, tb: torch.Tensor, sb: Shape,
                  out: Shape) -> torch.Tensor:
    """OCANNL's ``a @ b`` in torch: batch rows broadcast, a's input row against b's output
    row, the result laid out as batch, a's output row, b's input row."""
    nb = len(out.batch)
    pa = [1] * (nb - len(sa.batch)) + list(sa.batch)
    pb = [1] * (nb - len(sb.batch)) + list(sb.batch)
    k = math.prod(sa.input)
    ma = ta.reshape(*pa, math.prod(sa.output), k)
    mb = tb.reshape(*pb, k, math.prod(sb.input))
    return torch.matmul(ma, mb).reshape(out.dims)


@st.composite
def matmul_shapes(draw):
    batch = draw(shapes(batch=2, output=0, inp=0))
    ba = draw(broadcast_operand(batch)).batch
    bb = draw(broadcast_operand(batch)).batch
    k = draw(shapes(batch=0, output=2, inp=0)).output
    ao = draw(shapes(batch=0, output=2, inp=0)).output
    bi = draw(shapes(batch=0, output=0, inp=1)).input
    return Shape(ba, ao, k), Shape(bb, k, bi)


@pytest.mark.parametrize("prec", PRECS, **ids)
@drawn()
def test_matmul_gradients(prec, data):
    """``a @ b`` with broadcast batch rows, multi-axis (or no) contracted axes, and b's input
    axes carried to the result."""
    sa, sb = data.draw(matmul_shapes(), label="shapes")
    av = data.draw(values(sa.dims, -2.0, 2.0), label="a")
    bv = data.draw(values(sb.dims, -2.0, 2.0), label="b")
    a, b = param_of("a", sa, prec), param_of("b", sb, prec)
    out = a @ b
    assert out.shape.output == sa.output and out.shape.input == sb.input
    check_parity(out, lambda ta, tb: _torch_matmul(ta, sa, tb, sb, out.shape),
                 [(a, av), (b, bv)])


@pytest.mark.parametrize("prec", PRECS, **ids)
@drawn()
def test_param_input_dims_are_inferred_at_first_matmul(prec, data):
    """A parameter created with only output dims takes its input axes from the right operand's
    output axes; the weight is laid out (out, in) as torch.nn.Linear's."""
    x_shape = data.draw(shapes(batch=2, output=2, inp=0), label="x shape")
    out_dims = data.draw(shapes(batch=0, output=2, inp=0), label="w output").output
    w = T.param("w", output_dims=out_dims, prec=prec)
    # Reading w.shape would close the inference (its input row: empty); shape_known does not.
    assert not w.value.dims_known and not w.shape_known
    x = param_of("x", x_shape, prec)
    out = w @ x
    assert w.shape.input == x_shape.output
    assert w.dims == out_dims + x_shape.output and w.grad.dims == w.dims
    assert out.shape == Shape(x_shape.batch, out_dims, ())
    wv = data.draw(values(w.dims, -2.0, 2.0), label="w")
    xv = data.draw(values(x.dims, -2.0, 2.0), label="x")
    check_parity(out, lambda tw, tx: _torch_matmul(tw, w.shape, tx, x_shape, out.shape),
                 [(w, wv), (x, xv)])


@pytest.mark.parametrize("prec", PRECS, **ids)
def test_gemm_sized_layers(prec):
    """Products large enough to go to BLAS, forward and backward, with a shared weight."""
    rng = np.random.default_rng(5)
    xv = rng.normal(size=(64, 40))
    w1v, w2v = rng.normal(size=(48, 40)) / 6, rng.normal(size=(30, 48)) / 7
    x = T.param("x", batch_dims=(64,), output_dims=(40,), input_dims=(), prec=prec)
    w1 = T.param("w1", output_dims=(48,), prec=prec)
    w2 = T.param("w2", output_dims=(30,), prec=prec)
    out = w2 @ T.tanh(w1 @ x) + T.sum(w1 @ x, "output")

    def torch_fn(tx, tw1, tw2):
        h = tx @ tw1.T
        return torch.tanh(h) @ tw2.T + h.sum(1, keepdim=True)

    check_parity(out, torch_fn, [(x, xv), (w1, w1v), (w2, w2v)])


# --- einsum -----------------------------------------------------------------------------------

EINSUMS = [
    # spec, the torch equation over each operand's layout (batch, output, input)
    ("i->o;b|i=>b|o", "oi,bi->bo"),  # a linear layer
    ("b|i;b|i=>b|", "bi,bi->b"),  # per-example dot product
    ("i;j=>i->j", "i,j->ji"),  # outer product: j output, i input
    ("b|ij;b|jk=>b|ik", "bij,bjk->bik"),  # batched matrix product in the output row
    ("ij;ij=>", "ij,ij->"),  # full contraction
    ("b|i->o;b|o=>b|i", "boi,bo->bi"),  # contract the output axis
    ("b|ij;j=>b|i->j", "bij,j->bji"),  # broadcast multiply, nothing summed
    ("b|i->o=>o->i", "boi->io"),  # sum over batch; o becomes the input axis
    ("ij=>ji", "ij->ji"),  # transpose
    ("ii=>i", "ii->i"),  # diagonal
    ("b|ij=>j", "bij->j"),  # reduction
    ("i->o=>", "oi->"),  # sum of everything
]


def _operand_dims(spec: str, extent: dict[str, int]) -> list[Shape]:
    """The shape of each operand of ``spec`` ("batch|input->output" per operand)."""
    out = []
    for part in spec.split("=>")[0].split(";"):
        b, rest = part.split("|") if "|" in part else ("", part)
        i, o = rest.split("->") if "->" in rest else ("", rest)
        out.append(Shape(tuple(extent[c] for c in b), tuple(extent[c] for c in o),
                         tuple(extent[c] for c in i)))
    return out


@pytest.mark.parametrize("prec", PRECS, **ids)
@pytest.mark.parametrize(("spec", "equation"), EINSUMS)
@drawn(f32=3, f64=2)
def test_einsum_gradients(spec, equation, prec, data):
    letters = sorted(set(equation) - set(",->"))
    extent = dict(zip(letters, data.draw(st.lists(st.integers(1, 4), min_size=len(letters),
                                                  max_size=len(letters)), label="extents"),
                      strict=True))
    operand_shapes = _operand_dims(spec, extent)
    params = [(param_of(f"x{k}", s, prec),
               data.draw(values(s.dims, -2.0, 2.0), label=f"operand {k}"))
              for k, s in enumerate(operand_shapes)]
    out = T.einsum(spec, *(p for p, _ in params))
    check_parity(out, lambda *ts: torch.einsum(equation, *ts), params)


# --- reductions -------------------------------------------------------------------------------


def _torch_reduce(kind: str, x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    if not axes:  # reducing over no axis is the identity (torch would reduce over all)
        return x * 1
    return {"sum": torch.sum, "mean": torch.mean, "max": torch.amax}[kind](x, dim=axes)


@pytest.mark.parametrize("prec", PRECS, **ids)
@pytest.mark.parametrize("kind", ["sum", "mean", "max"])
@drawn()
def test_reduction_gradients(kind, prec, data):
    """Reductions over all axes, a row, or chosen positions. ``max`` values are distinct (on
    ties ocannl routes the gradient to every maximal element, torch splits it)."""
    shape = data.draw(shapes(), label="shape")
    axes, positions = data.draw(reduction_axes(shape), label="axes")
    av = data.draw(values(shape.dims, -3.0, 3.0, unique=kind == "max"), label="a")
    a = param_of("a", shape, prec)
    out = {"sum": T.sum, "mean": T.mean, "max": T.max}[kind](a, axes)
    kept = [d for k, d in enumerate(shape.dims) if k not in positions]
    assert out.dims == tuple(kept)
    check_parity(out, lambda ta: _torch_reduce(kind, ta, positions), [(a, av)])


def test_max_gradient_is_shared_by_tied_maxima():
    """As torch.amax: ties split the gradient evenly (each taking all of it would multiply it)."""
    from ocannl import Context, train

    a = T.param("a", output_dims=(4,), input_dims=())
    loss = T.max(a) * 3.0
    ctx = Context.cpu()
    ctx.set_values(a, [1.0, 5.0, 5.0, -2.0])
    ctx, r = ctx.compile(train.grad_update(loss))
    ctx.run(r)
    np.testing.assert_array_equal(ctx.get_values(a.grad), [0.0, 1.5, 1.5, 0.0])


# --- cast -------------------------------------------------------------------------------------

CASTS = [(Precision.f32, Precision.f64), (Precision.f64, Precision.f32),
         (Precision.f32, Precision.f16), (Precision.f32, Precision.bf16),
         (Precision.f64, Precision.bf16)]


@pytest.mark.parametrize(("src", "dst"), CASTS, ids=lambda p: p.value)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_cast_gradients(src, dst, data):
    """A cast rounds the value to nearest even and passes the gradient back, itself rounded
    at the narrow precision, as torch's ``.to(dtype)`` does. The 16-bit results are compared
    after widening; the loss weights ``r`` are f32."""
    shape = data.draw(shapes(), label="shape")
    av = data.draw(values(shape.dims, -3.0, 3.0), label="a")
    av = av + data.draw(st.floats(-1e-4, 1e-4), label="offset")  # bits below f32 for f64 sources
    a = param_of("a", shape, src)
    out = T.cast(a, dst)
    assert out.prec is dst and out.dims == a.dims
    if dst.is_narrow:
        out = T.cast(out, "f32")  # widened for the comparison

    def torch_fn(ta):
        t_out = ta.to(TORCH_DTYPE[dst])
        return t_out.float() if dst.is_narrow else t_out

    rel = 1e-5 if Precision.f32 in (src, dst) or dst.is_narrow else 1e-10
    check_parity(out, torch_fn, [(a, av)], rel=rel)


# --- composite graphs: shared subexpressions accumulate their gradients -----------------------


@pytest.mark.parametrize("prec", PRECS, **ids)
@drawn(f32=4, f64=2)
def test_shared_subexpressions(prec, data):
    shape = data.draw(shapes(batch=1, output=2, inp=0), label="shape")
    av = data.draw(values(shape.dims, 0.5, 2.0), label="a")
    bv = data.draw(values(shape.output, -2.0, 2.0), label="b")
    a = param_of("a", shape, prec)
    b = T.param("b", output_dims=shape.output, input_dims=(), prec=prec)
    h = a * b
    out = h * h + T.tanh(h) * a - T.log(a) / T.sigmoid(b) + T.sum(a, "batch") * b
    nb = len(shape.batch)

    def torch_fn(ta, tb):
        th = ta * tb
        t_sum = ta.sum(dim=list(range(nb))) if nb else ta
        return th * th + torch.tanh(th) * ta - torch.log(ta) / torch.sigmoid(tb) + t_sum * tb

    check_parity(out, torch_fn, [(a, av), (b, bv)])


def test_relu_gradient_reads_the_result_so_the_input_is_not_kept():
    """relu's gradient passes where its result is positive (as torch's does), which is where
    its input is: the same bits. A hidden layer's pre-activation (``x @ w + b``, local to the
    block) is then read by nothing after the forward pass, so the step hands it to relu in a
    register (``LoopGroup.registers``) and never stores it."""
    from ocannl import Context, nn_blocks, train
    from ocannl.ir.assignments import reads
    from ocannl.ir.lowering import LoopGroup

    x = T.term(np.random.default_rng(2).normal(size=(8, 16)), label="rx", batch_dims=(8,),
               output_dims=(16,))
    y = T.relu(T.param("rw", output_dims=(6,), input_dims=(16,)) @ x)
    read = {g.node.id for a in y.backprop_code for g in reads(a.expr)}
    assert read == {y.value.id, y.grad.id}  # the result and its gradient, not the input
    logits, _ = nn_blocks.mlp(x, (12,), 4, label="rmlp")
    loss = T.sum(logits * logits)
    ctx = train.init_params(Context.cpu(), loss)
    groups = [g for g in ctx.lower(train.grad_update(loss)) if isinstance(g, LoopGroup)]
    relu = [g for g in groups if any(n.assign.lhs.name.startswith("relu") for n in g.nests)]
    assert relu and all(g.registers for g in relu)
