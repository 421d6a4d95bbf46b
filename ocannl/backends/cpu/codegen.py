"""LLVM IR for a routine: its fills, loop groups and products as functions of its buffers.

A routine is one or more parts, ``void part(i64* table)``, run in order: ``table`` holds the
address of every node's flat buffer, in the order of ``nodes``. A part calls one function per
lowered item (a fill, a loop group, a product) with the buffers that item uses.
Going straight from the lowered code to LLVM IR, with nothing between, keeps the compile time a
small multiple of LLVM's own, linear in the size of the step.

This module renders what lowering and scheduling decided (``ocannl.ir.schedule``): which
product runs in BLAS and which inline, which copies in f32 exist (they are nodes of their
own), which loops are shared over threads and in how many chunks, which reductions run
several cells at once and as vectors, which values stay in registers. It decides none of it.

Arithmetic follows the usual C rules, the same as the CUDA backend's and NumPy's: an f32 value
meeting an f64 value is widened, literals take the nest's compute precision, and 16-bit storage
is widened to f32 on load and rounded once (nearest, ties to even) on store. Nothing is
reassociated or contracted, so results are bitwise those of the plain loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from llvmlite import ir

from ocannl.backends.cpu import pool, small_product, version
from ocannl.backends.cpu.scalar import (
    F16,
    F32,
    F64,
    I16,
    I32,
    I64,
    const_int,
    convert,
    f16_to_f32_hw,
    f16_to_f32_soft,
    f32_round_bf16,
    f32_to_bf16,
    f32_to_bf16_exact,
    f32_to_f16_hw,
    f32_to_f16_soft,
    like,
)
from ocannl.ir.assignments import (
    Affine,
    Apply,
    Const,
    Dynamic,
    Expr,
    Fixed,
    Get,
    Projection,
    reads,
)
from ocannl.ir.lowered import (
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    Lowered,
    MatrixView,
    accesses,
    item_nodes,
    nodes_of,
)
from ocannl.ir.ops import ACCUMS, OPS, Precision
from ocannl.ir.schedule import GEMM_BLOCK, ROW_BLOCK, read_stride
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode, Tnode

__all__ = ["GEMM16_SYMBOLS", "GEMM_SYMBOLS", "RoutineIR", "Target", "routine_ir",
           "shares_products", "signature"]

_VOID_P = ir.IntType(8).as_pointer()
_FLOAT = {Precision.f32: F32, Precision.f64: F64}
_ELEM = {Precision.f64: F64, Precision.f32: F32, Precision.f16: I16, Precision.bf16: I16}
# The BLAS routines, resolved by the JIT (``jit.py`` maps these names to the chosen BLAS's):
# by compute type, and the products of two 16-bit operands into f32 by their precision
# (``native_products.py``).
GEMM_SYMBOLS = {F32: "ocannl_sgemm", F64: "ocannl_dgemm"}
GEMM16_SYMBOLS = {Precision.bf16: "ocannl_gemm_bf16", Precision.f16: "ocannl_gemm_f16"}


class RoutineIR:
    """Builds the IR of one part of a routine, for ``target``."""

    def __init__(self, nodes: list[Tnode], target: Target,
                 for_gemms: frozenset[int] = frozenset()) -> None:
        self.module = ir.Module(name="ocannl")
        # Local nodes only products read (copies of their operands, im2col's patches): what a
        # copy into one does to a signalling NaN's bits cannot show, as a product quiets it.
        self.for_gemms = for_gemms
        self.hardware_f16 = target.hardware_f16
        self.avx = target.avx
        self.blas_int = ir.IntType(target.blas_int)
        self.inline_vector_bytes = target.inline_vector_bytes
        self.native_products = target.native_products
        self.nodes = nodes
        self.slots = {n.id: k for k, n in enumerate(nodes)}
        self.functions: dict[tuple[str, ir.Type], ir.Function] = {}
        # Each item: its function, its slots, (its extent when shared, chunks per thread).
        self.calls: list[tuple[ir.Function, list[int], tuple[int | None, int]]] = []
        # Whether the nest being emitted copies a value unchanged (a cast): only then does a
        # signalling NaN's bit pattern survive to the store, and the f16 conversions keep it
        # as NumPy does. Arithmetic quiets a NaN whatever the conversion did, so elsewhere the
        # plain instructions give the same bits.
        self.copying = False
        # Whether the nest being emitted writes a node only products read (``for_gemms``):
        # a rounded read there (``Get.rounded``) takes the plain conversions.
        self.plain_rounding = False
        # Whether the group being emitted is a conversion of scheduling's own
        # (``LoopGroup.conversion``): its copies take the plain instructions too.
        self.conversion = False
        # The group's nodes kept in registers, and their values at the point being emitted.
        self.registers: frozenset[int] = frozenset()
        self.held: dict[int, ir.Value] = {}
        self.cell: ir.Value | None = None  # the flat cell of a ``flat`` group
        # A jammed reduction's reads packed as vectors of its cells, by id.
        self.packed: dict[int, tuple[ir.Value, list[int], int]] = {}
        # Each item function's text (its name left out) -> the function: an item whose text an
        # earlier one of this part has is that one (``_same_item``); and the text of each
        # function kept, by name (the module's text is made of them, not made again).
        self.items_by_text: dict[str, ir.Function] = {}
        self.item_texts: dict[str, str] = {}
        self.jobs: dict[tuple[str, str], ir.Function] = {}  # (item, frame type) -> its job

    # --- plumbing ---------------------------------------------------------------------------


    @contextmanager
    def item(self, used: list[Tnode], split: int | None = None, per_thread: int = 1
             ) -> Iterator[None]:
        """Emit one lowered item as a function of its own, taking the buffers of ``used`` as
        ``noalias`` arguments: distinct nodes never share memory, and saying so
        spares LLVM run-time overlap checks (and a second, scalar copy of each vectorized
        loop). One small function per item keeps LLVM's work linear in the routine's size.
        ``split``: the item runs its outermost loop over a range given by two more arguments,
        so that threads can share it, in ``per_thread`` chunks per thread (see
        :meth:`finish`), as scheduling decided."""
        slots = list(dict.fromkeys(self.slots[n.id] for n in used))
        ranged = [I64, I64] if split else []
        ty = ir.FunctionType(ir.VoidType(), [*(_ELEM[self.nodes[k].prec].as_pointer()
                                               for k in slots), *ranged])
        self.fn = ir.Function(self.module, ty, name=f"item{len(self.calls)}")
        self.fn.linkage = "internal"
        self.fn.attributes.add("noinline")  # inlining would rebuild one huge function
        for arg in self.fn.args[:len(slots)]:
            arg.add_attribute("noalias")
        self.args = {k: self.fn.args[j] for j, k in enumerate(slots)}
        self.range = tuple(self.fn.args[-2:]) if split else None
        self.entry = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.b = ir.IRBuilder(self.fn.append_basic_block("start"))
        if self.avx:
            # BLAS kernels may return with the upper halves of the vector registers in use;
            # libm's scalar SSE code (erff, expf) then runs many times slower until they are
            # cleared (measured: gelu's gradient after a GEMM, 8 ms -> 100 ms).
            clear = self.module.globals.get("llvm.x86.avx.vzeroupper") or ir.Function(
                self.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.avx.vzeroupper")
            self.b.call(clear, [])
        yield
        self.entry.branch(self.fn.blocks[1])
        self.b.ret_void()
        self.calls.append((self._same_item(self.fn), slots, (split, per_thread)))

    def _same_item(self, fn: ir.Function) -> ir.Function:
        """``fn``, or the earlier item function of this part with the same text (its name
        aside), ``fn`` then dropped: the items of a stack's layers, or of their parameters'
        updates, are the same code over other buffers (the buffers are arguments), compiled
        once. The same text is the same code, so nothing else needs to agree."""
        text = str(fn)
        same = self.items_by_text.setdefault(text.replace(f'@"{fn.name}"', "@item", 1), fn)
        if same is fn:
            self.item_texts[fn.name] = text
        del self.module.globals[fn.name]  # in the module's text as ``item_texts``
        return same

    def buffer(self, node: Tnode) -> ir.Value:
        return self.args[self.slots[node.id]]

    def local(self, ty: ir.Type) -> ir.Value:
        """A stack slot in the entry block (LLVM promotes it to a register)."""
        return self.entry.alloca(ty)

    def function(self, name: str, ty: ir.Type) -> ir.Function:
        """A math function of libm (``tanhf``, ``erf``...) or an LLVM intrinsic, by value type."""
        key = (name, ty)
        if key not in self.functions:
            if name.startswith("llvm."):
                self.functions[key] = self.module.declare_intrinsic(name, [ty])
            else:
                c_name = name + ("f" if ty == F32 else "")
                self.functions[key] = ir.Function(self.module, ir.FunctionType(ty, [ty]), c_name)
        return self.functions[key]

    @contextmanager
    def loop(self, lo: int | ir.Value, hi: ir.Value | None = None) -> Iterator[ir.Value]:
        """``for i in range(lo)``, or ``range(lo, hi)``, never empty, as a bottom-tested loop
        over an i64."""
        if hi is None:
            lo, hi = const_int(0), const_int(lo)
        b = self.b
        before = b.block
        head = self.fn.append_basic_block("loop")
        after = self.fn.append_basic_block("after")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64)
        i.add_incoming(lo, before)
        yield i
        nxt = b.add(i, const_int(1), flags=["nuw", "nsw"])
        i.add_incoming(nxt, b.block)
        b.cbranch(b.icmp_unsigned("<", nxt, hi), head, after)
        b.position_at_end(after)

    @contextmanager
    def when(self, cond: ir.Value) -> Iterator[None]:
        b = self.b
        then = self.fn.append_basic_block("then")
        after = self.fn.append_basic_block("endif")
        b.cbranch(cond, then, after)
        b.position_at_end(then)
        yield
        b.branch(after)
        b.position_at_end(after)

    def finish(self) -> str:
        """Add ``part(table)``: load the addresses of the buffers the items use, call each
        item in order. A split item goes to the
        thread pool (``pool.py``) with its arguments in a frame: its outermost loop is cut into
        chunks (``per_thread`` per thread) that the pool's threads claim."""
        entry = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [I64.as_pointer()]),
                            name="part")
        self.b = b = ir.IRBuilder(entry.append_basic_block("entry"))
        self.fn = entry
        table = entry.args[0]
        used = sorted({k for _, slots, _ in self.calls for k in slots})
        pointers = {k: b.inttoptr(b.load(b.gep(table, [const_int(k)])),
                                  _ELEM[self.nodes[k].prec].as_pointer()) for k in used}
        for fn, slots, (split, per_thread) in self.calls:
            args = [pointers[k] for k in slots]
            if not split:
                b.call(fn, args)
                continue
            frame_ty = ir.LiteralStructType([a.type for a in args])
            frame = b.alloca(frame_ty)
            for k, a in enumerate(args):
                b.store(a, b.gep(frame, [ir.Constant(I32, 0), ir.Constant(I32, k)]))
            b.call(self._pool_run(), [self._job(fn, frame_ty), b.bitcast(frame, _VOID_P),
                                      const_int(split), const_int(per_thread)])
        b.ret_void()
        return "\n".join([str(self.module), *self.item_texts.values()])

    def _job(self, fn: ir.Function, frame_ty: ir.Type) -> ir.Function:
        """``void job(void *frame, i64 lo, i64 hi)``: ``fn`` over ``[lo, hi)`` with the
        arguments stored in the frame (one per item function and frame type)."""
        key = (fn.name, str(frame_ty))
        if key in self.jobs:
            return self.jobs[key]
        run = self.jobs[key] = ir.Function(self.module, pool.JOB,
                                           name=self.module.get_unique_name(f"{fn.name}_job"))
        run.linkage = "internal"
        b = ir.IRBuilder(run.append_basic_block("entry"))
        frame = b.bitcast(run.args[0], frame_ty.as_pointer())
        args = [b.load(b.gep(frame, [ir.Constant(I32, 0), ir.Constant(I32, k)]))
                for k in range(len(frame_ty.elements))]
        b.call(fn, [*args, run.args[1], run.args[2]])
        b.ret_void()
        return run

    def _pool_run(self) -> ir.Function:
        if pool.RUN_SYMBOL not in self.module.globals:
            ir.Function(self.module, pool.RUN, name=pool.RUN_SYMBOL)
        return self.module.globals[pool.RUN_SYMBOL]

    # --- 16-bit storage -----------------------------------------------------------------------

    def widen(self, bits: ir.Value, prec: Precision) -> ir.Value:
        """16-bit pattern -> f32, exact. ``bits`` may be a vector where it is bf16 or f16 on
        F16C outside a copy (``schedule._in_lanes``)."""
        b = self.b
        if prec is Precision.bf16:
            wide = like(bits, I32)
            return b.bitcast(b.shl(b.zext(bits, wide), ir.Constant(wide, 16)), like(bits, F32))
        if not self.hardware_f16:
            return f16_to_f32_soft(b, bits)
        if self.copying:
            return f16_to_f32_hw(b, bits)
        return b.fpext(b.bitcast(bits, like(bits, F16)), like(bits, F32))

    def round_to(self, value: ir.Value, prec: Precision) -> ir.Value:
        """``value`` rounded to a 16-bit precision as a store would, then widened as a load
        would: f32."""
        if prec is Precision.bf16:
            return f32_round_bf16(self.b, convert(self.b, value, F32))
        return self.widen(self.narrow(value, prec), prec)

    def narrow(self, value: ir.Value, prec: Precision) -> ir.Value:
        """f32 (or f64, through f32) -> 16-bit pattern, nearest with ties to even. ``value``
        may be a vector where ``widen``'s bits may."""
        b = self.b
        if like(value, F64) == value.type:
            value = b.fptrunc(value, like(value, F32))
        if prec is Precision.bf16:
            return f32_to_bf16(b, value)
        if not self.hardware_f16:
            return f32_to_f16_soft(b, value)
        if self.copying:
            return f32_to_f16_hw(b, value)
        return b.bitcast(b.fptrunc(value, like(value, F16)), like(value, I16))

    # --- loads, stores, expressions ----------------------------------------------------------

    def offset(self, node: Tnode, idx: Projection, iters: dict[int, ir.Value]) -> ir.Value:
        """The flat row-major offset of ``node[idx]`` (in a ``flat`` group: the cell's)."""
        if self.cell is not None:
            return self.cell
        b = self.b
        terms: list[ir.Value] = []
        const = 0
        for i, stride, dim in zip(idx, node.strides, node.dims, strict=True):
            if isinstance(i, Dynamic):  # the index node's value, loaded when the code runs
                at = b.fptosi(convert(b, b.load(self.buffer(i.node)), F32), I64)
                terms.append(at if stride == 1 else b.mul(at, const_int(stride), flags=["nsw"]))
            elif isinstance(i, Fixed):
                const += i.pos * stride
            elif dim > 1:  # along an axis of one cell, an in-bounds position is 0
                at = self.affine(i, iters) if isinstance(i, Affine) else iters[i]
                terms.append(at if stride == 1 else b.mul(at, const_int(stride), flags=["nsw"]))
        if const or not terms:
            terms.append(const_int(const))
        total = terms[0]
        for t in terms[1:]:
            total = b.add(total, t, flags=["nsw"])
        return total

    def affine(self, a: Affine, iters: dict[int, ir.Value]) -> ir.Value:
        b = self.b
        total: ir.Value = const_int(a.offset)
        for c, i in a.terms:
            if c:
                total = b.add(total, b.mul(iters[i], const_int(c)))
        return total

    def in_bounds(self, node: Tnode, idx: Projection, space: tuple[int, ...],
                  iters: dict[int, ir.Value]) -> ir.Value | None:
        """Whether every affine index of ``node[idx]`` is inside its axis; None where that
        holds over the whole product space."""
        b = self.b
        cond = None
        for i, dim in zip(idx, node.dims, strict=True):
            if not isinstance(i, Affine):
                continue
            lo, hi = i.bounds(space)
            at = self.affine(i, iters)
            for c in ([b.icmp_signed(">=", at, const_int(0))] if lo < 0 else []) + \
                     ([b.icmp_signed("<", at, const_int(dim))] if hi >= dim else []):
                cond = c if cond is None else b.and_(cond, c)
        return cond

    def load(self, node: Tnode, idx: Projection, space: tuple[int, ...],
             iters: dict[int, ir.Value], compute: ir.Type, rounded: Precision | None = None
             ) -> ir.Value:
        """``node[idx]`` widened to its compute type (``rounded``: first rounded to that
        precision, ``Get.rounded``), or 0 where an affine index falls outside the node
        (padding: the load then reads cell 0 and its value is not used)."""
        b = self.b
        if node.id in self.held:  # handed over in a register (``LoopGroup.registers``)
            held = self.held[node.id]
            return self.widen(held, node.prec) if node.prec.is_narrow else held
        off = self.offset(node, idx, iters)
        cond = self.in_bounds(node, idx, space, iters)
        if cond is not None:
            off = b.select(cond, off, const_int(0))
        value = b.load(b.gep(self.buffer(node), [off]))
        if node.prec.is_narrow:
            value = self.widen(value, node.prec)
        if rounded is not None:
            value = self._rounded(node, rounded, value)
        if cond is not None:
            value = b.select(cond, value, ir.Constant(value.type, 0.0))
        return value

    def store(self, node: Tnode, off: ir.Value, value: ir.Value, exact: bool = False) -> None:
        """``exact``: the value is representable in the node's precision (:meth:`representable`),
        so a bf16 store keeps its top half instead of rounding it (the same bits, NaN too)."""
        b = self.b
        if exact and node.prec is Precision.bf16:
            value = f32_to_bf16_exact(b, convert(b, value, F32))
        elif node.prec.is_narrow:
            value = self.narrow(value, node.prec)
        else:
            value = convert(b, value, _FLOAT[node.prec])
        if node.id in self.registers:  # later nests of the group read it here, not stored
            self.held[node.id] = value
            return
        b.store(value, b.gep(self.buffer(node), [off]))

    def representable(self, e: Expr, prec: Precision) -> bool:
        """Whether ``e``'s value is exactly representable in ``prec``: a constant that is, a read
        of a node of that precision (its loads widen it exactly, or round a wider node to it),
        a read rounded to it (``Get.rounded``), or ops that select among such values
        (``ops.representable``)."""
        if isinstance(e, Const):
            return bool(np.isfinite(e.value)) and float(
                np.array(e.value, prec.numpy_dtype)) == e.value
        if isinstance(e, Get):
            return (e.rounded or e.node.prec) is prec
        assert isinstance(e, Apply)
        units = [(isinstance(a, Const) and a.value in (0.0, 1.0, -1.0))
                 or (isinstance(a, Apply) and OPS[a.op].flag) for a in e.args]
        return OPS[e.op].representable([self.representable(a, prec) for a in e.args], units)

    def expr(self, e: Expr, compute: ir.Type, space: tuple[int, ...],
             iters: dict[int, ir.Value]) -> ir.Value:
        if isinstance(e, Const):
            return ir.Constant(compute, e.value)
        if isinstance(e, Get):
            return self.load(e.node, e.idx, space, iters, compute, e.rounded)
        assert isinstance(e, Apply)
        args = [self.expr(a, compute, space, iters) for a in e.args]
        return OPS[e.op].llvm(self, compute, *args)

    def combine(self, accum: str, old: ir.Value, new: ir.Value, compute: ir.Type) -> ir.Value:
        return OPS["add" if accum == "+" else accum].llvm(self, compute, old, new)

    # --- lowered items -----------------------------------------------------------------------

    def fill(self, f: Fill) -> None:
        node = f.node
        if node.prec.is_narrow:
            bits = int(np.array([f.value], node.prec.numpy_dtype).view(np.uint16)[0])
            value: ir.Value = ir.Constant(I16, bits)
        else:
            value = ir.Constant(_FLOAT[node.prec], f.value)
        ptr = self.buffer(node)
        with self.loop(node.size) as i:
            self.b.store(value, self.b.gep(ptr, [i]))

    def group(self, g: LoopGroup) -> None:
        """One loop over the lead nest's parallel iterators running every nest's body, shaped
        as scheduling decided: one loop over the cells (``flat``), a row walk
        (``walk_rows``), ``jam`` cells of a reduction at once (as one vector of them where
        ``lanes``, its ``packed`` reads packed first), or point by point with ``registers``
        handed over in registers."""
        lead = g.lead
        space = lead.space
        if 0 in space:
            return
        iters: dict[int, ir.Value] = {}
        self.plain_rounding = lead.assign.lhs.id in self.for_gemms
        if lead.walk_rows:
            self._loops(list(lead.par[:-1]), space, iters,
                        lambda: self._row_walk(lead, space, iters), outer=True)
        elif g.jam:
            if g.lanes:
                self._pack_reads(lead, g.jam, g.packed)
            self._loops(list(lead.par[:-1]), space, iters,
                        lambda: self._jammed(lead, g.jam, space, iters, g.lanes), outer=True)
            self.packed = {}
        elif g.flat:  # every access is the point's own cell: its flat offset
            self.registers = g.registers
            with self.loop(*(self.range or (const_int(0), const_int(math.prod(space))))) as i:
                self.cell = i
                self._par_body(g, space, iters)
            self.cell = None
            self.registers, self.held = frozenset(), {}
        else:
            self.registers = g.registers
            self._loops(list(lead.par), space, iters, lambda: self._par_body(g, space, iters),
                        outer=True)
            self.registers, self.held = frozenset(), {}

    def _loops(self, order: list[int], space: tuple[int, ...], iters: dict[int, ir.Value],
               body: Callable[[], None], outer: bool = False) -> None:
        """Loops over ``order`` around ``body``; ``outer``: the first runs over this item's
        range when it has one (a thread's share)."""
        if not order:
            body()
            return
        bounds = self.range if outer and self.range else (const_int(0), const_int(space[order[0]]))
        with self.loop(*bounds) as i:
            iters[order[0]] = i
            self._loops(order[1:], space, iters, body)

    def _par_body(self, g: LoopGroup, space: tuple[int, ...], iters: dict[int, ir.Value]) -> None:
        for nest in g.nests:
            self.plain_rounding = nest.assign.lhs.id in self.for_gemms
            self.conversion = g.conversion
            if not nest.red:
                self._point(nest, space, iters)
            elif nest.scatter:
                self._loops(list(nest.red), space, iters,
                            lambda n=nest: self._scatter(n, space, iters))
            elif nest.assign.accum == "=":  # every point overwrites its cell: the last stays
                self._loops(list(nest.red), space, iters,
                            lambda n=nest: self._point(n, space, iters))
            else:
                self._reduction(nest, space, iters)

    def _point(self, nest: LoopNest, space: tuple[int, ...], iters: dict[int, ir.Value]) -> None:
        """A nest with nothing to reduce: compute, combine with the cell unless it is
        overwritten, store."""
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        overwrite = a.accum == "=" or a.reset
        self.copying = (overwrite and isinstance(a.expr, Get) and a.lhs.id not in self.for_gemms
                        and not self.conversion)
        value = self.expr(a.expr, compute, space, iters)
        off = self.offset(a.lhs, a.lhs_idx, iters)
        if not overwrite:
            old = self.load(a.lhs, a.lhs_idx, space, iters, compute)
            value = self.combine(a.accum, old, value, compute)
        exact = (a.lhs.prec is Precision.bf16 and (overwrite or a.accum in ("max", "min"))
                 and self.representable(a.expr, a.lhs.prec))
        self.store(a.lhs, off, value, exact)
        self.copying = False

    def _reduction(self, nest: LoopNest, space: tuple[int, ...],
                   iters: dict[int, ir.Value]) -> None:
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        acc = self.local(compute)
        neutral = ACCUMS[a.accum]
        self.b.store(ir.Constant(compute, 0.0 if neutral is None else neutral), acc)

        unordered = a.accum == "+" and _zero_or_nan(a.expr)

        def inner() -> None:
            value = self.expr(a.expr, compute, space, iters)
            if unordered:  # LLVM may keep several partial sums (in vectors): the same result
                new = self.b.fadd(self.b.load(acc), convert(self.b, value, compute),
                                  flags=("reassoc",))
            else:
                new = self.combine(a.accum, self.b.load(acc), value, compute)
            self.b.store(convert(self.b, new, compute), acc)

        self._loops(list(nest.red), space, iters, inner)
        result = self.b.load(acc)
        if not a.reset:
            old = self.load(a.lhs, a.lhs_idx, space, iters, compute)
            result = self.combine(a.accum, old, result, compute)
        self.store(a.lhs, self.offset(a.lhs, a.lhs_idx, iters), result)

    def _jammed(self, nest: LoopNest, width: int, space: tuple[int, ...],
                iters: dict[int, ir.Value], lanes: bool) -> None:
        """The reduction for ``width`` consecutive cells of its last parallel iterator at once:
        one accumulator each, every term of the reduction loop adding to all of them; or,
        where ``lanes``, one vector accumulator, every term a vector of the
        cells' terms. Each cell takes its terms in the usual order (the same bits); the
        cells' chains of dependent additions overlap instead of running one after another."""
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        last = nest.par[-1]
        b = self.b
        neutral = 0.0 if ACCUMS[a.accum] is None else ACCUMS[a.accum]
        with self.loop(space[last] // width) as block:
            base = b.mul(block, const_int(width), flags=["nuw", "nsw"])
            cells = [b.add(base, const_int(u), flags=["nuw", "nsw"]) for u in range(width)]
            if lanes:  # one vector of the cells
                vec = ir.VectorType(compute, width)
                accs = [self.local(vec)]
                b.store(ir.Constant(vec, neutral), accs[0])
            else:
                accs = [self.local(compute) for _ in range(width)]
                for acc in accs:
                    b.store(ir.Constant(compute, neutral), acc)

            def inner() -> None:
                if lanes:
                    iters[last] = base
                    value = self._lanes_expr(a.expr, compute, width, last, space, iters)
                    b.store(self.combine(a.accum, b.load(accs[0]), value, compute), accs[0])
                    return
                for cell, acc in zip(cells, accs, strict=True):
                    iters[last] = cell
                    value = self.expr(a.expr, compute, space, iters)
                    new = self.combine(a.accum, b.load(acc), value, compute)
                    b.store(convert(b, new, compute), acc)

            self._loops(list(nest.red), space, iters, inner)
            if lanes and self._store_lanes(nest, width, iters, b.load(accs[0])):
                return
            for u, cell in enumerate(cells):
                iters[last] = cell
                result = (b.extract_element(b.load(accs[0]), const_int(u, I32)) if lanes
                          else b.load(accs[u]))
                if not a.reset:
                    old = self.load(a.lhs, a.lhs_idx, space, iters, compute)
                    result = self.combine(a.accum, old, result, compute)
                self.store(a.lhs, self.offset(a.lhs, a.lhs_idx, iters), result)

    def _store_lanes(self, nest: LoopNest, width: int, iters: dict[int, ir.Value],
                     value: ir.Value) -> bool:
        """Store a vector of a jammed reduction's cells (from ``iters[last]`` on) as one vector,
        rounded lane by lane to a 16-bit target: where the cells lie side by side, the
        reduction overwrites them and nothing else stands in for the target. False when it
        cannot (each cell is then stored alone)."""
        a = nest.assign
        lhs, b = a.lhs, self.b
        ok = (a.reset and read_stride(Get(lhs, a.lhs_idx), nest.par[-1]) == 1
              and lhs.id not in self.registers
              and (lhs.prec is not Precision.f16 or self.hardware_f16))
        if not ok:
            return False
        if lhs.prec.is_narrow:
            value = self.narrow(value, lhs.prec)
        elif value.type.element != _FLOAT[lhs.prec]:  # an f64 sum into an f32 target
            value = b.fptrunc(value, ir.VectorType(F32, width))
        at = b.gep(self.buffer(lhs), [self.offset(lhs, a.lhs_idx, iters)])
        b.store(value, b.bitcast(at, value.type.as_pointer()), align=lhs.prec.itemsize)
        return True

    def _pack_reads(self, nest: LoopNest, width: int, packed: tuple[int, ...]) -> None:
        """Pack the reads at positions ``packed`` (scheduling's choice: those striding across
        the cells that depend only on the jammed and reduction iterators, a convolution's
        kernel) into stack arrays, so the loops over the other parallel iterators load them
        as vectors (``_lanes_expr``)."""
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        last, red = nest.par[-1], list(nest.red)
        terms = math.prod(nest.space[i] for i in red)
        gets = list(reads(a.expr))
        for k in packed:
            get = gets[k]
            if id(get) not in self.packed:
                self.packed[id(get)] = (self._pack(get, width, last, red, nest.space, compute),
                                        red, terms)

    def _pack(self, get: Get, width: int, last: int, red: list[int], space: tuple[int, ...],
              compute: ir.Type) -> ir.Value:
        """``get``'s values block by block of ``width`` cells of ``last``, term by term of
        ``red``, the block's cells side by side, in a stack array."""
        terms = math.prod(space[i] for i in red)
        pack = self.entry.alloca(ir.ArrayType(compute, space[last] * terms))
        pack = self.entry.bitcast(pack, compute.as_pointer())
        b, iters = self.b, {}
        with self.loop(space[last]) as cell:
            iters[last] = cell

            def store() -> None:
                at = b.add(b.mul(b.udiv(cell, const_int(width)), const_int(terms)),
                           self._term(red, space, iters))
                at = b.add(b.mul(at, const_int(width)), b.urem(cell, const_int(width)))
                b.store(self.load(get.node, get.idx, space, iters, compute), b.gep(pack, [at]))

            self._loops(red, space, iters, store)
        return pack

    def _term(self, red: list[int], space: tuple[int, ...], iters: dict[int, ir.Value]
              ) -> ir.Value:
        """The reduction point's number, its iterators read in the nest's order."""
        b, at = self.b, const_int(0)
        for i in red:
            at = b.add(b.mul(at, const_int(space[i])), iters[i])
        return at

    def _lanes_expr(self, e: Expr, compute: ir.Type, width: int, last: int,
                    space: tuple[int, ...], iters: dict[int, ir.Value]) -> ir.Value:
        """``e`` for ``width`` cells from ``iters[last]`` on, as a vector: a read
        along ``last`` is a vector load, one not moving with it a broadcast, one striding
        across it a vector made of its cells."""
        vec = ir.VectorType(compute, width)
        if isinstance(e, Const):
            return ir.Constant(vec, e.value)
        if isinstance(e, Apply):
            args = [self._lanes_expr(x, compute, width, last, space, iters) for x in e.args]
            return OPS[e.op].llvm(self, compute, *args)
        assert isinstance(e, Get)
        b, node = self.b, e.node
        if id(e) in self.packed:  # the block's cells side by side for each term
            pack, red, terms = self.packed[id(e)]
            at = b.add(b.mul(iters[last], const_int(terms)),
                       b.mul(self._term(red, space, iters), const_int(width)))
            return b.load(b.bitcast(b.gep(pack, [at]), vec.as_pointer()),
                          align=4 if compute == F32 else 8)
        base = self.buffer(node)
        narrow = node.prec.is_narrow
        loaded = ir.VectorType(I16, width) if narrow else vec
        stride = read_stride(e, last)
        off = self.offset(node, e.idx, iters)
        cond = self.in_bounds(node, e.idx, space, iters)
        if cond is not None:
            off = b.select(cond, off, const_int(0))
        if stride == 1:
            value = b.load(b.bitcast(b.gep(base, [off]), loaded.as_pointer()),
                           align=loaded.element.width // 8 if narrow else
                           (4 if compute == F32 else 8))
        elif stride == 0:
            one = b.insert_element(ir.Constant(loaded, ir.Undefined),
                                   b.load(b.gep(base, [off])), const_int(0, I32))
            value = b.shuffle_vector(one, ir.Constant(loaded, ir.Undefined),
                                     ir.Constant(ir.VectorType(I32, width), [0] * width))
        else:
            value = ir.Constant(loaded, ir.Undefined)
            for u in range(width):
                at = b.add(off, const_int(u * stride), flags=["nsw"])
                value = b.insert_element(value, b.load(b.gep(base, [at])), const_int(u, I32))
        if narrow:
            value = self.widen(value, node.prec)
        if cond is not None:
            value = b.select(cond, value, ir.Constant(vec, 0.0))
        return value

    def _row_walk(self, nest: LoopNest, space: tuple[int, ...],
                  iters: dict[int, ir.Value]) -> None:
        """The reduction with its last parallel iterator innermost: a row of accumulators,
        each taking its terms in the usual order, stored once at the end."""
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        last = nest.par[-1]
        n = space[last]
        row = self.entry.alloca(ir.ArrayType(compute, n))
        b = self.b
        neutral = ACCUMS[a.accum]
        # A thread's share of a lone row: its blocks of cells (``_split``), else every cell.
        cells: tuple[ir.Value, ...] = (const_int(0), const_int(n))
        if self.range and len(nest.par) == 1:
            lo, hi = (b.mul(v, const_int(ROW_BLOCK)) for v in self.range)
            cells = (lo, b.select(b.icmp_unsigned("<", hi, const_int(n)), hi, const_int(n)))

        def cell(i: ir.Value) -> ir.Value:
            return b.gep(row, [const_int(0), i])

        with self.loop(*cells) as i:
            b.store(ir.Constant(compute, 0.0 if neutral is None else neutral), cell(i))

        def inner() -> None:
            with self.loop(*cells) as i:
                iters[last] = i
                value = self.expr(a.expr, compute, space, iters)
                new = self.combine(a.accum, b.load(cell(i)), value, compute)
                b.store(convert(b, new, compute), cell(i))

        self._loops(list(nest.red), space, iters, inner)
        with self.loop(*cells) as i:
            iters[last] = i
            result = b.load(cell(i))
            if not a.reset:
                old = self.load(a.lhs, a.lhs_idx, space, iters, compute)
                result = self.combine(a.accum, old, result, compute)
            self.store(a.lhs, self.offset(a.lhs, a.lhs_idx, iters), result)

    def _scatter(self, nest: LoopNest, space: tuple[int, ...], iters: dict[int, ir.Value]) -> None:
        """An affine target: every point reads, combines and writes its (moving) cell, and
        skips cells outside the node."""
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        value = self.expr(a.expr, compute, space, iters)
        cond = self.in_bounds(a.lhs, a.lhs_idx, space, iters)

        def write() -> None:
            new = value
            if a.accum != "=":
                old = self.load(a.lhs, a.lhs_idx, space, iters, compute)
                new = self.combine(a.accum, old, value, compute)
            self.store(a.lhs, self.offset(a.lhs, a.lhs_idx, iters), new)

        if cond is None:
            write()
        else:
            with self.when(cond):
                write()

    def _rounded(self, source: Tnode, prec: Precision, wide: ir.Value) -> ir.Value:
        """A read through a rounding (``Get.rounded``): ``wide`` rounded to ``prec`` as a store
        would round it, then widened as a load would. A virtual twin's rounding (its source
        materialized) is its copy's, which keeps a signalling NaN's bits unless only products
        read what is being written; a product's forwarded result's is its rounding store's."""
        copying, self.copying = self.copying, (source.memory_mode is MemoryMode.materialized
                                               and not self.plain_rounding)
        value = self.round_to(convert(self.b, wide, F32), prec)
        self.copying = copying
        return value

    def gemm(self, g: Gemm) -> None:
        """``out (=|+=) a @ b``, one product per batch point, by the kernel scheduling chose:
        inline (``small_product``, as the loops would compute it) or through BLAS
        (:meth:`_blas_call`). When this item has a range, ``g.split`` says what it picks: the
        batch points (``"batch"``, the first batch axis) or blocks of ``GEMM_BLOCK`` rows or
        columns of the product."""
        lhs = g.assign.lhs
        compute = _FLOAT.get(lhs.prec)
        inline = g.kernel == "inline"
        ok_b = g.b.node.prec is lhs.prec or (inline and g.b.node.prec.is_narrow)
        native = (not inline and g.a.node.prec is g.b.node.prec and lhs.prec is Precision.f32
                  and g.a.node.prec in self.native_products)
        if compute is None or not native and (g.a.node.prec is not lhs.prec or not ok_b):
            raise ValueError(
                f"the CPU renderer multiplies f32 or f64 operands into a target of their "
                f"precision (16-bit right operands inline, two operands of one of "
                f"Target.native_products {sorted(p.value for p in self.native_products)} into "
                f"f32 through the BLAS), not {g.a.node.prec.value} by {g.b.node.prec.value} "
                f"into {lhs.prec.value} ({lhs.name}): lowering must give a product copies in "
                f"its precision")
        a, bm, out = self.buffer(g.a.node), self.buffer(g.b.node), self.buffer(lhs)
        along = g.split
        b = self.b
        first = (const_int(0), const_int(0), const_int(0))
        call: Callable[[tuple[ir.Value, ir.Value, ir.Value]], None]
        if inline:
            def call(offsets: tuple[ir.Value, ir.Value, ir.Value]) -> None:
                small_product.emit(self, g, compute, a, bm, out, offsets)
        else:
            call, part = self._blas_call(g, compute, a, bm, out, along)
            if self.range and along in ("rows", "cols"):  # this range's parts, a call each
                with self.loop(*self.range) as p:
                    call(part(p))
                return

        def over(axes: tuple, offsets: tuple[ir.Value, ir.Value, ir.Value]) -> None:
            """A product per point of the batch axes, each at its offsets in the nodes."""
            if not axes:
                call(offsets)
                return
            axis = axes[0]
            ranged = self.range if along == "batch" and len(axes) == len(g.batch) else None
            with self.loop(*(ranged or (axis.size,))) as i:
                step = [b.mul(i, const_int(st), flags=["nsw"]) for st in (axis.out, axis.a, axis.b)]
                over(axes[1:], tuple(b.add(o, d, flags=["nsw"])
                                     for o, d in zip(offsets, step, strict=True)))

        over(g.batch, first)

    def _blas_call(self, g: Gemm, compute: ir.Type, a: ir.Value, bm: ir.Value, out: ir.Value,
                   along: str | None
                   ) -> tuple[Callable[[tuple[ir.Value, ir.Value, ir.Value]], None],
                              Callable[[ir.Value], tuple[ir.Value, ir.Value, ir.Value]]]:
        """A BLAS call of ``g`` at given offsets (out, a, b), column-major: ``out^T = b^T
        a^T``; and, when ``along`` is rows or columns, the offsets of a part of the product
        (its size set for the call). The parts are fixed by the product's shape, whatever the
        thread count: a BLAS picks its kernels by a call's size, so other cuts could give other
        bits."""
        m, n, k = g.rows, g.cols, g.inner
        # b is k x n: stored n x k when transposed; a is m x k: stored k x m when transposed.
        op_b, op_a = ("T" if g.b.transposed else "N"), ("T" if g.a.transposed else "N")
        beta = 0.0 if g.assign.reset else 1.0
        e, b = self.entry, self.b

        def by_ref(value: ir.Constant) -> ir.Value:
            slot = e.alloca(value.type)
            e.store(value, slot)
            return slot

        char = ir.IntType(8)
        rows, cols = by_ref(const_int(m, self.blas_int)), by_ref(const_int(n, self.blas_int))
        fixed = [by_ref(ir.Constant(char, ord(op_b))), by_ref(ir.Constant(char, ord(op_a))),
                 cols, rows, by_ref(const_int(k, self.blas_int)),
                 by_ref(ir.Constant(compute, 1.0))]
        ld_b = by_ref(const_int(g.b.ld, self.blas_int))
        ld_a = by_ref(const_int(g.a.ld, self.blas_int))
        beta_ref = by_ref(ir.Constant(compute, beta))
        ld_out = by_ref(const_int(g.out_ld, self.blas_int))
        gemm = self._gemm_function(compute, g.a.node.prec)

        def call(offsets: tuple[ir.Value, ir.Value, ir.Value]) -> None:
            o_out, o_a, o_b = offsets
            b.call(gemm, [*fixed, b.gep(bm, [o_b]), ld_b, b.gep(a, [o_a]), ld_a, beta_ref,
                          b.gep(out, [o_out]), ld_out])

        def part(p: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
            """Part ``p`` of the product's ``split_extent`` parts (``along`` its rows or
            columns, whole blocks of ``GEMM_BLOCK`` each): its size stored, its offsets."""
            size = m if along == "rows" else n
            blocks, parts = const_int(-(-size // GEMM_BLOCK)), const_int(g.split_extent)
            lo, hi = (b.mul(b.udiv(b.mul(q, blocks), parts), const_int(GEMM_BLOCK))
                      for q in (p, b.add(p, const_int(1))))
            hi = b.select(b.icmp_unsigned("<", hi, const_int(size)), hi, const_int(size))
            count = b.sub(hi, lo)
            b.store(b.trunc(count, self.blas_int) if self.blas_int != I64 else count,
                    rows if along == "rows" else cols)
            if along == "rows":
                return (b.mul(lo, const_int(g.out_ld)),
                        lo if g.a.transposed else b.mul(lo, const_int(g.a.ld)), const_int(0))
            return lo, const_int(0), b.mul(lo, const_int(g.b.ld)) if g.b.transposed else lo

        return call, part

    def _gemm_function(self, compute: ir.Type, operands: Precision) -> ir.Function:
        """The BLAS routine multiplying ``operands`` into ``compute``: ``sgemm``'s arguments,
        the operands' pointers to 16-bit values for a native product."""
        key = ("gemm", compute, operands)
        if key not in self.functions:
            p8, p32, pf = ir.IntType(8).as_pointer(), self.blas_int.as_pointer(), \
                compute.as_pointer()
            po = I16.as_pointer() if operands.is_narrow else pf
            ty = ir.FunctionType(ir.VoidType(), [p8, p8, p32, p32, p32, pf, po, p32, po, p32,
                                                 pf, pf, p32])
            symbol = GEMM16_SYMBOLS[operands] if operands.is_narrow else GEMM_SYMBOLS[compute]
            self.functions[key] = ir.Function(self.module, ty, symbol)
        return self.functions[key]


# Loop nests per part, at least: a routine of more is cut into parts that LLVM compiles in
# parallel (one per core, at most), each an object of its own. Nests, not items, say how
# much work there is (a long pointwise chain lowers to few groups of dozens of nests: a
# chain of 3,000 additions made 94 items, which compiled as one part); items say where to
# cut (halves by items came within 10% of each other in IR size on gpt_mini's step, halves
# by nests 44% apart).
PART_NESTS = 48


def _part_bounds(code: list[Lowered], workers: int) -> list[int]:
    """Where the parts start (and the last ends): at most ``workers`` parts of about equal
    numbers of items, each part's share of the nests at least ``PART_NESTS``."""
    nests = sum(len(item.nests) if isinstance(item, LoopGroup) else 1 for item in code)
    count = max(1, min(workers, nests // PART_NESTS, len(code)))
    return [len(code) * k // count for k in range(count + 1)]

def routine_ir(code: list[Lowered], nodes: list[Tnode], target: Target) -> list[str]:
    """The modules of a routine over ``nodes``, as LLVM IR text, each defining
    ``part(table)``: the routine runs them in order. Every array a routine uses is a node of
    its code (lowering's f32 copies too), its memory planned by the context with the others'.
    At most ``target.workers`` parts, each of at least ``PART_NESTS`` nests
    (``_part_bounds``)."""
    bounds = _part_bounds(code, target.workers)
    for_gemms = _for_gemms(code)
    texts: list[str] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        r = RoutineIR(nodes, target, for_gemms)
        for item in code[lo:hi]:
            if isinstance(item, Gemm):
                # One block range per thread: each range packs its operands again.
                with r.item(_used(item), item.split_extent if item.split else None):
                    r.gemm(item)
            elif isinstance(item, Fill):
                with r.item(_used(item)):
                    r.fill(item)
            else:
                with r.item(_used(item), item.split, item.chunks):
                    r.group(item)
        texts.append(r.finish())
    return texts


def _used(item: Lowered) -> list[Tnode]:
    """The nodes an item's function takes: those it reads or writes, but those it hands over
    in registers (they have no memory)."""
    held = item.registers if isinstance(item, LoopGroup) else frozenset()
    return [n for n in item_nodes(item) if n.id not in held]


def _for_gemms(code: list[Lowered]) -> frozenset[int]:
    """The local nodes of ``code`` that only products read."""
    local = {n.id for n in nodes_of(code) if n.memory_mode is MemoryMode.local}
    gemm_read, other_read = set(), set()
    for item in code:
        item_reads = accesses(item)[0]
        if isinstance(item, Gemm):
            operands = {item.a.node.id, item.b.node.id}
            gemm_read |= operands
            item_reads -= operands
        other_read |= item_reads
    return frozenset(local & gemm_read - other_read)


def _zero_or_nan(e: Expr) -> bool:
    """Whether every value of ``e`` is +-0 or NaN (a product with a constant 0: the gradient
    checksum's terms). A sum of such terms from +0 is +0 or NaN in any order, so it needs no
    fixed order of additions."""
    return isinstance(e, Apply) and e.op == "mul" and any(
        isinstance(x, Const) and x.value == 0.0 for x in e.args)


# The code generator's version: a hash of every file whose code can end up in a compiled
# object (``version.py``); a cached routine compiled by other code is not reused.
_VERSION = version.VERSION


def signature(code: list[Lowered], nodes: list[Tnode], target: Target) -> str:
    """Everything :func:`routine_ir` builds the IR from, as text: the lowered code with nodes
    named by position, their dims and precisions, every decision of its items, the target and
    this module's version. Equal
    signatures give equal IR, so the disk cache is keyed by it and a warm process builds no
    IR at all."""
    slot: dict[int, str] = {n.id: str(k) for k, n in enumerate(nodes)}
    for item in code:  # a node held in registers has no slot: it is named apart
        for i in sorted(item.registers) if isinstance(item, LoopGroup) else ():
            slot.setdefault(i, f"r{len(slot) - len(nodes)}")

    def expr(e: Expr) -> str:
        if isinstance(e, Get):
            via = f"~{e.rounded.value}" if e.rounded is not None else ""
            return f"g{slot[e.node.id]}{e.idx!r}{via}"
        if isinstance(e, Apply):
            return f"{e.op}({','.join(expr(a) for a in e.args)})"
        assert isinstance(e, Const)
        return repr(e.value)

    def view(v: MatrixView) -> str:
        return f"{slot[v.node.id]},{v.rows},{v.cols},{v.transposed},{v.ld}"

    lines = [f"{_VERSION} {target!r}",
             *(f"{n.dims} {n.prec.value} {n.memory_mode.value}" for n in nodes)]
    for item in code:
        if isinstance(item, Fill):
            lines.append(f"fill {slot[item.node.id]} {item.value!r}")
        elif isinstance(item, Gemm):
            a = item.assign
            lines.append(f"gemm {slot[a.lhs.id]} {a.reset} [{view(item.a)}] [{view(item.b)}] "
                         f"{item.rows} {item.cols} {item.inner} {item.out_ld} {item.batch!r} "
                         f"{item.kernel} {item.split} {item.split_extent}")
        else:
            for nest in item.nests:
                a = nest.assign
                lines.append(f"nest {nest.par} {nest.red} {nest.scatter} {nest.walk_rows} "
                             f"{slot[a.lhs.id]}{a.lhs_idx!r} {a.accum} {a.reset} {a.space} "
                             f"{expr(a.expr)}")
            lines.append(f"end {sorted(slot[i] for i in item.registers)} {item.split} "
                         f"{item.chunks} {item.jam} {item.lanes} {item.packed} "
                         f"{item.conversion} {item.flat}")
    return "\n".join(lines)


def shares_products(code: list[Lowered]) -> bool:
    """Whether the routine shares a product over the pool's threads: it then runs BLAS
    single-threaded (a product below the split threshold runs on one thread in OpenBLAS
    anyway)."""
    return any(isinstance(item, Gemm) and item.split is not None for item in code)
