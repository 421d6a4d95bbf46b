"""Lowering: assignments become the loop structure every backend renders, decided once here.

- A :class:`LoopNest` splits the product space into *parallel* iterators (distinct points
  write distinct cells of the written buffer) and *reduction* iterators (the rest: points that
  differ only there write the same cell). Backends loop over the first and accumulate over the
  second in a local; the CUDA backend maps the first to threads.
- A :class:`LoopGroup` is consecutive pointwise nests that run inside one loop over the same
  parallel space with the same result as run one after another (one loop on the CPU, one kernel
  on CUDA). A nest with a reduction is always alone in its group.
- A :class:`Gemm` is an assignment shaped like a matrix product over plain iterators, handed to
  BLAS (CPU) or cuBLAS (GPU), when the backend has one (``lower(comp, gemm=...)``); a batched
  product (attention's scores) is one per batch point, when the backend takes those
  (``batched=...``).

Backends only render what this module decided; they never re-decide it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ocannl.ir.assignments import (
    Accum,
    Affine,
    Apply,
    Comp,
    Const,
    Get,
    Projection,
    reads,
)
from ocannl.ir.ops import ACCUMS
from ocannl.ir.tnode import Tnode

# Below this many multiply-adds a GEMM-shaped assignment stays a loop nest: the call into
# BLAS costs more than the arithmetic.
GEMM_MIN_FLOPS = 2048


@dataclass(frozen=True)
class Fill:
    """Set every cell of ``node`` to ``value``."""

    node: Tnode
    value: float


@dataclass(frozen=True)
class LoopNest:
    """Loops over ``par`` (outer, distinct cells, in the written node's axis order so the
    innermost store is contiguous) then ``red`` (inner, accumulated locally). ``scatter``: the
    written cell moves with reduction iterators too (an affine target index: a convolution's
    input gradient), so every point reads, combines and writes its cell in turn.
    ``walk_rows``: the last parallel iterator runs innermost, inside the reduction loops, over
    a row of accumulators (a bias gradient summing ``g[i, j]`` over ``i`` reads rows of ``g``,
    not columns); each cell still accumulates its terms in the same order, so the same bits."""

    assign: Accum
    par: tuple[int, ...]
    red: tuple[int, ...]
    scatter: bool = False
    walk_rows: bool = False

    @property
    def space(self) -> tuple[int, ...]:
        return self.assign.space

    @property
    def par_size(self) -> int:
        return math.prod(self.space[i] for i in self.par)

    @property
    def red_size(self) -> int:
        return math.prod(self.space[i] for i in self.red)


@dataclass(frozen=True)
class LoopGroup:
    """Nests run point by point inside one loop over the first one's parallel iterators."""

    nests: tuple[LoopNest, ...]

    @property
    def lead(self) -> LoopNest:
        return self.nests[0]


@dataclass(frozen=True)
class MatrixView:
    """A node read as a 2-D matrix ``rows x cols``; ``transposed``: stored as ``cols x rows``.
    ``ld``: the stride between consecutive stored rows (the stored row length when dense)."""

    node: Tnode
    rows: int
    cols: int
    transposed: bool
    ld: int


@dataclass(frozen=True)
class BatchAxis:
    """An iterator a batched product runs over: its size and its stride in the output and in
    each operand."""

    size: int
    out: int
    a: int
    b: int


@dataclass(frozen=True)
class Gemm:
    """``out (accum)= a @ b`` with ``out`` a ``rows x cols`` row-major view of ``assign.lhs``
    (rows ``out_ld`` apart), once per point of ``batch`` (none: one product)."""

    assign: Accum
    a: MatrixView
    b: MatrixView
    rows: int
    cols: int
    inner: int
    out_ld: int
    batch: tuple[BatchAxis, ...] = ()


Lowered = Fill | LoopGroup | Gemm


def _covers(a: Accum) -> bool:
    """True when the lhs projection visits every cell exactly once per reduction slice."""
    its = [i for i in a.lhs_idx if isinstance(i, int)]
    return (
        len(its) == len(a.lhs_idx)
        and len(set(its)) == len(its)
        and all(a.space[i] == d for i, d in zip(its, a.lhs.dims, strict=True))
    )


def _group_order(idx: Projection, group: set[int]) -> list[int] | None:
    """The iterators of ``group`` in the order they appear in ``idx`` if they form one
    contiguous run there (an empty group is an empty run), else None."""
    pos = [k for k, i in enumerate(idx) if i in group]
    if pos and pos != list(range(pos[0], pos[0] + len(pos))):
        return None
    return [idx[k] for k in pos]


def _as_gemm(a: Accum, batched: bool = False) -> Gemm | None:
    """Recognise ``lhs[B, M, N] += A[B, M, K] * B[B, K, N]`` up to transposition, axis grouping
    and, when ``batched``, batch axes ``B`` anywhere but last in each node (a product per
    batch point, its matrices' rows strided)."""
    e = a.expr
    if not (a.accum == "+" and isinstance(e, Apply) and e.op == "mul"):
        return None
    x, y = e.args
    if not (isinstance(x, Get) and isinstance(y, Get) and _covers(a)):
        return None
    for idx in (x.idx, y.idx):
        if not idx or not all(isinstance(i, int) for i in idx) or len(set(idx)) != len(idx):
            return None
    everything = set(range(len(a.space)))
    lhs, xs, ys = set(a.lhs_idx), set(x.idx), set(y.idx)
    bs = xs & ys & lhs
    m, n, k = lhs & xs - ys, lhs & ys - xs, xs & ys - lhs
    if (bs and not batched) or not k or m | n | k | bs != everything:
        return None
    size = math.prod
    rows, cols, inner = (size(a.space[i] for i in g) for g in (m, n, k))
    if rows * cols * inner < GEMM_MIN_FLOPS:
        return None
    # The output's last axis is a column of the product: swap operands when it is in M.
    last = a.lhs_idx[-1] if a.lhs_idx else None
    if last in bs:
        return None
    if last in m:
        m, n, x, y, rows, cols = n, m, y, x, cols, rows
    om, on = _group_order(a.lhs_idx, m), _group_order(a.lhs_idx, n)
    xm, xk = _group_order(x.idx, m), _group_order(x.idx, k)
    yk, yn = _group_order(y.idx, k), _group_order(y.idx, n)
    if None in (om, on, xm, xk, yk, yn) or xm != om or yn != on or xk != yk:
        return None

    def stride(node: Tnode, idx: Projection, it: int) -> int:
        return node.strides[idx.index(it)]

    def view(g: Get, row_run: list[int], col_run: list[int], r: int, c: int) -> MatrixView | None:
        """The operand as an ``r x c`` matrix: stored so, or transposed; None when its last
        axis is a batch axis (no unit stride)."""
        if col_run and g.idx[-1] == col_run[-1]:
            return MatrixView(g.node, r, c, False, stride(g.node, g.idx, row_run[-1])
                              if row_run else max(1, c))
        if row_run and g.idx[-1] == row_run[-1]:
            return MatrixView(g.node, r, c, True, stride(g.node, g.idx, col_run[-1])
                              if col_run else max(1, r))
        return None

    va, vb = view(x, xm, xk, rows, inner), view(y, yk, yn, inner, cols)
    if va is None or vb is None:
        return None
    out_ld = stride(a.lhs, a.lhs_idx, om[-1]) if om else max(1, cols)
    batch = tuple(BatchAxis(a.space[i], stride(a.lhs, a.lhs_idx, i), stride(x.node, x.idx, i),
                            stride(y.node, y.idx, i)) for i in a.lhs_idx if i in bs)
    return Gemm(a, va, vb, rows, cols, inner, out_ld, batch)


def parallel_iterators(a: Accum) -> tuple[int, ...]:
    """The iterators that pick distinct cells of ``a.lhs``, in its axis order: those indexing
    an lhs axis of more than one cell. An iterator that indexes only size-1 axes writes one cell
    from many points: it is a reduction, however the projection names it."""
    out: dict[int, None] = {}
    for i, d in zip(a.lhs_idx, a.lhs.dims, strict=True):
        if isinstance(i, int) and (d > 1 or a.space[i] == 1):
            out.setdefault(i)
    return tuple(out)


# A row of accumulators (``LoopNest.walk_rows``) holds at least and at most this many cells,
# and its reduction takes at least ROW_MIN terms.
ROW_MIN, ROW_MAX = 8, 4096


def _walks_rows(a: Accum, par: tuple[int, ...], red: tuple[int, ...], scatter: bool) -> bool:
    """Whether reading along the last parallel iterator beats reading along the reductions:
    some operand's last axis is that iterator and none's is a reduction iterator."""
    if scatter or not red or not par or a.accum not in ("+", "max"):
        return False
    last = par[-1]
    if not ROW_MIN <= a.space[last] <= ROW_MAX or math.prod(a.space[i] for i in red) < ROW_MIN:
        return False  # a short reduction (a 2x2 pooling window) gains less than the row costs
    ends = [g.idx[-1] for g in reads(a.expr) if g.idx]
    return last in ends and not any(isinstance(i, int) and i in red for i in ends)


def loop_nest(a: Accum) -> LoopNest:
    par = parallel_iterators(a)
    red = tuple(i for i in range(len(a.space)) if i not in par)
    scatter = any(isinstance(i, Affine) for i in a.lhs_idx)
    return LoopNest(a, par, red, scatter, _walks_rows(a, par, red, scatter))


def lower_assignment(a: Accum, *, gemm: bool = True, batched: bool = False
                     ) -> list[Fill | LoopNest | Gemm]:
    as_gemm = _as_gemm(a, batched) if gemm else None
    if as_gemm is not None:
        return [as_gemm]
    out: list[Fill | LoopNest | Gemm] = []
    if a.reset and not _covers(a):
        out.append(Fill(a.lhs, _neutral(a.accum)))
        a = Accum(a.lhs, a.lhs_idx, a.accum, a.expr, a.space, reset=False)
    out.append(loop_nest(a))
    return out


def _neutral(accum: str) -> float:
    v = ACCUMS[accum]
    return 0.0 if v is None else v


def _is_fill(a: Accum) -> bool:
    return a.accum == "=" and isinstance(a.expr, Const) and _covers(a) and \
        len(a.space) == len(a.lhs_idx)


def _touches(a: Accum, node: Tnode) -> bool:
    return a.lhs is node or any(g.node is node for g in reads(a.expr))


def fuse_resets(assignments: tuple[Accum, ...]) -> list[Accum]:
    """Drop a zero fill whose next use is a covering ``+=`` into the node: that accumulation
    resets instead (``=+``), so gradients are written once rather than zeroed then added.
    A fill whose node is next overwritten whole is dropped too."""
    out: list[Accum | None] = list(assignments)
    for k, a in enumerate(out):
        if a is None or not _is_fill(a):
            continue
        nxt = next((j for j in range(k + 1, len(out)) if out[j] is not None
                    and _touches(out[j], a.lhs)), None)
        if nxt is None:
            continue
        b = out[nxt]
        if b.lhs is not a.lhs or not _covers(b) or any(g.node is a.lhs for g in reads(b.expr)):
            continue
        if b.accum == "=" and len(b.space) == len(b.lhs_idx):  # overwritten whole: dead fill
            out[k] = None
        elif b.accum == "+" and not b.reset and a.expr.value == 0.0:
            out[nxt] = Accum(b.lhs, b.lhs_idx, b.accum, b.expr, b.space, reset=True)
            out[k] = None
    return [a for a in out if a is not None]


# A loop group holds at most this many nests: past it, LLVM's and NVRTC's per-loop analyses
# (memory dependences between every pair of accesses) grow faster than the group, and a new
# loop costs one more pass over the cells.
MAX_GROUP = 32


class _Group:
    """The loop group being built, with what :meth:`admits` needs kept up to date: the
    projection each buffer is written at, and every buffer read."""

    def __init__(self, lead: LoopNest) -> None:
        self.nests = [lead]
        self.written = {lead.assign.lhs.id: lead.assign.lhs_idx}
        self.read = {g.node.id for g in reads(lead.assign.expr)}

    def admits(self, nxt: LoopNest) -> bool:
        """Whether ``nxt`` can run inside the group's loop, point by point, with the same
        result: every nest is pointwise (no reduction) over the same space and parallel
        order, every buffer the group writes is read by ``nxt`` only at the point being
        written, and ``nxt`` writes no buffer the group reads or writes."""
        lead, b = self.nests[0], nxt.assign
        if len(self.nests) >= MAX_GROUP:
            return False
        if lead.red or nxt.red or b.space != lead.space or nxt.par != lead.par:
            return False
        if not all(isinstance(i, int) for i in b.lhs_idx):
            return False
        if b.lhs.id in self.written or b.lhs.id in self.read:
            return False
        return all(g.idx == self.written.get(g.node.id, g.idx) for g in reads(b.expr))

    def add(self, nest: LoopNest) -> None:
        self.nests.append(nest)
        self.written[nest.assign.lhs.id] = nest.assign.lhs_idx
        self.read.update(g.node.id for g in reads(nest.assign.expr))


# How many lowered items back a pointwise nest may move to join a loop group it fits (past
# items it does not depend on, and that do not depend on it).
HOIST_WINDOW = 96


def _touched(item: Fill | Gemm | _Group) -> tuple[set[int], set[int]]:
    """The ids of the nodes an item reads and writes."""
    if isinstance(item, Fill):
        return set(), {item.node.id}
    if isinstance(item, Gemm):
        return {item.a.node.id, item.b.node.id}, {item.assign.lhs.id}
    return item.read, set(item.written)


def lower(comp: Comp, *, gemm: bool = True, batched: bool = False) -> list[Lowered]:
    """Lower a computation to what backends render, in order: fills, GEMMs (when the backend
    has a GEMM: ``gemm``; batched products too when it takes those: ``batched``) and loop
    groups.

    A pointwise nest joins the latest loop group it fits, up to ``HOIST_WINDOW`` items back,
    when it moves past nothing it depends on or that depends on it: an optimizer's per-weight
    update, written after every weight's gradient, then runs in one pass with the gradient's
    last pointwise step (the same values, in one pass over the cells instead of several)."""
    out: list[Fill | Gemm | _Group] = []
    for a in fuse_resets(comp.assignments):
        items = [Fill(a.lhs, a.expr.value)] if _is_fill(a) else lower_assignment(
            a, gemm=gemm, batched=batched)
        for item in items:
            if not isinstance(item, LoopNest):
                out.append(item)
                continue
            reads_ = {g.node.id for g in reads(item.assign.expr)}
            writes = item.assign.lhs.id
            for k in range(len(out) - 1, max(-1, len(out) - 1 - HOIST_WINDOW), -1):
                other = out[k]
                if isinstance(other, _Group) and other.admits(item):
                    other.add(item)
                    break
                r, w = _touched(other)
                if writes in r or writes in w or reads_ & w:
                    out.append(_Group(item))
                    break
            else:
                out.append(_Group(item))
    return [LoopGroup(tuple(i.nests)) if isinstance(i, _Group) else i for i in out]


def nests(code: list[Lowered]) -> list[LoopNest]:
    """Every loop nest of lowered code, in order."""
    return [n for item in code if isinstance(item, LoopGroup) for n in item.nests]


def _assigns(code: list[Lowered]) -> list[Fill | Accum]:
    out: list[Fill | Accum] = []
    for it in code:
        if isinstance(it, LoopGroup):
            out.extend(n.assign for n in it.nests)
        else:
            out.append(it if isinstance(it, Fill) else it.assign)
    return out


def nodes_of(code: list[Lowered]) -> list[Tnode]:
    """Every node the lowered code touches, in first-use order (each written node before
    what its assignment reads)."""
    seen: dict[int, Tnode] = {}
    for a in _assigns(code):
        if isinstance(a, Fill):
            seen.setdefault(a.node.id, a.node)
        else:
            seen.setdefault(a.lhs.id, a.lhs)
            for g in reads(a.expr):
                seen.setdefault(g.node.id, g.node)
    return list(seen.values())


@dataclass(frozen=True)
class Effects:
    """What running lowered code needs and leaves: ``inputs``, the nodes it reads before
    writing them whole (their values must come from somewhere), and ``written``, every node it
    writes."""

    inputs: tuple[Tnode, ...]
    written: tuple[Tnode, ...]


def effects(code: list[Lowered]) -> Effects:
    """The :class:`Effects` of lowered code, in first-use order."""
    whole: set[int] = set()
    inputs: dict[int, Tnode] = {}
    written: dict[int, Tnode] = {}

    def read(n: Tnode) -> None:
        if n.id not in whole:
            inputs.setdefault(n.id, n)

    for a in _assigns(code):
        if isinstance(a, Fill):
            whole.add(a.node.id)
            written.setdefault(a.node.id, a.node)
            continue
        for g in reads(a.expr):
            read(g.node)
        overwrites = a.accum == "=" or a.reset
        if not overwrites:
            read(a.lhs)
        if overwrites and _covers(a):
            whole.add(a.lhs.id)
        written.setdefault(a.lhs.id, a.lhs)
    return Effects(tuple(inputs.values()), tuple(written.values()))
