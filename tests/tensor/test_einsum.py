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
    rng = np.random.default_rng(stride + 3 * pad)
    xv, kv = rng.uniform(-1, 1, (2, 7, 6, 3)), rng.uniform(-1, 1, (4, 3, 3, 3))
    x = T.param("x", batch_dims=(2,), output_dims=(7, 6, 3), input_dims=())
    kernel = T.param("kernel", output_dims=(4,), input_dims=(3, 3, 3))
    off = f"-{pad}" if pad else ""
    spec = f"b|{stride}*oh+kh{off},{stride}*ow+kw{off},c;kh,kw,c->o=>b|oh,ow,o"
    y = T.einsum(spec, x, kernel)
    assert y.dims == conv2d(x, kernel, stride=stride, padding=pad).dims
    check_parity(y, lambda tx, tk: F.conv2d(tx.permute(0, 3, 1, 2), tk.permute(0, 3, 1, 2),
                                            stride=stride, padding=pad).permute(0, 2, 3, 1),
                 [(x, xv), (kernel, kv)])


def test_spec_errors_name_the_problem():
    x = T.term(np.ones((2, 3)), label="x")
    with pytest.raises(ValueError, match="expected 'A;B=>R'"):
        T.einsum("b|i", x)
    with pytest.raises(ValueError, match="output row .i,j. has 2 axes but x has shape"):
        T.einsum("b|i,j=>b|i", x)
    with pytest.raises(ValueError, match="not a label or an affine"):
        T.einsum("b|2**i,j=>b|j", T.term(np.ones((2, 3, 3)), label="x3", batch_dims=(2,),
                                               output_dims=(3, 3)))
    with pytest.raises(ValueError, match="result's axes must be plain"):
        T.einsum("b|i=>b|i+1,", x)
    img = T.term(np.ones((1, 4, 4, 1)), label="img", batch_dims=(1,), output_dims=(4, 4, 1))
    k = T.term(np.ones((1, 9, 9, 1)), label="k", batch_dims=(), output_dims=(1,),
               input_dims=(9, 9, 1))
    with pytest.raises(ValueError, match="would be empty"):
        T.einsum("b|oh+kh,ow+kw,c;kh,kw,c->o=>b|oh,ow,o", img, k)
    with pytest.raises(ValueError, match="cannot tell the extent"):
        T.einsum("b|oh+kh,ow,c=>b|oh", img)


@pytest.mark.parametrize("spec,operands,label", [
    ("b|h;h->o=>b|oo", 2, "o"),  # the issue's: neither a sum over h nor a diagonal
    ("b|i=>b|ii", 1, "i"),
    ("b|i=>bb|i", 1, "b"),
    ("b|i=>b|i->i", 1, "i"),  # across rows
])
def test_a_repeated_result_label_is_refused_naming_spec_and_label(spec: str, operands: int,
                                                                  label: str):
    a = T.term(np.arange(3.0).reshape(1, 3), label="a")
    b = T.term(np.ones((5, 3)), label="B", batch_dims=(), output_dims=(5,), input_dims=(3,))
    args = (a, b) if operands == 2 else (a,)
    with pytest.raises(ValueError, match=f"result label '{label}' appears more than once") \
            as err:
        T.einsum(spec, *args)
    assert repr(spec) in str(err.value)
