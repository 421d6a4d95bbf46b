"""Overflow names: the checksum's per-parameter cells, ``recipe.last_overflow`` after a skipped
step (host gate) or window (fused gate, sticky), bit-exact skips with clipping and
accumulation, and the names' trip through ``save_state``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from grad_rig import Rig, make_rig
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ocannl.tensor as T
from ocannl import Context, Failure, checkpoint, nn_blocks, optim, schedules, train
from ocannl.clipping import ClipNorm
from ocannl.ir.expr import reads
from ocannl.mixed_prec import Loss_scaler, Recipe, gated_step, scaled_step


def poison(ctx: Context, p: T.Tensor, value: float = math.inf) -> Context:
    """One cell of ``p``'s gradient set to ``value``, the rest kept."""
    g = ctx.get_values(p.grad).copy()
    g.reshape(-1)[1] = value
    return ctx.set_values(p.grad, g)


class Injector:
    """A GradReducer (the protocol data-parallel training uses) that poisons one parameter's
    gradient between the gradient routine and the check, when told to."""

    def __init__(self) -> None:
        self.target: tuple[T.Tensor, float] | None = None

    def grad_unscale(self, scaler: Loss_scaler) -> T.Tensor:
        return scaler.unscale

    def reduce(self, ctx: Context, scaler: Loss_scaler) -> Context:
        if self.target is not None:
            ctx = poison(ctx, *self.target)
            self.target = None
        return ctx


class Rigged:
    """A recipe (clipping, Adam) that can poison a named gradient before the check: through the
    injector (``accumulate=1``) or, with ``accumulate=2``, between the two micro-batches."""

    def __init__(self, gate: str, route: str, check_interval: int = 2,
                 opt: optim.Optimizer | None = None) -> None:
        self.rig: Rig = make_rig("f16")
        self.sc = Loss_scaler.create(init_scale=1024.0)
        self.opt = optim.Adam(1e-2) if opt is None else opt
        self.injector = Injector() if route == "reducer" else None
        self.k = 1 if route == "reducer" else 2
        kw = {"clip": ClipNorm(0.15), "accumulate": self.k, "reducer": self.injector}
        self.recipe: Recipe = scaled_step(self.sc, self.rig.loss, self.opt, **kw) \
            if gate == "scaled" else \
            gated_step(self.sc, self.rig.loss, self.opt, check_interval=check_interval, **kw)
        self.ctx = self.recipe.compile(self.rig.ctx)
        self.i = 0
        self.state = checkpoint.training_state(self.rig.loss, self.opt)

    def param(self, name: str) -> T.Tensor:
        return next(p for p in self.rig.params if p.value.label == name)

    def step(self, bad: tuple[str, float] | None = None) -> None:
        """One optimizer step (``k`` micro-batches), its gradient poisoned when ``bad``."""
        for m in range(self.k):
            self.ctx = self.rig.feed(self.ctx, self.i)
            self.i += 1
            if bad is not None and m == self.k - 1:
                target = (self.param(bad[0]), bad[1])
                if self.injector is not None:
                    self.injector.target = target
                else:  # after the first micro-batch: the second adds to it
                    self.ctx = poison(self.ctx, *target)
            self.ctx = self.recipe.step(self.ctx)

    def snapshot(self) -> list[bytes]:
        return [self.ctx.get_values(n).tobytes() for n in self.state]


@pytest.mark.parametrize("route", ["accumulate", "reducer"])
@pytest.mark.parametrize("gate", ["scaled", "gated"])
def test_a_skipped_step_changes_no_state_and_names_the_parameter(gate: str,
                                                                 route: str) -> None:
    r = Rigged(gate, route)
    r.step()
    before = r.snapshot()
    assert r.ctx.get_value(r.opt.step_counter) == 1.0
    r.step(("mlp_w1", math.inf))  # the second step of the fused gate's window: it closes
    assert r.snapshot() == before  # parameters, both moments, Adam's step counter
    assert r.recipe.last_overflow == ("mlp_w1",)
    assert not math.isfinite(r.ctx.get_value(r.recipe.grad_norm))  # computed, applied to none
    assert (r.recipe.applied_steps, r.recipe.skipped_steps, r.recipe.skipped_windows) == \
        (1, 1, 1)
    assert r.recipe.windows == (2 if gate == "scaled" else 1) and r.recipe.micro == 0
    assert r.sc.scale_val == 512.0
    if gate == "gated":
        assert np.all(r.ctx.get_values(r.recipe.overflow_seen) == 0)  # cleared at the end
        assert r.ctx.get_value(r.recipe.nonfinite_seen) == 0
    r.step()
    r.step()
    assert r.recipe.last_overflow == () and r.snapshot() != before
    assert (r.recipe.applied_steps, r.recipe.skipped_steps) == (3, 1)


@pytest.mark.parametrize("gate", ["scaled", "gated"])
def test_a_skipped_step_under_a_schedule_advances_its_counter_alone(gate: str) -> None:
    """Clipping, accumulation over 2 micro-batches and a warm-up-then-cosine schedule: a step
    skipped for one named parameter's infinity keeps every bit of the training state but the
    schedule's counter (the iterations, applied and skipped), which advances by one; the next
    applied step uses the rate of the iteration after the skipped one."""
    sched = schedules.warmup_cosine(1e-2, warmup_iters=3, T_max=10, start_factor=0.1)
    r = Rigged(gate, "accumulate", opt=optim.Adam(lr=sched))
    counter = r.opt.schedule_counter
    assert r.state[-1] is counter  # the checkpoint holds it, last
    r.step()
    before = r.snapshot()
    assert r.ctx.get_value(counter) == 1.0 and r.ctx.get_value(r.opt.step_counter) == 1.0
    r.step(("mlp_w1", math.inf))  # the fused gate's window of 2 closes here
    after = r.snapshot()
    assert after[:-1] == before[:-1]  # parameters, moments, Adam's step: the same bits
    assert r.ctx.get_value(counter) == 2.0
    assert r.recipe.last_overflow == ("mlp_w1",)
    assert (r.recipe.applied_steps, r.recipe.skipped_steps, r.recipe.micro) == (1, 1, 0)
    r.step()
    assert r.ctx.get_value(counter) == 3.0 and r.ctx.get_value(r.opt.step_counter) == 2.0
    assert r.ctx.get_value(r.opt.lr_node) == np.float32(sched.lr_at(2))
    # the host gate sampled this step; the fused gate's open window keeps the last one's names
    assert r.recipe.last_overflow == (() if gate == "scaled" else ("mlp_w1",))


def test_the_fused_windows_names_are_sticky_over_the_window() -> None:
    r = Rigged("gated", "accumulate", check_interval=3)
    r.step(("mlp_w1", math.inf))
    r.step(("mlp_b0", math.nan))
    assert r.recipe.last_overflow == () and r.recipe.pending == 2  # not sampled yet
    seen = r.ctx.get_values(r.recipe.overflow_seen)
    assert seen.tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # w0 b0 w1 b1 w2 b2
    r.step()
    assert r.recipe.last_overflow == ("mlp_b0", "mlp_w1")  # loss.params order
    assert (r.recipe.applied_steps, r.recipe.skipped_steps) == (1, 2)
    for _ in range(3):
        r.step()
    assert r.recipe.last_overflow == () and r.recipe.windows == 2


@pytest.mark.parametrize("gate", ["scaled", "gated"])
def test_last_overflow_travels_in_the_recipe_state(gate: str) -> None:
    r = Rigged(gate, "accumulate")
    r.step()
    r.step(("mlp_b2", math.inf))
    s = r.recipe.save_state()
    assert s.endswith(" micro=0 overflow=mlp_b2")
    fresh = Rigged(gate, "accumulate")
    fresh.recipe.restore_state(s)
    assert fresh.recipe.last_overflow == ("mlp_b2",)
    assert fresh.recipe.save_state() == s
    for bad, why in ((s.replace("mlp_b2", "mlp_b9"), "none of this recipe's parameters"),
                     (s.replace("mlp_b2", "mlp_b2,mlp_b2"), "repeated"),
                     (s.replace("mlp_b2", "mlp%5Fb2"), "not encoded as save_state"),
                     (s.replace("mlp_b2", "mlp b2"), "not a")):
        with pytest.raises(Failure, match=why):
            fresh.recipe.restore_state(bad)
        assert fresh.recipe.last_overflow == ("mlp_b2",)


def test_names_of_any_characters_round_trip() -> None:
    T.set_seed(0)
    x = T.term(np.ones((4, 3)), label="x")
    y = T.term(np.eye(2)[[0, 1, 0, 1]], label="y")
    w = T.param("layer 1, w=%", output_dims=[2])
    loss = nn_blocks.softmax_cross_entropy(w @ x, y)
    recipe = gated_step(Loss_scaler.create(), loss, optim.SGD(0.1))
    assert recipe.param_names == ("layer 1, w=%",)
    recipe.last_overflow = recipe.param_names
    s = recipe.save_state()
    assert s.endswith(" overflow=layer%201%2C%20w%3D%25")
    other = gated_step(Loss_scaler.create(), loss, optim.SGD(0.1))
    other.restore_state(s)
    assert other.last_overflow == ("layer 1, w=%",)


def test_checksum_cells_flag_each_parameter_in_the_checksums_own_pass() -> None:
    rig = make_rig()
    flag, cells, comp = train.grad_checksum_by_param(rig.loss)
    for p in rig.params:  # each gradient read once: the cells cost no pass of their own
        assert sum(any(g.node is p.grad for g in reads(a.expr)) for a in comp.assignments) == 1
    ctx, grads = rig.ctx.compile(train.grad_update(rig.loss))
    ctx, check = ctx.compile(comp)
    ctx = ctx.run(grads).run(check)
    assert ctx.get_value(flag) == 0 and ctx.get_values(cells).tolist() == [0.0] * 6
    names = [p.value.label for p in rig.params]
    for name, value in (("mlp_w0", math.inf), ("mlp_w1", -math.inf), ("mlp_b2", math.nan)):
        ctx = ctx.run(grads)
        ctx = poison(ctx, rig.params[names.index(name)], value)
        ctx = ctx.run(check)
        got = ctx.get_values(cells)
        assert [n for n, c in zip(names, got, strict=True) if not math.isfinite(c)] == [name]
        assert not math.isfinite(ctx.get_value(flag))


_STATE = ("ocannl.GatedStep/3 pending=0 applied=3 skipped=1 windows=2 skipped_windows=1 "
          "micro=1 overflow=")
# micro=1: the state records that the gradient sums are in the checkpoint
_NEEDS = " needs=" + ",".join(f"grad_mlp_{w}{k}" for k in range(3) for w in "wb")


@settings(max_examples=200, deadline=None)
@example("%FF")  # not UTF-8 once decoded
@example("mlp_w1,mlp_b0")
@given(st.text(alphabet=st.sampled_from("ab_,%0123456789ABCDEFmlp.~- "), max_size=24))
def test_restore_of_any_overflow_field_only_fails_with_failure(field: str) -> None:
    """Any overflow field is restored or refused with ocannl.Failure (nothing else raised),
    and a refusal changes nothing."""
    recipe = _shared_recipe()
    recipe.restore_state(_STATE + "mlp_w0" + _NEEDS)
    try:
        recipe.restore_state(_STATE + field + _NEEDS)
    except Failure:
        assert recipe.last_overflow == ("mlp_w0",)
    else:
        assert set(recipe.last_overflow) <= set(recipe.param_names)
        assert recipe.save_state() == _STATE + field + _NEEDS


_RECIPES: list[Recipe] = []


def _shared_recipe() -> Recipe:
    if not _RECIPES:
        rig = make_rig()
        _RECIPES.append(gated_step(Loss_scaler.create(), rig.loss, optim.SGD(0.1),
                                   accumulate=2))
    return _RECIPES[0]
