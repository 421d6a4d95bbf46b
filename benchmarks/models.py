"""The benchmarked models, built in each framework from a workload's spec and a fixture's
weights, so every runner (the suite's and ``data_parallel.py``'s) trains the same model.

- ``mlp``: relu layers ``sizes[0] -> ... -> sizes[-1]`` (``nn_blocks.mlp`` / ``nn.Linear``).
- ``lenet``: ``nn_blocks.lenet``: per stage a 3x3 "same" convolution, relu, 2x2 max pool;
  then a relu MLP ``sizes`` over the channels-last flattened features. Images are
  channels-last ``(height, width, channels)``. PyTorch's twin permutes them to NCHW for its
  convolutions, permutes the kernels from ``(out, k, k, in)`` to ``(out, in, k, k)``, and
  flattens channels-last before the first linear layer, so its weights are the same numbers.
- ``gpt``: ``nn_blocks.gpt`` over token ids, trained on every position's next token
  (``nn_blocks.cross_entropy``); PyTorch's twin is ``examples/torch_gpt.py``'s ``TorchGPT``,
  the one ``tests/test_gpt.py`` and ``examples/tiny_gpt.py`` compare against.

Fixture weights are (weight, bias) pairs, first layer first: a convolution's kernel laid out
``(out, k, k, in)``, a linear layer's ``(out, in)`` as ``torch.nn.Linear``'s (the first linear
layer of ``lenet`` reads the flattened ``(height, width, channels)`` features); a gpt's are by
``gpt``'s parameter names in torch's layout (``fixtures.gpt_shapes``).

The optimizer is the workload's: plain SGD (``sgd``) or Adam with torch's defaults (``adam``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from benchmarks.fixtures import Fixture, Weights
    from benchmarks.specs import Workload

Pairs = list[tuple[Any, Any]]
# A model's parameters: (weight, bias) pairs (mlp, lenet) or tensors by name (gpt).
Params = Pairs | dict[str, Any]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# --- this project ------------------------------------------------------------------------------


def ocannl_input(rows: np.ndarray, *, prec: str = "f32", label: str = "x") -> Any:
    """The input term for a batch shaped ``rows``: the first axis the batch, the rest the
    output row (the features, or an image's (height, width, channels))."""
    import ocannl.tensor as T

    return T.term(rows, label=label, batch_dims=rows.shape[:1], output_dims=rows.shape[1:],
                  prec=prec)


def ocannl_io(w: Workload, fx: Fixture) -> tuple[Any, Any]:
    """The input and target tensors, holding batch 0 (``feed_targets`` gives every batch's
    targets): an f32 input of features or images (a 16-bit variant casts it inside its step,
    as autocast casts an f32 input inside the first product) and one-hot targets; a gpt's
    token ids (``class_ids``)."""
    import ocannl.tensor as T

    if w.model == "gpt":
        return (T.class_ids(fx.x[0], num_classes=w.vocab, label="ids"),
                T.class_ids(fx.labels[0], num_classes=w.vocab, label="targets"))
    return ocannl_input(fx.x[0]), T.term(fx.onehot()[0], label="y")


def feed_targets(fx: Fixture) -> np.ndarray:
    """Per batch, what the target tensor of ``ocannl_io`` is set to: the next-token ids of a
    gpt, the one-hot labels of the others."""
    return fx.labels if fx.workload.model == "gpt" else fx.onehot()


def ocannl_loss(w: Workload, logits: Any, y: Any) -> Any:
    """The workload's softmax cross-entropy of f32 ``logits`` against ``ocannl_io``'s targets
    (a gpt's: the mean over every position of every sequence)."""
    from ocannl import nn_blocks

    if w.model == "gpt":
        return nn_blocks.cross_entropy(logits, y)
    return nn_blocks.softmax_cross_entropy(logits, y)


def ocannl_model(w: Workload, x: Any) -> tuple[Any, Params]:
    """The logits over ``x`` and the parameters: (weight, bias) pairs, first layer first, or a
    gpt's by name. Call it inside ``mixed_prec.with_master_weights`` for cast twins of f32
    masters."""
    from ocannl import nn_blocks

    if w.model == "gpt":
        return nn_blocks.gpt(x, vocab=w.vocab, context=w.context, d_model=w.d_model,
                             heads=w.heads, layers=w.layers, d_ff=w.d_ff, label="gpt")
    if w.model == "mlp":
        return nn_blocks.mlp(x, list(w.sizes[1:-1]), w.classes, label="mlp")
    if w.model == "lenet":
        logits, params = nn_blocks.lenet(x, num_classes=w.classes, channels=w.channels,
                                         hidden=w.sizes[1], label="lenet")
        return logits, list(zip(params[0::2], params[1::2], strict=True))
    raise ValueError(f"workload {w.name}: unknown model {w.model!r}")


def set_ocannl_weights(ctx: Any, layers: Params, weights: Weights) -> Any:
    """Write the fixture's weights into the parameters (reshaped to each parameter's dims: the
    first linear layer of ``lenet`` reads (height, width, channels), ``gpt``'s attention
    projections are torch's split by head)."""
    if isinstance(layers, dict):
        if set(layers) != set(weights):
            raise ValueError(f"the model's parameters {sorted(layers)} are not the fixture's "
                             f"{sorted(weights)}")
        for name, p in layers.items():
            ctx = ctx.set_values(p, weights[name].reshape(p.value.dims))
        return ctx
    for (wt, bt), (wv, bv) in zip(layers, weights, strict=True):
        ctx = ctx.set_values(wt, wv.reshape(wt.value.dims))
        ctx = ctx.set_values(bt, bv.reshape(bt.value.dims))
    return ctx


def ocannl_optimizer(w: Workload) -> Any:
    from ocannl import optim

    if w.optimizer == "sgd":
        return optim.SGD(w.learning_rate)
    if w.optimizer == "adam":
        return optim.Adam(w.learning_rate)
    raise ValueError(f"workload {w.name}: unknown optimizer {w.optimizer!r}")


# --- PyTorch -----------------------------------------------------------------------------------


def torch_gpt_class() -> Any:
    """``examples/torch_gpt.py``'s ``TorchGPT``, imported as the examples import it (their
    folder on ``sys.path``, appended: it shadows nothing)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    from torch_gpt import TorchGPT

    return TorchGPT


def torch_model(w: Workload, weights: Weights) -> Any:
    """The same model as ``ocannl_model`` (on the CPU, f32), holding the fixture's weights."""
    import torch

    if w.model == "gpt":
        return torch_gpt_class()(vocab=w.vocab, context=w.context, d_model=w.d_model,
                                 heads=w.heads, layers=w.layers, d_ff=w.d_ff).load(weights)

    class LeNet(torch.nn.Module):
        def __init__(self, convs: list[torch.nn.Conv2d], head: torch.nn.Sequential) -> None:
            super().__init__()
            self.convs = torch.nn.ModuleList(convs)
            self.head = head

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, h, w, c)
            h = x.permute(0, 3, 1, 2)
            for conv in self.convs:
                h = torch.nn.functional.max_pool2d(torch.relu(conv(h)), 2)
            return self.head(h.permute(0, 2, 3, 1).flatten(1))  # channels-last flattening

    def linear(wv: np.ndarray, bv: np.ndarray) -> torch.nn.Linear:
        lin = torch.nn.Linear(wv.shape[1], wv.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(wv))
            lin.bias.copy_(torch.from_numpy(bv))
        return lin

    n_conv = len(w.channels) if w.model == "lenet" else 0
    head: list[torch.nn.Module] = []
    fcs = weights[n_conv:]
    for k, (wv, bv) in enumerate(fcs):
        head.append(linear(wv, bv))
        if k < len(fcs) - 1:
            head.append(torch.nn.ReLU())
    if w.model == "mlp":
        return torch.nn.Sequential(*head)
    if w.model != "lenet":
        raise ValueError(f"workload {w.name}: unknown model {w.model!r}")
    convs = []
    for kv, bv in weights[:n_conv]:
        out_ch, k, _, in_ch = kv.shape
        conv = torch.nn.Conv2d(in_ch, out_ch, k, padding=(k - 1) // 2)
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(kv).permute(0, 3, 1, 2))
            conv.bias.copy_(torch.from_numpy(bv))
        convs.append(conv)
    return LeNet(convs, torch.nn.Sequential(*head))


def torch_loss(w: Workload, logits: Any, labels: Any) -> Any:
    """``torch.nn.functional.cross_entropy`` as ``ocannl_loss`` computes it: a gpt's logits
    ``(batch, seq, vocab)`` against ids ``(batch, seq)``, averaged over every position."""
    import torch

    if w.model == "gpt":
        return torch.nn.functional.cross_entropy(logits.reshape(-1, w.vocab), labels.reshape(-1))
    return torch.nn.functional.cross_entropy(logits, labels)


def torch_optimizer(w: Workload, params: Any) -> Any:
    import torch

    if w.optimizer == "sgd":
        return torch.optim.SGD(params, lr=w.learning_rate)
    if w.optimizer == "adam":
        return torch.optim.Adam(params, lr=w.learning_rate)
    raise ValueError(f"workload {w.name}: unknown optimizer {w.optimizer!r}")
