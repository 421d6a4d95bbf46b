"""Concatenation (upstream OCANNL's ``++^``) and block literals (``[a; b]``, ``[|a; b|]``,
``(a, b)``).

``concat(spec, *xs)`` takes an n-ary einsum spec in which one or more axes are written
``a^b^c``: an axis that runs over ``a``, then ``b``, then ``c`` (its size is the sum). The
labels and row variables work as in :func:`~ocannl.tensor.einsum.einsum` (equations, no
broadcasting except through row variables); the shapes are inferred by einsum's machinery,
which makes a ``^`` axis's size the sum of its parts. The patterns of upstream's docs:

- ``"a; b; c => a^b^c"``: concatenate (any row, other axes alongside:
  ``"...|a; ...|b => ...|a^b"``, ``"x, a; x, b => x, a^b"``);
- ``"a^b => a"`` / ``"a^b => b"`` / ``"a^b^c => b"``: a prefix, a suffix, a middle slice;
- ``"a^b => b^a"``: a rotation (every ``^`` axis of the spec moves together).

Each component ``k`` is one assignment: the slots that hold ``k`` (as a label, or in every
``^`` axis they have) and no other component take part, and a ``^`` axis's index is
``iterator(k) + (the sizes of the parts before k in it)``. A component the result lacks is
*discardable*: nothing is written for it, and when nothing else fixes its size it is 0
(upstream's closing stage 5), so ``"a^b => a"`` alone is the whole operand; ``sizes=`` (or a
``capture``'s ``set_dim``, while the shapes are open) cuts it. The result's cells no component
writes (``"a => a^b"``) are 0. A concatenation copies: it never sums (use einsum for that).
Each operand's gradient gets its slice back through the same projections.

``block(rows, axis)`` stacks tensors of one shape along a new axis in front of a row; nested
lists stack several axes, the outer list's first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ocannl.ir.assignments import Accum, Affine, Fixed, Get, Index
from ocannl.ir.tnode import Tnode
from ocannl.tensor import inference
from ocannl.tensor.einsum import Dims, _Env, _spec_shapes
from ocannl.tensor.einsum_spec import (
    Concat,
    EinsumSpec,
    FixedIndex,
    Label,
    OperandSpec,
    RowSpec,
    parse,
)
from ocannl.tensor.inference import (
    ROW_NAMES,
    Constraint,
    DimEq,
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
from ocannl.tensor.leaves import Operand, _lift, _read, _result_prec, sym_of
from ocannl.tensor.tensor import Tensor, fill

__all__ = ["block", "concat"]


# --- concat -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One assignment: component ``comp`` copied from operand ``source`` into the result."""

    comp: str
    source: int


def concat(spec: str, *xs: Operand, sizes: Mapping[str, int] | None = None,
           capture: Dims | None = None) -> Tensor:
    """The tensor ``spec`` describes over ``xs`` (see the module docstring): upstream's
    ``(x1, x2) ++^ "a; b => a^b"``. ``sizes`` fixes labels' sizes (``{"a": 1, "c": 2}`` for
    ``"a^b^c => b"``); ``capture`` binds the spec's labels and row variables as einsum's does.
    Shape errors name the spec and the operands' shapes."""
    if not isinstance(spec, str):
        raise TypeError(f"concat spec must be a string, got {type(spec).__name__}: {spec!r}")
    parsed = parse(spec)
    ts = [_lift(x) for x in xs]
    if len(parsed.operands) != len(ts):
        raise ValueError(f"concat {spec!r} names {len(parsed.operands)} operand(s), got "
                         f"{len(ts)}")
    plan, discard = _plan(parsed)
    origin = Origin(f"concat {spec!r}", tuple(ts))
    env, slots, res = _spec_shapes(parsed, ts, origin)
    for name in discard:
        env.labels[name].discardable = True
    for name, size in (sizes or {}).items():
        if name not in env.labels:
            raise ValueError(f"concat {spec!r}: sizes names {name!r}, not a label of the spec "
                             f"(it has {sorted(env.labels)})")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"concat {spec!r}: the size of {name!r} must be an integer >= 0, "
                             f"got {size!r}")
        env.cons.append(DimEq(env.labels[name], size, origin))
    out = Tensor(Tnode("concat", None, _result_prec(ts)), res, kind="op",
                 children=tuple(t for t in ts if t.kind != "number"))
    concats = _concat_axes(parsed, env)
    with _naming(origin, spec):
        inference.add(env.cons, [out])
        if all(t.shape_known for t in ts):  # nothing outside the spec is open: close it now
            _check_fixed(env, concats, discard, origin)
            inference.close(out)
    if capture is not None:
        for name, v in [*env.labels.items(), *env.rows.items()]:
            capture._bind(name.lstrip(".") if name.startswith("...") else name, v, spec)
    out.defer(lambda: _build(out, ts, parsed, env, plan))
    return out


def _axes(spec: OperandSpec) -> list[object]:
    return [ax for rs in spec.rows for ax in rs.axes]


def _plan(parsed: EinsumSpec) -> tuple[list[_Part], list[str]]:
    """The assignments (one per component the result and one operand hold) and the
    discardable components (in no slot but inside ``^`` axes, and not in the result); refuses
    what is not a concatenation: no ``^``, axes other than labels and fixed indices, a
    component two operands give, a label or row variable the result lacks (a sum), an operand
    no component reads."""
    spec = parsed.text
    comps: list[str] = []
    for s in parsed.specs:
        for ax in _axes(s):
            if isinstance(ax, Concat):
                if len(set(ax.parts)) != len(ax.parts):
                    raise ValueError(f"concat {spec!r}: a component repeats in "
                                     f"{'^'.join(ax.parts)}")
                comps += [p for p in ax.parts if p not in comps]
            elif not isinstance(ax, (Label, FixedIndex)):
                raise ValueError(f"concat {spec!r}: a concatenation spec takes labels, fixed "
                                 f"indices and '^' axes only, not {ax} (use einsum)")
    if not comps:
        raise ValueError(f"concat {spec!r}: no '^' axis to concatenate along (use einsum)")

    def holds(s: OperandSpec, k: str) -> bool:
        """Whether slot ``s`` takes part in component ``k``'s assignment."""
        for ax in _axes(s):
            if isinstance(ax, Concat) and k not in ax.parts:
                return False
            if isinstance(ax, Label) and ax.name in comps and ax.name != k:
                return False
        return True

    def names(s: OperandSpec, k: str) -> set[str]:
        out = {repr(ax.name) for ax in _axes(s) if isinstance(ax, Label)}
        out |= {repr(k) for ax in _axes(s) if isinstance(ax, Concat)}
        return out | {f"the {rs.var[3:]} row's '...'" if rs.var.startswith("...")
                      else f"'..{rs.var}..'" for rs in s.rows if rs.var is not None}

    plan: list[_Part] = []
    for k in comps:
        if not holds(parsed.result, k):
            continue  # not written: discarded
        srcs = [i for i, s in enumerate(parsed.operands) if holds(s, k)]
        if len(srcs) > 1:
            raise ValueError(f"concat {spec!r}: component {k!r} is read from operands "
                             f"{', '.join(str(i + 1) for i in srcs)}: each comes from one")
        if not srcs:
            continue  # nothing read: those cells stay 0
        missing = names(parsed.operands[srcs[0]], k) - names(parsed.result, k)
        if missing:
            raise ValueError(f"concat {spec!r}: {', '.join(sorted(missing))} of operand "
                             f"{srcs[0] + 1} not in the result: a concatenation copies, it "
                             f"does not sum (use einsum)")
        plan.append(_Part(k, srcs[0]))
    unread = [i + 1 for i in range(len(parsed.operands)) if all(p.source != i for p in plan)]
    if unread:
        raise ValueError(f"concat {spec!r}: no component of the result is read from operand(s) "
                         f"{', '.join(map(str, unread))}")
    plain = {ax.name for s in parsed.specs for ax in _axes(s) if isinstance(ax, Label)}
    discard = [k for k in comps if k not in plain and not holds(parsed.result, k)]
    return plan, discard


def _concat_axes(parsed: EinsumSpec, env: _Env) -> list[tuple[DimVar, tuple[str, ...]]]:
    return [(env.axes[id(ax)], ax.parts) for s in parsed.specs for ax in _axes(s)
            if isinstance(ax, Concat)]


def _check_fixed(env: _Env, concats: list[tuple[DimVar, tuple[str, ...]]],
                 discard: list[str], origin: Origin) -> None:
    """With every operand's shape known, refuse a component that closing would guess: one
    the result holds whose size neither the operands, nor ``sizes``, nor its axis's total
    (less the other parts, a discardable one 0) fix."""
    known: dict[str, int | None] = {}
    for _, parts in concats:
        for p in parts:
            v = find(env.labels[p])
            known[p] = None if isinstance(v, DimVar) else int(v)
    for p in discard:
        if known[p] is None:
            known[p] = 0
    progress = True
    while progress:
        progress = False
        for d, parts in concats:
            total = find(d)
            missing = [p for p in parts if known[p] is None]
            if len(missing) == 1 and not isinstance(total, DimVar):
                known[missing[0]] = int(total) - sum(known[p] or 0 for p in parts)
                progress = True
    left = [p for p, v in known.items() if v is None]
    if left:
        names = ", ".join(repr(p) for p in left)
        raise ShapeError(f"{origin.describe()}: nothing fixes the size of component(s) {names} "
                         f"(give it: sizes={{{left[0]!r}: n}})")


@contextmanager
def _naming(origin: Origin, spec: str) -> Iterator[None]:
    """Re-raise a shape error that does not name the spec and the operands' shapes with them
    (einsum's rule for a ``^`` axis names the spec only)."""
    try:
        yield
    except ShapeError as err:
        msg = str(err)
        if msg.startswith(origin.what + " over"):
            raise
        inner = f"einsum {spec!r}: "  # the wording of einsum's rule for a '^' axis
        msg = msg[len(inner):] if msg.startswith(inner) else msg
        raise ShapeError(f"{origin.describe()}: {msg}") from None


def _build(out: Tensor, ts: list[Tensor], parsed: EinsumSpec, env: _Env,
           plan: list[_Part]) -> None:
    """One assignment per component, with every dim now known; the first resets the result
    (to 0 where no component writes); each operand's gradient reads its slice back."""
    fwd: list[Accum] = []
    bwd: list[Accum] = []
    for part in plan:
        sp = _Space()
        res_idx = _projection(parsed.result, env, part.comp, sp.iterator)
        src_idx = _projection(parsed.operands[part.source], env, part.comp, sp.iterator)
        space = tuple(sp.sizes)
        if 0 in space:
            continue
        t = ts[part.source]
        fwd.append(Accum(out.value, res_idx, "=", _read(t, src_idx), space, reset=not fwd))
        if out.grad is not None and t.grad is not None:
            bwd.append(Accum(t.grad, src_idx, "+", Get(out.grad, res_idx), space))
    out.forward_code = tuple(fwd) if fwd else (fill(out.value, 0.0),)
    out.backprop_code = tuple(bwd)


class _Space:
    """An assignment's product space: one iterator per label and per row variable's axis."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.its: dict[object, int] = {}

    def iterator(self, key: object, size: int) -> int:
        if key not in self.its:
            self.its[key] = len(self.sizes)
            self.sizes.append(size)
        return self.its[key]


def _projection(spec: OperandSpec, env: _Env, comp: str,
                iterator: Callable[[object, int], int]) -> tuple[Index, ...]:
    """A slot's index in component ``comp``'s assignment, laid out batch, output, input."""

    def size(name: str) -> int:
        return int(find(env.labels[name]))  # type: ignore[arg-type]

    def axis(ax: object) -> Index:
        if isinstance(ax, Label):
            return iterator(ax.name, size(ax.name))
        if isinstance(ax, FixedIndex):
            return Fixed(ax.index)
        assert isinstance(ax, Concat)
        i = iterator(comp, size(comp))
        offset = sum(size(p) for p in ax.parts[:ax.parts.index(comp)])
        return Affine(((1, i),), offset) if offset else i

    def row(rs: RowSpec) -> list[Index]:
        idx = [axis(ax) for ax in rs.beg]
        if rs.var is not None:
            var_axes = norm(Row((), env.rows[rs.var], ())).dims
            idx += [iterator((rs.var, j), int(d)) for j, d in enumerate(var_axes)]
        return idx + [axis(ax) for ax in rs.dims]

    rows = dict(zip(ROW_NAMES, (row(rs) for rs in spec.rows), strict=True))
    return tuple(rows["batch"] + rows["output"] + rows["input"])


# --- block --------------------------------------------------------------------------------------

AXIS_KINDS = ("batch", "output", "input")
Blocks = Sequence["Operand | Blocks"]


def block(rows: Blocks, axis: str | Sequence[str] = "output") -> Tensor:
    """Stack tensors of one shape along a new axis put in front of the ``axis`` row:
    upstream's block literals ``[x1; x2]`` (``"output"``), ``[|x1; x2|]`` (``"batch"``) and
    ``(x1, x2)`` (``"input"``). A list of lists stacks two axes (and so on), the outer list's
    first: ``axis`` names the row of every level, or gives one per level (``("batch",
    "output")`` is upstream's ``[| [a; b]; [c; d] |]``). Numbers stack as scalars. Shape
    errors name the block's operands and their shapes."""
    kinds_given = (axis,) if isinstance(axis, str) else tuple(axis)
    for k in kinds_given:
        if k not in AXIS_KINDS:
            raise ValueError(f"block: axis must be one of {AXIS_KINDS}, got {k!r}")
    leaves, counts = _flatten(rows)
    if isinstance(axis, str):
        kinds = (axis,) * len(counts)
    elif len(kinds_given) != len(counts):
        raise ValueError(f"block: {len(counts)} nesting level(s) of lists, {len(kinds_given)} "
                         f"axis kind(s) {kinds_given}: give one per level")
    else:
        kinds = kinds_given
    ts = [_lift(x) for _, x in leaves]
    what = f"block {'x'.join(map(str, counts))} along {'/'.join(kinds)}"
    origin = Origin(what, tuple(ts))
    vars_ = {r: RowVar(Owner("", r, False)) for r in ROW_NAMES}
    cons: list[Constraint] = [RowEq(sym_of(t).row(r), Row((), vars_[r], ()), origin)
                              for t in ts for r in ROW_NAMES]
    new = {r: tuple(n for n, k in zip(counts, kinds, strict=True) if k == r) for r in ROW_NAMES}
    res = SymShape(*(Row(new[r], vars_[r], ()) for r in ROW_NAMES))
    out = Tensor(Tnode("block", None, _result_prec(ts)), res, kind="op",
                 children=tuple(dict.fromkeys(t for t in ts if t.kind != "number")))
    inference.add(cons, [out])
    if all(t.shape_known for t in ts):
        inference.close(out)

    def build() -> None:
        fwd: list[Accum] = []
        bwd: list[Accum] = []
        for (pos, _), t in zip(leaves, ts, strict=True):
            shape = t.shape
            offs = shape.row_offsets()
            idx: list[Index] = []
            for r in ("batch", "output", "input"):
                idx += [Fixed(p) for p, k in zip(pos, kinds, strict=True) if k == r]
                idx += list(range(offs[r], offs[r] + len(shape.row(r))))
            src = tuple(range(len(shape.dims)))
            fwd.append(Accum(out.value, tuple(idx), "=", _read(t, src), shape.dims,
                             reset=not fwd))
            if out.grad is not None and t.grad is not None:
                bwd.append(Accum(t.grad, src, "+", Get(out.grad, tuple(idx)), shape.dims))
        out.forward_code = tuple(fwd)
        out.backprop_code = tuple(bwd)

    out.defer(build)
    return out


def _flatten(rows: Blocks) -> tuple[list[tuple[tuple[int, ...], Operand]], tuple[int, ...]]:
    """The leaves of nested lists with their positions, and the length of each level; refuses
    ragged nesting and empty lists."""
    if not isinstance(rows, (list, tuple)):
        raise TypeError(f"block takes a list of tensors (or of lists of them), got "
                        f"{type(rows).__name__}")
    if not rows:
        raise ValueError("block: an empty list has nothing to stack")
    nested = [isinstance(r, (list, tuple)) for r in rows]
    if any(nested) and not all(nested):
        raise ValueError("block: a level mixes lists and tensors: nest every item alike")
    if not nested[0]:
        return [((i,), x) for i, x in enumerate(rows)], (len(rows),)  # type: ignore[misc]
    subs = [_flatten(r) for r in rows]  # type: ignore[arg-type]
    inner = subs[0][1]
    if any(c != inner for _, c in subs):
        raise ValueError(f"block: ragged nesting: the inner lists have lengths "
                         f"{[c for _, c in subs]}")
    leaves = [((i, *pos), x) for i, (ls, _) in enumerate(subs) for pos, x in ls]
    return leaves, (len(rows), *inner)
