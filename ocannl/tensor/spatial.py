"""Convolution and pooling over channels-last images, with backprop.

An image is a tensor whose output row is ``(height, width, channels)`` (batch axes in the batch
row), as in OCANNL. Both ops are single assignments whose input index is affine in the
iterators, ``stride * oh + kh - pad``: a read outside the image gives 0 (zero padding), and
their gradients into the image are scatters over the same projections.
"""

from __future__ import annotations

from ocannl.ir.assignments import Affine, Index
from ocannl.tensor.leaves import _lift
from ocannl.tensor.pointwise import div
from ocannl.tensor.reductions import _contract, _reduce_with
from ocannl.tensor.shape import Shape, broadcast_projection, int_value
from ocannl.tensor.tensor import Tensor


def _image_rows(x: Tensor, what: str) -> tuple[int, int, int]:
    if x.shape.input not in ((), None) or len(x.shape.output) != 3:
        raise ValueError(f"{what}: {x.label} {x.shape} is not an image: expected an output row "
                         f"(height, width, channels) and no input axes")
    h, w, c = x.shape.output
    return h, w, c


def _padding(padding: int | tuple[int, int], what: str) -> tuple[int, int]:
    """``(before, after)``: the zeros added at the top and the bottom of the height (the left
    and the right of the width) from an int (both sides) or a pair."""
    if isinstance(padding, tuple) and len(padding) == 2:
        lo, hi = (int_value(f"{what}: padding", p) for p in padding)
    elif isinstance(padding, tuple):
        raise TypeError(f"{what}: padding must be an integer or a pair (before, after), got "
                        f"{padding!r:.60}")
    else:
        lo = hi = int_value(f"{what}: padding", padding)
    if lo < 0 or hi < 0:
        raise ValueError(f"{what}: padding must be >= 0, got {padding!r}")
    return lo, hi


def _out_size(size: int, window: int, stride: int, pad: tuple[int, int], what: str,
              axis: str) -> int:
    if stride < 1:
        raise ValueError(f"{what}: stride must be >= 1, got {stride}")
    if window < 1 or window > size + sum(pad):
        side = f"{pad[0]} each side" if pad[0] == pad[1] else f"{pad[0]} before, {pad[1]} after"
        raise ValueError(f"{what}: window {window} does not fit the image {axis} {size} "
                         f"(padding {side})")
    return (size + sum(pad) - window) // stride + 1


def _window_space(x: Tensor, window: int, stride: int, pad: tuple[int, int],
                  extra: tuple[int, ...],
                  what: str) -> tuple[Shape, tuple[int, ...], tuple[Index, ...], int]:
    """The product space ``batch..., oh, ow, <extra>..., kh, kw, c`` and x's projection.

    Returns the result shape for a result whose output row is ``(oh, ow, *extra)`` (channels
    appended by the caller through ``extra``), the space, x's projection, and where the
    iterators after the result's start (kh)."""
    h, w, c = _image_rows(x, what)
    oh = _out_size(h, window, stride, pad, what, "height")
    ow = _out_size(w, window, stride, pad, what, "width")
    nb = len(x.shape.batch)
    shape = Shape(x.shape.batch, (oh, ow, *extra), ())
    i_oh, i_ow = nb, nb + 1
    i_kh = nb + 2 + len(extra)
    space = (*x.shape.batch, oh, ow, *extra, window, window)
    proj = (*broadcast_projection(Shape(batch=x.shape.batch), Shape(batch=x.shape.batch)),
            Affine(((stride, i_oh), (1, i_kh)), -pad[0]),
            Affine(((stride, i_ow), (1, i_kh + 1)), -pad[0]))
    return shape, space, proj, i_kh


def conv2d(x: Tensor, kernel: Tensor, *, stride: int = 1,
           padding: int | tuple[int, int] = 0) -> Tensor:
    """``y[b, oh, ow, o] = sum_{kh, kw, c} x[b, stride*oh + kh - padding, stride*ow + kw -
    padding, c] * kernel[o, kh, kw, c]``; ``kernel``'s output row is ``(out_channels,)`` and its
    input row ``(k, k, in_channels)`` (torch's weight, channels last). ``padding``: zeros on
    each side, or ``(before, after)`` (the same for height and width), as an even kernel's
    "same" padding needs."""
    stride = int_value("conv2d: stride", stride)
    pad = _padding(padding, "conv2d")
    x, kernel = _lift(x), _lift(kernel)
    _, _, c = _image_rows(x, "conv2d")
    k_in = kernel.shape.input
    if len(kernel.shape.output) != 1 or k_in is None or len(k_in) != 3 or k_in[0] != k_in[1] \
            or k_in[2] != c or kernel.shape.batch:
        raise ValueError(f"conv2d: kernel {kernel.label} {kernel.shape} does not fit image "
                         f"{x.label} {x.shape}: expected output row (out_channels,) and input "
                         f"row (k, k, {c})")
    (o,), k = kernel.shape.output, k_in[0]
    shape, space, xproj, i_kh = _window_space(x, k, stride, pad, (o,), "conv2d")
    i_o, i_c = i_kh - 1, i_kh + 2
    space = (*space, c)
    return _contract("conv2d", x, kernel, (*xproj, i_c), (i_o, i_kh, i_kh + 1, i_c), shape,
                     space)


def _pool(name: str, x: Tensor, window: int, stride: int, accum: str) -> Tensor:
    window = int_value(f"{name}: window", window)
    stride = int_value(f"{name}: stride", stride)
    x = _lift(x)
    _, _, c = _image_rows(x, name)
    shape, space, xproj, i_kh = _window_space(x, window, stride, (0, 0), (), name)
    i_c = i_kh + 2
    nb = len(x.shape.batch)
    res = (*range(nb), nb, nb + 1, i_c)
    # The channel iterator follows the window's: reorder so the result's come first.
    shape = Shape(shape.batch, (*shape.output, c), ())
    return _reduce_with(name, x, (*xproj, i_c), res, shape, (*space, c), accum, ties="first")


def max_pool2d(x: Tensor, *, window: int = 2, stride: int = 2) -> Tensor:
    """The maximum over each ``window x window`` patch, patches ``stride`` apart (no padding:
    a partial patch at the border is dropped, as torch's default)."""
    return _pool("max_pool2d", x, window, stride, "max")


def avg_pool2d(x: Tensor, *, window: int = 2, stride: int = 2) -> Tensor:
    """The mean over each ``window x window`` patch, patches ``stride`` apart (no padding)."""
    return div(_pool("avg_pool2d", x, window, stride, "+"), float(window * window))
