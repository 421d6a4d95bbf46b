"""Optimizers as objects (ocannl.optim): Adam and AdamW against torch.optim step for step, at f32
and through f16 cast twins with dynamic loss scaling in both recipes; skipped steps that change no
bit of training state (Adam's step counter included); a SIGKILL'd Adam run resumed exactly; the
SGD wrapper, validation and state bookkeeping."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_checkpoint import read_checkpoint, run_example, sigkill_then_resume
from test_mixed_prec import bad_batch, make_rig, snapshot
from test_train import Problem, _assert_close

import ocannl.tensor as T
from ocannl import Context, checkpoint, mixed_prec, optim, train
from ocannl.ir.assignments import Fixed, Get
from ocannl.mixed_prec import Loss_scaler, Recipe

LR = 0.01

# name -> (ocannl optimizer, torch optimizer, keyword arguments both take)
ADAM_VARIANTS: dict[str, tuple[type[optim.Adam], type[torch.optim.Optimizer], dict]] = {
    "adam": (optim.Adam, torch.optim.Adam, {}),
    "adam_weight_decay": (optim.Adam, torch.optim.Adam, {"weight_decay": 0.05}),
    "adam_amsgrad": (optim.Adam, torch.optim.Adam, {"amsgrad": True}),
    "adam_amsgrad_decay_betas": (optim.Adam, torch.optim.Adam,
                                 {"amsgrad": True, "weight_decay": 0.01, "betas": (0.8, 0.99),
                                  "eps": 1e-6}),
    "adamw": (optim.AdamW, torch.optim.AdamW, {}),  # weight_decay 0.01 by default in both
    "adamw_no_decay": (optim.AdamW, torch.optim.AdamW, {"weight_decay": 0.0}),
    "adamw_amsgrad": (optim.AdamW, torch.optim.AdamW, {"amsgrad": True, "weight_decay": 0.1}),
}


def _rel(got: list[float], want: list[float]) -> float:
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


CASES = [(v, "float") for v in ADAM_VARIANTS] + [("adam", "tensor"), ("adamw_amsgrad", "tensor")]


@pytest.mark.parametrize(("variant", "lr_kind"), CASES, ids=[f"{v}-{k}" for v, k in CASES])
def test_twenty_adam_steps_match_torch(variant: str, lr_kind: str) -> None:
    """Every loss of 20 steps within 1e-5 relative of torch.optim.Adam / AdamW from the same
    weights and data; final parameters, moments and the step counter agree too. A tensor
    learning rate is read on the device (AdamW's decay factor is then computed there)."""
    ours_cls, torch_cls, kw = ADAM_VARIANTS[variant]
    pb = Problem(hidden=(16, 32), n=64, seed=3)
    ctx = pb.load_weights(Context.cpu())
    lr: float | T.Tensor = LR if lr_kind == "float" else T.term([LR], label="lr")
    opt = ours_cls(lr, **kw)
    ctx, r = ctx.compile(train.grad_update(pb.loss) + opt.update(pb.loss))
    t_opt = torch_cls(pb.torch_params(), lr=LR, **kw)
    ours, theirs = [], []
    for _ in range(20):
        ctx.run(r)
        ours.append(float(ctx.get_values(pb.loss)))
        t_opt.zero_grad()
        t_loss = pb.torch_loss()
        t_loss.backward()
        t_opt.step()
        theirs.append(t_loss.item())
    err = _rel(ours, theirs)
    assert err <= 1e-5, f"worst relative loss error {err:.3g}\n{ours}\n{theirs}"
    assert theirs[0] - theirs[-1] > 0.1  # it trained: the comparison is not of a flat line
    for p, tp in zip(pb.params(), pb.torch_params(), strict=True):
        _assert_close(ctx.get_values(p), tp.detach().double().numpy(), 1e-4, f"final {p.label}")
    w0, tw0 = pb.layers[0][0], pb.torch_layers[0].weight
    state = opt.state_of(w0)
    t_state = t_opt.state[tw0]
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kw.get("amsgrad") else [])
    assert list(state) == names
    for name in names:
        _assert_close(ctx.get_values(state[name]), t_state[name].double().numpy(), 1e-4, name)
    assert ctx.get_value(opt.step_counter) == 20.0 == float(t_state["step"])


def torch_run(rig_ctx: Context, loss: T.Tensor, points: np.ndarray, targets: np.ndarray,
              make_opt: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
              steps: int, make_sched: Callable[[torch.optim.Optimizer], object] | None = None,
              ) -> list[float]:
    """PyTorch's f32 run of the rig's MLP from the rig's (master) weights on its batch
    (``make_sched``: a learning-rate scheduler over the optimizer, stepped after each step)."""
    ws = [torch.tensor(rig_ctx.get_values(p), dtype=torch.float32, requires_grad=True)
          for p in loss.params]
    opt = make_opt(ws)
    sched = None if make_sched is None else make_sched(opt)
    xb = torch.tensor(points, dtype=torch.float32)
    yb = torch.tensor(targets.argmax(-1))
    out = []
    for _ in range(steps):
        h = xb
        for k in range(0, len(ws), 2):
            h = h @ ws[k].T + ws[k + 1]
            if k + 2 < len(ws):
                h = torch.relu(h)
        t_loss = torch.nn.functional.cross_entropy(h, yb)
        opt.zero_grad()
        t_loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        out.append(t_loss.item())
    return out


F16_OPTS = {
    "adam": (lambda: optim.Adam(LR), lambda ws: torch.optim.Adam(ws, lr=LR)),
    "adamw_amsgrad": (lambda: optim.AdamW(LR, amsgrad=True, weight_decay=0.1),
                      lambda ws: torch.optim.AdamW(ws, lr=LR, amsgrad=True, weight_decay=0.1)),
}


def build_recipe(kind: str, sc: Loss_scaler, loss: T.Tensor, opt: optim.Optimizer,
                 check_interval: int = 16) -> Recipe:
    if kind == "host":
        return mixed_prec.scaled_step(sc, loss, opt)
    return mixed_prec.gated_step(sc, loss, opt, check_interval=check_interval)


@pytest.mark.parametrize("opt_name", list(F16_OPTS))
@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_f16_twins_with_loss_scaling_match_torch_f32(recipe_kind: str, opt_name: str) -> None:
    """f16 cast twins of f32 masters, dynamically scaled: 20 losses within 2e-3 of torch's f32
    run with the same optimizer, through either recipe, no step skipped."""
    rig = make_rig("f16")
    make_ours, make_theirs = F16_OPTS[opt_name]
    expected = torch_run(rig.ctx, rig.loss, rig.points, rig.targets, make_theirs, 20)
    sc = Loss_scaler.create(init_scale=2.0**14, growth_interval=8)  # it grows during the run
    opt = make_ours()
    recipe = build_recipe(recipe_kind, sc, rig.loss, opt, check_interval=4)
    ctx = recipe.compile(rig.ctx)
    got = []
    for _ in range(20):
        ctx = recipe.step(ctx)
        got.append(ctx.get_value(rig.loss))
    ctx = recipe.flush(ctx)
    assert (recipe.applied_steps, recipe.skipped_steps) == (20, 0)
    assert sc.scale_val > 2.0**14  # the scale grew: the scaled gradients were really scaled
    assert ctx.get_value(opt.step_counter) == 20.0
    err = _rel(got, expected)
    assert err <= 2e-3, f"worst relative loss error {err:.3g}\n{got}\n{expected}"
    assert expected[0] - expected[-1] > 0.05  # the loss moved well past the tolerance


def adam_state(loss: T.Tensor, opt: optim.Adam) -> list:
    nodes = checkpoint.training_state(loss, opt)
    assert nodes[-1] is opt.step_counter
    return nodes


@pytest.mark.parametrize("kind", ["nan", "overflow"])
@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_skipped_step_keeps_every_bit_including_adams_step(recipe_kind: str, kind: str) -> None:
    """A non-finite step changes no parameter, no moment, no running maximum and not the step
    counter (the bias correction does not advance), in either recipe; a good step then does."""
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=1024.0)
    opt = optim.AdamW(LR, amsgrad=True, weight_decay=0.1)
    recipe = build_recipe(recipe_kind, sc, rig.loss, opt, check_interval=5)
    ctx = recipe.compile(rig.ctx)
    nodes = adam_state(rig.loss, opt)
    for _ in range(2):
        ctx = recipe.step(ctx)
    assert ctx.get_value(opt.step_counter) == 2.0
    before = snapshot(ctx, nodes)
    assert all(np.any(ctx.get_values(n) != 0) for n in nodes)  # every buffer is in use
    ctx = ctx.set_values(rig.x, bad_batch(rig.points, kind))
    ctx = recipe.step(ctx)
    assert not math.isfinite(ctx.get_value(recipe.checksum))
    assert snapshot(ctx, nodes) == before
    assert ctx.get_value(opt.step_counter) == 2.0
    ctx = ctx.set_values(rig.x, rig.points)
    ctx = recipe.step(ctx)
    assert ctx.get_value(opt.step_counter) == 3.0
    after = snapshot(ctx, nodes)
    assert all(a != b for a, b in zip(after, before, strict=True))  # every node moved
    ctx = recipe.flush(ctx)
    assert (recipe.applied_steps, recipe.skipped_steps) == (3, 1)


@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_a_skipped_first_step_is_as_if_it_never_ran(recipe_kind: str) -> None:
    """Skipping the very first step (counter 0: the bias corrections divide by zero, and the
    select discards them) and then taking three steps ends bit-identical to taking the three
    steps alone."""
    finals = []
    for skip_first in (True, False):
        rig = make_rig()
        sc = Loss_scaler.create(init_scale=1024.0)
        opt = optim.Adam(LR, amsgrad=True)
        recipe = build_recipe(recipe_kind, sc, rig.loss, opt, check_interval=50)
        ctx = recipe.compile(rig.ctx)
        if skip_first:
            ctx = ctx.set_values(rig.x, bad_batch(rig.points, "inf"))
            ctx = recipe.step(ctx)
            ctx = sc.set_scale(ctx, 1024.0)  # the host gate backed off at once: undo it
            ctx = ctx.set_values(rig.x, rig.points)
        for _ in range(3):
            ctx = recipe.step(ctx)
        assert ctx.get_value(opt.step_counter) == 3.0
        finals.append(snapshot(ctx, adam_state(rig.loss, opt)))
    assert finals[0] == finals[1]


def test_adam_sigkill_then_resume_ends_bit_identical(tmp_path: Path) -> None:
    """The example with Adam through the fused gate, killed after a checkpoint and resumed,
    ends with the uninterrupted run's bytes: masters, moments, the step counter, the gate's
    count, the scaler's and the recipe's host state. The counter counts the applied steps."""
    steps = 600
    common = ["--gate", "fused", "--optimizer", "adam", "--lr", "0.01", "--check-interval", "8",
              "--inject-nonfinite", "195,250,251"]
    done, tensors, progress = sigkill_then_resume(tmp_path, common, steps)
    assert "accuracy" in done.stdout
    recipe_state = progress["extra"]["recipe"]
    m = re.fullmatch(r"ocannl\.GatedStep/3 pending=0 applied=(\d+) skipped=(\d+) windows=\d+ "
                     r"skipped_windows=\d+ micro=0 overflow=", recipe_state)
    assert m is not None, recipe_state
    applied, skipped = int(m[1]), int(m[2])
    assert applied + skipped == steps and skipped >= 3
    step_counter = np.frombuffer(tensors["adam_step"], np.float32)
    assert step_counter.tolist() == [float(applied)]
    assert {"exp_avg_mlp_w0", "exp_avg_sq_mlp_w0", "adam_step"} <= set(tensors)
    assert any(name.startswith("nonfinite_seen_") for name in tensors)
    assert not any(name.startswith("momentum") for name in tensors)
    # the run's optimizer belongs to the checkpoint: resuming it with another refuses
    other = run_example(*common[:2], "--optimizer", "sgd", "--steps", str(steps + 10),
                        "--no-plot", "--checkpoint", str(tmp_path / "whole.safetensors"),
                        "--resume")
    assert other.returncode != 0 and "cannot resume" in other.stderr
    _, unchanged = read_checkpoint(tmp_path / "whole.safetensors")
    assert unchanged == progress


# --- the optimizer objects ---------------------------------------------------------------------


def test_state_nodes_are_zero_started_in_a_deterministic_order() -> None:
    rig = make_rig()
    opt = optim.Adam(LR, amsgrad=True)
    opt.update(rig.loss)
    nodes = opt.state_nodes()
    params = rig.loss.params
    want = [f"{name}_{p.label}" for p in params
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")] + ["adam_step"]
    assert [n.label for n in nodes] == want
    assert all(n.zero_start for n in nodes)
    assert [n.dims for n in nodes[:3]] == [params[0].dims] * 3 and nodes[-1].dims == ()
    assert opt.state_nodes() == nodes  # stable, and another update reuses the buffers
    opt.update(rig.loss)
    assert opt.state_nodes() == nodes
    assert checkpoint.training_state(rig.loss, opt) == [p.value for p in params] + nodes
    sgd = optim.SGD(0.1, momentum=0.9)
    assert checkpoint.training_state(rig.loss, sgd)[len(params):] == \
        [sgd.state_of(p)["momentum"] for p in params]
    assert optim.AdamW(LR).state_nodes()[-1].label == "adamw_step"


def test_a_fresh_context_starts_optimizer_state_at_zero() -> None:
    """The moments and the counter need no initialization: compiling allocates them as zeros,
    and the first step reads them."""
    pb = Problem(hidden=(8,), n=16, seed=1)
    ctx = train.init_params(Context.cpu(), pb.loss)
    opt = optim.Adam(LR)
    ctx, r = ctx.compile(train.grad_update(pb.loss) + opt.update(pb.loss))
    for n in opt.state_nodes():
        assert ctx.is_initialized(n)
        assert not np.any(ctx.get_values(n))
    ctx.run(r)
    assert ctx.get_value(opt.step_counter) == 1.0


def test_no_optimizer_state_lives_on_the_parameters() -> None:
    pb = Problem(hidden=(8,), n=16)
    before = {id(p): set(vars(p)) for p in pb.params()}
    opts = [optim.SGD(0.1, momentum=0.9), optim.Adam(LR, amsgrad=True), optim.AdamW(LR)]
    for opt in opts:
        opt.update(pb.loss)
    train.sgd_update(pb.loss, learning_rate=0.1, momentum=0.9)
    assert {id(p): set(vars(p)) for p in pb.params()} == before
    ids = [{n.id for n in opt.state_nodes()} for opt in opts]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2])  # each optimizer owns its buffers


def test_gate_zero_keeps_every_store_including_the_step_counter() -> None:
    pb = Problem(hidden=(8,), n=16, seed=2)
    gate_t = T.term([0.0], label="gate")
    gate = Get(gate_t.value, (Fixed(0),))
    opt = optim.AdamW(LR, amsgrad=True)
    ctx = pb.load_weights(Context.cpu())
    ctx, r = ctx.compile(train.grad_update(pb.loss) + opt.update(pb.loss, gate=gate))
    nodes = [p.value for p in pb.params()] + opt.state_nodes()
    before = snapshot(ctx, nodes)
    for _ in range(3):
        ctx.run(r)
    assert snapshot(ctx, nodes) == before
    ctx.set_values(gate_t, [1.0])
    ctx.run(r)
    assert ctx.get_value(opt.step_counter) == 1.0
    assert all(a != b for a, b in zip(snapshot(ctx, nodes), before, strict=True))


def test_sgd_wrapper_is_the_sgd_object_and_shares_momentum_across_calls() -> None:
    """train.sgd_update builds an optim.SGD: the same bits as the object's update; its calls on
    one model share one momentum buffer per parameter, as before the optimizers were objects."""
    results = []
    for use_object in (True, False):
        pb = Problem(hidden=(16,), n=32, seed=4)
        ctx = pb.load_weights(Context.cpu())
        kw = {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
        if use_object:
            opt = optim.SGD(0.2, **kw)
            comp = train.grad_update(pb.loss) + opt.update(pb.loss)
            momentum = [opt.state_of(p)["momentum"] for p in pb.params()]
        else:
            comp = train.grad_update(pb.loss) + train.sgd_update(pb.loss, learning_rate=0.2,
                                                                 **kw)
            again = train.sgd_update(pb.loss, learning_rate=0.5, momentum=0.5)
            momentum = [train.optimizer_state(p, "momentum") for p in pb.params()]
            assert {a.lhs.id for a in again.assignments} >= {m.id for m in momentum}
        ctx, r = ctx.compile(comp)
        for _ in range(5):
            ctx.run(r)
        results.append(snapshot(ctx, [p.value for p in pb.params()] + momentum))
    assert results[0] == results[1]
    with pytest.raises(ValueError, match="no 'momentum' buffer"):
        train.optimizer_state(T.param("fresh", output_dims=[1], input_dims=()), "momentum")


@pytest.mark.parametrize(("make", "match"), [
    (lambda: optim.Adam(-0.1), "learning_rate must be >= 0, got -0.1"),
    (lambda: optim.Adam(math.inf), "learning_rate must be finite, got inf"),
    (lambda: optim.Adam(T.term([0.1, 0.2])), "learning_rate must be a one-element tensor"),
    (lambda: optim.Adam(betas=(1.0, 0.999)), r"betas\[0\] must be in \[0, 1\), got 1.0"),
    (lambda: optim.Adam(betas=(0.9, -0.5)), r"betas\[1\] must be in \[0, 1\), got -0.5"),
    (lambda: optim.Adam(betas=0.9), "betas must be a pair"),
    (lambda: optim.AdamW(betas=(0.9, "x")), r"betas\[1\] must be a real number, got str: 'x'"),
    (lambda: optim.Adam(eps=-1e-8), "eps must be >= 0, got -1e-08"),
    (lambda: optim.AdamW(weight_decay=math.nan), "weight_decay must be finite, got nan"),
    (lambda: optim.Adam(weight_decay=-0.01), "weight_decay must be >= 0, got -0.01"),
    (lambda: optim.Adam(amsgrad=1), "amsgrad must be a bool, got int: 1"),
    (lambda: optim.SGD(0.1, momentum="0.9"), "momentum must be a real number, got str: '0.9'"),
    (lambda: optim.SGD(0.1, momentum=1.0), r"momentum must be in \[0, 1\).*momentum=1.0"),
    (lambda: optim.SGD(0.1, weight_decay=-1), "weight_decay=-1"),
    (lambda: optim.SGD(0.1, nesterov=True), "nesterov momentum needs momentum > 0"),
    (lambda: optim.SGD(0.1, momentum=0.5, nesterov="yes"), "nesterov must be a bool"),
])
def test_hyperparameters_are_validated_naming_the_value(make: Callable, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_update_argument_errors() -> None:
    pb = Problem(hidden=(4,), n=8)
    with pytest.raises(TypeError, match="learning_rate must be a float or a one-element"):
        optim.SGD("0.1")  # type: ignore[arg-type]
    opt = optim.Adam(LR)
    with pytest.raises(ValueError, match="depends on no parameter"):
        opt.update(T.sum(T.term(np.ones(3))))
    with pytest.raises(TypeError, match="loss Tensor"):
        opt.update("loss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grad_unscale must be a one-element tensor"):
        opt.update(pb.loss, grad_unscale=T.term([1.0, 2.0]))
    with pytest.raises(ValueError, match="not a differentiable parameter"):
        opt.state_of(pb.x)


def test_one_grad_checksum_with_an_optional_unscale() -> None:
    """The single checksum: finite gradients give 0; an unscale of inf (a scale backed off to
    0) makes it non-finite, as torch's GradScaler's check of the unscaled gradients."""
    assert not hasattr(mixed_prec, "unscaled_grad_checksum")
    assert not hasattr(mixed_prec, "scaled_sgd_update")
    pb = Problem(hidden=(8,), n=16, seed=6)
    unscale = T.term([1.0], label="unscale")
    flag, check = train.grad_checksum(pb.loss, unscale=unscale)
    plain, plain_check = train.grad_checksum(pb.loss)
    ctx = pb.load_weights(Context.cpu())
    ctx, r = ctx.compile(train.grad_update(pb.loss) + check + plain_check)
    ctx.run(r)
    assert ctx.get_value(flag) == 0.0 == ctx.get_value(plain)
    ctx.set_values(unscale, [math.inf])
    ctx.run(r)
    assert math.isnan(ctx.get_value(flag)) and ctx.get_value(plain) == 0.0


@pytest.mark.parametrize("out_in", [((40,), ()), ((3,), (24,)), ((24,), (3,)), ((5,), (24,))])
def test_the_checksum_of_finite_gradients_whose_sum_overflows_is_zero(out_in: tuple) -> None:
    """Each term is ``g * 0``, summed in whatever order the code finds fastest: +0 for finite
    gradients, even where summing the gradients first would overflow (and ``inf * 0`` is
    NaN). Gradients of one axis, of short rows and of long rows (the partial sums' path)."""
    w = T.param("wbig", output_dims=out_in[0], input_dims=out_in[1])
    loss = T.sum(w * w)
    flag, check = train.grad_checksum(loss, unscale=T.number(0.5))
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(check)
    big = np.full(w.value.size, 3e38, np.float32)
    big[::3] = -1e38
    ctx.set_values(w.grad, big)
    ctx.run(r)
    assert ctx.get_value(flag) == 0.0 and math.copysign(1.0, ctx.get_value(flag)) > 0
    big[-1] = math.nan
    ctx.set_values(w.grad, big)
    ctx.run(r)
    assert math.isnan(ctx.get_value(flag))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_the_checksum_finds_one_bad_gradient_cell_anywhere(bad: float) -> None:
    """A gradient of two axes is checked through a row of partial sums: one non-finite cell,
    wherever it is, makes the checksum NaN; all finite gives exactly +0."""
    w = T.param("wcheck", output_dims=(5,), input_dims=(24,))
    loss = T.sum(w * w)
    flag, check = train.grad_checksum(loss)
    rows = [a.lhs for a in check.assignments if a.lhs.name.startswith("checksum_rows_")]
    assert [n.dims for n in rows] == [(w.value.dims[-1],)]
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(check)
    for cell in (0, 23, 24 * 3 + 7, w.value.size - 1):
        grad = np.full(w.value.size, -1.5, np.float32)
        ctx.set_values(w.grad, grad)
        ctx.run(r)
        assert ctx.get_value(flag) == 0.0 and not math.copysign(1.0, ctx.get_value(flag)) < 0
        grad[cell] = bad
        ctx.set_values(w.grad, grad)
        ctx.run(r)
        assert math.isnan(ctx.get_value(flag)), cell


def test_numpy_real_scalars_are_numbers() -> None:
    """Issue 38, friction: ``Adam(np.float32(0.01))`` was refused (``got float32``) where the
    schedules and clips took NumPy scalars. One rule: a NumPy real scalar is a number, folded
    as its exact value; a bool is not."""
    from ocannl import schedules

    opt = optim.Adam(np.float32(0.01), betas=(np.float32(0.9), np.float64(0.999)),
                     eps=np.float32(1e-8), weight_decay=np.int64(0))
    assert (opt.betas, opt.weight_decay) == ((float(np.float32(0.9)), 0.999), 0.0)
    assert optim.scalar_expr(np.float32(0.01), "lr").value == float(np.float32(0.01))
    sgd = optim.SGD(lr=np.float16(0.5), momentum=np.float32(0.5), weight_decay=np.int32(1))
    assert (sgd.momentum, sgd.weight_decay) == (0.5, 1.0)
    assert schedules.StepLR(np.float32(0.5), step_size=np.int64(3)).lr_at(3) == 0.05
    for bad in (True, np.True_):
        with pytest.raises(TypeError, match="learning_rate must be a float or a one-element"):
            optim.Adam(bad)
