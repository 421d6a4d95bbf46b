"""Learning-rate schedules as objects, computed on the device from a step counter.

A schedule is passed as an optimizer's learning rate (``optim.Adam(sched)``,
``optim.SGD(lr=sched, momentum=0.9)``). It is a description, over a base learning rate, of the
rate at step ``t`` (0, 1, 2, ...), with the semantics of ``torch.optim.lr_scheduler``:

- :class:`Constant`: ``base_lr`` at every step;
- :class:`LinearLR`: the factor goes linearly from ``start_factor`` to ``end_factor`` over
  ``total_iters`` steps, then stays (a linear warm-up is a ``LinearLR`` from a small
  ``start_factor`` to 1; a linear decay one towards a small ``end_factor``);
- :class:`CosineAnnealingLR`: ``eta_min + (base_lr - eta_min) * (1 + cos(pi * t / T_max)) / 2``.
  Past ``T_max`` it goes on as torch's (recursive) scheduler does: the rate rises again, a
  cosine of period ``2 * T_max`` (torch's closed and recursive forms agree on that);
- :class:`StepLR`: ``base_lr * gamma ** (t // step_size)``;
- :class:`SequentialLR`: the schedules one after another, switching at ``milestones``; each
  starts from its own step 0 at its milestone, as torch's ``SequentialLR`` restarts it.
  :func:`warmup_cosine` builds the common warm-up-then-cosine one.

Which count drives it: the optimizer owns a one-element f32 device counter
(:attr:`ocannl.optim.Optimizer.schedule_counter`) of the *iterations of the training loop*,
applied and skipped: what a torch loop counts that calls ``scheduler.step()`` every iteration,
whether ``GradScaler`` skipped ``optimizer.step()`` or not. Each optimizer update reads it,
computes the rate (in f64, rounded once to f32, as torch passes its Python-float rate to f32
arithmetic) and advances it; under the fused gate (``mixed_prec.GatedStep``) that advance is
not gated, and under the host gate (``mixed_prec.ScaledStep``) a skipped step runs the
optimizer's :meth:`~ocannl.optim.Optimizer.schedule_tick` instead of the update. Adam's own step
counter (its bias correction) counts applied steps only, as torch's. No value crosses the host
boundary per step and nothing recompiles; the counter is part of the optimizer's
``state_nodes()``, so a checkpoint holds it and a resumed run continues the schedule exactly.

The counter is an f32 integer: exact up to ``2**24`` (16,777,216) iterations. Every step count
a schedule takes (``total_iters``, ``T_max``, ``step_size``, milestones) is refused above that;
a run longer than that stops advancing the counter at ``2**24`` (``2**24 + 1`` rounds back to
``2**24``) and keeps the rate of step ``2**24 - 1`` from then on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ocannl.errors import finite_real, is_int
from ocannl.ir.assignments import Const, Expr, apply

__all__ = ["MAX_STEPS", "CosineAnnealingLR", "Constant", "LinearLR", "Schedule", "SequentialLR",
           "StepLR", "warmup_cosine"]

MAX_STEPS = 2**24
"""The largest step count a schedule takes: the f32 counter is exact up to it."""


def _real(owner: str, name: str, x: object) -> float:
    return finite_real(f"{owner}: {name}", x)


def _steps(owner: str, name: str, x: object, *, low: int = 1) -> int:
    """An integer step count in ``[low, MAX_STEPS]``, or ``ValueError`` naming it."""
    if not is_int(x):
        raise ValueError(f"{owner}: {name} must be an integer number of steps, got "
                         f"{type(x).__name__}: {x!r:.80}")
    v = int(x)
    if not low <= v <= MAX_STEPS:
        raise ValueError(f"{owner}: {name} must be an integer in [{low}, 2**24 = {MAX_STEPS}] "
                         f"(the step counter is an exact f32 integer up to 2**24), got {v!r:.80}")
    return v


def _base(owner: str, base_lr: object) -> float:
    v = _real(owner, "base_lr", base_lr)
    if v < 0:
        raise ValueError(f"{owner}: base_lr must be >= 0, got {base_lr!r}")
    return v


class Schedule:
    """A learning rate as a function of the step ``t``; see the module docstring.

    :meth:`lr_expr` is the rate as a device expression of the counter (computed in f64);
    :meth:`lr_at` the same closed form on the host, in Python floats, for logging and tests.
    Schedules are immutable descriptions: one may serve several optimizers, each with its own
    counter. ``repr`` names every parameter (a run can store it in its checkpoint's progress and
    refuse to resume under another schedule).
    """

    base_lr: float

    def lr_expr(self, t: Expr) -> Expr:
        """The rate at step ``t`` (an expression of the counter; evaluated in f64)."""
        raise NotImplementedError

    def lr_at(self, t: int) -> float:
        """The rate at step ``t`` on the host (Python floats: f64)."""
        raise NotImplementedError

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__}.{name} is read-only: build a new schedule")

    def _put(self, **fields: object) -> None:
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    def _check_step(self, t: object) -> int:
        return _steps(type(self).__name__, "t", t, low=0)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))


class Constant(Schedule):
    """``base_lr`` at every step (a schedule to put in a :class:`SequentialLR`)."""

    def __init__(self, base_lr: float) -> None:
        self._put(base_lr=_base("Constant", base_lr))

    def lr_expr(self, t: Expr) -> Expr:
        return Const(self.base_lr)

    def lr_at(self, t: int) -> float:
        self._check_step(t)
        return self.base_lr

    def __repr__(self) -> str:
        return f"Constant({self.base_lr!r})"


class LinearLR(Schedule):
    """``torch.optim.lr_scheduler.LinearLR``: ``base_lr * (start_factor + (end_factor -
    start_factor) * min(t, total_iters) / total_iters)``. ``start_factor`` in (0, 1] and
    ``end_factor`` in [0, 1], as torch's; ``total_iters`` >= 1 (torch's divides by it)."""

    def __init__(self, base_lr: float, *, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
                 total_iters: int = 5) -> None:
        owner = "LinearLR"
        base = _base(owner, base_lr)
        start = _real(owner, "start_factor", start_factor)
        end = _real(owner, "end_factor", end_factor)
        if not 0.0 < start <= 1.0:
            raise ValueError(f"{owner}: start_factor must be in (0, 1], got {start_factor!r}")
        if not 0.0 <= end <= 1.0:
            raise ValueError(f"{owner}: end_factor must be in [0, 1], got {end_factor!r}")
        total = _steps(owner, "total_iters", total_iters)
        self._put(base_lr=base, start_factor=start, end_factor=end, total_iters=total)

    def lr_expr(self, t: Expr) -> Expr:
        done = apply("min", t, Const(float(self.total_iters)))
        ramp = apply("div", apply("mul", Const(self.end_factor - self.start_factor), done),
                     Const(float(self.total_iters)))
        return apply("mul", Const(self.base_lr), apply("add", Const(self.start_factor), ramp))

    def lr_at(self, t: int) -> float:
        t = self._check_step(t)
        ramp = (self.end_factor - self.start_factor) * min(t, self.total_iters) / self.total_iters
        return self.base_lr * (self.start_factor + ramp)

    def __repr__(self) -> str:
        return (f"LinearLR({self.base_lr!r}, start_factor={self.start_factor!r}, "
                f"end_factor={self.end_factor!r}, total_iters={self.total_iters})")


class CosineAnnealingLR(Schedule):
    """``torch.optim.lr_scheduler.CosineAnnealingLR``: ``eta_min + (base_lr - eta_min) *
    (1 + cos(pi * t / T_max)) / 2``, periodic past ``T_max`` as torch's (the rate rises back to
    ``base_lr`` at ``2 * T_max``). ``T_max`` >= 1, ``eta_min`` >= 0.

    On the device the phase is reduced first, ``t mod 2 * T_max`` (exact for integer steps), so
    the cosine's argument stays in [0, 2 pi) however long the run."""

    def __init__(self, base_lr: float, *, T_max: int, eta_min: float = 0.0) -> None:  # noqa: N803 - torch's name
        owner = "CosineAnnealingLR"
        base = _base(owner, base_lr)
        period = _steps(owner, "T_max", T_max)
        low = _real(owner, "eta_min", eta_min)
        if low < 0:
            raise ValueError(f"{owner}: eta_min must be >= 0, got {eta_min!r}")
        self._put(base_lr=base, T_max=period, eta_min=low)

    def lr_expr(self, t: Expr) -> Expr:
        two_t = Const(2.0 * self.T_max)
        phase = apply("sub", t, apply("mul", two_t, apply("floor", apply("div", t, two_t))))
        angle = apply("div", apply("mul", Const(math.pi), phase), Const(float(self.T_max)))
        half = apply("div", apply("add", Const(1.0), apply("cos", angle)), Const(2.0))
        return apply("add", Const(self.eta_min),
                     apply("mul", Const(self.base_lr - self.eta_min), half))

    def lr_at(self, t: int) -> float:
        t = self._check_step(t) % (2 * self.T_max)
        half = (1.0 + math.cos(math.pi * t / self.T_max)) / 2.0
        return self.eta_min + (self.base_lr - self.eta_min) * half

    def __repr__(self) -> str:
        return (f"CosineAnnealingLR({self.base_lr!r}, T_max={self.T_max}, "
                f"eta_min={self.eta_min!r})")


class StepLR(Schedule):
    """``torch.optim.lr_scheduler.StepLR``: ``base_lr * gamma ** (t // step_size)``.
    ``step_size`` >= 1, ``gamma`` >= 0 (torch's default 0.1)."""

    def __init__(self, base_lr: float, *, step_size: int, gamma: float = 0.1) -> None:
        owner = "StepLR"
        base = _base(owner, base_lr)
        size = _steps(owner, "step_size", step_size)
        g = _real(owner, "gamma", gamma)
        if g < 0:
            raise ValueError(f"{owner}: gamma must be >= 0, got {gamma!r}")
        self._put(base_lr=base, step_size=size, gamma=g)

    def lr_expr(self, t: Expr) -> Expr:
        k = apply("floor", apply("div", t, Const(float(self.step_size))))
        return apply("mul", Const(self.base_lr), apply("pow", Const(self.gamma), k))

    def lr_at(self, t: int) -> float:
        t = self._check_step(t)
        return self.base_lr * self.gamma ** (t // self.step_size)

    def __repr__(self) -> str:
        return f"StepLR({self.base_lr!r}, step_size={self.step_size}, gamma={self.gamma!r})"


class SequentialLR(Schedule):
    """``torch.optim.lr_scheduler.SequentialLR``: ``schedulers[k]`` from ``milestones[k-1]``
    (the first from step 0), each restarted at its milestone (step ``t`` of the sequence is step
    ``t - milestones[k-1]`` of the ``k``-th). One milestone fewer than schedules, strictly
    increasing, each >= 1; every schedule over the same ``base_lr`` (torch's share the
    optimizer's)."""

    def __init__(self, schedulers: Sequence[Schedule], milestones: Sequence[int]) -> None:
        owner = "SequentialLR"
        if isinstance(schedulers, (str, bytes)) or not isinstance(schedulers, Sequence) \
                or not schedulers:
            raise ValueError(f"{owner}: schedulers must be a non-empty sequence of schedules, "
                             f"got {schedulers!r:.80}")
        for k, s in enumerate(schedulers):
            if not isinstance(s, Schedule):
                raise ValueError(f"{owner}: schedulers[{k}] must be a schedule (LinearLR, "
                                 f"CosineAnnealingLR, ...), got {type(s).__name__}: {s!r:.80}")
        bases = {s.base_lr for s in schedulers}
        if len(bases) != 1:
            raise ValueError(f"{owner}: every schedule must have the same base_lr (torch's "
                             f"share the optimizer's), got "
                             f"{[s.base_lr for s in schedulers]!r}")
        if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Sequence):
            raise ValueError(f"{owner}: milestones must be a sequence of step numbers, got "
                             f"{milestones!r:.80}")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"{owner}: {len(schedulers)} schedules need "
                             f"{len(schedulers) - 1} milestones, got {len(milestones)}: "
                             f"{list(milestones)!r:.80}")
        ms = [_steps(owner, f"milestones[{k}]", m) for k, m in enumerate(milestones)]
        for k in range(1, len(ms)):
            if not ms[k] > ms[k - 1]:
                raise ValueError(f"{owner}: milestones must be strictly increasing, got "
                                 f"milestones[{k - 1}]={ms[k - 1]} then milestones[{k}]={ms[k]}")
        self._put(base_lr=schedulers[0].base_lr, schedulers=tuple(schedulers),
                  milestones=tuple(ms))

    def lr_expr(self, t: Expr) -> Expr:
        starts = (0, *self.milestones)

        def local(k: int) -> Expr:
            s = self.schedulers[k]
            return s.lr_expr(t if starts[k] == 0 else apply("sub", t, Const(float(starts[k]))))

        expr = local(len(self.schedulers) - 1)
        for k in range(len(self.milestones) - 1, -1, -1):  # a select: no branch is multiplied
            expr = apply("where", apply("lt", t, Const(float(self.milestones[k]))), local(k),
                         expr)
        return expr

    def lr_at(self, t: int) -> float:
        t = self._check_step(t)
        k = sum(1 for m in self.milestones if m <= t)
        start = 0 if k == 0 else self.milestones[k - 1]
        return self.schedulers[k].lr_at(t - start)

    def __repr__(self) -> str:
        inner = ", ".join(repr(s) for s in self.schedulers)
        return f"SequentialLR([{inner}], milestones={list(self.milestones)})"


def warmup_cosine(base_lr: float, *, warmup_iters: int, T_max: int,  # noqa: N803 - torch's name
                  start_factor: float = 1e-3, eta_min: float = 0.0) -> SequentialLR:
    """A linear warm-up from ``base_lr * start_factor`` to ``base_lr`` over ``warmup_iters``
    steps, then a cosine from ``base_lr`` down to ``eta_min`` over ``T_max`` steps: torch's
    ``SequentialLR([LinearLR(...), CosineAnnealingLR(...)], milestones=[warmup_iters])``."""
    _steps("warmup_cosine", "warmup_iters", warmup_iters)
    return SequentialLR([LinearLR(base_lr, start_factor=start_factor, end_factor=1.0,
                                  total_iters=warmup_iters),
                         CosineAnnealingLR(base_lr, T_max=T_max, eta_min=eta_min)],
                        milestones=[warmup_iters])
