"""LLVM IR for a routine: its fills, loop groups and GEMMs as one function of a buffer table.

A routine is one or more parts, ``void part(i64* table)``, run in order: ``table`` holds the
address of every node's flat buffer (in the order of ``nodes``) and then of the routine's
scratch arrays. A part calls one function per lowered item (a fill, a loop group, a GEMM)
with the buffers that item uses.
Going straight from the lowered code to LLVM IR, with nothing between, keeps the compile time a
small multiple of LLVM's own, linear in the size of the step.

Arithmetic follows the usual C rules, the same as the CUDA backend's and NumPy's: an f32 value
meeting an f64 value is widened, literals take the nest's compute precision, and 16-bit storage
is widened to f32 on load and rounded once (nearest, ties to even) on store. Nothing is
reassociated or contracted, so results are bitwise those of the plain loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
    IR_OPS,
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
from ocannl.ir import ops as ops_module
from ocannl.ir.assignments import Affine, Apply, Const, Expr, Fixed, Get, Projection, reads
from ocannl.ir.lowering import (
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    Lowered,
    MatrixView,
    accesses,
    copy_source,
    nodes_of,
)
from ocannl.ir.ops import ACCUMS, Precision
from ocannl.ir.tnode import MemoryMode, Tnode

_VOID_P = ir.IntType(8).as_pointer()
_FLOAT = {Precision.f32: F32, Precision.f64: F64}
_ELEM = {Precision.f64: F64, Precision.f32: F32, Precision.f16: I16, Precision.bf16: I16}
# The BLAS routines, resolved by the JIT (``jit.py`` maps these names to SciPy's BLAS).
GEMM_SYMBOLS = {F32: "ocannl_sgemm", F64: "ocannl_dgemm"}


@dataclass(frozen=True)
class Target:
    """What the IR depends on beyond the code: ``hardware_f16``, convert f16 with the CPU's
    instructions (F16C) rather than integer code; ``workers``, how many parts a large routine
    may be cut into; ``avx``, clear the vector registers' upper halves at each item's start;
    ``blas_int``, the bits of the BLAS's integer arguments (32, or 64 for an ILP64 build);
    ``threads``, how many threads share a large loop group's outermost loop;
    ``products_shared``, products are shared over those threads too, each part a
    single-threaded BLAS call (the BLAS's thread count can be set)."""

    hardware_f16: bool = True
    workers: int = 1
    avx: bool = False
    blas_int: int = 32
    threads: int = 1
    products_shared: bool = False


class RoutineIR:
    """Builds the IR of one part of a routine, for ``target``."""

    def __init__(self, nodes: list[Tnode], target: Target,
                 scratch: dict[tuple[int, str, ir.Type], int],
                 copies: dict[int, tuple[tuple[int, str, ir.Type], int]],
                 uses: dict[int, list[int]] | None = None, base: int = 0,
                 for_gemms: frozenset[int] = frozenset(),
                 forwarded: dict[int, Gemm] | None = None,
                 gemm_outs: dict[int, tuple[int, str, ir.Type]] | None = None,
                 derived: dict[int, Tnode] | None = None,
                 tables: list[int] | None = None) -> None:
        self.module = ir.Module(name="ocannl")
        # Local nodes only products read (im2col's patches): what a copy into one does to a
        # signalling NaN's bits cannot show, as a product quiets it anyway.
        self.for_gemms = for_gemms
        # 16-bit targets of GEMMs read from the GEMM's f32 result, never stored (``_forwarded``)
        self.forwarded = forwarded or {}
        # 16-bit rounded copies of wider nodes, read by rounding those (``_derived``)
        self.derived = derived or {}
        self.hardware_f16 = target.hardware_f16
        self.avx = target.avx
        self.blas_int = ir.IntType(target.blas_int)
        self.nodes = nodes
        self.slots = {n.id: k for k, n in enumerate(nodes)}
        self.scratch = scratch  # (size, role, type) -> number, shared by a routine's parts
        # node id -> the scratch key of its current f32 / f64 copy, and the lowered item
        # that last read it
        self.copies = copies
        self.lowered = 0  # the lowered item being emitted (``routine_ir`` sets it)
        # scratch number -> the first and last item (counted over the routine) using it
        self.uses = {} if uses is None else uses
        self.base = base  # the routine's items before this part's
        self.functions: dict[tuple[str, ir.Type], ir.Function] = {}
        # Each item: its function, its slots, (its extent when shared, chunks per thread), the
        # scratch arrays it uses (their numbers, in the order of its table).
        self.calls: list[tuple[ir.Function, list[int], tuple[int | None, int], list[int]]] = []
        # Whether the nest being emitted copies a value unchanged (a cast): only then does a
        # signalling NaN's bit pattern survive to the store, and the f16 conversions keep it
        # as NumPy does. Arithmetic quiets a NaN whatever the conversion did, so elsewhere the
        # plain instructions give the same bits.
        self.copying = False
        self.redirect: dict[int, ir.Value] = {}  # node id -> an f32 copy standing in for it
        # id(Gemm) -> the scratch key of its f32 result, shared by a routine's parts
        self.gemm_outs = {} if gemm_outs is None else gemm_outs
        # The group's nodes kept in registers, and their values at the point being emitted.
        self.registers: frozenset[int] = frozenset()
        self.held: dict[int, ir.Value] = {}
        # A jammed reduction's reads packed as vectors of its cells (``_lanes``), by id.
        self.packed: dict[int, tuple[ir.Value, list[int], int]] = {}
        # Each item function's text (its name left out) -> the function: an item whose text an
        # earlier one of this part has is that one (``_same_item``); and the text of each
        # function kept, by name (the module's text is made of them, not made again).
        self.items_by_text: dict[str, ir.Function] = {}
        self.item_texts: dict[str, str] = {}
        self.jobs: dict[tuple[str, str], ir.Function] = {}  # (item, frame type) -> its job
        # The routine's table past its nodes, shared by its parts: one block per item call
        # that uses scratch, the numbers of its scratch arrays in its order (``finish``).
        self.tables = [] if tables is None else tables

    # --- plumbing ---------------------------------------------------------------------------

    @contextmanager
    def item(self, used: list[Tnode], split: int | None = None,
             per_thread: int = pool.CHUNKS_PER_THREAD) -> Iterator[None]:
        """Emit one lowered item as a function of its own, taking the table and the buffers
        of ``used`` as ``noalias`` arguments: distinct nodes never share memory, and saying so
        spares LLVM run-time overlap checks (and a second, scalar copy of each vectorized
        loop). One small function per item keeps LLVM's work linear in the routine's size.
        ``split``: the item runs its outermost loop over a range given by two more arguments,
        so that threads can share it, in ``per_thread`` chunks per thread (see
        :meth:`finish`)."""
        used = [*used, *(self.derived[n.id] for n in used if n.id in self.derived)]
        slots = list(dict.fromkeys(self.slots[n.id] for n in used))
        ranged = [I64, I64] if split else []
        ty = ir.FunctionType(ir.VoidType(), [I64.as_pointer(),
                                             *(_ELEM[self.nodes[k].prec].as_pointer()
                                               for k in slots), *ranged])
        self.fn = ir.Function(self.module, ty, name=f"item{len(self.calls)}")
        self.fn.linkage = "internal"
        self.fn.attributes.add("noinline")  # inlining would rebuild one huge function
        for arg in self.fn.args[1:1 + len(slots)]:
            arg.add_attribute("noalias")
        self.table = self.fn.args[0]
        self.args = {k: self.fn.args[1 + j] for j, k in enumerate(slots)}
        self.range = tuple(self.fn.args[-2:]) if split else None
        self.scratch_pointers: dict[int, ir.Value] = {}  # scratch number -> its address
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
        self.calls.append((self._same_item(self.fn), slots, (split, per_thread),
                           list(self.scratch_pointers)))

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

    def scratch_for(self, size: int, role: str, elem: ir.Type) -> ir.Value:
        """The scratch array of ``role`` (a copy, a product's output, a scatter's f32 target),
        allocated once per bound routine. An item reads the addresses of those it uses from
        its table argument, in the order it first uses them (``finish`` points each call at a
        block of its own in the routine's table), so items differing only in which arrays
        they use are the same code. Each use extends the array's span of items, which decides
        what it may share memory with."""
        k = self.scratch.setdefault((size, role, elem), len(self.scratch))
        at = self.base + len(self.calls)  # the item being emitted
        span = self.uses.setdefault(k, [at, at])
        span[0], span[1] = min(span[0], at), max(span[1], at)
        if k not in self.scratch_pointers:
            e = self.entry
            address = e.load(e.gep(self.table, [const_int(len(self.scratch_pointers))]))
            self.scratch_pointers[k] = e.inttoptr(address, elem.as_pointer())
        return self.scratch_pointers[k]

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
        item in order, with its block of the table (``_scratch_table``). A split item goes to the
        thread pool (``pool.py``) with its arguments in a frame: its outermost loop is cut into
        chunks (``per_thread`` per thread) that the pool's threads claim."""
        entry = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [I64.as_pointer()]),
                            name="part")
        self.b = b = ir.IRBuilder(entry.append_basic_block("entry"))
        self.fn = entry
        table = entry.args[0]
        used = sorted({k for _, slots, _, _ in self.calls for k in slots})
        pointers = {k: b.inttoptr(b.load(b.gep(table, [const_int(k)])),
                                  _ELEM[self.nodes[k].prec].as_pointer()) for k in used}
        for fn, slots, (split, per_thread), scratch in self.calls:
            args = [self._scratch_table(table, scratch), *(pointers[k] for k in slots)]
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

    def _scratch_table(self, table: ir.Value, scratch: list[int]) -> ir.Value:
        """The table of an item's call: a block of the routine's table, past its nodes, that
        binding fills with the addresses of the scratch arrays the item uses, in its order
        (``CompiledRoutine.bind``); so a call passes a pointer and copies nothing."""
        if not scratch:
            return table
        at = len(self.nodes) + len(self.tables)
        self.tables.extend(scratch)
        return self.b.gep(table, [const_int(at)])

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
        F16C outside a copy (``_widens_in_lanes``)."""
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
        """The flat row-major offset of ``node[idx]``."""
        b = self.b
        terms: list[ir.Value] = []
        const = 0
        for i, stride, dim in zip(idx, node.strides, node.dims, strict=True):
            if isinstance(i, Fixed):
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
             iters: dict[int, ir.Value], compute: ir.Type) -> ir.Value:
        """``node[idx]`` widened to its compute type, or 0 where an affine index falls outside
        the node (padding: the load then reads cell 0 and its value is not used)."""
        b = self.b
        if node.id in self.held:  # handed over in a register (``LoopGroup.registers``)
            held = self.held[node.id]
            return self.widen(held, node.prec) if node.prec.is_narrow else held
        off = self.offset(node, idx, iters)
        cond = self.in_bounds(node, idx, space, iters)
        if cond is not None:
            off = b.select(cond, off, const_int(0))
        if node.id in self.redirect:
            value = b.load(b.gep(self.redirect[node.id], [off]))
        elif node.id in self.derived:  # the wider node, rounded as the copy would store it
            value = self._rounded(node, b.load(b.gep(self.buffer(self.derived[node.id]),
                                                     [off])))
        elif node.id in self.forwarded:  # rounded as the GEMM's rounding item would store it
            g = self.forwarded[node.id]
            wide = b.load(b.gep(self._gemm_out(g, _FLOAT[node.prec.compute]), [off]))
            copying, self.copying = self.copying, False
            value = self.round_to(wide, node.prec)
            self.copying = copying
        else:
            value = b.load(b.gep(self.buffer(node), [off]))
            if node.prec.is_narrow:
                value = self.widen(value, node.prec)
        if cond is not None:
            value = b.select(cond, value, ir.Constant(value.type, 0.0))
        return value

    def store(self, node: Tnode, off: ir.Value, value: ir.Value, exact: bool = False) -> None:
        """``exact``: the value is representable in the node's precision (:meth:`representable`),
        so a bf16 store keeps its top half instead of rounding it (the same bits, NaN too)."""
        b = self.b
        if node.id in self.redirect:
            b.store(convert(b, value, F32), b.gep(self.redirect[node.id], [off]))
            return
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
        or ops that select among such values (``ops.representable``)."""
        if isinstance(e, Const):
            return bool(np.isfinite(e.value)) and float(
                np.array(e.value, prec.numpy_dtype)) == e.value
        if isinstance(e, Get):
            return e.node.prec is prec and e.node.id not in self.redirect
        assert isinstance(e, Apply)
        units = [(isinstance(a, Const) and a.value in (0.0, 1.0, -1.0))
                 or (isinstance(a, Apply) and ops_module.flag(a.op)) for a in e.args]
        return ops_module.representable(
            e.op, [self.representable(a, prec) for a in e.args], units)

    def expr(self, e: Expr, compute: ir.Type, space: tuple[int, ...],
             iters: dict[int, ir.Value]) -> ir.Value:
        if isinstance(e, Const):
            return ir.Constant(compute, e.value)
        if isinstance(e, Get):
            return self.load(e.node, e.idx, space, iters, compute)
        assert isinstance(e, Apply)
        args = [self.expr(a, compute, space, iters) for a in e.args]
        return IR_OPS[e.op](self, compute, *args)

    def combine(self, accum: str, old: ir.Value, new: ir.Value, compute: ir.Type) -> ir.Value:
        return IR_OPS["add" if accum == "+" else accum](self, compute, old, new)

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
        """One loop over the lead nest's parallel iterators running every nest's body.

        16-bit nodes a reduction reads many times over are widened to f32 copies first (once
        per run, exactly), so its inner loop loads f32 as an f32 nest does. A scatter into
        16-bit storage accumulates in an f32 copy of its target, rounded to 16 bits once at
        the end (as a reduction's local is), not at every point."""
        lead = g.lead
        space = lead.space
        if 0 in space:
            return
        iters: dict[int, ir.Value] = {}
        lhs = lead.assign.lhs
        widened = self._widen_reused(lead)
        target = lead.scatter and lhs.prec.is_narrow and lead.assign.accum != "="
        # A shared scatter's range is of the target's first axis: its block of cells.
        cells = None
        if self.range and lead.scatter:
            cells = tuple(self.b.mul(v, const_int(lhs.strides[0])) for v in self.range)
        if target:
            wide = self.scratch_for(lhs.size, "scatter", F32)
            self.convert_into(self.buffer(lhs), lhs.prec, wide, lhs.size, cells=cells)
            self.redirect[lhs.id] = wide
        width = _jam(g)
        if lead.walk_rows:
            self._loops(list(lead.par[:-1]), space, iters,
                        lambda: self._row_walk(lead, space, iters), outer=True)
        elif width:
            lanes = self._lanes(lead, width, space)
            self._loops(list(lead.par[:-1]), space, iters,
                        lambda: self._jammed(lead, width, space, iters, lanes), outer=True)
            self.packed = {}
        else:
            self.registers = g.registers
            self._loops(list(lead.par), space, iters, lambda: self._par_body(g, space, iters),
                        outer=True)
            self.registers, self.held = frozenset(), {}
        for node in widened:
            del self.redirect[node.id]
        if target:
            del self.redirect[lhs.id]
            self.narrow_into(wide, self.buffer(lhs), lhs.prec, lhs.size, cells=cells)

    def reused_narrow(self, nest: LoopNest) -> list[Tnode]:
        """The 16-bit nodes a reduction reads (not its target) at least ``REUSE`` times per
        cell on average: it reads their f32 copies."""
        if not nest.red:
            return []
        points = math.prod(nest.space)
        out: list[Tnode] = []
        for get in reads(nest.assign.expr):
            node = get.node
            if (node.prec.is_narrow and node is not nest.assign.lhs
                    and points >= REUSE * node.size and node not in out):
                out.append(node)
        return out

    def _widen_reused(self, nest: LoopNest) -> list[Tnode]:
        """Let the f32 copies of :meth:`reused_narrow` stand in for those nodes in the
        nest's loads (made here unless an earlier item made them)."""
        out = [n for n in self.reused_narrow(nest) if n.id not in self.redirect]
        for node in out:
            self.redirect[node.id] = self.copy_of(node, F32)
        return out

    def copy_of(self, node: Tnode, ty: ir.Type, ranged: bool = False) -> ir.Value:
        """An exact copy of ``node``'s values as ``ty`` (f32, f64) in scratch of its own, made
        by the first item of a run that needs it and reused by later ones until an item writes
        the node (``written``); a large copy only by the next lowered item (``FRESH_COPY``).
        ``ranged``: this item makes its range of the copy."""
        key = self._current_copy(node, ty)
        if key is not None:
            self.copies[node.id] = (key, self.lowered)
            return self.scratch_for(*key)
        key = (node.size, f"copy{self.slots[node.id]}.{len(self.scratch)}", ty)
        copy = self.scratch_for(*key)
        if node.id in self.derived:
            b = self.b
            src = self.buffer(self.derived[node.id])
            with self.loop(*(self.range if ranged and self.range else (node.size,))) as i:
                v = self._rounded(node, b.load(b.gep(src, [i])))
                b.store(convert(b, v, ty), b.gep(copy, [i]))
        else:
            self.convert_into(self.buffer(node), node.prec, copy, node.size, ranged)
        self.copies[node.id] = (key, self.lowered)
        return copy

    def _current_copy(self, node: Tnode, ty: ir.Type) -> tuple[int, str, ir.Type] | None:
        """The scratch key of the copy of ``node`` as ``ty`` this item may read, if any."""
        current = self.copies.get(node.id)
        if current is None or current[0][2] != ty:
            return None
        key, last = current
        return None if node.size >= FRESH_COPY and self.lowered > last + 1 else key

    def has_copy(self, node: Tnode, ty: ir.Type) -> bool:
        return self._current_copy(node, ty) is not None

    def reads_directly(self, v: MatrixView, g: Gemm, compute: ir.Type, inline: bool) -> bool:
        """Whether an inline small product (``inline``) reads its right operand's 16-bit
        buffer itself, widening a vector of values as it loads them (two instructions), rather
        than an f32 copy made by an item of its own: a 16-bit node with a buffer of its own
        values and no current copy. The left operand's values are loaded one at a time and
        broadcast, which a copy's f32 values make one instruction."""
        node = v.node
        return (inline and v is g.b and compute == F32 and not self.has_copy(node, compute)
                and (node.prec is Precision.bf16
                     or (node.prec is Precision.f16 and self.hardware_f16))
                and node.id not in self.derived and node.id not in self.forwarded
                and node.id not in self.redirect)

    def gemm_copies(self, g: Gemm, inline: bool) -> list[tuple[Tnode, ir.Type]]:
        """What a GEMM needs converted before it runs, and is not: its operands not in its
        type (but those it reads directly: :meth:`reads_directly`), and a 16-bit target it
        accumulates into (the copy it accumulates in)."""
        compute = _FLOAT[g.assign.lhs.prec.compute]
        out = [(v.node, compute) for v in (g.a, g.b) if _ELEM[v.node.prec] != compute
               and not self.reads_directly(v, g, compute, inline)]
        lhs = g.assign.lhs
        if lhs.prec.is_narrow and not g.assign.reset:
            out.append((lhs, compute))
        seen: list[tuple[Tnode, ir.Type]] = []
        for node, ty in out:
            if not self.has_copy(node, ty) and all(node is not n for n, _ in seen):
                seen.append((node, ty))
        return seen

    def _gemm_out(self, g: Gemm, compute: ir.Type) -> ir.Value:
        """Where a GEMM with a 16-bit target writes its f32 / f64 result before rounding:
        the target's copy when it accumulates, a scratch array of its own when it resets."""
        lhs = g.assign.lhs
        if g.assign.reset:  # one array per product, so the arena can share it when done
            key = self.gemm_outs.setdefault(id(g), (lhs.size, f"out{len(self.scratch)}", compute))
            return self.scratch_for(*key)
        return self.copy_of(lhs, compute)

    def gemm_narrow(self, g: Gemm) -> None:
        """Round a 16-bit target's f32 / f64 result into it (this item's range of it)."""
        lhs = g.assign.lhs
        out = self._gemm_out(g, _FLOAT[lhs.prec.compute])
        self.narrow_into(out, self.buffer(lhs), lhs.prec, lhs.size, ranged=True)

    def written(self, nodes: list[Tnode]) -> None:
        """The item just emitted wrote ``nodes``: their copies are stale."""
        for node in nodes:
            self.copies.pop(node.id, None)

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
            if nest.assign.lhs.id in self.derived:
                continue  # its readers round the wider node themselves
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
        self.copying = overwrite and isinstance(a.expr, Get) and a.lhs.id not in self.for_gemms
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
        where ``lanes`` (``_lanes``), one vector accumulator, every term a vector of the
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
        ok = (a.reset and self._stride(Get(lhs, a.lhs_idx), nest.par[-1]) == 1
              and not ({lhs.id} & (self.redirect.keys() | self.derived.keys()))
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

    def _in_lanes(self, e: Expr, compute: ir.Type, last: int) -> bool:
        """Whether a jammed reduction's term can be computed for its cells as one vector, lane
        by lane (the scalar's operations, so the same bits): ops that vectors take as they
        are, reads of ``compute`` values from memory, padding that does not depend on
        ``last`` (the jammed iterator)."""
        if isinstance(e, Const):
            return True
        if isinstance(e, Apply):
            return e.op in LANE_OPS and all(self._in_lanes(x, compute, last) for x in e.args)
        assert isinstance(e, Get)
        node = e.node
        if node.id in self.redirect:  # an f32 copy stands in for it
            stored, plain = F32, True
        else:  # 16-bit values widen as they load, lane by lane
            stored = F32 if self._widens_in_lanes(node.prec) else _ELEM[node.prec]
            plain = not ({node.id} & (self.held.keys() | self.derived.keys()
                                      | self.forwarded.keys()))
        return (stored == compute and plain
                and not any(isinstance(i, Affine) and any(it == last and c for c, it in i.terms)
                            for i in e.idx))

    def _widens_in_lanes(self, prec: Precision) -> bool:
        """Whether a vector of 16-bit values of ``prec`` widens to f32 in a few instructions:
        bf16's a shift, f16's one conversion where the CPU has it."""
        return prec is Precision.bf16 or (prec is Precision.f16 and self.hardware_f16)

    def _lanes(self, nest: LoopNest, width: int, space: tuple[int, ...]) -> bool:
        """Whether the jammed reduction runs as a vector of its cells (``_in_lanes``), and its
        reads striding across the cells that depend on nothing but the jammed iterator and
        the reduction's (a convolution's kernel, channels apart) packed into stack arrays
        first (``packed``), so the loops over the other parallel iterators load them as
        vectors. Another striding read is a vector made of its cells at every term: worth it
        for a max or a min (a scalar's takes four instructions), not for a sum (gpt_mini's
        softmax sums: 43 -> 53-62 us; its maxes 117 -> 70 us)."""
        a = nest.assign
        compute = _FLOAT[a.lhs.prec.compute]
        last, red = nest.par[-1], list(nest.red)
        if not self._in_lanes(a.expr, compute, last):
            return False
        terms = math.prod(space[i] for i in red)
        packs, gathered = [], False
        for get in reads(a.expr):
            if self._stride(get, last) in (0, 1):
                continue
            moving = {i for i in get.idx if isinstance(i, int)} | {
                it for i in get.idx if isinstance(i, Affine) for c, it in i.terms if c}
            if moving <= {last, *red} and space[last] * terms <= PACK_LANES:
                packs.append(get)
            else:
                gathered = True
        if gathered and a.accum not in ("max", "min"):
            return False
        for get in packs:
            if id(get) not in self.packed:
                self.packed[id(get)] = (self._pack(get, width, last, red, space, compute), red,
                                        terms)
        return True

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

    @staticmethod
    def _stride(get: Get, last: int) -> int:
        """How far apart in memory ``get`` reads for consecutive values of ``last``."""
        node = get.node
        return sum(st for i, st, dim in zip(get.idx, node.strides, node.dims, strict=True)
                   if i == last and not isinstance(i, Affine) and dim > 1)

    def _lanes_expr(self, e: Expr, compute: ir.Type, width: int, last: int,
                    space: tuple[int, ...], iters: dict[int, ir.Value]) -> ir.Value:
        """``e`` for ``width`` cells from ``iters[last]`` on, as a vector (``_in_lanes``): a read
        along ``last`` is a vector load, one not moving with it a broadcast, one striding
        across it a vector made of its cells."""
        vec = ir.VectorType(compute, width)
        if isinstance(e, Const):
            return ir.Constant(vec, e.value)
        if isinstance(e, Apply):
            args = [self._lanes_expr(x, compute, width, last, space, iters) for x in e.args]
            return IR_OPS[e.op](self, compute, *args)
        assert isinstance(e, Get)
        b, node = self.b, e.node
        if id(e) in self.packed:  # the block's cells side by side for each term
            pack, red, terms = self.packed[id(e)]
            at = b.add(b.mul(iters[last], const_int(terms)),
                       b.mul(self._term(red, space, iters), const_int(width)))
            return b.load(b.bitcast(b.gep(pack, [at]), vec.as_pointer()),
                          align=4 if compute == F32 else 8)
        base = self.redirect.get(node.id) or self.buffer(node)
        narrow = node.id not in self.redirect and node.prec.is_narrow
        loaded = ir.VectorType(I16, width) if narrow else vec
        stride = self._stride(e, last)
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

    def convert_into(self, src: ir.Value, src_prec: Precision, dst: ir.Value, size: int,
                     ranged: bool = False, cells: tuple[ir.Value, ...] | None = None) -> None:
        """Copy ``size`` values (``ranged``: this item's range of them; ``cells``: those from
        ``cells[0]`` to ``cells[1]``) into an f32 / f64 array, widening or converting each."""
        b = self.b
        with self.loop(*(cells or (self.range if ranged and self.range else (size,)))) as i:
            v = b.load(b.gep(src, [i]))
            v = self.widen(v, src_prec) if src_prec.is_narrow else v
            b.store(convert(b, v, dst.type.pointee), b.gep(dst, [i]))

    def _rounded(self, node: Tnode, wide: ir.Value) -> ir.Value:
        """A derived node's value from its wider node's: rounded to ``node``'s precision as
        its copy nest would store it, then widened as a load would."""
        copying, self.copying = self.copying, node.id not in self.for_gemms
        value = self.round_to(convert(self.b, wide, F32), node.prec)
        self.copying = copying
        return value

    def narrow_into(self, src: ir.Value, dst: ir.Value, prec: Precision, size: int,
                    ranged: bool = False, cells: tuple[ir.Value, ...] | None = None) -> None:
        b = self.b
        with self.loop(*(cells or (self.range if ranged and self.range else (size,)))) as i:
            b.store(self.narrow(b.load(b.gep(src, [i])), prec), b.gep(dst, [i]))

    def _matrix(self, v: MatrixView, g: Gemm, compute: ir.Type, inline: bool) -> ir.Value:
        """The operand's values: the buffer itself when it holds the GEMM's type or is read
        directly (:meth:`reads_directly`), else a converted copy."""
        if _ELEM[v.node.prec] == compute or self.reads_directly(v, g, compute, inline):
            return self.buffer(v.node)
        return self.copy_of(v.node, compute)

    @staticmethod
    def inline(g: Gemm, compute: ir.Type, along: str | None) -> bool:
        """Whether the product is computed inline (``small_product``) rather than by BLAS."""
        return along not in ("rows", "cols") and small_product.fits(g, compute)

    def gemm(self, g: Gemm, along: str | None, inline: bool) -> None:
        """``out (=|+=) a @ b``, one product per batch point: small ones inline
        (``small_product``, as the loops would compute them, when ``inline``: as
        :meth:`inline` decided), others through BLAS (:meth:`_blas_call`). ``along`` (when
        this item has a range): the range picks the batch points (``"batch"``, the first batch
        axis) or blocks of ``GEMM_BLOCK`` rows or columns of the product."""
        lhs = g.assign.lhs
        compute = _FLOAT[lhs.prec.compute]
        a = self._matrix(g.a, g, compute, inline)
        bm = self._matrix(g.b, g, compute, inline)
        out = self._gemm_out(g, compute) if lhs.prec.is_narrow else self.buffer(lhs)
        b = self.b
        first = (const_int(0), const_int(0), const_int(0))
        call: Callable[[tuple[ir.Value, ir.Value, ir.Value]], None]
        if inline:
            def call(offsets: tuple[ir.Value, ir.Value, ir.Value]) -> None:
                small_product.emit(self, g, compute, a, bm, out, offsets)
        else:
            call, first = self._blas_call(g, compute, a, bm, out, along)

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
                              tuple[ir.Value, ir.Value, ir.Value]]:
        """A BLAS call of ``g`` at given offsets (out, a, b), column-major: ``out^T = b^T
        a^T``; and the first offsets, this range's blocks' when ``along`` is rows or columns."""
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
        first = (const_int(0), const_int(0), const_int(0))
        if self.range and along in ("rows", "cols"):  # this range's blocks of the product
            lo, hi = (b.mul(v, const_int(GEMM_BLOCK)) for v in self.range)
            hi = b.select(b.icmp_unsigned("<", hi, const_int(m if along == "rows" else n)), hi,
                          const_int(m if along == "rows" else n))
            count = b.sub(hi, lo)
            b.store(b.trunc(count, self.blas_int) if self.blas_int != I64 else count,
                    rows if along == "rows" else cols)
            if along == "rows":
                first = (b.mul(lo, const_int(g.out_ld)),
                         lo if g.a.transposed else b.mul(lo, const_int(g.a.ld)), const_int(0))
            else:
                first = (lo, const_int(0), b.mul(lo, const_int(g.b.ld)) if g.b.transposed else lo)
        fixed = [by_ref(ir.Constant(char, ord(op_b))), by_ref(ir.Constant(char, ord(op_a))),
                 cols, rows, by_ref(const_int(k, self.blas_int)),
                 by_ref(ir.Constant(compute, 1.0))]
        ld_b = by_ref(const_int(g.b.ld, self.blas_int))
        ld_a = by_ref(const_int(g.a.ld, self.blas_int))
        beta_ref = by_ref(ir.Constant(compute, beta))
        ld_out = by_ref(const_int(g.out_ld, self.blas_int))
        gemm = self._gemm_function(compute)

        def call(offsets: tuple[ir.Value, ir.Value, ir.Value]) -> None:
            o_out, o_a, o_b = offsets
            b.call(gemm, [*fixed, b.gep(bm, [o_b]), ld_b, b.gep(a, [o_a]), ld_a, beta_ref,
                          b.gep(out, [o_out]), ld_out])

        return call, first

    def _gemm_function(self, compute: ir.Type) -> ir.Function:
        key = ("gemm", compute)
        if key not in self.functions:
            p8, p32, pf = ir.IntType(8).as_pointer(), self.blas_int.as_pointer(), \
                compute.as_pointer()
            ty = ir.FunctionType(ir.VoidType(), [p8, p8, p32, p32, p32, pf, pf, p32, pf, p32,
                                                 pf, pf, p32])
            self.functions[key] = ir.Function(self.module, ty, GEMM_SYMBOLS[compute])
        return self.functions[key]


# A reduction reading each cell of a 16-bit node at least this many times reads an f32 copy.
REUSE = 4
# A copy of this many cells or more is reused only by the lowered item that made or last read
# it and the next one (a GEMM's conversions, product and rounding are one); a later reader
# makes its own. Kept longer, it would hold its scratch from the
# forward pass to backprop (a weight's f32 copy, read by both), where the scratch arena
# could otherwise share it: widening again costs one pass over the node.
FRESH_COPY = 1 << 18

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


def routine_ir(code: list[Lowered], nodes: list[Tnode], target: Target
               ) -> tuple[list[str], list[tuple[int, str, int, int]], list[int]]:
    """The modules of a routine over ``nodes``, as LLVM IR text, each defining
    ``part(table)``: the routine runs them in order. Also its scratch arrays (size, "f32" |
    "f64", the first and the last item using it): nothing in one outlives a run, so arrays
    whose items do not overlap may share memory (``backend.py``). And the rest of its table,
    after the nodes' addresses: the numbers of the scratch arrays whose addresses go there,
    a block per item call that uses any. At most ``target.workers`` parts, each of at least
    ``PART_NESTS`` nests (``_part_bounds``)."""
    bounds = _part_bounds(code, target.workers)
    scratch: dict[tuple[int, str, ir.Type], int] = {}
    copies: dict[int, tuple[tuple[int, str, ir.Type], int]] = {}
    uses: dict[int, list[int]] = {}
    texts: list[str] = []
    base = 0
    for_gemms, forwarded, derived = _for_gemms(code), _forwarded(code), _derived(code)
    gemm_outs: dict[int, tuple[int, str, ir.Type]] = {}
    tables: list[int] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        r = RoutineIR(nodes, target, scratch, copies, uses, base, for_gemms, forwarded,
                      gemm_outs, derived, tables)
        for r.lowered, item in enumerate(code[lo:hi], lo):
            if isinstance(item, Gemm):
                _gemm_items(r, item, target.threads, target.products_shared)
            else:
                if isinstance(item, LoopGroup) and target.threads > 1:
                    # The f32 copies a shared reduction reads are made first, shared too.
                    for node in r.reused_narrow(item.lead):
                        if not r.has_copy(node, F32):
                            with r.item([node], _split_size(node.size)):
                                r.copy_of(node, F32, ranged=True)
                with r.item(_used(item), _split(item) if target.threads > 1 else None):
                    if isinstance(item, Fill):
                        r.fill(item)
                    else:
                        r.group(item)
            r.written(_written(item))
        base += len(r.calls)
        texts.append(r.finish())
    return texts, [(size, "f32" if ty == F32 else "f64", *uses[k])
                     for (size, _, ty), k in scratch.items()], tables


def _for_gemms(code: list[Lowered]) -> frozenset[int]:
    """The local nodes of ``code`` that only GEMMs read."""
    local = {n.id for n in nodes_of(code) if n.memory_mode is MemoryMode.local}
    gemm_read, other_read = set(), set()
    for item in code:
        if isinstance(item, Gemm):
            gemm_read |= {item.a.node.id, item.b.node.id}
            if not item.assign.reset:
                other_read.add(item.assign.lhs.id)
        elif isinstance(item, LoopGroup):
            for nest in item.nests:
                other_read |= {g.node.id for g in reads(nest.assign.expr)}
                if not (nest.assign.accum == "=" or nest.assign.reset):
                    other_read.add(nest.assign.lhs.id)
    return frozenset(local & gemm_read - other_read)


def _zero_or_nan(e: Expr) -> bool:
    """Whether every value of ``e`` is +-0 or NaN (a product with a constant 0: the gradient
    checksum's terms). A sum of such terms from +0 is +0 or NaN in any order, so it needs no
    fixed order of additions."""
    return isinstance(e, Apply) and e.op == "mul" and any(
        isinstance(x, Const) and x.value == 0.0 for x in e.args)


def _forwarded(code: list[Lowered]) -> dict[int, Gemm]:
    """Local 16-bit targets of GEMMs (with reset) that only pointwise nests of the next item
    read, by node id, with their GEMM: those nests read the GEMM's f32 result rounded as a
    store would round it, so the target is never stored (a cast twin's gradient flowing
    into its master's, a layer's product into its bias add)."""
    made: dict[int, Gemm] = {}
    at: dict[int, int] = {}  # node id -> the item of its GEMM
    bad: set[int] = set()
    read: set[int] = set()
    for k, item in enumerate(code):
        if isinstance(item, Fill):
            bad.add(item.node.id)
        elif isinstance(item, Gemm):
            bad |= {item.a.node.id, item.b.node.id}
            lhs = item.assign.lhs
            if (lhs.id in made or not item.assign.reset or not lhs.prec.is_narrow
                    or lhs.memory_mode is not MemoryMode.local):
                bad.add(lhs.id)
            made[lhs.id] = item
            at[lhs.id] = k
        else:
            for nest in item.nests:
                bad.add(nest.assign.lhs.id)
                if nest.red or nest.scatter:
                    bad |= {g.node.id for g in reads(nest.assign.expr)}
                else:  # read by the next item only: the f32 result is held no longer
                    got = {g.node.id for g in reads(nest.assign.expr)}
                    bad |= {i for i in got if i not in made or at[i] != k - 1}
                    read |= got
    return {i: g for i, g in made.items() if i not in bad and i in read}


def unstored(code: list[Lowered]) -> frozenset[int]:
    """The local nodes the routine never keeps in memory: values handed over in registers
    (``LoopGroup.registers``) and GEMM targets read from the GEMM's result (``_forwarded``).
    They need no place in the routine's arenas."""
    held = {i for item in code if isinstance(item, LoopGroup) for i in item.registers}
    return frozenset(held | set(_forwarded(code)) | set(_derived(code)))


def _derived(code: list[Lowered]) -> dict[int, Tnode]:
    """Local 16-bit nodes that are a rounded copy of a materialized wider node, cell for
    cell (a cast twin of its master), by node id, with that node: written once, and read
    only before anything writes the wider node again. Each read rounds the wider node as
    the copy would, so the copy is neither run nor stored: the twin recomputed at every read
    (``mixed_prec``'s ``"auto"`` placement)."""
    first: dict[int, tuple[int, Tnode]] = {}  # candidate id -> its item, its wider node
    writes: dict[int, list[int]] = {}
    last_read: dict[int, int] = {}
    for k, item in enumerate(code):
        r_ids, w_ids = accesses(item)
        for i in w_ids:
            writes.setdefault(i, []).append(k)
        for i in r_ids:
            last_read[i] = k
        if isinstance(item, LoopGroup) and not item.lead.walk_rows:
            for nest in item.nests:
                lhs, src = nest.assign.lhs, copy_source(nest)
                if (src is not None and lhs.memory_mode is MemoryMode.local
                        and lhs.prec.is_narrow and not src.prec.is_narrow
                        and src.memory_mode is MemoryMode.materialized):
                    first.setdefault(lhs.id, (k, src))
    out: dict[int, Tnode] = {}
    for i, (k, src) in first.items():
        end = last_read.get(i, k)
        if writes[i] == [k] and not any(k <= w <= end for w in writes.get(src.id, [])):
            out[i] = src
    return out



# The version of all the code whose output reaches a cached object (``version.py``): a cached
# routine compiled by other code is not reused.
_VERSION = version.VERSION


def signature(code: list[Lowered], nodes: list[Tnode], target: Target) -> str:
    """Everything :func:`routine_ir` builds the IR from, as text: the lowered code with nodes
    named by position, their dims and precisions, the flags and this module's version. Equal
    signatures give equal IR, so the disk cache is keyed by it and a warm process builds no
    IR at all."""
    slot = {n.id: k for k, n in enumerate(nodes)}

    def expr(e: Expr) -> str:
        if isinstance(e, Get):
            return f"g{slot[e.node.id]}{e.idx!r}"
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
                         f"{item.rows} {item.cols} {item.inner} {item.out_ld} {item.batch!r}")
        else:
            for nest in item.nests:
                a = nest.assign
                lines.append(f"nest {nest.par} {nest.red} {nest.scatter} {nest.walk_rows} "
                             f"{slot[a.lhs.id]}{a.lhs_idx!r} {a.accum} {a.reset} {a.space} "
                             f"{expr(a.expr)}")
            lines.append(f"end {sorted(slot[i] for i in item.registers)}")
    return "\n".join(lines)


# A loop group shares its outermost loop out over threads from this many points (points
# times nests) on: with the pool's workers spinning between jobs, an f32 exp over 4,096
# points already ran faster on 2 threads (6.5 against 5.5 us); 16,384 leaves room for
# cheaper arithmetic and sleeping workers.
PARALLEL_POINTS = 1 << 14


def _gemm_items(r: RoutineIR, g: Gemm, threads: int, shared: bool) -> None:
    """A GEMM as items: its operands' conversions, the product, the rounding of a 16-bit
    target; each shared over threads when large (the product by batch points, or by blocks
    of rows or columns, each block a BLAS call of its own)."""
    def split(size: int) -> int | None:
        return _split_size(size) if threads > 1 else None

    along, extent = _gemm_split(g) if shared else (None, 0)
    inline = r.inline(g, _FLOAT[g.assign.lhs.prec.compute], along)
    for node, ty in r.gemm_copies(g, inline):
        with r.item([node], split(node.size)):
            r.copy_of(node, ty, ranged=True)
    # One block range per thread: each range packs its operands again.
    with r.item(_used(g), extent if along else None, per_thread=1):
        r.gemm(g, along, inline)
    lhs = g.assign.lhs
    if lhs.prec.is_narrow and lhs.id not in r.forwarded:
        with r.item([lhs], split(lhs.size)):
            r.gemm_narrow(g)


# A product is shared out over threads from this many multiply-adds on, by blocks of this
# many rows or columns (a multiple of the BLAS kernels' widths).
GEMM_SPLIT_FLOPS = 1 << 18
GEMM_BLOCK = 16


def _gemm_split(g: Gemm) -> tuple[str | None, int]:
    """How a product is shared: by the first batch axis; else by blocks of its rows when it
    has more rows than columns (each block then packs all of ``b`` again, the smaller
    operand), else of its columns."""
    work = g.rows * g.cols * g.inner * math.prod(axis.size for axis in g.batch)
    if work < GEMM_SPLIT_FLOPS:
        return None, 0
    if g.batch:
        return ("batch", g.batch[0].size) if g.batch[0].size > 1 else (None, 0)
    along, size = ("rows", g.rows) if g.rows > g.cols else ("cols", g.cols)
    blocks = -(-size // GEMM_BLOCK)
    return (along, blocks) if blocks > 1 else (None, 0)


def shares_products(code: list[Lowered], target: Target) -> bool:
    """Whether the routine shares a product over the pool's threads: it then runs BLAS
    single-threaded (a product below ``GEMM_SPLIT_FLOPS`` runs on one thread in OpenBLAS
    anyway)."""
    return target.products_shared and any(
        isinstance(item, Gemm) and _gemm_split(item)[0] is not None for item in code)


def _split_size(size: int) -> int | None:
    """A conversion over ``size`` cells is shared over threads when it is large."""
    return size if size >= PARALLEL_POINTS else None


def _split(item: Lowered) -> int | None:
    """The extent of the outermost loop a loop group may share out over threads, or None.
    Distinct iterations of it write distinct cells and read nothing another writes (the group
    is pointwise, or a reduction over its inner iterators), so each thread computes its cells
    as one would, bit for bit. A scatter's cells move with its reductions: it is shared only
    by its first parallel iterator, where that is its target's first axis and the scatter
    reads no other cell of its target, so each thread's points write a block of the target's
    own (a max pool's gradient, batch point by batch point)."""
    if not isinstance(item, LoopGroup):
        return None
    lead = item.lead
    if math.prod(lead.space) * len(item.nests) < PARALLEL_POINTS:
        return None
    if lead.scatter:
        a = lead.assign
        if (len(item.nests) > 1 or not lead.par or a.lhs_idx[0] != lead.par[0]
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


# A row walk with no other parallel iterator (a bias's gradient, a checksum's partial sums) is
# shared over threads by blocks of this many cells of its row, when it has at least
# ROW_BLOCKS_MIN of them. Measured on 2 threads, sums over 1024 rows of a row of 512 cells:
# 64 -> 48 us; of 1024 cells: memory-bound, 160 us either way; of 128 cells: 8 -> 10 us.
ROW_BLOCK, ROW_BLOCKS_MIN = 64, 4


# A lone reduction of at least JAM_TERMS terms per cell runs JAM_WIDTH cells at once (or
# half, or a quarter, whichever divides its last parallel iterator).
JAM_WIDTH, JAM_TERMS = 8, 8
# The ops a jammed reduction's term may use to run as a vector of its cells (``_in_lanes``).
LANE_OPS = frozenset({"add", "sub", "mul", "max", "min", "relu"})
# At most this many cells of a read are packed for the lanes (a stack array each).
PACK_LANES = 1 << 12


def _jam(g: LoopGroup) -> int:
    """How many cells of a lone reduction (not a row walk, a scatter or an overwrite) to
    compute at once; 0: one at a time. Its last parallel iterator must not be its first (a
    thread's range is of the first)."""
    if len(g.nests) != 1:
        return 0
    nest = g.lead
    if (nest.walk_rows or nest.scatter or not nest.red or len(nest.par) < 2
            or nest.assign.accum not in ("+", "max")
            or math.prod(nest.space[i] for i in nest.red) < JAM_TERMS):
        return 0
    extent = nest.space[nest.par[-1]]
    for width in (JAM_WIDTH, JAM_WIDTH // 2, JAM_WIDTH // 4):
        if width > 1 and extent % width == 0:
            return width
    return 0


def _written(item: Lowered) -> list[Tnode]:
    if isinstance(item, Fill):
        return [item.node]
    if isinstance(item, Gemm):
        return [item.assign.lhs]
    return [nest.assign.lhs for nest in item.nests]


def _used(item: Lowered) -> list[Tnode]:
    """The nodes a lowered item reads or writes."""
    if isinstance(item, Fill):
        return [item.node]
    if isinstance(item, Gemm):
        return [item.assign.lhs, item.a.node, item.b.node]
    return [n for nest in item.nests
            for n in (nest.assign.lhs, *(g.node for g in reads(nest.assign.expr)))]
