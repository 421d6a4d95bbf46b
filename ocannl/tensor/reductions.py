"""Reductions (``sum``, ``max``, ``mean``, ``min``, ``reduce``, with or without the reduced
axes kept) and contractions (``matmul``, and the sum of products ``einsum``, the convolutions
and ``embedding`` are made of): an assignment whose target lacks some of the product space's
iterators, with its gradient."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ocannl.ir.assignments import Accum, Const, Fixed, Get, Index, apply, iterators_of
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.tensor import inference
from ocannl.tensor.inference import Constraint, Origin, Row, RowIneq, SymShape
from ocannl.tensor.leaves import _all, _lift, _new, _read, _result_prec, open_result
from ocannl.tensor.pointwise import div
from ocannl.tensor.shape import (
    BCAST_ONE,
    ROWS,
    Shape,
    broadcast,
    broadcast_projection,
    same_dim,
    stretches,
)
from ocannl.tensor.tensor import Tensor

# --- contractions -----------------------------------------------------------------------------


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """OCANNL's ``*``: contract a's input axes with b's output axes, broadcasting batches.

    As upstream's ``Compose``: ``a.input ⊑ b.output`` (b's output axes broadcast into a's
    input axes, which the contraction runs over), the result's batch refines both batches,
    its input row is b's and its output row a's; a shape left open is inferred from these."""
    a, b = _lift(a), _lift(b)
    if b.shape_known and not a.shape_known:
        _take_input_row(a, b)
    if a.shape_known and b.shape_known:
        _check_contracted(a, b)
        batch = broadcast([Shape(batch=a.shape.batch), Shape(batch=b.shape.batch)],
                          "matmul").batch
        out = _new("matmul", Shape(batch, a.shape.output, b.shape.input),
                   _result_prec([a, b]), (a, b))
    else:
        def rules(res: SymShape, ops: list[SymShape]) -> list[Constraint]:
            sa, sb = ops
            o = Origin("matmul")
            return [RowIneq(res.batch, sa.batch, o, "batch"),
                    RowIneq(res.output, sa.output, o, "output"),
                    RowIneq(sa.input, sb.output, o, "contracted (left input, right output)"),
                    RowIneq(res.batch, sb.batch, o, "batch"),
                    RowIneq(res.input, sb.input, o, "input")]

        out = open_result("matmul", _result_prec([a, b]), (a, b), [a, b], None, rules)

    def build() -> None:
        shape = out.shape
        batch = shape.batch
        n_res = len(shape.dims)
        k_its = tuple(range(n_res, n_res + len(a.shape.input)))
        space = shape.dims + a.shape.input
        res_o = tuple(range(len(batch), len(batch) + len(shape.output)))
        res_i = tuple(range(len(batch) + len(shape.output), n_res))

        def batch_proj(t: Tensor) -> tuple[Index, ...]:
            return broadcast_projection(Shape(batch=t.shape.batch), Shape(batch=batch))

        contracted = broadcast_projection(Shape(output=b.shape.output),
                                          Shape(output=a.shape.input))
        pa = batch_proj(a) + res_o + k_its
        pb = batch_proj(b) + tuple(k_its[i] if isinstance(i, int) else i
                                   for i in contracted) + res_i
        _contract_code(out, a, b, pa, pb, space)

    out.defer(build)
    return out


def _take_input_row(a: Tensor, b: Tensor) -> None:
    """A parameter's open input row (a bare row variable) meeting a known output row in ``@``
    becomes that row at once: closing would give it no other axes, and knowing it now keeps
    the rest of the graph off inference (a layer's weight ``T.param(output_dims=[d])``)."""
    assert a.sym is not None
    row = inference.norm(a.sym.input)
    v = row.var
    if v is None or row.beg or row.dims or not v.owner.terminal:
        return
    known = Row((), None, tuple(int(d) for d in b.shape.output))
    inference.add([inference.RowEq(a.sym.input, known, Origin("matmul", (a, b)))])
    a.shape_inferred()


def _check_contracted(a: Tensor, b: Tensor) -> None:
    """``a.input ⊑ b.output`` over known shapes: b's output axes, aligned right, equal to a's
    input axes or a 1 that stretches."""
    ai, bo = a.shape.input, b.shape.output
    if len(bo) > len(ai):
        raise ValueError(
            f"matmul: Too many axes in an operand: the right operand's output axes {bo} "
            f"({b.label} {b.shape}) outnumber the left operand's input axes {ai} ({a.label} "
            f"{a.shape}); maybe using @ instead of * (`@` is OCANNL's `*`, `*` its `*.`)?")
    ok = all(stretches(y) or same_dim(x, y)
                                    for x, y in zip(ai[len(ai) - len(bo):], bo, strict=True))
    if not ok:
        raise ValueError(
            f"matmul: the left operand's input axes {ai} ({a.label} {a.shape}) do not match "
            f"the right operand's output axes {bo} ({b.label} {b.shape})")


def _contract(label: str, a: Tensor, b: Tensor, pa: tuple[Index, ...], pb: tuple[Index, ...],
              shape: Shape, space: tuple[int, ...]) -> Tensor:
    """``out[res] += a[pa] * b[pb]`` over ``space`` (result iterators first)."""
    out = _new(label, shape, _result_prec([a, b]), (a, b))
    _contract_code(out, a, b, pa, pb, space)
    return out


def _contract_code(out: Tensor, a: Tensor, b: Tensor, pa: tuple[Index, ...],
                   pb: tuple[Index, ...], space: tuple[int, ...]) -> None:
    res = _all(len(out.shape.dims))
    x, y = _read(a, pa), _read(b, pb)
    out.forward_code = (Accum(out.value, res, "+", apply("mul", x, y), space, reset=True),)
    if out.grad is not None:
        g = Get(out.grad, res)
        out.backprop_code = tuple(
            Accum(t.grad, p, "+", apply("mul", g, other), space)
            for t, p, other in ((a, pa, y), (b, pb, x)) if t.grad is not None
        )


Tensor.__matmul__ = lambda a, b: matmul(a, b)  # type: ignore[assignment]
Tensor.__rmatmul__ = lambda a, b: matmul(b, a)  # type: ignore[assignment]


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


# --- reductions that keep the reduced axes (size 1), and min ----------------------------------


def _kept_shape(t: Tensor, red: set[int]) -> Shape:
    off = t.shape.row_offsets()
    rows = {}
    for row in ROWS:
        rows[row] = tuple(BCAST_ONE if off[row] + j in red else d
                          for j, d in enumerate(t.shape.row(row)))
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
