"""Mixed-precision training: master weights, dynamic loss scaling, scaled and fused-gated steps.

Three pieces, as in OCANNL's ``Mixed_prec``:

- **Master weights** (:func:`cast_param`, :func:`with_master_weights`): every parameter stays an
  f32 *master*, the tensor the optimizer updates and checkpoints save. The model reads a
  reduced-precision *cast twin* of it, recomputed from the master by each forward pass; the
  twin's gradient accumulates back into the master's f32 gradient (the widening happens there).
- **Loss scaling** (:class:`Loss_scaler`): f16's exponent range loses small gradients, so the
  backprop is seeded with a scale and the optimizer multiplies gradients by its reciprocal. The
  scale lives in one-element device buffers the host overwrites; compiled routines read them,
  so a new scale never recompiles anything. The schedule is torch-AMP's, to the bit.
- **Recipes** over any :mod:`ocannl.optim` optimizer, one interface (:class:`Recipe`):
  :func:`scaled_step` (the host reads the gradient checksum after every gradient routine and
  runs or skips the optimizer routine) and :func:`gated_step` (one fused routine whose
  optimizer step is gated on the device; the host samples a skipped-step counter every
  ``check_interval`` steps). Both clip the unscaled gradients (``clip=``, see
  :mod:`ocannl.clipping`), accumulate micro-batches under one scale (``accumulate=k``), and
  name the parameters whose gradients overflowed when a step is skipped (``last_overflow``).

bf16 has f32's exponent range and needs no loss scaling; f16 does.
"""

from __future__ import annotations

import math
import numbers
import re
import urllib.parse
import warnings
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np

import ocannl.tensor as T
from ocannl.context import Context, Routine
from ocannl.errors import Failure
from ocannl.ir.assignments import Accum, Comp, Const, Get, apply
from ocannl.ir.ops import Precision, precision_of
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.optim import Optimizer
from ocannl.tensor.tensor import Tensor, active_param_postprocess

if TYPE_CHECKING:
    from ocannl.clipping import Clip

__all__ = [
    "TWIN_PLACEMENTS", "GatedStep", "GradReducer", "Loss_scaler", "Recipe", "ScaledStep",
    "cast_param", "gated_step", "master_of", "scaled_grad_update", "scaled_step",
    "with_master_weights",
]

R = TypeVar("R")

# --- master weights ---------------------------------------------------------------------------

TWIN_PLACEMENTS = ("auto", "materialized", "virtual")
"""Where a cast twin lives. ``auto``: lowering decides: the twin is local to the routines
computing it (the host cannot read it), and recomputed from its master at every read (never
stored) where nothing writes the master between its cast and a read of it, on every backend;
``materialized``: a device buffer refreshed once per forward pass, readable from the host;
``virtual``: always recomputed at every read, never stored: a routine where that cannot be
(the master written between the cast and a read) is refused at compile, naming the twin."""

_TWIN_MODES = {"auto": MemoryMode.local, "materialized": MemoryMode.materialized,
               "virtual": MemoryMode.virtual}


def _check_placement(placement: str) -> None:
    if placement not in TWIN_PLACEMENTS:
        raise ValueError(f"placement {placement!r}: expected one of {TWIN_PLACEMENTS}")


def _link_twin(twin: Tensor, master: Tensor) -> None:
    """``twin = master`` rounded to the twin's precision; backprop ``master.grad += twin.grad``."""
    dims = twin.value.dims
    idx = tuple(range(len(dims)))
    twin.forward_code = (Accum(twin.value, idx, "=", Get(master.value, idx), dims),)
    assert master.grad is not None and twin.grad is not None
    twin.backprop_code = (Accum(master.grad, idx, "+", Get(twin.grad, idx), dims),)


def cast_param(p: Tensor, *, prec: Precision | str, placement: str = "auto") -> Tensor:
    """The reduced-precision cast twin of parameter ``p``, for the model to read instead of it.

    ``p`` stays the master: ``loss.params`` lists it (not the twin), so the optimizer updates it
    and checkpoints save it at full precision, while the twin is recomputed from it by every
    forward pass. The twin's gradient accumulates into ``p``'s gradient. A parameter whose dims
    are still to be inferred shares its open rows with its twin: the twin's uses infer both.
    A non-differentiable tensor is returned unchanged.
    """
    if not isinstance(p, Tensor):
        raise TypeError(f"cast_param expects a parameter Tensor, got {type(p).__name__}: {p!r}")
    prec = precision_of(prec)
    _check_placement(placement)
    if p.grad is None:
        return p
    if p.kind != "param":
        raise ValueError(f"cast_param: {p.label} is a {p.kind} tensor, not a parameter "
                         f"(a cast twin of a twin would have no master)")
    if p.prec.is_narrow:
        raise ValueError(f"cast_param: master {p.label} is {p.prec.value}; a master must be f32 "
                         f"or f64 (create the parameter at full precision)")
    node = Tnode(f"{p.label}_{prec.value}", p.value.dims_if_known, prec,
                 memory_mode=_TWIN_MODES[placement])
    # An open master's twin shares its rows: whatever the twin meets fixes the master's dims,
    # and the twin never has other dims than its master's.
    twin = Tensor(node, p.sym if p.sym is not None else p.shape, kind="op", children=(p,))
    twin.master = p
    twin.defer(lambda: _link_twin(twin, p))
    return twin


def master_of(t: Tensor) -> Tensor:
    """The f32 master behind a cast twin (a tensor that is no twin is its own master)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"master_of expects a Tensor, got {type(t).__name__}: {t!r}")
    return t if t.master is None else t.master


def with_master_weights(*, prec: Precision | str, f: Callable[[], R],
                        placement: str = "auto") -> R:
    """Run the model-building function ``f`` so that every parameter it creates is handed out
    as a ``prec`` cast twin of an f32 master (:func:`cast_param`); returns ``f()``.

    Wrap the construction of the model (where ``ocannl.tensor.param`` is called), not only its
    application. Build the parameters at f32 (the default): the masters keep their precision.
    """
    prec = precision_of(prec)
    _check_placement(placement)
    if not callable(f):
        raise TypeError(f"with_master_weights: f must be callable, got {type(f).__name__}")
    outer = active_param_postprocess.get()

    def hook(p: Tensor) -> Tensor:
        return cast_param(outer(p), prec=prec, placement=placement)

    token = active_param_postprocess.set(hook)
    try:
        return f()
    finally:
        active_param_postprocess.reset(token)


# --- f32 arithmetic of the scale --------------------------------------------------------------

_F32_MAX = float(np.finfo(np.float32).max)
_F32_ROUNDS_TO_INF = Fraction(2) ** 128 - Fraction(2) ** 103  # midpoint of max and 2**128


def _f32(x: float) -> float:
    """``x`` rounded to f32 (to nearest, ties to even), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _f32_odd(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) & 1


def _f32_of_fraction(x: Fraction) -> float:
    """The f32 nearest to the exact positive rational ``x`` (ties to even)."""
    if x >= _F32_ROUNDS_TO_INF:
        return math.inf
    c = np.float32(_f32(float(x)))
    inf32 = np.float32(np.inf)
    cands = {float(np.nextafter(c, -inf32)), float(c), float(np.nextafter(c, inf32))}
    cands = {v for v in cands if math.isfinite(v) and v >= 0}
    return min(cands, key=lambda v: (abs(Fraction(v) - x), _f32_odd(v)))


def _reciprocal_f32(scale: float) -> float:
    """What the device's ``unscale`` holds: the f32 rounding of the exact ``1 / scale``."""
    if scale == 0.0:
        return math.inf
    return _f32_of_fraction(1 / Fraction(scale))


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: object) -> bool:
    if type(x) is int:  # the common case, without the slower ABC check below
        return True
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_bool(name: str, x: object) -> bool:
    if x is True or x is False:
        return x
    if not isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {type(x).__name__}: {x!r}")
    return bool(x)


# --- Loss_scaler ------------------------------------------------------------------------------

_FIELDS = ("scale", "unscale", "scale_val", "good_steps", "growth_factor", "backoff_factor",
           "growth_interval")
_STATE_VERSION = "1"
_HEX = r"-?0x[01]\.[0-9a-f]{1,13}p[+-][0-9]{1,4}"
_INT = r"0|[1-9][0-9]{0,18}"
_STATE_VERSION_RE = re.compile(r"ocannl\.Loss_scaler/([0-9]{1,6})(?: |$)", re.ASCII)
_STATE_RE = re.compile(
    rf"ocannl\.Loss_scaler/{_STATE_VERSION}"
    rf" scale=(?P<scale>{_HEX})"
    rf" good_steps=(?P<good_steps>{_INT})"
    rf" growth_factor=(?P<growth_factor>{_HEX})"
    rf" backoff_factor=(?P<backoff_factor>{_HEX})"
    rf" growth_interval=(?P<growth_interval>{_INT})",
    re.ASCII,
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
        version = _STATE_VERSION_RE.match(s)
        if version is not None and version[1] != _STATE_VERSION:
            raise Failure(f"restore_state: {s!r:.200} is a state of format "
                          f"ocannl.Loss_scaler/{version[1]}, which this version does not read: "
                          f"expected format version {_STATE_VERSION}, {expected}")
        m = _STATE_RE.fullmatch(s)
        if m is None:
            raise Failure(f"restore_state: {s!r:.200} is not a Loss_scaler state: expected "
                          f"{expected}")
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


# --- the recipes ------------------------------------------------------------------------------


def scaled_grad_update(t: Loss_scaler, loss: Tensor) -> tuple[Tensor, Comp]:
    """``train.grad_update`` seeded with the scale, then ``train.grad_checksum`` of the
    gradients times ``t.unscale`` (what the optimizer would apply), as one computation; returns
    the checksum tensor with it. Both recipes start from it."""
    from ocannl import train

    _check_scaler(t)
    flag, check = train.grad_checksum(loss, unscale=t.unscale)
    return flag, train.grad_update(loss, loss_scale=t.scale) + check


def _check_scaler(t: object) -> None:
    if not isinstance(t, Loss_scaler):
        raise TypeError(f"expected a Loss_scaler, got {type(t).__name__}: {t!r}")


class GradReducer(Protocol):
    """What a recipe calls between its gradient routine and its optimizer step: data-parallel
    training's allreduce (:class:`ocannl.parallel.DataParallel`).

    With a reducer, a recipe's gradient routine computes the scaled gradients only; then
    :meth:`reduce` runs (it may change them in place, e.g. sum them over processes); then the
    checksum is taken over the reduced gradients, so every process sees the same bits and
    gates the same steps. The checksum and the optimizer multiply gradients by
    :meth:`grad_unscale`'s tensor instead of ``scaler.unscale``; :meth:`reduce` keeps it in
    step with the scaler (a data-parallel reducer folds the batch mean's ``1 / world`` in).
    """

    def grad_unscale(self, scaler: Loss_scaler) -> Tensor:
        """The one-element tensor gradients are multiplied by before the optimizer math."""
        ...

    def reduce(self, ctx: Context, scaler: Loss_scaler) -> Context:
        """Run after the gradient routine, before the checksum and the optimizer step."""
        ...


_COUNTERS = ("pending", "applied", "skipped", "windows", "skipped_windows", "micro")
# /1 (GatedStep's first) held the position only; /2 the counters without the position inside
# an accumulation and the overflow names: both refused, by name.
_RECIPE_STATE_VERSION = "3"
_NUM = r"(0|[1-9][0-9]{0,18})"
_NAME = r"[A-Za-z0-9_.~%-]+"  # a parameter's name, percent-encoded (urllib.parse.quote)
_NAMES = rf"((?:{_NAME}(?:,{_NAME})*)?)"
# The state nodes a position inside a window or an accumulation cannot resume without, by
# checkpoint name: ``checkpoint.save`` and ``checkpoint.load`` refuse a file without them.
_NEEDS = rf"(?: needs=({_NAME}(?:,{_NAME})*))?"


class Recipe:
    """A dynamically loss-scaled training step over any :mod:`ocannl.optim` optimizer; the
    interface both recipes share (:class:`ScaledStep`: host gate, :class:`GatedStep`: fused)::

        recipe = mixed_prec.gated_step(scaler, loss, optim.Adam(1e-3))  # or scaled_step(...)
        ctx = recipe.compile(ctx)          # its routine(s), bound to this context
        for _ in range(steps):
            ctx = recipe.step(ctx)
        ctx = recipe.flush(ctx)            # sample what is still unsampled (fused)

    A step whose unscaled gradients are not all finite is skipped: parameters, every optimizer
    buffer and the optimizer's step counter keep their bits. The host samples the outcome at
    the end of each *window* (one step for the host gate, ``check_interval`` steps for the fused
    one) and updates the scaler then. Counters, as of the last sample: ``applied_steps``,
    ``skipped_steps``, ``windows``, ``skipped_windows``; ``pending``: steps run since. All of
    them count *optimizer* steps (with accumulation, one per ``accumulate`` micro-batches).

    ``clip`` (:class:`ocannl.clipping.ClipNorm` or :class:`~ocannl.clipping.ClipValue`): the
    gradients are clipped after unscaling, as torch's ``scaler.unscale_(opt)`` then
    ``clip_grad_norm_`` / ``clip_grad_value_``. The norm (:attr:`grad_norm`, a one-element f32
    device tensor, ``None`` when clipping by value or not at all) is computed in the step's
    routine after the gradients (and after a reducer) and folded into the checksum, so a
    non-finite norm skips the step like non-finite gradients; a skipped step clips nothing.

    ``accumulate=k``: each :meth:`step` is one micro-batch (write its data before the call);
    the first of every ``k`` zeroes the gradients, the others add to them, all under one loss
    scale; the ``k``-th checks the sum once, steps the optimizer once and updates the scaler
    once. The gradient applied is the *mean* over the micro-batches (each seeded with
    ``scale / k``), as torch's ``(loss / k).backward()`` recipe. :attr:`micro` is the position
    inside the accumulation (micro-batches since the last optimizer step).

    :attr:`last_overflow`: after a skipped step (host gate) or a window with a skipped step
    (fused gate), the checkpoint names (node labels) of the parameters whose gradients were
    non-finite, in ``loss.params`` order (for the fused gate, over the whole window); empty
    after an applied step or window, and empty for a step skipped only because the norm of
    finite gradients overflowed. The flags come from the checksum's own pass (one 0/NaN cell
    per parameter, ``train.grad_checksum_by_param``) and are read only on a skip.

    A checkpoint holds ``checkpoint.training_state(loss, optimizer) + recipe.state_nodes()``
    and, in ``Progress.extra``, ``scaler.save_state()`` and ``recipe.save_state()``; with
    ``accumulate > 1`` the state nodes include the parameters' gradients (the partial sum), so
    a checkpoint between micro-batches resumes exactly. A state saved there records that they
    must be in the checkpoint (``needs=``): ``checkpoint.save`` and ``checkpoint.load`` refuse a
    file without them, and :meth:`restore_state` a state between micro-batches that does not
    record them.

    ``reducer`` (a :class:`GradReducer`): run between the gradient routine and the checksum
    and optimizer step (data-parallel training; with accumulation, once per optimizer step);
    the gradient routine then holds the gradients alone (:attr:`grad_comp`), the checksum is
    :attr:`check_comp`.
    """

    check_interval = 1

    def __init__(self, scaler: Loss_scaler, loss: Tensor, optimizer: Optimizer, *,
                 reducer: GradReducer | None = None, clip: Clip | None = None,
                 accumulate: int = 1) -> None:
        from ocannl import clipping, train

        _check_scaler(scaler)
        if not isinstance(loss, Tensor):
            raise TypeError(f"expected the loss Tensor, got {type(loss).__name__}: {loss!r}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"expected an ocannl.optim optimizer (SGD, Adam, AdamW, ...), got "
                            f"{type(optimizer).__name__}: {optimizer!r:.80}")
        k = train.check_micro_batches(accumulate, f"{type(self).__name__}: accumulate")
        if clip is not None:
            clipping.check_clip(clip)
        self.scaler = scaler
        self.loss = loss
        self.optimizer = optimizer
        self.reducer = reducer
        self.accumulate = k
        self.param_names = tuple(p.value.label for p in loss.params)
        self.unscale = scaler.unscale if reducer is None else reducer.grad_unscale(scaler)
        self.checksum, self.grad_flags, check = train.grad_checksum_by_param(
            loss, unscale=self.unscale)
        self.clipper: clipping.GradClipper | None = None
        self.grad_norm: Tensor | None = None
        if clip is not None:
            self.clipper = clipping.clipper(clip, loss, unscale=self.unscale, gate_on_norm=False)
            self.grad_norm = self.clipper.norm
            parts = [check, self.clipper.comp]
            if self.grad_norm is not None:  # a non-finite norm makes the checksum NaN: a skip
                fold = Accum(self.checksum.value, (), "+",
                             apply("mul", Get(self.grad_norm.value, ()), Const(0.0)), ())
                parts.append(Comp((fold,), "norm_into_checksum"))
            check = Comp.seq(parts, check.label)
        first = train.grad_update(loss, loss_scale=scaler.scale, micro_batches=k)
        self.accumulate_comp: Comp | None = None
        if k > 1:
            self.accumulate_comp = train.grad_update(loss, loss_scale=scaler.scale,
                                                     accumulate=True, micro_batches=k)
        if reducer is None:  # the check rides on the last micro-batch's gradient routine
            self.grad_comp = first + check if k == 1 else first
            self.last_grad_comp = self.grad_comp if self.accumulate_comp is None else \
                self.accumulate_comp + check
            self.check_comp: Comp | None = None
        else:
            self.grad_comp = first
            self.last_grad_comp = first if self.accumulate_comp is None else \
                self.accumulate_comp
            self.check_comp = check
        self.micro = 0
        self.pending = 0
        self.applied_steps = 0
        self.skipped_steps = 0
        self.windows = 0
        self.skipped_windows = 0
        self.last_applied: bool | None = None  # the last step's outcome, when the host knows it
        self.last_overflow: tuple[str, ...] = ()
        self._ctx: Context | None = None
        self._routines: dict[int, Routine] = {}

    # --- the interface ----------------------------------------------------------------------

    def compile(self, ctx: Context) -> Context:
        """Compile this recipe's routine(s) on ``ctx`` and write the scaler's current scale
        there (:meth:`Loss_scaler.set_scale`); :meth:`step` then runs them on ``ctx``."""
        raise NotImplementedError

    def step(self, ctx: Context) -> Context:
        """Run one training step, or one micro-batch of it (and, at a window's end, sample it
        and update the scaler)."""
        raise NotImplementedError

    def flush(self, ctx: Context) -> Context:
        """Close the current window now: sample it and update the scaler (nothing to do when
        no step is pending). Micro-batches since the last optimizer step stay accumulated."""
        self._check_ctx(ctx)
        return ctx

    def state_nodes(self) -> list[Tnode]:
        """Device state beyond the optimizer's that a checkpoint must hold to resume exactly:
        with ``accumulate > 1``, the parameters' gradients (the micro-batches' partial sum)."""
        return self._grad_sums()

    def save_state(self) -> str:
        """The host's position and counters as one line, for ``checkpoint.Progress.extra``:
        the window's position, the counters, the position inside an accumulation, and
        :attr:`last_overflow` (percent-encoded names, comma-separated); then, inside a window
        or an accumulation, ``needs=`` and the checkpoint names of the state nodes that
        position cannot resume without (:meth:`needed_nodes`), which ``checkpoint.save`` and
        ``checkpoint.load`` then require.

        With a reducer, only at an optimizer step's boundary (``micro == 0``): between
        micro-batches each process holds its own partial sums, which one checkpoint cannot
        hold for all of them (``ocannl.Failure`` then)."""
        if self.micro and self.reducer is not None:
            raise Failure(f"{type(self).__name__}.save_state: micro={self.micro} of "
                          f"accumulate={self.accumulate} with a reducer: each process's "
                          f"gradients are its own partial sums until the last micro-batch; "
                          f"checkpoint after an optimizer step (micro == 0)")
        vals = (self.pending, self.applied_steps, self.skipped_steps, self.windows,
                self.skipped_windows, self.micro)
        fields = " ".join(f"{k}={v}" for k, v in zip(_COUNTERS, vals, strict=True))
        names = _encoded(self.last_overflow)
        needs = _encoded(n.label for n in self.needed_nodes(self.pending, self.micro))
        return (f"ocannl.{type(self).__name__}/{_RECIPE_STATE_VERSION} {fields} overflow={names}"
                + (f" needs={needs}" if needs else ""))

    def needed_nodes(self, pending: int, micro: int) -> list[Tnode]:
        """The state nodes a checkpoint at this position (``pending`` steps into a window,
        ``micro`` micro-batches into an accumulation) cannot resume without: inside an
        accumulation, the gradients (the partial sum)."""
        return self._grad_sums() if micro else []

    def _grad_sums(self) -> list[Tnode]:
        if self.accumulate == 1:
            return []
        return [p.grad for p in self.loss.params if p.grad is not None]

    def restore_state(self, s: str) -> None:
        """Restore what :meth:`save_state` wrote; raises ``ocannl.Failure`` (and changes
        nothing) on anything else, on a position past the window or the accumulation, on an
        overflow name that is none of this recipe's parameters, on ``needs=`` naming other
        nodes than :meth:`needed_nodes`, or on a state inside an accumulation without it
        (written by the previous version, which did not record that its checkpoint held the
        gradient sums). A state of another format
        version (``ocannl.GatedStep/1``: a position only; ``/2``: no accumulation position nor
        overflow names) is refused, naming its version and the one expected."""
        name = type(self).__name__
        expected = f"'ocannl.{name}/{_RECIPE_STATE_VERSION} " + " ".join(
            f"{k}=<int>" for k in _COUNTERS) + " overflow=<names>[ needs=<names>]'"
        version = re.match(rf"ocannl\.{name}/([0-9]{{1,6}})(?: |$)", s, re.ASCII) \
            if isinstance(s, str) else None
        if version is not None and version[1] != _RECIPE_STATE_VERSION:
            raise Failure(f"{name}.restore_state: {s!r:.200} is a state of format "
                          f"ocannl.{name}/{version[1]}, which this version does not read: "
                          f"expected format version {_RECIPE_STATE_VERSION}, {expected}")
        pattern = rf"ocannl\.{name}/{_RECIPE_STATE_VERSION} " + " ".join(
            f"{k}={_NUM}" for k in _COUNTERS) + rf" overflow={_NAMES}{_NEEDS}"
        m = re.fullmatch(pattern, s, re.ASCII) if isinstance(s, str) else None
        if m is None:
            raise Failure(f"{name}.restore_state: {s!r:.200} is not a {name} state: expected "
                          f"{expected}")
        *counts, overflow, needs = m.groups()
        pending, applied, skipped, windows, skipped_windows, micro = (int(v) for v in counts)
        if pending >= self.check_interval:
            raise Failure(f"{name}.restore_state: pending={pending} is not below "
                          f"check_interval={self.check_interval}")
        if micro >= self.accumulate:
            raise Failure(f"{name}.restore_state: micro={micro} is not below "
                          f"accumulate={self.accumulate}")
        if skipped_windows > windows or skipped_windows > skipped:
            raise Failure(f"{name}.restore_state: skipped_windows={skipped_windows} exceeds "
                          f"windows={windows} or skipped={skipped}")
        names = self._decode_names(overflow)
        self._check_needs(needs, pending, micro)
        self.pending, self.applied_steps, self.skipped_steps = pending, applied, skipped
        self.windows, self.skipped_windows, self.micro = windows, skipped_windows, micro
        self.last_overflow = names

    def _check_needs(self, needs: str | None, pending: int, micro: int) -> None:
        """Refuse a ``needs=`` field other than this recipe's at that position, and a state
        inside an accumulation without one (the previous version wrote none, and saved such
        checkpoints without the gradient sums when asked to). A state inside a window without
        one is read: the examples' checkpoints of that version hold the gate's counter."""
        name = type(self).__name__
        want = _encoded(n.label for n in self.needed_nodes(pending, micro))
        if needs is None and micro:
            raise Failure(f"{name}.restore_state: a state at micro={micro} does not record that "
                          f"its gradient sums are in the checkpoint (expected needs={want}): "
                          f"it was written by an older version, which saved them only when "
                          f"asked to; resume from a checkpoint taken at micro=0, or restart")
        if needs is not None and needs != want:
            raise Failure(f"{name}.restore_state: the state needs {needs}, expected "
                          f"needs={want or '(none)'} (this recipe's state nodes at "
                          f"pending={pending}, micro={micro})")

    def _decode_names(self, field: str) -> tuple[str, ...]:
        name = type(self).__name__
        names: list[str] = []
        for enc in field.split(",") if field else ():
            try:
                n = urllib.parse.unquote(enc, errors="strict")
            except UnicodeDecodeError:
                n = None
            if n is None or urllib.parse.quote(n, safe="") != enc:
                raise Failure(f"{name}.restore_state: overflow name {enc!r} is not encoded as "
                              f"save_state writes it")
            if n not in self.param_names:
                raise Failure(f"{name}.restore_state: overflow name {n!r} is none of this "
                              f"recipe's parameters ({', '.join(self.param_names)[:200]})")
            if n in names:
                raise Failure(f"{name}.restore_state: overflow name {n!r} is repeated")
            names.append(n)
        return tuple(names)

    # --- shared plumbing --------------------------------------------------------------------

    def _compile(self, ctx: Context, comp: Comp | None) -> Context:
        """Compile ``comp`` once (a comp used in two roles shares its routine)."""
        if comp is not None and id(comp) not in self._routines:
            ctx, self._routines[id(comp)] = ctx.compile(comp)
        return ctx

    def _compile_micro_batches(self, ctx: Context) -> Context:
        """The gradient routines of the micro-batches before the last (and, with a reducer,
        the last's, whose check runs after the reduction)."""
        self._routines = {}
        k = self.accumulate
        if k > 1 or self.reducer is not None:
            ctx = self._compile(ctx, self.grad_comp)
        if k > 2 or (k > 1 and self.reducer is not None):
            ctx = self._compile(ctx, self.accumulate_comp)
        return ctx

    def _routine(self, comp: Comp | None) -> Routine:
        assert comp is not None
        return self._routines[id(comp)]

    def _micro_batch(self, ctx: Context) -> Context | None:
        """Run a micro-batch that is not the last of its accumulation (``None`` for the last,
        which the recipe runs itself)."""
        m = self.micro
        if m + 1 >= self.accumulate:
            return None
        ctx = ctx.run(self._first if m == 0 else self._more)
        self.micro = m + 1
        return ctx

    def _last_grads(self, ctx: Context) -> Context:
        """With a reducer: the last micro-batch's gradients, then the reduction."""
        assert self.reducer is not None
        ctx = ctx.run(self._first if self.accumulate == 1 else self._more)
        return self.reducer.reduce(ctx, self.scaler)

    @property
    def _first(self) -> Routine:
        return self._routine(self.grad_comp)

    @property
    def _more(self) -> Routine:
        return self._routine(self.accumulate_comp)

    def _overflowed(self, flags: np.ndarray) -> tuple[str, ...]:
        """The names of the parameters whose flag cell is set (non-zero: NaN or 1)."""
        return tuple(n for n, f in zip(self.param_names, flags.reshape(-1).tolist(),
                                       strict=True) if f != 0.0)

    def _bind(self, ctx: Context) -> Context:
        """Make ``ctx`` the recipe's context, its device scale the scaler's current one (the
        scaler may have moved on another context: nothing carries it here by itself)."""
        ctx = self.scaler.set_scale(ctx, self.scaler.scale_value())
        self._ctx = ctx
        return ctx

    def _check_ctx(self, ctx: Context) -> None:
        if self._ctx is None:
            raise ValueError(f"{type(self).__name__}: call compile(ctx) before stepping")
        if ctx is not self._ctx:
            raise ValueError(f"{type(self).__name__} was compiled on {self._ctx!r}, not on "
                             f"{ctx!r}: compile it on this context first")

    def _close_window(self, ctx: Context, steps: int, skipped: int) -> Context:
        """Account for a window of ``steps`` steps, ``skipped`` of them skipped, and update the
        scaler (:meth:`Loss_scaler.update_n`); nothing is pending after it."""
        ctx = self.scaler.update_n(ctx, grads_finite=skipped == 0, steps=steps)
        self._count_window(steps, skipped)
        return ctx

    def _count_window(self, steps: int, skipped: int) -> None:
        if skipped == 0:
            self.applied_steps += steps
        else:
            self.applied_steps += steps - skipped
            self.skipped_steps += skipped
            self.skipped_windows += 1
        self.windows += 1
        self.pending = 0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.optimizer!r}, check_interval="
                f"{self.check_interval}, accumulate={self.accumulate}, micro={self.micro}, "
                f"pending={self.pending}, applied={self.applied_steps}, "
                f"skipped={self.skipped_steps})")


class ScaledStep(Recipe):
    """The per-step host gate: the gradient routine (:func:`scaled_grad_update`), a host read
    of the checksum, the optimizer routine only when it is finite, then ``Loss_scaler.update``.
    Every step is a window of one; the read waits for the device every step, which the fused
    :class:`GatedStep` avoids. With ``accumulate=k``, the read, the optimizer routine and the
    scaler update come after every ``k``-th micro-batch only. Build one with
    :func:`scaled_step`.

    A skipped step runs the optimizer's ``schedule_tick()`` (when its learning rate is a
    schedule) instead of the update: the schedule counts every iteration (every optimizer
    step, under accumulation), as under the fused gate, while Adam's step counter and every
    other state keep their bits."""

    def __init__(self, scaler: Loss_scaler, loss: Tensor, optimizer: Optimizer, *,
                 reducer: GradReducer | None = None, clip: Clip | None = None,
                 accumulate: int = 1) -> None:
        super().__init__(scaler, loss, optimizer, reducer=reducer, clip=clip,
                         accumulate=accumulate)
        self.update_comp = optimizer.update(loss, grad_unscale=self.unscale, clip=self.clipper)
        self.tick_comp = optimizer.schedule_tick()  # None without a learning-rate schedule
        self._tick: Routine | None = None
        self._grads: Routine | None = None
        self._check: Routine | None = None
        self._update: Routine | None = None
        self._read_checksum: Callable[[], float] | None = None
        self._reader_fresh = False

    def compile(self, ctx: Context) -> Context:
        ctx = self._compile_micro_batches(ctx)
        if self.reducer is None:
            ctx = self._compile(ctx, self.last_grad_comp)
            self._grads = self._routine(self.last_grad_comp)
        else:
            self._grads = None
            ctx, self._check = ctx.compile(self.check_comp)
        ctx, self._update = ctx.compile(self.update_comp)
        if self.tick_comp is not None:
            ctx, self._tick = ctx.compile(self.tick_comp)
        self._read_checksum = ctx.reader(self.checksum)
        self._reader_fresh = False
        return self._bind(ctx)

    def step(self, ctx: Context) -> Context:
        if ctx is not self._ctx:
            self._check_ctx(ctx)  # raises, saying why
        if self.accumulate > 1:
            early = self._micro_batch(ctx)
            if early is not None:
                return early
            self.micro = 0
        if self.reducer is None:
            ctx = ctx.run(self._grads)
        else:
            ctx = self._last_grads(ctx)
            ctx = ctx.run(self._check)
        finite = _isfinite(self._read_checksum())
        if finite:
            ctx = ctx.run(self._update)
            if self.last_overflow:
                self.last_overflow = ()
        else:
            if self._tick is not None:
                ctx = ctx.run(self._tick)  # the schedule counts skipped iterations too
            self.last_overflow = self._overflowed(ctx.get_values(self.grad_flags))
        ctx = self.scaler.update(ctx, grads_finite=finite)  # a window of one step
        self._count_window(1, 0 if finite else 1)
        self.last_applied = finite
        if not self._reader_fresh:
            # The checksum has been written now: its reader made now is the backend's own,
            # with no check left (the one made at compile checks until the first run).
            self._read_checksum = ctx.reader(self.checksum)
            self._reader_fresh = True
        return ctx


def _encoded(names: Iterable[str]) -> str:
    """Names as a state line writes them: percent-encoded, comma-separated."""
    return ",".join(urllib.parse.quote(n, safe="") for n in names)


# A recipe's step on a small model takes a few microseconds, and its own Python is most of
# what a recipe adds to the routines' time: module-level names are the cheapest to reach.
_isfinite = math.isfinite


def scaled_step(scaler: Loss_scaler, loss: Tensor, optimizer: Optimizer, *,
                reducer: GradReducer | None = None, clip: Clip | None = None,
                accumulate: int = 1) -> ScaledStep:
    """Build the per-step, host-gated recipe (see :class:`ScaledStep`; ``clip`` and
    ``accumulate`` as :class:`Recipe` says)."""
    return ScaledStep(scaler, loss, optimizer, reducer=reducer, clip=clip,
                      accumulate=accumulate)


class GatedStep(Recipe):
    """The fused recipe: one routine per step, no host read in between.

    The routine (:attr:`comp`) computes the scaled gradients and their checksum and runs the
    optimizer's update gated on the device: where the checksum is non-finite every parameter,
    optimizer buffer and step counter keeps its old bits (a select, not a multiply by a 0/1
    flag: ``inf * 0`` is NaN), but for a learning-rate schedule's counter, which counts every
    iteration. A device counter, :attr:`nonfinite_seen`, counts the skipped
    steps of the window (non-zero: some step was skipped). :meth:`step` runs the routine and,
    every ``check_interval`` steps, reads the counter, feeds the window to
    :meth:`Loss_scaler.update_n` and clears it. Build one with :func:`gated_step`.

    :attr:`overflow_seen` (one f32 cell per parameter, sticky over the window): set where a
    step of the window had a non-finite gradient of that parameter; read at a window's end
    only when the window had a skipped step (:attr:`last_overflow`), then cleared.

    With ``accumulate=k`` the micro-batches before the ``k``-th run gradient routines only;
    :attr:`comp` is the ``k``-th's, and ``check_interval`` counts optimizer steps.

    The scale changes only at window ends, so after an overflow the rest of its window is
    likely skipped too: the price of not waiting for the device every step.
    """

    def __init__(self, scaler: Loss_scaler, loss: Tensor, optimizer: Optimizer, *,
                 check_interval: int = 16, reducer: GradReducer | None = None,
                 clip: Clip | None = None, accumulate: int = 1) -> None:
        if not _is_int(check_interval) or check_interval < 1:
            raise ValueError(f"check_interval must be an integer >= 1, got {check_interval!r}")
        super().__init__(scaler, loss, optimizer, reducer=reducer, clip=clip,
                         accumulate=accumulate)
        self.check_interval = int(check_interval)
        finite = apply("isfinite", Get(self.checksum.value, ()))
        update = optimizer.update(loss, grad_unscale=self.unscale, gate=finite,
                                  clip=self.clipper)
        flag = T.term(np.float32(0.0), label=f"nonfinite_seen_{loss.label}", prec=Precision.f32)
        seen = Get(flag.value, ())
        count = Accum(flag.value, (), "=",
                      apply("where", finite, seen, apply("add", seen, Const(1.0))), ())
        n = len(loss.params)
        sticky = Tnode(f"overflow_seen_{loss.label}", (n,), Precision.f32, zero_start=True)
        keep = apply("isfinite", Get(self.grad_flags.value, (0,)))
        mark = Accum(sticky, (0,), "=", apply("where", keep, Get(sticky, (0,)), Const(1.0)),
                     (n,))
        # With a reducer, the gradients are a routine of their own and ``comp`` the rest: the
        # checksum of the reduced gradients, the gated update and the count (same on every
        # process, so the counter needs no reduction of its own).
        head = self.last_grad_comp if self.check_comp is None else self.check_comp
        self.comp = Comp.seq([head, update, Comp((count, mark), "count_skipped")],
                             f"gated_step_{loss.label}")
        self._grads: Routine | None = None
        self.nonfinite_seen = flag
        self.overflow_seen = sticky
        self._routine_: Routine | None = None
        self._read_seen: Callable[[], float] | None = None

    def compile(self, ctx: Context) -> Context:
        ctx = self._compile_micro_batches(ctx)
        ctx, self._routine_ = ctx.compile(self.comp)
        self._read_seen = ctx.reader(self.nonfinite_seen)
        return self._bind(ctx)

    def step(self, ctx: Context) -> Context:
        if ctx is not self._ctx:
            self._check_ctx(ctx)  # raises, saying why
        if self.accumulate > 1:
            early = self._micro_batch(ctx)
            if early is not None:
                return early
            self.micro = 0
        if self.reducer is not None:
            ctx = self._last_grads(ctx)
        ctx = ctx.run(self._routine_)
        self.pending += 1
        if self.pending >= self.check_interval:
            ctx = self.flush(ctx)
        return ctx

    def flush(self, ctx: Context) -> Context:
        self._check_ctx(ctx)
        if self.pending == 0:
            return ctx
        assert self._read_seen is not None
        seen = self._read_seen()
        skipped = self.pending if not 0.0 <= seen <= self.pending else int(seen)
        if seen != 0.0:
            skipped = max(skipped, 1)
            ctx = ctx.set_values(self.nonfinite_seen, 0.0)
            self.last_overflow = self._overflowed(ctx.get_values(self.overflow_seen))
            if self.last_overflow:
                ctx = ctx.set_values(self.overflow_seen,
                                     np.zeros(len(self.param_names), np.float32))
        elif self.last_overflow:
            self.last_overflow = ()
        return self._close_window(ctx, self.pending, skipped)

    def state_nodes(self) -> list[Tnode]:
        """The skipped-step counter and the sticky overflow flags (a checkpoint taken
        mid-window must hold them), then the gradients when accumulating."""
        return [self.nonfinite_seen.value, self.overflow_seen, *super().state_nodes()]

    def needed_nodes(self, pending: int, micro: int) -> list[Tnode]:
        """Inside a window, the skipped-step counter and the sticky overflow flags; then,
        inside an accumulation, the gradients."""
        gate = [self.nonfinite_seen.value, self.overflow_seen] if pending else []
        return gate + super().needed_nodes(pending, micro)


def gated_step(scaler: Loss_scaler, loss: Tensor, optimizer: Optimizer, *,
               check_interval: int = 16, reducer: GradReducer | None = None,
               clip: Clip | None = None, accumulate: int = 1) -> GatedStep:
    """Build the fused, device-gated recipe (see :class:`GatedStep`; ``clip`` and
    ``accumulate`` as :class:`Recipe` says).

    ``check_interval``: how many (optimizer) steps run between two host reads of the
    skipped-step counter; 1 gives the per-step schedule exactly, larger values trade reaction
    time for fewer device syncs.
    """
    return GatedStep(scaler, loss, optimizer, check_interval=check_interval, reducer=reducer,
                     clip=clip, accumulate=accumulate)
