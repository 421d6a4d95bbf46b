"""Learning-rate schedules (ocannl.schedules) against torch.optim.lr_scheduler: the device's
rate, step by step over 1000 steps, is torch's rate rounded to f32, bit for bit; 30-step training
runs with Adam and SGD under each schedule match torch within 1e-5 (f32) and 2e-3 (f16 twins with
dynamic loss scaling, both recipes); the schedule counts every iteration, applied or skipped, the
same under both gates and as a torch loop calling ``scheduler.step()`` every iteration, while a
skipped step changes no other bit of training state; a resume continues the schedule exactly;
bad arguments are refused by name; optimizers take ``lr=`` beside ``learning_rate=``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from test_mixed_prec import bad_batch, make_rig, snapshot
from test_optim import torch_run
from test_train import Problem, _assert_close
from torch.optim import lr_scheduler as tl

import ocannl.tensor as T
from ocannl import Context, checkpoint, mixed_prec, optim, schedules, train
from ocannl.mixed_prec import Loss_scaler, Recipe

BASE = 0.05
TorchSched = Callable[[torch.optim.Optimizer], tl.LRScheduler]

# name -> (our schedule over ``base``, torch's scheduler over an optimizer at lr=base)
SCHEDULES: dict[str, tuple[Callable[[float], schedules.Schedule], TorchSched]] = {
    "linear_warmup": (lambda b: schedules.LinearLR(b, start_factor=0.01, total_iters=300),
                      lambda o: tl.LinearLR(o, start_factor=0.01, total_iters=300)),
    "linear_decay": (lambda b: schedules.LinearLR(b, start_factor=1.0, end_factor=0.05,
                                                  total_iters=700),
                     lambda o: tl.LinearLR(o, start_factor=1.0, end_factor=0.05,
                                           total_iters=700)),
    # past T_max (three times over in 1000 steps) the rate rises again, as torch's does
    "cosine": (lambda b: schedules.CosineAnnealingLR(b, T_max=300, eta_min=1e-4),
               lambda o: tl.CosineAnnealingLR(o, T_max=300, eta_min=1e-4)),
    "cosine_to_zero": (lambda b: schedules.CosineAnnealingLR(b, T_max=250),
                       lambda o: tl.CosineAnnealingLR(o, T_max=250)),
    "step": (lambda b: schedules.StepLR(b, step_size=70, gamma=0.7),
             lambda o: tl.StepLR(o, step_size=70, gamma=0.7)),
    "constant": (lambda b: schedules.Constant(b),
                 lambda o: tl.ConstantLR(o, factor=1.0, total_iters=0)),
    "warmup_cosine": (lambda b: schedules.warmup_cosine(b, warmup_iters=50, T_max=400,
                                                        start_factor=0.01, eta_min=1e-5),
                      lambda o: tl.SequentialLR(o, [
                          tl.LinearLR(o, start_factor=0.01, total_iters=50),
                          tl.CosineAnnealingLR(o, T_max=400, eta_min=1e-5)], milestones=[50])),
    "three_phases": (lambda b: schedules.SequentialLR([
                         schedules.LinearLR(b, start_factor=0.1, total_iters=40),
                         schedules.Constant(b),
                         schedules.StepLR(b, step_size=100, gamma=0.5)], milestones=[40, 200]),
                     lambda o: tl.SequentialLR(o, [
                         tl.LinearLR(o, start_factor=0.1, total_iters=40),
                         tl.ConstantLR(o, factor=1.0, total_iters=0),
                         tl.StepLR(o, step_size=100, gamma=0.5)], milestones=[40, 200])),
}


def torch_rates(make: TorchSched, steps: int, base: float = BASE) -> np.ndarray:
    """The rate a torch loop uses at each of ``steps`` iterations (``scheduler.step()`` after
    each), in f64."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=base)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return np.array(out)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_device_rates_are_torchs_rounded_to_f32_over_1000_steps(name: str) -> None:
    """The rate the device computes (in f64 from the f32 counter, rounded once to f32) is,
    at each of 1000 steps, torch's f64 rate rounded to f32: the same bits, so within 2**-24
    (6e-8) relative. The host's closed form (``lr_at``) is within 1e-12 of torch's recursive
    one."""
    ours, theirs = SCHEDULES[name]
    sched = ours(BASE)
    steps = 1000
    opt = optim.SGD(sched)
    ctx, tick = Context.cpu().compile(opt.schedule_tick())
    got = []
    for _ in range(steps):
        ctx = ctx.run(tick)
        got.append(ctx.get_value(opt.lr_node))
    assert ctx.get_value(opt.schedule_counter) == float(steps)
    want = torch_rates(theirs, steps)
    rounded = want.astype(np.float32)
    assert np.array_equal(np.asarray(got, np.float32), rounded), \
        np.flatnonzero(np.asarray(got, np.float32) != rounded)[:10]
    host = np.array([sched.lr_at(t) for t in range(steps)])
    assert np.all(np.abs(host - want) <= 1e-12 * np.abs(want) + 1e-18)
    if name == "constant":
        assert set(got) == {float(np.float32(BASE))}
    else:
        assert len(set(got)) > 10  # the rate really changes


# --- training parity --------------------------------------------------------------------------

TRAIN_SCHEDULES: dict[str, tuple[Callable[[float], schedules.Schedule], TorchSched]] = {
    "linear": (lambda b: schedules.LinearLR(b, start_factor=0.1, total_iters=20),
               lambda o: tl.LinearLR(o, start_factor=0.1, total_iters=20)),
    "cosine": (lambda b: schedules.CosineAnnealingLR(b, T_max=20, eta_min=1e-4),
               lambda o: tl.CosineAnnealingLR(o, T_max=20, eta_min=1e-4)),
    "step": (lambda b: schedules.StepLR(b, step_size=7, gamma=0.5),
             lambda o: tl.StepLR(o, step_size=7, gamma=0.5)),
    "warmup_cosine": (lambda b: schedules.warmup_cosine(b, warmup_iters=5, T_max=25,
                                                        start_factor=0.05),
                      lambda o: tl.SequentialLR(o, [
                          tl.LinearLR(o, start_factor=0.05, total_iters=5),
                          tl.CosineAnnealingLR(o, T_max=25)], milestones=[5])),
}

# name -> (ocannl optimizer over a rate, torch optimizer over params and a rate, base rate)
OPTIMIZERS = {
    "adam": (lambda lr: optim.Adam(lr), lambda ps, b: torch.optim.Adam(ps, lr=b), 0.02),
    "sgd": (lambda lr: optim.SGD(lr=lr, momentum=0.9),
            lambda ps, b: torch.optim.SGD(ps, lr=b, momentum=0.9), 0.1),
    # decoupled decay reads the rate too: 1 - lr * weight_decay, computed in f64 as torch's
    "adamw": (lambda lr: optim.AdamW(lr, weight_decay=0.5),
              lambda ps, b: torch.optim.AdamW(ps, lr=b, weight_decay=0.5), 0.02),
}
PARITY = [(o, s) for o in ("adam", "sgd") for s in TRAIN_SCHEDULES] + [("adamw", "warmup_cosine")]


def make_torch_opt(opt_name: str, params: list[torch.Tensor],
                   sched_name: str, table: dict) -> tuple[torch.optim.Optimizer, tl.LRScheduler]:
    _, make_opt, base = OPTIMIZERS[opt_name]
    t_opt = make_opt(params, base)
    return t_opt, table[sched_name][1](t_opt)


@pytest.mark.parametrize(("opt_name", "sched_name"), PARITY, ids=[f"{o}-{s}" for o, s in PARITY])
def test_thirty_scheduled_steps_match_torch(opt_name: str, sched_name: str) -> None:
    """30 steps of an f32 MLP (fresh shapes: 40 points of 8 features, 3 classes, hidden 12 and
    20) under each schedule: every loss and the final parameters within 1e-5 relative of
    torch's run with the same optimizer and ``scheduler.step()`` after each step."""
    make_ours, _, base = OPTIMIZERS[opt_name]
    pb = Problem(hidden=(12, 20), n=40, classes=3, seed=11, dataset="blobs")
    ctx = pb.load_weights(Context.cpu())
    sched = TRAIN_SCHEDULES[sched_name][0](base)
    opt = make_ours(sched)
    ctx, step = ctx.compile(train.grad_update(pb.loss) + opt.update(pb.loss))
    t_opt, t_sched = make_torch_opt(opt_name, pb.torch_params(), sched_name, TRAIN_SCHEDULES)
    ours, theirs, rates = [], [], []
    for _ in range(30):
        rates.append(t_opt.param_groups[0]["lr"])
        ctx = ctx.run(step)
        ours.append(float(ctx.get_values(pb.loss)))
        t_opt.zero_grad()
        t_loss = pb.torch_loss()
        t_loss.backward()
        t_opt.step()
        t_sched.step()
        theirs.append(t_loss.item())
        assert ctx.get_value(opt.lr_node) == float(np.float32(rates[-1]))
    err = float(np.max(np.abs(np.array(ours) - theirs) / np.abs(theirs)))
    print(f"{opt_name} {sched_name}: worst relative loss error {err:.2e}")
    assert err <= 1e-5, f"worst relative loss error {err:.3g}\n{ours}\n{theirs}"
    assert theirs[0] - theirs[-1] > 0.1  # it trained
    assert max(rates) > 1.5 * min(rates)  # under a rate that really moved
    for p, tp in zip(pb.params(), pb.torch_params(), strict=True):
        _assert_close(ctx.get_values(p), tp.detach().double().numpy(), 1e-5, f"final {p.label}")
    assert ctx.get_value(opt.schedule_counter) == 30.0


def torch_twin_run(rig_ctx: Context, loss: T.Tensor, points: np.ndarray, targets: np.ndarray,
                   opt_name: str, sched_name: str, steps: int) -> list[float]:
    """torch's f32 run of the rig's MLP from its master weights, scheduled."""
    _, make_opt, base = OPTIMIZERS[opt_name]
    return torch_run(rig_ctx, loss, points, targets, lambda ws: make_opt(ws, base), steps,
                     TRAIN_SCHEDULES[sched_name][1])


def build_recipe(kind: str, sc: Loss_scaler, loss: T.Tensor, opt: optim.Optimizer,
                 check_interval: int = 4) -> Recipe:
    if kind == "host":
        return mixed_prec.scaled_step(sc, loss, opt)
    return mixed_prec.gated_step(sc, loss, opt, check_interval=check_interval)


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_f16_twins_scaled_and_scheduled_match_torch_f32(recipe_kind: str, opt_name: str) -> None:
    """f16 cast twins of f32 masters (``with_master_weights``), dynamic loss scaling, warm-up
    then cosine: 30 losses within 2e-3 of torch's f32 run, through either recipe."""
    rig = make_rig("f16", seed=4)
    make_ours, _, base = OPTIMIZERS[opt_name]
    expected = torch_twin_run(rig.ctx, rig.loss, rig.points, rig.targets, opt_name,
                              "warmup_cosine", 30)
    sc = Loss_scaler.create(init_scale=2.0**12, growth_interval=8)
    opt = make_ours(TRAIN_SCHEDULES["warmup_cosine"][0](base))
    recipe = build_recipe(recipe_kind, sc, rig.loss, opt)
    ctx = recipe.compile(rig.ctx)
    got = []
    for _ in range(30):
        ctx = recipe.step(ctx)
        got.append(ctx.get_value(rig.loss))
    ctx = recipe.flush(ctx)
    assert (recipe.applied_steps, recipe.skipped_steps) == (30, 0)
    assert sc.scale_val > 2.0**12  # the scale grew: gradients really were scaled
    err = float(np.max(np.abs(np.array(got) - expected) / np.abs(expected)))
    print(f"f16 {recipe_kind} {opt_name}: worst relative loss error {err:.2e}")
    assert err <= 2e-3, f"worst relative loss error {err:.3g}\n{got}\n{expected}"
    assert expected[0] - expected[-1] > 0.05


# --- skipped steps: the schedule counts them, nothing else moves ------------------------------


def scheduled_adam() -> optim.AdamW:
    return optim.AdamW(lr=schedules.warmup_cosine(0.01, warmup_iters=3, T_max=10,
                                                  start_factor=0.1), amsgrad=True,
                       weight_decay=0.1)


@pytest.mark.parametrize("kind", ["nan", "overflow"])
@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_a_skipped_step_changes_only_the_schedule_counter(recipe_kind: str, kind: str) -> None:
    """After a non-finite step every parameter, moment, running maximum and Adam's step keep
    their bits; the schedule's counter alone advances (and the rate computed is the skipped
    iteration's); the next good step uses the rate of the iteration after it."""
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=1024.0)
    opt = scheduled_adam()
    recipe = build_recipe(recipe_kind, sc, rig.loss, opt, check_interval=5)
    ctx = recipe.compile(rig.ctx)
    nodes = checkpoint.training_state(rig.loss, opt)
    assert nodes[-1] is opt.schedule_counter and opt.step_counter in nodes
    for _ in range(2):
        ctx = recipe.step(ctx)
    before = snapshot(ctx, nodes[:-1])
    assert all(np.any(ctx.get_values(n) != 0) for n in nodes)  # every node is in use
    ctx = ctx.set_values(rig.x, bad_batch(rig.points, kind))
    ctx = recipe.step(ctx)
    assert not math.isfinite(ctx.get_value(recipe.checksum))
    assert snapshot(ctx, nodes[:-1]) == before
    assert ctx.get_value(opt.step_counter) == 2.0
    assert ctx.get_value(opt.schedule_counter) == 3.0
    assert ctx.get_value(opt.lr_node) == float(np.float32(opt.schedule.lr_at(2)))
    ctx = ctx.set_values(rig.x, rig.points)
    ctx = recipe.step(ctx)
    assert ctx.get_value(opt.step_counter) == 3.0
    assert ctx.get_value(opt.schedule_counter) == 4.0
    assert ctx.get_value(opt.lr_node) == float(np.float32(opt.schedule.lr_at(3)))
    assert all(a != b for a, b in zip(snapshot(ctx, nodes[:-1]), before, strict=True))
    ctx = recipe.flush(ctx)
    assert (recipe.applied_steps, recipe.skipped_steps) == (3, 1)


def test_both_gates_give_the_same_rates_over_a_run_with_skips() -> None:
    """12 iterations, three of them non-finite: the host gate and the fused gate (windows of
    4) use, iteration by iteration, the same rate, the schedule's at the iteration's index;
    their counters both count 12 while Adam's counts the 9 applied steps."""
    bad = {3, 7, 8}
    seqs = {}
    for kind in ("host", "fused"):
        rig = make_rig()
        sc = Loss_scaler.create(init_scale=1024.0)
        opt = scheduled_adam()
        recipe = build_recipe(kind, sc, rig.loss, opt, check_interval=4)
        ctx = recipe.compile(rig.ctx)
        rates = []
        for k in range(12):
            ctx = ctx.set_values(rig.x, bad_batch(rig.points, "inf") if k in bad else rig.points)
            ctx = recipe.step(ctx)
            rates.append(ctx.get_value(opt.lr_node))
        ctx = recipe.flush(ctx)
        assert recipe.skipped_steps == 3 and recipe.applied_steps == 9
        assert ctx.get_value(opt.schedule_counter) == 12.0
        assert ctx.get_value(opt.step_counter) == 9.0
        seqs[kind] = rates
    assert seqs["host"] == seqs["fused"]
    assert seqs["host"] == [float(np.float32(opt.schedule.lr_at(k))) for k in range(12)]


@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_skips_count_as_torch_counts_them_with_grad_scaler(recipe_kind: str) -> None:
    """An f32 model, loss-scaled, with non-finite batches at iterations 4 and 9: ocannl's
    recipe (the fused one sampled every step) against torch's loop of ``GradScaler.step``
    (which skips ``optimizer.step()``), ``scaler.update()`` and ``scheduler.step()`` every
    iteration: the same losses at the good iterations, the same final parameters (1e-5)."""
    bad = {4, 9}
    pb = Problem(hidden=(12, 20), n=40, classes=3, seed=5, dataset="blobs")
    ctx = pb.load_weights(Context.cpu())
    sc = Loss_scaler.create(init_scale=1024.0, growth_interval=5)
    sched = TRAIN_SCHEDULES["warmup_cosine"][0](0.02)
    opt = optim.Adam(sched)
    recipe = build_recipe(recipe_kind, sc, pb.loss, opt, check_interval=1)
    ctx = recipe.compile(ctx)
    x_good = ctx.get_values(pb.x)
    t_opt = torch.optim.Adam(pb.torch_params(), lr=0.02)
    t_sched = tl.SequentialLR(t_opt, [tl.LinearLR(t_opt, start_factor=0.05, total_iters=5),
                                      tl.CosineAnnealingLR(t_opt, T_max=25)], milestones=[5])
    t_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    tx_good = pb.tx
    ours, theirs = [], []
    for k in range(20):
        x = bad_batch(x_good, "inf") if k in bad else x_good
        ctx = ctx.set_values(pb.x, x)
        ctx = recipe.step(ctx)
        pb.tx = torch.tensor(x, dtype=torch.float32)
        t_opt.zero_grad()
        t_loss = pb.torch_loss()
        t_scaler.scale(t_loss).backward()
        t_scaler.step(t_opt)
        t_scaler.update()
        t_sched.step()
        if k not in bad:
            ours.append(ctx.get_value(pb.loss))
            theirs.append(t_loss.item())
    pb.tx = tx_good
    ctx = recipe.flush(ctx)
    assert recipe.skipped_steps == 2 and sc.scale_value() == t_scaler.get_scale()
    err = float(np.max(np.abs(np.array(ours) - theirs) / np.abs(theirs)))
    print(f"GradScaler {recipe_kind}: worst relative loss error {err:.2e}")
    assert err <= 1e-5, f"worst relative loss error {err:.3g}\n{ours}\n{theirs}"
    for p, tp in zip(pb.params(), pb.torch_params(), strict=True):
        _assert_close(ctx.get_values(p), tp.detach().double().numpy(), 1e-5, f"final {p.label}")
    assert ctx.get_value(opt.schedule_counter) == 20.0
    assert ctx.get_value(opt.lr_node) == float(np.float32(sched.lr_at(19)))


# --- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_kind", ["host", "fused"])
def test_resume_mid_schedule_continues_bit_for_bit(recipe_kind: str, tmp_path: Path) -> None:
    """Save after 7 iterations (one skipped, mid warm-up-then-cosine), restore into a fresh
    model and context, run 9 more (one skipped): every node of the checkpoint (masters,
    moments, Adam's step, the schedule counter, the gate's count) and the host states equal the
    uninterrupted run's, bit for bit."""
    bad = {2, 11}
    path = tmp_path / "ck.safetensors"

    def start() -> tuple:
        rig = make_rig(seed=2)
        sc = Loss_scaler.create(init_scale=1024.0, growth_interval=4)
        opt = scheduled_adam()
        recipe = build_recipe(recipe_kind, sc, rig.loss, opt, check_interval=3)
        ctx = recipe.compile(rig.ctx)
        return rig, sc, opt, recipe, ctx, checkpoint.training_state(rig.loss, opt) \
            + recipe.state_nodes()

    def steps(rig, recipe, ctx, ks):
        for k in ks:
            ctx = ctx.set_values(rig.x, bad_batch(rig.points, "nan") if k in bad else rig.points)
            ctx = recipe.step(ctx)
        return ctx

    rig, sc, opt, recipe, ctx, nodes = start()
    ctx = steps(rig, recipe, ctx, range(16))
    ctx = recipe.flush(ctx)
    whole = (snapshot(ctx, nodes), sc.save_state(), recipe.save_state())
    assert ctx.get_value(opt.schedule_counter) == 16.0 and ctx.get_value(opt.step_counter) == 14

    rig, sc, opt, recipe, ctx, nodes = start()
    ctx = steps(rig, recipe, ctx, range(7))
    checkpoint.save(path, ctx, nodes, checkpoint.Progress(
        step=7, extra={"scaler": sc.save_state(), "recipe": recipe.save_state()}))
    assert "adamw_lr_step" in checkpoint.node_names(nodes)

    rig, sc, opt, recipe, ctx, nodes = start()  # a fresh model, optimizer and context
    ctx, progress = checkpoint.load(path, ctx, nodes)
    ctx = sc.restore_state(ctx, progress.extra["scaler"])
    recipe.restore_state(progress.extra["recipe"])
    assert ctx.get_value(opt.schedule_counter) == 7.0 and ctx.get_value(opt.step_counter) == 6
    ctx = steps(rig, recipe, ctx, range(7, 16))
    ctx = recipe.flush(ctx)
    assert (snapshot(ctx, nodes), sc.save_state(), recipe.save_state()) == whole


# --- the optimizer side: state, lr= ------------------------------------------------------------


def test_the_counter_is_the_last_state_node_and_only_with_a_schedule() -> None:
    pb = Problem(hidden=(4,), n=8)
    plain = optim.Adam(0.01)
    assert plain.schedule is None and plain.schedule_counter is None
    assert plain.schedule_tick() is None
    assert checkpoint.training_state(pb.loss, plain)[-1] is plain.step_counter
    sgd = optim.SGD(schedules.StepLR(0.1, step_size=2))
    nodes = checkpoint.training_state(pb.loss, sgd)
    assert nodes[-1] is sgd.schedule_counter
    assert sgd.schedule_counter.label == "sgd_lr_step" and sgd.schedule_counter.zero_start
    assert sgd.schedule_counter.dims == () and sgd.schedule_counter.prec.value == "f32"
    assert len(nodes) == len(pb.loss.params) + 1  # no momentum: the counter alone
    ctx = pb.load_weights(Context.cpu())
    ctx, r = ctx.compile(train.grad_update(pb.loss) + sgd.update(pb.loss))
    count = ctx.compile_count
    for _ in range(5):
        ctx = ctx.run(r)
    assert ctx.compile_count == count  # a schedule recompiles nothing
    assert ctx.get_value(sgd.lr_node) == float(np.float32(0.1 * 0.1**2))  # step 4: 0.1 * g**2


def test_the_counter_saturates_at_2_to_the_24() -> None:
    """Documented: the f32 counter stops at 2**24; the rate then stays that of step 2**24 - 1."""
    sched = schedules.CosineAnnealingLR(1.0, T_max=1000)
    opt = optim.SGD(sched)
    ctx, tick = Context.cpu().compile(opt.schedule_tick())
    ctx = ctx.set_values(opt.schedule_counter, 2.0**24 - 1)
    for want in (2.0**24 - 1, 2.0**24 - 1):  # 2**24 - 1 counted, then stuck at 2**24
        ctx = ctx.run(tick)
        assert ctx.get_value(opt.schedule_counter) == 2.0**24
        assert ctx.get_value(opt.lr_node) == float(np.float32(sched.lr_at(int(want))))
    ctx = ctx.run(tick)
    assert ctx.get_value(opt.lr_node) == float(np.float32(sched.lr_at(2**24 - 1)))


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam, optim.AdamW])
def test_lr_is_an_alias_of_learning_rate(cls: type[optim.Optimizer]) -> None:
    a, b = cls(lr=0.03), cls(learning_rate=0.03)
    assert a.learning_rate == b.learning_rate == 0.03 and repr(a) == repr(b)
    sched = schedules.Constant(0.2)
    assert cls(lr=sched).schedule is sched
    with pytest.raises(ValueError, match=r"learning_rate=0\.1 and lr=0\.1 both given"):
        cls(0.1, lr=0.1)
    with pytest.raises(ValueError, match=r"learning_rate=0\.1 and lr=Constant\(0\.2\)"):
        cls(learning_rate=0.1, lr=sched)
    with pytest.raises(ValueError, match=r"learning_rate must be >= 0, got -0\.5"):
        cls(lr=-0.5)
    with pytest.raises(TypeError, match="a float or a one-element Tensor, or a schedule"):
        cls(lr="0.1")


def test_sgd_needs_a_rate_adam_defaults_to_torchs() -> None:
    with pytest.raises(TypeError, match="SGD needs a learning rate: pass learning_rate= or lr="):
        optim.SGD(momentum=0.9)
    assert optim.Adam().learning_rate == 1e-3 == optim.AdamW().learning_rate


def test_lr_given_as_lr_trains_as_learning_rate_does() -> None:
    """The alias reaches the update: the same bits after 3 steps either way."""
    finals = []
    for kw in ({"lr": 0.1}, {"learning_rate": 0.1}):
        pb = Problem(hidden=(6,), n=16, seed=1)
        ctx = pb.load_weights(Context.cpu())
        opt = optim.SGD(momentum=0.5, **kw)
        ctx, r = ctx.compile(train.grad_update(pb.loss) + opt.update(pb.loss))
        for _ in range(3):
            ctx = ctx.run(r)
        finals.append([ctx.get_values(p).tobytes() for p in pb.params()])
    assert finals[0] == finals[1]


# --- bad input ---------------------------------------------------------------------------------

BAD = [
    (lambda: schedules.LinearLR(0.1, total_iters=-3), "total_iters", "-3"),
    (lambda: schedules.LinearLR(0.1, total_iters=0), "total_iters", "0"),
    (lambda: schedules.LinearLR(0.1, total_iters=5.0), "total_iters", "5.0"),
    (lambda: schedules.LinearLR(0.1, total_iters=True), "total_iters", "True"),
    (lambda: schedules.LinearLR(0.1, total_iters=2**24 + 1), "total_iters", "16777217"),
    (lambda: schedules.LinearLR(0.1, start_factor=0.0), "start_factor", "0.0"),
    (lambda: schedules.LinearLR(0.1, start_factor=1.5), "start_factor", "1.5"),
    (lambda: schedules.LinearLR(0.1, end_factor=-0.1), "end_factor", "-0.1"),
    (lambda: schedules.LinearLR(0.1, end_factor=math.nan), "end_factor", "nan"),
    (lambda: schedules.LinearLR(math.inf), "base_lr", "inf"),
    (lambda: schedules.LinearLR(-0.1), "base_lr", "-0.1"),
    (lambda: schedules.CosineAnnealingLR(0.1, T_max=-10), "T_max", "-10"),
    (lambda: schedules.CosineAnnealingLR(0.1, T_max=0), "T_max", "0"),
    (lambda: schedules.CosineAnnealingLR(0.1, T_max=10, eta_min=math.inf), "eta_min", "inf"),
    (lambda: schedules.CosineAnnealingLR(0.1, T_max=10, eta_min=-1e-3), "eta_min", "-0.001"),
    (lambda: schedules.CosineAnnealingLR(math.nan, T_max=10), "base_lr", "nan"),
    (lambda: schedules.StepLR(0.1, step_size=0), "step_size", "0"),
    (lambda: schedules.StepLR(0.1, step_size=-2), "step_size", "-2"),
    (lambda: schedules.StepLR(0.1, step_size=3, gamma=-0.5), "gamma", "-0.5"),
    (lambda: schedules.StepLR(0.1, step_size=3, gamma=math.nan), "gamma", "nan"),
    (lambda: schedules.Constant("0.1"), "base_lr", "'0.1'"),
    (lambda: schedules.warmup_cosine(0.1, warmup_iters=-5, T_max=10), "warmup_iters", "-5"),
    (lambda: schedules.warmup_cosine(0.1, warmup_iters=5, T_max=-1), "T_max", "-1"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1), schedules.Constant(0.1)],
                                    milestones=[]), "milestones", "2 schedules need 1"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1)] * 3, milestones=[5, 5]),
     "milestones", "milestones[0]=5 then milestones[1]=5"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1)] * 3, milestones=[9, 4]),
     "milestones", "strictly increasing"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1)] * 2, milestones=[0]),
     "milestones[0]", "got 0"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1)] * 2, milestones=[2.5]),
     "milestones[0]", "2.5"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1), 0.1], milestones=[3]),
     "schedulers[1]", "float"),
    (lambda: schedules.SequentialLR([], milestones=[]), "schedulers", "[]"),
    (lambda: schedules.SequentialLR([schedules.Constant(0.1), schedules.Constant(0.2)],
                                    milestones=[3]), "base_lr", "[0.1, 0.2]"),
    (lambda: schedules.Constant(0.1).lr_at(-1), "t", "-1"),
]


@pytest.mark.parametrize(("build", "name", "value"), BAD, ids=[f"{n}={v}" for _, n, v in BAD])
def test_bad_arguments_are_refused_by_name(build: Callable[[], object], name: str,
                                           value: str) -> None:
    with pytest.raises(ValueError) as err:
        build()
    msg = str(err.value)
    assert name in msg and value in msg, msg


def test_schedules_are_immutable_and_described_exactly() -> None:
    sched = schedules.warmup_cosine(0.1, warmup_iters=5, T_max=20, eta_min=1e-4)
    assert repr(sched) == ("SequentialLR([LinearLR(0.1, start_factor=0.001, end_factor=1.0, "
                           "total_iters=5), CosineAnnealingLR(0.1, T_max=20, eta_min=0.0001)], "
                           "milestones=[5])")
    with pytest.raises(AttributeError, match="read-only"):
        sched.base_lr = 0.2  # type: ignore[misc]
    assert sched == schedules.warmup_cosine(0.1, warmup_iters=5, T_max=20, eta_min=1e-4)
    assert sched != schedules.warmup_cosine(0.1, warmup_iters=6, T_max=20, eta_min=1e-4)
    # one schedule, two optimizers: each has its own counter
    a, b = optim.SGD(sched), optim.Adam(sched)
    assert a.schedule_counter is not b.schedule_counter
