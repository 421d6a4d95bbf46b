"""Lowering: each assignment becomes a loop nest (or a GEMM) that every backend can render.

A :class:`LoopNest` splits the product space into *parallel* iterators (those the written
buffer is indexed by: distinct points write distinct cells) and *reduction* iterators (the
rest). Backends loop over the first and accumulate over the second in a local variable; the
CUDA backend maps the first to threads. A :class:`Gemm` is an assignment shaped like a matrix
product over plain iterators, handed to BLAS (CPU) or cuBLAS (GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ocannl.ir.assignments import Accum, Apply, Comp, Const, Fixed, Get, Projection, reads
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
    """Loops over ``par`` (outer, distinct cells) then ``red`` (inner, accumulated locally)."""

    assign: Accum
    par: tuple[int, ...]
    red: tuple[int, ...]

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
class MatrixView:
    """A node read as a 2-D matrix ``rows x cols``; ``transposed``: stored as ``cols x rows``."""

    node: Tnode
    rows: int
    cols: int
    transposed: bool


@dataclass(frozen=True)
class Gemm:
    """``out (accum)= a @ b`` with ``out`` a ``rows x cols`` row-major view of ``assign.lhs``."""

    assign: Accum
    a: MatrixView
    b: MatrixView
    rows: int
    cols: int
    inner: int


Lowered = Fill | LoopNest | Gemm


def _covers(a: Accum) -> bool:
    """True when the lhs projection visits every cell exactly once per reduction slice."""
    its = [i for i in a.lhs_idx if not isinstance(i, Fixed)]
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


def _as_gemm(a: Accum) -> Gemm | None:
    """Recognise ``lhs[M, N] += A[M, K] * B[K, N]`` up to transposition and axis grouping."""
    e = a.expr
    if not (a.accum == "+" and isinstance(e, Apply) and e.op == "mul"):
        return None
    x, y = e.args
    if not (isinstance(x, Get) and isinstance(y, Get) and _covers(a)):
        return None
    for idx in (x.idx, y.idx):
        if any(isinstance(i, Fixed) for i in idx) or len(set(idx)) != len(idx):
            return None
    lhs, xs, ys = set(a.lhs_idx), set(x.idx), set(y.idx)
    if xs | ys != set(range(len(a.space))) or not lhs <= xs | ys:
        return None
    m, n, k = lhs & xs - ys, lhs & ys - xs, xs & ys - lhs
    if (xs & ys & lhs) or not k:  # batched products and outer products stay loops
        return None
    if m | n | k != set(range(len(a.space))):
        return None
    size = math.prod
    if size(a.space) < GEMM_MIN_FLOPS:
        return None
    # The lhs must be [M-run][N-run] or [N-run][M-run]; swap operands for the latter.
    pos = {it: k for k, it in enumerate(a.lhs_idx)}
    if m and n and min(pos[i] for i in n) < min(pos[i] for i in m):
        m, n, x, y = n, m, y, x
    om, on = _group_order(a.lhs_idx, m), _group_order(a.lhs_idx, n)
    if om is None or on is None or list(a.lhs_idx) != om + on:
        return None
    xm, xk = _group_order(x.idx, m), _group_order(x.idx, k)
    yk, yn = _group_order(y.idx, k), _group_order(y.idx, n)
    if None in (xm, xk, yk, yn) or xm != om or yn != on or xk != yk:
        return None
    rows = size(a.space[i] for i in m)
    cols = size(a.space[i] for i in n)
    inner = size(a.space[i] for i in k)
    x_t = bool(m) and bool(k) and x.idx.index(xk[0]) < x.idx.index(xm[0])
    y_t = bool(k) and bool(n) and y.idx.index(yn[0]) < y.idx.index(yk[0])
    return Gemm(a, MatrixView(x.node, rows, inner, x_t), MatrixView(y.node, inner, cols, y_t),
                rows, cols, inner)


def lower_assignment(a: Accum, *, allow_gemm: bool = True) -> list[Lowered]:
    gemm = _as_gemm(a) if allow_gemm else None
    if gemm is not None:
        return [gemm]
    out: list[Lowered] = []
    if a.reset and not _covers(a):
        out.append(Fill(a.lhs, _neutral(a.accum)))
        a = Accum(a.lhs, a.lhs_idx, a.accum, a.expr, a.space, reset=False)
    in_lhs = {i for i in a.lhs_idx if not isinstance(i, Fixed)}
    par = tuple(i for i in range(len(a.space)) if i in in_lhs)
    red = tuple(i for i in range(len(a.space)) if i not in in_lhs)
    out.append(LoopNest(a, par, red))
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


def lower(comp: Comp, *, allow_gemm: bool = True) -> list[Lowered]:
    """Lower a computation to the loop nests backends render, in order."""
    out: list[Lowered] = []
    for a in fuse_resets(comp.assignments):
        if _is_fill(a):
            out.append(Fill(a.lhs, a.expr.value))
        else:
            out.extend(lower_assignment(a, allow_gemm=allow_gemm))
    return out


def nodes_of(items: list[Lowered]) -> list[Tnode]:
    """Every node the lowered code touches, in first-use order."""
    seen: dict[int, Tnode] = {}
    for it in items:
        if isinstance(it, Fill):
            seen.setdefault(it.node.id, it.node)
        else:
            seen.setdefault(it.assign.lhs.id, it.assign.lhs)
            for g in reads(it.assign.expr):
                seen.setdefault(g.node.id, g.node)
    return list(seen.values())
