"""The blocks beyond the MLP (``ocannl.nn_blocks``): layer and batch norm (with running
statistics), dropout, embeddings, multi-head attention (with and without the causal mask), the
pre-norm decoder block and integer-target cross-entropy. Values and gradients against PyTorch
on hypothesis-drawn shapes at f32 (relative 1e-5) and f64 (1e-10), weights copied with a
reshape at most; a training run with dropout and batch norm resumed from a checkpoint continues
bit for bit."""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "tensor"))
from torch_oracle import assert_close, check_parity  # noqa: E402

import ocannl.tensor as T  # noqa: E402
from ocannl import Context, Precision, checkpoint, nn_blocks, optim, train  # noqa: E402

F32, F64 = Precision.f32, Precision.f64
TOL = {F32: 1e-5, F64: 1e-10}
DTYPE = {F32: torch.float32, F64: torch.float64}


def few(f32: int, f64: int, **strategies):
    """Run the test on ``f32`` hypothesis examples at f32, ``f64`` at f64 (its ``prec``
    argument), drawing the named ``strategies``. Each example compiles a routine: the f64 runs
    check the formulas at 1e-10, the f32 runs the precision."""
    def deco(test):
        def run(prec, **kwargs):
            @settings(max_examples={F32: f32, F64: f64}[prec], deadline=None)
            @given(**strategies)
            def inner(**drawn):
                test(prec=prec, **kwargs, **drawn)

            inner()

        sig = inspect.signature(test)
        run.__signature__ = sig.replace(parameters=[
            p for name, p in sig.parameters.items() if name not in strategies])
        run.__name__, run.__doc__ = test.__name__, test.__doc__
        return run
    return deco


def _x(label: str, dims: tuple[int, ...], nb: int, prec: Precision) -> T.Tensor:
    """A differentiable input: the first ``nb`` axes batch, the rest output."""
    return T.param(label, batch_dims=dims[:nb], output_dims=dims[nb:], input_dims=(), prec=prec)


def run_grad_update(out: T.Tensor, params: list[tuple[T.Tensor, np.ndarray]],
                    seed: int = 0) -> tuple[Context, np.ndarray]:
    """``loss = sum(out * r)`` (``r`` uniform in [-1, 1]), forward and backprop on the CPU;
    the context and ``r`` as stored."""
    r = np.random.default_rng(seed).uniform(-1.0, 1.0, out.dims)
    r_t = T.term(r, batch_dims=out.shape.batch, output_dims=out.shape.output,
                 input_dims=out.shape.input, label="r", prec=out.prec)
    ctx = Context.cpu()
    for p, v in params:
        ctx.set_values(p, v)
    ctx, routine = ctx.compile(train.grad_update(T.sum(out * r_t)))
    ctx.run(routine)
    return ctx, ctx.get_values(r_t).astype(np.float64)


def _torch_run(fn, leaves: list[np.ndarray], r: np.ndarray, dtype: torch.dtype):
    ts = [torch.tensor(v, dtype=dtype, requires_grad=True) for v in leaves]
    out = fn(*ts)
    (out * torch.tensor(r, dtype=dtype)).sum().backward()
    return out.detach().double().numpy(), [t.grad.double().numpy() for t in ts]


# --- layer norm and batch norm ----------------------------------------------------------------


def _norm_magnitudes(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, g: np.ndarray,
                     axes: tuple[int, ...], eps: float) -> list[np.ndarray]:
    """The magnitudes of what a normalization sums, for y, dx, dgamma, dbeta (gamma, beta over
    the last axis). ``x - mean`` cancels, so ``|x_hat|`` is bounded by ``A = (|x| + |mean|) /
    sigma``; ``dx = (g_hat - mean(g_hat) - x_hat mean(g_hat x_hat)) / sigma`` cancels too."""
    mu = x.mean(axis=axes, keepdims=True)
    sig = np.sqrt(x.var(axis=axes, keepdims=True) + eps)
    a = (np.abs(x) + np.abs(mu)) / sig
    gh = np.abs(g * gamma)
    dx = (gh + gh.mean(axis=axes, keepdims=True) + a * (gh * a).mean(axis=axes, keepdims=True)) \
        / sig
    rest = tuple(range(x.ndim - 1))
    return [np.abs(gamma) * a + np.abs(beta), dx, (np.abs(g) * a).sum(axis=rest),
            np.abs(g).sum(axis=rest)]


def _norm_parity(y: T.Tensor, leaves: list[tuple[T.Tensor, np.ndarray]], torch_fn,
                 axes: tuple[int, ...], eps: float, prec: Precision) -> Context:
    """ocannl and torch (at ``prec``) both within ``TOL`` of torch at f64, against the
    magnitudes of :func:`_norm_magnitudes`."""
    ctx, r = run_grad_update(y, leaves)
    vals = [v for _, v in leaves]
    want, want_grads = _torch_run(torch_fn, vals, r, torch.float64)
    mags = _norm_magnitudes(vals[0], vals[1], vals[2], r, axes, eps)
    ours = (ctx.get_values(y), [ctx.get_values(p.grad) for p, _ in leaves], "ocannl")
    theirs = (*_torch_run(torch_fn, vals, r, DTYPE[prec]), f"torch {prec.value}")
    for got, grads, who in (ours, theirs):
        assert_close(got, want, TOL[prec], f"{who}: y", mags[0])
        for (p, _), gg, wg, m in zip(leaves, grads, want_grads, mags[1:], strict=True):
            assert_close(gg, wg, TOL[prec], f"{who}: grad of {p.label}", m)
    return ctx


@st.composite
def norm_case(draw, min_rows: int = 1):
    nb = draw(st.integers(1, 2))
    dims = tuple(draw(st.lists(st.integers(1, 4), min_size=nb, max_size=nb)))
    if min_rows > 1 and math.prod(dims) < min_rows:
        dims = (min_rows,) + dims[1:]
    dims = dims + (draw(st.integers(1, 5)),)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = np.float32(rng.normal(size=dims) * draw(st.sampled_from([0.5, 3.0])) +
                   draw(st.sampled_from([0.0, 2.0]))).astype(np.float64)
    gamma = np.float32(rng.uniform(0.5, 2.0, dims[-1:])).astype(np.float64)
    beta = np.float32(rng.uniform(-1.0, 1.0, dims[-1:])).astype(np.float64)
    return nb, x, gamma, beta


@pytest.mark.parametrize("prec", [F32, F64], ids=lambda p: p.value)
@few(4, 2, case=norm_case())
def test_layer_norm(prec, case):
    nb, xv, gv, bv = case
    x = _x("x", xv.shape, nb, prec)
    y, gamma, beta = nn_blocks.layer_norm(x, eps=1e-5)
    assert gamma.dims == beta.dims == xv.shape[-1:] and y.dims == xv.shape

    def torch_fn(tx, tg, tb):
        return F.layer_norm(tx, tx.shape[-1:], tg, tb, eps=1e-5)

    _norm_parity(y, [(x, xv), (gamma, gv), (beta, bv)], torch_fn, (xv.ndim - 1,), 1e-5, prec)


def test_layer_norm_starts_at_ones_and_zeros_and_needs_an_output_axis():
    x = T.term(np.arange(6.0).reshape(2, 3), label="x")
    y, gamma, beta = nn_blocks.layer_norm(x)
    ctx = train.init_params(Context.cpu(), y)
    np.testing.assert_array_equal(ctx.get_values(gamma), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(ctx.get_values(beta), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="no output axis to normalize over"):
        nn_blocks.layer_norm(T.term(np.ones(3), label="v", batch_dims=(3,), output_dims=()))


@pytest.mark.parametrize("sync", [False, True], ids=["per-batch", "sync"])
@pytest.mark.parametrize("prec", [F32, F64], ids=lambda p: p.value)
@few(4, 2, case=norm_case(min_rows=2))
def test_batch_norm_training_values_gradients_and_running_statistics(prec, sync, case):
    """Training mode against ``F.batch_norm(training=True)`` over every axis but the channel
    (the last); then two more forward runs update the running statistics as torch's do
    (momentum 0.1, unbiased variance), and the evaluation graph built on the same params
    normalizes with them, as torch's eval mode. ``sync=True`` outside a data-parallel run
    is the same batch norm (its global sums over the one batch)."""
    nb, xv, gv, bv = case
    c = xv.shape[-1]
    x = _x("x", xv.shape, nb, prec)
    y, bn = nn_blocks.batch_norm(x, train=True, eps=1e-5, momentum=0.1, sync=sync)
    assert len(T.global_sums(y)) == sync
    assert bn.running_mean.dims == (c,) and set(T.buffers(y)) == {bn.running_mean.value,
                                                                   bn.running_var.value}

    def torch_fn(tx, tg, tb):
        flat = tx.reshape(-1, c)
        return F.batch_norm(flat, None, None, tg, tb, training=True, eps=1e-5).reshape(tx.shape)

    axes = tuple(range(xv.ndim - 1))
    ctx = _norm_parity(y, [(x, xv), (bn.gamma, gv), (bn.beta, bv)], torch_fn, axes, 1e-5, prec)
    # the grad_update ran the forward once; run it twice more
    ctx, fwd = ctx.compile(train.forward(y))
    ctx.run(fwd).run(fwd)
    rm, rv = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
    for _ in range(3):
        F.batch_norm(torch.tensor(xv).reshape(-1, c), rm, rv, training=True, momentum=0.1)
    tol = TOL[prec]
    assert_close(ctx.get_values(bn.running_mean), rm.numpy(), tol, "running mean",
                 np.abs(xv).reshape(-1, c).mean(0))
    assert_close(ctx.get_values(bn.running_var), rv.numpy(), tol, "running var",
                 1.0 + ((np.abs(xv) + np.abs(xv.mean(axis=axes))) ** 2).reshape(-1, c).mean(0)
                 * 2)
    # evaluation mode on the same params and statistics
    x_eval = _x("x_eval", xv.shape, nb, prec)
    y_eval, same = nn_blocks.batch_norm(x_eval, train=False, params=bn)
    assert same is bn
    ctx.set_values(x_eval, xv)
    ctx, ev = ctx.compile(train.forward(y_eval))
    ctx.run(ev)
    want = F.batch_norm(torch.tensor(xv).reshape(-1, c), rm, rv, torch.tensor(gv),
                        torch.tensor(bv), training=False, eps=1e-5).reshape(xv.shape).numpy()
    assert_close(ctx.get_values(y_eval), want, tol, "eval y",
                 np.abs(gv) * (np.abs(xv) + np.abs(rm.numpy())) / np.sqrt(rv.numpy() + 1e-5)
                 + np.abs(bv))


def test_batch_norm_refuses_a_single_value_per_channel_in_training():
    x = T.param("x", batch_dims=(1,), output_dims=(3,), input_dims=())
    with pytest.raises(ValueError, match="more than one value per channel"):
        nn_blocks.batch_norm(x, train=True)
    y, _ = nn_blocks.batch_norm(x, train=False)  # evaluation needs no batch statistics
    assert y.dims == (1, 3)


# --- dropout and embedding blocks -------------------------------------------------------------


def test_dropout_block_is_the_identity_outside_training_and_needs_an_rng_in_it():
    x = T.param("x", output_dims=(4,), input_dims=())
    assert nn_blocks.dropout(x, rate=0.5, train=False) is x
    assert nn_blocks.dropout(x, rate=0.0, train=True) is x
    with pytest.raises(ValueError, match="needs an rng"):
        nn_blocks.dropout(x, rate=0.5, train=True)
    with pytest.raises(ValueError, match="rate must be a number in"):
        nn_blocks.dropout(x, rate=1.5, train=False)
    rng = T.Rng(3)
    y = nn_blocks.dropout(x, rate=0.5, train=True, rng=rng)
    assert set(T.buffers(y)) == {rng.seed, rng.counter}


def test_embedding_block_table_is_torch_layout():
    ids = T.class_ids([[1, 2], [0, 1]], num_classes=3)
    y, table = nn_blocks.embedding(ids, vocab=3, dim=5)
    assert table.dims == (3, 5) and y.shape == T.Shape((2, 2), (5,), ())
    tv = np.random.default_rng(0).normal(size=(3, 5))
    check_parity(y, lambda tt: F.embedding(torch.tensor([[1, 2], [0, 1]]), tt), [(table, tv)])
    with pytest.raises(ValueError, match="the ids have 3 classes, the table 4 rows"):
        nn_blocks.embedding(ids, vocab=4, dim=5)


# --- attention and the decoder block ----------------------------------------------------------


def _torch_mha(x, wq, bq, wk, bk, wv, bv, wo, bo, *, causal: bool, capture=None):
    """torch's scaled dot-product attention with (out, in) projection weights: ours, reshaped
    ``(heads, d, d_model) -> (heads * d, d_model)``."""
    h, dk, d_model = wq.shape
    dv = wv.shape[1]
    lead = x.shape[:-2]
    s = x.shape[-2]
    xb = x.reshape(-1, s, d_model)

    def heads(w, b, d):
        return F.linear(xb, w.reshape(h * d, d_model), b.reshape(h * d)).reshape(
            -1, s, h, d).transpose(1, 2)

    keys = heads(wk, bk, dk)
    if capture is not None:  # the keys' gradient: the magnitude of the key bias's
        keys.retain_grad()
        capture.setdefault("keys", []).append(keys)
    o = F.scaled_dot_product_attention(heads(wq, bq, dk), keys, heads(wv, bv, dv),
                                       is_causal=causal)
    o = o.transpose(1, 2).reshape(-1, s, h * dv)
    return F.linear(o, wo.reshape(d_model, h * dv), bo).reshape(*lead, s, d_model)


def _attention_parity(y: T.Tensor, leaves: list[tuple[T.Tensor, np.ndarray]], torch_fn,
                      prec: Precision, key_bias: T.Tensor) -> None:
    """ocannl against torch in f64 at ``TOL[prec]`` with ``check_parity``'s magnitudes (the
    function of the absolute values), and two more, for sums that cancel in ways those miss:

    - the key bias's gradient is 0 in exact arithmetic (shifting every key adds the same score
      to all of them), so it is rounding residue, judged against ``sum |dL/dkeys|``;
    - at f32, each gradient may also be off by 8 times the largest error torch's own f32
      computation makes on it (a softmax over nearly equal scores, a layer norm over two
      values, make some gradients a small difference of large terms: f32 cannot do better
      than torch's own rounding there, and an error in an op is far beyond it).
    """
    ctx, r = run_grad_update(y, leaves)
    vals = [v for _, v in leaves]
    cap: dict = {}
    want, want_grads = _torch_run(lambda *ts: torch_fn(*ts, capture=cap), vals, r,
                                  torch.float64)
    mag, mag_grads = _torch_run(torch_fn, [np.abs(v) for v in vals], np.abs(r), torch.float64)
    t32 = _torch_run(torch_fn, vals, r, torch.float32) if prec is F32 else None
    tol = TOL[prec]
    assert_close(ctx.get_values(y), want, tol, "value", np.maximum(np.abs(mag), np.abs(want)))
    for k, ((p, _), wg, mg) in enumerate(zip(leaves, want_grads, mag_grads, strict=True)):
        m = np.abs(mg)
        if p is key_bias:
            keys = sum(np.abs(kg.grad.double().numpy()).sum(axis=(0, 2)) for kg in cap["keys"])
            m = np.maximum(m, keys)
        if t32 is not None:
            m = np.maximum(m, 8 * np.abs(t32[1][k] - wg).max() / tol)
        assert_close(ctx.get_values(p.grad), wg, tol, f"grad of {p.label}", m)


@st.composite
def attention_case(draw, min_d_model: int = 1):
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    # one position would make the query and key gradients exactly 0 (torch leaves rounding
    # noise there): at least two
    seq, d_model = draw(st.integers(2, 4)), draw(st.integers(min_d_model, 4))
    heads, dk, dv = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return lead, seq, d_model, heads, dk, dv, draw(st.integers(0, 2**16))


def _weights(params: dict[str, T.Tensor], seed: int) -> list[tuple[T.Tensor, np.ndarray]]:
    """Values for every parameter: matrices uniform in +-1/sqrt(fan_in), vectors in +-0.5
    (gammas around 1), all exact at f32."""
    rng = np.random.default_rng(seed)
    out = []
    for name, p in params.items():
        fan_in = math.prod(p.shape.input) or 1
        if p.shape.input:
            v = rng.uniform(-1, 1, p.dims) / math.sqrt(fan_in)
        elif "gamma" in name:
            v = rng.uniform(0.5, 1.5, p.dims)
        else:
            v = rng.uniform(-0.5, 0.5, p.dims)
        out.append((p, np.float32(v).astype(np.float64)))
    return out


@pytest.mark.parametrize("prec", [F32, F64], ids=lambda p: p.value)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@few(3, 1, case=attention_case())
def test_multi_head_attention(causal, prec, case):
    lead, seq, d_model, heads, dk, dv, seed = case
    x = T.param("x", batch_dims=lead + (seq,), output_dims=(d_model,), input_dims=(), prec=prec)
    y, params = nn_blocks.multi_head_attention(x, num_heads=heads, d_k=dk, d_v=dv,
                                               causal=causal)
    assert list(params) == ["wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo"]
    assert params["wq"].dims == (heads, dk, d_model) and params["wo"].dims == (d_model, heads, dv)
    assert y.dims == lead + (seq, d_model)
    xv = np.float32(np.random.default_rng(seed).uniform(-1, 1, x.dims)).astype(np.float64)
    _attention_parity(y, [(x, xv)] + _weights(params, seed + 1),
                      lambda tx, *ws, capture=None: _torch_mha(tx, *ws, causal=causal,
                                                               capture=capture),
                      prec, params["bk"])


def test_causal_attention_ignores_later_positions():
    """Changing the last position's input changes no earlier output under the causal mask
    (and does without it)."""
    rng = np.random.default_rng(1)
    xv = rng.normal(size=(2, 5, 4))
    outs = {}
    for causal in (False, True):
        x = T.term(xv, label="x", batch_dims=(2, 5), output_dims=(4,))
        y, params = nn_blocks.multi_head_attention(x, num_heads=2, d_k=3, causal=causal)
        ctx = Context.cpu()
        for p, v in _weights(params, 7):
            ctx.set_values(p, v)
        ctx, r = ctx.compile(train.forward(y))
        ctx.run(r)
        before = ctx.get_values(y).copy()
        changed = xv.copy()
        changed[:, -1] += 1.0
        ctx.set_values(x, changed)
        ctx.run(r)
        outs[causal] = np.abs(ctx.get_values(y) - before)[:, :-1].max()
    assert outs[True] == 0.0 and outs[False] > 1e-3


def _torch_decoder(x, *ws, names, causal, approximate, eps=1e-5, capture=None):
    p = dict(zip(names, ws, strict=True))
    d_model = x.shape[-1]
    z = F.layer_norm(x, (d_model,), p["ln1_gamma"], p["ln1_beta"], eps=eps)
    h = x + _torch_mha(z, *(p[k] for k in ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo")),
                       causal=causal, capture=capture)
    z2 = F.layer_norm(h, (d_model,), p["ln2_gamma"], p["ln2_beta"], eps=eps)
    m = F.linear(F.gelu(F.linear(z2, p["w1"], p["b1"]), approximate=approximate), p["w2"],
                 p["b2"])
    return h + m


@pytest.mark.parametrize("prec", [F32, F64], ids=lambda p: p.value)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@few(1, 1, case=attention_case(min_d_model=2))  # a layer norm over one value is constant
def test_decoder_block(approximate, prec, case):
    lead, seq, d_model, heads, dk, dv, seed = case
    x = T.param("x", batch_dims=lead + (seq,), output_dims=(d_model,), input_dims=(), prec=prec)
    y, params = nn_blocks.decoder_block(x, num_heads=heads, d_k=dk, d_v=dv, d_ff=3 * d_model,
                                        gelu_approximate=approximate)
    assert params["w1"].dims == (3 * d_model, d_model)
    assert params["w2"].dims == (d_model, 3 * d_model)
    xv = np.float32(np.random.default_rng(seed).uniform(-1, 1, x.dims)).astype(np.float64)
    _attention_parity(y, [(x, xv)] + _weights(params, seed + 1),
                      lambda tx, *ws, capture=None: _torch_decoder(
                          tx, *ws, names=list(params), causal=True, approximate=approximate,
                          capture=capture),
                      prec, params["bk"])


# --- cross-entropy ----------------------------------------------------------------------------


@pytest.mark.parametrize("prec", [F32, F64], ids=lambda p: p.value)
@few(5, 2, batch=st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple),
     classes=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_cross_entropy_with_integer_targets(prec, batch, classes, seed):
    rng = np.random.default_rng(seed)
    ids_v = rng.integers(0, classes, size=batch)
    lv = np.float32(rng.uniform(-4, 4, batch + (classes,))).astype(np.float64)
    logits = T.param("logits", batch_dims=batch, output_dims=(classes,), input_dims=(),
                     prec=prec)
    loss = nn_blocks.cross_entropy(logits, T.class_ids(ids_v, num_classes=classes))
    assert loss.dims == ()
    check_parity(loss, lambda tl: F.cross_entropy(tl.reshape(-1, classes),
                                                  torch.tensor(ids_v.reshape(-1))),
                 [(logits, lv)])


def test_cross_entropy_checks_shapes_and_shows_invalid_ids():
    logits = T.param("logits", batch_dims=(3,), output_dims=(4,), input_dims=())
    ids = T.class_ids([0, 3, 1], num_classes=4)
    with pytest.raises(ValueError, match="do not match the targets"):
        nn_blocks.cross_entropy(logits, T.class_ids([0, 1], num_classes=4))
    with pytest.raises(TypeError, match="must come from ocannl.tensor.class_ids"):
        nn_blocks.cross_entropy(logits, T.term([0.0, 1.0, 2.0]))
    loss = nn_blocks.cross_entropy(logits, ids)
    ctx = Context.cpu().set_values(logits, np.zeros((3, 4)))
    ctx, r = ctx.compile(train.forward(loss))
    ctx.run(r)
    assert abs(ctx.get_values(loss) - math.log(4)) < 1e-6
    with pytest.raises(ValueError, match="value 4.0 at position"):  # set_values validates ids
        ctx.set_values(ids, [0.0, 4.0, 1.0])
    ctx.run(r)
    assert abs(ctx.get_values(loss) - math.log(4)) < 1e-6  # the ids were left as they were


# --- a training run with dropout and batch norm, resumed from a checkpoint --------------------


def _model(xv: np.ndarray, yv: np.ndarray):
    x = T.term(xv, label="x")
    ids = T.class_ids(yv, num_classes=3, label="y")
    rng = T.Rng(99, label="rng")
    w1 = T.param("w1", output_dims=(16,))
    b1 = T.param("b1", output_dims=(16,), input_dims=(), init="zeros")
    h, _ = nn_blocks.batch_norm(w1 @ x + b1, train=True, label="bn")
    h = nn_blocks.dropout(T.relu(h), rate=0.3, train=True, rng=rng)
    logits, _ = nn_blocks.mlp(h, [], 3, label="head")
    loss = nn_blocks.cross_entropy(logits, ids)
    opt = optim.SGD(0.1, momentum=0.9)
    return loss, opt, train.grad_update(loss) + opt.update(loss)


def test_training_with_dropout_and_batch_norm_resumes_bit_exactly(tmp_path):
    rng = np.random.default_rng(0)
    xv, yv = rng.normal(size=(32, 5)), rng.integers(0, 3, size=32)

    def state(loss, opt):
        return checkpoint.training_state(loss, opt) + T.buffers(loss)

    T.set_seed(5)
    loss, opt, step = _model(xv, yv)
    names = [n.label for n in T.buffers(loss)]
    assert names == ["bn_running_mean", "bn_running_var", "rng_seed", "rng_counter"]
    ctx = train.init_params(Context.cpu(), loss)
    ctx, routine = ctx.compile(step)
    losses = []
    for k in range(6):
        ctx.run(routine)
        losses.append(float(ctx.get_values(loss)))
        if k == 2:
            checkpoint.save(tmp_path / "ckpt", ctx, state(loss, opt), checkpoint.Progress(3))
    full = [ctx.get_values(n) for n in state(loss, opt)]
    assert len(set(losses)) == len(losses)

    T.set_seed(123)  # other initial values: the checkpoint must replace them
    loss2, opt2, step2 = _model(xv, yv)
    ctx2 = train.init_params(Context.cpu(), loss2)
    ctx2, routine2 = ctx2.compile(step2)
    ctx2, progress = checkpoint.load(tmp_path / "ckpt", ctx2, state(loss2, opt2))
    assert progress.step == 3 and ctx2.get_value(T.buffers(loss2)[-1]) == 3.0
    resumed = []
    for _ in range(3):
        ctx2.run(routine2)
        resumed.append(float(ctx2.get_values(loss2)))
    assert resumed == losses[3:]
    for a, b, n in zip(full, [ctx2.get_values(n) for n in state(loss2, opt2)],
                       state(loss2, opt2), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=n.label)
