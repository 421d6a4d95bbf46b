"""Mixed precision: the Loss_scaler against torch-AMP, the scaled and fused-gated steps, master
weights, and f16 / bf16 training parity with PyTorch's f32 run."""

from __future__ import annotations

import contextvars
import math
import re
import threading
import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from observed import observed

import ocannl.tensor as T
from ocannl import Context, Failure, checkpoint, datasets, nn_blocks, optim, train
from ocannl.ir.assignments import Get
from ocannl.ir.lowered import nodes_of
from ocannl.ir.tnode import MemoryMode
from ocannl.mixed_prec import (
    GatedStep,
    Loss_scaler,
    Recipe,
    ScaledStep,
    cast_param,
    gated_step,
    master_of,
    scaled_grad_update,
    scaled_step,
    with_master_weights,
)
from ocannl.tensor import tensor as tensor_mod

F32_MAX = float(np.finfo(np.float32).max)
FIELDS = ("scale", "unscale", "scale_val", "good_steps", "growth_factor", "backoff_factor",
          "growth_interval")
LR, MOMENTUM = 0.1, 0.9  # the example's: the same generated code, compiled once


def torch_reciprocal(s: float) -> float:
    """What torch's GradScaler multiplies gradients by: its f32 scale's reciprocal, in f32."""
    return torch.tensor(s, dtype=torch.float32).double().reciprocal().float().item()


def device_state(ctx: Context, sc: Loss_scaler) -> tuple[float, float]:
    return ctx.get_value(sc.scale), ctx.get_value(sc.unscale)


def host_state(sc: Loss_scaler) -> tuple:
    """The scaler's fields (its tensors' host arrays are their initial values: never written)."""
    return tuple(getattr(sc, f) for f in FIELDS)


def fresh_ctx(sc: Loss_scaler) -> Context:
    ctx = Context.cpu()
    ctx = ctx.from_host(sc.scale)
    return ctx.from_host(sc.unscale)


# --- the record --------------------------------------------------------------------------------


def test_fields_readable_not_assignable() -> None:
    sc = Loss_scaler.create()
    assert sc.scale_val == 65536.0 and sc.good_steps == 0
    assert (sc.growth_factor, sc.backoff_factor, sc.growth_interval) == (2.0, 0.5, 200)
    assert sc.scale_value() == Loss_scaler.scale_value(sc) == 65536.0
    for name in FIELDS:
        before = getattr(sc, name)
        with pytest.raises(AttributeError, match=name):
            setattr(sc, name, before)
        with pytest.raises(AttributeError):
            delattr(sc, name)
        assert getattr(sc, name) is before
    with pytest.raises(AttributeError):
        sc.extra_field = 1  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="create"):
        Loss_scaler()


def test_scale_tensors_are_data_backed_broadcastable_f32() -> None:
    sc = Loss_scaler.create(init_scale=3.0)
    for t, v in ((sc.scale, 3.0), (sc.unscale, float(np.float32(1 / 3)))):
        node = t.value
        assert node.dims == () and node.size == 1 and node.prec.value == "f32"
        assert node.memory_mode is MemoryMode.materialized and node.host_data is not None
        assert float(node.host_data) == v and t.const is None and t.forward_code == ()
        assert isinstance(train.scalar_expr(t, "s"), Get)  # read from its buffer, not a literal
    wide = T.term(np.ones((3, 4, 5)), label="wide")
    prod = wide * sc.scale
    assert prod.dims == (3, 4, 5)
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(prod))
    assert sc.scale.value in r.nodes
    ctx = ctx.run(r)
    assert np.all(ctx.get_values(prod) == 3.0)
    ctx = sc.set_scale(ctx, 5.0)
    assert np.all(ctx.run(r).get_values(prod) == 5.0)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"init_scale": 0.0}, "0.0"), ({"init_scale": -1.0}, "-1.0"),
    ({"init_scale": math.inf}, "inf"), ({"init_scale": math.nan}, "nan"),
    ({"init_scale": 1e39}, "1e+39"), ({"init_scale": 1e-50}, "1e-50"),
    ({"init_scale": "8"}, "'8'"), ({"init_scale": True}, "True"),
    ({"growth_factor": 1.0}, "1.0"), ({"growth_factor": 0.5}, "0.5"),
    ({"growth_factor": math.nan}, "nan"), ({"growth_factor": math.inf}, "inf"),
    ({"backoff_factor": 0.0}, "0.0"), ({"backoff_factor": 1.0}, "1.0"),
    ({"backoff_factor": -0.5}, "-0.5"), ({"backoff_factor": math.nan}, "nan"),
    ({"growth_interval": 0}, "0"), ({"growth_interval": -3}, "-3"),
    ({"growth_interval": 2.5}, "2.5"), ({"growth_interval": True}, "True"),
])
def test_create_rejects_out_of_range(kwargs: dict, named: str) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError) as err:
        Loss_scaler.create(**kwargs)
    assert name in str(err.value) and named in str(err.value)


def test_update_arguments_validated_state_unchanged() -> None:
    sc = Loss_scaler.create(growth_interval=3)
    ctx = fresh_ctx(sc)
    ctx = sc.update(ctx, grads_finite=True)
    before = host_state(sc), device_state(ctx, sc)
    for bad in ({"grads_finite": 1}, {"grads_finite": "yes"}, {"grads_finite": None}):
        with pytest.raises(ValueError, match="grads_finite"):
            sc.update(ctx, **bad)
    for steps in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=re.escape(repr(steps))):
            sc.update_n(ctx, grads_finite=True, steps=steps)
    for v in (-1.0, math.inf, math.nan, 1e39, "2"):
        with pytest.raises(ValueError, match="scale"):
            sc.set_scale(ctx, v)
    with pytest.raises(TypeError):
        sc.update(ctx, True)  # type: ignore[misc]  # labelled arguments are keyword-only
    assert (host_state(sc), device_state(ctx, sc)) == before


# --- the schedule against torch --------------------------------------------------------------

finite_pos = st.floats(min_value=1e-40, max_value=F32_MAX, allow_nan=False,
                       allow_infinity=False).filter(lambda v: np.float32(v) > 0)
schedules = st.fixed_dictionaries({
    "init_scale": finite_pos | st.sampled_from([65536.0, 1.0, 3.0e38, F32_MAX, 1e-45, 2.0**-126]),
    "growth_factor": st.floats(1.0, 1e6, exclude_min=True) | st.sampled_from([2.0, 1.5, 10.0]),
    "backoff_factor": st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)
    | st.sampled_from([0.5, 0.25, 1e-30]),
    "growth_interval": st.integers(1, 6),
})


def check_against_torch_op(params: dict, steps: list[bool]) -> Loss_scaler:
    sc = Loss_scaler.create(**params)
    ctx = fresh_ctx(sc)
    scale = torch.full((), params["init_scale"], dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    assert sc.scale_val == scale.item()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for ok in steps:
            hit_zero_before = sc.scale_val == 0.0
            ctx = sc.update(ctx, grads_finite=ok)
            torch._amp_update_scale_(scale, tracker, torch.tensor(0.0 if ok else 1.0),
                                     params["growth_factor"], params["backoff_factor"],
                                     params["growth_interval"])
            assert sc.scale_val == scale.item(), (sc, scale.item())
            assert sc.good_steps == tracker.item()
            s, u = device_state(ctx, sc)
            assert s == np.float32(sc.scale_val) == sc.scale_val
            assert u == torch_reciprocal(sc.scale_val)
            if sc.scale_val == 0.0:
                assert u == math.inf
                if not ok and not hit_zero_before:
                    assert any(issubclass(w.category, RuntimeWarning) for w in caught)
    zero_warnings = [w for w in caught if "backed off to 0" in str(w.message)]
    assert len(zero_warnings) == (1 if sc.scale_val == 0.0 else 0)
    return sc


@settings(max_examples=150, deadline=None)
@given(schedules, st.lists(st.booleans(), max_size=60))
@example({"init_scale": F32_MAX, "growth_factor": 2.0, "backoff_factor": 0.5,
          "growth_interval": 1}, [True] * 5 + [False] + [True] * 3)
@example({"init_scale": 2.0**-140, "growth_factor": 2.0, "backoff_factor": 0.5,
          "growth_interval": 2}, [False] * 12 + [True] * 6)
@example({"init_scale": 3.0e38, "growth_factor": 1.5, "backoff_factor": 0.9,
          "growth_interval": 1}, [True] * 4)
def test_schedule_matches_torch_amp_update_scale(params: dict, steps: list[bool]) -> None:
    check_against_torch_op(params, steps)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(0, 20), st.integers(100, 127))
def test_growth_to_f32_ceiling_and_backoff_to_zero(interval: int, wiggle: int,
                                                   exponent: int) -> None:
    up = [True] * (interval * (140 - exponent + 3) + wiggle)
    sc = check_against_torch_op({"init_scale": 2.0**exponent, "growth_factor": 2.0,
                                 "backoff_factor": 0.5, "growth_interval": interval}, up)
    assert sc.scale_val == 2.0**127  # the largest power of two below f32's ceiling
    down = [False] * (exponent + 160) + [True] * (3 * interval)
    sc = check_against_torch_op({"init_scale": 2.0**-exponent * 3, "growth_factor": 2.0,
                                 "backoff_factor": 0.5, "growth_interval": interval}, down)
    assert sc.scale_val == 0.0  # and it stays there


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1.0, 128.0, 65536.0, 2.0**24]), st.sampled_from([2.0, 3.0]),
       st.sampled_from([0.5, 0.25]), st.integers(1, 4), st.lists(st.booleans(), max_size=25))
def test_schedule_matches_grad_scaler(init: float, growth: float, backoff: float, interval: int,
                                      steps: list[bool]) -> None:
    """torch.amp.GradScaler itself, driving an SGD step whose gradients are made non-finite."""
    gs = torch.amp.GradScaler("cpu", init_scale=init, growth_factor=growth,
                              backoff_factor=backoff, growth_interval=interval)
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1e-3)
    sc = Loss_scaler.create(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                            growth_interval=interval)
    ctx = fresh_ctx(sc)
    for ok in steps:
        opt.zero_grad()
        gs.scale((w * (1.0 if ok else math.inf)).sum()).backward()
        gs.step(opt)
        gs.update()
        ctx = sc.update(ctx, grads_finite=ok)
        assert sc.scale_val == gs.get_scale()
        assert sc.good_steps == int(gs._growth_tracker)
        assert device_state(ctx, sc) == (gs.get_scale(), torch_reciprocal(gs.get_scale()))


def test_backoff_to_zero_warns_once_per_scaler() -> None:
    for _ in range(2):
        sc = Loss_scaler.create(init_scale=2.0**-140, backoff_factor=0.5)
        ctx = fresh_ctx(sc)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(20):
                ctx = sc.update(ctx, grads_finite=False)
            ctx = sc.update_n(ctx, grads_finite=False, steps=3)
        assert sc.scale_val == 0.0 and device_state(ctx, sc) == (0.0, math.inf)
        assert [w.category for w in caught] == [RuntimeWarning]
        assert "no step can succeed" in str(caught[0].message)


# --- update_n --------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(check=st.integers(1, 40), interval=st.integers(1, 40), init_exp=st.integers(-20, 120),
       windows=st.lists(st.booleans(), max_size=30), growth=st.sampled_from([2.0, 1.5, 4.0]))
def test_update_n_cadence(check: int, interval: int, init_exp: int, windows: list[bool],
                          growth: float) -> None:
    """A finite window of ``check`` steps is ``check`` per-step good steps (growth up to the f32
    ceiling and the remainder included); a non-finite window is one backoff and a cleared count."""
    params = {"init_scale": 2.0**init_exp, "growth_factor": growth, "growth_interval": interval}
    sc = Loss_scaler.create(**params)
    ctx = fresh_ctx(sc)
    ref = Loss_scaler.create(**params)
    ref_ctx = fresh_ctx(ref)
    scale = torch.full((), 2.0**init_exp, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    for finite in windows:
        ctx = sc.update_n(ctx, grads_finite=finite, steps=check)
        if finite:
            for _ in range(check):
                ref_ctx = ref.update(ref_ctx, grads_finite=True)
                torch._amp_update_scale_(scale, tracker, torch.tensor(0.0), growth, 0.5,
                                         interval)
        else:
            ref_ctx = ref.update(ref_ctx, grads_finite=False)
            torch._amp_update_scale_(scale, tracker, torch.tensor(1.0), growth, 0.5, interval)
            assert sc.good_steps == 0
        assert (sc.scale_val, sc.good_steps) == (ref.scale_val, ref.good_steps)
        assert (sc.scale_val, sc.good_steps) == (scale.item(), tracker.item())
        assert device_state(ctx, sc) == device_state(ref_ctx, ref)


def test_update_n_keeps_remainder() -> None:
    sc = Loss_scaler.create(init_scale=1.0, growth_interval=10)
    ctx = fresh_ctx(sc)
    ctx = sc.update_n(ctx, grads_finite=True, steps=16)
    assert (sc.scale_val, sc.good_steps) == (2.0, 6)
    ctx = sc.update_n(ctx, grads_finite=True, steps=16)  # 22 credited: two growths
    assert (sc.scale_val, sc.good_steps) == (8.0, 2)
    ctx = sc.update_n(ctx, grads_finite=True, steps=35)  # 37: three
    assert (sc.scale_val, sc.good_steps) == (64.0, 7)
    ctx = sc.update_n(ctx, grads_finite=True, steps=0)
    assert (sc.scale_val, sc.good_steps) == (64.0, 7)
    ctx = sc.update_n(ctx, grads_finite=False, steps=16)  # one backoff, however long
    assert (sc.scale_val, sc.good_steps) == (32.0, 0)
    assert device_state(ctx, sc) == (32.0, 1 / 32)


# --- save_state / restore_state ---------------------------------------------------------------


def test_save_state_format_and_round_trip() -> None:
    sc = Loss_scaler.create(init_scale=3.0, growth_factor=1.5, backoff_factor=0.3,
                            growth_interval=7)
    ctx = fresh_ctx(sc)
    for ok in (True, True, False, True, True, True):
        ctx = sc.update(ctx, grads_finite=ok)
    s = sc.save_state()
    assert "\n" not in s and "\r" not in s and s.startswith("ocannl.Loss_scaler/1 ")
    fields = dict(kv.split("=") for kv in s.split()[1:])
    assert float.fromhex(fields["scale"]) == sc.scale_val
    assert float.fromhex(fields["growth_factor"]) == 1.5
    assert float.fromhex(fields["backoff_factor"]) == 0.3
    assert int(fields["good_steps"]) == sc.good_steps == 3
    assert int(fields["growth_interval"]) == 7
    again = Loss_scaler.create(growth_factor=1.5, backoff_factor=0.3, growth_interval=7)
    ctx2 = fresh_ctx(again)
    ctx2 = again.restore_state(ctx2, s)
    assert host_state(again)[2:] == host_state(sc)[2:]
    assert device_state(ctx2, again) == device_state(ctx, sc)
    assert again.save_state() == s


@pytest.mark.parametrize(("kwargs", "param", "saved", "mine"), [
    ({"growth_factor": 3.0}, "growth_factor", "2.0", "3.0"),
    ({"backoff_factor": 0.25}, "backoff_factor", "0.5", "0.25"),
    ({"growth_interval": 100}, "growth_interval", "200", "100"),
])
def test_restore_state_refuses_another_schedule(kwargs: dict, param: str, saved: str,
                                                mine: str) -> None:
    s = Loss_scaler.create().save_state()
    sc = Loss_scaler.create(init_scale=8.0, **kwargs)
    ctx = fresh_ctx(sc)
    before = host_state(sc), device_state(ctx, sc)
    with pytest.raises(Failure) as err:
        sc.restore_state(ctx, s)
    msg = str(err.value)
    assert f"{param}={saved}" in msg and f"{param}={mine}" in msg
    assert (host_state(sc), device_state(ctx, sc)) == before


@pytest.mark.parametrize("s", [
    "", "ocannl.Loss_scaler/2 scale=0x1.0000000000000p+16 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000001p+0 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=-0x1.0000000000000p+0 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+9999 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+0 good_steps=200 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+0 good_steps=٣ growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+0 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200\n",
    None, b"ocannl.Loss_scaler/1", 3.5,
])
def test_restore_state_rejects(s: object) -> None:
    sc = Loss_scaler.create(init_scale=8.0)
    ctx = fresh_ctx(sc)
    before = host_state(sc), device_state(ctx, sc)
    with pytest.raises(Failure):
        sc.restore_state(ctx, s)  # type: ignore[arg-type]
    assert (host_state(sc), device_state(ctx, sc)) == before


@pytest.mark.parametrize("version", ["0", "2", "17"])
def test_restore_state_refuses_another_format_version_naming_it(version: str) -> None:
    """A state line of another format version is refused by its version, whatever follows it
    (an older layout of fields too), and nothing changes."""
    good = Loss_scaler.create().save_state()
    sc = Loss_scaler.create(init_scale=8.0)
    ctx = fresh_ctx(sc)
    before = host_state(sc), device_state(ctx, sc)
    for s in (good.replace("Loss_scaler/1 ", f"Loss_scaler/{version} "),
              f"ocannl.Loss_scaler/{version} scale=0x1.0000000000000p+16 good=0",
              f"ocannl.Loss_scaler/{version}"):
        with pytest.raises(Failure, match=rf"format ocannl\.Loss_scaler/{version}, which this "
                                          rf"version does not read: expected format version 1"):
            sc.restore_state(ctx, s)
        assert (host_state(sc), device_state(ctx, sc)) == before


def _reads_the_scale(sc: Loss_scaler) -> T.Tensor:
    return T.term(np.ones(2), label="probe") * sc.scale * sc.unscale


def test_a_scale_written_in_one_context_does_not_reach_another() -> None:
    """The scaler writes its scale into the context it is given, and nowhere else: a context
    that allocates the scale tensors later starts from their initial value (a recipe compiled
    there then writes the scaler's current scale through set_scale)."""
    sc = Loss_scaler.create(init_scale=1024.0)
    first = fresh_ctx(sc)
    first = sc.set_scale(first, 8.0)
    first = sc.update(first, grads_finite=False)  # backs off to 4 in the first context
    assert device_state(first, sc) == (4.0, 0.25) and sc.scale_value() == 4.0
    second, probe = Context.cpu().compile(train.forward(_reads_the_scale(sc)))
    assert device_state(second, sc) == (1024.0, 1 / 1024)  # not 4.0, the first's
    assert float(sc.scale.value.host_data) == 1024.0
    assert float(sc.unscale.value.host_data) == 1 / 1024
    assert device_state(first, sc) == (4.0, 0.25)
    rig = make_rig()
    recipe = scaled_step(sc, rig.loss, sgd())
    rig.ctx = recipe.compile(rig.ctx)  # the recipe's context follows the scaler: set_scale
    assert device_state(rig.ctx, sc) == (4.0, 0.25)
    third = fresh_ctx(sc)
    assert device_state(third, sc) == (1024.0, 1 / 1024)


@dataclass
class _Shared:
    sc: Loss_scaler
    ctx: Context


_SHARED: list[_Shared] = []


def shared_scaler() -> _Shared:
    if not _SHARED:
        sc = Loss_scaler.create(init_scale=3.0, growth_interval=5)
        ctx = fresh_ctx(sc)
        for ok in (True, True, False, True, True):
            ctx = sc.update(ctx, grads_finite=ok)
        _SHARED.append(_Shared(sc, ctx))
    return _SHARED[0]


def check_restore(s: str) -> None:
    sh = shared_scaler()
    original = sh.sc.save_state()
    before = host_state(sh.sc), device_state(sh.ctx, sh.sc)
    try:
        sh.ctx = sh.sc.restore_state(sh.ctx, s)
    except Failure:
        assert (host_state(sh.sc), device_state(sh.ctx, sh.sc)) == before
        return
    # Accepted: then it was exactly an encoding save_state writes, and it was applied.
    assert sh.sc.save_state() == s
    assert device_state(sh.ctx, sh.sc) == (sh.sc.scale_val, torch_reciprocal(sh.sc.scale_val))
    sh.ctx = sh.sc.restore_state(sh.ctx, original)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_restore_state_arbitrary_strings_only_fail(s: str) -> None:
    check_restore(s)


valid_states = st.builds(
    lambda scale, good: (f"ocannl.Loss_scaler/1 scale={scale.hex()} good_steps={good} "
                         f"growth_factor={(2.0).hex()} backoff_factor={(0.5).hex()} "
                         f"growth_interval=5"),
    st.floats(0, F32_MAX, width=32).map(abs), st.integers(0, 4))


@st.composite
def mutated_states(draw: st.DrawFn) -> str:
    s = draw(valid_states)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(s)))
        j = draw(st.integers(i, min(len(s), i + 12)))
        op = draw(st.sampled_from(["delete", "insert", "replace", "dup", "swapcase", "digit"]))
        if op == "delete":
            s = s[:i] + s[j:]
        elif op == "insert":
            s = s[:i] + draw(st.text(max_size=6)) + s[i:]
        elif op == "replace":
            s = s[:i] + draw(st.text(min_size=1, max_size=3)) + s[j:]
        elif op == "dup":
            s = s[:j] + s[i:j] + s[j:]
        elif op == "swapcase":
            s = s[:i] + s[i:j].swapcase() + s[j:]
        else:
            s = s[:i] + draw(st.sampled_from("0123456789abcdefp+-.x ")) + s[i + 1:]
    return s


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_states())
def test_restore_state_mutated_encodings_only_fail(s: str) -> None:
    check_restore(s)


@settings(max_examples=60, deadline=None)
@given(valid_states)
def test_restore_state_accepts_every_valid_state(s: str) -> None:
    sc = Loss_scaler.create(growth_interval=5)
    ctx = fresh_ctx(sc)
    ctx = sc.restore_state(ctx, s)
    assert sc.save_state() == s
    assert device_state(ctx, sc) == (sc.scale_val, torch_reciprocal(sc.scale_val))


# --- training rigs ------------------------------------------------------------------------------


@dataclass
class Rig:
    x: T.Tensor
    y: T.Tensor
    logits: T.Tensor
    loss: T.Tensor
    points: np.ndarray
    targets: np.ndarray
    ctx: Context


def make_rig(prec: str = "f16", seed: int = 0) -> Rig:
    """The example's model (same generated code): f16 (or bf16) twins of f32 masters over a
    64-point half-moons batch, f32 softmax cross-entropy."""
    T.set_seed(seed)
    points, labels = datasets.half_moons(64, seed=seed)
    targets = datasets.one_hot(labels, 2)
    x = T.term(np.zeros((64, 2)), label="x", prec=prec)
    y = T.term(np.zeros((64, 2)), label="y")
    logits, _ = with_master_weights(prec=prec, f=lambda: nn_blocks.mlp(x, [16, 16], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    ctx = train.init_params(Context.cpu(), loss)
    ctx = ctx.set_values(x, points).set_values(y, targets)
    return Rig(x, y, logits, loss, points, targets, ctx)


def sgd() -> optim.SGD:
    return optim.SGD(LR, momentum=MOMENTUM)


def state_nodes(loss: T.Tensor, opt: optim.Optimizer) -> list:
    return checkpoint.training_state(loss, opt)


def snapshot(ctx: Context, nodes: list) -> list[bytes]:
    return [ctx.get_values(n).tobytes() for n in nodes]


def host_recipe(rig: Rig, sc: Loss_scaler, opt: optim.Optimizer | None = None) -> ScaledStep:
    recipe = scaled_step(sc, rig.loss, sgd() if opt is None else opt)
    rig.ctx = recipe.compile(rig.ctx)
    return recipe


def fused_recipe(rig: Rig, sc: Loss_scaler, check_interval: int,
                 opt: optim.Optimizer | None = None) -> GatedStep:
    recipe = gated_step(sc, rig.loss, sgd() if opt is None else opt,
                        check_interval=check_interval)
    rig.ctx = recipe.compile(rig.ctx)
    return recipe


def test_set_scale_reaches_compiled_routine_without_recompiling() -> None:
    rig = make_rig()
    rig.loss.retain_grad()  # read below: the seed is the scale
    sc = Loss_scaler.create(init_scale=1024.0)
    rig.ctx, grad_routine = rig.ctx.compile(scaled_grad_update(sc, rig.loss)[1])
    masters = rig.loss.params
    ctx = rig.ctx.run(grad_routine)
    g1 = [ctx.get_values(p.grad) for p in masters]
    assert all(np.any(g != 0) for g in g1)
    count = ctx.compile_count
    ctx = sc.set_scale(ctx, 2048.0)
    ctx = ctx.run(grad_routine)  # the same routine object
    g2 = [ctx.get_values(p.grad) for p in masters]
    assert ctx.compile_count == count
    assert ctx.get_value(rig.loss.grad) == 2048.0
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_array_equal(b, 2 * a)  # f16 scaling by 2 is exact here
    ctx = sc.set_scale(ctx, 256.0)
    ctx = ctx.run(grad_routine)
    assert ctx.compile_count == count
    for a, p in zip(g1, masters, strict=True):
        np.testing.assert_allclose(ctx.get_values(p.grad), a / 4, rtol=2e-3, atol=1e-6)


def bad_batch(points: np.ndarray, kind: str) -> np.ndarray:
    xb = points.copy()
    xb[5, 1] = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan, "overflow": 6e4}[kind]
    return xb


@pytest.mark.parametrize("kind", ["nan", "inf", "overflow"])
def test_host_gate_skips_nonfinite_step_bit_exactly(kind: str) -> None:
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=1024.0)
    recipe = host_recipe(rig, sc)
    ctx = rig.ctx
    for _ in range(2):
        ctx = recipe.step(ctx)
        assert recipe.last_applied
    nodes = state_nodes(rig.loss, recipe.optimizer)
    before = snapshot(ctx, nodes)
    assert any(np.any(ctx.get_values(n) != 0) for n in nodes[len(nodes) // 2:])  # momentum
    ctx = ctx.set_values(rig.x, bad_batch(rig.points, kind))
    ctx = recipe.step(ctx)
    assert recipe.last_applied is False and not math.isfinite(ctx.get_value(recipe.checksum))
    assert any(not np.all(np.isfinite(ctx.get_values(p.grad))) for p in rig.loss.params)
    assert snapshot(ctx, nodes) == before
    assert (sc.scale_val, sc.good_steps) == (512.0, 0)
    assert device_state(ctx, sc) == (512.0, 1 / 512)
    assert (recipe.applied_steps, recipe.skipped_steps, recipe.pending) == (2, 1, 0)
    assert (recipe.windows, recipe.skipped_windows) == (3, 1)
    ctx = ctx.set_values(rig.x, rig.points)
    ctx = recipe.step(ctx)
    assert recipe.last_applied and snapshot(ctx, nodes) != before
    assert recipe.flush(ctx) is ctx and recipe.state_nodes() == []


def test_scale_backed_off_to_zero_skips_every_step() -> None:
    """With scale 0 the gradients are 0 and the reciprocal inf: the check on unscaled gradients
    (as torch's) skips the step rather than writing 0 * inf = NaN into the weights."""
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=1024.0)
    recipe = host_recipe(rig, sc)
    ctx = sc.set_scale(rig.ctx, 0.0)
    nodes = state_nodes(rig.loss, recipe.optimizer)
    before = snapshot(ctx, nodes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            ctx = recipe.step(ctx)
            assert recipe.last_applied is False
    assert snapshot(ctx, nodes) == before and sc.scale_val == 0.0


@pytest.mark.parametrize("kind", ["nan", "inf", "overflow"])
def test_fused_gate_skips_nonfinite_step_bit_exactly(kind: str) -> None:
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=1024.0, growth_interval=200)
    gs = fused_recipe(rig, sc, 5)
    ctx = rig.ctx
    nodes = state_nodes(rig.loss, gs.optimizer)
    for _ in range(2):
        ctx = gs.step(ctx)
    assert gs.pending == 2 and ctx.get_value(gs.nonfinite_seen) == 0.0
    assert gs.last_applied is None  # the host does not know before it samples
    before = snapshot(ctx, nodes)
    ctx = ctx.set_values(rig.x, bad_batch(rig.points, kind))
    ctx = gs.step(ctx)
    assert snapshot(ctx, nodes) == before  # parameters and momentum bit-unchanged
    assert not math.isfinite(ctx.get_value(gs.checksum))
    assert ctx.get_value(gs.nonfinite_seen) == 1.0 and sc.scale_val == 1024.0  # not sampled yet
    ctx = ctx.set_values(rig.x, rig.points)
    ctx = gs.step(ctx)  # a good step: applied, and the count stays
    after_good = snapshot(ctx, nodes)
    assert after_good != before and ctx.get_value(gs.nonfinite_seen) == 1.0
    ctx = gs.step(ctx)  # the fifth: the window closes
    assert gs.pending == 0 and gs.skipped_windows == 1 and gs.windows == 1
    assert (gs.applied_steps, gs.skipped_steps) == (4, 1)
    assert (sc.scale_val, sc.good_steps) == (512.0, 0)
    assert device_state(ctx, sc) == (512.0, 1 / 512)
    assert ctx.get_value(gs.nonfinite_seen) == 0.0


def test_fused_gate_counts_every_skipped_step_of_a_window() -> None:
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=1024.0)
    gs = fused_recipe(rig, sc, 4)
    ctx = rig.ctx
    for step in range(6):
        ctx = ctx.set_values(rig.x, bad_batch(rig.points, "nan") if step in (0, 2, 3)
                             else rig.points)
        ctx = gs.step(ctx)
    assert ctx.get_value(gs.nonfinite_seen) == 0.0 and gs.pending == 2
    assert (gs.applied_steps, gs.skipped_steps, gs.windows, gs.skipped_windows) == (1, 3, 1, 1)
    ctx = gs.flush(ctx)
    assert (gs.applied_steps, gs.skipped_steps, gs.windows, gs.skipped_windows) == (3, 3, 2, 1)
    assert gs.flush(ctx) is ctx and gs.windows == 2  # nothing pending: nothing sampled


def test_fused_windows_grow_like_the_per_step_schedule() -> None:
    rig = make_rig()
    sc = Loss_scaler.create(init_scale=64.0, growth_interval=4)
    gs = fused_recipe(rig, sc, 3)
    ctx = rig.ctx
    seen = []
    for _ in range(14):
        ctx = gs.step(ctx)
        seen.append((sc.scale_val, sc.good_steps))
    # windows end after steps 3, 6, 9, 12: credited 3, 6 -> grow (2 left), 5 -> grow (1), 4 -> grow
    assert seen[2] == (64.0, 3) and seen[5] == (128.0, 2) and seen[8] == (256.0, 1)
    assert seen[11] == (512.0, 0) and seen[13] == (512.0, 0) and gs.pending == 2
    ctx = gs.flush(ctx)
    assert (sc.scale_val, sc.good_steps, gs.pending) == (512.0, 2, 0)


def test_fused_with_interval_one_equals_host_recipe() -> None:
    """The fused routine, sampled every step, takes exactly the host recipe's steps."""
    bad_steps = {3, 4, 9}
    results = []
    for recipe_kind in ("host", "fused"):
        rig = make_rig()
        sc = Loss_scaler.create(init_scale=2.0**17, growth_interval=3)
        recipe: Recipe = host_recipe(rig, sc) if recipe_kind == "host" else \
            fused_recipe(rig, sc, 1)
        ctx, trace = rig.ctx, []
        for step in range(14):
            xb = bad_batch(rig.points, "nan") if step in bad_steps else rig.points
            ctx = ctx.set_values(rig.x, xb)
            ctx = recipe.step(ctx)
            trace.append((sc.scale_val, sc.good_steps, ctx.get_values(rig.loss).tobytes()))
        counters = (recipe.applied_steps, recipe.skipped_steps, recipe.windows,
                    recipe.skipped_windows)
        results.append((trace, counters,
                        snapshot(ctx, state_nodes(rig.loss, recipe.optimizer))))
    assert results[0] == results[1]
    assert results[0][1] == (11, 3, 14, 3)
    scales = [s for s, _, _ in results[0][0]]
    assert len(set(scales)) > 2  # it both grew and backed off


def test_recipes_go_through_context_run_and_the_scalers_public_schedule() -> None:
    """Every routine of every step runs through Context.run, and the scale moves through
    Loss_scaler.update / update_n: what a context or a scaler of one's own sees, the recipe
    does (no direct Routine.call, no private schedule)."""
    SeenContext, SeenScaler, runs, updates = observed()

    for build, steps in ((scaled_step, 5), (lambda *a: gated_step(*a, check_interval=2), 6)):
        rig = make_rig()
        ctx = SeenContext.cpu()
        ctx = train.init_params(ctx, rig.loss)
        ctx = ctx.set_values(rig.x, rig.points).set_values(rig.y, rig.targets)
        runs.clear()
        updates.clear()
        recipe = build(SeenScaler.create(), rig.loss, sgd())
        ctx = recipe.compile(ctx)
        for _ in range(steps):
            ctx = recipe.step(ctx)
        assert recipe.skipped_steps == 0 and recipe.applied_steps == steps
        if isinstance(recipe, ScaledStep):
            assert runs == [recipe.grad_comp.label, recipe.update_comp.label] * steps
            assert updates == [("update", True)] * steps
        else:
            assert runs == [recipe.comp.label] * steps
            assert updates == [("update_n", True, 2)] * (steps // 2)


def test_the_host_gates_steady_path_takes_the_general_paths_steps() -> None:
    """The host gate's every-step path (the library's own context and scaler: lookups made
    once, their steady states inline) against the general one (a context and a scaler of
    one's own, every call through them): the same losses, scales, counters and state bits,
    through skipped steps, growth, and a master written between steps (its kept twin is recast
    before the next read)."""
    SeenContext, SeenScaler, _, _ = observed()
    bad_steps, master_written = {3, 4, 9}, 6
    results = []
    for own in (False, True):
        rig = make_rig()
        sc = (SeenScaler if own else Loss_scaler).create(init_scale=2.0**17, growth_interval=3)
        ctx = rig.ctx
        if own:
            ctx = train.init_params(SeenContext.cpu(), rig.loss)
            ctx = ctx.set_values(rig.x, rig.points).set_values(rig.y, rig.targets)
            rig.ctx = ctx
        recipe = host_recipe(rig, sc)
        ctx, trace = rig.ctx, []
        for step in range(14):
            xb = bad_batch(rig.points, "nan") if step in bad_steps else rig.points
            ctx = ctx.set_values(rig.x, xb)
            if step == master_written:
                p = rig.loss.params[0]
                ctx = ctx.set_values(p, ctx.get_values(p) * np.float32(0.5))
            ctx = recipe.step(ctx)
            assert (recipe._steady is None) is own  # armed by the first step
            if not own:  # and on the CPU its routines and the checksum's test are one call
                assert ctx._gated(recipe._grads, recipe._update, recipe.checksum) is not None
            trace.append((sc.scale_val, sc.good_steps, recipe.last_applied,
                          recipe.last_overflow, ctx.get_values(rig.loss).tobytes()))
        counters = (recipe.applied_steps, recipe.skipped_steps, recipe.windows,
                    recipe.skipped_windows, recipe.pending)
        results.append((trace, counters, device_state(ctx, sc),
                        snapshot(ctx, state_nodes(rig.loss, recipe.optimizer))))
    assert results[0] == results[1]
    assert results[0][1] == (11, 3, 14, 3, 0)
    scales = [s for s, *_ in results[0][0]]
    assert len(set(scales)) > 2  # it both grew and backed off
    assert [t[3] != () for t in results[0][0]] == [s in bad_steps for s in range(14)]


def test_recipe_validation_and_state() -> None:
    rig = make_rig()
    sc = Loss_scaler.create()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="check_interval"):
            gated_step(sc, rig.loss, sgd(), check_interval=bad)
    with pytest.raises(TypeError, match="Loss_scaler"):
        gated_step(object(), rig.loss, sgd())  # type: ignore[arg-type]
    for build in (scaled_step, gated_step):
        with pytest.raises(TypeError, match="ocannl.optim optimizer"):
            build(sc, rig.loss, {"learning_rate": LR})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="loss Tensor"):
            build(sc, "loss", sgd())  # type: ignore[arg-type]
    gs = gated_step(sc, rig.loss, sgd(), check_interval=4)
    with pytest.raises(ValueError, match="compile"):
        gs.step(rig.ctx)  # not compiled yet
    gs.pending, gs.applied_steps, gs.skipped_steps = 3, 40, 5
    gs.windows, gs.skipped_windows = 11, 2
    s = gs.save_state()
    assert s == ("ocannl.GatedStep/3 pending=3 applied=40 skipped=5 windows=11 skipped_windows=2 "
                 f"micro=0 overflow= needs=nonfinite_seen_{rig.loss.value.label},"
                 f"overflow_seen_{rig.loss.value.label}")
    gs.pending = gs.applied_steps = gs.skipped_steps = gs.windows = gs.skipped_windows = 0
    gs.restore_state(s)
    assert (gs.pending, gs.applied_steps, gs.skipped_steps, gs.windows,
            gs.skipped_windows) == (3, 40, 5, 11, 2)
    for old in ("ocannl.GatedStep/1 pending=2", "ocannl.GatedStep/1 pending=0",
                "ocannl.GatedStep/2 pending=0 applied=0 skipped=0 windows=0 skipped_windows=0",
                "ocannl.GatedStep/4 pending=0 applied=0 skipped=0 windows=0 skipped_windows=0 "
                "micro=0 overflow="):
        version = old.split()[0].split("/")[1]
        with pytest.raises(Failure, match=rf"format ocannl\.GatedStep/{version}, which this "
                                          rf"version does not read: expected format version 3"):
            gs.restore_state(old)  # the first format held a position only: superseded
        assert (gs.pending, gs.applied_steps, gs.skipped_steps, gs.windows,
                gs.skipped_windows) == (3, 40, 5, 11, 2)
    for bad_state in ("ocannl.GatedStep/1 pending=4", "pending=1", "", None,
                      s.replace("pending=3", "pending=4"),
                      s.replace("skipped_windows=2", "skipped_windows=12"),
                      s.replace("GatedStep", "ScaledStep")):
        with pytest.raises(Failure):
            gs.restore_state(bad_state)  # type: ignore[arg-type]
        assert (gs.pending, gs.applied_steps) == (3, 40)
    assert gs.state_nodes() == [gs.nonfinite_seen.value, gs.overflow_seen]
    host = scaled_step(sc, rig.loss, sgd())
    assert host.save_state() == ("ocannl.ScaledStep/3 pending=0 applied=0 skipped=0 windows=0 "
                                 "skipped_windows=0 micro=0 overflow=")
    with pytest.raises(Failure, match="check_interval=1"):
        host.restore_state(s.replace("GatedStep", "ScaledStep"))  # pending=3: past its window
    at_zero = s.replace("GatedStep", "ScaledStep").replace("pending=3", "pending=0")
    with pytest.raises(Failure, match=r"needs nonfinite_seen_.*, expected needs=\(none\)"):
        host.restore_state(at_zero)  # the fused gate's nodes: none of the host gate's
    host.restore_state(at_zero.split(" needs=")[0])
    assert (host.applied_steps, host.skipped_steps) == (40, 5)
    other = Context.cpu()
    rig.ctx = host.compile(rig.ctx)
    with pytest.raises(ValueError, match="compiled on"):
        host.step(other)


def test_a_save_inside_a_window_without_the_gates_nodes_is_refused(tmp_path) -> None:
    """Two steps into a window of 4, the fused gate's skip count and flags are part of the
    position: its state says so (``needs=``), and a save without ``recipe.state_nodes()`` is
    refused naming them, writing nothing."""
    rig = make_rig()
    opt = sgd()
    gs = gated_step(Loss_scaler.create(), rig.loss, opt, check_interval=4)
    ctx = gs.compile(rig.ctx)
    for _ in range(2):
        ctx = gs.step(ctx)
    gate = [gs.nonfinite_seen.value.label, gs.overflow_seen.label]
    progress = checkpoint.Progress(step=2, extra={"recipe": gs.save_state()})
    with pytest.raises(Failure) as err:
        checkpoint.save(tmp_path / "c", ctx, checkpoint.training_state(rig.loss, opt), progress)
    assert f"extra['recipe'] needs {gate}, which this save does not hold" in str(err.value)
    assert list(tmp_path.iterdir()) == []
    checkpoint.save(tmp_path / "c", ctx, checkpoint.training_state(rig.loss, opt)
                    + gs.state_nodes(), progress)


# --- master weights -----------------------------------------------------------------------------


def test_master_weights_twins_and_masters() -> None:
    rig = make_rig()
    masters = rig.loss.params
    assert [p.label for p in masters] == [f"mlp_{k}{i}" for i in range(3) for k in "wb"]
    assert all(p.kind == "param" and p.prec.value == "f32" for p in masters)
    assert all(p.grad is not None and p.grad.prec.value == "f32" for p in masters)
    twins = [t for t in rig.loss.topo() if t.master is not None]
    assert len(twins) == len(masters)
    for tw in twins:
        assert tw.prec.value == "f16" and tw.grad.prec.value == "f16"
        assert tw.dims == master_of(tw).dims and master_of(tw) in masters
    assert tensor_mod.active_param_postprocess.get() is tensor_mod._no_postprocess  # reset
    nodes = checkpoint.training_state(rig.loss, sgd())
    assert {n.prec.value for n in nodes} == {"f32"}
    assert not {tw.value.id for tw in twins} & {n.id for n in nodes}


def test_twin_gradients_accumulate_into_f32_master() -> None:
    # f16-exact values: the sum the twin's gradient holds is then the same in either order
    a = T.term(np.array([[0.125, -2.0, 3.0]]), label="a")
    b = T.term(np.array([[1.0, 0.25, -(2.0**-10)]]), label="b")
    tw = with_master_weights(prec="f16", f=lambda: T.param(  # read below: materialized
        "p", output_dims=[3], input_dims=(), init="uniform"), placement="materialized")
    p = master_of(tw)
    loss = T.sum(tw * a) + T.sum(tw * b)  # two uses of the one twin
    assert loss.params == [p]
    tw.retain_grad()  # an intermediate tensor's gradient: read below
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(train.grad_update(loss))
    ctx = ctx.run(r)
    twin_grad = ctx.get_values(tw.grad)
    assert twin_grad.dtype == np.float16
    expected = [1.125, -1.75, 3.0]  # 3 - 2**-10 is an f16 tie, rounded to even
    np.testing.assert_array_equal(twin_grad.reshape(-1), np.array(expected, np.float16))
    np.testing.assert_array_equal(ctx.get_values(p.grad), twin_grad.astype(np.float32))
    np.testing.assert_array_equal(ctx.get_values(tw), ctx.get_values(p).astype(np.float16))


def test_twins_are_declared_tensor_fields_and_the_postprocess_is_context_local() -> None:
    plain = T.param("plain_p", output_dims=[2], input_dims=())
    assert plain.master is None and master_of(plain) is plain
    seen: list = []
    elsewhere: list = []

    def build() -> T.Tensor:
        seen.append(tensor_mod.active_param_postprocess.get())
        # a thread starts in its own context: the hook does not leak into it
        worker = threading.Thread(target=lambda: elsewhere.append(
            T.param("in_thread", output_dims=[1], input_dims=())))
        worker.start()
        worker.join()
        return T.param("open", output_dims=[3])  # input axes left to inference

    before = contextvars.copy_context()
    tw = with_master_weights(prec="bf16", f=build)
    assert seen[0] is not tensor_mod._no_postprocess
    assert elsewhere[0].kind == "param" and elsewhere[0].master is None
    assert before.run(tensor_mod.active_param_postprocess.get) is tensor_mod._no_postprocess
    assert tensor_mod.active_param_postprocess.get() is tensor_mod._no_postprocess
    p = master_of(tw)
    assert tw.master is p and p.master is None and p.kind == "param"
    # An open master's twin shares its rows (on_input_inferred, the hook that completed the
    # master at the twin's first `@`, gave way to the shared inference): the twin's use fixes
    # both.
    assert tw.sym is p.sym and tw.value.dims_if_known is None
    out = tw @ T.term(np.ones((4, 5)), label="x5")
    assert p.dims == tw.dims == (3, 5) and p.grad.dims == (3, 5)
    assert out.params == [p]
    with pytest.raises(TypeError, match="master_of expects a Tensor"):
        master_of("w")  # type: ignore[arg-type]


def test_cast_param_and_with_master_weights_errors() -> None:
    p = T.param("p", output_dims=[2], input_dims=(2,))
    with pytest.raises(ValueError, match="placement 'nowhere'"):
        cast_param(p, prec="f16", placement="nowhere")
    with pytest.raises(ValueError, match="precision"):
        cast_param(p, prec="f8")
    narrow = T.param("narrow", output_dims=[2], input_dims=(2,), prec="f16")
    with pytest.raises(ValueError, match="f32 or f64"):
        cast_param(narrow, prec="bf16")
    twin = cast_param(p, prec="bf16", placement="materialized")
    with pytest.raises(ValueError, match="twin"):
        cast_param(twin, prec="f16")
    data = T.term(np.ones(2), label="d")
    assert cast_param(data, prec="f16") is data  # not differentiable: unchanged

    def boom() -> None:
        T.param("q", output_dims=[1], input_dims=())
        raise RuntimeError("model construction failed")

    with pytest.raises(RuntimeError):
        with_master_weights(prec="f16", f=boom)
    assert tensor_mod.active_param_postprocess.get() is tensor_mod._no_postprocess
    assert T.param("plain", output_dims=[1], input_dims=()).kind == "param"


# --- parity with PyTorch f32 ------------------------------------------------------------------


def torch_losses(rig: Rig, steps: int) -> list[float]:
    """PyTorch's f32 run of the same model from the same weights on the same batch."""
    ws = [torch.tensor(rig.ctx.get_values(p), dtype=torch.float32, requires_grad=True)
          for p in rig.loss.params]
    opt = torch.optim.SGD(ws, lr=LR, momentum=MOMENTUM)
    xb = torch.tensor(rig.points, dtype=torch.float32)
    yb = torch.tensor(rig.targets.argmax(-1))
    out = []
    for _ in range(steps):
        h = xb
        for k in range(0, len(ws), 2):
            h = h @ ws[k].T + ws[k + 1]
            if k + 2 < len(ws):
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_f16_training_parity_with_torch_f32() -> None:
    rig = make_rig("f16")
    expected = torch_losses(rig, 20)
    sc = Loss_scaler.create()
    recipe = host_recipe(rig, sc)
    ctx, got = rig.ctx, []
    for _ in range(20):
        ctx = recipe.step(ctx)
        assert recipe.last_applied  # no skipped step: the trajectories are comparable
        got.append(ctx.get_value(rig.loss))
    np.testing.assert_allclose(got, expected, rtol=2e-3)
    assert expected[0] - expected[-1] > 0.05  # the loss moved well past the tolerance


def test_bf16_training_parity_with_torch_f32() -> None:
    rig = make_rig("bf16")
    assert rig.ctx.get_values(rig.x).dtype == ml_dtypes.bfloat16
    expected = torch_losses(rig, 20)
    comp = train.grad_update(rig.loss) + train.sgd_update(rig.loss, learning_rate=LR,
                                                          momentum=MOMENTUM)
    ctx, routine = rig.ctx.compile(comp)
    got = []
    for _ in range(20):
        ctx = ctx.run(routine)
        got.append(ctx.get_value(rig.loss))
    np.testing.assert_allclose(got, expected, rtol=4e-3)
    assert expected[0] - expected[-1] > 0.05


@pytest.mark.parametrize("prec", ["f16", "bf16"])
def test_auto_twins_are_kept_with_the_bits_of_recomputed_and_stored_ones(prec, tmp_path,
                                                                         monkeypatch):
    """Placed ``"auto"`` (the default), a twin is local: the host cannot read it, and scheduling
    keeps it between steps in a node of its own, written in the update's pass
    (``ocannl.ir.kept``). Placed ``"virtual"``, every read rounds its master instead
    (``schedule.virtual_twins``). Three SGD steps give the bits of twins stored once per forward
    pass either way."""
    from ocannl.ir.lowering import lower_items
    from ocannl.ir.schedule import virtual_twins
    from ocannl.ir.target import Target
    from ocannl.ir.tnode import MemoryMode

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))

    def run(placement: str) -> tuple[list[bytes], Context, T.Tensor, int]:
        T.set_seed(9)
        x = T.term(np.random.default_rng(9).normal(size=(24, 40)), label="xt", prec=prec,
                   batch_dims=(24,), output_dims=(40,))
        y, layers = with_master_weights(prec=prec, placement=placement,
                                        f=lambda: nn_blocks.mlp(x, (48,), 6, label="tw"))
        loss = T.sum(T.cast(y, "f32") * T.cast(y, "f32"))
        ctx = train.init_params(Context.cpu(), loss)
        comp = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.01)
        derived = virtual_twins(lower_items(comp, Target()))
        assert not derived.keys() & {n.id for n in nodes_of(ctx.lower(comp))}
        ctx, r = ctx.compile(comp)
        for _ in range(3):
            ctx.run(r)
        return [ctx.get_values(p).tobytes() for p in loss.params], ctx, layers[0][0], len(derived)

    auto, ctx, twin, derived = run("auto")
    virtual, v_ctx, v_twin, v_derived = run("virtual")
    stored, ref_ctx, ref_twin, ref_derived = run("materialized")
    assert twin.value.memory_mode is MemoryMode.local
    assert v_twin.value.memory_mode is MemoryMode.virtual
    assert ref_twin.value.memory_mode is MemoryMode.materialized and ref_derived == 0
    assert derived == v_derived == 4  # both layers' weights and biases
    assert auto == stored == virtual
    # A virtual twin has no buffer; the copies its products read live in the arena, as large
    # as the stored twin where a product reads it as stored.
    assert not ctx.is_allocated(twin) and ref_ctx.is_allocated(ref_twin)
    kept = [n for n in ctx.nodes() if n.keeps is not None]
    assert len(kept) == derived and {n.keeps[1].value for n in kept} == {prec}
    assert twin.value.cast_of in [n.keeps[0] for n in kept]
    assert not [n for n in v_ctx.nodes() if n.keeps is not None]
    with pytest.raises(ValueError, match=r"local .* placement='materialized'"):
        ctx.get_values(twin)
    with pytest.raises(ValueError, match=r"virtual .* placement='materialized'"):
        v_ctx.get_values(v_twin)
    with pytest.raises(ValueError, match=r"virtual"):
        v_ctx.set_values(v_twin, np.zeros(v_twin.dims))
    ref_ctx.get_values(ref_twin)  # a materialized twin reads


def test_a_virtual_twin_that_cannot_be_recomputed_is_refused_by_name() -> None:
    """A twin placed ``"virtual"`` whose master is written between its cast and a read of it
    (two forward passes around an update, the cast computed twice) cannot be recomputed at
    its reads: compiling it is refused, naming the twin, and the context is unchanged."""
    x = T.term(np.ones((4, 3)), label="xv")
    y, layers = with_master_weights(prec="f16", placement="virtual",
                                    f=lambda: nn_blocks.mlp(x, (5,), 2, label="vt"))
    loss = T.sum(T.cast(y, "f32"))
    ctx = train.init_params(Context.cpu(), loss)
    comp = train.forward(loss) + train.sgd_update(loss, learning_rate=0.1) + train.forward(loss)
    before = (ctx.mem(), len(ctx.nodes()))
    with pytest.raises(ValueError, match=r"vt_w\d_f16_\d+ is placed 'virtual'"):
        ctx.compile(train.grad_update(loss) + comp)
    assert (ctx.mem(), len(ctx.nodes())) == before
