"""Optimizers as objects that own their state: :class:`SGD`, :class:`Adam`, :class:`AdamW`.

An optimizer holds its hyperparameters and, per parameter, the device buffers it keeps between
steps (momentum; Adam's first and second moments), created on first use as
``Tnode(..., zero_start=True)``: all zeros is their defined start, so a context counts them as
initialized when it allocates them. Adam's step counter is a one-element device node of the
same kind, advanced *inside* the update computation, so a checkpoint holding
:meth:`Optimizer.state_nodes` resumes exactly and a gated-off step leaves it as it was.

:meth:`Optimizer.update` returns the update as a :class:`~ocannl.ir.assignments.Comp` over every
parameter of a loss; sequence it after ``train.grad_update`` and compile the whole step once.
The arithmetic follows ``torch.optim`` (single-tensor implementations) operation for operation.

The learning rate is a float (folded into the code), a one-element tensor (the host sets it)
or a :mod:`ocannl.schedules` schedule, computed on the device from the optimizer's own step
counter (:attr:`Optimizer.schedule_counter`, the loop's iterations, skipped ones included). It
is given as ``learning_rate=`` or, as PyTorch names it, ``lr=``.

A new optimizer is one subclass of :class:`Optimizer`: it names its per-parameter buffers
(``buffer_names``) and writes :meth:`Optimizer._param_update` (and, for optimizer-wide device
scalars, :meth:`Optimizer._prologue`).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ocannl.backends.rounding import to_precision
from ocannl.errors import finite_real, is_real, real
from ocannl.ir.assignments import Accum, Comp, Const, Expr, Fixed, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.schedules import Schedule
from ocannl.tensor.tensor import Tensor

if TYPE_CHECKING:
    from ocannl.clipping import GradClipper
    from ocannl.parallel.zero import OptimizerShard, Part

__all__ = ["SGD", "Adam", "AdamW", "FiniteRate", "LearningRate", "Optimizer", "Scalar",
           "gated_store", "scalar_expr"]

Scalar = float | Tensor
LearningRate = float | Tensor | Schedule


def scalar_expr(x: Scalar, what: str) -> Expr:
    """A float as a literal, a one-element tensor as a read of its buffer (so the host can
    change it with ``Context.set_values`` without recompiling)."""
    if isinstance(x, Tensor):
        if x.value.size != 1:
            raise ValueError(f"{what} must be a one-element tensor, got {x.label} {x.shape}")
        if x.const is not None:
            return Const(x.const)
        return Get(x.value, tuple(Fixed(0) for _ in x.dims))
    if is_real(x):
        return Const(finite_real(what, x))
    raise TypeError(f"{what} must be a float or a one-element Tensor, got {type(x).__name__}")


def require_scalar_loss(loss: Tensor, what: str) -> None:
    """``ValueError`` naming the shape unless ``loss`` is one cell: seeding a wider tensor's
    gradient with ones would silently optimize the sum of its cells (torch: "grad can be
    implicitly created only for scalar outputs")."""
    if math.prod(loss.dims) != 1:
        raise ValueError(f"{what}: loss {loss.label} {loss.shape} has {math.prod(loss.dims)} "
                         f"cells, expected one (a scalar): reduce it first, e.g. T.mean(...)")


def gated_store(node: Tnode, idx: tuple[int, ...], new: Expr, gate: Expr | None) -> Accum:
    """``node[idx] = new`` over the node's extent; with a ``gate``, a select: where the gate is
    0 the cell keeps its old bits (never a multiply by a 0/1 flag: ``inf * 0`` is NaN)."""
    if gate is not None:
        new = apply("where", gate, new, Get(node, idx))
    return Accum(node, idx, "=", new, node.dims)


class FiniteRate:
    """A node's ``check_values`` (see :class:`~ocannl.ir.tnode.Tnode`) for a node an optimizer
    reads as a rate: ``Context.set_values`` refuses a value that is not finite in the node's
    precision, naming the node, before writing anything. A NaN written there would be applied
    to every weight: the gates check only the gradients, and skipping such steps instead would
    stall the run silently. The rule is the node's, so it holds in every context. Any check the
    node had already runs first."""

    def __init__(self, node: Tnode, reader: str) -> None:
        self.node, self.reader, self.previous = node, reader, node.check_values

    @classmethod
    def register(cls, node: Tnode, reader: str, owner: str) -> None:
        """Give ``node`` this check (once: a rate shared by two optimizers keeps the first);
        ``ValueError`` naming the node when its host values (copied into every context that
        allocates it) are not finite already."""
        if isinstance(node.check_values, cls):
            return
        check = cls(node, reader)
        if node.host_data is not None:
            bad = check.first_bad(np.asarray(node.host_data))
            if bad is not None:
                raise ValueError(f"{owner}: {node.name}, {reader}, holds {bad}: expected a "
                                 f"finite number")
        node.check_values = check

    def first_bad(self, values: np.ndarray) -> str | None:
        """The first value that is not finite once rounded to the node's precision, described
        (``nan``; ``1e+39 (inf in f32)``), or None."""
        with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            stored = to_precision(values, self.node.prec).astype(np.float64)
        ok = np.isfinite(stored)
        if ok.all():
            return None
        k = int(np.argmin(ok.ravel()))
        given = float(np.asarray(values, np.float64).ravel()[k])
        rounded = float(stored.ravel()[k])
        return repr(given) if not math.isfinite(given) else \
            f"{given!r} ({rounded!r} in {self.node.prec.value})"

    def __call__(self, values: np.ndarray) -> None:
        if self.previous is not None:
            self.previous(values)
        bad = self.first_bad(values)
        if bad is not None:
            raise ValueError(f"set_values on {self.node.name}: {self.reader} must be finite, "
                             f"got {bad}; nothing was written")


def _learning_rate_argument(owner: str, learning_rate: LearningRate | None,
                            lr: LearningRate | None,
                            default: LearningRate | None) -> LearningRate:
    """The learning rate given as ``learning_rate=`` or as ``lr=`` (PyTorch's name): both is
    ambiguous and refused, naming both; neither is ``default`` (refused where there is none)."""
    if learning_rate is not None and lr is not None:
        raise ValueError(f"{owner}: learning_rate={learning_rate!r:.60} and lr={lr!r:.60} both "
                         f"given: pass one of them (lr= is PyTorch's name for learning_rate=)")
    given = learning_rate if learning_rate is not None else lr
    if given is None:
        if default is None:
            raise TypeError(f"{owner} needs a learning rate: pass learning_rate= or lr=")
        return default
    return given


def _flag(name: str, x: object) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {type(x).__name__}: {x!r}")
    return bool(x)


class UpdateClip:
    """What :meth:`Optimizer.update` takes as ``clip=``: a rewrite of each unscaled gradient and
    of the update's gate. :class:`ocannl.clipping.GradClipper` is the one implementation; the
    interface lives here so that optim, a layer below clipping, never imports it."""

    def check_for(self, loss: Tensor, grad_unscale: Scalar | None) -> None:
        """``ValueError`` unless the rewrite was built for ``loss`` and ``grad_unscale``."""
        raise NotImplementedError

    def gate(self, gate: Expr | None) -> Expr | None:
        """``gate`` with the rewrite's own condition folded in."""
        raise NotImplementedError

    def apply(self, g: Expr) -> Expr:
        """The rewritten form of one unscaled gradient element ``g``."""
        raise NotImplementedError


class Optimizer:
    """What every optimizer shares: the learning rate, the per-parameter buffers (a dict keyed
    by parameter, created on first use), and :meth:`update`'s walk over a loss's parameters.

    ``learning_rate``: a float (folded into the code), a one-element tensor (read from its
    buffer at every step, so the host can change it without recompiling, to finite values
    only: see :class:`FiniteRate`) or a schedule (:mod:`ocannl.schedules`). Floats may be any
    real number type, NumPy scalars included, but not bool. ``buffers``: the per-parameter
    buffer table to use instead of a fresh one, for optimizers that must share their buffers
    (``train.sgd_update`` passes one, so repeated calls on one model share its momentum, as
    OCANNL's functional ``sgd_update`` does).

    With a schedule, the optimizer owns :attr:`schedule_counter`, a one-element f32 device node
    (zero-started, exact up to 2**24) counting the loop's iterations, applied and skipped, as a
    torch loop calling ``scheduler.step()`` every iteration does. Each update first advances it
    (never gated: a step skipped by the fused gate still counts) and computes the step's rate
    from its previous value in f64 (:attr:`lr_f64`), rounded once to the f32 node
    :attr:`lr_node` that the parameter loops read and the host may read (the rate of the last
    iteration). A recipe that skips the update on the host runs :meth:`schedule_tick` instead.
    The counter is the last of :meth:`state_nodes`, so checkpoints hold it.
    """

    label = "optimizer"  # prefix of the update computation's label and of optimizer-wide nodes

    def __init__(self, learning_rate: LearningRate, *,
                 buffers: MutableMapping[Tensor, dict[str, Tnode]] | None = None) -> None:
        owner = type(self).__name__
        self.schedule: Schedule | None = None
        self.schedule_counter: Tnode | None = None
        self.lr_f64: Tnode | None = None
        self.lr_node: Tnode | None = None
        if isinstance(learning_rate, Schedule):
            self.schedule = learning_rate
            self.schedule_counter = Tnode(f"{self.label}_lr_step", (), Precision.f32,
                                          zero_start=True)
            self.lr_f64 = Tnode(f"{self.label}_lr_f64", (), Precision.f64)
            self.lr_node = Tnode(f"{self.label}_lr", (), Precision.f32)
            FiniteRate.register(self.schedule_counter,
                                f"the step counter {owner}'s schedule reads its rate from", owner)
        else:
            try:
                scalar_expr(learning_rate, "learning_rate")  # type and finiteness
            except TypeError:
                raise TypeError(f"learning_rate must be a float or a one-element Tensor, or a "
                                f"schedule (ocannl.schedules), got "
                                f"{type(learning_rate).__name__}: {learning_rate!r:.80}") \
                    from None
            if not isinstance(learning_rate, Tensor):
                if learning_rate < 0:
                    raise ValueError(f"learning_rate must be >= 0, got {learning_rate!r}")
            elif learning_rate.const is None:  # a buffer the host writes: finite values only
                FiniteRate.register(learning_rate.value, f"the learning rate of {owner}", owner)
        self.learning_rate = learning_rate
        self._state: MutableMapping[Tensor, dict[str, Tnode]] = {} if buffers is None \
            else buffers
        self._parts: dict[Part, dict[str, Tnode]] = {}  # ZeRO-1: a rank's parts' buffers
        self.shard: OptimizerShard | None = None  # set by an update over a shard

    # --- what a subclass defines ----------------------------------------------------------------

    def buffer_names(self) -> tuple[str, ...]:
        """The names of the buffers kept per parameter, in checkpoint order."""
        return ()

    def scalar_nodes(self) -> list[Tnode]:
        """Optimizer-wide device state (Adam's step counter)."""
        return []

    def _prologue(self, lr: Expr, gate: Expr | None) -> list[Accum]:
        """Assignments run once per update, before the parameters' (the step counter). ``lr``
        is the rate at its widest: with a schedule, a read of the f64 node :attr:`lr_f64`
        (scalars derived from it are best computed in f64 and rounded once, as torch does on
        the host); the parameter loops get the f32 :attr:`lr_node`."""
        return []

    def _param_update(self, value: Tnode, state: dict[str, Tnode], idx: tuple[int, ...],
                      g: Expr, lr: Expr, gate: Expr | None) -> list[Accum]:
        """The stores updating a parameter's ``value`` and its buffers ``state`` (name ->
        node, of the value's dims), given its (unscaled) gradient ``g``: elementwise, so the
        same code updates a whole parameter or a rank's part of it (ZeRO-1)."""
        raise NotImplementedError

    # --- state ----------------------------------------------------------------------------------

    def state_of(self, p: Tensor) -> dict[str, Tnode]:
        """``p``'s buffers (name -> node), created zero-started on first use."""
        if not isinstance(p, Tensor) or p.kind != "param" or p.grad is None:
            raise ValueError(f"{type(self).__name__}: {p!r} is not a differentiable parameter")
        state = self._state.setdefault(p, {})
        for name in self.buffer_names():
            if name not in state:
                state[name] = Tnode(f"{name}_{p.label}", p.dims, p.prec, zero_start=True)
        return state

    def part_state(self, part: Part) -> dict[str, Tnode]:
        """The buffers of a rank's part of a parameter (ZeRO-1, :mod:`ocannl.parallel.zero`):
        1-D, of the part's size, zero-started. A checkpoint names them by the whole
        parameter's buffers (:meth:`state_of`), which ``DataParallel.save`` gathers."""
        state = self._parts.setdefault(part, {})
        for name in self.buffer_names():
            if name not in state:
                state[name] = Tnode(f"{name}_{part.value.label}", (part.size,), part.value.prec,
                                    zero_start=True)
        return state

    def state_nodes(self) -> list[Tnode]:
        """Every device node this optimizer keeps between steps: each parameter's buffers
        (parameters in creation order, buffers in ``buffer_names`` order), then the
        optimizer-wide ones. What a checkpoint must hold beyond the parameters."""
        nodes: list[Tnode] = []
        names = self.buffer_names()
        for p in sorted(self._state, key=lambda t: t.value.id):
            state = self._state[p]
            nodes.extend(state[name] for name in names if name in state)
        schedule = [] if self.schedule_counter is None else [self.schedule_counter]
        return nodes + self.scalar_nodes() + schedule

    # --- the learning rate ----------------------------------------------------------------------

    def _learning_rate(self) -> tuple[list[Accum], Expr, Expr]:
        """The code computing this step's learning rate (none for a float or a tensor) and
        the rate as read by the prologue (widest) and by the parameter loops (f32)."""
        if self.schedule is None:
            lr = scalar_expr(self.learning_rate, "learning_rate")
            return [], lr, lr
        return self._schedule_code(), Get(self.lr_f64, ()), Get(self.lr_node, ())

    def _schedule_code(self) -> list[Accum]:
        """Advance the counter, then the rate of the step it counted, from its previous value
        (``counter - 1``: nothing writes the counter after the rate is computed)."""
        assert self.schedule is not None and self.schedule_counter is not None
        assert self.lr_f64 is not None and self.lr_node is not None
        t = Get(self.schedule_counter, ())
        return [Accum(self.schedule_counter, (), "=", apply("add", t, Const(1.0)), ()),
                Accum(self.lr_f64, (), "=",
                      self.schedule.lr_expr(apply("sub", t, Const(1.0))), ()),
                Accum(self.lr_node, (), "=", Get(self.lr_f64, ()), ())]

    def schedule_tick(self) -> Comp | None:
        """What an iteration whose update does not run must still do (None without a
        schedule): advance the schedule's counter (and compute the skipped iteration's rate
        into :attr:`lr_node`). ``mixed_prec.ScaledStep`` runs it on a skipped step, so both
        gates count the same iterations."""
        if self.schedule is None:
            return None
        return Comp(tuple(self._schedule_code()), f"{self.label}_schedule_tick")

    # --- the update -----------------------------------------------------------------------------

    def update(self, loss: Tensor, *, grad_unscale: Scalar | None = None,
               gate: Expr | None = None, clip: GradClipper | None = None,
               shard: OptimizerShard | None = None,
               order: Sequence[Tensor] | None = None) -> Comp:
        """One optimizer step over every parameter of ``loss``, reading their gradients (run it
        after ``train.grad_update(loss)``).

        ``grad_unscale`` multiplies each gradient before any optimizer math, so momentum and
        moments see true magnitudes under loss scaling. ``gate``: an expression; where it is 0,
        every store of this computation (parameters, buffers, the step counter) keeps its old
        bits -- a skipped step changes no training state -- but for a schedule's counter, which
        counts every iteration. ``clip`` (a :class:`ocannl.clipping.GradClipper` built for this
        loss and ``grad_unscale``): each unscaled gradient is clipped before the optimizer math,
        and the gate covers the norm; run the clipper's ``comp`` before this update
        (``clipping.clipped_update`` does). ``shard`` (ZeRO-1, from ``DataParallel(
        shard_optimizer=True).optimizer_shard``): update only this rank's parts of the
        parameters, with buffers of their size (:meth:`part_state`); the data-parallel
        reducer gathers the parameters after it. ``order``: the parameters in the order their
        updates run (every one of the loss's, once; default the loss's order): each update is
        elementwise and apart, so the order changes no bit, only when each parameter's
        gradient is first needed (``DataParallel.update_order``: as its buckets' sums arrive).
        """
        if not isinstance(loss, Tensor):
            raise TypeError(f"update expects the loss Tensor, got {type(loss).__name__}")
        if loss.grad is None:
            raise ValueError(f"loss {loss.label} depends on no parameter: nothing to update")
        require_scalar_loss(loss, f"{self.label}.update")
        lr_code, lr_wide, lr = self._learning_rate()  # with a schedule: advances its counter
        unscale = None if grad_unscale is None else scalar_expr(grad_unscale, "grad_unscale")
        if clip is not None:
            if not isinstance(clip, UpdateClip):
                raise TypeError(f"clip must be a clipping.GradClipper (clipping.clipper(spec, "
                                f"loss)), got {type(clip).__name__}: {clip!r:.80}; "
                                f"clipping.clipped_update builds both")
            clip.check_for(loss, grad_unscale)
            gate = clip.gate(gate)
        rank = self._update_rank(loss, order)
        targets: list[tuple[Tnode, Tnode, dict[str, Tnode]]] = []
        if shard is None:
            for p in sorted(loss.params, key=lambda p: rank[p.value.id]):
                assert p.grad is not None
                targets.append((p.value, p.grad, self.state_of(p)))
        else:
            if [p.value.id for p in shard.params] != [p.value.id for p in loss.params]:
                raise ValueError(f"{self.label}.update: {shard!r} was cut from another model's "
                                 f"parameters than loss {loss.label}'s")
            shard.bind(self)
            self.shard = shard
            for p in loss.params:
                self.state_of(p)  # the whole buffers: the names a checkpoint holds
            targets = [(q.value, q.grad, self.part_state(q))
                       for q in sorted(shard.parts, key=lambda q: rank[q.param.value.id])]
        code = lr_code + self._prologue(lr_wide, gate)
        for value, grad, state in targets:
            idx = tuple(range(len(value.dims)))
            g: Expr = Get(grad, idx)
            if unscale is not None:
                g = apply("mul", g, unscale)
            if clip is not None:
                g = clip.apply(g)
            code.extend(self._param_update(value, state, idx, g, lr, gate))
        return Comp(tuple(code), f"{self.label}_{loss.label}")


    def _update_rank(self, loss: Tensor, order: Sequence[Tensor] | None) -> dict[int, int]:
        """Each parameter's place in the update's order (by its value node's id), checked:
        ``order`` holds every parameter of the loss once, and nothing else."""
        params = list(loss.params)
        if order is None:
            return {p.value.id: i for i, p in enumerate(params)}
        given = list(order)
        ids = [getattr(getattr(p, "value", None), "id", None) for p in given]
        want = [p.value.id for p in params]
        if Counter(ids) != Counter(want):
            names = {p.value.id: p.label for p in params}
            extra = [getattr(p, "label", repr(p)) for p, i in zip(given, ids, strict=True)
                     if i not in names]
            missing = [names[i] for i in want if i not in ids]
            twice = sorted({names[i] for i in ids if i in names and ids.count(i) > 1})
            raise ValueError(f"{self.label}.update: order must list each of the loss's "
                             f"{len(want)} parameters once; missing {missing}, not the loss's "
                             f"{extra}, twice {twice}")
        return {i: k for k, i in enumerate(ids)}


class SGD(Optimizer):
    """``torch.optim.SGD`` with dampening 0: optional momentum, Nesterov momentum and (L2)
    weight decay added to the gradient."""

    label = "sgd"

    def __init__(self, learning_rate: LearningRate | None = None, *,
                 lr: LearningRate | None = None, momentum: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False,
                 buffers: MutableMapping[Tensor, dict[str, Tnode]] | None = None) -> None:
        rate = _learning_rate_argument("SGD", learning_rate, lr, None)
        m, wd = real("momentum", momentum), real("weight_decay", weight_decay)
        if not 0.0 <= m < 1.0 or not math.isfinite(wd) or wd < 0:
            raise ValueError(f"momentum must be in [0, 1) and weight_decay >= 0, got "
                             f"momentum={momentum!r}, weight_decay={weight_decay!r}")
        if _flag("nesterov", nesterov) and m == 0.0:
            raise ValueError(f"nesterov momentum needs momentum > 0, got momentum={momentum!r}")
        # the rate last: a refused construction leaves a rate tensor as it was
        super().__init__(rate, buffers=buffers)
        self.momentum, self.weight_decay, self.nesterov = m, wd, bool(nesterov)

    def buffer_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def _param_update(self, value_node: Tnode, state: dict[str, Tnode], idx: tuple[int, ...],
                      g: Expr, lr: Expr, gate: Expr | None) -> list[Accum]:
        value = Get(value_node, idx)
        if self.weight_decay:
            g = apply("add", g, apply("mul", Const(self.weight_decay), value))
        code: list[Accum] = []
        step = g
        if self.momentum:
            v = state["momentum"]
            v_get = Get(v, idx)
            mu = Const(self.momentum)
            code.append(gated_store(v, idx, apply("add", apply("mul", mu, v_get), g), gate))
            step = apply("add", g, apply("mul", mu, v_get)) if self.nesterov else v_get
        code.append(gated_store(value_node, idx, apply("sub", value, apply("mul", lr, step)),
                                gate))
        return code

    def __repr__(self) -> str:
        return (f"SGD(learning_rate={self.learning_rate!r}, momentum={self.momentum!r}, "
                f"weight_decay={self.weight_decay!r}, nesterov={self.nesterov!r})")


class Adam(Optimizer):
    """``torch.optim.Adam``: bias-corrected first and second moments, ``eps`` added outside the
    square root, L2 ``weight_decay`` added to the gradient, optional ``amsgrad`` (the running
    maximum of the second moment).

    The step counter is the one-element f32 device node :attr:`step_counter` (exact up to
    2**24 steps, far past where the bias corrections round to 1). Each update increments it
    first (gated like every other store), then computes the step's scalars once, as torch does
    on the host: ``lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)`` (and AdamW's
    ``1 - lr * weight_decay``) in f64, each rounded once to an f32 scratch node that the
    parameter loops read. (In f32, ``1 - 0.999**t`` would be off by 1e-5 relative.)
    """

    label = "adam"
    decoupled = False  # AdamW: weight decay applied to the parameter, not added to the gradient

    def __init__(self, learning_rate: LearningRate | None = None, *,
                 lr: LearningRate | None = None,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        rate = _learning_rate_argument(type(self).__name__, learning_rate, lr, 1e-3)
        if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        b1, b2 = finite_real("betas[0]", betas[0]), finite_real("betas[1]", betas[1])
        for k, b in enumerate((b1, b2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{k}] must be in [0, 1), got {b!r}")
        e = finite_real("eps", eps)
        if e < 0:
            raise ValueError(f"eps must be >= 0, got {eps!r}")
        wd = finite_real("weight_decay", weight_decay)
        if wd < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        ams = _flag("amsgrad", amsgrad)
        # the rate last: a refused construction leaves a rate tensor as it was
        super().__init__(rate)
        self.betas = (b1, b2)
        self.eps, self.weight_decay = e, wd
        self.amsgrad = ams
        self.step_counter = Tnode(f"{self.label}_step", (), Precision.f32, zero_start=True)
        # scratch scalars, recomputed by every update before they are read: (f64, f32) pairs
        self._scalars = {name: (Tnode(f"{self.label}_{name}_f64", (), Precision.f64),
                                Tnode(f"{self.label}_{name}", (), Precision.f32))
                         for name in ("step_size", "bias_correction2_sqrt", "decay")}

    def buffer_names(self) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if self.amsgrad else names

    def scalar_nodes(self) -> list[Tnode]:
        return [self.step_counter]

    def _scalar(self, name: str) -> Get:
        return Get(self._scalars[name][1], ())

    def _prologue(self, lr: Expr, gate: Expr | None) -> list[Accum]:
        b1, b2 = self.betas
        t = Get(self.step_counter, ())
        one = Const(1.0)
        wide = {
            "step_size": apply("div", lr, apply("sub", one, apply("pow", Const(b1), t))),
            "bias_correction2_sqrt": apply("sqrt", apply("sub", one,
                                                         apply("pow", Const(b2), t))),
        }
        if self.decoupled and self.weight_decay:
            wide["decay"] = apply("sub", one, apply("mul", lr, Const(self.weight_decay)))
        # The counter first: what follows reads the incremented value, as torch's
        # ``step_t += 1`` precedes the bias corrections. A gated-off step leaves it as it was
        # (the scalars computed from it then go unused: every store below is gated too).
        code = [gated_store(self.step_counter, (), apply("add", t, one), gate)]
        for name, expr in wide.items():
            w, n = self._scalars[name]
            code.append(Accum(w, (), "=", expr, ()))
            code.append(Accum(n, (), "=", Get(w, ()), ()))
        return code

    def _decayed(self, value: Expr) -> Expr:
        """The parameter before the gradient step: decoupled decay ``p * (1 - lr * wd)``."""
        if not (self.decoupled and self.weight_decay):
            return value
        return apply("mul", value, self._scalar("decay"))

    def _param_update(self, value_node: Tnode, state: dict[str, Tnode], idx: tuple[int, ...],
                      g: Expr, lr: Expr, gate: Expr | None) -> list[Accum]:
        b1, b2 = self.betas
        value = Get(value_node, idx)
        if self.weight_decay and not self.decoupled:
            g = apply("add", g, apply("mul", Const(self.weight_decay), value))
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m_get, v_get = Get(m, idx), Get(v, idx)
        # exp_avg.lerp_(g, 1 - b1); exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_new = apply("add", m_get, apply("mul", Const(1.0 - b1), apply("sub", g, m_get)))
        v_new = apply("add", apply("mul", v_get, Const(b2)),
                      apply("mul", apply("mul", Const(1.0 - b2), g), g))
        code = [gated_store(m, idx, m_new, gate), gated_store(v, idx, v_new, gate)]
        second: Expr = Get(v, idx)
        if self.amsgrad:
            vmax = state["max_exp_avg_sq"]
            code.append(gated_store(vmax, idx, apply("max", Get(vmax, idx), Get(v, idx)), gate))
            second = Get(vmax, idx)
        # denom = sqrt(v) / sqrt(1 - b2**t) + eps; p.addcdiv_(m, denom, value=-step_size)
        denom = apply("add", apply("div", apply("sqrt", second),
                                   self._scalar("bias_correction2_sqrt")), Const(self.eps))
        step = apply("div", apply("mul", apply("neg", self._scalar("step_size")), Get(m, idx)),
                     denom)
        code.append(gated_store(value_node, idx, apply("add", self._decayed(value), step), gate))
        return code

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(learning_rate={self.learning_rate!r}, "
                f"betas={self.betas!r}, eps={self.eps!r}, weight_decay={self.weight_decay!r}, "
                f"amsgrad={self.amsgrad!r})")


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay, ``p *= 1 - lr * weight_decay``
    before the moment step (default ``weight_decay=1e-2``, as torch's)."""

    label = "adamw"
    decoupled = True

    def __init__(self, learning_rate: LearningRate | None = None, *,
                 lr: LearningRate | None = None,
                 betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False) -> None:
        super().__init__(learning_rate, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad)
