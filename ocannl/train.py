"""Training computations: forward, backprop, SGD, the gradient checksum, parameter init.

Each function returns a :class:`~ocannl.ir.assignments.Comp`; sequence them with ``+`` and
compile the whole step once (``to_routine``), so running a step costs one call.
Host-settable scalars (a learning rate, a loss scale) are one-element ``term`` tensors: their
buffers are read by the routine, never folded into its code.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ocannl.context import Context, Routine
from ocannl.ir.assignments import Accum, Comp, Const, Expr, Fixed, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.tensor.shape import Shape
from ocannl.tensor.tensor import Tensor, copy_into

Scalar = float | Tensor


def scalar_expr(x: Scalar, what: str) -> Expr:
    """A float as a literal, a one-element tensor as a read of its buffer."""
    if isinstance(x, Tensor):
        if x.value.size != 1:
            raise ValueError(f"{what} must be a one-element tensor, got {x.label} {x.shape}")
        if x.const is not None:
            return Const(x.const)
        return Get(x.value, tuple(Fixed(0) for _ in x.dims))
    if isinstance(x, (int, float)):
        if not math.isfinite(x):
            raise ValueError(f"{what} must be finite, got {x!r}")
        return Const(float(x))
    raise TypeError(f"{what} must be a float or a one-element Tensor, got {type(x).__name__}")


def forward(t: Tensor) -> Comp:
    """The code computing ``t`` from its parameters and inputs."""
    return t.forward_comp()


def grad_update(loss: Tensor, *, loss_scale: Tensor | None = None) -> Comp:
    """Forward, zero the gradients, seed the loss gradient (1, or the loss scale), backprop."""
    if loss.grad is None:
        raise ValueError(f"loss {loss.label} depends on no parameter: nothing to differentiate")
    seed = Const(1.0) if loss_scale is None else scalar_expr(loss_scale, "loss_scale")
    seed_comp = Comp((copy_into(loss.grad, seed),), "seed")
    return Comp.seq(
        [forward(loss), loss.zero_grads_comp(), seed_comp, loss.backprop_comp()],
        f"grad_update_{loss.label}",
    )


def optimizer_state(p: Tensor, name: str) -> Tnode:
    """A persistent optimizer buffer of a parameter (its momentum), created on first use."""
    state = p.__dict__.setdefault("optimizer_state", {})
    if name not in state:
        state[name] = Tnode(f"{name}_{p.label}", p.dims, p.prec)
    return state[name]


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
    """SGD over every parameter of ``loss``, as torch.optim.SGD (dampening 0).

    ``grad_unscale`` multiplies each gradient before the optimizer math, so momentum sees true
    magnitudes. ``gate`` (an expression of the step) makes every store a select: where it is 0
    the parameters and momentum keep their old bits (used by the fused mixed-precision step).
    """
    lr = scalar_expr(learning_rate, "learning_rate")
    if not 0.0 <= momentum < 1.0 or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"momentum must be in [0, 1) and weight_decay >= 0, got "
                         f"momentum={momentum!r}, weight_decay={weight_decay!r}")
    if nesterov and momentum == 0.0:
        raise ValueError("nesterov momentum needs momentum > 0")
    unscale = None if grad_unscale is None else scalar_expr(grad_unscale, "grad_unscale")
    code: list[Accum] = []
    for p in loss.params:
        idx = tuple(range(len(p.dims)))
        value = Get(p.value, idx)
        g: Expr = Get(p.grad, idx)
        if unscale is not None:
            g = apply("mul", g, unscale)
        if weight_decay:
            g = apply("add", g, apply("mul", Const(weight_decay), value))
        step = g
        if momentum:
            v = optimizer_state(p, "momentum")
            v_get = Get(v, idx)
            code.append(_store(v, idx, apply("add", apply("mul", Const(momentum), v_get), g),
                               gate))
            step = apply("add", g, apply("mul", Const(momentum), v_get)) if nesterov else v_get
        code.append(_store(p.value, idx, apply("sub", value, apply("mul", lr, step)), gate))
    return Comp(tuple(code), f"sgd_{loss.label}")


def _store(node: Tnode, idx: tuple[int, ...], new: Expr, gate: Expr | None) -> Accum:
    if gate is not None:
        new = apply("where", gate, new, Get(node, idx))
    return Accum(node, idx, "=", new, node.dims)


def grad_checksum(loss: Tensor) -> tuple[Tensor, Comp]:
    """A one-element f32 tensor that is non-finite exactly when some parameter gradient is.

    It sums ``g * 0`` over every gradient element: 0 for finite values (so it never overflows),
    NaN for an infinity or a NaN.
    """
    flag = Tensor(Tnode(f"checksum_{loss.label}", (), Precision.f32), Shape(), kind="op",
                  differentiable=False)
    code = [copy_into(flag.value, Const(0.0))]
    for p in loss.params:
        g = Get(p.grad, tuple(range(len(p.dims))))
        code.append(Accum(flag.value, (), "+", apply("mul", g, Const(0.0)), p.dims))
    return flag, Comp(tuple(code), f"checksum_{loss.label}")


def init_params(ctx: Context, t: Tensor) -> Context:
    """Draw the initial values of ``t``'s parameters not yet on the context."""
    for p in t.params:
        if not ctx.is_initialized(p):
            fan_in = math.prod(p.shape.input or ())
            ctx = ctx.set_values(p, p.init(p.dims, fan_in))
    return ctx


def to_routine(ctx: Context, comp: Comp, bindings: dict | None = None) -> tuple[Context, Routine]:
    return ctx.compile(comp, bindings)


def sequential_loop(n: int, body: Callable[[int], object]) -> None:
    """Run ``body(i)`` for ``i`` in ``0 .. n-1`` (OCANNL's loop over a static index)."""
    for i in range(n):
        body(i)
