"""Model building blocks: the MLP and softmax cross-entropy the examples and benchmarks use."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np

import ocannl.tensor as T
from ocannl.errors import f32_positive, is_int, real, require_bool
from ocannl.ir.assignments import Accum, Const, Expr, Fixed, Get, apply
from ocannl.ir.ops import Precision, precision_of
from ocannl.ir.tnode import MemoryMode, Tnode, ids_issued
from ocannl.tensor.data import dropout_rate
from ocannl.tensor.leaves import expect_shape
from ocannl.tensor.shape import Shape, int_dims, int_value
from ocannl.tensor.sharing import current_blocks, shared_state
from ocannl.tensor.tensor import Tensor

F = TypeVar("F", bound=Callable[..., Any])


def _tensors(result: object) -> Iterator[Tensor]:
    """The tensors a block returns: its output, its parameters (in tuples, lists, dicts)."""
    if isinstance(result, Tensor):
        yield result
    elif isinstance(result, (tuple, list)):
        for r in result:
            yield from _tensors(r)
    elif isinstance(result, dict):
        for r in result.values():
            yield from _tensors(r)


def block(fn: F) -> F:
    """Make the tensors a block computes and does not return local to the routines computing
    them (``MemoryMode.local``). No one outside the block holds them, so neither the host nor
    another routine can want their values; each routine then keeps them in memory shared with
    its other local nodes whose uses do not overlap, as an eager framework frees activations
    once backprop used them. Cast twins stay as they are (``mixed_prec`` places them).

    Every parameter created while a block runs records the blocks being built, by label
    (``ocannl.tensor.sharing.block_path``), so ``ocannl.summary`` can list it by block."""
    default_label = inspect.signature(fn).parameters.get("label")
    default = fn.__name__ if default_label is None else default_label.default

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        first = ids_issued()
        # Which block a parameter belongs to, for ``ocannl.summary``.
        token = current_blocks.set((*current_blocks.get(), str(kwargs.get("label", default))))
        try:
            result = fn(*args, **kwargs)
        finally:
            current_blocks.reset(token)
        returned = list(_tensors(result))
        kept = {id(t) for t in returned}
        for out in returned:
            for t in out.topo():
                if (t.kind == "op" and t.master is None and t.value.id > first
                        and id(t) not in kept):
                    t.value.memory_mode = MemoryMode.local
        return result
    return wrapper  # type: ignore[return-value]


@block
def mlp(
    x: Tensor,
    hidden: Sequence[int],
    out_dim: int | None = None,
    *,
    label: str = "mlp",
    prec: Precision | str = Precision.f32,
) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """A relu MLP over ``x``'s output axes: ``w_k @ h + b_k`` per layer, no relu on the last.

    Returns the logits and the (weight, bias) pair of every layer, first layer first. Weights
    are laid out (out, in), as torch.nn.Linear's, and start kaiming-uniform like torch's. The
    first layer's input width is ``x``'s; ``out_dim=None`` leaves the last layer's width to
    what the logits meet (a loss's target).
    """
    dims: list[int | None] = [*int_dims(f"mlp {label}: hidden", hidden)]
    dims.append(None if out_dim is None else int_value(f"mlp {label}: out_dim", out_dim))
    bad = [d for d in dims if d is not None and d < 1]
    if bad:
        raise ValueError(f"mlp {label}: layer widths must be >= 1, got hidden {list(hidden)} and "
                         f"out_dim {out_dim}")
    h = x
    layers = []
    for k, d in enumerate(dims):
        out = None if d is None else [d]
        w = T.param(f"{label}_w{k}", output_dims=out, prec=prec)
        b = T.param(f"{label}_b{k}", output_dims=out, input_dims=(), init="zeros", prec=prec)
        h = w @ h + b
        layers.append((w, b))
        if k < len(dims) - 1:
            h = T.relu(h)
    return h, layers


@block
def softmax_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean over the batch of ``-sum(targets * log_softmax(logits))`` (targets one-hot or
    probabilities over the output axes), computed stably via the max-shifted log-sum-exp.

    ``targets`` must have ``logits``' shape exactly, as torch requires: a label column
    ``(N, 1)`` or a batch of one would otherwise broadcast over every class or row and train
    on another objective (use :func:`cross_entropy` for integer class ids)."""
    if not isinstance(targets, Tensor) or not isinstance(logits, Tensor):
        raise TypeError(f"softmax_cross_entropy: logits and targets must be Tensors, got "
                        f"{type(logits).__name__} and {type(targets).__name__}")
    if logits.shape_known and targets.shape_known and targets.shape != logits.shape:
        raise ValueError(f"softmax_cross_entropy: targets {targets.label} {targets.shape} do "
                         f"not match logits {logits.label} {logits.shape}: expected the same "
                         f"shape (one-hot rows or probabilities per class; integer labels go "
                         f"to nn_blocks.cross_entropy with T.class_ids)")
    # An open logits shape (a last layer left to inference) takes the targets' shape.
    expect_shape(logits, targets, "softmax_cross_entropy: the logits and the targets must have "
                 "the same shape")
    z = logits - T.max(logits, "output")
    log_norm = T.log(T.sum(T.exp(z), "output"))
    return T.mean(T.sum(targets * (log_norm - z), "output"))


# --- convolutional blocks (images channels-last: output row (height, width, channels)) --------


@block
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

    ``padding="same"`` keeps the image size at stride 1 as torch's ``padding="same"`` does:
    ``kernel_size - 1`` zeros in all, ``(kernel_size - 1) // 2`` before and the rest after (an
    even kernel gets one more after); ``"valid"`` none."""
    from ocannl.tensor import spatial

    if padding not in ("same", "valid"):
        raise ValueError(f"conv2d {label}: padding must be 'same' or 'valid', got {padding!r}")
    kernel_size = int_value(f"conv2d {label}: kernel_size", kernel_size)
    out_channels = int_value(f"conv2d {label}: out_channels", out_channels)
    stride = int_value(f"conv2d {label}: stride", stride)
    if kernel_size < 1:
        raise ValueError(f"conv2d {label}: kernel_size must be an integer >= 1, "
                         f"got {kernel_size!r}")
    if out_channels < 1:
        raise ValueError(f"conv2d {label}: out_channels must be an integer >= 1, "
                         f"got {out_channels!r}")
    _, _, c = spatial._image_rows(x, f"conv2d {label}")
    kernel = T.param(f"{label}_kernel", output_dims=[out_channels],
                     input_dims=(kernel_size, kernel_size, c), prec=prec)
    bias = T.param(f"{label}_bias", output_dims=[out_channels], input_dims=(), init="zeros",
                   prec=prec)
    before = (kernel_size - 1) // 2
    pad = (before, kernel_size - 1 - before) if padding == "same" else 0
    return spatial.conv2d(x, kernel, stride=stride, padding=pad) + bias, kernel, bias


@block
def max_pool2d(x: Tensor, *, window: int = 2, stride: int = 2) -> Tensor:
    """The maximum over each ``window x window`` patch (see ``ocannl.tensor.spatial``)."""
    from ocannl.tensor import spatial

    return spatial.max_pool2d(x, window=window, stride=stride)


@block
def avg_pool2d(x: Tensor, *, window: int = 2, stride: int = 2) -> Tensor:
    """The mean over each ``window x window`` patch (see ``ocannl.tensor.spatial``)."""
    from ocannl.tensor import spatial

    return spatial.avg_pool2d(x, window=window, stride=stride)


@block
def global_avg_pool2d(x: Tensor) -> Tensor:
    """The mean over every position of the image: output row ``(channels,)``."""
    from ocannl.tensor import spatial

    spatial._image_rows(x, "global_avg_pool2d")
    off = x.shape.row_offsets()["output"]
    return T.mean(x, [off, off + 1])


@block
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


# --- normalization, dropout, embeddings, attention ----------------------------------------------


def _last_output_axis(x: Tensor, what: str) -> int:
    if not x.shape.output:
        raise ValueError(f"{what}: {x.label} {x.shape} has no output axis to normalize over")
    return x.shape.row_offsets()["output"] + len(x.shape.output) - 1


def _param_prec(prec: Precision | str) -> Precision:
    """The precision of a block's parameters over activations of ``prec``: the same, but f32
    for a narrow one (f16, bf16): such parameters are masters, and
    ``mixed_prec.with_master_weights`` hands the model their twins at ``prec``."""
    prec = precision_of(prec)
    return Precision.f32 if prec.is_narrow else prec


def _vector_param(label: str, n: int, value: float, prec: Precision | str) -> Tensor:
    init = T.Init("zeros") if value == 0.0 else T.Init("constant", value)
    return T.param(label, output_dims=[n], input_dims=(), init=init, prec=_param_prec(prec))


@block
def layer_norm(
    x: Tensor,
    *,
    eps: float = 1e-5,
    label: str = "ln",
    params: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer normalization over the last output axis (torch.nn.LayerNorm over the last dim):
    ``(x - mean) / sqrt(var + eps) * gamma + beta``, the variance biased. Returns
    ``(y, gamma, beta)``; ``gamma`` starts at ones, ``beta`` at zeros (or pass ``params``
    to share them)."""
    ax = _last_output_axis(x, f"layer_norm {label}")
    d = x.dims[ax]
    gamma, beta = params if params is not None else (
        _vector_param(f"{label}_gamma", d, 1.0, x.prec), _vector_param(f"{label}_beta", d, 0.0,
                                                                         x.prec))
    return T.standardize(x, [ax], eps) * gamma + beta, gamma, beta


class BatchNormParams(NamedTuple):
    """A batch norm's parameters (``gamma``, ``beta``) and its running statistics (buffers:
    checkpoint them with ``T.buffers(loss)``)."""

    gamma: Tensor
    beta: Tensor
    running_mean: Tensor
    running_var: Tensor


@block
def batch_norm(
    x: Tensor,
    *,
    train: bool,
    eps: float = 1e-5,
    momentum: float = 0.1,
    label: str = "bn",
    params: BatchNormParams | None = None,
    sync: bool = False,
) -> tuple[Tensor, BatchNormParams]:
    """Batch normalization per channel, the channel being the last output axis (channels-last
    images: per channel over batch, height and width), as torch's BatchNorm in both modes.

    ``train=True``: normalizes with the batch statistics (the variance biased) and, every time
    the forward code runs, updates the running statistics ``r = (1 - momentum) * r + momentum *
    s`` with the batch mean and the *unbiased* batch variance. ``train=False``: normalizes with
    the running statistics (mean from 0, variance from 1). Build the evaluation graph with the
    training graph's ``params`` to share parameters and statistics. Returns
    ``(y, BatchNormParams)``. ``train`` must be a bool (a truthy ``"no"`` would build the
    training graph); ``eps`` a finite number > 0 that stays one in f32 (a negative or NaN eps
    makes every output NaN).

    ``sync=True`` (synced batch norm): under ``parallel.DataParallel`` the training statistics,
    and the two sums their gradient needs, are taken over the global batch, every shard's rows
    (``T.global_standardize``: exchanged inside the forward and the backward code, summed in
    the shard tree's order, so the same bits on any rank count). The default, ``False``,
    takes them per shard, as DDP without SyncBatchNorm does per rank; a shard of few rows
    then normalizes noisily. Outside a data-parallel run both are batch norm over the batch
    (``sync=True`` sums in f64 at f32)."""
    train = require_bool(f"batch_norm {label}: train", train)
    sync = require_bool(f"batch_norm {label}: sync", sync)
    eps = f32_positive(f"batch_norm {label}: eps", eps)
    m = real(f"batch_norm {label}: momentum", momentum, "a number in [0, 1]")
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"batch_norm {label}: momentum must be a number in [0, 1], got "
                         f"{momentum!r}")
    momentum = m
    ax = _last_output_axis(x, f"batch_norm {label}")
    c = x.dims[ax]
    axes = [k for k in range(len(x.dims)) if k != ax]
    count = math.prod(x.dims[k] for k in axes)
    if params is None:
        stat_shape = Shape((), (c,), ())

        def running_mean() -> Tensor:
            rm = Tnode(f"{label}_running_mean", (c,), x.prec, zero_start=True)
            return Tensor(rm, stat_shape, kind="term", differentiable=False)

        def running_var() -> Tensor:
            rv = Tnode(f"{label}_running_var", (c,), x.prec,
                       host_data=np.ones(c, x.prec.numpy_dtype))
            return Tensor(rv, stat_shape, kind="term", differentiable=False)

        # Under an ``ocannl.model.Model``, a later build (the evaluation graph) gets the same
        # statistics back, as it gets the same gamma and beta.
        params = BatchNormParams(
            _vector_param(f"{label}_gamma", c, 1.0, x.prec),
            _vector_param(f"{label}_beta", c, 0.0, x.prec),
            shared_state(f"{label}_running_mean", running_mean, dims=(c,), prec=x.prec),
            shared_state(f"{label}_running_var", running_var, dims=(c,), prec=x.prec))
    gamma, beta, running_mean, running_var = params
    if not train:
        y = (x - running_mean) / T.sqrt(running_var + eps) * gamma + beta
        T.register_buffers(y, [running_mean.value, running_var.value])
        return y, params
    if count < 2:
        raise ValueError(f"batch_norm {label}: training needs more than one value per channel, "
                         f"{x.label} {x.shape} has {count}")
    at = tuple(0 if k == ax else Fixed(0) for k in range(len(x.dims)))  # (c,) in the stats

    def update(r: Tensor, stat: Expr, scale: float) -> Accum:
        old = Get(r.value, (0,))
        new = apply("add", apply("mul", Const(1.0 - momentum), old),
                    apply("mul", Const(momentum * scale), stat))
        return Accum(r.value, (0,), "=", new, (c,))

    if sync:
        z, sums = T.global_standardize(
            x, axes, eps, label=f"{label}_standardize",
            same_on_every_shard=(running_mean.value, running_var.value))
        y = z * gamma + beta
        n = Get(sums.count, (Fixed(0),))  # the global batch's cells per channel
        total, squares = (Get(g[0], at) for g in sums.groups[:2])
        stats = ((apply("div", total, n), 1.0),
                 (apply("div", squares, apply("sub", n, Const(1.0))), 1.0))
    else:
        mean = T.reduce(x, "mean", axes, keepdims=True)
        xc = x - mean
        var = T.reduce(xc * xc, "mean", axes, keepdims=True)
        y = xc / T.sqrt(var + eps) * gamma + beta
        stats = ((Get(mean.value, at), 1.0), (Get(var.value, at), count / (count - 1)))
    y.forward_code = y.forward_code + (update(running_mean, *stats[0]),
                                       update(running_var, *stats[1]))
    T.register_buffers(y, [running_mean.value, running_var.value])
    return y, params


@block
def dropout(x: Tensor, *, rate: float, train: bool, rng: T.Rng | None = None) -> Tensor:
    """Inverted dropout while training (``train=True``: each element zeroed with probability
    ``rate``, the rest scaled by ``1 / (1 - rate)``, a new mask every step, drawn on the device
    from ``rng``); the identity otherwise. One ``rng`` can serve every dropout of a model: each
    draw advances its counter. ``train`` must be a bool, ``rate`` a number (NumPy's too)."""
    train = require_bool("dropout: train", train)
    rate = dropout_rate(rate)
    if not train or rate == 0.0:
        return x
    if rng is None:
        raise ValueError("dropout: training needs an rng (ocannl.tensor.Rng(seed)) to draw "
                         "masks from")
    return T.dropout(x, rate=rate, rng=rng)


@block
def embedding(
    ids: T.ClassIds,
    *,
    vocab: int,
    dim: int,
    label: str = "emb",
    prec: Precision | str = Precision.f32,
    table: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """An embedding lookup: row ``ids[b]`` of a ``(vocab, dim)`` table (torch.nn.Embedding's
    weight, drawn from N(0, 1) like it) at every batch position. Returns ``(y, table)``."""
    if not isinstance(ids, T.ClassIds):
        raise TypeError(f"embedding {label}: ids must come from ocannl.tensor.class_ids, "
                        f"got {ids!r}")
    if ids.num_classes != vocab:
        raise ValueError(f"embedding {label}: the ids have {ids.num_classes} classes, the "
                         f"table {vocab} rows")
    if table is None:
        table = T.param(f"{label}_table", output_dims=[vocab, dim], input_dims=(),
                        init=T.Init("normal", 0.0, 1.0), prec=prec)
    return T.embedding(ids, table), table


_LETTERS = "ABCDEFGHIJKLMNOPRSTUVWXYZ"


@block
def multi_head_attention(
    x: Tensor,
    *,
    num_heads: int,
    d_k: int,
    d_v: int | None = None,
    causal: bool = False,
    bias: bool = True,
    label: str = "mha",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Multi-head scaled dot-product self-attention over the sequence axis, the last batch axis
    of ``x`` (``x``: batch row ``(..., seq)``, output row ``(d_model,)``).

    Per head: ``softmax(q k^T / sqrt(d_k)) v`` over key positions, with ``causal=True``
    masking the keys after each query (scores replaced by -1e9 before the stable softmax).
    Projections ``q = wq @ x + bq`` with ``wq`` of dims ``(heads, d_k, d_model)`` (torch's
    ``(heads * d_k, d_model)``, reshaped), likewise ``k`` and ``v``; the output projection
    ``wo`` has dims ``(d_model, heads, d_v)``. Returns ``(y, params)``, ``params`` the weights
    and biases by name (``wq, bq, wk, bk, wv, bv, wo, bo``; biases start at zero)."""
    d_v = d_k if d_v is None else d_v
    if x.shape.input not in ((), None) or len(x.shape.output) != 1 or not x.shape.batch:
        raise ValueError(f"multi_head_attention {label}: expected x with batch row "
                         f"(..., seq), output row (d_model,) and no input axes, got {x.shape}")
    for name, v in (("num_heads", num_heads), ("d_k", d_k), ("d_v", d_v)):
        if not is_int(v) or v < 1:
            raise ValueError(f"multi_head_attention {label}: {name} must be an integer >= 1, "
                             f"got {v!r}")
    num_heads, d_k, d_v = int(num_heads), int(d_k), int(d_v)
    d_model = x.shape.output[0]
    seq = x.shape.batch[-1]
    pre = _LETTERS[:len(x.shape.batch) - 1]
    params: dict[str, Tensor] = {}

    def project(name: str, out_dims: tuple[int, ...], h: Tensor) -> Tensor:
        w = T.param(f"{label}_w{name}", output_dims=out_dims, prec=_param_prec(h.prec))
        params[f"w{name}"] = w
        y = w @ h
        if bias:
            b = T.param(f"{label}_b{name}", output_dims=out_dims, input_dims=(), init="zeros",
                        prec=_param_prec(h.prec))
            params[f"b{name}"] = b
            y = y + b
        return y

    q = project("q", (num_heads, d_k), x)
    k = project("k", (num_heads, d_k), x)
    v = project("v", (num_heads, d_v), x)
    # Scores laid out (..., head, query, key): per head a matrix with unit-stride rows, so the
    # two products are batched GEMMs, and the softmax runs along contiguous keys.
    scores = T.einsum(f"{pre}q|hd;{pre}k|hd=>{pre}hqk|", q, k) * (1.0 / math.sqrt(d_k))
    if causal:
        mask = T.term(np.tril(np.ones((seq, seq))), label=f"{label}_causal",
                      batch_dims=(seq, seq), output_dims=(), prec=x.prec)
        scores = T.where(mask, scores, -1e9)
    attn = T.softmax(scores, len(pre) + 2)  # over the key positions
    heads = T.einsum(f"{pre}hqk|;{pre}k|hv=>{pre}q|hv", attn, v)
    y = project("o", (d_model,), heads)
    # the dict in the order wq, bq, wk, bk, wv, bv, wo, bo
    return y, params


@block
def decoder_block(
    x: Tensor,
    *,
    num_heads: int,
    d_k: int | None = None,
    d_v: int | None = None,
    d_ff: int | None = None,
    causal: bool = True,
    eps: float = 1e-5,
    gelu_approximate: str = "none",
    dropout_rate: float = 0.0,
    train: bool = False,
    rng: T.Rng | None = None,
    label: str = "dec",
) -> tuple[Tensor, dict[str, Tensor]]:
    """A pre-norm transformer decoder block (GPT-style, no cross-attention)::

        h = x + dropout(attention(layer_norm(x)))
        y = h + dropout(w2 @ gelu(w1 @ layer_norm(h) + b1) + b2)

    ``d_k`` defaults to ``d_model // num_heads``, ``d_v`` to ``d_k``, ``d_ff`` to
    ``4 * d_model``. Returns ``(y, params)``: ``ln1_gamma, ln1_beta``, the attention's
    (``wq`` ... ``bo``), ``ln2_gamma, ln2_beta, w1, b1, w2, b2``."""
    if len(x.shape.output) != 1:
        raise ValueError(f"decoder_block {label}: expected output row (d_model,), got {x.shape}")
    d_model = x.shape.output[0]
    d_k = d_k or max(1, d_model // num_heads)
    d_ff = d_ff or 4 * d_model
    params: dict[str, Tensor] = {}
    z, params["ln1_gamma"], params["ln1_beta"] = layer_norm(x, eps=eps, label=f"{label}_ln1")
    a, attn_params = multi_head_attention(z, num_heads=num_heads, d_k=d_k, d_v=d_v,
                                          causal=causal, label=f"{label}_attn")
    params.update(attn_params)
    h = x + dropout(a, rate=dropout_rate, train=train, rng=rng)
    z2, params["ln2_gamma"], params["ln2_beta"] = layer_norm(h, eps=eps, label=f"{label}_ln2")
    pp = _param_prec(x.prec)
    w1 = T.param(f"{label}_w1", output_dims=[d_ff], prec=pp)
    b1 = T.param(f"{label}_b1", output_dims=[d_ff], input_dims=(), init="zeros", prec=pp)
    w2 = T.param(f"{label}_w2", output_dims=[d_model], prec=pp)
    b2 = T.param(f"{label}_b2", output_dims=[d_model], input_dims=(), init="zeros", prec=pp)
    m = w2 @ T.gelu(w1 @ z2 + b1, approximate=gelu_approximate) + b2
    params.update(w1=w1, b1=b1, w2=w2, b2=b2)
    return h + dropout(m, rate=dropout_rate, train=train, rng=rng), params


@block
def cross_entropy(logits: Tensor, class_ids: T.ClassIds) -> Tensor:
    """Mean over the batch of ``-log_softmax(logits)[class]`` (torch's ``cross_entropy`` with
    integer targets): ``logits`` has the ids' batch axes and one output axis of
    ``num_classes`` logits; the log-softmax is max-shifted. Ids are validated when created and
    by ``Context.set_values``: one that is not a valid class is refused, naming it."""
    if not isinstance(class_ids, T.ClassIds):
        raise TypeError(f"cross_entropy: targets must come from ocannl.tensor.class_ids, "
                        f"got {class_ids!r}")
    expect = Shape(class_ids.shape.batch, (class_ids.num_classes,), ())
    if logits.shape_known and logits.shape != expect:
        raise ValueError(f"cross_entropy: logits {logits.label} {logits.shape} do not match "
                         f"the targets: expected {expect}")
    # An open logits shape (a last layer left to inference) takes the targets' batch axes
    # and one output axis of num_classes.
    expect_shape(logits, expect, "cross_entropy: the logits must match the targets")
    picked = T.sum(T.one_hot(class_ids, prec=logits.prec) * T.log_softmax(logits, "output"),
                   "output")
    return -T.mean(picked)


# --- a decoder-only transformer -----------------------------------------------------------------


@block
def gpt(
    ids: T.ClassIds,
    *,
    vocab: int,
    context: int,
    d_model: int,
    heads: int,
    layers: int,
    d_ff: int | None = None,
    eps: float = 1e-5,
    gelu_approximate: str = "none",
    dropout_rate: float = 0.0,
    train: bool = False,
    rng: T.Rng | None = None,
    label: str = "gpt",
) -> tuple[Tensor, dict[str, Tensor]]:
    """A decoder-only (GPT-style) transformer over token ids: ``ids`` has batch row
    ``(..., seq)``, ``seq <= context``. Computes::

        h = tok_emb[ids] + pos_emb[0 .. seq-1]
        h = decoder_block(h)            # `layers` times: pre-norm, causal self-attention
        logits = head_w @ layer_norm(h) + head_b

    ``logits`` has the ids' batch row and output row ``(vocab,)``: position ``t``'s logits
    predict token ``t + 1`` and see only the tokens at ``0 .. t``. Heads of ``d_model // heads``
    dims each; ``d_ff`` defaults to ``4 * d_model``; the gelu, layer-norm ``eps`` and dropout as
    :func:`decoder_block` (dropout after the embeddings too).

    Returns ``(logits, params)``, ``params`` by name in creation order: ``tok_emb``
    ``(vocab, d_model)``, ``pos_emb`` ``(context, d_model)`` (torch.nn.Embedding's layout and
    N(0, 1) init), ``block{k}.NAME`` for each :func:`decoder_block` parameter ``NAME``,
    ``ln_f_gamma``, ``ln_f_beta``, and the head ``head_w`` ``(vocab, d_model)``, ``head_b``.
    Every weight is (out, in) like torch's; the attention projections are torch's
    ``(heads * d_k, d_model)`` reshaped to ``(heads, d_k, d_model)`` (``wo``:
    ``(d_model, heads, d_k)``)."""
    what = f"gpt {label}"
    for name, v in (("vocab", vocab), ("context", context), ("d_model", d_model),
                    ("heads", heads), ("layers", layers)):
        if not is_int(v) or v < 1:
            raise ValueError(f"{what}: {name} must be an integer >= 1, got {v!r}")
    if d_ff is not None and (not is_int(d_ff) or d_ff < 1):
        raise ValueError(f"{what}: d_ff must be an integer >= 1, got {d_ff!r}")
    if d_model % heads:
        raise ValueError(f"{what}: d_model {d_model} is not a multiple of heads {heads}")
    if not isinstance(ids, T.ClassIds):
        raise TypeError(f"{what}: ids must come from ocannl.tensor.class_ids, got {ids!r}")
    if not ids.shape.batch or ids.shape.batch[-1] > context:
        raise ValueError(f"{what}: the ids' last batch axis is the sequence, at most context="
                         f"{context} long; got ids of dims {ids.dims}")
    seq = ids.shape.batch[-1]
    params: dict[str, Tensor] = {}
    tok, params["tok_emb"] = embedding(ids, vocab=vocab, dim=d_model, label=f"{label}_tok")
    positions = T.class_ids(np.arange(seq), num_classes=context, label=f"{label}_positions")
    pos, params["pos_emb"] = embedding(positions, vocab=context, dim=d_model,
                                       label=f"{label}_pos")
    h = dropout(tok + pos, rate=dropout_rate, train=train, rng=rng)
    for k in range(layers):
        h, block = decoder_block(h, num_heads=heads, d_k=d_model // heads, d_ff=d_ff,
                                 causal=True, eps=eps, gelu_approximate=gelu_approximate,
                                 dropout_rate=dropout_rate, train=train, rng=rng,
                                 label=f"{label}_block{k}")
        params.update((f"block{k}.{name}", p) for name, p in block.items())
    z, params["ln_f_gamma"], params["ln_f_beta"] = layer_norm(h, eps=eps, label=f"{label}_ln_f")
    logits, ((params["head_w"], params["head_b"]),) = mlp(z, [], vocab, label=f"{label}_head",
                                                         prec=_param_prec(z.prec))
    return logits, params
