"""``Loss_scaler``: dynamic loss scaling, OCANNL's ``Mixed_prec.Loss_scaler`` (the seed spec)."""

from __future__ import annotations

import math
import warnings

import numpy as np

import ocannl.tensor as T
from ocannl.context import Context
from ocannl.errors import Failure
from ocannl.ir.ops import Precision
from ocannl.mixed_prec.scale import (
    _F32_MAX,
    _check_bool,
    _f32,
    _is_int,
    _is_real,
    _reciprocal_f32,
)
from ocannl.mixed_prec.state import parse_state
from ocannl.tensor.tensor import Tensor

__all__ = ["Loss_scaler"]

_FIELDS = ("scale", "unscale", "scale_val", "good_steps", "growth_factor", "backoff_factor",
           "growth_interval")
_STATE_VERSION = "1"
_HEX = r"-?0x[01]\.[0-9a-f]{1,13}p[+-][0-9]{1,4}"
_INT = r"0|[1-9][0-9]{0,18}"
_STATE_FIELDS = (
    rf"scale=(?P<scale>{_HEX})"
    rf" good_steps=(?P<good_steps>{_INT})"
    rf" growth_factor=(?P<growth_factor>{_HEX})"
    rf" backoff_factor=(?P<backoff_factor>{_HEX})"
    rf" growth_interval=(?P<growth_interval>{_INT})"
)


class Loss_scaler:  # noqa: N801 - the OCaml module's name, as the port's conventions ask
    """Dynamic loss-scale state, host-managed (OCANNL's ``Mixed_prec.Loss_scaler``).

    ``scale`` (pass as ``train.grad_update(loss_scale=...)``) and ``unscale``, its reciprocal
    (pass as ``train.sgd_update(grad_unscale=...)``), are one-element f32 data-backed tensors
    that broadcast into any shape: compiled routines read their device buffers, and the
    schedule overwrites those through ``Context.set_values``, never recompiling. The schedule is
    torch-AMP's: back off by ``backoff_factor`` after a step with non-finite gradients (the step
    is skipped), grow by ``growth_factor`` after ``growth_interval`` consecutive good steps.

    The seven fields are read-only from outside; the methods below are their only writers, and
    every method works both as ``Loss_scaler.update(t, ctx, grads_finite=True)`` and as
    ``t.update(ctx, grads_finite=True)``. Build one with :meth:`create`.
    """

    __slots__ = (*_FIELDS, "_warned_zero")

    scale: Tensor
    unscale: Tensor
    scale_val: float
    good_steps: int
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    def __init__(self) -> None:
        raise TypeError("build a Loss_scaler with Loss_scaler.create(...)")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Loss_scaler.{name} is read-only: the schedule (update, update_n, "
                             f"set_scale, restore_state) is its only writer")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Loss_scaler.{name} cannot be deleted")

    def _put(self, **fields: object) -> None:
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    def __repr__(self) -> str:
        return (f"Loss_scaler(scale_val={self.scale_val!r}, good_steps={self.good_steps}, "
                f"growth_factor={self.growth_factor!r}, backoff_factor={self.backoff_factor!r}, "
                f"growth_interval={self.growth_interval})")

    MAX_GROWTH_INTERVAL = 10**19 - 1
    """The largest ``growth_interval``: the state line carries integers of up to 19 digits."""

    @staticmethod
    def _shown(x: object) -> str:
        """``repr(x)``, shortened when huge (an int of 400 digits is named, not printed)."""
        r = repr(x)
        if len(r) <= 60:
            return r
        if isinstance(x, int):
            return f"{r[:16]}...{r[-4:]} (an integer of {len(r.lstrip('-'))} digits)"
        return f"{r[:24]}...{r[-8:]} ({len(r)} characters)"

    @staticmethod
    def _rounded(given: object, v: float) -> str:
        return "" if isinstance(given, float) else f" (as a float: {v!r})"

    @classmethod
    def _real(cls, name: str, x: object, expected: str) -> float:
        """``x`` as a float, or ``ValueError`` naming it when it is no real number or is too
        large for a float (``float(10**400)`` would raise ``OverflowError``)."""
        if not _is_real(x):
            raise ValueError(f"{name} must be {expected}, got {type(x).__name__}: "
                             f"{cls._shown(x)}")
        try:
            return float(x)  # type: ignore[arg-type]
        except (OverflowError, ValueError, TypeError):
            raise ValueError(f"{name} must be {expected}, got {cls._shown(x)}, which is too "
                             f"large for a float") from None

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 200,
    ) -> Loss_scaler:
        """A scaler starting at ``init_scale`` (rounded to f32, as torch keeps its scale) with
        no good steps. Raises ``ValueError`` naming any argument out of range: ``init_scale``
        must round to a finite f32 > 0; ``growth_factor`` a finite number > 1 and
        ``backoff_factor`` one in (0, 1) (after rounding to a float); ``growth_interval`` an
        integer in [1, 10**19 - 1], the range :meth:`save_state` writes and
        :meth:`restore_state` reads back. Any real number type is accepted (int, float,
        Fraction, NumPy scalars), but not bool; an int too large for a float is out of range."""
        init = cls._real("init_scale", init_scale, "a finite number > 0")
        if not math.isfinite(init) or not init > 0:
            raise ValueError(f"init_scale must be a finite number > 0, got "
                             f"{cls._shown(init_scale)}")
        s = _f32(init)
        if not math.isfinite(s) or s == 0.0:
            raise ValueError(f"init_scale={cls._shown(init_scale)} is not representable in f32 "
                             f"(it rounds to {s!r}): expected a value in (0, {_F32_MAX!r}]")
        growth = cls._real("growth_factor", growth_factor, "a finite number > 1")
        if not math.isfinite(growth) or not growth > 1:
            raise ValueError(f"growth_factor must be a finite number > 1, got "
                             f"{cls._shown(growth_factor)}" + cls._rounded(growth_factor, growth))
        backoff = cls._real("backoff_factor", backoff_factor, "a number in (0, 1)")
        if not 0 < backoff < 1:
            raise ValueError(f"backoff_factor must be a number in (0, 1), got "
                             f"{cls._shown(backoff_factor)}"
                             + cls._rounded(backoff_factor, backoff))
        if not _is_int(growth_interval) or not 1 <= growth_interval <= cls.MAX_GROWTH_INTERVAL:
            raise ValueError(f"growth_interval must be an integer in [1, "
                             f"{cls.MAX_GROWTH_INTERVAL}] (the range save_state and "
                             f"restore_state carry), got {cls._shown(growth_interval)}")
        t = object.__new__(cls)
        t._put(
            scale=T.term(np.float32(s), label="loss_scale", prec=Precision.f32),
            unscale=T.term(np.float32(_reciprocal_f32(s)), label="grad_unscale",
                           prec=Precision.f32),
            scale_val=s,
            good_steps=0,
            growth_factor=growth,
            backoff_factor=backoff,
            growth_interval=int(growth_interval),
            _warned_zero=False,
        )
        return t

    # --- the scale on the device ---------------------------------------------------------------

    def scale_value(self) -> float:
        """The current scale, as the host last set it: the f32 value the device holds."""
        return self.scale_val

    def _write(self, ctx: Context, s: float) -> Context:
        """Write scale ``s`` (already f32) and its reciprocal to ``ctx``'s device tensors.

        Only to ``ctx``: the tensors' host arrays keep the initial scale, so another context
        that allocates them starts from ``init_scale`` and follows the schedule only through
        this scaler's methods called on it (a recipe's ``compile`` calls :meth:`set_scale`).
        """
        ctx = ctx.set_values(self.scale, np.array([s], np.float32))
        ctx = ctx.set_values(self.unscale, np.array([_reciprocal_f32(s)], np.float32))
        self._put(scale_val=s)
        return ctx

    def set_scale(self, ctx: Context, v: float) -> Context:
        """Set the scale to ``v`` (rounded to f32) and write it and its reciprocal to the
        device. The good-step count is kept. ``v`` must be finite and >= 0 in f32."""
        fv = self._real("set_scale: the scale", v, "a finite number >= 0")
        if not math.isfinite(fv) or fv < 0:
            raise ValueError(f"set_scale: the scale must be a finite number >= 0, got "
                             f"{self._shown(v)}")
        s = _f32(fv)
        if not math.isfinite(s):
            raise ValueError(f"set_scale: {self._shown(v)} overflows f32 (largest finite: "
                             f"{_F32_MAX!r})")
        return self._write(ctx, abs(s))

    # --- the schedule --------------------------------------------------------------------------

    def _backoff(self, ctx: Context) -> Context:
        s = _f32(self.scale_val * self.backoff_factor)
        if s == 0.0 and not self._warned_zero:
            object.__setattr__(self, "_warned_zero", True)
            warnings.warn(
                f"Loss_scaler: the loss scale backed off to 0 (from {self.scale_val!r}): "
                f"gradients are all zero from now on and no step can succeed",
                RuntimeWarning, stacklevel=3)
        if s != self.scale_val:
            ctx = self._write(ctx, s)
        self._put(good_steps=0)
        return ctx

    def _grow(self, ctx: Context, steps: int) -> Context:
        """Credit ``steps`` good steps: one growth per full ``growth_interval``, remainder kept.

        A growth that would make the scale non-finite in f32 leaves it unchanged (and the count
        restarts, as torch's does) -- hence every later growth too.
        """
        good = self.good_steps + steps
        if good < self.growth_interval:  # no growth
            _set_good_steps(self, good)
            return ctx
        s = self.scale_val
        grows, good = divmod(good, self.growth_interval)
        for _ in range(grows):
            g = _f32(s * self.growth_factor)
            if not math.isfinite(g) or g == s:
                break  # fixed point: the remaining growths change nothing either
            s = g
        if s != self.scale_val:
            ctx = self._write(ctx, s)
        self._put(good_steps=good)
        return ctx

    def update(self, ctx: Context, *, grads_finite: bool) -> Context:
        """One step of the schedule: back off on non-finite gradients, grow after
        ``growth_interval`` consecutive good steps."""
        if grads_finite is True:  # the host gate's every step: the count alone
            good = self.good_steps + 1
            if good < self.growth_interval:
                _set_good_steps(self, good)
                return ctx
            return self._grow(ctx, 1)
        if _check_bool("grads_finite", grads_finite):
            return self._grow(ctx, 1)
        return self._backoff(ctx)

    def update_n(self, ctx: Context, *, grads_finite: bool, steps: int) -> Context:
        """Like :meth:`update`, for a window of ``steps`` steps sampled at once (the fused
        :func:`gated_step`): a finite sample credits all of them toward growth (growing once per
        full ``growth_interval`` contained, keeping the remainder, so the cadence matches the
        per-step schedule), a non-finite one backs off once and clears the count."""
        finite = _check_bool("grads_finite", grads_finite)
        if not _is_int(steps) or steps < 0:
            raise ValueError(f"update_n: steps must be an integer >= 0, got {steps!r}")
        if finite:
            return self._grow(ctx, int(steps))
        return self._backoff(ctx)

    # --- persistence ---------------------------------------------------------------------------

    def save_state(self) -> str:
        """The host state as one line (no newline), versioned, floats in exact hexadecimal: the
        scale, the good-step count and the schedule's parameters. Store it in
        ``checkpoint.Progress.extra``: the scale tensors are inputs, not training state, so a
        resumed run needs this to skip and grow on the same steps as the saved one."""
        return (f"ocannl.Loss_scaler/{_STATE_VERSION} scale={self.scale_val.hex()} "
                f"good_steps={self.good_steps} growth_factor={self.growth_factor.hex()} "
                f"backoff_factor={self.backoff_factor.hex()} "
                f"growth_interval={self.growth_interval}")

    def restore_state(self, ctx: Context, s: str) -> Context:
        """Put the state :meth:`save_state` encoded in ``s`` back into this scaler (created
        afresh by the resumed program) and write the scale and its reciprocal to the device.

        Raises ``ocannl.Failure`` when ``s`` is not such an encoding, or was saved under another
        growth_factor, backoff_factor or growth_interval (the schedule belongs to the program).
        On failure the scaler and the context are as they were.
        """
        if not isinstance(s, str):
            raise Failure(f"restore_state: expected a string from Loss_scaler.save_state, "
                          f"got {type(s).__name__}: {s!r:.80}")
        expected = (f"'ocannl.Loss_scaler/{_STATE_VERSION} scale=<hex> good_steps=<int> "
                    f"growth_factor=<hex> backoff_factor=<hex> growth_interval=<int>'")
        m = parse_state(s, kind="Loss_scaler", version=_STATE_VERSION, fields=_STATE_FIELDS,
                        expected=expected, who="restore_state")
        vals: dict[str, float] = {}
        for key in ("scale", "growth_factor", "backoff_factor"):
            try:
                v = float.fromhex(m[key])
            except (ValueError, OverflowError):
                raise Failure(f"restore_state: {key}={m[key]} is not a finite hexadecimal "
                              f"float") from None
            if not math.isfinite(v) or v.hex() != m[key]:
                raise Failure(f"restore_state: {key}={m[key]} is not a float as float.hex "
                              f"writes it")
            vals[key] = v
        good_steps, interval = int(m["good_steps"]), int(m["growth_interval"])
        for key, saved, mine in (("growth_factor", vals["growth_factor"], self.growth_factor),
                                 ("backoff_factor", vals["backoff_factor"], self.backoff_factor),
                                 ("growth_interval", interval, self.growth_interval)):
            if saved != mine:
                raise Failure(f"restore_state: the state was saved with {key}={saved!r}, this "
                              f"scaler has {key}={mine!r}; create the scaler with the saved "
                              f"schedule to continue that run")
        scale = vals["scale"]
        if math.copysign(1.0, scale) < 0 or _f32(scale) != scale:
            raise Failure(f"restore_state: scale={m['scale']} ({scale!r}) is not a scale: "
                          f"expected an f32 value >= 0")
        if good_steps >= self.growth_interval:
            raise Failure(f"restore_state: good_steps={good_steps} is not below "
                          f"growth_interval={self.growth_interval}")
        ctx = self._write(ctx, scale)
        self._put(good_steps=good_steps)
        return ctx


# The slot's own setter: the schedule's every-step write of the count, past the read-only
# __setattr__ (the scaler's methods are the only writers).
_set_good_steps = Loss_scaler.__dict__["good_steps"].__set__
