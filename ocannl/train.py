"""Training computations: forward, backprop, the gradient checksum, parameter init, and
OCANNL's functional ``sgd_update`` (a thin wrapper over :class:`ocannl.optim.SGD`; optimizers
as objects, with their state, live in :mod:`ocannl.optim`).

Each function returns a :class:`~ocannl.ir.assignments.Comp`; sequence them with ``+`` and
compile the whole step once (``to_routine``), so running a step costs one call.
Host-settable scalars (a learning rate, a loss scale) are one-element ``term`` tensors: their
buffers are read by the routine, never folded into its code.
"""

from __future__ import annotations

import math
import numbers
import weakref

import numpy as np

from ocannl.context import Context, Routine
from ocannl.ir.assignments import Accum, Comp, Const, Expr, Fixed, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.optim import SGD, Scalar, require_scalar_loss, scalar_expr
from ocannl.tensor.shape import Shape
from ocannl.tensor.tensor import Tensor, copy_into

__all__ = [
    "Scalar", "check_micro_batches", "forward", "grad_checksum", "grad_checksum_by_param",
    "grad_update", "init_params", "optimizer_state",
    "scalar_expr", "sgd_update", "to_routine",
]


def forward(t: Tensor) -> Comp:
    """The code computing ``t`` from its parameters and inputs."""
    return t.forward_comp()


def grad_update(loss: Tensor, *, loss_scale: Tensor | None = None, accumulate: bool = False,
                micro_batches: int = 1) -> Comp:
    """Forward, zero the gradients, seed the loss gradient (1, or the loss scale), backprop.

    Gradient accumulation (the recipes' ``accumulate=k``): ``accumulate=True`` keeps the
    parameters' gradients and adds this batch's to them (every other gradient is still zeroed
    first); ``micro_batches=k`` seeds with ``loss_scale / k`` (``1 / k``), so that the sum over
    ``k`` micro-batches is the gradient of their mean loss, as torch's ``(loss / k).backward()``.
    """
    if loss.grad is None:
        raise ValueError(f"loss {loss.label} depends on no parameter: nothing to differentiate")
    require_scalar_loss(loss, "grad_update")
    if type(accumulate) is not bool:
        raise ValueError(f"accumulate must be a bool, got {type(accumulate).__name__}: "
                         f"{accumulate!r}")
    check_micro_batches(micro_batches, "grad_update: micro_batches")
    seed = Const(1.0) if loss_scale is None else scalar_expr(loss_scale, "loss_scale")
    if micro_batches != 1:
        seed = Const(1.0 / micro_batches) if loss_scale is None else \
            apply("div", seed, Const(float(micro_batches)))
    seed_comp = Comp((copy_into(loss.grad, seed),), "seed")
    zero = loss.zero_grads_comp()
    if accumulate:
        kept = {p.grad.id for p in loss.params if p.grad is not None}
        zero = Comp(tuple(a for a in zero.assignments if a.lhs.id not in kept), zero.label)
    label = "grad_accumulate" if accumulate else "grad_update"
    return Comp.seq([forward(loss), zero, seed_comp, loss.backprop_comp()],
                    f"{label}_{loss.label}")


def check_micro_batches(k: object, what: str) -> int:
    """``k`` if it is an integer >= 1 (not a bool), else ``ValueError`` naming it."""
    if type(k) is not int and (not isinstance(k, numbers.Integral)
                               or isinstance(k, (bool, np.bool_))):
        raise ValueError(f"{what} must be an integer >= 1, got {type(k).__name__}: {k!r}")
    if k < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {k!r}")
    return int(k)  # type: ignore[call-overload]


# The buffers of the functional sgd_update, by parameter: repeated calls on one model share its
# momentum. Weak keys: a model's buffers go with it.
_sgd_buffers: weakref.WeakKeyDictionary[Tensor, dict[str, Tnode]] = weakref.WeakKeyDictionary()


def optimizer_state(p: Tensor, name: str) -> Tnode:
    """The buffer ``name`` (``"momentum"``) that :func:`sgd_update` keeps for parameter ``p``.
    An :class:`~ocannl.optim.Optimizer` object keeps its own: see its ``state_of``."""
    try:
        return _sgd_buffers[p][name]
    except (KeyError, TypeError):
        raise ValueError(f"no {name!r} buffer for {p!r}: build train.sgd_update with "
                         f"momentum over a loss of this parameter first") from None


def sgd_update(
    loss: Tensor,
    *,
    learning_rate: Scalar,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    grad_unscale: Tensor | None = None,
    gate: Expr | None = None,
) -> Comp:
    """OCANNL's functional ``sgd_update``: :class:`ocannl.optim.SGD`'s update (torch.optim.SGD
    with dampening 0), its momentum buffers kept per parameter across calls.

    ``grad_unscale`` multiplies each gradient before the optimizer math, so momentum sees true
    magnitudes. ``gate`` (an expression of the step) makes every store a select: where it is 0
    the parameters and momentum keep their old bits (used by the fused mixed-precision step).
    To checkpoint, resume, or use another optimizer, build an optimizer object instead.
    """
    opt = SGD(learning_rate, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov,
              buffers=_sgd_buffers)
    return opt.update(loss, grad_unscale=grad_unscale, gate=gate)


def grad_checksum(loss: Tensor, *, unscale: Scalar | None = None) -> tuple[Tensor, Comp]:
    """:func:`grad_checksum_by_param` without the flags tensor: the checksum and its comp."""
    flag, _, comp = grad_checksum_by_param(loss, unscale=unscale)
    return flag, comp


def grad_checksum_by_param(loss: Tensor, *, unscale: Scalar | None = None,
                           ) -> tuple[Tensor, Tensor, Comp]:
    """A one-element f32 tensor that is non-finite exactly when some parameter gradient (times
    ``unscale``, when given) is, and its computation; run it after the gradients.

    It sums ``g * 0`` (``g * unscale * 0``) over every gradient element: 0 for finite values (so
    it never overflows), NaN for an infinity or a NaN. With ``unscale`` (a loss scaler's
    reciprocal) it checks what the optimizer would apply, as torch's GradScaler does: a scale
    backed off to 0 (``0 * inf``) is then caught instead of writing NaN into the weights.

    Every term is 0 or NaN, so the order of the sum cannot change the outcome: a gradient of
    two or more axes is first summed over all but its last into a row of partial sums, which
    the generated code accumulates a whole row at a time (in vector registers) rather than
    one long chain of dependent additions.

    The sum goes through one cell per parameter (the second tensor returned, ``(P,)`` f32 over
    ``loss.params`` in order): cell ``i`` is 0 when parameter ``i``'s gradient is finite, NaN
    when not, and the checksum is the sum of the cells. The same single pass over the
    gradients thus also says *which* gradients overflowed (a recipe's ``last_overflow``).
    """
    if loss.grad is None:
        raise ValueError(f"loss {loss.label} depends on no parameter: nothing to check")
    u = None if unscale is None else scalar_expr(unscale, "unscale")
    flag = Tensor(Tnode(f"checksum_{loss.label}", (), Precision.f32), Shape(), kind="op",
                  differentiable=False)
    params = loss.params
    cells = Tensor(Tnode(f"grad_flags_{loss.label}", (len(params),), Precision.f32),
                   Shape(output=(len(params),)), kind="op", differentiable=False)
    code = [copy_into(cells.value, Const(0.0))]
    for i, p in enumerate(params):
        assert p.grad is not None
        axes = tuple(range(len(p.dims)))
        g: Expr = Get(p.grad, axes)
        if u is not None:
            g = apply("mul", g, u)
        term = apply("mul", g, Const(0.0))
        cell = (Fixed(i),)
        if len(p.dims) >= 2 and p.dims[-1] >= _CHECKSUM_ROW:
            row = Tnode(f"checksum_rows_{p.label}", (p.dims[-1],), Precision.f32)
            code.append(Accum(row, (axes[-1],), "+", term, p.dims, reset=True))
            code.append(Accum(cells.value, cell, "+", Get(row, (0,)), (p.dims[-1],)))
        else:
            code.append(Accum(cells.value, cell, "+", term, p.dims))
    code.append(Accum(flag.value, (), "+", Get(cells.value, (0,)), (len(params),), reset=True))
    return flag, cells, Comp(tuple(code), f"checksum_{loss.label}")


# A gradient whose last axis has at least this many cells is checked a row at a time.
_CHECKSUM_ROW = 8


def init_params(ctx: Context, t: Tensor) -> Context:
    """Draw the initial values of ``t``'s parameters not yet on the context."""
    for p in t.params:
        if not ctx.is_initialized(p):
            fan_in, fan_out = math.prod(p.shape.input), math.prod(p.shape.output)
            ctx = ctx.set_values(p, p.init(p.dims, fan_in, None, fan_out))
    return ctx


def to_routine(ctx: Context, comp: Comp, bindings: dict | None = None) -> tuple[Context, Routine]:
    return ctx.compile(comp, bindings)
