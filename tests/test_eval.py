"""ocannl.model: a model built twice shares its parameters and state buffers; its evaluation
routine (another batch size, batch norm on running statistics, dropout off) matches PyTorch's
``model.eval()``, allocates no gradient, changes no training state, and ambiguous or
state-writing graphs are refused naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ocannl.tensor as T
from ocannl import Context, mixed_prec, nn_blocks, optim, train
from ocannl.model import Model, compile_eval

RNG = np.random.default_rng(7)
XS = RNG.normal(size=(16, 4))
YS = np.eye(3)[RNG.integers(0, 3, 16)]
X_EVAL = RNG.normal(size=(5, 4))


def _net(rng: T.Rng):
    def build(x, *, train):
        h, _ = nn_blocks.batch_norm(x, train=train, label="bn")
        h = nn_blocks.dropout(h, rate=0.25, train=train, rng=rng)
        logits, _ = nn_blocks.mlp(h, [8], 3, label="mlp")
        return logits
    return Model(build)


def _trained(steps: int = 3):
    T.set_seed(0)
    rng = T.Rng(3)
    model = _net(rng)
    x = T.term(XS, label="x")
    y = T.term(YS, label="y")
    loss = nn_blocks.softmax_cross_entropy(model(x, train=True), y)
    ctx = train.init_params(Context.cpu(), loss)
    opt = optim.Adam(0.01)
    ctx, step = ctx.compile(train.grad_update(loss) + opt.update(loss))
    for _ in range(steps):
        ctx = ctx.run(step)
    return model, loss, opt, rng, ctx, step


def _state_bits(ctx, loss, opt, model, rng) -> dict[str, bytes]:
    nodes = ([p.value for p in loss.params] + opt.state_nodes() + T.buffers(loss)
             + rng.state_nodes())
    return {n.name: ctx.get_values(n).tobytes() for n in nodes}


def test_evaluation_graph_reuses_the_training_parameters_and_statistics():
    model, loss, *_ = _trained(0)
    e = model(T.term(X_EVAL, label="x_eval"), train=False)
    assert [p.value.id for p in e.params] == [p.value.id for p in loss.params]
    stats = {b.value.id for b in model.state_buffers}
    assert {b.id for b in T.buffers(e)} == stats < {b.id for b in T.buffers(loss)}
    assert [p.label for p in model.params] == ["bn_gamma", "bn_beta", "mlp_w0", "mlp_b0",
                                                "mlp_w1", "mlp_b1"]


def test_evaluation_matches_torch_eval_mode_at_another_batch_size():
    model, loss, _, _, ctx, _ = _trained()
    x_eval = T.term(np.zeros((5, 4)), label="x_eval")
    out = model(x_eval, train=False)
    ctx, ev = compile_eval(ctx, out)
    ctx, (got,) = ev.run(ctx, {x_eval: X_EVAL})
    v = {n.value.label: ctx.get_values(n) for n in model.params + model.state_buffers}
    bn = torch.nn.BatchNorm1d(4).double()
    lin0, lin1 = torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor(v["bn_gamma"]))
        bn.bias.copy_(torch.tensor(v["bn_beta"]))
        bn.running_mean.copy_(torch.tensor(v["bn_running_mean"]))
        bn.running_var.copy_(torch.tensor(v["bn_running_var"]))
        for lin, k in ((lin0, 0), (lin1, 1)):
            lin.weight.copy_(torch.tensor(v[f"mlp_w{k}"]))
            lin.bias.copy_(torch.tensor(v[f"mlp_b{k}"]))
    net = torch.nn.Sequential(bn, torch.nn.Dropout(0.25), lin0, torch.nn.ReLU(), lin1).eval()
    want = net(torch.tensor(X_EVAL)).detach().numpy()
    assert not np.allclose(v["bn_running_mean"], 0)  # the statistics moved: they are used
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_evaluation_allocates_no_gradient_and_changes_no_training_state():
    model, loss, opt, rng, ctx, step = _trained()
    before = _state_bits(ctx, loss, opt, model, rng)
    x_eval = T.term(X_EVAL, label="x_eval")
    out = model(x_eval, train=False)
    ctx, ev = compile_eval(ctx, out)
    for _ in range(3):
        ctx, _ = ev.run(ctx)
    grads = [t.grad for t in out.topo() if t.grad is not None]
    assert grads and not any(ctx.is_allocated(g) for g in grads if g.id not in
                             {p.grad.id for p in loss.params})
    assert not any(n.id in {g.id for g in grads} for n in ev.routine.nodes)
    assert _state_bits(ctx, loss, opt, model, rng) == before
    # and training goes on as if no evaluation had run: bit for bit
    ctx = ctx.run(step).run(step)
    _, loss2, opt2, rng2, ctx2, _ = _trained(5)
    a = _state_bits(ctx, loss, opt, model, rng)
    b = _state_bits(ctx2, loss2, opt2, None, rng2)
    assert list(a.values()) == list(b.values())


def test_mixed_precision_evaluation_reads_the_masters_through_twins_of_its_own():
    def build(x, *, train):
        def f():
            return nn_blocks.mlp(x, [8], 3, label="mp")[0]
        return T.cast(mixed_prec.with_master_weights(prec="f16", f=f), "f32")

    model = Model(build)
    x = T.term(XS, label="x", prec="f16")
    logits = model(x, train=True)
    x_eval = T.term(XS[:5], label="x_eval", prec="f16")
    ev_logits = model(x_eval, train=False)
    assert [p.value.id for p in ev_logits.params] == [p.value.id for p in logits.params]
    twins = {t.value.id for t in logits.topo() if t.master is not None}
    ev_twins = {t.value.id for t in ev_logits.topo() if t.master is not None}
    assert len(twins) == len(ev_twins) == 4 and not twins & ev_twins
    ctx = train.init_params(Context.cpu(), logits)
    ctx, fwd = ctx.compile(train.forward(logits))
    ctx = ctx.run(fwd)
    ctx, ev = compile_eval(ctx, ev_logits)
    ctx, (got,) = ev.run(ctx)
    np.testing.assert_array_equal(got, ctx.get_values(logits)[:5])


def test_a_train_mode_graph_is_refused_naming_the_state_it_would_write():
    model, loss, opt, rng, ctx, _ = _trained()
    held = len(ctx.nodes())
    with pytest.raises(ValueError, match=r"writes .*bn_running_mean.*evaluating would change"):
        compile_eval(ctx, model(T.term(X_EVAL, label="x_eval"), train=True))
    assert len(ctx.nodes()) == held  # nothing allocated


def test_dropout_in_training_mode_is_refused_for_its_counter():
    rng = T.Rng(1)
    x = T.term(XS, label="x")
    y = nn_blocks.dropout(x, rate=0.5, train=True, rng=rng)
    with pytest.raises(ValueError, match=r"rng_counter"):
        compile_eval(Context.cpu(), y)


def test_a_parameter_asked_for_with_another_shape_is_refused_naming_it():
    def build(x, *, train):
        width = 8 if train else 6  # depends on the mode: the shared weight would differ
        return nn_blocks.mlp(x, [width], 3, label="m")[0]

    model = Model(build)
    model(T.term(XS, label="x"), train=True)
    with pytest.raises(ValueError, match=r"parameter 'm_w0' is asked for as batch \(\), "
                                         r"output \(6,\).*created it as .*output \(8,\)"):
        model(T.term(X_EVAL, label="xe"), train=False)


def test_a_parameter_the_first_build_did_not_create_is_refused():
    def build(x, *, train):
        logits = nn_blocks.mlp(x, [], 3, label="m")[0]
        return logits if train else nn_blocks.mlp(logits, [], 3, label="extra")[0]

    model = Model(build)
    model(T.term(XS, label="x"), train=True)
    with pytest.raises(ValueError, match=r"creates parameter 'extra_w0', which the model's "
                                         r"first build did not create"):
        model(T.term(X_EVAL, label="xe"), train=False)


def test_two_parameters_of_one_label_are_refused_at_the_first_build():
    def build(x, *, train):
        h = nn_blocks.mlp(x, [], 4)[0]
        return nn_blocks.mlp(h, [], 3)[0]  # both labelled "mlp"

    model = Model(build)
    with pytest.raises(ValueError, match=r"two parameters are labelled 'mlp_w0'"):
        model(T.term(XS, label="x"), train=True)
    assert model.builds == 0 and model.params == []


def test_an_input_of_other_features_is_refused_by_the_shared_weight():
    model = Model(lambda x, *, train: nn_blocks.mlp(x, [8], 3, label="f")[0])
    model(T.term(XS, label="x"), train=True)
    with pytest.raises(ValueError, match=r"input axes \(4,\).*output axes \(5,\)"):
        model(T.term(np.zeros((2, 5)), label="x5"), train=False)


def test_train_must_be_a_bool():
    model = Model(lambda x, *, train: x)
    with pytest.raises(TypeError, match="train must be True or False, got 1"):
        model(T.term(XS, label="x"), train=1)


def test_an_input_the_graph_does_not_read_is_refused_and_nothing_is_written():
    """Issue 38, 1: the training input given to the evaluation routine (which reads
    ``x_eval``) would overwrite the training batch and return the logits of ``x_eval``'s
    construction values without a word. Refused, naming it and what the graph reads, before
    any value is written (not even the input the graph does read)."""
    model, loss, opt, rng, ctx, _ = _trained()
    x = next(t for t in loss.topo() if t.label == "x")
    x_eval = T.term(np.zeros((5, 4)), label="x_eval")
    ctx, ev = compile_eval(ctx, model(x_eval, train=False))
    before = _state_bits(ctx, loss, opt, model, rng)
    inputs_before = (ctx.get_values(x).tobytes(), ctx.get_values(x_eval).tobytes())
    with pytest.raises(ValueError, match=r"Evaluation\(\w+\)\.run: the graph does not read "
                                         r"x \(node x_\d+\): it reads x_eval_\d+, "):
        ev.run(ctx, {x_eval: X_EVAL, x: np.ones((16, 4))})
    assert (ctx.get_values(x).tobytes(), ctx.get_values(x_eval).tobytes()) == inputs_before
    assert _state_bits(ctx, loss, opt, model, rng) == before
