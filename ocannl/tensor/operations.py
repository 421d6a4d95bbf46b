"""The tensor DSL: leaves, pointwise ops, ``@``, reductions, ``einsum``, ``cast``, with backprop.

Every op builds one forward assignment over a product space and, when it is differentiable,
one backprop assignment per differentiable operand over the same space, written with the
projections of the forward one (so broadcasting in forward is a reduction in backprop).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ocannl.ir.assignments import Accum, Const, Expr, Get, Index, apply
from ocannl.ir.ops import Precision, precision_of, promote
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor import tensor as _t
from ocannl.tensor.shape import ROWS, Shape, broadcast, broadcast_projection
from ocannl.tensor.tensor import INIT_KINDS, Init, Tensor

Operand = Tensor | float | int

# --- leaves -----------------------------------------------------------------------------------


def _dims_row(name: str, dims: Sequence[int] | None) -> tuple[int, ...] | None:
    if dims is None:
        return None
    out = tuple(int(d) for d in dims)
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
    if op == "relu":
        return apply("mul", g, apply("gt", a, Const(0.0)))
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


def _parse_operand(spec: str) -> tuple[str, str, str]:
    """``"b|i->o"`` into (batch, input, output) label strings; parts may be absent."""
    batch, rest = spec.split("|", 1) if "|" in spec else ("", spec)
    inp, out = rest.split("->", 1) if "->" in rest else ("", rest)
    return batch.strip(), inp.strip(), out.strip()


def einsum(spec: str, a: Tensor, b: Tensor | None = None) -> Tensor:
    """Generalised contraction, OCANNL style.

    ``spec`` is ``"A;B=>R"`` (binary: the product of a and b) or ``"A=>R"`` (unary: a copy).
    Each of A, B, R is ``"batch|input->output"``, each part a string of one-letter axis labels
    (``"b|i->o"``; ``"i->o"`` has no batch axes; ``"o"`` only output axes). Equal labels are the
    same iterator; labels missing from R are summed over. Example: ``"b|i->h;h->o=>b|i->o"``.
    """
    if "=>" not in spec:
        raise ValueError(f"einsum spec {spec!r}: expected 'A;B=>R' or 'A=>R'")
    lhs, res = spec.split("=>")
    parts = lhs.split(";")
    ts = [a] if b is None else [a, b]
    if len(parts) != len(ts):
        raise ValueError(f"einsum spec {spec!r} names {len(parts)} operands, got {len(ts)}")
    ops = [_parse_operand(p) for p in parts]
    r = _parse_operand(res)
    extent: dict[str, int] = {}
    owner: dict[str, Tensor] = {}  # the operand that first gave each axis its extent
    for t, (pb, pi, po) in zip(ts, ops, strict=True):
        for row, labels in (("batch", pb), ("input", pi), ("output", po)):
            dims = t.shape.row(row)
            if len(labels) != len(dims):
                raise ValueError(
                    f"einsum {spec!r}: {row} row {labels!r} has {len(labels)} axes but "
                    f"{t.label} has shape {t.shape}"
                )
            for lab, d in zip(labels, dims, strict=True):
                first = owner.setdefault(lab, t)
                if extent.setdefault(lab, d) != d:
                    raise ValueError(f"einsum {spec!r}: axis {lab!r} is {extent[lab]} in "
                                     f"{first.label} {first.shape} and {d} in {t.label} {t.shape}")
    for lab in "".join(r):
        if lab not in extent:
            raise ValueError(f"einsum {spec!r}: result axis {lab!r} appears in no operand")
    rb, ri, ro = r
    order = list(dict.fromkeys(rb + ro + ri))  # result iterators first, in dims order
    order += [lab for lab in dict.fromkeys("".join(x[0] + x[2] + x[1] for x in ops))
              if lab not in order]
    it = {lab: k for k, lab in enumerate(order)}
    space = tuple(extent[lab] for lab in order)
    shape = Shape(tuple(extent[c] for c in rb), tuple(extent[c] for c in ro),
                  tuple(extent[c] for c in ri))
    projs = [tuple(it[c] for c in pb + po + pi) for pb, pi, po in ops]
    if b is not None:
        return _contract("einsum", a, b, projs[0], projs[1], shape, space)
    return _reduce_with("einsum", a, projs[0], tuple(it[c] for c in rb + ro + ri), shape,
                        space, "+")


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
                 shape: Shape, space: tuple[int, ...], accum: str) -> Tensor:
    out = _new(label, shape, t.prec, (t,))
    x = _read(t, proj)
    out.forward_code = (Accum(out.value, res_idx, accum, x, space, reset=True),)
    if out.grad is not None:
        g = Get(out.grad, res_idx)
        d = g if accum == "+" else apply("mul", g, apply("eq", x, Get(out.value, res_idx)))
        out.backprop_code = (Accum(t.grad, proj, "+", d, space),)
    return out


def sum(t: Tensor, axes: None | str | int | Sequence[int] = None) -> Tensor:  # noqa: A001
    """Sum over ``axes``: None (all), a row name ("batch", "input", "output"), or positions."""
    return _reduce("sum", t, axes, "+")


def max(t: Tensor, axes: None | str | int | Sequence[int] = None) -> Tensor:  # noqa: A001
    """Maximum over ``axes``; the gradient flows to every element equal to the maximum."""
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

