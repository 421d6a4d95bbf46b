"""Convolution and pooling (``ocannl.tensor.spatial``): values and gradients against PyTorch,
images channels-last, on hypothesis-drawn sizes, strides and paddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_oracle import check_parity

import ocannl.tensor as T
from ocannl import Context, Precision
from ocannl.ir.lowering import lower, nests
from ocannl.ir.target import PRODUCTS
from ocannl.tensor.spatial import avg_pool2d, conv2d, max_pool2d

F32 = Precision.f32


def _nchw(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 3, 1, 2)


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1)


@st.composite
def conv_case(draw):
    k = draw(st.sampled_from([1, 2, 3]))
    stride = draw(st.sampled_from([1, 2]))
    pad = draw(st.integers(0, k // 2 + (k == 3)))
    h = draw(st.integers(max(1, k - 2 * pad), 7))
    w = draw(st.integers(max(1, k - 2 * pad), 6))
    return (draw(st.integers(1, 2)), h, w, draw(st.integers(1, 3)), draw(st.integers(1, 4)), k,
            stride, pad, draw(st.integers(0, 2**16)))


@settings(max_examples=12, deadline=None)
@given(conv_case())
def test_conv2d_matches_torch(case):
    b, h, w, c, o, k, stride, pad, seed = case
    rng = np.random.default_rng(seed)
    xv = rng.uniform(-1, 1, (b, h, w, c))
    kv = rng.uniform(-1, 1, (o, k, k, c))
    x = T.param("x", batch_dims=(b,), output_dims=(h, w, c), input_dims=())
    kernel = T.param("kernel", output_dims=(o,), input_dims=(k, k, c))
    y = conv2d(x, kernel, stride=stride, padding=pad)
    check_parity(y, lambda tx, tk: _nhwc(F.conv2d(_nchw(tx), tk.permute(0, 3, 1, 2),
                                                  stride=stride, padding=pad)),
                 [(x, xv), (kernel, kv)], seed=seed)


@pytest.mark.parametrize("stride,pad", [(1, 1), (2, 1), (1, 0), (2, 0)])
def test_conv2d_strides_and_paddings(stride, pad):
    rng = np.random.default_rng(stride * 10 + pad)
    xv, kv = rng.uniform(-1, 1, (2, 8, 7, 3)), rng.uniform(-1, 1, (5, 3, 3, 3))
    x = T.param("x", batch_dims=(2,), output_dims=(8, 7, 3), input_dims=())
    kernel = T.param("kernel", output_dims=(5,), input_dims=(3, 3, 3))
    y = conv2d(x, kernel, stride=stride, padding=pad)
    check_parity(y, lambda tx, tk: _nhwc(F.conv2d(_nchw(tx), tk.permute(0, 3, 1, 2),
                                                  stride=stride, padding=pad)),
                 [(x, xv), (kernel, kv)])


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 2), st.integers(2, 7), st.integers(2, 7), st.integers(1, 3),
       st.sampled_from([(2, 2), (3, 1), (2, 1), (3, 2)]), st.sampled_from(["max", "avg"]),
       st.integers(0, 2**16))
def test_pooling_matches_torch(b, h, w, c, window_stride, kind, seed):
    window, stride = window_stride
    if window > min(h, w):
        window = min(h, w)
    rng = np.random.default_rng(seed)
    xv = rng.permutation(b * h * w * c).reshape(b, h, w, c) / 7.0  # distinct: one maximum
    x = T.param("x", batch_dims=(b,), output_dims=(h, w, c), input_dims=())
    ours, theirs = (max_pool2d, F.max_pool2d) if kind == "max" else (avg_pool2d, F.avg_pool2d)
    y = ours(x, window=window, stride=stride)
    check_parity(y, lambda tx: _nhwc(theirs(_nchw(tx), window, stride)), [(x, xv)], seed=seed)


def test_the_image_gradient_is_a_scatter_and_padding_reads_zero():
    x = T.param("x", batch_dims=(1,), output_dims=(4, 4, 1), input_dims=())
    kernel = T.param("kernel", output_dims=(1,), input_dims=(3, 3, 1))
    y = conv2d(x, kernel, padding=1)
    ctx = Context.cpu().set_values(x, np.ones((1, 4, 4, 1))).set_values(kernel, np.ones(
        (1, 3, 3, 1)))
    from ocannl import train

    code = lower(train.grad_update(T.sum(y)), PRODUCTS)
    assert any(n.scatter and n.assign.lhs is x.grad for n in nests(code))
    ctx, r = ctx.compile(train.grad_update(T.sum(y)))
    ctx.run(r)
    # a corner output sees 4 image cells (the rest is padding), an edge 6, the inside 9
    np.testing.assert_array_equal(ctx.get_values(y)[0, :, :, 0],
                                  [[4, 6, 6, 4], [6, 9, 9, 6], [6, 9, 9, 6], [4, 6, 6, 4]])


def test_bad_images_and_windows_are_refused_at_build_time():
    flat = T.param("flat", batch_dims=(2,), output_dims=(5, 3), input_dims=())
    kernel = T.param("kernel", output_dims=(2,), input_dims=(3, 3, 3))
    with pytest.raises(ValueError, match="is not an image"):
        conv2d(flat, kernel)
    img = T.param("img", batch_dims=(2,), output_dims=(4, 4, 2), input_dims=())
    with pytest.raises(ValueError, match=r"input row \(k, k, 2\)"):
        conv2d(img, kernel)
    with pytest.raises(ValueError, match="window 5 does not fit the image height 4"):
        max_pool2d(img, window=5)
    with pytest.raises(ValueError, match="stride must be >= 1"):
        avg_pool2d(img, window=2, stride=0)


def test_pooling_ties_send_the_gradient_to_the_first_maximum_like_torch():
    """Zero-padded relu maps are full of ties: every tied element taking the whole gradient
    would multiply it (the digits convnet's parity with torch failed on this)."""
    xv = np.zeros((1, 4, 4, 2))
    xv[0, 0, 0, 0], xv[0, 2, 3, 1] = 1.0, -1.0
    x = T.param("x", batch_dims=(1,), output_dims=(4, 4, 2), input_dims=())
    check_parity(max_pool2d(x), lambda tx: _nhwc(F.max_pool2d(_nchw(tx), 2, 2)), [(x, xv)])


def test_reduction_ties_share_the_gradient_evenly_like_torch_amax():
    mv = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    m = T.param("m", batch_dims=(2,), output_dims=(4,), input_dims=())
    check_parity(T.max(m, "output"), lambda tm: torch.amax(tm, dim=1), [(m, mv)])
    check_parity(T.max(m), lambda tm: torch.amax(tm), [(m, mv)])
