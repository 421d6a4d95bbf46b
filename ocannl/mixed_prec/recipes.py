"""The loss-scaled training steps over any :mod:`ocannl.optim` optimizer: :class:`ScaledStep`
(host gate) and :class:`GatedStep` (fused, device gate), one interface (:class:`Recipe`)."""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

import ocannl.tensor as T
from ocannl.context import Context, Routine
from ocannl.errors import Failure
from ocannl.ir.assignments import Accum, Comp, Const, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.mixed_prec.scale import _is_int
from ocannl.mixed_prec.scaler import Loss_scaler, _set_good_steps
from ocannl.mixed_prec.state import parse_state
from ocannl.optim import Optimizer
from ocannl.tensor.tensor import Tensor

if TYPE_CHECKING:
    from ocannl.clipping import Clip

__all__ = ["GatedStep", "GradReducer", "Recipe", "ScaledStep", "gated_step",
           "scaled_grad_update", "scaled_step"]

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
        """Run after the gradient routine, before the checksum and the optimizer step. A
        reducer may instead have ``run_and_reduce(ctx, routine, scaler)``, which runs the
        last micro-batch's gradient routine itself (to overlap its exchange with it)."""
        ...


def _optimizer_shard(reducer: GradReducer | None) -> Any:
    """The slice of the optimizer's state a reducer gives this process (ZeRO-1:
    ``DataParallel(shard_optimizer=True)``), or None: a reducer that shards the state has an
    ``optimizer_shard`` and an ``after_update(ctx, applied)`` that gathers the parameters."""
    return getattr(reducer, "optimizer_shard", None)


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
        self._gathers = _optimizer_shard(reducer) is not None
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
        fields = " ".join(f"{k}={_NUM}" for k in _COUNTERS) + rf" overflow={_NAMES}{_NEEDS}"
        m = parse_state(s, kind=name, version=_RECIPE_STATE_VERSION, fields=fields,
                        expected=expected, who=f"{name}.restore_state")
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

    def _before_step(self, ctx: Context) -> Context | None:
        """Check ``ctx`` is the compiled one (raising, saying why); run a micro-batch that is
        not the last of its accumulation and return its context, else None: the step goes on."""
        if ctx is not self._ctx:
            self._check_ctx(ctx)
        if self.accumulate > 1:
            early = self._micro_batch(ctx)
            if early is not None:
                return early
            self.micro = 0
        return None

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
        routine = self._first if self.accumulate == 1 else self._more
        run_and_reduce = getattr(self.reducer, "run_and_reduce", None)
        if run_and_reduce is not None:  # it may start exchanges while the routine runs
            return run_and_reduce(ctx, routine, self.scaler)
        return self.reducer.reduce(ctx.run(routine), self.scaler)

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
    :class:`GatedStep` avoids. On the CPU the two routines and the read are one call once both
    routines are ready (``Context._gated``): the same steps, the host's work a few calls. With
    ``accumulate=k``, the read, the optimizer routine and the scaler update come after every
    ``k``-th micro-batch only. Build one with :func:`scaled_step`.

    A skipped step runs the optimizer's ``schedule_tick()`` (when its learning rate is a
    schedule) instead of the update: the schedule counts every iteration (every optimizer
    step, under accumulation), as under the fused gate, while Adam's step counter and every
    other state keep their bits."""

    def __init__(self, scaler: Loss_scaler, loss: Tensor, optimizer: Optimizer, *,
                 reducer: GradReducer | None = None, clip: Clip | None = None,
                 accumulate: int = 1) -> None:
        super().__init__(scaler, loss, optimizer, reducer=reducer, clip=clip,
                         accumulate=accumulate)
        self.update_comp = optimizer.update(loss, grad_unscale=self.unscale, clip=self.clipper,
                                            shard=_optimizer_shard(reducer))
        self.tick_comp = optimizer.schedule_tick()  # None without a learning-rate schedule
        self._tick: Routine | None = None
        self._grads: Routine | None = None
        self._check: Routine | None = None
        self._update: Routine | None = None
        self._read_checksum: Callable[[], float] | None = None
        self._reader_fresh = False
        self._steady: Callable[[], Context] | None = None

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
        self._steady = None
        return self._bind(ctx)

    def step(self, ctx: Context) -> Context:
        steady = self._steady
        if steady is not None and ctx is self._ctx:
            return steady()
        early = self._before_step(ctx)
        if early is not None:
            return early
        if self.reducer is None:
            ctx = ctx.run(self._grads)
        else:
            ctx = self._last_grads(ctx)
            ctx = ctx.run(self._check)
        ctx = self._gate(ctx, _isfinite(self._read_checksum()))
        if not self._reader_fresh:
            # The checksum has been written now: its reader made now is the backend's own,
            # with no check left (the one made at compile checks until the first run).
            self._read_checksum = ctx.reader(self.checksum)
            self._reader_fresh = True
            self._steady = self._steady_step(ctx)
        return ctx

    def _steady_step(self, ctx: Context) -> Callable[[], Context] | None:
        """The plain step's every-step path, once the reader is the backend's own: what
        :meth:`step` does, with the lookups made once and :meth:`Context.run`'s and
        :meth:`Loss_scaler.update`'s steady states inline; on the CPU the two routines and
        the checksum's test are one call (``Context._gated``). A step of a small model is a
        few microseconds, and the general path's calls and lookups were a tenth of
        mlp_small's f16 step (0.5 us). Only where both are the library's own (a subclass
        overriding either sees every call) and with no reducer or accumulation; ``None``
        elsewhere. While a routine is not ready (a kept twin gone stale) both go through
        :meth:`Context.run`'s checks; a skipped step goes on in :meth:`_gate`."""
        grads, update, read, scaler = self._grads, self._update, self._read_checksum, self.scaler
        if (self.reducer is not None or self.accumulate != 1 or type(ctx).run is not Context.run
                or type(scaler).update is not Loss_scaler.update):
            return None
        assert grads is not None and update is not None and read is not None
        both = ctx._gated(grads, update, self.checksum)  # one call where the backend has it

        def steady() -> Context:
            if both is not None and grads._ready_in is ctx and update._ready_in is ctx:
                if not both():
                    return self._gate(ctx, False)
            else:
                ctx.run(grads)
                if not _isfinite(read()):
                    return self._gate(ctx, False)
                ctx.run(update)
            if self.last_overflow:
                self.last_overflow = ()
            self.applied_steps += 1
            self.windows += 1
            self.last_applied = True
            good = scaler.good_steps + 1  # Loss_scaler.update's every-step count, inline
            if good < scaler.growth_interval:
                _set_good_steps(scaler, good)
                return ctx
            return scaler.update(ctx, grads_finite=True)  # it grows the scale

        return steady

    def _gate(self, ctx: Context, finite: bool) -> Context:
        """After the checksum is read: the update or the skip, then the scaler's update."""
        if finite:
            ctx = ctx.run(self._update)
            if self.last_overflow:
                self.last_overflow = ()
        else:
            if self._tick is not None:
                ctx = ctx.run(self._tick)  # the schedule counts skipped iterations too
            self.last_overflow = self._overflowed(ctx.get_values(self.grad_flags))
        if self._gathers:  # a skipped step changed no parameter: nothing to gather then
            ctx = self.reducer.after_update(ctx, finite)  # type: ignore[union-attr]
        ctx = self.scaler.update(ctx, grads_finite=finite)  # a window of one step
        self._count_window(1, 0 if finite else 1)
        self.last_applied = finite
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
                                  clip=self.clipper, shard=_optimizer_shard(reducer))
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
        early = self._before_step(ctx)
        if early is not None:
            return early
        if self.reducer is not None:
            ctx = self._last_grads(ctx)
        ctx = ctx.run(self._routine_)
        if self._gathers:  # the gate is on the device: gather whether or not it applied
            ctx = self.reducer.after_update(ctx, True)  # type: ignore[union-attr]
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
