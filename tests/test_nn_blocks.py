"""Model building blocks: the MLP's layout and the softmax cross-entropy's value."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, Precision, nn_blocks, optim, train
from ocannl.tensor import Shape


def test_mlp_layers_are_laid_out_as_torch_linear():
    x = T.term(np.zeros((5, 3)), label="x")
    logits, layers = nn_blocks.mlp(x, [7, 4], 2, label="net")
    assert [(w.dims, b.dims) for w, b in layers] == [((7, 3), (7,)), ((4, 7), (4,)),
                                                      ((2, 4), (2,))]
    assert logits.shape == Shape((5,), (2,), ())
    assert [w.label for w, _ in layers] == ["net_w0", "net_w1", "net_w2"]
    assert all(p.kind == "param" for wb in layers for p in wb)
    assert logits.params == [p for wb in layers for p in wb]


def test_mlp_precision_and_forward_values():
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(6, 3))
    x = T.term(xs, label="x", prec="f64")
    logits, layers = nn_blocks.mlp(x, [4], 2, prec="f64")
    assert all(p.prec is Precision.f64 for wb in layers for p in wb)
    ctx = Context.cpu()
    weights = [(rng.normal(size=w.dims), rng.normal(size=b.dims)) for w, b in layers]
    for (w, b), (wv, bv) in zip(layers, weights, strict=True):
        ctx.set_values(w, wv)
        ctx.set_values(b, bv)
    ctx, r = ctx.compile(train.forward(logits))
    ctx.run(r)
    (w0, b0), (w1, b1) = weights
    want = np.maximum(xs @ w0.T + b0, 0) @ w1.T + b1
    np.testing.assert_allclose(ctx.get_values(logits), want, rtol=1e-12)


@pytest.mark.parametrize("prec", ["f32", "f64"])
def test_softmax_cross_entropy_value_is_stable(prec):
    """Large logits do not overflow (the max is subtracted first); soft targets work."""
    logits_v = np.array([[1000.0, 0.0, -1000.0], [2.0, 3.0, 1.0], [-50.0, -51.0, -49.0]])
    targets_v = np.array([[0.0, 1.0, 0.0], [0.2, 0.5, 0.3], [1.0, 0.0, 0.0]])
    logits = T.term(logits_v, label="logits", prec=prec)
    targets = T.term(targets_v, label="targets", prec=prec)
    loss = nn_blocks.softmax_cross_entropy(logits, targets)
    assert loss.dims == ()
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(loss))
    ctx.run(r)
    z = logits_v - logits_v.max(axis=1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    want = -(targets_v * log_softmax).sum(axis=1).mean()
    rtol = 1e-6 if prec == "f32" else 1e-13
    np.testing.assert_allclose(float(ctx.get_values(loss)), want, rtol=rtol)


# --- a block's internal tensors are local -------------------------------------------------------


def _tiny_gpt(materialize: bool):  # noqa: ANN202 - the loss, its logits and the context
    """A 2-layer GPT's loss after one Adam step, with the blocks' internal tensors local
    (their default) or, ``materialize``, each given a buffer of its own."""
    from ocannl.ir.tnode import MemoryMode

    seqs = np.random.default_rng(5).integers(0, 11, size=(3, 7))
    T.set_seed(4)
    ids = T.class_ids(seqs[:, :-1], num_classes=11, label="ids")
    targets = T.class_ids(seqs[:, 1:], num_classes=11, label="targets")
    logits, _ = nn_blocks.gpt(ids, vocab=11, context=6, d_model=8, heads=2, layers=2)
    loss = nn_blocks.cross_entropy(logits, targets)
    internal = [t for t in loss.topo() if t.value.memory_mode is MemoryMode.local]
    if materialize:
        for t in internal:
            t.value.memory_mode = MemoryMode.materialized
    ctx = train.init_params(Context.cpu(), loss)
    ctx, step = ctx.compile(train.grad_update(loss) + optim.Adam(1e-2).update(loss))
    ctx.run(step)
    return loss, logits, internal, ctx


def test_a_blocks_internal_tensors_are_local_and_compute_the_same_bits():
    """What a block returns (the logits, the loss, the parameters) stays materialized; the
    tensors it computes on the way (attention scores, activations, norms) are local: the host
    cannot read them, the step holds them in a shared arena, and its bits are those of one
    buffer per tensor."""
    from ocannl.ir.tnode import MemoryMode

    loss, logits, internal, ctx = _tiny_gpt(materialize=False)
    kinds = {t.label.split("_")[0] for t in internal}
    assert {"einsum", "softmax", "gelu", "matmul"} <= kinds, kinds
    for t in (loss, logits, *loss.params):
        assert t.value.memory_mode is MemoryMode.materialized, t.label
    with pytest.raises(ValueError, match=rf"{internal[0].value.name} is local"):
        ctx.get_values(internal[0])
    ref_loss, _, ref_internal, ref_ctx = _tiny_gpt(materialize=True)
    assert [t.label for t in ref_internal] == [t.label for t in internal]
    assert ctx.mem() < ref_ctx.mem()
    assert ctx.get_values(loss).tobytes() == ref_ctx.get_values(ref_loss).tobytes()
    for p, q in zip(loss.params, ref_loss.params, strict=True):
        assert ctx.get_values(p).tobytes() == ref_ctx.get_values(q).tobytes(), p.label


# --- refusals of what would otherwise be silently wrong (issue 28) ---------------------------


@pytest.mark.parametrize("targets_shape", [(64, 1), (1, 2), (2,)])
def test_softmax_cross_entropy_refuses_targets_that_would_broadcast(targets_shape):
    logits = T.term(np.zeros((64, 2)), label="logits")
    y = T.term(np.zeros(targets_shape), label="y")
    with pytest.raises(ValueError, match=r"targets y .* do not match logits logits") as err:
        nn_blocks.softmax_cross_entropy(logits, y)
    assert str(y.shape) in str(err.value) and str(logits.shape) in str(err.value)


@pytest.mark.parametrize("hidden,out_dim,bad", [([16.9], 2, "16.9"), ([16], 2.0, "2.0"),
                                                (16, 2, "16")])
def test_mlp_refuses_fractional_or_misplaced_widths(hidden, out_dim, bad):
    x = T.term(np.zeros((4, 3)), label="x")
    with pytest.raises(TypeError, match=r"mlp net: (hidden|out_dim)") as err:
        nn_blocks.mlp(x, hidden, out_dim, label="net")
    assert bad in str(err.value)


def test_conv2d_refuses_a_float_size_or_stride():
    x = T.term(np.zeros((2, 8, 8, 1)), label="x", batch_dims=(2,), output_dims=(8, 8, 1))
    for kw, name in ((dict(kernel_size=3.0), "kernel_size"), (dict(stride=1.5), "stride"),
                     (dict(out_channels=2.5), "out_channels")):
        args = dict(out_channels=2, **kw) if "out_channels" not in kw else kw
        with pytest.raises(TypeError, match=f"conv2d c: {name} must be an integer"):
            nn_blocks.conv2d(x, label="c", **args)
    for pool in (nn_blocks.max_pool2d, nn_blocks.avg_pool2d):
        for kw in (dict(window=2.0), dict(stride=1.5)):
            with pytest.raises(TypeError, match=f"{next(iter(kw))} must be an integer"):
                pool(x, **kw)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_conv2d_same_padding_keeps_the_size_as_torch_does(k):
    """Even kernels too: torch's padding="same" puts (k-1)//2 zeros before, the rest after."""
    import torch

    rng = np.random.default_rng(k)
    xv = rng.normal(size=(2, 8, 8, 3))
    x = T.term(xv, label="x", batch_dims=(2,), output_dims=(8, 8, 3), prec="f64")
    y, kernel, bias = nn_blocks.conv2d(x, out_channels=4, kernel_size=k, label="c", prec="f64")
    assert y.shape.output == (8, 8, 4)
    kv, bv = rng.normal(size=kernel.dims), rng.normal(size=bias.dims)
    ctx = Context.cpu().set_values(kernel, kv).set_values(bias, bv)
    ctx, r = ctx.compile(train.forward(y))
    got = ctx.run(r).get_values(y)
    want = torch.nn.functional.conv2d(
        torch.from_numpy(xv).permute(0, 3, 1, 2), torch.from_numpy(kv).permute(0, 3, 1, 2),
        torch.from_numpy(bv), padding="same").permute(0, 2, 3, 1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# --- issue 38: flags and numbers ----------------------------------------------------------------


def _bn_input() -> T.Tensor:
    return T.term(np.random.default_rng(2).normal(size=(6, 3)), label="bx")


@pytest.mark.parametrize(("block", "kw"), [
    (nn_blocks.batch_norm, {"train": "no"}),
    (nn_blocks.dropout, {"rate": 0.5, "train": "false"}),
    (nn_blocks.dropout, {"rate": 0.5, "train": 1}),
])
def test_train_must_be_a_bool_in_the_blocks(block, kw):
    """Issue 38, 3: any truthy ``train`` built a training graph (statistics updated, dropout
    active). Refused as ``Model.__call__`` refuses it; nothing is built (no node issued)."""
    from ocannl.ir.tnode import ids_issued

    x = _bn_input()
    rng = T.Rng(5)
    issued = ids_issued()
    with pytest.raises(TypeError, match=rf"train must be True or False, got {kw['train']!r} "
                                        rf"\({type(kw['train']).__name__}\)"):
        block(x, rng=rng, **kw) if block is nn_blocks.dropout else block(x, **kw)
    assert ids_issued() == issued


def test_batch_norm_sync_must_be_a_bool():
    """A truthy ``sync="no"`` would build the synced statistics; refused, nothing built."""
    from ocannl.ir.tnode import ids_issued

    x = _bn_input()
    issued = ids_issued()
    with pytest.raises(TypeError, match=r"batch_norm bn: sync must be True or False, got 'no' "
                                        r"\(str\)"):
        nn_blocks.batch_norm(x, train=True, sync="no")
    assert ids_issued() == issued


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), 0.0, 1e-50, "1e-5", True])
def test_batch_norm_eps_must_be_a_finite_number_above_zero_in_f32(eps):
    """Issue 38, 4: ``eps=-1.0`` or ``nan`` made every output NaN; ``1e-50`` rounds to 0 in
    f32. Refused naming the value; nothing is built."""
    from ocannl.ir.tnode import ids_issued

    x = _bn_input()
    issued = ids_issued()
    with pytest.raises(ValueError, match=r"batch_norm bn: eps( must be a finite number > 0 "
                                         r"\(in f32\), got |=1e-50 rounds to 0.0 in f32)") as err:
        nn_blocks.batch_norm(x, train=True, eps=eps)
    assert repr(eps) in str(err.value)
    assert ids_issued() == issued


def test_numpy_scalars_are_numbers_in_the_blocks():
    """Issue 38, friction: ``dropout(rate=np.float32(0.5))`` said "must be in [0, 1)". A NumPy
    real scalar is a number; a bool is not."""
    x = _bn_input()
    rng = T.Rng(5)
    y = nn_blocks.dropout(x, rate=np.float32(0.5), train=True, rng=rng)
    assert set(T.buffers(y)) == {rng.seed, rng.counter}
    assert nn_blocks.dropout(x, rate=np.float64(0.25), train=False) is x
    y, _ = nn_blocks.batch_norm(x, train=True, eps=np.float32(1e-5), momentum=np.float64(0.1),
                                label="bn_np")
    nn_blocks.layer_norm(x, eps=np.float32(1e-5), label="ln_np")
    seq = T.term(np.zeros((2, 3, 4)), batch_dims=(2, 3), output_dims=(4,), label="seq")
    a, _ = nn_blocks.multi_head_attention(seq, num_heads=np.int64(2), d_k=np.int32(2))
    assert a.dims == (2, 3, 4)
    with pytest.raises(ValueError, match=r"dropout: rate must be a number in \[0, 1\), got "
                                         r"bool: False"):
        nn_blocks.dropout(x, rate=False, train=False)
    with pytest.raises(ValueError, match=r"momentum must be a number in \[0, 1\], got bool"):
        nn_blocks.batch_norm(x, train=True, momentum=True, label="bn_bool")
