"""The renderer core: what every renderer of a loop nest computes, written once.

Both renderers (LLVM IR on the CPU, ``ocannl.backends.cpu.codegen``; CUDA C,
``ocannl.backends.cuda.plan``) turn a :class:`~ocannl.ir.lowered.LoopNest` into the same
arithmetic: a cell's flat offset from its projection, the conditions of a padded read, a
read rounded to a virtual node's precision, an expression over the op table, an
accumulation, and the nest's cases (a point that overwrites or combines its cell, a scatter
guarded at the target's edges, a reduction into a local stored once). This module says all of
that in terms of a :class:`Spelling`, a renderer's words for integers, values, reads, stores
and loops; a renderer keeps only its spelling (an LLVM builder's calls, C text) and the
shapes only it has (the CPU's jammed reductions and row walks, a GPU's block reductions).
As OCANNL's one C-syntax functor serves its C, CUDA and Metal backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ocannl.ir.assignments import Affine, Const, Dynamic, Expr, Fixed, Get, Projection
from ocannl.ir.expr import Apply
from ocannl.ir.lowered import LoopNest
from ocannl.ir.ops import ACCUMS, Precision
from ocannl.ir.tnode import Tnode

V = Any  # a renderer's value: an LLVM value, a C expression's text
Iters = dict[int, V]


class Spelling(Protocol):
    """A renderer's words. Integers (offsets): :meth:`index`, :meth:`index_add`,
    :meth:`index_scale`, :meth:`dynamic`; conditions: :meth:`at_least_zero`, :meth:`below`,
    :meth:`both`; values in a compute precision: :meth:`literal`, :meth:`read`, :meth:`held`,
    :meth:`rounded`, :meth:`pad`, :meth:`guard_offset`, :meth:`op`, :meth:`any_order_add`;
    statements: :meth:`store`, :meth:`accumulator`, :meth:`get`, :meth:`set`, :meth:`over`
    (the nest's reduction loops around a body), :meth:`when`. ``cell``: the point's flat
    cell, where every access is at it (a ``flat`` group), else None."""

    cell: V | None

    def index(self, n: int) -> V: ...
    def index_add(self, a: V, b: V) -> V: ...
    def index_scale(self, a: V, c: int) -> V: ...
    def dynamic(self, node: Tnode) -> V: ...
    def at_least_zero(self, a: V) -> V: ...
    def below(self, a: V, n: int) -> V: ...
    def both(self, a: V, b: V) -> V: ...
    def literal(self, value: float, compute: Precision) -> V: ...
    def held(self, node: Tnode) -> V | None: ...
    def read(self, node: Tnode, off: V, compute: Precision) -> V: ...
    def rounded(self, value: V, source: Tnode, prec: Precision) -> V: ...
    def pad(self, cond: V, value: V, compute: Precision) -> V: ...
    def guard_offset(self, cond: V, off: V) -> V: ...
    def op(self, name: str, compute: Precision, args: list[V]) -> V: ...
    def any_order_add(self, acc: V, value: V, compute: Precision) -> V: ...
    def store(self, node: Tnode, off: V, value: V, exact: bool) -> None: ...
    def accumulator(self, value: V, compute: Precision) -> V: ...
    def get(self, local: V) -> V: ...
    def set(self, local: V, value: V) -> None: ...
    def over(self, nest: LoopNest, iters: Iters, body: Callable[[], None]) -> None: ...
    def when(self, cond: V, body: Callable[[], None]) -> None: ...


# --- index arithmetic -------------------------------------------------------------------------


def affine(sp: Spelling, a: Affine, iters: Iters) -> V:
    """``a.offset + sum(c * i)`` over the iterators' values."""
    total = sp.index(a.offset)
    for c, i in a.terms:
        if c:
            total = sp.index_add(total, sp.index_scale(iters[i], c))
    return total


def offset(sp: Spelling, node: Tnode, idx: Projection, iters: Iters) -> V:
    """The flat row-major offset of ``node[idx]`` (in a ``flat`` group: the point's cell). A
    dynamic index reads its node when the code runs; an axis of one cell adds nothing (in
    bounds, its position is 0)."""
    if sp.cell is not None:
        return sp.cell
    terms: list[V] = []
    const = 0
    for i, stride, dim in zip(idx, node.strides, node.dims, strict=True):
        if isinstance(i, Dynamic):
            terms.append(sp.index_scale(sp.dynamic(i.node), stride))
        elif isinstance(i, Fixed):
            const += i.pos * stride
        elif dim > 1:
            at = affine(sp, i, iters) if isinstance(i, Affine) else iters[i]
            terms.append(sp.index_scale(at, stride))
    if const or not terms:
        terms.append(sp.index(const))
    total = terms[0]
    for t in terms[1:]:
        total = sp.index_add(total, t)
    return total


def in_bounds(sp: Spelling, node: Tnode, idx: Projection, space: tuple[int, ...],
              iters: Iters) -> V | None:
    """Whether every affine index of ``node[idx]`` is inside its axis; None where that holds
    over the whole product space (no padding there)."""
    cond = None
    for i, dim in zip(idx, node.dims, strict=True):
        if not isinstance(i, Affine):
            continue
        below, past = i.outside(space, dim)
        at = affine(sp, i, iters)
        for c in ([sp.at_least_zero(at)] if below else []) + ([sp.below(at, dim)]
                                                              if past else []):
            cond = c if cond is None else sp.both(cond, c)
    return cond


# --- values -----------------------------------------------------------------------------------


def load(sp: Spelling, node: Tnode, idx: Projection, space: tuple[int, ...], iters: Iters,
         compute: Precision, rounded: Precision | None = None) -> V:
    """``node[idx]`` in ``compute`` (``rounded``: first rounded to that precision as a store
    would, ``Get.rounded``), or 0 where an affine index falls outside the node (padding); a
    node handed over in a register is its value."""
    held = sp.held(node)
    if held is not None:
        return held
    off = offset(sp, node, idx, iters)
    cond = in_bounds(sp, node, idx, space, iters)
    if cond is not None:
        off = sp.guard_offset(cond, off)
    value = sp.read(node, off, compute)
    if rounded is not None:
        value = sp.rounded(value, node, rounded)
    if cond is not None:
        value = sp.pad(cond, value, compute)
    return value


def expr(sp: Spelling, e: Expr, compute: Precision, space: tuple[int, ...], iters: Iters) -> V:
    """``e``'s value at the point ``iters``, in ``compute``."""
    if isinstance(e, Const):
        return sp.literal(e.value, compute)
    if isinstance(e, Get):
        return load(sp, e.node, e.idx, space, iters, compute, e.rounded)
    assert isinstance(e, Apply)
    return sp.op(e.op, compute, [expr(sp, a, compute, space, iters) for a in e.args])


def combine(sp: Spelling, accum: str, old: V, new: V, compute: Precision) -> V:
    """``old (accum) new``: an accumulation is an application of the op table's row."""
    return sp.op("add" if accum == "+" else accum, compute, [old, new])


def neutral(accum: str) -> float:
    v = ACCUMS[accum]
    return 0.0 if v is None else v


# --- a nest's cases ---------------------------------------------------------------------------


def nest(sp: Spelling, n: LoopNest, iters: Iters) -> None:
    """``lhs (accum)= expr`` at the point of its parallel iterators ``iters``: a point that
    overwrites or combines its cell; a scatter, whose cell moves with the reduction
    iterators, combining into it at every point; every point overwriting its cell (``=``
    over reduction iterators: the last stays); a reduction into a local, stored once."""
    a = n.assign
    if not n.red:
        point(sp, n, iters)
    elif n.scatter:
        sp.over(n, iters, lambda: scatter(sp, n, iters))
    elif a.accum == "=":
        sp.over(n, iters, lambda: point(sp, n, iters))
    else:
        reduction(sp, n, iters)


def point(sp: Spelling, n: LoopNest, iters: Iters) -> None:
    """Compute, combine with the cell unless the nest overwrites it, store (exactly where
    scheduling said so: ``LoopNest.exact_store``)."""
    a = n.assign
    compute = a.lhs.prec.compute
    value = expr(sp, a.expr, compute, a.space, iters)
    off = offset(sp, a.lhs, a.lhs_idx, iters)
    if not (a.accum == "=" or a.reset):
        old = load(sp, a.lhs, a.lhs_idx, a.space, iters, compute)
        value = combine(sp, a.accum, old, value, compute)
    sp.store(a.lhs, off, value, n.exact_store)


def scatter(sp: Spelling, n: LoopNest, iters: Iters) -> None:
    """An affine target: read, combine and write the (moving) cell; skip cells outside."""
    a = n.assign
    compute = a.lhs.prec.compute
    value = expr(sp, a.expr, compute, a.space, iters)

    def write() -> None:
        new = value
        if a.accum != "=":
            old = load(sp, a.lhs, a.lhs_idx, a.space, iters, compute)
            new = combine(sp, a.accum, old, value, compute)
        sp.store(a.lhs, offset(sp, a.lhs, a.lhs_idx, iters), new, False)

    cond = in_bounds(sp, a.lhs, a.lhs_idx, a.space, iters)
    if cond is None:
        write()
    else:
        sp.when(cond, write)


def reduction(sp: Spelling, n: LoopNest, iters: Iters) -> None:
    """The terms into a local from the neutral element, in the loops' order (in any order
    where scheduling allowed it: ``LoopNest.any_order``), then combined with the cell unless
    the nest resets it, stored once."""
    a = n.assign
    compute = a.lhs.prec.compute
    acc = sp.accumulator(sp.literal(neutral(a.accum), compute), compute)

    def term() -> None:
        value = expr(sp, a.expr, compute, a.space, iters)
        if n.any_order:
            sp.set(acc, sp.any_order_add(sp.get(acc), value, compute))
        else:
            sp.set(acc, combine(sp, a.accum, sp.get(acc), value, compute))

    sp.over(n, iters, term)
    result = sp.get(acc)
    if not a.reset:
        old = load(sp, a.lhs, a.lhs_idx, a.space, iters, compute)
        result = combine(sp, a.accum, old, result, compute)
    sp.store(a.lhs, offset(sp, a.lhs, a.lhs_idx, iters), result, False)
