"""einsum's spec grammar: multi-letter labels, ``...`` batch axes, affine axes (convolutions),
against NumPy / PyTorch, and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch.nn.functional as F
from torch_oracle import check_parity

import ocannl.tensor as T
from ocannl import Context, train
from ocannl.tensor.spatial import conv2d


def _values(t: T.Tensor, ctx: Context) -> np.ndarray:
    ctx, r = ctx.compile(train.forward(t))
    return ctx.run(r).get_values(t)


def test_multi_letter_labels_are_comma_separated():
    rng = np.random.default_rng(0)
    xv, wv = rng.normal(size=(4, 3)), rng.normal(size=(5, 3))
    x = T.term(xv, label="x")  # batch (4,), output (3,)
    w = T.term(wv, label="w", batch_dims=(), output_dims=(5,), input_dims=(3,))
    y = T.einsum("rows|d_in,;d_in->d_out=>rows|d_out", x, w)
    np.testing.assert_allclose(_values(y, Context.cpu()), xv @ wv.T, rtol=1e-6)


def test_ellipsis_stands_for_the_remaining_batch_axes():
    rng = np.random.default_rng(1)
    xv = rng.normal(size=(2, 3, 4))
    x = T.term(xv, label="x", batch_dims=(2, 3), output_dims=(4,))
    s = T.einsum("...|i=>...|", x)  # sum the output axis, keep every batch axis
    assert s.shape.batch == (2, 3)
    np.testing.assert_allclose(_values(s, Context.cpu()), xv.sum(-1), rtol=1e-6)


@pytest.mark.parametrize("stride,pad", [(1, 1), (2, 1), (1, 0), (2, 0)])
def test_an_affine_spec_is_a_convolution(stride, pad):
    """Upstream's grammar: ``stride*oh=+kh`` pads (``in = stride*out``), ``stride*oh<+kh`` is
    valid (``in = stride*(out-1) + kernel``): each must divide exactly, so the image's sizes
    are picked per case (the port's own ``2*oh+kh-1`` spelling gave way to upstream's)."""
    rng = np.random.default_rng(stride + 3 * pad)
    h, w = (8, 6) if pad else (7, 5)
    xv, kv = rng.uniform(-1, 1, (2, h, w, 3)), rng.uniform(-1, 1, (4, 3, 3, 3))
    x = T.param("x", batch_dims=(2,), output_dims=(h, w, 3), input_dims=())
    kernel = T.param("kernel", output_dims=(4,), input_dims=(3, 3, 3))
    mark = "=" if pad else "<"
    spec = f"b|{stride}*oh{mark}+kh,{stride}*ow{mark}+kw,c;kh,kw,c->o=>b|oh,ow,o"
    y = T.einsum(spec, x, kernel)
    assert y.dims == conv2d(x, kernel, stride=stride, padding=pad).dims
    check_parity(y, lambda tx, tk: F.conv2d(tx.permute(0, 3, 1, 2), tk.permute(0, 3, 1, 2),
                                            stride=stride, padding=pad).permute(0, 2, 3, 1),
                 [(x, xv), (kernel, kv)])


def test_spec_errors_name_the_spec_the_operands_and_the_axis():
    x = T.term(np.ones((2, 3)), label="x")
    with pytest.raises(ValueError, match="b\\|i"):
        T.einsum("b|i", x)
    with pytest.raises(ValueError, match=r"einsum 'b\|i,j=>b\|i' over x 2\|->3: Number of axes"):
        T.einsum("b|i,j=>b|i", x)
    with pytest.raises(ValueError, match="must be an integer literal"):
        T.einsum("b|k*i,j=>b|j", x)
    with pytest.raises(ValueError, match="an affine axis may only be read"):
        T.einsum("b|i=>b|2*i,", x)
    img = T.term(np.ones((1, 4, 4, 1)), label="img", batch_dims=(1,), output_dims=(4, 4, 1))
    k = T.term(np.ones((1, 9, 9, 1)), label="k", batch_dims=(), output_dims=(1,),
               input_dims=(9, 9, 1))
    with pytest.raises(ValueError, match="incompatible stride: input 4, window 9"):
        T.einsum("b|oh<+kh,ow<+kw,c;kh,kw,c->o=>b|oh,ow,o", img, k)
    with pytest.raises(ValueError, match="use_padding must be specified"):
        T.einsum("b|oh+kh,ow,c=>b|oh", img)
    y = T.term(np.ones((2, 4)), label="y")
    with pytest.raises(ValueError, match=r"einsum 'b\|i;b\|i=>b\|i' over x 2\|->3; y 2\|->4: "
                                         r"solved dimensions for axis 'i': mismatch: 3 and 4"):
        T.einsum("b|i;b|i=>b|i", x, y)


@pytest.mark.parametrize("spec,want", [
    ("b|i=>b|ii", lambda a: np.stack([np.diag(r) for r in a])),
    ("b|i=>b|i->i", lambda a: np.stack([np.diag(r) for r in a])),  # across rows
    ("b|ii=>b|i", None),
])
def test_a_repeated_label_reads_or_writes_a_diagonal(spec, want):
    """As upstream: repeated in the result it writes the diagonal (the other cells 0),
    repeated in an operand it reads it."""
    if want is None:
        av = np.arange(18.0).reshape(2, 3, 3)
        a = T.term(av, label="a", batch_dims=(2,))
        np.testing.assert_allclose(_values(T.einsum(spec, a), Context.cpu()),
                                   np.stack([np.diag(m) for m in av]))
        return
    av = np.arange(6.0).reshape(2, 3)
    a = T.term(av, label="a")
    np.testing.assert_allclose(_values(T.einsum(spec, a), Context.cpu()), want(av))


def test_assign_is_upstreams_cd_logic():
    """``T.assign(c, accum, a, b, logic=...)``: one assignment whose projections a spec (or
    upstream's "@", "." or "T") gives; ``reset=False`` adds to what ``c`` holds (``=+``)."""
    av = np.arange(6.0).reshape(2, 3)
    a = T.term(av, label="a", batch_dims=(), output_dims=[2], input_dims=[3])
    b = T.term(np.ones((3, 4)), label="b", batch_dims=(), output_dims=[3], input_dims=[4])
    c = T.param("c", init="zeros")
    ctx, compose = Context.cpu().compile(T.assign(c, "+", a, b, logic="@"))
    ctx = ctx.run(compose)
    np.testing.assert_allclose(ctx.get_values(c), av @ np.ones((3, 4)))
    ctx, again = ctx.compile(T.assign(c, "+", a, b, logic="@", reset=False))
    np.testing.assert_allclose(ctx.run(again).get_values(c), 2 * (av @ np.ones((3, 4))))
    t = T.param("t", init="zeros")
    ctx, tr = ctx.compile(T.assign(t, "=", a, logic="T"))
    np.testing.assert_allclose(ctx.run(tr).get_values(t), av.T)
    m = T.param("m", init="zeros")
    ctx, mx = ctx.compile(T.assign(m, "max", a, logic="|i->o => o"))
    np.testing.assert_allclose(ctx.run(mx).get_values(m), av.max(axis=1))
    with pytest.raises(ValueError, match=r"assign ~logic:'@' into c: the spec names 2 operands"):
        T.assign(c, "+", a, logic="@")
    with pytest.raises(ValueError, match=r"assign ~logic:'@' into bad over a .*; b .*"):
        T.assign(T.term(np.zeros((5, 5)), label="bad"), "+", a, b, logic="@")
