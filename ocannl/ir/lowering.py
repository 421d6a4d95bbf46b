"""Lowering: assignments become the items every backend renders, decided once here.

- A :class:`LoopNest` splits the product space into *parallel* iterators (distinct points
  write distinct cells of the written buffer) and *reduction* iterators (the rest: points that
  differ only there write the same cell). Backends loop over the first and accumulate over the
  second in a local; the CUDA backend maps the first to threads.
- A :class:`LoopGroup` is consecutive pointwise nests that run inside one loop over the same
  parallel space with the same result as run one after another (one loop on the CPU, one kernel
  on CUDA). A nest with a reduction is always alone in its group.
- A :class:`Gemm` is an assignment shaped like a matrix product over plain iterators, handed to
  the backend's library (``Target.gemm``: BLAS, cuBLAS); a batched product (attention's
  scores) is one per batch point, when the backend takes those (``Target.batched_gemm``).
- *im2col* (``Target.im2col``, for backends whose products beat their loop nests on a
  convolution): a product with one operand read through a window (an affine projection) is
  copied patch by patch into a node of its own, then multiplied as a GEMM; a product scattered
  into a window (a convolution's input gradient) is a GEMM into a patch gradient added back
  into its target by a nest (col2im). See :func:`im2col_items`.
- A scatter (an affine target index, whose cell moves with reduction iterators) is lowered as
  gathers where the target record takes them: a reduction per target cell over the points
  landing on it, parallel on every backend. See :func:`gather_parts`.

:func:`lower` does this, then hands the items to :func:`ocannl.ir.schedule.schedule`, which
makes the target's choices (placements, product kernels, widened copies, threads, vectors,
conversions and stores, launches). The items and their fields are in
:mod:`ocannl.ir.lowered`. Backends only render what was decided here; they never re-decide it.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Set as AbstractSet
from dataclasses import replace

from ocannl.ir.assignments import (
    Accum,
    Affine,
    Apply,
    Comp,
    Const,
    Expr,
    Fixed,
    Get,
    Index,
    Projection,
    apply,
    reads,
)
from ocannl.ir.expr import rewrite_reads
from ocannl.ir.lowered import (
    MAX_GROUP,
    Access,
    AccessIndex,
    BatchAxis,
    Effects,
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    Lowered,
    MatrixView,
    access,
    batch_offsets,
    copy_source,
    covers,
    effects,
    loop_nest,
    nests,
    nodes_of,
    parallel_iterators,
    stored_in,
    stored_nodes,
)
from ocannl.ir.ops import ACCUMS, Precision
from ocannl.ir.schedule import copy_run, native_operands, product_kernel, schedule
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode, Tnode

__all__ = [
    "Access", "AccessIndex", "BatchAxis", "Effects", "Fill", "Gemm", "LoopGroup", "LoopNest",
    "Lowered", "MatrixView", "access", "batch_offsets", "copy_source", "covers", "effects",
    "gather_nest", "gather_of", "gather_parts", "im2col_items", "lower", "lower_items",
    "loop_nest", "nests", "nodes_of", "parallel_iterators", "scatter_as_gather", "stored_in",
    "stored_nodes",
]

# Below this many multiply-adds a GEMM-shaped assignment stays a loop nest: the call into
# BLAS costs more than the arithmetic.
GEMM_MIN_FLOPS = 2048


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
    if not (isinstance(x, Get) and isinstance(y, Get) and covers(a)):
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


def lower_assignment(a: Accum, target: Target) -> list[Fill | LoopNest | Gemm]:
    as_gemm = _as_gemm(a, target.batched_gemm) if target.gemm else None
    if as_gemm is not None:
        return [as_gemm]
    if target.gemm and target.im2col:
        rewritten = im2col_items(a, target)
        if rewritten is not None:
            return rewritten
    gathers = scatter_as_gather(a, target)
    if gathers is not None:
        _GATHERS.update(g for g, _ in gathers)
        return [gather_nest(*g) for g in gathers]
    out: list[Fill | LoopNest | Gemm] = []
    if a.reset and not covers(a):
        out.append(Fill(a.lhs, _neutral(a.accum)))
        a = Accum(a.lhs, a.lhs_idx, a.accum, a.expr, a.space, reset=False)
    out.append(loop_nest(a))
    return out


# --- scatters as gathers -------------------------------------------------------------------------

# A scatter (``lhs[affine] += expr``: a convolution's input gradient without im2col, a pool's)
# runs point by point, each point reading, adding and writing its moving cell: serial within a
# GPU thread (a kernel of few threads each doing thousands of dependent global updates), shared
# over CPU threads by its first axis only. Its gathers (:func:`gather_parts`; a strided
# window's target cut into phases) are reductions per cell. A GPU (``Target.gpu_block``) takes
# them wherever they take at most ``GPU_GATHER_MAX_WASTE`` times the scatter's
# points (not measured on a GPU: an estimate; a point outside costs a guarded read, no memory
# access).
# A CPU takes it only where each cell sums at least ``CPU_GATHER_MIN_TERMS`` terms (and within
# ``CPU_GATHER_MAX_WASTE``): ``benchmarks/ab_gather.py`` (f32, 64 images, p50 of the rounds'
# ratios, 12 then 20 rounds x 40 calls, interleaved, on a shared 2-core AMD EPYC: noisy),
# gather / scatter time, 1 thread and 2: convnet's second convolution's input gradient (144
# terms a cell) 0.19-0.21 and 0.18-0.21; a convolution's with 72 terms 0.81-0.97 and 0.80-0.81,
# with 36 0.95 and 0.87-0.88 (a stride-2 one, 36 on average in 4 phases: 0.88 and 0.73), with
# 18 (a small one) 1.32-1.33 and 1.24-1.25; a 3x3 stride-1 pool's (9 terms) 4.6-5.1 and
# 3.0-3.5. A short sum gains nothing from its local accumulator and pays its padding guards at
# every term. (benchmarks/OBSTACLES.md: "Scatters as gathers".) A gather of one term a cell
# and no point outside (a pool whose windows tile its input: 2x2, stride 2) is a pointwise pass
# over its target instead of a fill and a scatter: the CPU takes it whatever its terms.
GPU_GATHER_MAX_WASTE = 2
CPU_GATHER_MAX_WASTE = 2
CPU_GATHER_MIN_TERMS = 32
_GATHERS: weakref.WeakSet[Accum] = weakref.WeakSet()  # the gathers made of scatters


def scatter_as_gather(a: Accum, target: Target) -> list[tuple[Accum, tuple[int, ...]]] | None:
    """``a``'s gathers (:func:`gather_parts`) where ``target`` takes them (a GPU within
    ``GPU_GATHER_MAX_WASTE``, a CPU within ``CPU_GATHER_MAX_WASTE`` and summing at least
    ``CPU_GATHER_MIN_TERMS`` terms a cell), else None (not a scatter, not invertible, too
    wasteful, too short)."""
    if not any(isinstance(i, Affine) for i in a.lhs_idx):
        return None
    if target.gpu_block:
        return gather_parts(a, GPU_GATHER_MAX_WASTE)
    if CPU_GATHER_MAX_WASTE <= 0:
        return None
    parts = gather_parts(a, CPU_GATHER_MAX_WASTE)
    if parts is None:
        return None
    cells = sum(math.prod(g.space[i] for i in par) for g, par in parts)
    terms = sum(math.prod(g.space) for g, _ in parts)
    if terms == cells == math.prod(a.space):  # a term a cell, each a point of the scatter:
        return parts  # a pass over the cells (a 2x2 pool's), not a fill and a scatter
    if terms < CPU_GATHER_MIN_TERMS * cells:
        return None
    return parts


# --- im2col -------------------------------------------------------------------------------------

# When a windowed product is worth its patches (measured on the CPU backend, f32, one BLAS
# thread, batches of 2 to 64 images of 4 to 16 pixels a side: see ``_worth_it``). Its direct
# loop nest sums each output's terms in order, fast only for a reduction short enough that LLVM
# unrolls it whole: a 3x3 window over 1 or 2 channels (9 or 18 terms) runs 1.0-1.5x faster
# direct; 25 terms and more run 2-20x faster through patches. The patches cost a pass of about
# a nanosecond per cell, repaid only when the GEMM uses each cell several times: a convolution
# to 2 output channels (each cell used twice) runs 0.4-1.2x as fast through patches, to 3
# channels 1.5x, to 4 or more 1.7x and up.
IM2COL_MIN_INNER = 20
IM2COL_MIN_REUSE = 3
# The input gradient's col2im gathers (each cell of the target sums the patch cells that land
# on it, reading outside the patches as 0: a reduction, run over threads like any other) when
# that reads at most this many times the patch gradient's cells, else scatters them.
GATHER_MAX_WASTE = 2

# Patch nodes by the node they copy and how (a normalized projection, dims, precision): lowering
# the same computation again (another routine, a profile of its items) finds the same node,
# which a context then holds one buffer for.
_PATCHES: weakref.WeakKeyDictionary[Tnode, dict[tuple, Tnode]] = weakref.WeakKeyDictionary()
# The id of the node each patch node copies: a gather already done is not done again.
_PATCH_SOURCE: weakref.WeakKeyDictionary[Tnode, int] = weakref.WeakKeyDictionary()


def _patch_node(src: Tnode, role: str, key: tuple, dims: tuple[int, ...], prec: Precision
                ) -> Tnode:
    table = _PATCHES.setdefault(src, {})
    key = (role, key, dims, prec)
    node = table.get(key)
    if node is None:
        # named ..._{role}_{id}; local: written by each routine's own gather before use
        node = table[key] = Tnode(f"{src.name}_{role}", dims, prec, memory_mode=MemoryMode.local)
    return node


def _window_order(idx: Projection) -> list[int] | None:
    """The iterators of a windowed projection in the order its patches lay them out: plain
    iterators before the first affine index, then each affine index's first iterator (the
    output position), then their other iterators (the window offsets), then the remaining
    plain iterators: ``x[b, s*oh + kh - p, s*ow + kw - p, c]`` gives ``(b, oh, ow, kh, kw, c)``.
    None when the projection has a fixed index, a zero coefficient, or an iterator twice."""
    first = next((k for k, i in enumerate(idx) if isinstance(i, Affine)), None)
    if first is None or any(not isinstance(i, int | Affine) for i in idx):
        return None
    affs = [i for i in idx if isinstance(i, Affine)]
    if any(not i.terms or any(c == 0 for c, _ in i.terms) for i in affs):
        return None
    order = [i for i in idx[:first] if isinstance(i, int)]
    order += [a.terms[0][1] for a in affs]
    order += [it for a in affs for _, it in a.terms[1:]]
    order += [i for i in idx[first:] if isinstance(i, int)]
    return order if len(set(order)) == len(order) else None


def _renumber(idx: Projection, pos: dict[int, int]) -> Projection:
    return tuple(pos[i] if isinstance(i, int) else
                 Affine(tuple((c, pos[it]) for c, it in i.terms), i.offset) for i in idx)


def _orders(order: list[int], lhs_idx: Projection, other: Projection) -> list[list[int]]:
    """``order`` (the canonical layout, shared by a convolution and its kernel's gradient),
    then the layouts with the iterators shared with the target first, or last."""
    in_lhs = [i for i in lhs_idx if isinstance(i, int) and i in order]
    in_other = [i for i in other if isinstance(i, int) and i in order and i not in in_lhs]
    rest = [i for i in order if i not in in_lhs and i not in in_other]
    out = [order]
    for cand in (in_lhs + in_other + rest, in_other + in_lhs + rest):
        if cand not in out and len(cand) == len(order):
            out.append(cand)
    return out


def _worth_it(g: Gemm, patches: Tnode) -> bool:
    """Whether the GEMM ``g`` over ``patches`` (gathered from a windowed operand) beats the
    direct loops: its reduction has at least ``IM2COL_MIN_INNER`` terms and it reads each patch
    cell at least ``IM2COL_MIN_REUSE`` times. (A scattered product's GEMM is always worth it:
    its direct nest reads, adds and writes its target at every point; the GEMM must only be
    large enough for BLAS, as every GEMM: ``GEMM_MIN_FLOPS``.)"""
    work = g.rows * g.cols * g.inner * math.prod(b.size for b in g.batch)
    return g.inner >= IM2COL_MIN_INNER and work >= IM2COL_MIN_REUSE * patches.size


def im2col_items(a: Accum, target: Target) -> list[Fill | LoopNest | Gemm] | None:
    """``a`` as patches and a GEMM, when it is ``lhs += X[window] * W`` (a convolution, or its
    kernel's gradient) or ``lhs[window] += U * W`` (its input's gradient) with every other
    index a plain iterator and the GEMM is recognised over the patches (and, for the first,
    worth it: :func:`_worth_it`); else None.

    - ``lhs += X[window] * W``: a pointwise nest copies ``X`` into patches ``P`` (the window's
      iterators as axes of their own, 0 where the window is outside ``X``: padding), then
      ``lhs += P * W`` is a GEMM. ``P`` is in ``X``'s precision when that is f32 or f64, or
      16-bit and multiplied as stored (``schedule.native_operands``), else in f32: the same
      values, and the operand the GEMM needs.
    - ``lhs[window] += U * W``: ``dP = U * W`` is a GEMM into a patch gradient (f32 when
      ``lhs`` is 16-bit), then ``lhs[window] += dP`` adds it back (a zero fill first when ``a``
      resets ``lhs``), as a reduction over the window offsets that land on each cell where
      every affine index has an iterator of coefficient +-1 and that reads at most
      ``GATHER_MAX_WASTE`` times the patches, else as a scatter."""
    e = a.expr
    if not (a.accum == "+" and isinstance(e, Apply) and e.op == "mul"):
        return None
    x, y = e.args
    if not (isinstance(x, Get) and isinstance(y, Get)) or a.lhs in (x.node, y.node):
        return None
    plain = [all(isinstance(i, int) for i in p) for p in (a.lhs_idx, x.idx, y.idx)]
    if all(plain[:1]) and plain[1] != plain[2]:
        return _gathered(a, x, y, target) if not plain[1] else _gathered(a, y, x, target)
    if not plain[0] and plain[1] and plain[2]:
        return _scattered(a, target.batched_gemm)
    return None


def _gathered(a: Accum, win: Get, other: Get, target: Target) -> list[LoopNest | Gemm] | None:
    """See :func:`im2col_items`. The patches are laid out in the canonical order (shared by a
    convolution and its kernel's gradient: one gather for both), unless, on a CPU, a
    convolution over this window is never worth patches (its ``IM2COL_MIN_INNER`` terms: the
    first layer's 3 x 3 window over one channel) and another layout copies longer runs
    (``copy_run``): the 1-channel image's patches as window offsets first, each a run of an
    image row, not runs of three cells: convnet's first layer's gather 16.7 -> 10.7 us, its
    product over them 16.7 -> 18.1 us (B transposed for the library), its steps 0.97x (AMD
    EPYC Zen 5, OpenBLAS, which gave the same bits either way)."""
    order = _window_order(win.idx)
    if order is None:
        return None
    src = win.node
    chosen: tuple[Gemm, LoopNest, int] | None = None  # with its gather's run of cells
    alone = (target.gpu_block == 0  # the runs are the CPU's (a GPU's threads copy cells)
             and math.prod(a.space[i] for i in _window_terms(win.idx)) < IM2COL_MIN_INNER)
    for cand in _orders(order, a.lhs_idx, other.idx):
        pos = {it: k for k, it in enumerate(cand)}
        dims = tuple(a.space[i] for i in cand)
        g, patches = _over_patches(a, win, other, cand, src.prec, target.batched_gemm)
        if g is None:
            continue
        if src.prec.is_narrow and not native_operands(g, product_kernel(g, target), target):
            # the f32 operand the product needs
            g, patches = _over_patches(a, win, other, cand, Precision.f32, target.batched_gemm)
            assert g is not None  # the same product over other storage
        if not _worth_it(g, patches):
            return None
        gather = loop_nest(Accum(patches, tuple(range(len(cand))), "=",
                                 Get(src, _renumber(win.idx, pos)), dims))
        cells = _run_cells(gather)
        if chosen is None or cells > chosen[2]:
            chosen = (g, gather, cells)
        if not alone or cells > 0:
            break
    if chosen is None:
        return None
    g, gather, _ = chosen
    _PATCH_SOURCE[gather.assign.lhs] = src.id
    return [gather, g]


def _window_terms(idx: Projection) -> list[int]:
    """The iterators a window's cell adds to its output position (``kh``, ``kw`` and the
    channels ``c`` of ``x[b, s*oh + kh - p, s*ow + kw - p, c]``): a convolution's terms."""
    order = _window_order(idx)
    assert order is not None
    first = next(k for k, i in enumerate(idx) if isinstance(i, Affine))
    lead = sum(isinstance(i, int) for i in idx[:first])
    return order[lead + sum(isinstance(i, Affine) for i in idx):]


def _run_cells(gather: LoopNest) -> int:
    """The cells of each run a gather copies as a run (``schedule.copy_run``), 0 for none."""
    count = copy_run(LoopGroup((gather,)))
    return math.prod(gather.space[i] for i in gather.par[-count:]) if count else 0


def _over_patches(a: Accum, win: Get, other: Get, order: list[int], prec: Precision,
                  batched: bool) -> tuple[Gemm | None, Tnode]:
    """``a``'s product over the patches of ``win`` laid out in ``order``, stored in ``prec``
    (None where that is no GEMM), and those patches."""
    pos = {it: k for k, it in enumerate(order)}
    dims = tuple(a.space[i] for i in order)
    patches = _patch_node(win.node, "patches", _renumber(win.idx, pos), dims, prec)
    read = Get(patches, tuple(order))
    args = (read, other) if a.expr.args[0] is win else (other, read)
    product = Accum(a.lhs, a.lhs_idx, "+", apply("mul", *args), a.space, a.reset)
    return _as_gemm(product, batched), patches


def _scattered(a: Accum, batched: bool) -> list[Fill | LoopNest | Gemm] | None:
    order = _window_order(a.lhs_idx)
    if order is None:
        return None
    lhs = a.lhs
    prec = Precision.f32 if lhs.prec.is_narrow else lhs.prec
    x, y = a.expr.args
    for cand in _orders(order, x.idx, y.idx):
        pos = {it: k for k, it in enumerate(cand)}
        dims = tuple(a.space[i] for i in cand)
        grad = _patch_node(lhs, "patch_grad", _renumber(a.lhs_idx, pos), dims, prec)
        g = _as_gemm(Accum(grad, tuple(cand), "+", a.expr, a.space, reset=True), batched)
        if g is None:
            continue
        back = _col2im_gather(a, grad, cand)
        if back is not None:
            _GATHERS.update(p for p, _ in back)
            return [g, *(gather_nest(*p) for p in back)]
        out: list[Fill | LoopNest | Gemm] = [g]
        if a.reset:
            out.append(Fill(lhs, 0.0))
        out.append(loop_nest(Accum(lhs, _renumber(a.lhs_idx, pos), "+",
                                   Get(grad, tuple(range(len(cand)))), dims)))
        return out
    return None


def _col2im_gather(a: Accum, grad: Tnode, order: list[int]
                   ) -> list[tuple[Accum, tuple[int, ...]]] | None:
    """col2im ``lhs[window] (=)+ grad[...]`` as a gather (:func:`gather_of`: one, through
    plain iterators; a strided window's phases would sum a few terms a cell, which a CPU does
    faster as a scatter), within ``GATHER_MAX_WASTE``."""
    back = Accum(a.lhs, _renumber(a.lhs_idx, {it: k for k, it in enumerate(order)}), "+",
                 Get(grad, tuple(range(len(order)))), grad.dims, a.reset)
    gather = gather_of(back, GATHER_MAX_WASTE)
    return None if gather is None else [(gather, tuple(range(len(a.lhs.dims))))]


def _vanishes(e: Expr, solved: dict[int, int]) -> bool:
    """Whether ``e`` is 0 at every point where any one solved iterator is outside its extent
    (``solved``: iterator -> extent): for each, a read that indexes an axis of that extent with
    the iterator itself (read there: 0), or a product or negation of such an expression (times
    finite values)."""
    return all(_vanishes_for(e, it, extent) for it, extent in solved.items())


def _vanishes_for(e: Expr, it: int, extent: int) -> bool:
    if isinstance(e, Get):
        return any(i == it and d == extent for i, d in zip(e.idx, e.node.dims, strict=True)
                   if isinstance(i, int))
    if isinstance(e, Apply) and e.op == "mul":
        return any(_vanishes_for(x, it, extent) for x in e.args)
    if isinstance(e, Apply) and e.op == "neg":
        return _vanishes_for(e.args[0], it, extent)
    return False


def _substitute(e: Expr, at: dict[int, Index]) -> Expr:
    """``e`` with every iterator replaced by its index in ``at`` (an affine index of an
    affine index composes)."""
    def index(i: Index) -> Index:
        if isinstance(i, int):
            return at[i]
        if not isinstance(i, Affine):
            return i
        terms: list[tuple[int, int]] = []
        offset = i.offset
        for c, it in i.terms:
            j = at[it]
            if isinstance(j, int):
                terms.append((c, j))
            elif isinstance(j, Fixed):
                offset += c * j.pos
            else:
                terms += [(c * c2, it2) for c2, it2 in j.terms]
                offset += c * j.offset
        return Affine(tuple(terms), offset)

    return rewrite_reads(e, lambda g: Get(g.node, tuple(index(i) for i in g.idx), g.rounded))


def _strided(i: Affine) -> tuple[int, int, int] | None:
    """``(o, s, k)`` where ``i`` is ``s*o + k + offset`` with ``s >= 2``: a window moving
    by a stride (a strided convolution's or pool's index), else None."""
    if len(i.terms) != 2:
        return None
    (c1, i1), (c2, i2) = i.terms
    if c2 == 1 and c1 >= 2:
        return i1, c1, i2
    if c1 == 1 and c2 >= 2:
        return i2, c2, i1
    return None


def gather_parts(a: Accum, max_waste: float) -> list[tuple[Accum, tuple[int, ...]]] | None:
    """The scatter ``lhs[affine] (=)+ expr`` as gathers, each with the iterators that pick its
    cells (the others are reduced over): ``lhs[cells] (=)+ the sum of expr over the points
    that land on each cell``, a reduction per cell (parallel, each cell's terms in one order
    whatever the threads); or None where it cannot be or would cost too much.

    - A strided affine index ``s*o + k + offset`` (``s >= 2``) splits the target's axis into
      ``s`` phases, cells ``s*m + phi``: on a phase only ``k = s*q + rho`` land, with
      ``o = m + A - q`` (``phi - offset = s*A + rho``), each exactly once. Where the axis, the
      offset and ``k``'s extent are multiples of ``s``, ``phi`` is one more iterator of the
      cells (``rho = phi``, ``A`` fixed); else there is a gather per phase.
    - Any other affine index is solved for its iterator of coefficient +-1 with the largest
      extent (an affine index of the cell and the other iterators), which may fall outside.
    - Every other iterator is reduced over, in ``a``'s order.

    A point whose ``o`` (or solved iterator) is outside its extent is no point of ``a``:
    ``expr`` must vanish there (:func:`_vanishes`: a read of it outside its axis gives 0),
    which a non-finite factor beside that read breaks (``0 * inf`` is NaN where the scatter
    added nothing): such inputs give a non-finite gradient either way. None where an affine
    index has no such iterator, a phase gets no term (a window narrower than its stride), a
    plain index does not cover its axis or an iterator is in two indices, ``expr`` does not
    vanish, ``a`` accumulates otherwise than with ``+``, reads its own target, or the gathers
    take more than ``max_waste`` times ``a``'s points."""
    lhs = a.lhs
    if a.accum != "+" or any(g.node is lhs for g in reads(a.expr)):
        return None
    named = [it for i in a.lhs_idx if isinstance(i, int | Affine)
             for it in ((i,) if isinstance(i, int) else i.iterators)]
    if any(isinstance(i, Fixed) for i in a.lhs_idx) or len(set(named)) != len(named):
        return None
    phases: dict[int, tuple[int, int, int]] = {}  # target axis -> (o, s, k)
    solved: dict[int, tuple[int, Affine]] = {}  # iterator -> (target axis, affine index)
    for j, (i, d) in enumerate(zip(a.lhs_idx, lhs.dims, strict=True)):
        if isinstance(i, int):
            if a.space[i] != d:
                return None
        elif _strided(i) is not None:
            phases[j] = _strided(i)
        else:
            units = [(c, it) for c, it in i.terms if abs(c) == 1]
            if not units:
                return None
            solved[max(units, key=lambda t: a.space[t[1]])[1]] = (j, i)
    vanish = {s: a.space[s] for s in solved} | {o: a.space[o] for o, _, _ in phases.values()}
    if not _vanishes(a.expr, vanish):
        return None
    merged = {j for j, (_, s, k) in phases.items()
              if lhs.dims[j] % s == 0 and a.lhs_idx[j].offset % s == 0 and a.space[k] % s == 0}
    apart = [j for j in phases if j not in merged]
    parts: list[tuple[Accum, tuple[int, ...]]] = []
    for phis in itertools.product(*(range(phases[j][1]) for j in apart)):
        part = _gather_part(a, phases, dict(zip(apart, phis, strict=True)), solved)
        if part is None:
            return None
        if math.prod(part[0].space[i] for i in part[1]) > 0:
            parts.append(part)
    if sum(math.prod(p.space) for p, _ in parts) > max_waste * math.prod(a.space):
        return None
    return parts


def _gather_part(a: Accum, phases: dict[int, tuple[int, int, int]], phis: dict[int, int],
                 solved: dict[int, tuple[int, Affine]]
                 ) -> tuple[Accum, tuple[int, ...]] | None:
    """The gather of :func:`gather_parts` over the phases ``phis`` (axis -> phase; a strided
    axis not in it has its phase as an iterator) and its cells' iterators, or None where a
    phase gets no term; a phase with no cell gives a gather of none."""
    lhs = a.lhs
    space: list[int] = []
    lhs_idx: list[Index] = []
    par: list[int] = []
    cell: dict[int, tuple[int, int | None]] = {}  # target axis -> its iterators (m, phi)
    at: dict[int, Index] = {}  # an original iterator -> its index in the gather's space
    for j, (i, d) in enumerate(zip(a.lhs_idx, lhs.dims, strict=True)):
        m = len(space)
        if j not in phases:
            if isinstance(i, int):
                at[i] = m
            lhs_idx.append(m)
            space.append(d)
            cell[j] = (m, None)
        elif j in phis:
            s, phi = phases[j][1], phis[j]
            lhs_idx.append(Affine(((s, m),), phi))
            space.append(max(0, -(-(d - phi) // s)))  # the cells s*m + phi inside the axis
            cell[j] = (m, None)
        else:
            s = phases[j][1]
            lhs_idx.append(Affine(((s, m), (1, m + 1))))
            space += [d // s, s]
            cell[j] = (m, m + 1)
        par += [k for k in cell[j] if k is not None]
    for it, extent in enumerate(a.space):
        if it not in at and it not in solved and not any(it in (o, k) for o, _, k in
                                                          phases.values()):
            at[it] = len(space)
            space.append(extent)
    for j, (o, s, k) in phases.items():
        offset = a.lhs_idx[j].offset
        m, phi_it = cell[j]
        if phi_it is None:
            shift, rho = divmod(phis[j] - offset, s)
            k_at: list[tuple[int, int]] = []
        else:
            shift, rho = -offset // s, 0
            k_at = [(1, phi_it)]  # rho is the phase
        terms = -(-(a.space[k] - rho) // s)  # k = s*q + rho inside k's extent
        if terms <= 0:
            return None
        o_at = [(1, m)]
        if terms > 1:
            k_at.append((s, len(space)))
            o_at.append((-1, len(space)))
            space.append(terms)
        at[k] = Affine(tuple(k_at), rho) if k_at else Fixed(rho)
        at[o] = Affine(tuple(o_at), shift)
    for s, (j, i) in solved.items():
        c_s = next(c for c, it in i.terms if it == s)
        terms_ = [(c_s, cell[j][0])]  # s = c_s * (cell - offset - others)
        terms_ += [(-c * c_s, at[it]) for c, it in i.terms if it != s]
        at[s] = Affine(tuple(terms_), -i.offset * c_s)
    gather = Accum(lhs, tuple(lhs_idx), "+", _substitute(a.expr, at), tuple(space), a.reset)
    return gather, tuple(par)


def gather_of(a: Accum, max_waste: float) -> Accum | None:
    """``a``'s gather where :func:`gather_parts` makes one that writes its cells through
    plain iterators (no strided axis), else None."""
    parts = gather_parts(a, max_waste)
    if parts is None or len(parts) != 1 or not all(isinstance(i, int)
                                                    for i in parts[0][0].lhs_idx):
        return None
    return parts[0][0]


def gather_nest(gather: Accum, par: tuple[int, ...]) -> LoopNest:
    """A gather of :func:`gather_parts` as a loop nest: parallel over ``par`` (distinct
    cells, also through a phase's ``s*m + phi``), reducing over the rest."""
    if all(isinstance(i, int) for i in gather.lhs_idx):
        return replace(loop_nest(gather), gather=True)
    red = tuple(i for i in range(len(gather.space)) if i not in par)
    return LoopNest(gather, par, red, gather=True)


def _neutral(accum: str) -> float:
    v = ACCUMS[accum]
    return 0.0 if v is None else v


def _is_fill(a: Accum) -> bool:
    return a.accum == "=" and isinstance(a.expr, Const) and covers(a) and \
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
        if b.lhs is not a.lhs or not covers(b) or any(g.node is a.lhs for g in reads(b.expr)):
            continue
        if b.accum == "=" and len(b.space) == len(b.lhs_idx):  # overwritten whole: dead fill
            out[k] = None
        elif b.accum == "+" and not b.reset and a.expr.value == 0.0:
            out[nxt] = Accum(b.lhs, b.lhs_idx, b.accum, b.expr, b.space, reset=True)
            out[k] = None
    return [a for a in out if a is not None]



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


def _touched(item: Fill | Gemm | _Group) -> tuple[AbstractSet[int], AbstractSet[int]]:
    """The ids of the nodes an item reads and writes (a group being built: its own sets)."""
    if isinstance(item, _Group):
        return item.read, set(item.written)
    acc = access(item)
    return acc.reads, acc.writes


def lower(comp: Comp, target: Target) -> list[Lowered]:
    """The items ``target``'s backend renders for ``comp``, in order, with every choice made:
    :func:`lower_items`, then :func:`ocannl.ir.schedule.schedule`."""
    return schedule(lower_items(comp, target), target)


def lower_items(comp: Comp, target: Target) -> list[Lowered]:
    """Lower a computation to items that mean the same on every backend, in order: fills,
    GEMMs (when the target has a library for them: ``Target.gemm``; batched products too when
    it takes those: ``Target.batched_gemm``; windowed products through patches too when
    ``Target.im2col``: see :func:`im2col_items`) and loop groups.

    A pointwise nest joins the latest loop group it fits, up to ``HOIST_WINDOW`` items back,
    when it moves past nothing it depends on or that depends on it: an optimizer's per-weight
    update, written after every weight's gradient, then runs in one pass with the gradient's
    last pointwise step (the same values, in one pass over the cells instead of several).

    The patches of a node are copied once while the node is unchanged (a convolution's and its
    kernel gradient's are the same). A zero fill of a target that im2col's col2im then adds
    into whole, with nothing touching the target between, becomes that col2im's reset."""
    out: list[Fill | Gemm | _Group] = []
    gathered: dict[int, int] = {}  # patch node id -> its source's, while the copy is current
    for a in fuse_resets(comp.assignments):
        items = [Fill(a.lhs, a.expr.value)] if _is_fill(a) else lower_assignment(a, target)
        items = _gathers_after_zeros(items, out)
        for item in items:
            source = _PATCH_SOURCE.get(item.assign.lhs) if isinstance(item, LoopNest) else None
            if source is not None and item.assign.accum == "=":  # a gather
                if gathered.get(item.assign.lhs.id) == source:
                    continue  # these patches are already there
                gathered[item.assign.lhs.id] = source
            _append(out, item)
            wrote = _touched(out[-1])[1] if not isinstance(item, LoopNest) else \
                {item.assign.lhs.id}
            for p, src in list(gathered.items()):
                if src in wrote:
                    del gathered[p]
    return _pull_up(_alias_copies([LoopGroup(tuple(i.nests)) if isinstance(i, _Group) else i
                                   for i in out]))


# How far back (in items) a loop group looks for the GEMM whose result it reads.
PULL_WINDOW = 8


def _pull_up(code: list[Lowered]) -> list[Lowered]:
    """Bring a loop group that reads a GEMM's result (at most ``PULL_WINDOW`` items back) to
    right after that GEMM: the group moves up when nothing in between touches what it reads
    or writes, else the GEMM moves down when nothing in between touches what the GEMM reads
    or writes. The result is consumed at once, its memory free sooner (a cast twin's
    gradient, flowing into its master's, no longer waits for the input gradient's
    product)."""
    # A read of a local copy of a node counts as a read of that node too: scheduling may make
    # the copy virtual, each read then reading the node (a cast twin its master:
    # ``schedule.virtual_twins``), which the moved item must not pass a write of.
    source = {n.assign.lhs.id: n.assign.expr.node.id for item in code
              if isinstance(item, LoopGroup) for n in item.nests
              if isinstance(n.assign.expr, Get)
              and n.assign.lhs.memory_mode in (MemoryMode.local, MemoryMode.virtual)}

    def touched(item: Lowered) -> tuple[AbstractSet[int], AbstractSet[int]]:
        acc = access(item)
        return acc.reads | {source[i] for i in acc.reads if i in source}, acc.writes

    def independent(a: Lowered, b: Lowered) -> bool:
        (ra, wa), (rb, wb) = touched(a), touched(b)
        return not (wa & (rb | wb) or ra & wb)

    out = list(code)
    for r, item in enumerate(out):
        if not isinstance(item, LoopGroup):
            continue
        reads_r = touched(item)[0]
        p = next((p for p in range(r - 1, max(r - PULL_WINDOW, 0) - 1, -1)
                  if isinstance(out[p], Gemm) and out[p].assign.lhs.id in reads_r), None)
        if p is None or p == r - 1:
            continue
        between = out[p + 1:r]
        if all(independent(item, other) for other in between):  # the group moves up
            out.insert(p + 1, out.pop(r))
        elif all(independent(out[p], other) for other in between):  # the product down
            out.insert(r - 1, out.pop(p))
    return out


def _alias_copies(code: list[Lowered]) -> list[Lowered]:
    """Drop whole-node copies ``b = a`` of a local ``b`` (an addition's gradient handed to an
    operand's: a linear layer's bias add) and let ``b``'s readers read ``a``: same dims and
    precision, cell for cell, ``b`` written nowhere else and ``a`` nowhere after. A copy
    leading a group of several nests stays (the group's loop is the lead's)."""
    writers = AccessIndex(code).writers

    def only_writer(node_id: int, k: int, group: LoopGroup, j: int) -> bool:
        """Whether nest ``j`` of ``group`` (item ``k``) is the one nest writing the node."""
        return writers[node_id] == [k] and [m for m, n in enumerate(group.nests)
                                            if n.assign.lhs.id == node_id] == [j]

    def written_after(node_id: int, k: int, group: LoopGroup, j: int) -> bool:
        """Whether an item after ``k``, or a nest of ``group`` (item ``k``) after ``j``,
        writes the node."""
        return any(w > k for w in writers.get(node_id, [])) or any(
            n.assign.lhs.id == node_id for n in group.nests[j + 1:])

    alias: dict[int, Tnode] = {}
    dropped: set[tuple[int, int]] = set()
    for k, item in enumerate(code):
        if not isinstance(item, LoopGroup):
            continue
        for j, nest in enumerate(item.nests):
            copied = copy_source(nest)
            if (j == 0 and len(item.nests) > 1) or copied is None:
                continue
            dst, src = nest.assign.lhs, alias.get(copied.id, copied)
            if (dst.memory_mode is not MemoryMode.local or src.id == dst.id
                    or src.prec != dst.prec or not only_writer(dst.id, k, item, j)
                    or written_after(src.id, k, item, j)):
                continue
            alias[dst.id] = src
            dropped.add((k, j))
    if not alias:
        return code

    def renamed(a: Accum) -> Accum:
        return replace(a, expr=rewrite_reads(
            a.expr, lambda g: Get(alias[g.node.id], g.idx) if g.node.id in alias else g))

    def view(v: MatrixView) -> MatrixView:
        return replace(v, node=alias[v.node.id]) if v.node.id in alias else v

    out: list[Lowered] = []
    for k, item in enumerate(code):
        if isinstance(item, Gemm):
            item = replace(item, assign=renamed(item.assign), a=view(item.a), b=view(item.b))
        elif isinstance(item, LoopGroup):
            kept = tuple(replace(n, assign=renamed(n.assign))
                         for j, n in enumerate(item.nests) if (k, j) not in dropped)
            if not kept:
                continue
            item = replace(item, nests=kept)
        out.append(item)
    return out


def _gathers_after_zeros(items: list[Fill | LoopNest | Gemm], out: list[Fill | Gemm | _Group]
                         ) -> list[Fill | LoopNest | Gemm]:
    """``items`` with their gathers (one of ``_GATHERS``: a scatter's or col2im's, adding into
    every cell of their target together, each cell once) resetting the target instead of adding
    into it where the latest item touching the target zeroed it (a zero fill, then dropped)."""
    gathers = [n for n in items if isinstance(n, LoopNest) and n.assign in _GATHERS]
    if not gathers or any(n.assign.reset for n in gathers):
        return items
    lhs = gathers[0].assign.lhs
    for k in range(len(out) - 1, -1, -1):
        r, w = _touched(out[k])
        if lhs.id in r or lhs.id in w:
            item = out[k]
            if not (isinstance(item, Fill) and item.node is lhs and item.value == 0.0):
                return items
            del out[k]
            return [replace(n, assign=replace(n.assign, reset=True))
                    if isinstance(n, LoopNest) and n.assign in _GATHERS else n for n in items]
    return items


def _append(out: list[Fill | Gemm | _Group], item: Fill | LoopNest | Gemm) -> None:
    if not isinstance(item, LoopNest):
        out.append(item)
        return
    reads_ = {g.node.id for g in reads(item.assign.expr)}
    writes = item.assign.lhs.id
    for k in range(len(out) - 1, max(-1, len(out) - 1 - HOIST_WINDOW), -1):
        other = out[k]
        if isinstance(other, _Group) and other.admits(item):
            other.add(item)
            return
        r, w = _touched(other)
        if writes in r or writes in w or reads_ & w:
            break
    out.append(_Group(item))

