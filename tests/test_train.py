"""Training: an MLP with softmax cross-entropy against PyTorch (gradients, and 20 SGD steps with
the optimizer variants), host-settable learning rates and loss scales, the gradient checksum,
and 16-bit parameters training end to end on the CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ocannl.tensor as T
from ocannl import Context, Precision, datasets, nn_blocks, train
from ocannl.ir.lowering import Gemm, lower_items
from ocannl.ir.target import PRODUCTS

TOL = {Precision.f32: 1e-5, Precision.f64: 1e-10}
TORCH_DTYPE = {Precision.f32: torch.float32, Precision.f64: torch.float64}


def _assert_close(got, want, rel: float, what: str) -> None:
    """Elementwise relative, with an absolute floor of ``rel * max|want|``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    floor = rel * float(np.max(np.abs(want), initial=0.0))
    err = np.abs(got - want)
    assert np.all(err <= rel * np.abs(want) + floor), (
        f"{what}: max error {err.max():.3g} at rel {rel:g} (scale {np.abs(want).max():.3g})")


class Problem:
    """The same MLP and data in ocannl and torch, from the same weights."""

    def __init__(self, *, hidden=(16, 16), n=64, classes=2, prec=Precision.f32, seed=0,
                 dataset="moons"):
        if dataset == "moons":
            xs, labels = datasets.half_moons(n, seed=seed)
        else:
            xs, labels = datasets.gaussian_classes(n, 8, classes, seed=seed)
        self.labels = labels
        self.prec = prec
        self.x = T.term(xs, label="x", prec=prec)
        self.y = T.term(datasets.one_hot(labels, classes), label="y", prec=prec)
        self.logits, self.layers = nn_blocks.mlp(self.x, list(hidden), classes, prec=prec)
        self.loss = nn_blocks.softmax_cross_entropy(self.logits, self.y)
        dtype = TORCH_DTYPE[prec]
        torch.manual_seed(seed)
        dims = [xs.shape[1], *hidden, classes]
        self.torch_layers = [torch.nn.Linear(i, o, dtype=dtype)
                             for i, o in zip(dims[:-1], dims[1:], strict=True)]
        for lin in self.torch_layers:  # non-zero biases, so their gradients are exercised too
            with torch.no_grad():
                lin.bias.uniform_(-0.3, 0.3)
        self.tx = torch.tensor(xs.astype(np.float64), dtype=dtype)
        self.tlabels = torch.tensor(labels)

    def load_weights(self, ctx: Context) -> Context:
        for (w, b), lin in zip(self.layers, self.torch_layers, strict=True):
            assert w.dims == tuple(lin.weight.shape)  # (out, in), as torch.nn.Linear
            ctx.set_values(w, lin.weight.detach().double().numpy())
            ctx.set_values(b, lin.bias.detach().double().numpy())
        return ctx

    def torch_loss(self) -> torch.Tensor:
        h = self.tx
        for k, lin in enumerate(self.torch_layers):
            h = lin(h)
            if k < len(self.torch_layers) - 1:
                h = torch.relu(h)
        return torch.nn.functional.cross_entropy(h, self.tlabels)

    def torch_params(self) -> list[torch.Tensor]:
        return [p for lin in self.torch_layers for p in (lin.weight, lin.bias)]

    def params(self):
        return [p for wb in self.layers for p in wb]


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
@pytest.mark.parametrize("hidden", [(16, 16), (48, 64)], ids=["small", "gemm"])
def test_mlp_softmax_cross_entropy_gradients(prec, hidden):
    """The "gemm" sizes send the wider products (forward and backward) to BLAS."""
    pb = Problem(hidden=hidden, prec=prec, dataset="blobs" if hidden[0] > 16 else "moons",
                 classes=3 if hidden[0] > 16 else 2)
    assert set(pb.loss.params) == set(pb.params())
    ctx = pb.load_weights(Context.cpu())
    ctx, r = ctx.compile(train.grad_update(pb.loss))
    ctx.run(r)
    t_loss = pb.torch_loss()
    t_loss.backward()
    rel = TOL[prec]
    _assert_close(ctx.get_values(pb.loss), t_loss.item(), rel, "loss")
    for p, tp in zip(pb.params(), pb.torch_params(), strict=True):
        _assert_close(ctx.get_values(p.grad), tp.grad.double().numpy(), rel, f"grad {p.label}")
    # the logits too
    h = pb.tx
    for k, lin in enumerate(pb.torch_layers):
        h = lin(h) if k == len(pb.torch_layers) - 1 else torch.relu(lin(h))
    _assert_close(ctx.get_values(pb.logits), h.detach().double().numpy(), rel, "logits")


SGD_VARIANTS = {
    "plain": {"momentum": 0.0},
    "momentum": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "weight_decay": {"momentum": 0.5, "weight_decay": 0.01},
}


@pytest.mark.parametrize("variant", list(SGD_VARIANTS))
def test_twenty_sgd_steps_match_torch(variant):
    """Every loss of 20 steps within 1e-5 relative of torch.optim.SGD from the same weights; the
    whole step (forward, backprop, update) is one routine."""
    opts = SGD_VARIANTS[variant]
    lr = 0.2
    pb = Problem(hidden=(16, 32), n=64, seed=3)
    ctx = pb.load_weights(Context.cpu())
    step = train.grad_update(pb.loss) + train.sgd_update(pb.loss, learning_rate=lr, **opts)
    ctx, r = ctx.compile(step)
    opt = torch.optim.SGD(pb.torch_params(), lr=lr, **opts)
    ours, theirs = [], []
    for _ in range(20):
        ctx.run(r)
        ours.append(float(ctx.get_values(pb.loss)))
        opt.zero_grad()
        t_loss = pb.torch_loss()
        t_loss.backward()
        opt.step()
        theirs.append(t_loss.item())
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {k}: ocannl {a!r}, torch {b!r}\n{ours}\n{theirs}"
    assert theirs[-1] < theirs[0]  # the run trained (the comparison is not of a flat line)
    for p, tp in zip(pb.params(), pb.torch_params(), strict=True):
        _assert_close(ctx.get_values(p), tp.detach().double().numpy(), 1e-4, f"final {p.label}")
    if opts.get("momentum"):
        w0 = pb.layers[0][0]
        buf = opt.state[pb.torch_layers[0].weight]["momentum_buffer"]
        _assert_close(ctx.get_values(train.optimizer_state(w0, "momentum")),
                      buf.double().numpy(), 1e-4, "momentum buffer")


def test_learning_rate_term_changes_the_next_update_without_recompiling():
    pb = Problem(hidden=(8,), n=32, seed=5)
    lr = T.term([0.1], label="lr")
    ctx = pb.load_weights(Context.cpu())
    ctx, r = ctx.compile(train.grad_update(pb.loss) + train.sgd_update(pb.loss,
                                                                        learning_rate=lr))
    compiled = ctx.compile_count
    w = pb.layers[0][0]

    def step():
        before = ctx.get_values(w).astype(np.float64)
        ctx.run(r)
        return before, ctx.get_values(w.grad).astype(np.float64), ctx.get_values(w)

    for rate in (0.1, 0.0, 0.5, 0.1):
        ctx.set_values(lr, [rate])
        before, g, after = step()
        assert np.abs(g).max() > 1e-3  # there is a gradient to apply
        np.testing.assert_allclose(after, before - rate * g, rtol=1e-6, atol=1e-7)
        if rate == 0.0:
            np.testing.assert_array_equal(after, before)
    assert ctx.compile_count == compiled


def test_the_whole_step_is_one_routine_and_init_params_draws_once():
    T.set_seed(11)
    pb = Problem(hidden=(8,), n=16)
    ctx = train.init_params(Context.cpu(), pb.loss)
    w0, b0 = pb.layers[0]
    first = ctx.get_values(w0)
    bound = 1 / math.sqrt(2)  # kaiming uniform over fan-in 2, as torch.nn.Linear's weight
    assert np.all(np.abs(first) <= bound) and np.abs(first).max() > bound / 4
    np.testing.assert_array_equal(ctx.get_values(b0), 0)  # zeros init
    ctx.set_values(w0, np.zeros(w0.dims))
    ctx = train.init_params(ctx, pb.loss)  # already initialised: untouched
    np.testing.assert_array_equal(ctx.get_values(w0), 0)
    T.set_seed(11)
    pb2 = Problem(hidden=(8,), n=16)
    ctx2 = train.init_params(Context.cpu(), pb2.loss)
    np.testing.assert_array_equal(ctx2.get_values(pb2.layers[0][0]), first)  # reproducible


# --- loss scale, gradient unscaling, checksum -------------------------------------------------


def test_loss_scale_seeds_the_gradient_and_grad_unscale_undoes_it():
    pb = Problem(hidden=(8,), n=32, seed=2)
    scale = T.term([1024.0], label="scale")
    unscale = T.term([1 / 1024.0], label="unscale")
    ctx = pb.load_weights(Context.cpu())
    ctx, plain = ctx.compile(train.grad_update(pb.loss))
    ctx.run(plain)
    grads = [ctx.get_values(p.grad).astype(np.float64) for p in pb.params()]
    ctx, scaled = ctx.compile(train.grad_update(pb.loss, loss_scale=scale))
    ctx.run(scaled)
    for p, g in zip(pb.params(), grads, strict=True):
        # a power of two scales exactly
        np.testing.assert_array_equal(ctx.get_values(p.grad), (g * 1024).astype(np.float32))
    before = [ctx.get_values(p).astype(np.float64) for p in pb.params()]
    ctx, upd = ctx.compile(train.sgd_update(pb.loss, learning_rate=0.1, momentum=0.9,
                                            grad_unscale=unscale))
    ctx.run(upd)
    for p, g, b in zip(pb.params(), grads, before, strict=True):
        np.testing.assert_allclose(ctx.get_values(p), b - 0.1 * g, rtol=1e-6, atol=1e-7)
        mom = ctx.get_values(train.optimizer_state(p, "momentum"))
        np.testing.assert_allclose(mom, g, rtol=1e-6, atol=1e-9)  # true magnitudes


def test_grad_checksum_is_non_finite_exactly_when_a_gradient_is():
    pb = Problem(hidden=(8,), n=32, seed=4)
    scale = T.term([1.0], label="scale")
    flag, check = train.grad_checksum(pb.loss)
    assert flag.dims == () and flag.prec is Precision.f32
    ctx = pb.load_weights(Context.cpu())
    ctx, r = ctx.compile(train.grad_update(pb.loss, loss_scale=scale) + check)
    xs = ctx.get_values(pb.x)
    seen = set()
    # The last two make gradients overflow: a scale near the f32 limit, then inputs 1e4 larger.
    for s, x_gain in ((1.0, 1.0), (1e30, 1.0), (3e38, 1.0), (3e38, 1e4)):
        ctx.set_values(scale, [s])
        ctx.set_values(pb.x, xs * x_gain)
        ctx.run(r)
        grads = [ctx.get_values(p.grad) for p in pb.params()]
        all_finite = all(np.isfinite(g).all() for g in grads)
        value = ctx.get_value(flag)
        assert math.isfinite(value) == all_finite, (s, x_gain, value)
        if all_finite:
            assert value == 0.0  # never overflows on finite gradients, however large
        big = max(float(np.abs(g[np.isfinite(g)]).max(initial=0.0)) for g in grads)
        seen.add((all_finite, big > 1e30))
    assert (True, True) in seen  # finite gradients beyond 1e30 summed without overflow
    assert any(not finite for finite, _ in seen)  # and non-finite ones were flagged
    ctx.set_values(pb.x, xs)
    ctx.set_values(scale, [1.0])  # and the same routine recovers
    ctx.run(r)
    assert ctx.get_value(flag) == 0.0


def test_optimizer_argument_errors():
    pb = Problem(hidden=(4,), n=8)
    for kwargs in ({"momentum": 1.0}, {"momentum": -0.1}, {"weight_decay": -1.0},
                   {"weight_decay": math.inf}):
        with pytest.raises(ValueError, match="momentum must be in"):
            train.sgd_update(pb.loss, learning_rate=0.1, **kwargs)
    with pytest.raises(ValueError, match="nesterov momentum needs momentum > 0"):
        train.sgd_update(pb.loss, learning_rate=0.1, nesterov=True)
    with pytest.raises(ValueError, match="learning_rate must be finite"):
        train.sgd_update(pb.loss, learning_rate=math.nan)
    with pytest.raises(ValueError, match="learning_rate must be a one-element tensor"):
        train.sgd_update(pb.loss, learning_rate=T.term([0.1, 0.2]))
    with pytest.raises(TypeError, match="learning_rate must be a float or a one-element"):
        train.sgd_update(pb.loss, learning_rate="0.1")
    with pytest.raises(ValueError, match="loss_scale must be a one-element tensor"):
        train.grad_update(pb.loss, loss_scale=T.term([1.0, 2.0]))
    with pytest.raises(ValueError, match="depends on no parameter"):
        train.grad_update(T.sum(T.term(np.ones(3))))


# --- 16-bit parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("prec", ["f16", "bf16"])
def test_16_bit_param_gradients_are_the_rounded_f32_gradients(prec):
    """With 16-bit weights and f32 inputs the arithmetic runs in f32 and each gradient is
    rounded once when stored: torch's f32 gradients from the same (16-bit) weights, to within
    the 16-bit rounding. The sizes send the wide products, forward and backward, to BLAS
    through f32 scratch buffers."""
    eps = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8}[prec]
    xs, labels = datasets.gaussian_classes(64, 8, 3, seed=6)
    x = T.term(xs, label="x")
    y = T.term(datasets.one_hot(labels, 3), label="y")
    logits, layers = nn_blocks.mlp(x, [48, 64], 3, prec=prec)
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    ctx = Context.cpu()
    rng = np.random.default_rng(6)
    torch_params = []
    for w, b in layers:
        for p in (w, b):
            ctx.set_values(p, rng.uniform(-0.4, 0.4, p.dims))
            stored = ctx.get_values(p).astype(np.float32)  # the 16-bit values, widened
            torch_params.append(torch.tensor(stored, requires_grad=True))
    step = train.grad_update(loss)
    gemms = [g for g in lower_items(step, PRODUCTS) if isinstance(g, Gemm)]
    assert any(v.node.prec.is_narrow for g in gemms for v in (g.a, g.b))
    assert any(g.assign.lhs.prec.is_narrow for g in gemms)  # a weight gradient
    ctx, r = ctx.compile(step)
    ctx.run(r)
    h = torch.tensor(xs)
    for k in range(len(layers)):
        w, b = torch_params[2 * k], torch_params[2 * k + 1]
        h = h @ w.T + b
        if k < len(layers) - 1:
            h = torch.relu(h)
    t_loss = torch.nn.functional.cross_entropy(h, torch.tensor(labels))
    t_loss.backward()
    _assert_close(ctx.get_values(loss), t_loss.item(), 1e-5, "loss")
    params = [p for wb in layers for p in wb]
    for p, tp in zip(params, torch_params, strict=True):
        got = ctx.get_values(p.grad)
        assert got.dtype == Precision(prec).numpy_dtype
        _assert_close(got.astype(np.float32), tp.grad.numpy(), eps + 1e-5, f"grad {p.label}")


@pytest.mark.parametrize("prec", ["f16", "bf16"])
def test_mlp_with_16_bit_params_trains_on_cpu(prec):
    T.set_seed(0)
    xs, labels = datasets.half_moons(128, seed=1)
    x = T.term(xs, label="x")
    y = T.term(datasets.one_hot(labels, 2), label="y")
    logits, layers = nn_blocks.mlp(x, [16, 16], 2, prec=prec)
    for w, b in layers:
        assert w.prec is Precision(prec) and b.prec is Precision(prec)
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    ctx = train.init_params(Context.cpu(), loss)
    step = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.2, momentum=0.9)
    ctx, r = ctx.compile(step)
    losses = []
    for _ in range(150):
        ctx.run(r)
        losses.append(float(ctx.get_values(loss)))
    assert all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-10:]) < 0.25 * losses[0], losses[::10]
    w = ctx.get_values(layers[0][0])
    assert w.dtype == Precision(prec).numpy_dtype and np.isfinite(w.astype(np.float32)).all()
    mom = ctx.get_values(train.optimizer_state(layers[0][0], "momentum"))
    assert mom.dtype == Precision(prec).numpy_dtype
    pred = np.argmax(ctx.get_values(logits).astype(np.float32), axis=1)
    assert (pred == labels).mean() >= 0.95
