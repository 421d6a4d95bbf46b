"""``einsum``: upstream OCANNL's einsum notation, its shapes inferred as equations.

A spec is ``"rhs1;rhs2=>lhs"`` (the grammar is ``einsum_spec``'s): each operand equals its
slot's shape, and the result is the slot after ``=>``. A label names one dim throughout the
spec; a label or a row variable absent from the result is reduced over (summed, or the
maximum with ``accum="max"``). ``...`` is the row's own row variable (shared by every slot's
row at that position), ``..v..`` a named one. A number is a fixed index: in an operand it
reads that position, in the result it writes there (the axis has at least that many cells,
the others are 0). A label repeated in an operand reads its diagonal, repeated in the result
writes it. An affine axis ``stride*o=+k`` (padded: ``in = stride*o``) or ``stride*o<+k``
(valid: ``in = stride*(o-1) + 1 + (k-1)*dilation``) reads a convolution window, zero outside
the operand.

Unlike pointwise ops, einsum does not broadcast, except through row variables.
``capture=Dims()`` binds the spec's labels and row variables to read (``dims["k"]``) or
constrain (``set_dim``, ``set_equal``, ``set_scale``) their solved sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ocannl.ir.assignments import Accum, Affine, Comp, Fixed, Get, Index, apply
from ocannl.ir.ops import OPS, Precision
from ocannl.ir.tnode import Tnode
from ocannl.tensor import inference
from ocannl.tensor.einsum_spec import (
    Axis,
    Concat,
    Conv,
    EinsumSpec,
    FixedIndex,
    Label,
    OperandSpec,
    Placeholder,
    RowSpec,
    parse,
)
from ocannl.tensor.inference import (
    ROW_NAMES,
    AtLeast,
    Constraint,
    DimEq,
    DimRule,
    DimVar,
    Origin,
    Owner,
    Row,
    RowEq,
    RowVar,
    ShapeError,
    SymShape,
    find,
    norm,
)
from ocannl.tensor.leaves import _lift, _read, _result_prec, sym_of
from ocannl.tensor.tensor import Tensor

ACCUMS = ("+", "max")
COMBINES = ("mul", "add", "where")


class Dims:
    """The labels and row variables of an einsum spec, captured (upstream's ``["a"; "b"]``
    after a spec): ``dims["a"]`` is a label's solved size, or a row variable's solved axes (a
    tuple), closing the inference if it is still open; ``set_dim``, ``set_equal`` and
    ``set_scale`` constrain them before that."""

    def __init__(self) -> None:
        self._vars: dict[str, DimVar | RowVar] = {}
        self.spec = ""

    def _bind(self, name: str, var: DimVar | RowVar, spec: str) -> None:
        if name in self._vars and self._vars[name] is not var:
            raise ValueError(f"einsum {spec!r}: captured name {name!r} is already bound by "
                             f"einsum {self.spec!r}: capture each spec in its own Dims")
        self._vars[name] = var
        self.spec = spec

    def var(self, name: str) -> DimVar | RowVar:
        if name not in self._vars:
            raise KeyError(f"{name!r} is not a label or row variable of the captured spec "
                           f"{self.spec!r} (it has {sorted(self._vars)})")
        return self._vars[name]

    def __getitem__(self, name: str) -> int | tuple[int, ...]:
        v = self.var(name)
        inference.close_vars([v])
        if isinstance(v, RowVar):
            row = norm(Row((), v, ()))
            return tuple(int(d) for d in row.dims)  # type: ignore[arg-type]
        return int(find(v))  # type: ignore[arg-type]

    def total(self, name: str) -> int:
        """A label's size, or the product of a row variable's sizes."""
        v = self[name]
        return math.prod(v) if isinstance(v, tuple) else v

    def set_dim(self, name: str, size: int) -> None:
        """Fix a label's size, or a row variable's total number of cells."""
        v = self.var(name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"set_dim {name}: the size must be an integer >= 1, got {size!r}")
        origin = Origin(f"set_dim {name}={size} of einsum {self.spec!r}")
        if isinstance(v, RowVar):
            inference.add([inference.RowTotal((Row((), v, ()),), lambda t: [size], origin)])
        else:
            inference.add([DimEq(v, int(size), origin)])

    def set_equal(self, a: str, b: str) -> None:
        """Two labels equal; two row variables (or a row variable and a label) with the same
        total number of cells."""
        va, vb = self.var(a), self.var(b)
        origin = Origin(f"set_equal {a} {b} of einsum {self.spec!r}")
        if isinstance(va, DimVar) and isinstance(vb, DimVar):
            inference.add([DimEq(va, vb, origin)])
            return
        rows = tuple(Row((), v, ()) if isinstance(v, RowVar) else Row((), None, (v,))
                     for v in (va, vb))
        inference.add([inference.RowTotal(rows, lambda t: [t[1], t[0]], origin)])

    def set_scale(self, large: str, small: str, factor: int) -> None:
        """``large = factor * small`` (upstream's ``Shape.set_scale``)."""
        vl, vs = self.var(large), self.var(small)
        if not (isinstance(vl, DimVar) and isinstance(vs, DimVar)):
            raise ValueError(f"Shape.set_scale: {large} and {small} must be labels, not row "
                             f"variables")

        def solve(k: list[int | None]) -> list[int | None]:
            lg, sm = k
            if lg is not None and sm is not None and int(lg) != factor * int(sm):
                raise ShapeError(f"Shape.set_scale: dimensions do not satisfy d_large = factor "
                                 f"* d_small ({large}={int(lg)}, {small}={int(sm)}, factor "
                                 f"{factor})")
            if lg is not None and sm is None:
                if int(lg) % factor:
                    raise ShapeError(f"Shape.set_scale: solved dimension {int(lg)} for {large} "
                                     f"is not divisible by factor {factor}")
                return [lg, int(lg) // factor]
            if sm is not None:
                return [factor * int(sm), sm]
            return [None, None]

        inference.add([DimRule((vl, vs), solve, Origin(f"set_scale {large}={factor}*{small}"))])


@dataclass
class _Env:
    """The variables of one einsum's spec, by name."""

    spec: EinsumSpec
    origin: Origin
    labels: dict[str, DimVar] = field(default_factory=dict)
    rows: dict[str, RowVar] = field(default_factory=dict)
    cons: list[Constraint] = field(default_factory=list)
    axes: dict[int, DimVar] = field(default_factory=dict)  # id(axis occurrence) -> its dim

    def label(self, name: str) -> DimVar:
        if name not in self.labels:
            self.labels[name] = DimVar(Owner("", "", False), name=name)
        return self.labels[name]

    def row_var(self, name: str, row: str) -> RowVar:
        if name not in self.rows:
            self.rows[name] = RowVar(Owner("", row, False), name=name.lstrip("."))
        return self.rows[name]


def _axis_dim(env: _Env, ax: Axis, in_result: bool) -> DimVar:
    """The dim of one written axis, with the constraints it brings."""
    o = env.origin
    if isinstance(ax, Label):
        return env.label(ax.name)
    d = DimVar(Owner("", "", False))
    if isinstance(ax, FixedIndex):
        env.cons.append(AtLeast(d, ax.index + 1, o))
    elif isinstance(ax, Conv):
        if in_result:
            raise ValueError(f"einsum {env.spec.text!r}: an affine axis may only be read (in an "
                             f"operand), not written")
        env.cons.append(_conv_rule(env, ax, d))
    elif isinstance(ax, Concat):
        parts = tuple(env.label(p) for p in ax.parts)
        env.cons.append(DimRule((d, *parts), _concat_solve(env.spec.text), o))
    return d


def _conv_rule(env: _Env, ax: Conv, inp: DimVar) -> DimRule:
    spec = env.spec.text
    if ax.kernel is not None and ax.use_padding is None:
        raise ValueError(f"einsum {spec!r}: use_padding must be specified in convolution spec "
                         f"(use = for true, < for false)")
    s, dil = ax.stride, ax.dilation
    over = env.label(ax.over)
    valid = ax.kernel is not None and not ax.use_padding
    if not valid:  # strided, or padded: in = stride * out
        def solve(k: list[int | None]) -> list[int | None]:
            i, o = k
            if i is not None and o is None:
                if int(i) % s:
                    raise ShapeError(f"einsum {spec!r}: incompatible stride: input {int(i)} is "
                                     f"not a multiple of stride {s}")
                return [i, int(i) // s]
            if o is not None:
                if i is not None and int(i) != s * int(o):
                    raise ShapeError(f"einsum {spec!r}: incompatible stride: input {int(i)} is "
                                     f"not {s} * {int(o)}")
                return [s * int(o), o]
            return [None, None]
        return DimRule((inp, over), solve, env.origin)
    kernel = env.label(ax.kernel)  # type: ignore[arg-type]

    def solve_valid(k: list[int | None]) -> list[int | None]:
        i, o, kk = k
        if kk is None:
            return [i, o, None]
        span = 1 + (int(kk) - 1) * dil
        if i is not None and o is None:
            if (int(i) - span) % s or int(i) < span:
                raise ShapeError(f"einsum {spec!r}: incompatible stride: input {int(i)}, window "
                                 f"{span}, stride {s}")
            return [i, (int(i) - span) // s + 1, kk]
        if o is not None:
            want = s * (int(o) - 1) + span
            if i is not None and int(i) != want:
                raise ShapeError(f"einsum {spec!r}: incompatible stride: input {int(i)} is not "
                                 f"{s}*({int(o)}-1) + {span}")
            return [want, o, kk]
        return [None, None, kk]
    return DimRule((inp, over, kernel), solve_valid, env.origin)


def _concat_solve(spec: str) -> Callable[[list[int | None]], list[int | None]]:
    def solve(k: list[int | None]) -> list[int | None]:
        total, parts = k[0], k[1:]
        missing = [j for j, p in enumerate(parts) if p is None]
        known = sum(int(p) for p in parts if p is not None)
        if not missing:
            if total is not None and int(total) != known:
                raise ShapeError(f"einsum {spec!r}: concatenation of {known} cells into an axis "
                                 f"of {int(total)}")
            return [known, *parts]
        if total is not None and len(missing) == 1:
            out = list(parts)
            if int(total) < known:
                raise ShapeError(f"einsum {spec!r}: concatenation parts of {known} exceed the "
                                 f"axis of {int(total)}")
            out[missing[0]] = int(total) - known
            return [total, *out]
        return [total, *parts]
    return solve


def _spec_shapes(parsed: EinsumSpec, ts: list[Tensor], origin: Origin,
                 result: Tensor | None = None) -> tuple[_Env, list[SymShape], SymShape]:
    """The spec's variables, each operand's slot and the result's, and (in ``env.cons``) the
    equations tying each operand, and ``result`` when given, to its slot."""
    env = _Env(parsed, origin)
    slots = [SymShape(*(_slot_row(env, op.rows[k], ROW_NAMES[k], False) for k in range(3)))
             for op in parsed.operands]
    res = SymShape(*(_slot_row(env, parsed.result.rows[k], ROW_NAMES[k], True)
                     for k in range(3)))
    tied = [*zip(ts, slots, strict=True), *([(result, res)] if result is not None else [])]
    for t, slot in tied:
        sym = sym_of(t)
        env.cons += [RowEq(sym.row(r), slot.row(r), origin, r) for r in ROW_NAMES]
    return env, slots, res


def _slot_row(env: _Env, rs: RowSpec, row: str, in_result: bool) -> Row:
    var = None if rs.var is None else env.row_var(rs.var, row)
    beg = tuple(_occurrence(env, ax, in_result) for ax in rs.beg)
    dims = tuple(_occurrence(env, ax, in_result) for ax in rs.dims)
    return Row(beg, var, dims)


def _occurrence(env: _Env, ax: Axis, in_result: bool) -> DimVar:
    d = _axis_dim(env, ax, in_result)
    env.axes[id(ax)] = d
    return d


def einsum(spec: str, *operands: Tensor | float, accum: str = "+", combine: str = "mul",
           capture: Dims | None = None) -> Tensor:
    """The result ``spec`` describes (see the module docstring): with one operand a copy, a
    permutation or a reduction of it; with several, ``combine`` (``"mul"``: upstream's ``+*``;
    ``"add"``: ``+++``; ``"where"`` over three: a select) of their cells, accumulated by
    ``accum`` (``"+"``, or ``"max"``: upstream's ``@^^`` and, with ``"add"``, ``@^+``) over
    the labels the result lacks. Shape errors name the spec and the operands' shapes."""
    if not isinstance(spec, str):
        raise TypeError(f"einsum spec must be a string, got {type(spec).__name__}: {spec!r}")
    if accum not in ACCUMS:
        raise ValueError(f"einsum {spec!r}: accum must be one of {ACCUMS}, got {accum!r}")
    if combine not in COMBINES:
        raise ValueError(f"einsum {spec!r}: combine must be one of {COMBINES}, got {combine!r}")
    parsed = parse(spec)
    ts = [_lift(x) for x in operands]
    if len(parsed.operands) != len(ts):
        raise ValueError(f"einsum {spec!r} names {len(parsed.operands)} operands, got {len(ts)}")
    if len(ts) > 1 and OPS[combine].arity != len(ts):
        raise ValueError(f"einsum {spec!r}: combine {combine!r} takes {OPS[combine].arity} "
                         f"operands, got {len(ts)}")
    env, slots, res = _spec_shapes(parsed, ts, Origin(f"einsum {spec!r}", tuple(ts)))
    prec = _result_prec(ts)
    out = Tensor(Tnode("einsum", None, prec), res, kind="op",
                 children=tuple(t for t in ts if t.kind != "number"))
    inference.add(env.cons, [out])
    if capture is not None:
        for name, v in [*env.labels.items(), *env.rows.items()]:
            capture._bind(name.lstrip(".") if name.startswith("...") else name, v, spec)
    if all(t.shape_known for t in ts):  # nothing outside the spec is open: close it now
        inference.close(out)
    out.defer(lambda: _build(out, ts, parsed, slots, res, env, accum, combine))
    return out


def _build(out: Tensor, ts: list[Tensor], parsed: EinsumSpec, slots: list[SymShape],
           res: SymShape, env: _Env, accum: str, combine: str) -> None:
    """The assignment, with every dim now known."""
    res_idx, projs, space = _projections(parsed, slots, res, env)
    _code(out, ts, projs, res_idx, space, accum, combine)


def _projections(parsed: EinsumSpec, slots: list[SymShape], res: SymShape, env: _Env
                 ) -> tuple[tuple[Index, ...], list[tuple[Index, ...]], tuple[int, ...]]:
    """The result's and each operand's projection and the product space: one iterator per
    label and per axis of each row variable; a reduced one is an iterator the result's
    projection lacks."""
    it: dict[object, int] = {}
    space: list[int] = []

    def iterator(key: object, size: int) -> int:
        if key not in it:
            it[key] = len(space)
            space.append(size)
        return it[key]

    def row_proj(rs: RowSpec, row: Row, in_result: bool) -> list[Index]:
        solved = norm(row)
        var_axes: tuple = ()
        if rs.var is not None:
            var_axes = norm(Row((), env.rows[rs.var], ())).dims
        out_idx: list[Index] = [axis_proj(ax, in_result) for ax in rs.beg]
        out_idx += [iterator((rs.var, k), int(d)) for k, d in enumerate(var_axes)]
        out_idx += [axis_proj(ax, in_result) for ax in rs.dims]
        assert len(out_idx) == len(solved.dims), (rs, solved)
        return out_idx

    def size(d: DimVar) -> int:
        return int(find(d))  # type: ignore[arg-type]

    def axis_proj(ax: Axis, in_result: bool) -> Index:
        if isinstance(ax, Label):
            return iterator(ax.name, size(env.labels[ax.name]))
        if isinstance(ax, FixedIndex):
            return Fixed(ax.index)
        if isinstance(ax, Placeholder):
            return iterator(("_", id(ax)), size(env.axes[id(ax)]))
        if isinstance(ax, Conv):
            o = iterator(ax.over, size(env.labels[ax.over]))
            if ax.kernel is None:
                return Affine(((ax.stride, o),), ax.offset)
            k = iterator(ax.kernel, size(env.labels[ax.kernel]))
            pad = 0
            if ax.use_padding:  # as much padding before as the window reaches past the centre
                pad = (size(env.labels[ax.kernel]) - 1) * ax.dilation // 2
            return Affine(((ax.stride, o), (ax.dilation, k)), ax.offset - pad)
        raise ValueError(f"einsum {parsed.text!r}: a concatenation {'^'.join(ax.parts)} is "
                         f"read and written by T.concat, not einsum")

    def proj(spec: OperandSpec, sym: SymShape, in_result: bool) -> tuple[Index, ...]:
        rows = {r: row_proj(spec.rows[k], sym.row(r), in_result)
                for k, r in enumerate(ROW_NAMES)}
        return tuple(rows["batch"] + rows["output"] + rows["input"])

    res_idx = proj(parsed.result, res, True)
    projs = [proj(op, slot, False) for op, slot in zip(parsed.operands, slots, strict=True)]
    return res_idx, projs, tuple(space)


# Upstream's ``%cd ~logic`` shorthands, as specs: pointwise (no broadcasting), compose (``@``:
# the left operand's input row contracted with the right's output row), transpose.
LOGIC = {
    ".": "..b..|..i..->..o..;..b..|..i..->..o..=>..b..|..i..->..o..",
    "@": "..b..|..k..->..o..;..b..|..i..->..k..=>..b..|..i..->..o..",
    "T": "..b..|..i..->..o..=>..b..|..o..->..i..",
}


def assign(lhs: Tensor, accum: str, *operands: Tensor | float, logic: str,
           op: str | None = None, reset: bool = True) -> Comp:
    """One assignment ``lhs (accum)= op(operands)`` whose projections a spec gives: upstream's
    ``%cd lhs =:+ a * b ~logic:"spec"`` (``"."``, ``"@"``, ``"T"`` or any einsum spec, ``lhs``
    its result). ``accum``: ``"="``, ``"+"`` or ``"max"``; ``reset`` fills ``lhs`` with the
    accumulator's neutral element first (``=:+``; False: ``=+``, adding to what is there).
    ``op``: the op combining several operands (default ``"mul"``). The shapes meet the spec
    as einsum's do (an open one is inferred, then closed); the result is a computation to
    compile or add to a step."""
    if accum not in ACCUMS_OF_ASSIGN:
        raise ValueError(f"assign: accum must be one of {ACCUMS_OF_ASSIGN}, got {accum!r}")
    if not isinstance(lhs, Tensor) or lhs.kind == "number":
        raise TypeError(f"assign: the left-hand side must be a tensor with a buffer, got "
                        f"{lhs!r:.60}")
    spec = LOGIC.get(logic, logic)
    parsed = parse(spec)
    ts = [_lift(x) for x in operands]
    if len(parsed.operands) != len(ts):
        raise ValueError(f"assign ~logic:{logic!r} into {lhs.label}: the spec names "
                         f"{len(parsed.operands)} operands, got {len(ts)}")
    combine = op or ("mul" if len(ts) > 1 else "id")
    if len(ts) > 1 and OPS[combine].arity != len(ts):
        raise ValueError(f"assign: op {combine!r} takes {OPS[combine].arity} operands, got "
                         f"{len(ts)}")
    origin = Origin(f"assign ~logic:{logic!r} into {lhs.label}", tuple(ts))
    env, slots, res = _spec_shapes(parsed, ts, origin, result=lhs)
    inference.add(env.cons)
    for t in (lhs, *ts):
        _ = t.shape  # the code needs every dim: close what is open
    inference.close_vars([*env.labels.values(), *env.rows.values()])
    res_idx, projs, space = _projections(parsed, slots, res, env)
    args = [_read(t, p) for t, p in zip(ts, projs, strict=True)]
    expr = args[0] if len(args) == 1 else apply(combine, *args)
    return Comp((Accum(lhs.value, res_idx, accum, expr, space, reset=reset),),
                f"assign_{lhs.label}")


ACCUMS_OF_ASSIGN = ("=", "+", "max")


def _code(out: Tensor, ts: list[Tensor], projs: list[tuple[Index, ...]],
          res_idx: tuple[Index, ...], space: tuple[int, ...], accum: str, combine: str) -> None:
    """``out[res_idx] (accum)= combine(t[proj] ...)`` over ``space``, and each operand's
    gradient: the combining op's own rule, times (for ``max``) the share of the cells equal
    to the maximum."""
    args = [_read(t, p) for t, p in zip(ts, projs, strict=True)]
    x = args[0] if len(args) == 1 else apply(combine, *args)
    out.forward_code = (Accum(out.value, res_idx, accum, x, space, reset=True),)
    if out.grad is None:
        return
    g = Get(out.grad, res_idx)
    pre: tuple[Accum, ...] = ()
    if accum == "max":  # the gradient goes to the cells equal to the maximum, split evenly
        hit = apply("eq", x, Get(out.value, res_idx))
        ties = Tnode("einsum_ties", out.value.dims, Precision.f32)
        pre = (Accum(ties, res_idx, "+", hit, space, reset=True),)
        g = apply("div", apply("mul", g, hit), Get(ties, res_idx))
    ds = [g] if len(args) == 1 else OPS[combine].grad(args, x, g)
    out.backprop_code = pre + tuple(
        Accum(t.grad, p, "+", d, space)
        for t, p, d in zip(ts, projs, ds, strict=True) if t.grad is not None and d is not None)



