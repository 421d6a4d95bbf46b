"""``Loss_scaler.create`` accepts exactly what ``save_state`` / ``restore_state`` can carry, and
refuses huge or odd numbers with the documented ``ValueError`` naming them (never an
``OverflowError``); ``restore_state`` keeps every check."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ocannl import Context, Failure
from ocannl.mixed_prec import Loss_scaler

LARGEST = 10**19 - 1  # 19 digits: what the state line carries


def ctx_for(sc: Loss_scaler) -> Context:
    return Context.cpu().from_host(sc.scale).from_host(sc.unscale)


def state(sc: Loss_scaler) -> tuple:
    return (sc.scale_val, sc.good_steps, sc.growth_factor, sc.backoff_factor, sc.growth_interval)


def test_the_largest_growth_interval_round_trips() -> None:
    assert Loss_scaler.MAX_GROWTH_INTERVAL == LARGEST
    sc = Loss_scaler.create(init_scale=4.0, growth_interval=LARGEST)
    ctx = ctx_for(sc)
    ctx = sc.update_n(ctx, grads_finite=True, steps=LARGEST - 1)  # one short of a growth
    assert sc.good_steps == LARGEST - 1 and sc.scale_val == 4.0
    saved = sc.save_state()
    again = Loss_scaler.create(init_scale=1.0, growth_interval=LARGEST)
    ctx2 = again.restore_state(ctx_for(again), saved)
    assert state(again) == state(sc)
    assert ctx2.get_value(again.scale) == 4.0 and ctx2.get_value(again.unscale) == 0.25
    ctx2 = again.update(ctx2, grads_finite=True)
    assert again.scale_val == 8.0 and again.good_steps == 0


@pytest.mark.parametrize("interval", [LARGEST + 1, 10**20, 2**64, 10**400, np.uint64(2**64 - 1)])
def test_a_growth_interval_the_state_cannot_carry_is_refused(interval: object) -> None:
    with pytest.raises(ValueError, match=r"growth_interval must be an integer in \[1, "
                                         r"9999999999999999999\]") as err:
        Loss_scaler.create(growth_interval=interval)
    shown = repr(interval)
    assert (shown if len(shown) <= 60 else shown[:16]) in str(err.value)


@pytest.mark.parametrize(("name", "value", "shown"), [
    ("init_scale", 10**400, "an integer of 401 digits"),
    ("init_scale", -(10**400), "an integer of 401 digits"),
    ("init_scale", Fraction(10**400), "Fraction(1000"),
    ("init_scale", 2**128, repr(2**128)),  # a float, but not an f32
    ("init_scale", np.longdouble("1e4000"), "1e+4000"),
    ("init_scale", np.float16("inf"), "inf"),
    ("init_scale", np.bool_(True), "True"),
    ("init_scale", complex(1, 0), "(1+0j)"),
    ("init_scale", None, "None"),
    ("growth_factor", 10**400, "an integer of 401 digits"),
    ("growth_factor", Fraction(10**400 + 1, 10**400), "as a float: 1.0"),
    ("growth_factor", np.float32(1.0), "1.0"),
    ("backoff_factor", 10**400, "an integer of 401 digits"),
    ("backoff_factor", Fraction(1, 10**400), "as a float: 0.0"),
    ("backoff_factor", np.float64(1.0), "1.0"),
    ("growth_interval", np.float64(200.0), "200.0"),
    ("growth_interval", np.int64(0), "0"),
    ("growth_interval", np.bool_(True), "True"),
])
def test_huge_and_odd_arguments_are_the_documented_value_error(name: str, value: object,
                                                                shown: str) -> None:
    with pytest.raises(ValueError) as err:
        Loss_scaler.create(**{name: value})
    assert type(err.value) is ValueError
    assert name in str(err.value) and shown in str(err.value), str(err.value)


def test_numpy_scalars_and_fractions_in_range_are_accepted() -> None:
    sc = Loss_scaler.create(init_scale=np.float32(1024.0), growth_factor=np.float64(2.0),
                            backoff_factor=Fraction(1, 2), growth_interval=np.int64(7))
    assert state(sc) == (1024.0, 0, 2.0, 0.5, 7)
    assert all(type(v) in (float, int) for v in state(sc))
    sc = Loss_scaler.create(init_scale=2**20, growth_interval=np.uint64(LARGEST))
    assert sc.scale_val == 2.0**20 and sc.growth_interval == LARGEST
    assert type(sc.growth_interval) is int


def test_set_scale_of_a_huge_int_is_a_value_error() -> None:
    sc = Loss_scaler.create()
    ctx = ctx_for(sc)
    for v in (10**400, Fraction(10**400), 2**128):
        with pytest.raises(ValueError, match="set_scale"):
            sc.set_scale(ctx, v)
    assert sc.scale_val == 65536.0 and ctx.get_value(sc.scale) == 65536.0


@pytest.mark.parametrize("bad", [
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+2 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=10000000000000000000",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+2 good_steps=9999999999999999999 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=9999999999999999999",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000000p+2 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=200",
    "ocannl.Loss_scaler/1 scale=-0x1.0000000000000p+2 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=9999999999999999999",
    "ocannl.Loss_scaler/1 scale=0x1.0000000000001p+2 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=9999999999999999999",
    "ocannl.Loss_scaler/2 scale=0x1.0000000000000p+2 good_steps=0 growth_factor="
    "0x1.0000000000000p+1 backoff_factor=0x1.0000000000000p-1 growth_interval=9999999999999999999",
])
def test_restore_state_keeps_every_check_at_the_limit(bad: str) -> None:
    sc = Loss_scaler.create(growth_interval=LARGEST)
    ctx = ctx_for(sc)
    before = state(sc), ctx.get_value(sc.scale)
    with pytest.raises(Failure):
        sc.restore_state(ctx, bad)
    assert (state(sc), ctx.get_value(sc.scale)) == before


@settings(max_examples=80, deadline=None)
@given(init=st.one_of(st.floats(min_value=1e-38, max_value=3e38), st.integers(1, 2**127)),
       growth=st.one_of(st.floats(min_value=1.0001, max_value=1e6), st.integers(2, 10**6)),
       backoff=st.floats(min_value=1e-300, max_value=0.9999),
       interval=st.integers(1, LARGEST), good=st.integers(0, LARGEST))
def test_every_scaler_create_accepts_restores_its_own_state(init: float, growth: float,
                                                            backoff: float, interval: int,
                                                            good: int) -> None:
    sc = Loss_scaler.create(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                            growth_interval=interval)
    ctx = ctx_for(sc)
    ctx = sc.update_n(ctx, grads_finite=True, steps=good % interval)
    again = Loss_scaler.create(init_scale=1.0, growth_factor=growth, backoff_factor=backoff,
                               growth_interval=interval)
    again.restore_state(ctx_for(again), sc.save_state())
    assert state(again) == state(sc)
    assert math.isfinite(again.scale_val)
