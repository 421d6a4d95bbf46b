"""Model building blocks: the MLP and softmax cross-entropy the examples and benchmarks use."""

from __future__ import annotations

from collections.abc import Sequence

import ocannl.tensor as T
from ocannl.ir.ops import Precision
from ocannl.tensor.tensor import Tensor


def mlp(
    x: Tensor,
    hidden: Sequence[int],
    out_dim: int,
    *,
    label: str = "mlp",
    prec: Precision | str = Precision.f32,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """A relu MLP over ``x``'s output axes: ``w_k @ h + b_k`` per layer, no relu on the last.

    Returns the logits and the (weight, bias) pair of every layer, first layer first. Weights
    are laid out (out, in), as torch.nn.Linear's, and start kaiming-uniform like torch's.
    """
    h = x
    layers = []
    dims = [*hidden, out_dim]
    for k, d in enumerate(dims):
        w = T.param(f"{label}_w{k}", output_dims=[d], prec=prec)
        b = T.param(f"{label}_b{k}", output_dims=[d], input_dims=(), init="zeros", prec=prec)
        h = w @ h + b
        layers.append((w, b))
        if k < len(dims) - 1:
            h = T.relu(h)
    return h, layers


def softmax_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over the batch of ``-sum(targets * log_softmax(logits))`` (targets one-hot or
    probabilities over the output axes), computed stably via the max-shifted log-sum-exp."""
    z = logits - T.max(logits, "output")
    log_norm = T.log(T.sum(T.exp(z), "output"))
    return T.mean(T.sum(targets * (log_norm - z), "output"))


# --- convolutional blocks (images channels-last: output row (height, width, channels)) --------


def conv2d(
    x: Tensor,
    *,
    out_channels: int,
    kernel_size: int = 3,
    stride: int = 1,
    padding: str = "same",
    label: str = "conv",
    prec: Precision | str = Precision.f32,
) -> tuple[Tensor, Tensor, Tensor]:
    """A 2-D convolution plus bias; returns ``(y, kernel, bias)``, ``kernel`` of dims
    ``(out_channels, kernel_size, kernel_size, in_channels)`` (torch's weight, channels last).

    ``padding="same"`` pads ``(kernel_size - 1) // 2`` zeros each side (the output keeps the
    image size at stride 1; torch's ``padding=kernel_size // 2`` for odd sizes), ``"valid"``
    none."""
    from ocannl.tensor import spatial

    if padding not in ("same", "valid"):
        raise ValueError(f"conv2d {label}: padding must be 'same' or 'valid', got {padding!r}")
    if not isinstance(kernel_size, int) or kernel_size < 1:
        raise ValueError(f"conv2d {label}: kernel_size must be an integer >= 1, "
                         f"got {kernel_size!r}")
    if not isinstance(out_channels, int) or out_channels < 1:
        raise ValueError(f"conv2d {label}: out_channels must be an integer >= 1, "
                         f"got {out_channels!r}")
    _, _, c = spatial._image_rows(x, f"conv2d {label}")
    kernel = T.param(f"{label}_kernel", output_dims=[out_channels],
                     input_dims=(kernel_size, kernel_size, c), prec=prec)
    bias = T.param(f"{label}_bias", output_dims=[out_channels], input_dims=(), init="zeros",
                   prec=prec)
    pad = (kernel_size - 1) // 2 if padding == "same" else 0
    return spatial.conv2d(x, kernel, stride=stride, padding=pad) + bias, kernel, bias


def max_pool2d(x: Tensor, *, window: int = 2, stride: int = 2) -> Tensor:
    """The maximum over each ``window x window`` patch (see ``ocannl.tensor.spatial``)."""
    from ocannl.tensor import spatial

    return spatial.max_pool2d(x, window=window, stride=stride)


def avg_pool2d(x: Tensor, *, window: int = 2, stride: int = 2) -> Tensor:
    """The mean over each ``window x window`` patch (see ``ocannl.tensor.spatial``)."""
    from ocannl.tensor import spatial

    return spatial.avg_pool2d(x, window=window, stride=stride)


def global_avg_pool2d(x: Tensor) -> Tensor:
    """The mean over every position of the image: output row ``(channels,)``."""
    from ocannl.tensor import spatial

    spatial._image_rows(x, "global_avg_pool2d")
    off = x.shape.row_offsets()["output"]
    return T.mean(x, [off, off + 1])


def lenet(
    x: Tensor, *, num_classes: int, channels: tuple[int, int] = (8, 16), hidden: int = 64,
    label: str = "lenet",
) -> tuple[Tensor, list[Tensor]]:
    """A LeNet-style convnet: two (3x3 same conv, relu, 2x2 max pool) stages, then a relu MLP
    with one hidden layer. Returns the logits and every parameter, in creation order."""
    h, params = x, []
    for k, ch in enumerate(channels):
        h, kernel, bias = conv2d(h, out_channels=ch, kernel_size=3, label=f"{label}_conv{k}")
        h = max_pool2d(T.relu(h))
        params += [kernel, bias]
    logits, layers = mlp(h, [hidden], num_classes, label=f"{label}_fc")
    return logits, params + [t for pair in layers for t in pair]
