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
