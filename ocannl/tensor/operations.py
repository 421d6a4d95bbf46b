"""The tensor DSL: leaves, pointwise ops, ``@``, reductions, ``cast``, with backprop.

Every op builds one forward assignment over a product space and, when it is differentiable,
one backprop assignment per differentiable operand over the same space, written with the
projections of the forward one (so broadcasting in forward is a reduction in backprop).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import numpy as np

from ocannl.ir.assignments import Accum, Const, Expr, Fixed, Get, Index, apply, iterators_of
from ocannl.ir.ops import Precision, precision_of, promote
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor import tensor as _t
from ocannl.tensor.shape import ROWS, Shape, broadcast, broadcast_projection, int_dims
from ocannl.tensor.tensor import INIT_KINDS, Init, Tensor

Operand = Tensor | float | int

# --- leaves -----------------------------------------------------------------------------------


def _dims_row(name: str, dims: Sequence[int] | None) -> tuple[int, ...] | None:
    if dims is None:
        return None
    out = int_dims(f"{name}_dims", dims)
    if any(d < 1 for d in out):
        raise ValueError(f"{name} dims must be positive, got {tuple(dims)}")
    return out


def param(
    label: str,
    *,
    output_dims: Sequence[int],
    input_dims: Sequence[int] | None = None,
    batch_dims: Sequence[int] = (),
    init: str | Init = "kaiming_uniform",
    prec: Precision | str = Precision.f32,
) -> Tensor:
    """A trainable tensor. ``input_dims=None`` infers the input axes from its first ``@``."""
    if isinstance(init, str):
        if init not in INIT_KINDS:
            raise ValueError(f"unknown init {init!r}: expected one of {INIT_KINDS}")
        init = Init(init)
    prec = precision_of(prec)
    shape = Shape(_dims_row("batch", batch_dims), _dims_row("output", output_dims),
                  _dims_row("input", input_dims))
    node = Tnode(label, shape.dims if shape.input is not None else None, prec, needs_init=True)
    seed = (_t._seed["base"], next(_t._param_counter))

    def draw(dims: tuple[int, ...], fan_in: int, _rng: object = None) -> np.ndarray:
        return init.draw(dims, fan_in, np.random.default_rng(list(seed)))

    t = Tensor(node, shape, kind="param", differentiable=True, init=draw)
    return _t.param_postprocess(t)


def term(
    values: object = None,
    *,
    label: str = "term",
    batch_dims: Sequence[int] | None = None,
    input_dims: Sequence[int] = (),
    output_dims: Sequence[int] | None = None,
    prec: Precision | str = Precision.f32,
) -> Tensor:
    """A non-differentiable, data-backed tensor (inputs, targets, a learning rate, a scale).

    Without explicit rows, a 1-D array is an output row and a 2-D or wider array has its last
    axis as the output row and the rest as batch axes.
    """
    prec = precision_of(prec)
    arr = None if values is None else np.asarray(values, dtype=np.float64)
    if arr is not None and arr.dtype.kind not in "biuf":
        raise ValueError(f"term {label}: values must be numeric, got dtype {arr.dtype}")
    if output_dims is None:
        if arr is None:
            raise ValueError(f"term {label}: give values or output_dims")
        output_dims = arr.shape[-1:] if arr.ndim >= 1 else ()
        if batch_dims is None:
            batch_dims = arr.shape[:-1]
    shape = Shape(_dims_row("batch", batch_dims or ()), _dims_row("output", output_dims),
                  _dims_row("input", input_dims))
    if arr is not None and arr.size != int(np.prod(shape.dims)):
        raise ValueError(f"term {label}: {arr.size} values (shape {arr.shape}) do not fill {shape}")
    host = None if arr is None else arr.reshape(shape.dims).astype(prec.numpy_dtype)
    node = Tnode(label, shape.dims, prec, host_data=host, needs_init=True)
    return Tensor(node, shape, kind="term", differentiable=False)


def number(value: float, *, prec: Precision | str = Precision.f32) -> Tensor:
    """A constant folded into the generated code (never a buffer: use ``term`` for values the
    host changes)."""
    node = Tnode(f"c{value:g}", (), precision_of(prec), memory_mode=MemoryMode.virtual)
    return Tensor(node, Shape(), kind="number", differentiable=False, const=float(value))


def _lift(x: Operand) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (int, float, np.floating, np.integer)):
        return number(float(x))
    raise TypeError(f"expected a Tensor or a number, got {type(x).__name__}: {x!r}")


def _read(t: Tensor, idx: tuple[Index, ...]) -> Expr:
    return Const(t.const) if t.const is not None else Get(t.value, idx)


def _result_prec(ts: Sequence[Tensor]) -> Precision:
    precs = [t.prec for t in ts if t.kind != "number"]
    return promote(*precs) if precs else Precision.f32


def _new(label: str, shape: Shape, prec: Precision, children: tuple[Tensor, ...]) -> Tensor:
    return Tensor(Tnode(label, shape.dims, prec), shape, kind="op", children=children)


def _all(n: int) -> tuple[int, ...]:
    return tuple(range(n))


# --- pointwise --------------------------------------------------------------------------------

# d(op)/d(operand k) * g, as expressions of the operands ``a``, the result ``v``, the incoming
# gradient ``g``.
def _binary_grads(op: str, a: Expr, b: Expr, g: Expr) -> tuple[Expr, Expr]:
    if op == "add":
        return g, g
    if op == "sub":
        return g, apply("neg", g)
    if op == "mul":
        return apply("mul", g, b), apply("mul", g, a)
    if op == "div":
        return (apply("div", g, b),
                apply("neg", apply("div", apply("mul", g, a), apply("mul", b, b))))
    raise ValueError(f"no backprop for binary op {op!r}")


def _unary_grad(op: str, a: Expr, v: Expr, g: Expr, c: float | None) -> Expr:
    one = Const(1.0)
    if op == "neg":
        return apply("neg", g)
    if op == "relu":  # where the result is positive, as torch's: the input is then not kept
        return apply("mul", g, apply("gt", v, Const(0.0)))
    if op == "exp":
        return apply("mul", g, v)
    if op == "log":
        return apply("div", g, a)
    if op == "tanh":
        return apply("mul", g, apply("sub", one, apply("mul", v, v)))
    if op == "sigmoid":
        return apply("mul", g, apply("mul", v, apply("sub", one, v)))
    if op == "sqrt":
        return apply("div", apply("mul", g, Const(0.5)), v)
    if op == "pow":
        assert c is not None
        return apply("mul", g, apply("mul", Const(c), apply("pow", a, Const(c - 1.0))))
    if op == "id":
        return g
    raise ValueError(f"no backprop for unary op {op!r}")


def _pointwise(op: str, xs: Sequence[Operand], *, c: float | None = None,
               prec: Precision | None = None) -> Tensor:
    ts = [_lift(x) for x in xs]
    shape = broadcast([t.shape for t in ts], f"{op}")
    prec = prec or _result_prec(ts)
    label = op if len(ts) == 1 else f"{op}"
    out = _new(label, shape, prec, tuple(t for t in ts if t.kind != "number"))
    space = shape.dims
    res_idx = _all(len(space))
    projs = [broadcast_projection(t.shape, shape) for t in ts]
    args = [_read(t, p) for t, p in zip(ts, projs, strict=True)]
    if op == "id":
        expr = args[0]
    elif op == "pow":
        expr = apply("pow", args[0], Const(c))
    else:
        expr = apply(op, *args)
    out.forward_code = (Accum(out.value, res_idx, "=", expr, space),)
    if out.grad is not None:
        g = Get(out.grad, res_idx)
        if len(ts) == 2:
            grads = _binary_grads(op, args[0], args[1], g)
        else:
            grads = (_unary_grad(op, args[0], Get(out.value, res_idx), g, c),)
        out.backprop_code = tuple(
            Accum(t.grad, p, "+", d, space)
            for t, p, d in zip(ts, projs, grads, strict=True) if t.grad is not None
        )
    return out


def add(a: Operand, b: Operand) -> Tensor:
    return _pointwise("add", [a, b])


def sub(a: Operand, b: Operand) -> Tensor:
    return _pointwise("sub", [a, b])


def mul(a: Operand, b: Operand) -> Tensor:
    """Pointwise product with broadcasting (OCANNL's ``*.``)."""
    return _pointwise("mul", [a, b])


def div(a: Operand, b: Operand) -> Tensor:
    return _pointwise("div", [a, b])


def neg(a: Tensor) -> Tensor:
    return _pointwise("neg", [a])


def relu(a: Tensor) -> Tensor:
    return _pointwise("relu", [a])


def exp(a: Tensor) -> Tensor:
    return _pointwise("exp", [a])


def log(a: Tensor) -> Tensor:
    return _pointwise("log", [a])


def tanh(a: Tensor) -> Tensor:
    return _pointwise("tanh", [a])


def sigmoid(a: Tensor) -> Tensor:
    return _pointwise("sigmoid", [a])


def sqrt(a: Tensor) -> Tensor:
    return _pointwise("sqrt", [a])


def pow_const(a: Tensor, c: float) -> Tensor:
    """``a ** c`` for a constant exponent."""
    if not isinstance(c, (int, float)):
        raise TypeError(f"the exponent must be a constant number, got {type(c).__name__}")
    return _pointwise("pow", [a], c=float(c))


def cast(a: Tensor, prec: Precision | str) -> Tensor:
    """The same values stored at another precision (rounded to nearest, ties to even)."""
    return _pointwise("id", [a], prec=precision_of(prec))


# --- contractions -----------------------------------------------------------------------------


def _infer_input(a: Tensor, dims: tuple[int, ...]) -> None:
    """Fix a parameter's input axes at its first ``@``."""
    a.shape = Shape(a.shape.batch, a.shape.output, dims)
    a.value.set_dims(a.shape.dims)
    if a.grad is not None:
        a.grad.set_dims(a.shape.dims)
    hook = a.on_input_inferred  # a cast twin completes its master
    if hook is not None:
        hook(a)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """OCANNL's ``*``: contract a's input axes with b's output axes, broadcasting batches."""
    a, b = _lift(a), _lift(b)
    if a.shape.input is None:
        _infer_input(a, b.shape.output)
    if b.shape.input is None:
        raise ValueError(f"matmul: right operand {b.label} {b.shape} has input axes not inferred")
    if a.shape.input != b.shape.output:
        raise ValueError(
            f"matmul: the left operand's input axes {a.shape.input} (shape {a.shape}) do not match "
            f"the right operand's output axes {b.shape.output} (shape {b.shape})"
        )
    batch = broadcast([Shape(batch=a.shape.batch), Shape(batch=b.shape.batch)], "matmul").batch
    shape = Shape(batch, a.shape.output, b.shape.input)
    n_res = len(shape.dims)
    k_its = tuple(range(n_res, n_res + len(a.shape.input)))
    space = shape.dims + a.shape.input
    res_o = tuple(range(len(batch), len(batch) + len(shape.output)))
    res_i = tuple(range(len(batch) + len(shape.output), n_res))

    def batch_proj(t: Tensor) -> tuple[Index, ...]:
        return broadcast_projection(Shape(batch=t.shape.batch), Shape(batch=batch))

    pa = batch_proj(a) + res_o + k_its
    pb = batch_proj(b) + k_its + res_i
    return _contract("matmul", a, b, pa, pb, shape, space)


def _contract(label: str, a: Tensor, b: Tensor, pa: tuple[Index, ...], pb: tuple[Index, ...],
              shape: Shape, space: tuple[int, ...]) -> Tensor:
    """``out[res] += a[pa] * b[pb]`` over ``space`` (result iterators first)."""
    out = _new(label, shape, _result_prec([a, b]), (a, b))
    res = _all(len(shape.dims))
    x, y = _read(a, pa), _read(b, pb)
    out.forward_code = (Accum(out.value, res, "+", apply("mul", x, y), space, reset=True),)
    if out.grad is not None:
        g = Get(out.grad, res)
        out.backprop_code = tuple(
            Accum(t.grad, p, "+", apply("mul", g, other), space)
            for t, p, other in ((a, pa, y), (b, pb, x)) if t.grad is not None
        )
    return out


# --- reductions -------------------------------------------------------------------------------


def _axes(t: Tensor, axes: None | str | int | Sequence[int]) -> list[int]:
    n = len(t.dims)
    if axes is None:
        return list(range(n))
    if isinstance(axes, str):
        if axes not in ROWS:
            raise ValueError(f"unknown row {axes!r}: expected one of {ROWS} or axis positions")
        off = t.shape.row_offsets()[axes]
        return list(range(off, off + len(t.shape.row(axes))))
    seq = [axes] if isinstance(axes, int) else list(axes)
    out = []
    for ax in seq:
        if not -n <= ax < n:
            raise ValueError(f"axis {ax} out of range for {t.label} with dims {t.dims}")
        out.append(ax % n)
    return sorted(set(out))


def _reduce(name: str, t: Tensor, axes: None | str | int | Sequence[int], accum: str) -> Tensor:
    t = _lift(t)
    red = set(_axes(t, axes))
    n = len(t.dims)
    keep = [k for k in range(n) if k not in red]
    rows = {}
    off = t.shape.row_offsets()
    for row in ROWS:
        r = t.shape.row(row)
        rows[row] = tuple(d for j, d in enumerate(r) if off[row] + j not in red)
    return _reduce_with(name, t, _all(n), tuple(keep), Shape(**rows), t.dims, accum)


def _reduce_with(label: str, t: Tensor, proj: tuple[Index, ...], res_idx: tuple[Index, ...],
                 shape: Shape, space: tuple[int, ...], accum: str, *,
                 ties: str = "split") -> Tensor:
    """``out[res_idx] (accum)= t[proj]`` over ``space``, with its gradient.

    The gradient of a maximum (or minimum) goes to the elements equal to it. ``ties``: with
    several, ``"split"`` shares it evenly among them (torch's ``amax``), ``"first"`` gives it
    to the first in the reduced iterators' row-major order (torch's ``max_pool2d``). Either
    way the shares sum to one: every tied element getting all of it would multiply it."""
    out = _new(label, shape, t.prec, (t,))
    x = _read(t, proj)
    out.forward_code = (Accum(out.value, res_idx, accum, x, space, reset=True),)
    if out.grad is None:
        return out
    g = Get(out.grad, res_idx)
    if accum == "+":
        out.backprop_code = (Accum(t.grad, proj, "+", g, space),)
        return out
    if ties not in ("split", "first"):
        raise ValueError(f"ties must be 'split' or 'first', got {ties!r}")
    hit = apply("eq", x, Get(out.value, res_idx))
    tie = Tnode(f"{label}_ties", shape.dims, Precision.f32)
    if ties == "split":  # tie = how many elements equal the extremum
        count = Accum(tie, res_idx, "+", hit, space, reset=True)
        d = apply("div", apply("mul", g, hit), Get(tie, res_idx))
    else:  # tie = minus the position of the first such element; iota numbers the positions
        red = [i for i in range(len(space)) if i not in iterators_of(res_idx)]
        extents = tuple(space[i] for i in red)
        iota = Tnode(f"{label}_positions", extents, Precision.f32,
                     host_data=np.arange(int(np.prod(extents)), dtype=np.float32)
                     .reshape(extents))
        minus_pos = apply("neg", Get(iota, tuple(red)))
        count = Accum(tie, res_idx, "max", apply("where", hit, minus_pos, Const(-np.inf)),
                      space, reset=True)
        d = apply("mul", g, apply("eq", minus_pos, Get(tie, res_idx)))
    out.backprop_code = (count, Accum(t.grad, proj, "+", d, space))
    return out


def sum(t: Tensor, axes: None | str | int | Sequence[int] = None) -> Tensor:  # noqa: A001
    """Sum over ``axes``: None (all), a row name ("batch", "input", "output"), or positions."""
    return _reduce("sum", t, axes, "+")


def max(t: Tensor, axes: None | str | int | Sequence[int] = None) -> Tensor:  # noqa: A001
    """Maximum over ``axes``; the gradient is shared evenly by the elements equal to it."""
    return _reduce("max", t, axes, "max")


def mean(t: Tensor, axes: None | str | int | Sequence[int] = None) -> Tensor:
    t = _lift(t)
    count = int(np.prod([t.dims[k] for k in _axes(t, axes)]))
    return div(sum(t, axes), float(count))


# --- operators on Tensor ----------------------------------------------------------------------

Tensor.__add__ = lambda a, b: add(a, b)  # type: ignore[assignment]
Tensor.__radd__ = lambda a, b: add(b, a)  # type: ignore[assignment]
Tensor.__sub__ = lambda a, b: sub(a, b)  # type: ignore[assignment]
Tensor.__rsub__ = lambda a, b: sub(b, a)  # type: ignore[assignment]
Tensor.__mul__ = lambda a, b: mul(a, b)  # type: ignore[assignment]
Tensor.__rmul__ = lambda a, b: mul(b, a)  # type: ignore[assignment]
Tensor.__truediv__ = lambda a, b: div(a, b)  # type: ignore[assignment]
Tensor.__rtruediv__ = lambda a, b: div(b, a)  # type: ignore[assignment]
Tensor.__matmul__ = lambda a, b: matmul(a, b)  # type: ignore[assignment]
Tensor.__neg__ = lambda a: neg(a)  # type: ignore[assignment]
Tensor.__pow__ = lambda a, c: pow_const(a, c)  # type: ignore[assignment]



# --- beyond MLPs: pointwise ops built from expressions ------------------------------------------
#
# Each op below is one assignment whose right-hand side is an expression tree over the operands
# (so ``gelu`` is one or two nodes, not seven), and one backprop assignment per differentiable
# operand over the same space and projections.

Grads = Callable[[list[Expr], Expr, Expr], Sequence[Expr | None]]


def _elementwise(label: str, xs: Sequence[Operand], forward: Callable[[list[Expr]], Expr],
                 grads: Grads | None, *, prec: Precision | None = None) -> Tensor:
    """``out = forward(operands)`` pointwise with broadcasting. ``grads(operands, value, g)``
    gives each operand's gradient contribution (None: none); ``grads=None``: the result is not
    differentiable (comparisons)."""
    ts = [_lift(x) for x in xs]
    shape = broadcast([t.shape for t in ts], label)
    prec = prec or _result_prec(ts)
    children = tuple(t for t in ts if t.kind != "number")
    node = Tnode(label, shape.dims, prec)
    if grads is None:
        out = Tensor(node, shape, kind="op", children=children, differentiable=False)
    else:
        out = Tensor(node, shape, kind="op", children=children)
    space = shape.dims
    res = _all(len(space))
    projs = [broadcast_projection(t.shape, shape) for t in ts]
    args = [_read(t, p) for t, p in zip(ts, projs, strict=True)]
    out.forward_code = (Accum(out.value, res, "=", forward(args), space),)
    if out.grad is not None and grads is not None:
        ds = grads(args, Get(out.value, res), Get(out.grad, res))
        out.backprop_code = tuple(
            Accum(t.grad, p, "+", d, space)
            for t, p, d in zip(ts, projs, ds, strict=True) if t.grad is not None and d is not None
        )
    return out


def _compare(op: str, a: Operand, b: Operand) -> Tensor:
    return _elementwise(op, [a, b], lambda x: apply(op, x[0], x[1]), None)


def lt(a: Operand, b: Operand) -> Tensor:
    """1 where ``a < b``, else 0 (not differentiable)."""
    return _compare("lt", a, b)


def le(a: Operand, b: Operand) -> Tensor:
    """1 where ``a <= b``, else 0 (not differentiable)."""
    return _compare("le", a, b)


def gt(a: Operand, b: Operand) -> Tensor:
    """1 where ``a > b``, else 0 (not differentiable)."""
    return _compare("gt", a, b)


def ge(a: Operand, b: Operand) -> Tensor:
    """1 where ``a >= b``, else 0 (not differentiable)."""
    return _compare("ge", a, b)


def eq(a: Operand, b: Operand) -> Tensor:
    """1 where ``a == b``, else 0 (not differentiable)."""
    return _compare("eq", a, b)


def ne(a: Operand, b: Operand) -> Tensor:
    """1 where ``a != b`` (NaN included), else 0 (not differentiable)."""
    return _compare("ne", a, b)


def where(cond: Operand, a: Operand, b: Operand) -> Tensor:
    """``a`` where ``cond`` is nonzero, else ``b``: a select (an infinity in the branch not
    taken leaves no NaN). The gradient goes to the branch taken; ``cond`` gets none."""
    zero = Const(0.0)

    def grads(x: list[Expr], v: Expr, g: Expr) -> list[Expr | None]:
        return [None, apply("where", x[0], g, zero), apply("where", x[0], zero, g)]

    return _elementwise("where", [cond, a, b], lambda x: apply("where", *x), grads)


def _select_grads(pick_first: str) -> Grads:
    """Gradients of a pointwise minimum / maximum: to the operand chosen, halved on ties
    (as torch's)."""
    zero, half = Const(0.0), Const(0.5)

    def grads(x: list[Expr], v: Expr, g: Expr) -> list[Expr]:
        a, b = x
        tie = apply("where", apply("eq", a, b), apply("mul", g, half), zero)
        return [apply("where", apply(pick_first, a, b), g, tie),
                apply("where", apply(pick_first, b, a), g, tie)]

    return grads


def minimum(a: Operand, b: Operand) -> Tensor:
    """Pointwise minimum with broadcasting (a NaN on either side propagates, as torch's)."""
    return _elementwise("minimum", [a, b], lambda x: apply("min", *x), _select_grads("lt"))


def maximum(a: Operand, b: Operand) -> Tensor:
    """Pointwise maximum with broadcasting (a NaN on either side propagates, as torch's)."""
    return _elementwise("maximum", [a, b], lambda x: apply("max", *x), _select_grads("gt"))


def abs(a: Operand) -> Tensor:  # noqa: A001
    """``|a|``; its gradient is ``sign(a)``, 0 at 0 (as torch's)."""
    def grads(x: list[Expr], v: Expr, g: Expr) -> list[Expr]:
        sign = apply("sub", apply("gt", x[0], Const(0.0)), apply("lt", x[0], Const(0.0)))
        return [apply("mul", g, sign)]

    return _elementwise("abs", [a], lambda x: apply("abs", x[0]), grads)


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


def erf(a: Operand) -> Tensor:
    """The error function."""
    def grads(x: list[Expr], v: Expr, g: Expr) -> list[Expr]:
        e = apply("exp", apply("neg", apply("mul", x[0], x[0])))
        return [apply("mul", g, apply("mul", Const(_TWO_OVER_SQRT_PI), e))]

    return _elementwise("erf", [a], lambda x: apply("erf", x[0]), grads)


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
        if x_.prec.is_narrow:  # a stored f32 Phi would cost more traffic than erf does
            return _elementwise(
                "gelu", [x_], lambda x: apply("mul", x[0], cdf(x[0])),
                lambda x, v, g: [apply("mul", g, apply("add", cdf(x[0]),
                                                        apply("mul", x[0], pdf(x[0]))))])
        # Phi(x) is a node of its own: the gradient reads it instead of computing erf again
        # (the same values, so the same bits). Local: no one else holds it.
        phi = _elementwise("gelu_cdf", [x_], lambda x: cdf(x[0]), None)
        phi.value.memory_mode = MemoryMode.local
        return _elementwise(
            "gelu", [x_, phi], lambda x: apply("mul", x[0], x[1]),
            lambda x, v, g: [apply("mul", g, apply("add", x[1], apply("mul", x[0], pdf(x[0])))),
                             None])
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

        return _elementwise("gelu_tanh", [a], fwd, grads)
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


# --- reductions that keep the reduced axes (size 1), and min ----------------------------------


def _kept_shape(t: Tensor, red: set[int]) -> Shape:
    off = t.shape.row_offsets()
    rows = {}
    for row in ROWS:
        rows[row] = tuple(1 if off[row] + j in red else d for j, d in enumerate(t.shape.row(row)))
    return Shape(**rows)


def _reduce_keep(name: str, t: Tensor, axes: None | str | int | Sequence[int], accum: str,
                 *, differentiable: bool = True) -> Tensor:
    """A reduction whose result keeps the reduced axes with size 1, so it broadcasts back
    against ``t`` whichever axes were reduced."""
    t = _lift(t)
    red = set(_axes(t, axes))
    n = len(t.dims)
    res_idx = tuple(Fixed(0) if k in red else k for k in range(n))
    if differentiable:
        return _reduce_with(name, t, _all(n), res_idx, _kept_shape(t, red), t.dims, accum)
    shape = _kept_shape(t, red)
    out = Tensor(Tnode(name, shape.dims, t.prec), shape, kind="op", children=(t,),
                 differentiable=False)
    out.forward_code = (Accum(out.value, res_idx, accum, _read(t, _all(n)), t.dims, reset=True),)
    return out


def min(t: Tensor, axes: None | str | int | Sequence[int] = None,  # noqa: A001
        *, keepdims: bool = False) -> Tensor:
    """Minimum over ``axes`` (as :func:`max`); the gradient is shared evenly by the elements
    equal to the minimum (torch's ``amin``). Computed as ``-max(-t)`` in one node: the maximum
    of the negated values, negated in place."""
    t = _lift(t)
    red = set(_axes(t, axes))
    n = len(t.dims)
    if keepdims:
        res_idx: tuple[Index, ...] = tuple(Fixed(0) if k in red else k for k in range(n))
        shape = _kept_shape(t, red)
    else:
        res_idx = tuple(k for k in range(n) if k not in red)
        off = t.shape.row_offsets()
        shape = Shape(**{row: tuple(d for j, d in enumerate(t.shape.row(row))
                                    if off[row] + j not in red) for row in ROWS})
    out = _new("min", shape, t.prec, (t,))
    x = _read(t, _all(n))
    own = _all(len(shape.dims))
    out.forward_code = (
        Accum(out.value, res_idx, "max", apply("neg", x), t.dims, reset=True),
        Accum(out.value, own, "=", apply("neg", Get(out.value, own)), shape.dims),
    )
    if out.grad is not None:
        g = Get(out.grad, res_idx)
        hit = apply("eq", x, Get(out.value, res_idx))
        ties = Tnode("min_ties", shape.dims, Precision.f32)  # how many equal the minimum
        out.backprop_code = (
            Accum(ties, res_idx, "+", hit, t.dims, reset=True),
            Accum(t.grad, _all(n), "+", apply("div", apply("mul", g, hit), Get(ties, res_idx)),
                  t.dims),
        )
    return out


def reduce(t: Tensor, kind: str, axes: None | str | int | Sequence[int] = None, *,  # noqa: A001
           keepdims: bool = False) -> Tensor:
    """``sum``, ``mean``, ``max`` or ``min`` over ``axes``; ``keepdims=True`` keeps the reduced
    axes with size 1 (in their rows), so the result broadcasts back against ``t``."""
    if kind not in ("sum", "mean", "max", "min"):
        raise ValueError(f"reduce: kind must be 'sum', 'mean', 'max' or 'min', got {kind!r}")
    if kind == "min":
        return min(t, axes, keepdims=keepdims)
    if not keepdims:
        return {"sum": sum, "mean": mean, "max": max}[kind](t, axes)
    t = _lift(t)
    if kind == "mean":
        count = int(np.prod([t.dims[k] for k in _axes(t, axes)]))
        return div(_reduce_keep("sum", t, axes, "+"), float(count))
    return _reduce_keep(kind, t, axes, "+" if kind == "sum" else "max")


def _rows(x: Tensor, axes: None | str | int | Sequence[int]
          ) -> tuple[tuple[int, ...], tuple[Index, ...], tuple[int, ...], int]:
    """For an op over ``axes`` whose per-row results broadcast back against ``x``: every
    cell's index, a row result's index (``Fixed(0)`` on the reduced axes), a row result
    node's dims, and how many cells a row has."""
    red = set(_axes(x, axes))
    n = len(x.dims)
    kept = tuple(Fixed(0) if k in red else k for k in range(n))
    return _all(n), kept, _kept_shape(x, red).dims, math.prod(x.dims[k] for k in red)


def _local(name: str, dims: tuple[int, ...], prec: Precision) -> Tnode:
    """An op's intermediate node: local to the routines computing it."""
    return Tnode(name, dims, prec, memory_mode=MemoryMode.local)


def _cancelling_sum_prec(prec: Precision) -> Precision:
    """Where an op's gradient subtracts a sum that nearly cancels its terms (softmax's and
    a normalization's): f64 at f32 and f64 (products of f32 values are exact there, and the
    difference is taken in f64), f32 for 16-bit data."""
    return Precision.f32 if prec.is_narrow else Precision.f64


def softmax(x: Tensor, axes: None | str | int | Sequence[int]) -> Tensor:
    """``exp(x) / sum(exp(x))`` over ``axes`` (a row name, positions, or None for all),
    computed stably: the maximum over the axes is subtracted first.

    One op with its own gradient, torch's: ``(g - sum(g * y)) * y`` over the axes, one
    reduction without divisions; the chain rule through the division by the sum would
    reduce ``g * e / s^2`` and then pass the gradient through the exponential too. Its
    intermediates (the maximum, the exponentials, the sum, the gradient's dot product) are
    local to the routines computing them."""
    x = _lift(x)
    cells, kept, kept_dims, _ = _rows(x, axes)
    top, e, total = _local("softmax_max", kept_dims, x.prec), \
        _local("softmax_exp", x.dims, x.prec), _local("softmax_sum", kept_dims, x.prec)
    out = _new("softmax", x.shape, x.prec, (x,))
    y = Get(out.value, cells)
    out.forward_code = (
        Accum(top, kept, "max", _read(x, cells), x.dims, reset=True),
        Accum(e, cells, "=", apply("exp", apply("sub", _read(x, cells), Get(top, kept))),
              x.dims),
        Accum(total, kept, "+", Get(e, cells), x.dims, reset=True),
        Accum(out.value, cells, "=", apply("div", Get(e, cells), Get(total, kept)), x.dims),
    )
    if out.grad is not None and x.grad is not None:
        g = Get(out.grad, cells)
        dot = _local("softmax_dot", kept_dims, _cancelling_sum_prec(x.prec))
        out.backprop_code = (
            Accum(dot, kept, "+", apply("mul", g, y), x.dims, reset=True),
            Accum(x.grad, cells, "+", apply("mul", apply("sub", g, Get(dot, kept)), y), x.dims),
        )
    return out


def standardize(x: Tensor, axes: None | str | int | Sequence[int], eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``axes``, the variance biased: a layer norm
    without its gain and bias (``nn_blocks.layer_norm``).

    One op with torch's gradient, ``(g - mean(g) - y * mean(g * y)) / sqrt(var + eps)``: two
    sums with no division in them and one pass, where the chain rule through the division,
    the square root and both means took several passes, one of them dividing per element. The
    two sums are taken, and subtracted, in f64 at f32 and f64 (they cancel). The forward
    values are those of the composition. Its intermediates are local to the routines computing
    them."""
    x = _lift(x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"standardize: eps must be a finite number >= 0, got {eps!r}")
    cells, kept, kept_dims, per_row = _rows(x, axes)
    count = Const(float(per_row))
    total, centered = _local("standardize_sum", kept_dims, x.prec), \
        _local("standardize_centered", x.dims, x.prec)
    squares, std = _local("standardize_squares", kept_dims, x.prec), \
        _local("standardize_std", kept_dims, x.prec)
    out = _new("standardize", x.shape, x.prec, (x,))
    xc, deviation = Get(centered, cells), Get(std, kept)
    out.forward_code = (
        Accum(total, kept, "+", _read(x, cells), x.dims, reset=True),
        Accum(centered, cells, "=",
              apply("sub", _read(x, cells), apply("div", Get(total, kept), count)), x.dims),
        Accum(squares, kept, "+", apply("mul", xc, xc), x.dims, reset=True),
        Accum(std, _all(len(kept_dims)), "=", apply("sqrt", apply("add", apply(
            "div", Get(squares, _all(len(kept_dims))), count), Const(float(eps)))), kept_dims),
        Accum(out.value, cells, "=", apply("div", xc, deviation), x.dims),
    )
    if out.grad is not None and x.grad is not None:
        g, y = Get(out.grad, cells), Get(out.value, cells)
        wide = _cancelling_sum_prec(x.prec)
        g_sum, gy_sum = _local("standardize_grad_sum", kept_dims, wide), \
            _local("standardize_grad_dot", kept_dims, wide)
        mean_g, mean_gy = (apply("div", Get(t, kept), count) for t in (g_sum, gy_sum))
        out.backprop_code = (
            Accum(g_sum, kept, "+", g, x.dims, reset=True),
            Accum(gy_sum, kept, "+", apply("mul", g, y), x.dims, reset=True),
            Accum(x.grad, cells, "+", apply("div", apply("sub", apply("sub", g, mean_g),
                                                         apply("mul", y, mean_gy)), deviation),
                  x.dims),
        )
    return out


def log_softmax(x: Tensor, axes: None | str | int | Sequence[int]) -> Tensor:
    """``x - log(sum(exp(x)))`` over ``axes``, computed stably (max-shifted)."""
    z = sub(x, _reduce_keep("log_softmax_max", x, axes, "max", differentiable=False))
    return sub(z, log(_reduce_keep("log_softmax_sum", exp(z), axes, "+")))


# --- integer class ids as data: one-hot, embedding lookup ------------------------------------

# The largest class count whose ids a precision holds exactly (every integer below it).
_EXACT_INTS = {Precision.f64: 2**53, Precision.f32: 2**24, Precision.f16: 2**11,
               Precision.bf16: 2**8}


class ClassIds(Tensor):
    """A data-backed tensor of integer class ids in ``[0, num_classes)``, one per position of
    its batch axes (no output or input axes). Made by :func:`class_ids`; set new ids with
    :meth:`set` (or :func:`set_class_ids`), which validates them before anything is written.

    ``Context.set_values`` validates them too (through ``Tnode.check_values``): ids out of
    range or not integers are refused naming the first, and nothing is written.
    """

    num_classes: int

    def check(self, values: object) -> np.ndarray:
        """``values`` as an array of this tensor's dims, or ``ValueError`` naming the first
        offending value and its position (not an integer, out of range), or the shape."""
        return _checked_ids(self.label, values, self.num_classes, self.dims)

    def set(self, ctx: object, values: object) -> object:
        """Validate, then write the ids into ``ctx`` (nothing is written if they are invalid).
        Returns the context."""
        return ctx.set_values(self, self.check(values))  # type: ignore[attr-defined]


def _checked_ids(label: str, values: object, num_classes: int,
                 dims: tuple[int, ...] | None) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as err:
        raise ValueError(f"class ids {label}: not an array of numbers ({err})") from None
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise ValueError(f"class ids {label}: expected integers, got an array of dtype "
                         f"{arr.dtype}")
    if dims is not None:
        size = int(np.prod(dims))
        if arr.shape != tuple(dims) and arr.shape != (size,):
            raise ValueError(f"class ids {label}: got {arr.size} ids of shape {arr.shape}, "
                             f"expected shape {tuple(dims)} (or flat ({size},))")
        arr = arr.reshape(dims)
    if arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.trunc(arr))
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"class ids {label}: value {float(arr[pos])!r} at position {pos} "
                             f"is not an integer")
    bad = (arr < 0) | (arr >= num_classes)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        v = arr[pos]
        v = int(v) if arr.dtype.kind in "iu" else float(v)
        raise ValueError(f"class ids {label}: value {v!r} at position {pos} is out of range: "
                         f"expected an integer in [0, {num_classes})")
    return arr


def class_ids(
    ids: object = None,
    *,
    num_classes: int,
    label: str = "class_ids",
    batch_dims: Sequence[int] | None = None,
    prec: Precision | str = Precision.f32,
) -> ClassIds:
    """A tensor of integer class ids, validated now (each an integer in ``[0, num_classes)``;
    ``ValueError`` names the first that is not). All its axes are batch axes (``batch_dims``
    defaults to the array's shape); without ``ids``, give ``batch_dims`` and set them later
    with :meth:`ClassIds.set`. Ids are stored as floats of ``prec``, which must hold every id
    exactly (f32: fewer than 2**24 classes)."""
    prec = precision_of(prec)
    if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or \
            num_classes < 1:
        raise ValueError(f"class ids {label}: num_classes must be an integer >= 1, "
                         f"got {num_classes!r}")
    if num_classes > _EXACT_INTS[prec]:
        raise ValueError(f"class ids {label}: {prec.value} holds integers exactly only below "
                         f"{_EXACT_INTS[prec]}, not {num_classes} classes: use a wider prec")
    if ids is None:
        if batch_dims is None:
            raise ValueError(f"class ids {label}: give ids or batch_dims")
        dims = _dims_row("batch", batch_dims)
        host = None
    else:
        dims = None if batch_dims is None else _dims_row("batch", batch_dims)
        arr = _checked_ids(label, ids, int(num_classes), dims)
        dims = tuple(arr.shape)
        host = arr.astype(prec.numpy_dtype)
    shape = Shape(dims, (), ())
    node = Tnode(label, shape.dims, prec, host_data=host, needs_init=True)
    node.check_values = lambda v: _checked_ids(label, v, int(num_classes), shape.dims)
    t = ClassIds(node, shape, kind="term", differentiable=False)
    t.num_classes = int(num_classes)
    return t


def set_class_ids(ctx: object, ids: ClassIds, values: object) -> object:
    """``ids.set(ctx, values)``: validate the class ids, then write them. Returns the context."""
    if not isinstance(ids, ClassIds):
        raise TypeError(f"set_class_ids expects a tensor made by class_ids, got {ids!r}")
    return ids.set(ctx, values)


def _iota(label: str, n: int, prec: Precision) -> Tensor:
    """A constant data tensor ``0, 1, ..., n-1`` along one output axis."""
    node = Tnode(label, (n,), prec, host_data=np.arange(n, dtype=prec.numpy_dtype))
    return Tensor(node, Shape((), (n,), ()), kind="term", differentiable=False)


def one_hot(ids: ClassIds, *, prec: Precision | str | None = None) -> Tensor:
    """``[ids == v for v in range(num_classes)]`` along a new output axis (not differentiable).

    A row whose id matched no class (out of range or not an integer: ids set by
    ``Context.set_values`` are not validated) is NaN throughout, so what is computed from it
    shows the error rather than treating the id as absent."""
    if not isinstance(ids, ClassIds):
        raise TypeError(f"one_hot expects a tensor made by class_ids, got {ids!r}")
    n_cls = ids.num_classes
    prec = ids.prec if prec is None else precision_of(prec)
    iota = _iota(f"{ids.label}_classes", n_cls, ids.prec)
    nb = len(ids.dims)
    space = ids.dims + (n_cls,)
    hit = apply("eq", Get(ids.value, _all(nb)), Get(iota.value, (nb,)))
    hits = Tensor(Tnode(f"{ids.label}_hits", ids.dims, prec), ids.shape, kind="op",
                  children=(ids, iota), differentiable=False)
    hits.forward_code = (Accum(hits.value, _all(nb), "+", hit, space, reset=True),)
    shape = Shape(ids.shape.batch, (n_cls,), ())
    out = Tensor(Tnode(f"{ids.label}_one_hot", shape.dims, prec), shape, kind="op",
                 children=(ids, iota, hits), differentiable=False)
    out.forward_code = (Accum(out.value, _all(nb + 1), "=",
                              apply("div", hit, Get(hits.value, _all(nb))), space),)
    return out


def embedding(ids: ClassIds, table: Tensor) -> Tensor:
    """Row ``ids[b]`` of ``table`` (dims ``(num_classes, dim)``, as torch.nn.Embedding's
    weight) at every batch position ``b``: the result has ``ids``' batch axes and output row
    ``(dim,)``. A one-hot contraction (a GEMM when large): its gradient scatters into the rows
    of the table that were looked up."""
    if not isinstance(ids, ClassIds):
        raise TypeError(f"embedding expects class ids made by class_ids, got {ids!r}")
    if len(table.dims) != 2 or table.dims[0] != ids.num_classes:
        raise ValueError(f"embedding: the table {table.label} has dims {table.dims}, expected "
                         f"({ids.num_classes}, dim) for {ids.num_classes} classes")
    oh = one_hot(ids, prec=table.prec)
    nb = len(ids.dims)
    dim = table.dims[1]
    shape = Shape(ids.shape.batch, (dim,), ())
    space = ids.dims + (dim, ids.num_classes)
    v, d = nb + 1, nb
    return _contract("embedding", oh, table, _all(nb) + (v,), (v, d), shape, space)


# --- counter-based random numbers on the device -----------------------------------------------


_U52 = 2**52


class Rng:
    """A counter-based random generator on the device: a seed and a step counter, each a
    one-element f64 node. Every draw (:meth:`uniform`) is a pure integer hash of
    ``(seed, counter, element index)`` (the op table's ``hash_*`` rows), so the CPU and CUDA
    backends draw identical numbers, and each draw adds 1 to the counter as it runs: a routine
    draws new numbers every time it runs, and a run resumed with the counter restored (it is in
    :meth:`state_nodes`, and in ``buffers(loss)``) continues the same stream exactly.

    ``seed``: an integer in ``[0, 2**52)``; ``ctx.set_values(rng.seed, s)`` reseeds.
    """

    def __init__(self, seed: int = 0, *, label: str = "rng") -> None:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or \
                not 0 <= seed < _U52:
            raise ValueError(f"Rng {label}: seed must be an integer in [0, 2**52), got {seed!r}")
        self.label = label
        self.seed = Tnode(f"{label}_seed", (), Precision.f64,
                          host_data=np.array(float(seed), np.float64))
        self.counter = Tnode(f"{label}_counter", (), Precision.f64, zero_start=True)

    def state_nodes(self) -> list[Tnode]:
        """What a checkpoint must hold to continue the stream: the seed and the counter."""
        return [self.seed, self.counter]

    def uniform(self, *, batch_dims: Sequence[int] = (), output_dims: Sequence[int] = (),
                input_dims: Sequence[int] = (), label: str | None = None) -> Tensor:
        """A tensor of independent uniform draws in ``[0, 1)`` (multiples of 2**-24, exact at
        f32), new ones every time its forward code runs. f64 (the hash is exact there); not
        differentiable."""
        shape = Shape(_dims_row("batch", batch_dims) or (), _dims_row("output", output_dims) or (),
                      _dims_row("input", input_dims) or ())
        return _uniform(self, shape, label or f"{self.label}_uniform")

    def uniform_like(self, t: Tensor, *, label: str | None = None) -> Tensor:
        """Draws shaped as ``t``."""
        return _uniform(self, t.shape, label or f"{self.label}_uniform")

    def __repr__(self) -> str:
        return f"Rng({self.label}, seed node {self.seed.name}, counter {self.counter.name})"


def _hash_mix(z: Expr) -> Expr:
    from ocannl.ir.ops import HASH_MIX

    for shift, mult in HASH_MIX:
        z = apply("hash_xsm", z, Const(float(shift)), Const(float(mult)))
    return z


def uniform_expr(seed: Expr, counter: Expr, index: Expr) -> Expr:
    """The draw at ``(seed, counter, index)`` as an expression (``ops.uniform_reference`` in
    NumPy); exact in an f64 computation."""
    h = _hash_mix(apply("hash_add", Const(0.0), seed))
    h = _hash_mix(apply("hash_add", h, counter))
    h = _hash_mix(apply("hash_add", h, index))
    return apply("hash_unit", h)


def _uniform(rng: Rng, shape: Shape, label: str) -> Tensor:
    dims = shape.dims
    f64 = Precision.f64
    if int(np.prod(dims)) >= _U52:
        raise ValueError(f"{label}: {int(np.prod(dims))} draws exceed the 2**52 indices")
    iotas = [_iota(f"{label}_ax{k}", d, f64) for k, d in enumerate(dims)]
    strides = [int(np.prod(dims[k + 1:])) for k in range(len(dims))]
    index: Expr = Const(0.0)
    for k, (io, st) in enumerate(zip(iotas, strides, strict=True)):
        if dims[k] == 1:
            continue
        term: Expr = Get(io.value, (k,))
        index = apply("add", index, term if st == 1 else apply("mul", term, Const(float(st))))
    out = Tensor(Tnode(label, dims, f64), shape, kind="op", children=tuple(iotas),
                 differentiable=False)
    counter = Get(rng.counter, ())
    out.forward_code = (
        Accum(out.value, _all(len(dims)), "=", uniform_expr(Get(rng.seed, ()), counter, index),
              dims),
        Accum(rng.counter, (), "=", apply("add", counter, Const(1.0)), ()),
    )
    _BUFFERS[out] = tuple(rng.state_nodes())
    return out


def dropout(x: Tensor, *, rate: float, rng: Rng) -> Tensor:
    """Inverted dropout: each element kept with probability ``1 - rate`` and scaled by
    ``1 / (1 - rate)``, else 0; a new mask every time it runs (drawn from ``rng``). The
    gradient flows through the kept elements, scaled alike."""
    if not isinstance(rate, (int, float)) or not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout: rate must be a number in [0, 1), got {rate!r}")
    if not isinstance(rng, Rng):
        raise TypeError(f"dropout: rng must be an ocannl.tensor.Rng, got {rng!r}")
    u = rng.uniform_like(x, label=f"{x.label}_dropout_u")
    scale = Const(1.0 / (1.0 - rate))
    zero = Const(0.0)

    def fwd(a: list[Expr]) -> Expr:
        return apply("where", apply("ge", a[1], Const(float(rate))), apply("mul", a[0], scale),
                     zero)

    def grads(a: list[Expr], v: Expr, g: Expr) -> list[Expr | None]:
        return [apply("where", apply("ge", a[1], Const(float(rate))), apply("mul", g, scale),
                      zero), None]

    return _elementwise("dropout", [x, u], fwd, grads, prec=x.prec)


# --- state that is neither a parameter nor optimizer state ------------------------------------

# Tensor -> the nodes it keeps across steps (random-stream counters, running statistics).
_BUFFERS: weakref.WeakKeyDictionary[Tensor, tuple[Tnode, ...]] = weakref.WeakKeyDictionary()


def register_buffers(t: Tensor, nodes: Sequence[Tnode]) -> None:
    """Record that running ``t``'s forward code updates ``nodes`` (state to checkpoint)."""
    _BUFFERS[t] = tuple(_BUFFERS.get(t, ())) + tuple(nodes)


def buffers(t: Tensor) -> list[Tnode]:
    """The nodes ``t``'s graph updates as it runs besides its parameters: random-stream seeds
    and counters, batch-norm running statistics. A resumed run needs them to continue exactly:
    checkpoint ``training_state(loss, optimizer) + buffers(loss)``."""
    seen: dict[int, Tnode] = {}
    for s in t.topo():
        for n in _BUFFERS.get(s, ()):
            seen.setdefault(n.id, n)
    return list(seen.values())
