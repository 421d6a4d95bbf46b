"""Leaves of the model graph (parameters, data-backed terms, literal numbers), and how an op's
operands become tensors and reads: every op module builds on these."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ocannl.ir.assignments import Const, Expr, Get, Index
from ocannl.ir.ops import Precision, precision_of, promote
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor import inference, sharing
from ocannl.tensor import tensor as _t
from ocannl.tensor.inference import ROW_NAMES, Constraint, Origin, Owner, SymShape, open_row
from ocannl.tensor.shape import Based, Shape, int_dims
from ocannl.tensor.tensor import Init, Tensor

Operand = Tensor | float | int


def _dims_row(name: str, dims: Sequence[int] | None,
              axes: Sequence[tuple[str, int]] | None = None) -> tuple[int, ...] | None:
    """A row from ``dims`` (sizes) or ``axes`` (upstream's ``("rgb", 3)`` pairs: a size with
    a basis, which must agree wherever the axis meets another); at most one of them."""
    if axes is not None:
        if dims is not None:
            raise ValueError(f"give {name}_dims or {name}_axes, not both: {name}_dims "
                             f"{dims!r:.40}, {name}_axes {axes!r:.40}")
        if isinstance(axes, (str, bytes)) or not all(
                isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) for a in axes):
            raise TypeError(f"{name}_axes must be (basis, size) pairs such as [('rgb', 3)], "
                            f"got {axes!r:.60}")
        sizes = _dims_row(name, [size for _, size in axes])
        assert sizes is not None
        return tuple(Based(d, basis) for (basis, _), d in zip(axes, sizes, strict=True))
    if dims is None:
        return None
    out = int_dims(f"{name}_dims", dims)
    if any(d < 1 for d in out):
        raise ValueError(f"{name} dims must be positive, got {tuple(dims)}")
    return out


def param(
    label: str,
    *,
    output_dims: Sequence[int] | None = None,
    input_dims: Sequence[int] | None = None,
    batch_dims: Sequence[int] = (),
    init: str | Init | None = None,
    prec: Precision | str = Precision.f32,
    output_axes: Sequence[tuple[str, int]] | None = None,
    input_axes: Sequence[tuple[str, int]] | None = None,
) -> Tensor:
    """A trainable tensor, drawn by ``init`` (None: the default, ``T.set_default_init``).

    A row left ``None`` is inferred from the parameter's uses, as
    upstream's ``{w}``: ``w @ x`` gives ``w`` the input axes ``x`` has as output, ``w + y``
    gives it ``y``'s rows; closed when the dims are first needed (compiling), and refused
    there, naming the parameter and the row, if nothing it meets fixes them. The batch row is
    empty unless given."""
    init = _t.default_init() if init is None else _t.as_init(init)
    prec = precision_of(prec)
    label = sharing.param_prefix.get() + label
    rows = {"batch": _dims_row("batch", batch_dims) or (),
            "output": _dims_row("output", output_dims, output_axes),
            "input": _dims_row("input", input_dims, input_axes)}

    def make() -> Tensor:
        if rows["output"] is None or rows["input"] is None:
            shape: Shape | SymShape = SymShape(
                *(open_row(Owner(label, r, terminal=True), rows[r]) for r in ROW_NAMES))
        else:
            shape = Shape(rows["batch"], rows["output"], rows["input"])
        node = Tnode(label, shape.dims if isinstance(shape, Shape) else None, prec,
                     needs_init=True)
        seed = (_t._seed["base"], next(_t._param_counter))

        def draw(dims: tuple[int, ...], fan_in: int, _rng: object = None,
                 fan_out: int = 1) -> np.ndarray:
            return init.draw(dims, fan_in, np.random.default_rng(list(seed)), fan_out)

        t = Tensor(node, shape, kind="param", differentiable=True, init=draw)
        sharing.record_block_path(t)
        return t

    scope = sharing.active_scope.get()
    if scope is None:
        t = make()
    else:  # a model built again over other inputs gets its first build's parameter back
        spec = (rows["batch"], rows["output"], rows["input"], prec, init)
        shown = ", ".join(f"{r} {'inferred' if rows[r] is None else rows[r]}"
                          for r in ("batch", "output", "input"))
        t = scope.param(label, spec, f"{shown}, {prec.value}, init {init.kind}", make)
    return _t.param_postprocess(t)


def term(
    values: object = None,
    *,
    label: str = "term",
    batch_dims: Sequence[int] | None = None,
    input_dims: Sequence[int] | None = None,
    output_dims: Sequence[int] | None = None,
    prec: Precision | str = Precision.f32,
    batch_axes: Sequence[tuple[str, int]] | None = None,
    input_axes: Sequence[tuple[str, int]] | None = None,
    output_axes: Sequence[tuple[str, int]] | None = None,
) -> Tensor:
    """A non-differentiable, data-backed tensor (inputs, targets, a learning rate, a scale).

    With ``values``, the rows not given come from the array's shape, laid out batch, output,
    input: with none given, a 1-D array is an output row and a wider one has its last axis as
    the output row and the rest as batch axes; with ``batch_dims`` (and ``input_dims``) given,
    the axes between them are the output row; with ``output_dims`` (and ``input_dims``) given,
    the axes before them are the batch row. ``input_dims`` defaults to none. The array must then
    have exactly those dims, or be flat (or a scalar) with their number of values, as
    ``set_values`` takes them: rows given that re-cut another shape are refused, naming both,
    as are values that are not numbers (strings are not converted). Without ``values``,
    ``output_dims`` is needed.
    """
    prec = precision_of(prec)
    rows = {"batch": _dims_row("batch", batch_dims, batch_axes),
            "output": _dims_row("output", output_dims, output_axes),
            "input": _dims_row("input", input_dims, input_axes)}
    arr = None if values is None else _numbers(label, values)
    if arr is None:
        if rows["output"] is None:
            raise ValueError(f"term {label}: give values or output_dims")
        batch, output, inp = (rows[k] or () for k in ("batch", "output", "input"))
    else:
        batch, output, inp = _rows_of(label, arr.shape, rows)
    shape = Shape(batch, output, inp)
    if arr is not None and arr.shape != shape.dims and not (
            arr.ndim <= 1 and arr.size == int(np.prod(shape.dims))):
        raise ValueError(f"term {label}: values of shape {arr.shape} do not have the dims "
                         f"{shape.dims} of {shape} (give values shaped so, or flat)")
    host = None if arr is None else arr.reshape(shape.dims).astype(prec.numpy_dtype)
    node = Tnode(label, shape.dims, prec, host_data=host, needs_init=True)
    return Tensor(node, shape, kind="term", differentiable=False)


def _numbers(label: str, values: object) -> np.ndarray:
    """``values`` as an f64 array, or ``ValueError`` naming the term: real numbers (or
    booleans) only, as ``set_values`` takes them; a string is not converted."""
    try:
        raw = np.asarray(values)
    except (ValueError, TypeError) as err:
        raise ValueError(f"term {label}: the values are not an array of numbers ({err})") \
            from None
    if raw.dtype.kind not in "biuf" and raw.dtype.name != "bfloat16":
        raise ValueError(f"term {label}: values must be real numbers, got dtype {raw.dtype}")
    return raw.astype(np.float64)


def _rows_of(label: str, shape: tuple[int, ...], rows: dict[str, tuple[int, ...] | None]
             ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The batch, output and input rows of a term over values of ``shape``: those given, and
    the rest read from the shape (see :func:`term`); ``ValueError`` naming both where the
    shape does not hold the rows given."""
    batch, output, inp = rows["batch"], rows["output"], rows["input"]
    if batch is output is inp is None:
        return shape[:-1], shape[-1:], ()
    if batch is None and output is None:
        raise ValueError(f"term {label}: input_dims {inp} alone leave the batch and output "
                         f"rows of values of shape {shape} ambiguous: give batch_dims or "
                         f"output_dims too")
    if output is None:  # batch given: the output row lies between it and the input row
        inp = inp or ()
        cut = len(shape) - len(inp)
        if len(batch) <= cut and shape[:len(batch)] == batch and shape[cut:] == inp:
            return batch, shape[len(batch):cut], inp
    else:
        inp = inp or ()
        if batch is None:  # the batch row is what lies before the output and input rows
            tail = len(output) + len(inp)
            batch = shape[:len(shape) - tail] if tail <= len(shape) else ()
        return batch, output, inp
    given = ", ".join(f"{k}_dims {v}" for k, v in rows.items() if v is not None)
    raise ValueError(f"term {label}: values of shape {shape} do not hold {given} (laid out "
                     f"batch, output, input)")


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


def open_result(label: str, prec: Precision, children: tuple[Tensor, ...],
                operands: Sequence[Tensor], differentiable: bool | None,
                constraints: Callable[[SymShape, list[SymShape]], list[Constraint]]) -> Tensor:
    """An op's result whose shape is inferred: fresh open rows, and ``constraints(result,
    operands' rows)``, solved as far as they can be now (a conflict raises here, naming the op
    and the operands' shapes)."""
    res = SymShape(*(open_row(Owner("", r, terminal=False), None) for r in ROW_NAMES))
    out = Tensor(Tnode(label, None, prec), res, kind="op", children=children,
                 differentiable=differentiable)
    cons = constraints(res, [sym_of(t) for t in operands])
    origin = Origin(label, tuple(operands))
    for c in cons:
        c.origin = origin
    inference.add(cons, [out])
    out.shape_inferred()
    return out


def expect_shape(t: Tensor, want: Tensor | Shape, what: str) -> None:
    """Require ``t``'s rows to equal ``want``'s (another tensor's, or a shape): an open row
    of either is inferred from the other (a model's last layer takes its width from the
    loss's target); ``ValueError`` naming ``what`` and both shapes where they differ."""
    if t.shape_known and (isinstance(want, Shape) or want.shape_known):
        other = want if isinstance(want, Shape) else want.shape
        if tuple(map(int, t.shape.dims)) == tuple(map(int, other.dims)) and all(
                len(t.shape.row(r)) == len(other.row(r)) for r in ROW_NAMES):
            return
        shown = other if isinstance(want, Shape) else f"{want.label} {other}"
        raise ValueError(f"{what}: {t.label} {t.shape} does not match {shown}")
    a = sym_of(t)
    b = SymShape.of(want) if isinstance(want, Shape) else sym_of(want)
    origin = Origin(what, (t,) if isinstance(want, Shape) else (t, want))
    inference.add([inference.RowEq(a.row(r), b.row(r), origin, r) for r in ROW_NAMES])


def sym_of(t: Tensor) -> SymShape:
    """``t``'s rows for the inference: its open ones, or its known shape as rows."""
    return t.sym if t.sym is not None else SymShape.of(t.shape)


def _all(n: int) -> tuple[int, ...]:
    return tuple(range(n))
