"""A reference interpreter of lowered code: NumPy running fills, loop groups and products exactly
as lowering wrote them.

Why it exists: it is the oracle both renderers (LLVM IR on the CPU, CUDA C) are tested
against. It reads only the lowered items (their meaning, and scheduling's choices where they
change bits), never a renderer's own, so a
lowering bug shows against hand values here and a rendering bug shows as a difference between
a backend and this module, each in tests of their own.

The arithmetic is C's as the renderers write it: a nest computes in its target's compute
precision (``prec.compute``: f32, or f64), literals take that precision, 16-bit storage widens
exactly to f32 on load and rounds once (nearest, ties to even) on store, an f32 meeting an f64
widens, and nothing is reassociated or contracted. Each op means what ``ops.reference`` computes
(comparisons and hashes give a value of the compute precision); ``max``/``min`` select as their C
template does (the left operand on a tie or a NaN). ``ULP`` says how far each op's CPU builder
may be from that reference.

- A loop group runs nest by nest, each over its whole parallel space at once. That equals the
  renderers' point-by-point loop only where every node the group writes is read and written in
  it at one projection (each point then sees its own cell only): checked, and a group that breaks
  it is refused (:class:`GroupingError`), so a wrong grouping in lowering is caught, not hidden.
  A group's register nodes are poisoned (NaN) after it: no later item may need them.
- A reduction takes its terms per cell in the lowered order (the reduction iterators nested in
  ``red`` order, row-major), from the accumulator's neutral element, in the compute precision,
  into a local, combined with the cell's old value at the end unless it resets; reads see the
  values from before the nest. A scatter (an affine target) reads, combines and writes point by
  point in loop order (``par`` then ``red``); a 16-bit target accumulates in f32 and rounds once
  at the end, as a reduction's local does.
- It reads scheduling's choices where they bear on bits, as the renderers do: a nest's exact
  bf16 stores (``LoopNest.exact_store``: the top half, rounding's bits), a sum in any order
  (``any_order``: NumPy's order, the same bits), a product's TF32 operands (``Gemm.tf32``).
  Its conversions keep a NaN's payload everywhere, which is what ``keeps_payload`` and
  ``payload_rounds`` promise; elsewhere a renderer's payload is unspecified.
- A :class:`~ocannl.ir.lowering.Gemm` is, by default, the in-order sum over the inner dimension
  from +0 of products rounded one by one (what the loops and the inline small products compute),
  then ``old + sum`` when it accumulates; ``gemm="matmul"`` uses ``np.matmul`` (BLAS: fast, its
  order undefined), and a callable computes the item itself (a differential test borrowing the
  backend's BLAS, whose order has no definition).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ocannl.ir.assignments import Affine, Apply, Const, Dynamic, Expr, Fixed, Get, reads
from ocannl.ir.lowering import (
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    Lowered,
    MatrixView,
    batch_offsets,
    effects,
)
from ocannl.ir.ops import ACCUMS, OPS, Precision, reference
from ocannl.ir.tnode import MemoryMode, Tnode

# How many ulps (of the compute precision: f32 or f64) the CPU backend's builder of each op
# may be from ``ops.reference`` on the same operands, by op: its row's ``ulps`` (0: the same
# bits, signs of zeros included, NaN payloads aside), measured by ``tests/ir/test_ops.py`` and
# checked again by ``tests/backends/test_cpu_render.py``.
ULP: dict[str, int] = {name: op.ulps for name, op in OPS.items()}

# Ops whose result is a value of the computation's precision whatever their operands' (a 0 / 1
# flag, an integer hash): what the renderers produce.
_COMPUTE_RESULT = frozenset({"eq", "gt", "lt", "le", "ge", "ne", "isfinite", "hash_add",
                             "hash_xsm", "hash_unit"})
# At most this many points of a nest are evaluated at once (a block of its outer iterator).
CHUNK_POINTS = 1 << 22

Values = dict[int, np.ndarray]
OpTable = Mapping[str, Callable[..., np.ndarray]]
GemmHook = Callable[[Gemm, Values], None]


class GroupingError(ValueError):
    """A loop group whose nests, run one after another over the whole space, would not compute
    what its point-by-point loop computes."""


def run(code: Sequence[Lowered], values: Values, *, gemm: str | GemmHook = "ordered",
        ops: OpTable | None = None) -> None:
    """Run lowered code on ``values`` (node id -> an array of the node's dims in its host dtype:
    ``prec.numpy_dtype``), in place. Nodes the code reads before writing whole must be there
    (``ValueError`` names those missing); others are added, NaN until written.

    ``gemm``: ``"ordered"`` (the in-order sum), ``"matmul"`` (NumPy's BLAS) or a callable
    ``(item, values)`` writing the item's target. ``ops``: functions standing in for
    ``ops.reference`` for some ops (a test borrowing a backend's own ``exp``)."""
    if gemm not in ("ordered", "matmul") and not callable(gemm):
        raise ValueError(f"gemm must be 'ordered', 'matmul' or a callable, got {gemm!r}")
    missing = [n.name for n in effects(list(code)).inputs if n.id not in values]
    if missing:
        raise ValueError(f"run: no values for {', '.join(missing)}, which the code reads "
                         f"before writing them whole")
    machine = _Machine(values, ops or {})
    for item in code:
        if isinstance(item, Fill):
            machine.fill(item)
        elif isinstance(item, Gemm):
            machine.node(item.assign.lhs)
            if callable(gemm):
                gemm(item, values)
            else:
                machine.gemm(item, ordered=gemm == "ordered")
        elif isinstance(item, LoopGroup):
            machine.group(item)
        else:
            raise TypeError(f"run: not a lowered item: {item!r}")


def check_group(group: LoopGroup) -> None:
    """Refuse (:class:`GroupingError`) a group that nest-by-nest execution would get wrong: its
    nests must share the lead's space and parallel iterators, only a lone nest may reduce or
    scatter, and every node the group writes must be accessed at one projection throughout."""
    lead = group.lead
    if group.row_sum:  # the pointwise nests, then the row walk summing what they write
        walk = group.nests[-1]
        if not walk.walk_rows or len(walk.par) != 1 or walk.space != lead.space:
            raise GroupingError(f"row-sum group led by {lead.assign.lhs.name}: its last nest, "
                                f"writing {walk.assign.lhs.name}, must be a lone row walk "
                                f"over the lead's space {lead.space}")
        heads = group.nests[:-1]
        order = walk.red + walk.par
    else:
        heads, order = group.nests, lead.par
    if len(group.nests) > 1:
        for nest in heads:
            if nest.space != lead.space or nest.par != order or nest.red or nest.scatter:
                raise GroupingError(
                    f"group led by {lead.assign.lhs.name}: nest writing {nest.assign.lhs.name} "
                    f"has space {nest.space}, par {nest.par}, red {nest.red}, scatter "
                    f"{nest.scatter}: a group of several nests must be pointwise over the "
                    f"lead's space {lead.space} and par {order}")
    written = {n.assign.lhs.id: n.assign.lhs_idx for n in group.nests}
    for nest in group.nests:
        a = nest.assign
        for g in [*reads(a.expr), Get(a.lhs, a.lhs_idx)]:
            at = written.get(g.node.id)
            if at is not None and g.idx != at:
                raise GroupingError(
                    f"group led by {lead.assign.lhs.name}: {g.node.name} is written at "
                    f"{at} and accessed at {g.idx}: a point would see another point's cell")
    for nid in group.registers:
        writers = [n for n in group.nests if n.assign.lhs.id == nid]
        if len(writers) != 1 or writers[0].assign.lhs.memory_mode is not MemoryMode.local:
            raise GroupingError(f"group led by {lead.assign.lhs.name}: register node {nid} "
                                f"must be local and written by exactly one of its nests")


def neutral(accum: str) -> float:
    v = ACCUMS[accum]
    return 0.0 if v is None else v


def stored(value: np.ndarray, prec: Precision) -> np.ndarray:
    """``value`` (f32 or f64) as a store into ``prec`` makes it: a 16-bit store rounds once to
    nearest even from f32 (an f64 value goes through f32 first, as the renderers convert)."""
    with np.errstate(all="ignore"):
        if prec.is_narrow:
            return np.asarray(value).astype(np.float32).astype(prec.numpy_dtype)
        return np.asarray(value).astype(prec.numpy_dtype)


def exactly(value: np.ndarray) -> np.ndarray:
    """An f32 value bf16 represents, stored as the renderers store it
    (``LoopNest.exact_store``): its top half, a NaN its sign's quiet NaN (rounding's bits)."""
    bits = (np.asarray(value, np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(value, np.float32))
    bits = np.where(nan, (bits & np.uint16(0x8000)) | np.uint16(0x7FC0), bits)
    return bits.astype(np.uint16).view(Precision.bf16.numpy_dtype)


def _dtype(prec: Precision) -> np.dtype:
    """The dtype a load of ``prec`` storage gives: 16-bit values widen to f32."""
    return np.dtype(np.float32) if prec.is_narrow else prec.numpy_dtype


def _unified(*xs: np.ndarray) -> list[np.ndarray]:
    """The operands in their common type (an f32 meeting an f64 widens)."""
    dt = np.result_type(*xs)
    return [np.asarray(x, dt) for x in xs]


def _select_max(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = _unified(x, y)
    return np.where((x >= y) | (x != x), x, y)


def _select_min(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = _unified(x, y)
    return np.where((x <= y) | (x != x), x, y)


def _combine(accum: str, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return old + new if accum == "+" else _select_max(old, new)


class _Machine:
    """The values being worked on and the op table, shared by the items of one run."""

    def __init__(self, values: Values, ops: OpTable) -> None:
        self.values = values
        self.ops = ops

    def node(self, n: Tnode) -> np.ndarray:
        arr = self.values.get(n.id)
        if arr is None:
            arr = self.values[n.id] = np.full(n.dims, np.nan, n.prec.numpy_dtype)
        elif arr.shape != n.dims or arr.dtype != n.prec.numpy_dtype:
            raise ValueError(f"values of {n.name}: {arr.dtype} {arr.shape}, expected "
                             f"{n.prec.numpy_dtype} {n.dims}")
        return arr

    # --- items -----------------------------------------------------------------------------

    def fill(self, f: Fill) -> None:
        self.node(f.node)[...] = np.array([f.value], f.node.prec.numpy_dtype)[0]

    def group(self, g: LoopGroup) -> None:
        check_group(g)
        for nest in g.nests:
            self.nest(nest)
        for nid in g.registers:  # never stored by a renderer: no later item may read them
            arr = self.values[nid]
            arr[...] = np.nan

    @staticmethod
    def store(nest: LoopNest, value: np.ndarray) -> np.ndarray:
        """``value`` as the nest's store into its target leaves it: its top half where
        scheduling said the value is bf16's (``exact_store``), else rounded once. NumPy's
        conversions keep a NaN's payload, as a nest that ``keeps_payload`` must; elsewhere
        the payload is unspecified (LLVM may fold a widening and a narrowing away)."""
        if nest.exact_store and nest.assign.lhs.prec is Precision.bf16:
            return exactly(value)
        return stored(value, nest.assign.lhs.prec)

    def nest(self, nest: LoopNest) -> None:
        a = nest.assign
        self.node(a.lhs)
        if 0 in a.space:
            return
        if nest.scatter:
            self._scatter(nest)
            return
        order = [*nest.par, *nest.red]
        # Blocks of the outermost parallel iterator: distinct cells, independent.
        outer = nest.par[0] if nest.par else None
        extent = a.space[outer] if outer is not None else 1
        per = max(1, math.prod(a.space) // extent)
        step = max(1, CHUNK_POINTS // per) if outer is not None else 1
        for lo in range(0, extent, step):
            rng = {outer: (lo, min(extent, lo + step))} if outer is not None else {}
            self._block(nest, order, rng)

    def _iters(self, space: tuple[int, ...], order: list[int],
               rng: dict[int, tuple[int, int]]) -> tuple[dict[int, np.ndarray], tuple[int, ...]]:
        """Index arrays of each iterator over the region (axes in ``order``), and its shape."""
        shape = tuple((rng[i][1] - rng[i][0]) if i in rng else space[i] for i in order)
        iters = {}
        for k, i in enumerate(order):
            lo = rng[i][0] if i in rng else 0
            at = [1] * len(order)
            at[k] = shape[k]
            iters[i] = (np.arange(shape[k]) + lo).reshape(at)
        return iters, shape

    def _block(self, nest: LoopNest, order: list[int], rng: dict[int, tuple[int, int]]) -> None:
        a = nest.assign
        lhs = a.lhs
        compute = _dtype(lhs.prec.compute)
        iters, shape = self._iters(a.space, order, rng)
        npar = len(nest.par)
        par_shape, red_shape = shape[:npar], shape[npar:]
        # the written cells over the parallel axes (a reduction iterator in the target indexes
        # a one-cell axis: its only cell)
        nred = len(order) - npar
        cell_iters = {i: iters[i][(Ellipsis, *([0] * nred))] if k < npar
                      else np.zeros((1,) * npar, np.int64) for k, i in enumerate(order)}
        cells = tuple(self._index(lhs, a.lhs_idx, cell_iters)[0])
        target = self.values[lhs.id]
        if not nest.red:
            value = np.broadcast_to(self.expr(a.expr, compute, iters), shape)
            if not (a.accum == "=" or a.reset):
                old = target[cells].astype(compute)
                value = _combine(a.accum, old, value)
            target[cells] = self.store(nest, value)
            return
        value = np.broadcast_to(self.expr(a.expr, compute, iters), shape)
        terms = value.reshape(*par_shape, math.prod(red_shape))
        if a.accum == "=":  # every point overwrites its cell: in order, the last one stays
            if any(g.node.id == lhs.id for g in reads(a.expr)):
                raise ValueError(f"{lhs.name} = ... over reduction iterators reads its own "
                                 f"target: each point would see the last one's store")
            target[cells] = self.store(nest, terms[..., -1])
            return
        acc = self._reduce(a.accum, terms, compute, nest.any_order)
        if not a.reset:
            acc = _combine(a.accum, target[cells].astype(compute), acc)
        target[cells] = stored(acc, lhs.prec)

    @staticmethod
    def _reduce(accum: str, terms: np.ndarray, compute: np.dtype, any_order: bool = False
                ) -> np.ndarray:
        """The terms (last axis) combined one by one, in order, from the neutral element, each
        step rounded to the compute precision; ``any_order`` (``LoopNest.any_order``: every
        term +-0 or NaN), summed in NumPy's order, which gives the same bits."""
        start = np.full(terms.shape[:-1], neutral(accum), compute)
        with np.errstate(all="ignore"):
            if any_order and terms.dtype == compute:
                return (start + np.sum(terms, axis=-1, dtype=compute)).astype(compute)
            if accum == "+" and terms.dtype == compute:
                # accumulate adds strictly in order (it never splits a sum pairwise)
                both = np.concatenate([start[..., None], terms], axis=-1)
                return np.add.accumulate(both, axis=-1, dtype=compute)[..., -1]
            acc = start
            for k in range(terms.shape[-1]):
                acc = _combine(accum, acc, terms[..., k]).astype(compute)
        return acc

    def _scatter(self, nest: LoopNest) -> None:
        """Point by point in loop order: read the moving cell, combine, write; outside the
        node, skipped."""
        a = nest.assign
        lhs = a.lhs
        compute = _dtype(lhs.prec.compute)
        if any(g.node.id == lhs.id for g in reads(a.expr)):
            raise ValueError(f"scatter into {lhs.name} reads its own target: its result depends "
                             f"on the order of the points, which nest-wide evaluation loses")
        order = [*nest.par, *nest.red]
        iters, shape = self._iters(a.space, order, {})
        value = np.broadcast_to(self.expr(a.expr, compute, iters), shape).reshape(-1)
        idx, ok = self._index(lhs, a.lhs_idx, iters)
        flat = np.ravel_multi_index(tuple(np.broadcast_to(i, shape) for i in idx),
                                    lhs.dims).reshape(-1) if lhs.dims else np.zeros(
                                        value.size, np.int64)
        keep = np.broadcast_to(ok, shape).reshape(-1)
        flat, value = flat[keep], value[keep]
        target = self.values[lhs.id].reshape(-1)
        wide = target.astype(compute)  # a 16-bit target accumulates in f32
        if a.accum == "=":
            last = np.unique(flat[::-1], return_index=True)[1]
            wide[flat[::-1][last]] = value[::-1][last]
        elif a.accum == "+" and value.dtype == compute:
            np.add.at(wide, flat, value)  # unbuffered, in the order of the points
        else:
            for cell, v in zip(flat, value, strict=True):
                wide[cell] = _combine(a.accum, wide[cell], v)
        target[...] = self.store(nest, wide)

    def gemm(self, g: Gemm, ordered: bool) -> None:
        lhs = g.assign.lhs
        compute = _dtype(lhs.prec.compute)
        out = self.values[lhs.id].reshape(-1)
        ops = [self.node(v.node).reshape(-1).astype(compute) for v in (g.a, g.b)]
        if g.tf32:  # operands rounded to TF32 (10 bits of mantissa, nearest even), as cuBLAS's
            ops = [tf32(x) for x in ops]  # tensor cores take f32 (``Gemm.tf32``)
        for off_out, off_a, off_b in batch_offsets(g.batch):
            a = gemm_matrix(ops[0], g.a, off_a)
            b = gemm_matrix(ops[1], g.b, off_b)
            cells = (off_out + np.arange(g.rows)[:, None] * g.out_ld
                     + np.arange(g.cols)[None, :])
            with np.errstate(all="ignore"):
                if ordered:
                    acc = np.zeros((g.rows, g.cols), compute)
                    for k in range(g.inner):
                        acc = acc + a[:, k, None] * b[None, k, :]
                else:
                    acc = np.matmul(a, b)
                if not g.assign.reset:
                    acc = out[cells].astype(compute) + acc
            out[cells] = stored(acc, lhs.prec)

    # --- expressions -----------------------------------------------------------------------

    def _index(self, node: Tnode, idx: tuple, iters: dict[int, np.ndarray]
               ) -> tuple[list[np.ndarray], np.ndarray | bool]:
        """Per-axis index arrays of ``node[idx]`` and where every affine index is inside the
        node (out of range: clamped to 0, to be masked)."""
        out: list[np.ndarray] = []
        ok: np.ndarray | bool = True
        for i, dim in zip(idx, node.dims, strict=True):
            if isinstance(i, Dynamic):
                at = np.asarray(int(self.values[i.node.id].reshape(-1)[0]))
            elif isinstance(i, Fixed):
                at = np.asarray(i.pos)
            elif isinstance(i, Affine):
                at = np.asarray(i.offset)
                for c, it in i.terms:
                    at = at + c * iters[it]
                inside = (at >= 0) & (at < dim)
                ok = ok & inside
                at = np.where(inside, at, 0)
            else:
                at = iters[i]
            if dim == 1:  # a one-cell axis: the renderers read its only cell
                at = np.zeros_like(at)
            out.append(at)
        return out, ok

    def expr(self, e: Expr, compute: np.dtype, iters: dict[int, np.ndarray]) -> np.ndarray:
        if isinstance(e, Const):
            return np.asarray(e.value, compute)
        if isinstance(e, Get):
            arr = self.values.get(e.node.id)
            if arr is None:
                raise ValueError(f"{e.node.name} is read before anything wrote it")
            idx, ok = self._index(e.node, e.idx, iters)
            value = np.asarray(arr[tuple(idx)]).astype(_dtype(e.node.prec))
            rounded = getattr(e, "rounded", None)  # a read rounded as a store into it rounds
            if rounded is not None:
                value = stored(value, rounded).astype(_dtype(rounded))
            if ok is not True:
                value = np.where(ok, value, np.zeros((), value.dtype))
            return value
        assert isinstance(e, Apply)
        args = [self.expr(x, compute, iters) for x in e.args]
        return self.apply(e.op, compute, args)

    def apply(self, op: str, compute: np.dtype, args: list[np.ndarray]) -> np.ndarray:
        if op == "max":
            return _select_max(*args)
        if op == "min":
            return _select_min(*args)
        if op == "where":
            return np.where(args[0] != 0, *_unified(*args[1:]))
        if op in self.ops:
            result = self.ops[op](*args)
        else:
            with np.errstate(all="ignore"):
                result = reference(op, *args)
        result = np.asarray(result)
        if op in _COMPUTE_RESULT:
            return result.astype(compute)
        want = np.result_type(*args)
        if result.dtype != want:  # a reference that computed in f64 (erf)
            raise AssertionError(f"op {op}: reference gave {result.dtype} for {want} operands")
        return result


def tf32(x: np.ndarray) -> np.ndarray:
    """f32 values rounded to TF32's 10 bits of mantissa (nearest, ties to even), kept in f32;
    NaN and infinities as they are."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    finite = np.isfinite(np.asarray(x, np.float32))
    return np.where(finite, rounded.astype(np.uint32).view(np.float32), x).astype(np.float32)


def gemm_matrix(flat: np.ndarray, v: MatrixView, offset: int) -> np.ndarray:
    """The view's ``rows x cols`` matrix at ``offset`` in the node's flat values."""
    r = np.arange(v.rows)[:, None]
    c = np.arange(v.cols)[None, :]
    return flat[offset + (c * v.ld + r if v.transposed else r * v.ld + c)]


def ulp_distance(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """How many representable values of their (shared) precision lie between ``got`` and
    ``want``, elementwise: 0 where equal or both NaN, a huge number where one only is NaN."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype:
        raise ValueError(f"ulp_distance: {got.dtype} against {want.dtype}")
    bits = {2: np.int16, 4: np.int32, 8: np.int64}[got.dtype.itemsize]
    wide = np.int64

    def ordered(x: np.ndarray) -> np.ndarray:
        i = x.view(bits).astype(wide)
        top = np.array(1, wide) << (8 * x.dtype.itemsize - 1)
        # sign-magnitude to a monotone integer line, -0 one step below +0
        return np.where(i < 0, -(i + top) - 1, i)

    with np.errstate(invalid="ignore"):
        gn, wn = np.isnan(got.astype(np.float64)), np.isnan(want.astype(np.float64))
    d = np.abs(ordered(got) - ordered(want))
    d = np.where(gn & wn, 0, d)
    return np.where(gn ^ wn, np.iinfo(wide).max, d)

