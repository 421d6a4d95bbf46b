"""Scheduling: the choices lowering makes from the backend's :class:`~ocannl.ir.target.Target`.

:func:`~ocannl.ir.lowering.lower` first turns assignments into fills, loop groups and
products that mean the same on every backend; :func:`schedule` then decides, from the target
record alone, everything a renderer would otherwise decide for itself, and writes it into the
items:

- **Placements.** A cast twin placed ``"auto"`` is *kept* between steps in a node of its own,
  written in the pass that writes its master, read in place of casting it
  (:mod:`ocannl.ir.kept`). A node is *virtual* when every read of it can compute it instead (a cast
  twin of a master that nothing writes while the twin is read; a 16-bit product result read
  only by the next item's pointwise nests): its copy is dropped and each read becomes a read of
  its source rounded to its precision (``Get.rounded``). A node in ``LoopGroup.registers`` is
  handed over in a register and never stored. Every other local node gets a slot in its
  routine's arena (``Context``), every other node is materialized.
- **Products.** Each :class:`Gemm`'s kernel (``"blas"``, or ``"inline"``: register-blocked,
  summing in the loops' order, its orientation and register block: ``Gemm.swapped``,
  ``Gemm.block``) and its operands' precisions: a 16-bit operand the library does
  not take as stored (``Target.native_products``) is read from an f32 copy, a node of its own
  made by a pointwise nest before the product; a 16-bit target is computed in an f32 node and
  rounded into it by a nest after the product (or read rounded by its readers: virtual).
- **Widened copies.** A reduction reading a 16-bit node many times over reads an f32 copy (on
  a CPU, so do im2col's f32 patches of a 16-bit node: a 16-bit gather loads a lane at a time); a
  scatter into a 16-bit node accumulates in an f32 copy rounded once at the end (a copy
  zeroed itself where the target was just zeroed: the rounding overwrites the target), or read
  rounded by the next pass where only it reads the target (never stored then). A copy is
  reused by later items until its source is written (a large one only by the next item). On a
  target without products of a 16-bit precision, a copy is made in the pass writing its
  source and read in the source's place from then on; a max-pool's 16-bit result, one of its
  terms a cell, is written into its copy directly (``selections_widened``).
- **Threads and vectors.** Which loops and products are shared over threads, by which extent
  and in how many chunks (on a GPU: which groups run a thread per cell, which a block per
  cell, and how a long reduction is cut over blocks); which reductions run several cells at
  once (``jam``) and as vectors of their cells (``lanes``), with which reads packed first
  and which loaded a vector of terms per cell and transposed (``transposed``: a row sum's);
  which pointwise groups walk their cells in one loop (``flat``), and which, walked point by
  point, have a short innermost loop vectorized whole (``inner_vector``).
- **Conversions, stores and launches** (:func:`rendering`). Which conversions keep a NaN's
  payload (a copy of a value that may be a signalling NaN: not of one arithmetic just
  computed), which 16-bit stores are exact (kept as computed where a register holds them),
  which sums may be reassociated, which vectors are stored whole, whether the library runs
  single-threaded, TF32 products; on a GPU, each kernel's blocks and threads and how a batched
  product's axes fold into strided calls.

Every copy is a plain assignment over a node of its own, so the arena planner is the only
memory planner, and a backend renders a copy as it renders any other nest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ocannl.ir.assignments import Accum, Affine, Apply, Const, Expr, Get, iterators_of, reads
from ocannl.ir.expr import rewrite_reads, walk
from ocannl.ir.kept import keep_twins
from ocannl.ir.lowered import (
    MAX_GROUP,
    AccessIndex,
    BatchAxis,
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    Lowered,
    MatrixView,
    access,
    copy_source,
    covers,
    loop_nest,
    nodes_of,
    renamed_item,
    renamed_reads,
)
from ocannl.ir.ops import OPS, Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode, Tnode


def schedule(code: list[Lowered], target: Target) -> list[Lowered]:
    """``code`` with every choice of the module docstring made for ``target``."""
    code = keep_twins(code, target)
    virtual = virtual_twins(code)
    code = _with_copies(code, target, virtual)
    code = _substitute(code, virtual)
    left = [n.name for n in nodes_of(code) if n.memory_mode is MemoryMode.virtual]
    if left:
        raise ValueError(f"{', '.join(left)}: placed 'virtual' (recomputed from its master at "
                         f"every read), but this code reads it without computing it: compile "
                         f"its cast with its readers, or place it 'auto' or 'materialized'")
    code = widened_in_place(copies_in_writers(code, target), target.native_products)
    code = selections_widened(code, target.native_products)
    code = in_registers(code)
    code = [_threaded(item, target) for item in code]
    return row_sums_in_writers(rendering(code, target), target)


# --- virtual nodes --------------------------------------------------------------------------


def virtual_twins(code: list[Lowered]) -> dict[int, Tnode]:
    """Local 16-bit nodes that are a rounded copy of a materialized wider node, cell for cell
    (a cast twin of its master), by node id, with that node: written once, and read only
    before anything writes the wider node again. Each read can round the wider node as the
    copy would, so the copy is neither run nor stored. A node marked ``MemoryMode.virtual``
    that is such a copy must be one: ``ValueError`` names it otherwise."""
    index = AccessIndex(code)
    writes = index.writers
    first: dict[int, tuple[int, Tnode, Tnode]] = {}  # id -> its item, the node, its source
    for k, item in enumerate(code):
        if isinstance(item, LoopGroup) and not item.lead.walk_rows:
            for nest in item.nests:
                lhs, src = nest.assign.lhs, copy_source(nest)
                if (src is not None and lhs.memory_mode in (MemoryMode.local, MemoryMode.virtual)
                        and lhs.prec.is_narrow and not src.prec.is_narrow
                        and src.memory_mode is MemoryMode.materialized):
                    first.setdefault(lhs.id, (k, lhs, src))
    out: dict[int, Tnode] = {}
    for i, (k, node, src) in first.items():
        end = index.readers[i][-1] if i in index.readers else k
        if writes[i] == [k] and not any(k <= w <= end for w in writes.get(src.id, [])):
            out[i] = src
        elif node.memory_mode is MemoryMode.virtual:
            raise ValueError(
                f"{node.name} is placed 'virtual' (recomputed from {src.name} at every read), "
                f"but {src.name} is written between its copy and a read of it, or it is "
                f"written twice: place it 'auto' or 'materialized'")
    return out


def _substitute(code: list[Lowered], virtual: dict[int, Tnode]) -> list[Lowered]:
    """Drop the copies into virtual nodes and let their readers read the source, rounded."""
    if not virtual:
        return code
    out: list[Lowered] = []
    for item in code:
        if isinstance(item, LoopGroup):
            kept = tuple(replace(n, assign=replace(n.assign, expr=_rounded_reads(
                n.assign.expr, virtual))) for n in item.nests if n.assign.lhs.id not in virtual)
            if not kept:
                continue
            item = replace(item, nests=kept)
        elif isinstance(item, Gemm):  # its 16-bit operands were given copies already
            assert item.a.node.id not in virtual and item.b.node.id not in virtual
        out.append(item)
    return out


def _rounded_reads(e: Expr, sources: dict[int, Tnode]) -> Expr:
    """``e`` reading ``sources[i]`` rounded to the precision of the node of id ``i`` wherever
    it read that node (a virtual node's source, a forwarded product's f32 result)."""
    def read(g: Get) -> Get:
        src = sources.get(g.node.id)
        return g if src is None else Get(src, g.idx, rounded=g.node.prec)

    return rewrite_reads(e, read)


def forwarded(code: list[Lowered]) -> set[int]:
    """Local 16-bit targets of products (with reset) that only pointwise nests of the next item
    read: those nests read the product's f32 result rounded as a store would round it, so the
    target is never stored (a cast twin's gradient flowing into its master's)."""
    index = AccessIndex(code)
    out: set[int] = set()
    for k, item in enumerate(code):
        if not isinstance(item, Gemm):
            continue
        lhs = item.assign.lhs
        # read by the next item only: the f32 result is held no longer
        if (item.assign.reset and lhs.prec.is_narrow and index.writers[lhs.id] == [k]
                and read_pointwise_next(code, index, k, lhs)):
            out.add(lhs.id)
    return out


# --- copies made where their source is written ------------------------------------------------


def copies_in_writers(code: list[Lowered], target: Target) -> list[Lowered]:
    """Move each copy of scheduling's own (an f32 copy of a 16-bit node for a product) into the
    loop group that writes its source, as a nest beside the one writing it: the copy is made in
    the pass that computes the values, from the value just stored, not by a pass of its own
    reading them again (a layer's bf16 activations and their f32 copy for the next product, in
    one pass). Only where the source is written whole, point by point, by that group, and
    nothing between the group and the copy writes the source or touches the copy.

    A large copy (``FRESH_COPY``) moves only from the item right before it, so it is held no
    longer than before, unless it is the f32 copy of a 16-bit node the target has no products
    of: that copy then becomes the node's storage (:func:`widened_in_place`), and moving it
    from the pass writing the node saves every later widening of the node (the trade of bytes
    held for passes is that function's). A source then read by nothing but its copy is handed
    over in a register (:func:`in_registers`)."""
    out: list[Lowered] = []
    for item in code:
        moved = _copy_into_writer(item, out, target)
        if not moved:
            out.append(item)
    return out


def _copy_into_writer(item: Lowered, out: list[Lowered], target: Target) -> bool:
    """Whether ``item``, a copy group, went into the group of ``out`` writing its source."""
    if not (isinstance(item, LoopGroup) and item.conversion and len(item.nests) == 1):
        return False
    copy = item.nests[0]
    src, dst = copy_source(copy), copy.assign.lhs
    if src is None or dst.memory_mode is not MemoryMode.local:
        return False
    held = (dst.size < FRESH_COPY or (src.prec.is_narrow and dst.prec is Precision.f32
                                      and src.prec not in target.native_products))
    for j in range(len(out) - 1, -1, -1):
        acc = access(out[j])
        if dst.id in acc.touched:
            return False
        if src.id not in acc.writes:
            continue
        writer = out[j]
        if not isinstance(writer, LoopGroup) or len(writer.nests) >= MAX_GROUP \
                or writer.lead.walk_rows or (not held and j < len(out) - 1):
            return False
        at = [k for k, n in enumerate(writer.nests) if n.assign.lhs.id == src.id]
        n = writer.nests[at[-1]]
        a = n.assign
        if (len(at) != 1 or n.red or n.scatter or not covers(a)
                or not all(isinstance(i, int) for i in a.lhs_idx)):
            return False
        nest = LoopNest(Accum(dst, a.lhs_idx, "=", Get(src, a.lhs_idx), a.space), n.par, n.red)
        out[j] = replace(writer, nests=(*writer.nests, nest))
        return True
    return False


def widened_in_place(code: list[Lowered], native: frozenset[Precision] = frozenset()
                     ) -> list[Lowered]:
    """Where the pass writing a local 16-bit node also makes its f32 copy (a product reads the
    copy: a target without products of that precision), every later read of the node reads the
    copy instead, and every later copy of the node is that copy: the node's values, stored in
    f32 once, are widened once per step, not again for backprop's products and reductions.
    The 16-bit node, read then only in its own pass, is handed over in a register. Not for a
    precision of the target's ``native`` products: the library reads such a node as stored
    (an inline product's copy of it, made for that product, leaves it as it is).

    The trade: the f32 copy (4 bytes a cell) is held from the forward pass to backprop, where
    the 16-bit node (2) was; on a target with products of the node's precision there is no
    copy, and nothing changes. The values read are the same (an f32 copy of a 16-bit value is
    exact), so the bits are."""
    index = AccessIndex(code)
    wide: dict[int, tuple[int, Tnode]] = {}  # a 16-bit node's id -> its writer, its f32 copy
    twice: dict[int, Tnode] = {}  # a second copy in the same pass -> the first
    for k, item in enumerate(code):
        if not isinstance(item, LoopGroup):
            continue
        here = {n.assign.lhs.id for n in item.nests}
        for n in item.nests:
            src, dst = copy_source(n), n.assign.lhs
            if (src is not None and src.id in here and src.prec.is_narrow
                    and src.prec not in native and dst.prec is Precision.f32
                    and src.memory_mode is dst.memory_mode is MemoryMode.local
                    and index.writers[src.id] == [k] and index.writers[dst.id] == [k]):
                if src.id in wide:
                    twice[dst.id] = wide[src.id][1]
                else:
                    wide[src.id] = (k, dst)
    if not wide:
        return code
    out: list[Lowered] = []
    stands: dict[int, Tnode] = {}  # node id -> the f32 copy read in its place from here on
    for k, item in enumerate(code):
        if twice and isinstance(item, LoopGroup):
            nests = tuple(n for n in item.nests if n.assign.lhs.id not in twice)
            if len(nests) < len(item.nests):
                item = replace(item, nests=nests)
                stands.update((i, c) for i, c in twice.items() if i in index.items[k].writes)
        stands.update((i, c) for i, (j, c) in wide.items() if j == k - 1)
        again = _copied_again(item, stands)
        if again is not None:  # another copy of a widened node: the copy itself
            stands[again[1].id] = stands[again[0].id]
            continue
        out.append(renamed_item(item, stands) if stands else item)
    return out


def _copied_again(item: Lowered, stands: dict[int, Tnode]) -> tuple[Tnode, Tnode] | None:
    """The source and target where ``item`` is a copy group making another f32 copy of a node
    whose f32 copy ``stands`` in its place (:func:`widened_in_place`,
    :func:`selections_widened`), else None."""
    if not (stands and isinstance(item, LoopGroup) and item.conversion and len(item.nests) == 1):
        return None
    src, dst = copy_source(item.nests[0]), item.nests[0].assign.lhs
    return (src, dst) if src is not None and src.id in stands and dst.prec is Precision.f32 \
        else None


def selections_widened(code: list[Lowered], native: frozenset[Precision] = frozenset()
                       ) -> list[Lowered]:
    """Where a reduction that selects among its 16-bit terms (a max-pool: every value it stores
    is one of its precision's, ``representable``) writes a local 16-bit node and the next item
    is that node's f32 copy (a product or a gather reads it: a target without products of that
    precision), the reduction writes the copy and every later read of the node reads the copy,
    as :func:`widened_in_place` does for a pointwise pass: the same values (the f32 accumulator
    holds the 16-bit term it selected), one pass fewer, and the 16-bit node is never stored.
    The trade is that function's: the copy's 4 bytes a cell are held until the node's last
    read (backprop's tie mask), where the node's 2 were."""
    index = AccessIndex(code)
    widened = {k: dst for k in range(len(code) - 1)
               if (dst := _selection_copy(code, index, k, native)) is not None}
    if not widened:
        return code
    out: list[Lowered] = []
    stands: dict[int, Tnode] = {}  # a 16-bit node's id -> the f32 copy read in its place
    for k, item in enumerate(code):
        if k - 1 in widened:  # the copy the reduction now writes
            continue
        again = _copied_again(item, stands)
        if again is not None and again[1].memory_mode is MemoryMode.local \
                and index.writers[again[1].id] == [k]:  # another copy: the copy itself
            stands[again[1].id] = stands[again[0].id]
            continue
        item = renamed_item(item, stands) if stands else item
        if k in widened:
            n = item.nests[0]  # type: ignore[union-attr]
            stands[n.assign.lhs.id] = widened[k]
            item = replace(item, nests=(replace(n, assign=replace(n.assign, lhs=widened[k])),))
        out.append(item)
    return out


def _selection_copy(code: list[Lowered], index: AccessIndex, k: int,
                    native: frozenset[Precision]) -> Tnode | None:
    """The f32 copy item ``k + 1`` makes of the 16-bit node item ``k`` writes, where item ``k``
    is a reduction that selects among values of that precision (:func:`selections_widened`)."""
    item, after = code[k], code[k + 1]
    if not (isinstance(item, LoopGroup) and len(item.nests) == 1
            and isinstance(after, LoopGroup) and after.conversion and len(after.nests) == 1):
        return None
    n, copy = item.nests[0], after.nests[0]
    a, dst, src = n.assign, copy.assign.lhs, copy_source(copy)
    ok = (n.red and not n.scatter and not n.walk_rows and a.reset and a.accum in ("max", "min")
          and a.lhs.prec.is_narrow and a.lhs.prec not in native
          and a.lhs.memory_mode is MemoryMode.local and index.writers[a.lhs.id] == [k]
          and representable(a.expr, a.lhs.prec) and src is not None and src.id == a.lhs.id
          and dst.prec is Precision.f32 and dst.memory_mode is MemoryMode.local
          and index.writers[dst.id] == [k + 1])
    return dst if ok else None


# --- registers ----------------------------------------------------------------------------


def in_registers(code: list[Lowered]) -> list[Lowered]:
    """Mark the nodes each loop group may keep in registers (``LoopGroup.registers``): local
    (no host or other routine reads them), written once, by a pointwise nest that overwrites
    its cell, and read only inside the same group, by later pointwise nests at that cell. A
    chain of pointwise steps (softmax's gradient through its shift and mask) then stores only
    its last value."""
    users = AccessIndex(code).users  # a node no other item takes may stay in the group
    out: list[Lowered] = []
    for k, item in enumerate(code):
        if not isinstance(item, LoopGroup) or item.lead.walk_rows:
            out.append(item)
            continue
        write: dict[int, tuple[int, LoopNest]] = {}  # node id -> its one writing nest
        bad: set[int] = set()
        for j, nest in enumerate(item.nests):
            a = nest.assign
            pointwise = not nest.red and not nest.scatter
            if (a.lhs.id in write or not pointwise or not (a.accum == "=" or a.reset)
                    or a.lhs.memory_mode is not MemoryMode.local):
                bad.add(a.lhs.id)
            write[a.lhs.id] = (j, nest)
            for g in reads(a.expr):
                wrote = write.get(g.node.id)
                if not pointwise or wrote is None or wrote[0] >= j or \
                        g.idx != wrote[1].assign.lhs_idx:
                    bad.add(g.node.id)
        held = frozenset(i for i in write if i not in bad and users[i] == [k])
        out.append(replace(item, registers=held) if held else item)
    return out


# --- copies in another precision -----------------------------------------------------------

# A reduction reading each cell of a 16-bit node at least this many times reads an f32 copy.
REUSE = 4
# A copy of this many cells or more is reused only by the item that made or last read it and
# the next one (a product's conversions, the product and its rounding are one item). Kept
# longer, it would hold its memory from the forward pass to backprop (a weight's f32 copy,
# read by both), where the arena could otherwise share it: widening again costs one pass.
FRESH_COPY = 1 << 18


class _Copies:
    """The copies of nodes in another precision made so far, while they are current."""

    def __init__(self, virtual: dict[int, Tnode]) -> None:
        self.virtual = virtual
        self.current: dict[tuple[int, Precision], tuple[Tnode, int]] = {}  # -> copy, last use
        self.at = 0  # the item being scheduled

    def of(self, node: Tnode, prec: Precision, out: list[Lowered]) -> Tnode:
        """``node``'s values in ``prec``: a current copy, or a new one whose nest goes to
        ``out`` (a virtual node's copy rounds its source)."""
        key = (node.id, prec)
        held = self.current.get(key)
        if held is not None and not (node.size >= FRESH_COPY and self.at > held[1] + 1):
            self.current[key] = (held[0], self.at)
            return held[0]
        copy = Tnode(f"{node.label}_{prec.value}", node.dims, prec, memory_mode=MemoryMode.local)
        out.append(copy_group(copy, node, self.virtual.get(node.id)))
        self.current[key] = (copy, self.at)
        return copy

    def has(self, node: Tnode, prec: Precision) -> bool:
        held = self.current.get((node.id, prec))
        return held is not None and not (node.size >= FRESH_COPY and self.at > held[1] + 1)

    def written(self, ids: set[int]) -> None:
        for key in [k for k in self.current if k[0] in ids]:
            del self.current[key]


def copy_group(dst: Tnode, src: Tnode, source: Tnode | None = None) -> LoopGroup:
    """``dst = src`` cell for cell (``source``: ``src`` is virtual, its values those of
    ``source`` rounded to its precision)."""
    idx = tuple(range(len(src.dims)))
    read = Get(src, idx) if source is None else Get(source, idx, rounded=src.prec)
    return LoopGroup((loop_nest(Accum(dst, idx, "=", read, src.dims)),), conversion=True)


def _with_copies(code: list[Lowered], target: Target, virtual: dict[int, Tnode]
                 ) -> list[Lowered]:
    """The copies products, reductions and scatters read in another precision, as items of
    their own before (and roundings after) the items using them."""
    copies = _Copies(virtual)
    index = AccessIndex(code)
    direct = forwarded(code)
    out: list[Lowered] = []
    pending: dict[int, Tnode] = {}  # a forwarded target -> the f32 result its readers round
    for k, item in enumerate(code):
        copies.at = k
        if pending and isinstance(item, LoopGroup):
            item = _read_rounded(_into_reader(item, pending, out), pending)
        pending = {}
        if isinstance(item, Gemm):
            pending = _product(item, target, copies, direct, out)
        elif isinstance(item, LoopGroup):
            lead = item.lead
            sums = (not target.gpu_block and lead.gather and lead.assign.reset
                    and lead.assign.lhs.prec.is_narrow and len(item.nests) == 1
                    and _sums_forwarded(code, index, k))
            wide = _widened_reads(item, copies, out, gathers=target.gpu_block == 0, sums=sums)
            if wide is not None and (sums or _sums_forwarded(code, index, k)):
                out.pop()  # the rounding: the next item reads the f32 sums rounded
                pending = {item.lead.assign.lhs.id: wide}
        else:
            out.append(item)
        copies.written(index.items[k].writes)
    return out


def _into_reader(item: LoopGroup, pending: dict[int, Tnode], out: list[Lowered]) -> LoopGroup:
    """``item``, where its one reader of the forwarded product (``out[-1]``) is a nest that
    resets an f32 node ``G`` of the product's shape to the result rounded, cell for cell (a
    cast twin's gradient flowing into its master's): the product then writes ``G`` and the nest
    rounds ``G`` in place. The same values, without the f32 result's own buffer (a 1024 x 1024
    weight's gradient: 4 MiB less scratch)."""
    g = out[-1]
    if not isinstance(g, Gemm):  # a scatter's sums: read rounded where they are
        return item
    assert len(pending) == 1
    (target_id, wide), = pending.items()
    readers = [k for k, n in enumerate(item.nests)
               if any(r.node.id == target_id for r in reads(n.assign.expr))]
    if len(readers) != 1:
        return item
    k = readers[0]
    a = item.nests[k].assign
    read = a.expr
    if not (isinstance(read, Get) and read.rounded is None and read.idx == a.lhs_idx
            and a.reset and a.accum == "+" and a.lhs.prec is wide.prec
            and a.lhs.dims == wide.dims and a.lhs_idx == tuple(range(len(wide.dims)))
            and a.lhs.id not in (g.a.node.id, g.b.node.id)
            and not any(a.lhs.id in access(LoopGroup((n,))).touched for n in item.nests[:k])):
        return item
    del pending[target_id]
    out[-1] = replace(g, assign=replace(g.assign, lhs=a.lhs))
    nest = replace(item.nests[k], assign=replace(a, expr=Get(a.lhs, read.idx,
                                                             rounded=read.node.prec)))
    return replace(item, nests=(*item.nests[:k], nest, *item.nests[k + 1:]))


def _read_rounded(item: LoopGroup, results: dict[int, Tnode]) -> LoopGroup:
    """``item`` reading each forwarded target's f32 result, rounded to the target's precision."""
    return replace(item, nests=tuple(replace(n, assign=replace(n.assign, expr=_rounded_reads(
        n.assign.expr, results))) for n in item.nests))


def _product(g: Gemm, target: Target, copies: _Copies, direct: set[int], out: list[Lowered]
             ) -> dict[int, Tnode]:
    """The product, its kernel and thread split decided, with the copies it reads before it
    and the rounding of a 16-bit target after it; returns the forwarded target's f32 result
    (its readers in the next item read it rounded) or nothing."""
    lhs = g.assign.lhs
    compute = lhs.prec.compute
    along, extent = gemm_split(g, target.product_parts) if target.products_shared else (None, 0)
    kernel, swapped, block = inline_product(g, target)
    native = native_operands(g, kernel, target)

    def operand(v: MatrixView, right: bool) -> MatrixView:
        node = v.node
        if native:  # as stored; a virtual twin is stored once, rounded from its master
            return replace(v, node=copies.of(node, node.prec, out)) \
                if node.id in copies.virtual else v
        if node.prec is compute:
            return v
        if (right and kernel == "inline" and compute is Precision.f32
                and not copies.has(node, compute)
                and (node.prec is Precision.bf16
                     or (node.prec is Precision.f16 and target.hardware_f16))):
            # widened vector by vector as the inline product loads it (a virtual twin from a
            # 16-bit copy: half an f32 one's memory)
            return replace(v, node=copies.of(node, node.prec, out)) \
                if node.id in copies.virtual else v
        return replace(v, node=copies.of(node, compute, out))

    # the kernel's right operand may be read as stored; a swapped product's (a) is copied as
    # the library's operands are: its readers' copy serves them all
    a, b = operand(g.a, False), operand(g.b, not swapped)
    # The assignment names the nodes the product reads and writes, as its views do.
    renamed = {v.node.id: w.node for v, w in ((g.a, a), (g.b, b)) if w is not v}
    assign = replace(g.assign, expr=renamed_reads(g.assign.expr, renamed)) if renamed else g.assign
    decided = {"kernel": kernel, "swapped": swapped, "block": block, "split": along,
               "split_extent": extent}
    if not lhs.prec.is_narrow:
        out.append(replace(g, assign=assign, a=a, b=b, **decided))
        return {}
    if g.assign.reset:
        wide = Tnode(f"{lhs.label}_{compute.value}", lhs.dims, compute,
                     memory_mode=MemoryMode.local)
    else:  # accumulates: into a copy of the target
        wide = copies.of(lhs, compute, out)
    out.append(replace(g, assign=replace(assign, lhs=wide), a=a, b=b, **decided))
    if lhs.id in direct:
        return {lhs.id: wide}
    out.append(copy_group(lhs, wide))
    return {}


def read_pointwise_next(code: list[Lowered], index: AccessIndex, k: int, node: Tnode) -> bool:
    """Whether local ``node``, written by item ``k``, is read by no item but the next (item
    ``k`` itself aside: its accumulation), and there only by pointwise nests: those can read a
    wider value rounded in its place (:func:`forwarded`, :func:`_sums_forwarded`)."""
    if node.memory_mode is not MemoryMode.local or [
            r for r in index.readers.get(node.id, []) if r != k] != [k + 1]:
        return False
    reader = code[k + 1]
    return isinstance(reader, LoopGroup) and not any(
        (nest.red or nest.scatter) and any(g.node.id == node.id for g in reads(nest.assign.expr))
        for nest in reader.nests)


def _sums_forwarded(code: list[Lowered], index: AccessIndex, k: int) -> bool:
    """Whether the 16-bit target of item ``k``'s scatter (summed in an f32 copy) is written by
    nothing else but fills of zeros and read only by pointwise nests of the next item
    (:func:`read_pointwise_next`): those then read the f32 sums rounded as the rounding would
    store them, and the target is never stored (the relu mask's gradient behind a max-pool's:
    one pass fewer)."""
    lhs = code[k].lead.assign.lhs  # type: ignore[union-attr]
    return read_pointwise_next(code, index, k, lhs) and all(
        w == k or (isinstance(code[w], Fill) and code[w].value == 0.0)
        for w in index.writers[lhs.id])


def _widened_reads(item: LoopGroup, copies: _Copies, out: list[Lowered],
                   gathers: bool = False, sums: bool = False) -> Tnode | None:
    """``item`` appended to ``out``, a reduction's 16-bit reads it takes many times over from
    f32 copies made before it, a scatter into a 16-bit node into an f32 copy rounded back
    after it (the copy returned, its rounding the last of ``out``); with ``sums`` (a CPU's), a
    gather (writing every cell of its 16-bit target) too, into an f32 node its next pass reads
    rounded (:func:`_sums_forwarded`: the 16-bit target is then never stored, as a scatter's
    is not: a 2x2 pool's gradient, whose 16-bit node stood at the arena's peak beside the
    next pass's, 32 KiB more of convnet's bf16 scratch)."""
    lead = item.lead
    renamed: dict[int, Tnode] = {}
    for node in reused_narrow(lead, gathers):
        renamed[node.id] = copies.of(node, Precision.f32, out)
    lhs = lead.assign.lhs
    scatter = lead.scatter and lhs.prec.is_narrow and lead.assign.accum != "="
    wide = Tnode(f"{lhs.label}_f32", lhs.dims, Precision.f32, memory_mode=MemoryMode.local) \
        if sums or scatter else None
    if scatter and not sums:  # a scatter adds into the target: its f32 node starts from it
        zeroed = _last_zero_fill(lhs, out)
        if zeroed is None:
            out.append(copy_group(wide, lhs))
        else:  # the target's zeros, which the rounding after overwrites: zero the copy instead
            out.append(Fill(wide, out.pop(zeroed).value))
    if wide is not None:
        renamed[lhs.id] = wide
    if renamed:
        nests = []
        for n in item.nests:
            a = replace(n.assign, expr=renamed_reads(n.assign.expr, renamed))
            if wide is not None and a.lhs is lhs:
                a = replace(a, lhs=wide)
            nests.append(replace(n, assign=a))
        item = replace(item, nests=tuple(nests))
    out.append(item)
    if wide is not None:
        out.append(copy_group(lhs, wide))
    return wide


def _last_zero_fill(node: Tnode, out: list[Lowered]) -> int | None:
    """The position in ``out`` of a fill of ``node`` with zeros that no later item of ``out``
    reads or writes ``node`` after, or None."""
    for k in range(len(out) - 1, -1, -1):
        item = out[k]
        if isinstance(item, Fill) and item.node.id == node.id:
            return k if item.value == 0.0 else None
        if node.id in access(item).touched:
            return None
    return None


def reused_narrow(nest: LoopNest, gathers: bool = False) -> list[Tnode]:
    """The 16-bit nodes a reduction reads (not its target) at least ``REUSE`` times per cell
    on average: it reads their f32 copies. A read that stays on one cell while reduction
    iterators its index does not name run (a max-pool's output against its window) widens
    once for all of them: those points are not reuse. With ``gathers``, the windowed reads
    of a pointwise nest into a wider node too (im2col's f32 patches of a 16-bit node: each
    cell read once per window offset over it), for a target whose vectors cannot gather
    16-bit cells: a CPU's loads a lane at a time there, a widening each, against one gather
    instruction of f32 cells (16-bit patches of a 16-bit node copy as stored)."""
    windowed = gathers and not nest.red and not nest.assign.lhs.prec.is_narrow
    if not nest.red and not windowed:
        return []
    points = math.prod(nest.space)
    out: list[Tnode] = []
    for get in reads(nest.assign.expr):
        node = get.node
        if windowed and not any(isinstance(i, Affine) for i in get.idx):
            continue
        if node.prec.is_narrow and node is not nest.assign.lhs and node not in out:
            named = iterators_of(get.idx)
            steady = math.prod(nest.space[i] for i in nest.red if i not in named)
            if points >= REUSE * node.size * steady:
                out.append(node)
    return out


# --- products ---------------------------------------------------------------------------------

# A product is shared out over threads from this many multiply-adds on, by blocks of this many
# rows or columns (a multiple of the BLAS kernels' widths).
GEMM_SPLIT_FLOPS = 1 << 18
GEMM_BLOCK = 16


def gemm_split(g: Gemm, parts: int) -> tuple[str | None, int]:
    """How a product is shared, and into how many parts, each a library call of its own: by
    the first batch axis, a call per batch point; else into ``parts`` parts of whole blocks of
    ``GEMM_BLOCK`` rows when it has more rows than columns (each part then packs all of ``b``
    again, the smaller operand), else of its columns, each part at least ``GEMM_SPLIT_FLOPS``
    multiply-adds (a convnet's small products cut in 8 ran 1.1-1.4x slower than in 2). The
    parts depend on the shape and the target (``Target.product_parts``), not on how many
    threads run them: the same calls, hence the same bits, on one thread or many."""
    work = g.rows * g.cols * g.inner * math.prod(axis.size for axis in g.batch)
    if work < GEMM_SPLIT_FLOPS:
        return None, 0
    if g.batch:
        return ("batch", g.batch[0].size) if g.batch[0].size > 1 else (None, 0)
    along, size = ("rows", g.rows) if g.rows > g.cols else ("cols", g.cols)
    count = min(parts, -(-size // GEMM_BLOCK), work // GEMM_SPLIT_FLOPS)
    return (along, count) if count > 1 else (None, 0)


def product_kernel(g: Gemm, target: Target) -> str:
    """``"inline"`` (in registers, summing in the loops' order) for a product that fits
    (:func:`inline_fits`, as it is or swapped) and is not cut into parts by rows or columns,
    else ``"blas"``."""
    return inline_product(g, target)[0]


def inline_product(g: Gemm, target: Target) -> tuple[str, bool, tuple[int, int]]:
    """The product's kernel, whether the inline kernel computes it swapped (``Gemm.swapped``:
    tried where it does not fit as it is) and its register block (``Gemm.block``)."""
    along = gemm_split(g, target.product_parts)[0] if target.products_shared else None
    if along in ("rows", "cols"):
        return "blas", False, (0, 0)
    compute = g.assign.lhs.prec.compute
    native = native_operands(g, "blas", target)
    for swapped in (False, True):
        if inline_fits(g, compute, target, native=native, swapped=swapped):
            return "inline", swapped, inline_block(g, compute, target, swapped)
    return "blas", False, (0, 0)


def native_operands(g: Gemm, kernel: str, target: Target) -> bool:
    """Whether the library multiplies ``g``'s operands as stored: both in the same 16-bit
    precision of ``Target.native_products``, accumulating into an f32 result, by the library
    (inline products widen their own loads). A 16-bit operand beside an f32 one is widened:
    narrowing the f32 one instead would change the product's values."""
    prec = g.a.node.prec
    return (kernel == "blas" and prec.is_narrow and g.b.node.prec is prec
            and prec in target.native_products and g.assign.lhs.prec.compute is Precision.f32)


# An inline product's register block: this many output rows by one vector of columns. A
# product whose whole output fits in HELD_REGISTERS of the target's vectors is one block,
# computed inline whatever its inner length: one pass over its terms, where a library call on
# so small an output spends more than its arithmetic (a convolution's first kernel gradient,
# 8 x 9 cells of 4,096 terms each: 19 us through OpenBLAS's sgemm). Larger blocks for the
# others were slower (gpt_mini's attention products, 10 rows a block: its f32 step 1.03x).
INLINE_ROWS = 4
HELD_REGISTERS = 10


def inline_width(cols: int, compute: Precision, target: Target) -> int:
    """The columns of an inline product's vectors: the target's ``inline_vector_bytes`` of
    ``compute`` values, or the largest power of two under it, of at least 4, dividing
    ``cols``; 0 when none does."""
    w = target.inline_vector_bytes // compute.itemsize
    while w >= 4 and cols % w:
        w //= 2
    return w if w >= 4 else 0


def inline_block(g: Gemm, compute: Precision, target: Target, swapped: bool = False
                 ) -> tuple[int, int]:
    """The inline kernel's register block: output rows at a time by one vector of columns;
    the whole output where it fits in ``HELD_REGISTERS`` of the target's vectors, else
    ``INLINE_ROWS`` rows."""
    rows, cols = (g.cols, g.rows) if swapped else (g.rows, g.cols)
    w = inline_width(cols, compute, target)
    registers = -(-(w * compute.itemsize) // (target.vector_bits // 8))  # an accumulator's
    held = cols == w and rows * registers <= HELD_REGISTERS
    return (rows if held else min(rows, INLINE_ROWS)), w


def inline_fits(g: Gemm, compute: Precision, target: Target, native: bool = False,
                swapped: bool = False) -> bool:
    """Whether ``g`` (``swapped``: its transposed product, ``b^T @ a^T``) is computed inline,
    in registers: columns a whole number of vectors (:func:`inline_width`), a transposed right
    operand small enough to pack on the stack, and at most ``Target.inline_product_work``
    multiply-adds (``inline_native_work`` where the library would multiply its operands as
    stored: ``native``), or its whole output in one register block (:func:`inline_block`)
    on a target with inline products."""
    most = target.inline_native_work if native else target.inline_product_work
    rows, cols = (g.cols, g.rows) if swapped else (g.rows, g.cols)
    right = g.a if swapped else g.b
    packs = right.transposed != swapped  # stored cols x inner (a's rows are b^T's columns)
    block_rows, w = inline_block(g, compute, target, swapped)
    if not w or most == 0 or (packs and g.inner * cols > target.inline_pack_cells):
        return False
    return g.rows * g.cols * g.inner <= most or (block_rows == rows and w == cols)


# --- threads and vectors ----------------------------------------------------------------------

# A loop group shares its outermost loop out over threads from this many points (points
# times computing nests: ``computing``) on: with the pool's workers spinning between jobs,
# an f32 exp over 4,096 points already ran faster on 2 threads; 16,384 leaves room for
# cheaper arithmetic and sleeping workers (benchmarks/OBSTACLES.md).
PARALLEL_POINTS = 1 << 14
# A shared loop is cut into this many chunks per thread, which the threads claim in turn.
CHUNKS_PER_THREAD = 4
# A flat group of vector arithmetic only (its ops run in lanes: no libm call) streams memory
# at a few cells per nanosecond: shared over threads from this many cells on, where each
# thread's share outweighs handing it out.
FLAT_PARALLEL_CELLS = 1 << 17
# A row walk with no other parallel iterator (a bias's gradient, a checksum's partial sums) is
# shared over threads by blocks of this many cells of its row, when it has at least
# ROW_BLOCKS_MIN of them (benchmarks/OBSTACLES.md).
ROW_BLOCK, ROW_BLOCKS_MIN = 64, 4
# A lone reduction of at least JAM_TERMS terms per cell runs JAM_WIDTH cells at once (or
# half, or a quarter, whichever divides its last parallel iterator).
JAM_WIDTH, JAM_TERMS = 8, 8
# At most this many cells of a read are packed for the lanes (a stack array each).
PACK_LANES = 1 << 12
# A row walk over a padded read, of at most this many cells, runs as jammed vectors of its
# cells instead (``jam``).
SHORT_ROW = 32
# A pointwise group walked point by point whose innermost loop runs over 4 to this many cells
# (a power of two) is vectorized at that width (``short_inner``): LLVM unrolls so short a loop
# whole before its loop vectorizer sees it, and leaves scalar code.
SHORT_INNER = 16
# A padded copy's runs of contiguous cells are copied as runs from this many cells on
# (``copy_run``).
RUN_MIN_CELLS = 8


def _threaded(item: Lowered, target: Target) -> Lowered:
    if not isinstance(item, LoopGroup):
        return item
    if target.gpu_block:
        return gpu_threads(item, target)
    if walks_cells(item):
        size = math.prod(item.lead.space)
        cheap = all(OPS[e.op].lanes for n in item.nests for e in applies(n.assign.expr))
        least = FLAT_PARALLEL_CELLS if cheap else PARALLEL_POINTS
        split = size if target.threads > 1 and size * computing(item) >= least else None
        return replace(item, flat=True, split=split, chunks=CHUNKS_PER_THREAD if split else 0)
    width = jam(item)
    reads_in_lanes = lanes(item.lead, width, target) if width else None
    if item.lead.walk_rows:
        if reads_in_lanes is None:  # a row walk it stays
            width = 0
        else:  # a short row: its cells in vectors, each taking its terms as the walk would
            item = replace(item, nests=(replace(item.lead, walk_rows=False),))
    split = group_split(item, target) if target.threads > 1 else None
    packed, transposed = reads_in_lanes or ((), ())
    run = 0 if width else copy_run(item)
    return replace(item, split=split, chunks=CHUNKS_PER_THREAD if split else 0, jam=width,
                   lanes=reads_in_lanes is not None, packed=packed, transposed=transposed,
                   inner_vector=0 if width or run else short_inner(item), run=run)


def copy_run(item: LoopGroup) -> int:
    """How many of a padded copy's last parallel iterators walk one run of cells, contiguous
    in its target and in its read alike (im2col's patches: a window row's offsets and
    channels, ``kw`` and ``c``, copied from one image row), where the padding cuts each run
    into zeros, a read and zeros (only the run's first iterator moves an index that may leave
    its node, by +1 a step); 0 where there is no such run (``LoopGroup.run``). Point by point
    the padded read is a guarded load at every cell, which LLVM vectorizes, if at all, into
    gathers and scatters across the runs: measured on an AMD EPYC (Zen 5), one thread, a
    convnet's patches of a 64 x 8 x 8 x 1 image and of its 64 x 4 x 4 x 8 pooled maps, 3 x 3,
    padding 1: 16.7 and 12.6 us point by point (a C compiler's loops, 8.5 and 9.9), against
    4.6 and 2.6 us as runs (the same C, each run as a masked copy). A run of fewer than
    ``RUN_MIN_CELLS`` cells stays point by point: its three stretches cost more than its cells
    (the 1-channel image's runs of 3: 16.7 -> 19.4 us here). The values copied are the
    point-by-point nest's, so are the bits."""
    if len(item.nests) != 1:
        return 0
    nest = item.lead
    a = nest.assign
    get = a.expr
    if (nest.red or nest.scatter or nest.walk_rows or a.accum != "=" or not isinstance(get, Get)
            or get.rounded is not None or not padded(nest) or len(nest.par) < 2
            or not all(isinstance(i, int) for i in a.lhs_idx)
            or not all(isinstance(i, int | Affine) for i in get.idx)):
        return 0
    best = 0
    for m in range(1, len(nest.par)):
        run = nest.par[-m:]
        if not (_mixed_radix(a.lhs, a.lhs_idx, run, a.space)
                and _mixed_radix(get.node, get.idx, run, a.space)):
            break
        moving = [i for i in get.idx if isinstance(i, Affine)
                  and any(c and t in run for c, t in i.terms)]
        if not moving or (len(moving) == 1 and all(
                c == 1 if t == run[0] else not (c and t in run) for c, t in moving[0].terms)):
            best = m
    return best if best and math.prod(a.space[i] for i in nest.par[-best:]) >= RUN_MIN_CELLS \
        else 0


def _mixed_radix(node: Tnode, idx: tuple, run: tuple[int, ...], space: tuple[int, ...]) -> bool:
    """Whether ``node[idx]`` steps through memory as the cells of ``run`` count in row-major
    order (each iterator's step the product of the later ones' extents)."""
    def terms(i: int | Affine) -> list[tuple[int, int]]:  # (coefficient, iterator)
        return [(1, i)] if isinstance(i, int) else list(i.terms)

    want = 1
    for it in reversed(run):
        step = sum(st * c for i, st, dim in zip(idx, node.strides, node.dims, strict=True)
                   if dim > 1 for c, t in terms(i) if t == it)
        if space[it] > 1 and step != want:
            return False
        want *= space[it]
    return True


def short_inner(item: LoopGroup) -> int:
    """The width to vectorize a pointwise group's innermost loop at, walked point by point (not
    ``flat``: a read is broadcast along some axis, a bias over a convolution's channels), or 0.
    Its extent must be a power of two from 4 to ``SHORT_INNER``, every access contiguous along
    it or the same cell for all of it, every op one that :func:`vectorizes`: the vector loop
    then does each cell's scalar operations, the same bits (measured: a convnet's bias and
    ReLU over 8 channels, f16 on a CPU without f16 arithmetic, 13.6 -> 4.5 us)."""
    lead = item.lead
    if len(lead.par) < 2:
        return 0
    it = lead.par[-1]
    for n in item.nests:
        if n.red or n.scatter or n.walk_rows or n.space != lead.space or n.par != lead.par:
            return 0
    return vector_width(item.nests, it, lead.space[it])


def vector_width(nests: Sequence[LoopNest], it: int, extent: int) -> int:
    """``extent``, where a loop over iterator ``it`` of ``extent`` cells running ``nests``
    vectorizes whole with each cell's scalar bits: a power of two from 4 to ``SHORT_INNER``,
    every access contiguous along ``it`` or the same cell for all of it, every op one that
    :func:`vectorizes`; else 0."""
    if not 4 <= extent <= SHORT_INNER or extent & (extent - 1):
        return 0
    for n in nests:
        a = n.assign
        if not all(vectorizes(e.op) for e in applies(a.expr)):
            return 0
        for g in (Get(a.lhs, a.lhs_idx), *reads(a.expr)):
            if any(isinstance(i, Affine) and any(t == it and c for c, t in i.terms)
                   for i in g.idx) or read_stride(g, it) not in (0, 1):
                return 0
    return extent


# Ops whose scalar code is a few plain instructions (a division, a square root, a comparison's
# select, a sign flip) that a loop vectorizer widens lane by lane, each lane the scalar's bits,
# beyond those that run in lanes (``Op.lanes``, the cheap ones): no libm call.
PLAIN_OPS = frozenset({"div", "sqrt", "neg", "abs", "where"})


def vectorizes(op: str) -> bool:
    """Whether a loop vectorizer computes ``op`` lane by lane with the scalar's bits (the
    width :func:`short_inner` and :func:`row_vector` give a loop)."""
    o = OPS[op]
    return o.lanes or o.flag or op in PLAIN_OPS


def applies(e: Expr) -> list[Apply]:
    """Every op application in ``e``, in pre-order."""
    return [x for x in walk(e) if isinstance(x, Apply)]


def walks_cells(item: LoopGroup) -> bool:
    """Whether every nest of the group is pointwise over the same space and reads and writes
    every node at the point's own cell (the identity projection over a node of the space's
    dims): the group is then one loop over the cells. Nested loops of short extents (a 16-cell
    row) are unrolled by LLVM before its loop vectorizer sees them, leaving scalar code; one
    loop over the cells vectorizes."""
    space = item.lead.space
    ident = tuple(range(len(space)))

    def own_cell(node: Tnode, idx: tuple) -> bool:
        return node.dims == space and tuple(idx) == ident

    return all(
        not n.red and n.space == space and own_cell(n.assign.lhs, n.assign.lhs_idx)
        and all(own_cell(g.node, g.idx) for g in reads(n.assign.expr)) for n in item.nests)


def computing(item: LoopGroup) -> int:
    """The nests of a group that compute (at least one): a nest whose value is one read (a
    copy, a cast, a 16-bit twin rounded from the master the group just updated) adds a load
    and a store to its pass, not arithmetic. Sharing a group over threads weighs its work
    against handing it out: counted as the f32 step's own group, a 16-bit twin riding in an
    optimizer's pass does not tip a small update over the threshold (convnet's 4,096-weight
    Adam update ran 1.0 us slower shared, its twin's store all it added)."""
    return max(1, sum(1 for n in item.nests if not isinstance(n.assign.expr, Get)))


def group_split(item: LoopGroup, target: Target) -> int | None:
    """The extent of the outermost loop a loop group shares out over threads, or None.
    Distinct iterations of it write distinct cells and read nothing another writes (the group
    is pointwise, or a reduction over its inner iterators), so each thread computes its cells
    as one would, bit for bit. A scatter's cells move with its reductions: it is shared only
    by its first parallel iterator, where that is its target's first axis and the scatter
    reads no other cell of its target, so each thread's points write a block of the target's
    own (a max pool's gradient, batch point by batch point)."""
    lead = item.lead
    if math.prod(lead.space) * computing(item) < PARALLEL_POINTS:
        return None
    if lead.scatter:
        a = lead.assign
        if (not target.parallel_scatters or len(item.nests) > 1 or not lead.par
                or a.lhs_idx[0] != lead.par[0]
                or any(g.node.id == a.lhs.id for g in reads(a.expr))):
            return None
        extent = lead.space[lead.par[0]]
        return extent if extent > 1 else None
    if lead.walk_rows and len(lead.par) == 1:  # a lone row: shared by blocks of its cells
        blocks = -(-lead.space[lead.par[0]] // ROW_BLOCK)
        return blocks if blocks >= ROW_BLOCKS_MIN else None
    outer = lead.par[:-1] if lead.walk_rows else lead.par
    if not outer:
        return None
    extent = lead.space[outer[0]]
    return extent if extent > 1 else None


def jam(g: LoopGroup) -> int:
    """How many cells of a lone reduction (not a scatter or an overwrite) to compute at once;
    0: one at a time. Its last parallel iterator must not be its first (a thread's range is of
    the first). A row walk over a padded read, its row of at most ``SHORT_ROW`` cells, may be
    jammed too, where its reads run in lanes (``_threaded``): a vector of the row's cells is
    the walk's row of accumulators in registers (a convolution's output channels, the patch
    gradients summed back into an image's), where the walk checks the padding cell by cell
    and stays scalar. An unpadded row walk vectorizes as it is (a bias's gradient)."""
    if len(g.nests) != 1:
        return 0
    nest = g.lead
    if ((nest.walk_rows and (nest.space[nest.par[-1]] > SHORT_ROW or not padded(nest)))
            or nest.scatter
            or not nest.red or len(nest.par) < 2
            or nest.assign.accum not in ("+", "max")
            or math.prod(nest.space[i] for i in nest.red) < JAM_TERMS):
        return 0
    extent = nest.space[nest.par[-1]]
    for width in (JAM_WIDTH, JAM_WIDTH // 2, JAM_WIDTH // 4):
        if width > 1 and extent % width == 0:
            return width
    return 0


def padded(nest: LoopNest) -> bool:
    """Whether a read of ``nest`` may fall outside its node (zero padding: a convolution's
    borders), which the code checks point by point."""
    space = nest.assign.space
    return any(isinstance(i, Affine) and any(i.outside(space, dim))
               for g in reads(nest.assign.expr) for i, dim in zip(g.idx, g.node.dims, strict=True))


def read_stride(get: Get, it: int) -> int:
    """How far apart in memory ``get`` reads for consecutive values of iterator ``it``."""
    node = get.node
    return sum(st for i, st, dim in zip(get.idx, node.strides, node.dims, strict=True)
               if i == it and not isinstance(i, Affine) and dim > 1)


def _in_lanes(e: Expr, compute: Precision, last: int, target: Target) -> bool:
    """Whether a jammed reduction's term can be computed for its cells as one vector, lane by
    lane (the scalar's operations, so the same bits): ops whose row says they run in lanes
    (``Op.lanes``), reads of ``compute`` values
    (16-bit ones where they widen in a few instructions: bf16's a shift, f16's one conversion
    where the CPU has it), padding that does not move with ``last`` (the jammed iterator)."""
    def read_in_lanes(g: Get) -> bool:
        prec = g.node.prec
        widens = prec is Precision.bf16 or (prec is Precision.f16 and target.hardware_f16)
        stored = Precision.f32 if widens else prec
        return (stored is compute and g.rounded is None
                and not any(isinstance(i, Affine) and any(it == last and c for c, it in i.terms)
                            for i in g.idx))

    return all(OPS[x.op].lanes if isinstance(x, Apply) else
               read_in_lanes(x) if isinstance(x, Get) else True for x in walk(e))


def lanes(nest: LoopNest, width: int, target: Target
          ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Whether the jammed reduction runs as a vector of its cells (``_in_lanes``): None if
    not, else two tuples of reads (their positions in ``reads`` order) striding across the
    cells: those that depend on nothing but the jammed iterator and the reduction's (a
    convolution's kernel, channels apart), to be packed first into stack arrays so the loops
    over the other parallel iterators load them as vectors; and those contiguous along the
    reduction's one iterator (a row sum's rows, ``transposable``), loaded ``width`` terms of
    each cell at a time and transposed in registers. Another striding read is a vector made of
    its cells at every term: worth it for a max or a min, not for a sum
    (benchmarks/OBSTACLES.md)."""
    a = nest.assign
    compute = a.lhs.prec.compute
    last, red = nest.par[-1], list(nest.red)
    if not _in_lanes(a.expr, compute, last, target):
        return None
    terms = math.prod(nest.space[i] for i in red)
    packs, transposed, gathered = [], [], False
    for k, get in enumerate(reads(a.expr)):
        if read_stride(get, last) in (0, 1):
            continue
        moving = {i for i in get.idx if isinstance(i, int)} | {
            it for i in get.idx if isinstance(i, Affine) for c, it in i.terms if c}
        if moving <= {last, *red} and nest.space[last] * terms <= PACK_LANES:
            packs.append(k)
        elif transposable(get, nest, width):
            transposed.append(k)
        else:
            gathered = True
    if gathered and a.accum not in ("max", "min"):
        return None
    return tuple(packs), tuple(transposed)


def transposable(get: Get, nest: LoopNest, width: int) -> bool:
    """Whether a read striding across a jammed reduction's cells can be loaded ``width``
    terms of each cell at once (one vector load, widened as a whole) and transposed in
    registers into ``width`` vectors of the cells, one a term: the nest reduces over one
    iterator, a multiple of ``width`` long, along which the read is contiguous, with no
    padding. The cells' additions are those of the scalar jam, so the bits too. Measured on
    an AMD EPYC (Zen 5), one thread, 1024 rows of 128 cells, in-process A/B: a row sum f32
    15.6 -> 6.0 us, f16 49.5 -> 6.9 us (each term was a scalar conversion), bf16 30.8 ->
    8.8 us; a row dot product f32 31.4 -> 9.7 us, f16 78.4 -> 11.1 us."""
    if len(nest.red) != 1 or any(isinstance(i, Affine) for i in get.idx):
        return False
    r = nest.red[0]
    return nest.space[r] % width == 0 and read_stride(get, r) == 1


# --- a GPU's threads --------------------------------------------------------------------------

SERIAL_RED_MAX = 32  # a reduction this short runs serially in its thread
SERIAL_PAR_MIN = 1024  # ... as does one up to SERIAL_RED_WIDE long when this many cells
SERIAL_RED_WIDE = 256  # keep enough threads busy
PER_THREAD = 8  # a split reduction gives each thread at least this many terms
MAX_REDUCE_BLOCKS = 1024  # splitting stops once cells x splits reaches this many blocks


def gpu_threads(item: LoopGroup, target: Target) -> LoopGroup:
    """``item`` mapped onto a GPU's threads (``LoopGroup.mapping``). A scatter moves its target
    cell within a thread's reduction loop: serial, never split. A scatter's gather
    (``LoopNest.gather``: an input gradient) of more than SERIAL_RED_MAX terms a cell reduces
    in a thread per cell only where those threads fill the GPU's SMs (``Target.gpu_sms``),
    else in a block per cell: a thread per cell of a small convnet's input gradient leaves
    most SMs idle. (A shorter one stays a thread per cell: a block would idle.)"""
    lead = item.lead
    block = target.gpu_block
    if lead.scatter:
        return replace(item, mapping="serial")
    mapping = gpu_mapping(lead.par_size, lead.red_size, lead.assign.accum, bool(lead.red))
    if (mapping == "serial" and lead.gather and lead.red_size > SERIAL_RED_MAX
            and -(-lead.par_size // block) < target.gpu_sms):
        mapping = "reduce"
    if mapping != "reduce":
        return replace(item, mapping=mapping)
    splits, chunk = reduce_splits(lead.par_size, lead.red_size, block)
    return replace(item, mapping=mapping, reduce_splits=splits, reduce_chunk=chunk)


def gpu_mapping(par_size: int, red_size: int, accum: str, has_reduction: bool) -> str:
    """How a loop nest maps to a GPU's threads: ``"map"`` (one thread per written cell, no
    reduction), ``"serial"`` (one thread per cell, reducing in a loop) or ``"reduce"`` (a block
    per cell reducing in parallel).

    A serial reduction is the trap OCANNL's benchmarks fell into: one thread summing a whole
    gradient. It is used only where it is short, or moderate with many cells to spread over.
    ``=`` with a reduction keeps the serial order's last-write-wins meaning.
    """
    if not has_reduction:
        return "map"
    if accum == "=" or red_size <= SERIAL_RED_MAX:
        return "serial"
    if par_size >= SERIAL_PAR_MIN and red_size <= SERIAL_RED_WIDE:
        return "serial"
    return "reduce"


def reduce_splits(par_size: int, red_size: int, block: int) -> tuple[int, int]:
    """``(splits, chunk)``: into how many blocks of ``block`` threads each cell's reduction is
    cut, and how many terms each covers. One split means a single pass; more, a partial pass
    over ``par_size * splits`` blocks and a final pass combining the partials in order."""
    want = math.ceil(red_size / (block * PER_THREAD))
    room = max(1, MAX_REDUCE_BLOCKS // max(par_size, 1))
    splits = max(1, min(want, room))
    chunk = math.ceil(red_size / splits)
    return math.ceil(red_size / chunk), chunk


# --- conversions, stores and launches -----------------------------------------------------------


def rendering(code: list[Lowered], target: Target) -> list[Lowered]:
    """``code`` with the last choices a renderer would otherwise make from its own dataflow
    written into the items: how each nest converts and stores (``LoopNest.keeps_payload``,
    ``payload_rounds``, ``exact_store``, ``any_order``), whether a jammed reduction stores its
    vector whole (``LoopGroup.lane_store``), how products run (``Gemm.one_thread``,
    ``strided``, ``tf32``) and, on a GPU, every kernel's launch (``grid``, ``block``)."""
    only_products = products_only(code)
    shared = target.products_shared and any(
        isinstance(item, Gemm) and item.split is not None for item in code)
    computed: set[int] = set()  # nodes every cell of which the routine's arithmetic wrote last
    out: list[Lowered] = []
    for item in code:
        if isinstance(item, Fill):
            computed.add(item.node.id)
            if target.gpu_block:
                grid, block = gpu_launch(item.node.size, target)
                item = replace(item, grid=grid, block=block)
        elif isinstance(item, Gemm):
            (computed.add if covers(item.assign) else computed.discard)(item.assign.lhs.id)
            tf32 = target.tf32 and item.a.node.prec is item.b.node.prec is Precision.f32
            item = replace(item, one_thread=shared, tf32=tf32,
                           strided=batch_runs(item.batch) if target.gpu_block else ((), None))
        else:
            nests = _group_conversions(item, only_products, computed)
            item = replace(item, nests=nests, lane_store=item.lanes and lane_store(
                nests[0], item.registers, target))
            if target.gpu_block:
                item = replace(item, **_gpu_launch_of(item, target))
        out.append(item)
    return out


# --- a row sum in the pass writing what it sums --------------------------------------------


def row_sums_in_writers(code: list[Lowered], target: Target) -> list[Lowered]:
    """On a CPU, a lone row walk run on one thread (a bias's gradient) joins the pointwise
    group just before it that writes what it sums (the activation's gradient), as
    ``LoopGroup.row_sum``: one pass instead of two, the row's terms read as they are written.
    The same bits. Where that pass was shared over threads, only a row of at most
    ``SHORT_INNER`` cells (a vector's worth) joins it: such a row walk is a chain of dependent
    vector additions, bound by their latency, whose shadow holds the pass's work (convnet's
    first bias, 8 cells: the two items alone 1.6 us on two threads and 3.8 us, together 2.0
    us); a longer one is bound by its loads, and the pass keeps its threads (gpt_mini's
    128-cell rows: its f32 step 1.03-1.10x slower when they joined)."""
    if target.gpu_block:
        return code
    out: list[Lowered] = []
    for item in code:
        prev = out[-1] if out else None
        if isinstance(prev, LoopGroup) and isinstance(item, LoopGroup) and sums_row_of(prev,
                                                                                      item):
            fused = LoopGroup(prev.nests + item.nests, registers=prev.registers, row_sum=True)
            out[-1] = replace(fused, inner_vector=row_vector(fused))
            continue
        out.append(item)
    return out


def sums_row_of(heads: LoopGroup, walk: LoopGroup) -> bool:
    """Whether ``walk`` (a lone row walk, one thread) can run in ``heads``' pass: ``heads``
    pointwise over its space, its points in the walk's order (its reductions, then its row),
    ``walk`` reading what ``heads`` writes only at the point written, and ``heads`` touching
    nothing ``walk`` writes."""
    r = walk.lead
    if (len(walk.nests) != 1 or not r.walk_rows or len(r.par) != 1 or walk.split is not None
            or walk.jam or r.scatter or r.gather):
        return False
    if heads.row_sum or heads.jam or heads.run or heads.conversion:
        return False
    if heads.split is not None and r.space[r.par[0]] > SHORT_INNER:
        return False  # a longer row is bound by its loads: the pass keeps its threads
    order = r.red + r.par
    written: dict[int, Any] = {}
    for n in heads.nests:
        if n.red or n.scatter or n.walk_rows or n.gather or n.space != r.space or n.par != order:
            return False
        written[n.assign.lhs.id] = n.assign.lhs_idx
        if r.assign.lhs.id in {g.node.id for g in reads(n.assign.expr)} | {n.assign.lhs.id}:
            return False
    sums = [g for g in reads(r.assign.expr) if g.node.id in written]
    return bool(sums) and all(g.idx == written[g.node.id] for g in sums)


def row_vector(group: LoopGroup) -> int:
    """The width to vectorize a row-sum group's row loop at (``LoopGroup.inner_vector``), or
    0: :func:`vector_width` over every nest, the row walk's too."""
    walk = group.nests[-1]
    return vector_width(group.nests, walk.par[0], walk.space[walk.par[0]])


def products_only(code: list[Lowered]) -> frozenset[int]:
    """The local nodes of ``code`` that only products read (copies of their operands,
    im2col's patches): what a copy into one does to a signalling NaN's bits cannot show, as a
    product quiets it."""
    index = AccessIndex(code)

    def operand(k: int, node_id: int) -> bool:
        item = code[k]
        return (isinstance(item, Gemm) and node_id in (item.a.node.id, item.b.node.id)
                and (node_id != item.assign.lhs.id or item.assign.reset))

    return frozenset(n.id for n in nodes_of(code) if n.memory_mode is MemoryMode.local
                     and index.readers.get(n.id)
                     and all(operand(k, n.id) for k in index.readers[n.id]))


# Arithmetic whose result is never a signalling NaN (IEEE quiets one), unless the compiler folds
# it away: an operand 0 or +-1 may make it the other operand, bits and all (``x * 1``).
_QUIETING = frozenset({"add", "sub", "mul", "div", "sqrt"})


def quiet(e: Expr, known: Callable[[Get], bool]) -> bool:
    """Whether ``e``'s value is never a signalling NaN: arithmetic of ``_QUIETING`` on no
    identity constant, a flag, a constant, a pass-through op (``Op.selects``) of such values,
    or a read ``known`` vouches for. A copy of such a value keeps its payload with the plain
    conversions (only a signalling NaN's differs), so it needs no payload-keeping ones."""
    if isinstance(e, Const):
        return True
    if isinstance(e, Get):
        return known(e)
    op = OPS[e.op]
    if op.flag:
        return True
    if e.op in _QUIETING:
        return not any(isinstance(x, Const) and x.value in (0.0, 1.0, -1.0) for x in e.args)
    return op.selects is not None and all(quiet(e.args[k], known) for k in op.selects)


def _group_conversions(item: LoopGroup, only_products: frozenset[int], routine: set[int]
                       ) -> tuple[LoopNest, ...]:
    """``item``'s nests with their conversions decided; ``routine``, the nodes whose every cell
    the routine's arithmetic wrote last, is brought up to date past the group. A read is known
    quiet when its node is one of those, or, in a group of pointwise nests, when an earlier nest
    of the group wrote the cell it reads from a quiet value (the kept twin of a master the
    optimizer's update just wrote, or a product's result rounded)."""
    pointwise = not any(n.red or n.scatter for n in item.nests)
    here: dict[int, tuple[Any, tuple[int, ...]]] = {}  # node id -> the cell and space written
    calm: dict[int, bool] = {}  # node id -> every write of the group so far quiet
    whole: set[int] = set()  # nodes quiet before the group, or written whole by it
    space: tuple[int, ...] = ()

    def known(g: Get) -> bool:
        return (here.get(g.node.id) == (g.idx, space)
                or (g.node.id in routine and calm.get(g.node.id, True)))

    out = []
    for n in item.nests:
        a, space = n.assign, n.assign.space
        out.append(_conversions(n, item.conversion, only_products, known))
        # "+" and "max" keep the old value where nothing is added or nothing is larger
        ok = quiet(a.expr, known) and (a.accum == "=" or a.reset
                                       or known(Get(a.lhs, a.lhs_idx)))
        if pointwise and ok:
            here[a.lhs.id] = (a.lhs_idx, space)
        else:
            here.pop(a.lhs.id, None)
        calm[a.lhs.id] = ok and calm.get(a.lhs.id, True)
        if a.lhs.id in routine or covers(a):
            whole.add(a.lhs.id)
    for i, ok in calm.items():
        (routine.add if ok and i in whole else routine.discard)(i)
    return tuple(out)


def _conversions(nest: LoopNest, conversion: bool, only_products: frozenset[int],
                 known: Callable[[Get], bool]) -> LoopNest:
    """``nest`` with how it converts and stores decided (``LoopNest``'s fields say what each
    means). Only a nest that stores its expression's value as it is (nothing to reduce, or
    every point overwriting its cell) copies or stores exactly; a copy of a value that is never
    a signalling NaN (:func:`quiet`, ``known`` vouching for reads) converts plainly."""
    a = nest.assign
    overwrite = a.accum == "=" or a.reset
    stores_value = not nest.red or (a.accum == "=" and not nest.scatter)
    plain = a.lhs.id in only_products
    keeps = (stores_value and overwrite and isinstance(a.expr, Get) and not plain
             and not conversion and not known(a.expr))
    rounds = frozenset() if plain else frozenset(
        g.node.id for g in reads(a.expr)
        if g.rounded is not None and g.node.memory_mode is MemoryMode.materialized
        and not known(g))
    exact = (stores_value and a.lhs.prec.is_narrow
             and (a.lhs.prec is Precision.bf16 or not keeps)
             and (overwrite or a.accum in ("max", "min")) and representable(a.expr, a.lhs.prec))
    any_order = bool(nest.red) and a.accum == "+" and zero_or_nan(a.expr)
    return replace(nest, keeps_payload=keeps, payload_rounds=rounds, exact_store=exact,
                   any_order=any_order)


def representable(e: Expr, prec: Precision) -> bool:
    """Whether ``e``'s value is exactly representable in ``prec``: a constant that is, a read
    of a node of that precision (its loads widen it exactly, or round a wider node to it), a
    read rounded to it (``Get.rounded``), or ops that select among such values
    (``ops.representable``)."""
    if isinstance(e, Const):
        with np.errstate(over="ignore"):  # past f16's range: inf, not the constant
            return bool(np.isfinite(e.value)) and float(
                np.array(e.value, prec.numpy_dtype)) == e.value
    if isinstance(e, Get):
        return (e.rounded or e.node.prec) is prec
    assert isinstance(e, Apply)
    units = [(isinstance(a, Const) and a.value in (0.0, 1.0, -1.0))
             or (isinstance(a, Apply) and OPS[a.op].flag) for a in e.args]
    return OPS[e.op].representable([representable(a, prec) for a in e.args], units)


def zero_or_nan(e: Expr) -> bool:
    """Whether every value of ``e`` is +-0 or NaN (a product with a constant 0: the gradient
    checksum's terms). A sum of such terms from +0 is +0 or NaN in any order, so it needs no
    fixed order of additions."""
    return isinstance(e, Apply) and e.op == "mul" and any(
        isinstance(x, Const) and x.value == 0.0 for x in e.args)


def lane_store(nest: LoopNest, registers: frozenset[int], target: Target) -> bool:
    """Whether a jammed reduction's vector of cells is stored as one vector: it overwrites
    them, they lie side by side, nothing else stands in for the target (a register), and a
    16-bit target rounds in vectors (bf16's integer rounding, f16's conversion where the CPU
    has it)."""
    a = nest.assign
    lhs = a.lhs
    return (a.reset and read_stride(Get(lhs, a.lhs_idx), nest.par[-1]) == 1
            and lhs.id not in registers
            and (lhs.prec is not Precision.f16 or target.hardware_f16))


def batch_runs(batch: tuple[BatchAxis, ...]) -> tuple[tuple[BatchAxis, ...], BatchAxis | None]:
    """A product's batch axes as (outer axes looped over, the one axis each strided-batched call
    covers): size-1 axes dropped, each axis folded into the one after it where its strides are
    that axis' size times its strides in the output and both operands (so the two are one
    stride). None: no batch axis, a plain product."""
    axes = [x for x in batch if x.size > 1]
    merged: list[BatchAxis] = []
    for x in reversed(axes):
        if merged:
            y = merged[-1]
            if (x.out, x.a, x.b) == (y.size * y.out, y.size * y.a, y.size * y.b):
                merged[-1] = BatchAxis(x.size * y.size, y.out, y.a, y.b)
                continue
        merged.append(x)
    merged.reverse()
    if not merged:
        return (), None
    return tuple(merged[:-1]), merged[-1]


WARP = 32
MAX_GRID = 65535  # a GPU's grid-stride loops cover anything larger


def gpu_launch(n: int, target: Target) -> tuple[int, int]:
    """``(grid, block)`` for a grid-stride loop over ``n`` items: blocks of
    ``target.gpu_block`` threads, fewer (whole warps) where that gives a small map
    ``target.gpu_sms`` blocks (a 16,384-cell map in blocks of 256 threads would leave 68 of an
    H200's 132 SMs idle: a small convnet's pool gradient), at most :data:`MAX_GRID` blocks."""
    block = min(target.gpu_block, max(WARP, -(-n // WARP) * WARP))
    while block > WARP and -(-n // block) < target.gpu_sms:
        block -= WARP
    return min(MAX_GRID, max(1, -(-n // block))), block


def _gpu_launch_of(group: LoopGroup, target: Target) -> dict[str, int]:
    """A loop group's launch: a thread per cell in :func:`gpu_launch`'s blocks, or a block of
    ``target.gpu_block`` threads per cell (``"reduce"``; a split reduction's two passes take
    their grids from its splits)."""
    lead = group.lead
    if group.mapping == "reduce":
        return {"grid": min(lead.par_size * group.reduce_splits, MAX_GRID),
                "block": target.gpu_block}
    grid, block = gpu_launch(lead.par_size, target)
    return {"grid": grid, "block": block}
