"""Pointwise ops: one assignment over the broadcast of the operands' shapes, and one backprop
assignment per differentiable operand over the same space and projections (so broadcasting in
forward is a reduction in backprop). A single op's gradient is its op-table row's rule
(``ocannl.ir.ops``); a composite op (``gelu``) gives its own. ``cast`` is here too: the
identity, stored at another precision."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ocannl.ir.assignments import Accum, Const, Expr, Get, apply
from ocannl.ir.ops import OPS, GradRule, Precision, precision_of
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor.inference import ROW_NAMES, Origin, RowIneq
from ocannl.tensor.leaves import Operand, _all, _lift, _read, _result_prec, open_result
from ocannl.tensor.shape import broadcast, broadcast_projection
from ocannl.tensor.tensor import Tensor


def pointwise(label: str, xs: Sequence[Operand | Const], forward: Callable[[list[Expr]], Expr],
              grad: GradRule | None, *, prec: Precision | None = None) -> Tensor:
    """``out = forward(operands)`` at every cell of the operands' broadcast shape. ``grad``
    (an op row's rule, or a composite op's own): ``grad(operands, value, g)`` gives each
    operand's gradient contribution (None: none), written as one backprop assignment per
    differentiable operand; ``grad=None``: the result is not differentiable (comparisons). An
    operand given as a ``Const`` is a literal (pow's exponent), not a tensor."""
    ts = [x if isinstance(x, Const) else _lift(x) for x in xs]
    tensors = [t for t in ts if isinstance(t, Tensor)]
    prec = prec or _result_prec(tensors)
    children = tuple(t for t in tensors if t.kind != "number")
    differentiable = None if grad is not None else False
    if all(t.shape_known for t in tensors):
        shape = broadcast([t.shape for t in tensors], label)
        out = Tensor(Tnode(label, shape.dims, prec), shape, kind="op", children=children,
                     differentiable=differentiable)
    else:  # the result refines every operand, row by row (upstream's inequalities)
        out = open_result(label, prec, children, tensors, differentiable,
                          lambda res, ops: [RowIneq(res.row(r), o.row(r), Origin(label), r)
                                            for o in ops for r in ROW_NAMES])

    def build() -> None:
        shape = out.shape
        space = shape.dims
        res = _all(len(space))
        projs = [None if isinstance(t, Const) else broadcast_projection(t.shape, shape)
                 for t in ts]
        args = [t if isinstance(t, Const) else _read(t, p) for t, p in zip(ts, projs,
                                                                           strict=True)]
        out.forward_code = (Accum(out.value, res, "=", forward(args), space),)
        if out.grad is not None and grad is not None:
            ds = grad(args, Get(out.value, res), Get(out.grad, res))
            out.backprop_code = tuple(
                Accum(t.grad, p, "+", d, space)
                for t, p, d in zip(ts, projs, ds, strict=True)
                if isinstance(t, Tensor) and t.grad is not None and d is not None
            )

    out.defer(build)
    return out


def _op(op: str, xs: Sequence[Operand | Const], *, label: str | None = None) -> Tensor:
    """The op-table op ``op`` applied pointwise, with its row's gradient rule."""
    return pointwise(label or op, xs, lambda x: apply(op, *x), OPS[op].grad)


def add(a: Operand, b: Operand) -> Tensor:
    return _op("add", [a, b])


def sub(a: Operand, b: Operand) -> Tensor:
    return _op("sub", [a, b])


def mul(a: Operand, b: Operand) -> Tensor:
    """Pointwise product with broadcasting (OCANNL's ``*.``)."""
    return _op("mul", [a, b])


def div(a: Operand, b: Operand) -> Tensor:
    return _op("div", [a, b])


def neg(a: Tensor) -> Tensor:
    return _op("neg", [a])


def relu(a: Tensor) -> Tensor:
    return _op("relu", [a])


def exp(a: Tensor) -> Tensor:
    return _op("exp", [a])


def log(a: Tensor) -> Tensor:
    return _op("log", [a])


def tanh(a: Tensor) -> Tensor:
    return _op("tanh", [a])


def sigmoid(a: Tensor) -> Tensor:
    return _op("sigmoid", [a])


def sqrt(a: Tensor) -> Tensor:
    return _op("sqrt", [a])


def pow_const(a: Tensor, c: float) -> Tensor:
    """``a ** c`` for a constant exponent."""
    if not isinstance(c, (int, float)):
        raise TypeError(f"the exponent must be a constant number, got {type(c).__name__}")
    return _op("pow", [a, Const(float(c))])


def cast(a: Tensor, prec: Precision | str) -> Tensor:
    """The same values stored at another precision (rounded to nearest, ties to even)."""
    return pointwise("id", [a], lambda x: x[0], lambda x, v, g: (g,), prec=precision_of(prec))


def lt(a: Operand, b: Operand) -> Tensor:
    """1 where ``a < b``, else 0 (not differentiable)."""
    return _op("lt", [a, b])


def le(a: Operand, b: Operand) -> Tensor:
    """1 where ``a <= b``, else 0 (not differentiable)."""
    return _op("le", [a, b])


def gt(a: Operand, b: Operand) -> Tensor:
    """1 where ``a > b``, else 0 (not differentiable)."""
    return _op("gt", [a, b])


def ge(a: Operand, b: Operand) -> Tensor:
    """1 where ``a >= b``, else 0 (not differentiable)."""
    return _op("ge", [a, b])


def eq(a: Operand, b: Operand) -> Tensor:
    """1 where ``a == b``, else 0 (not differentiable)."""
    return _op("eq", [a, b])


def ne(a: Operand, b: Operand) -> Tensor:
    """1 where ``a != b`` (NaN included), else 0 (not differentiable)."""
    return _op("ne", [a, b])


def where(cond: Operand, a: Operand, b: Operand) -> Tensor:
    """``a`` where ``cond`` is nonzero, else ``b``: a select (an infinity in the branch not
    taken leaves no NaN). The gradient goes to the branch taken; ``cond`` gets none."""
    return _op("where", [cond, a, b])


def minimum(a: Operand, b: Operand) -> Tensor:
    """Pointwise minimum with broadcasting (a NaN on either side propagates, as torch's); the
    gradient goes to the operand chosen, halved on ties."""
    return _op("min", [a, b], label="minimum")


def maximum(a: Operand, b: Operand) -> Tensor:
    """Pointwise maximum with broadcasting (a NaN on either side propagates, as torch's); the
    gradient goes to the operand chosen, halved on ties."""
    return _op("max", [a, b], label="maximum")


def abs(a: Operand) -> Tensor:  # noqa: A001
    """``|a|``; its gradient is ``sign(a)``, 0 at 0 (as torch's)."""
    return _op("abs", [a])


_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


def erf(a: Operand) -> Tensor:
    """The error function."""
    return _op("erf", [a])


def cos(a: Operand) -> Tensor:
    return _op("cos", [a])


def sin(a: Operand) -> Tensor:
    return _op("sin", [a])


def floor(a: Operand) -> Tensor:
    """The largest integer not above ``a``; its gradient is zero (as torch's)."""
    return _op("floor", [a])


def gelu(a: Operand, *, approximate: str = "none") -> Tensor:
    """GELU, as ``torch.nn.functional.gelu``: ``approximate="none"`` is the exact
    ``x * Phi(x) = x / 2 * (1 + erf(x / sqrt 2))``, ``"tanh"`` the tanh approximation
    ``x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``."""
    one, half = Const(1.0), Const(0.5)
    if approximate == "none":
        def cdf(x: Expr) -> Expr:  # Phi(x)
            return apply("mul", half, apply("add", one, apply("erf",
                                                             apply("mul", x, Const(_INV_SQRT2)))))

        def pdf(x: Expr) -> Expr:  # Phi'(x)
            return apply("mul", Const(_INV_SQRT_2PI),
                         apply("exp", apply("mul", Const(-0.5), apply("mul", x, x))))

        x_ = _lift(a)
        # Phi(x) is a node of its own, in the precision it is computed in (f32 for a 16-bit x):
        # the gradient reads it instead of computing erf again (the same values, so the same
        # bits; erf is the step's costliest op per cell). Local: no one else holds it.
        phi = pointwise("gelu_cdf", [x_], lambda x: cdf(x[0]), None, prec=x_.prec.compute)
        phi.value.memory_mode = MemoryMode.local
        return pointwise(
            "gelu", [x_, phi], lambda x: apply("mul", x[0], x[1]),
            lambda x, v, g: [apply("mul", g, apply("add", x[1], apply("mul", x[0], pdf(x[0])))),
                             None], prec=x_.prec)
    if approximate == "tanh":
        def inner(x: Expr) -> Expr:  # sqrt(2/pi) * (x + kappa x^3)
            cube = apply("mul", apply("mul", x, x), x)
            return apply("mul", Const(_SQRT_2_OVER_PI),
                         apply("add", x, apply("mul", Const(_GELU_KAPPA), cube)))

        def fwd(x: list[Expr]) -> Expr:
            return apply("mul", apply("mul", half, x[0]), apply("add", one, apply("tanh",
                                                                                 inner(x[0]))))

        def grads(x: list[Expr], v: Expr, g: Expr) -> list[Expr]:
            a_ = x[0]
            t = apply("tanh", inner(a_))
            d_inner = apply("mul", Const(_SQRT_2_OVER_PI),
                            apply("add", one, apply("mul", Const(3.0 * _GELU_KAPPA),
                                                    apply("mul", a_, a_))))
            left = apply("mul", half, apply("add", one, t))
            right = apply("mul", apply("mul", half, a_),
                          apply("mul", apply("sub", one, apply("mul", t, t)), d_inner))
            return [apply("mul", g, apply("add", left, right))]

        return pointwise("gelu_tanh", [a], fwd, grads)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


# --- operators on Tensor (``@`` is in reductions.py, with matmul) ------------------------------

Tensor.__add__ = lambda a, b: add(a, b)  # type: ignore[assignment]
Tensor.__radd__ = lambda a, b: add(b, a)  # type: ignore[assignment]
Tensor.__sub__ = lambda a, b: sub(a, b)  # type: ignore[assignment]
Tensor.__rsub__ = lambda a, b: sub(b, a)  # type: ignore[assignment]
Tensor.__mul__ = lambda a, b: mul(a, b)  # type: ignore[assignment]
Tensor.__rmul__ = lambda a, b: mul(b, a)  # type: ignore[assignment]
Tensor.__truediv__ = lambda a, b: div(a, b)  # type: ignore[assignment]
Tensor.__rtruediv__ = lambda a, b: div(b, a)  # type: ignore[assignment]
Tensor.__neg__ = lambda a: neg(a)  # type: ignore[assignment]
Tensor.__pow__ = lambda a, c: pow_const(a, c)  # type: ignore[assignment]
