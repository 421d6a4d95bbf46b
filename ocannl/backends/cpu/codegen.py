"""LLVM IR for a routine: its fills, loop groups and products as functions of its buffers.

A routine is one or more parts, ``void part(i64* table)``, run in order: ``table`` holds the
address of every node's flat buffer, in the order of ``nodes``. A part calls one function per
lowered item (a fill, a loop group, a product) with the buffers that item uses.
Going straight from the lowered code to LLVM IR, with nothing between, keeps the compile time a
small multiple of LLVM's own, linear in the size of the step.

This module renders what lowering and scheduling decided (``ocannl.ir.schedule``): which
product runs in BLAS and which inline, which copies in f32 exist (they are nodes of their
own), which loops are shared over threads and in how many chunks, which reductions run
several cells at once and as vectors and how their vectors are stored, which values stay in
registers, which conversions keep a NaN's payload, which 16-bit stores are exact, which sums may
be reassociated. It decides none of it: its own choices are how to spell those in LLVM IR and
where to cut a routine into parts for the compiler (``PART_NESTS``, the same bits however
cut).

Arithmetic follows the usual C rules, the same as the CUDA backend's and NumPy's: an f32 value
meeting an f64 value is widened, literals take the nest's compute precision, and 16-bit storage
is widened to f32 on load and rounded once (nearest, ties to even) on store. Nothing is
reassociated or contracted, so results are bitwise those of the plain loops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from llvmlite import ir

from ocannl.backends import core
from ocannl.backends.cpu import pool, small_product, version
from ocannl.backends.cpu.op_builders import BUILDERS
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
    Expr,
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
    stored_in,
)
from ocannl.ir.ops import ACCUMS, Precision
from ocannl.ir.schedule import GEMM_BLOCK, ROW_BLOCK, read_stride
from ocannl.ir.target import Target
from ocannl.ir.tnode import Tnode

__all__ = ["GEMM16_SYMBOLS", "GEMM_SYMBOLS", "RoutineIR", "Target", "one_thread_products",
           "routine_ir", "signature"]

_VOID_P = ir.IntType(8).as_pointer()
_FLOAT = {Precision.f32: F32, Precision.f64: F64}
_PREC = {F32: Precision.f32, F64: Precision.f64}
_ELEM = {Precision.f64: F64, Precision.f32: F32, Precision.f16: I16, Precision.bf16: I16}
# The BLAS routines, resolved by the JIT (``jit.py`` maps these names to the chosen BLAS's):
# by compute type, and the products of two 16-bit operands into f32 by their precision
# (``native_products.py``).
GEMM_SYMBOLS = {F32: "ocannl_sgemm", F64: "ocannl_dgemm"}
GEMM16_SYMBOLS = {Precision.bf16: "ocannl_gemm_bf16", Precision.f16: "ocannl_gemm_f16"}


class RoutineIR:
    """Builds the IR of one part of a routine, for ``target``."""

    def __init__(self, nodes: list[Tnode], target: Target) -> None:
        self.module = ir.Module(name="ocannl")
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
        # Whether the conversions being emitted keep a signalling NaN's payload (as NumPy's
        # do): the nest's ``keeps_payload``, or a rounded read's source in its
        # ``payload_rounds``; elsewhere the plain instructions.
        self.copying = False
        # The nest being emitted: its rounded reads' conversions (``LoopNest.payload_rounds``).
        self.payload_rounds: frozenset[int] = frozenset()
        # The group's nodes kept in registers, and their values at the point being emitted.
        self.registers: frozenset[int] = frozenset()
        self.held_values: dict[int, ir.Value] = {}
        self.cell: ir.Value | None = None  # the flat cell of a ``flat`` group
        # A jammed reduction's reads packed as vectors of its cells, by id.
        self.packed: dict[int, tuple[ir.Value, list[int], int]] = {}
        # Its transposed reads at the term being emitted: a vector of the cells each, by id.
        self.transposed: dict[int, ir.Value] = {}
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
    def loop(self, lo: int | ir.Value, hi: ir.Value | None = None, vector: int = 0
             ) -> Iterator[ir.Value]:
        """``for i in range(lo)``, or ``range(lo, hi)``, never empty, as a bottom-tested loop
        over an i64; ``vector``: vectorized at that width, never unrolled."""
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
        latch = b.cbranch(b.icmp_unsigned("<", nxt, hi), head, after)
        if vector:
            latch.set_metadata("llvm.loop", self._vector_loop_id(vector))
        b.position_at_end(after)

    def _vector_loop_id(self, width: int) -> ir.MDValue:
        """A loop id (its own first operand, so distinct) asking LLVM's loop vectorizer for
        ``width`` lanes and its unroller to leave the loop alone."""
        m = self.module
        props = [m.add_metadata([ir.MetaDataString(m, "llvm.loop.unroll.disable")]),
                 m.add_metadata([ir.MetaDataString(m, "llvm.loop.vectorize.enable"),
                                 ir.Constant(ir.IntType(1), 1)]),
                 m.add_metadata([ir.MetaDataString(m, "llvm.loop.vectorize.width"),
                                 ir.Constant(I32, width)])]
        loop_id = ir.values.MDValue(m, [], name=str(len(m.metadata)))  # appended to m's
        loop_id.operands = (loop_id, *props)
        return loop_id

    @contextmanager
    def when_(self, cond: ir.Value) -> Iterator[None]:
        b = self.b
        then = self.fn.append_basic_block("then")
        after = self.fn.append_basic_block("endif")
        b.cbranch(cond, then, after)
        b.position_at_end(then)
        yield
        b.branch(after)
        b.position_at_end(after)

    def finish(self, cycles: int = 0) -> str:
        """Add ``part(table)``: load the addresses of the buffers the items use, call each
        item in order. A split item goes to the
        thread pool (``pool.py``) with its arguments in a frame: its outermost loop is cut into
        chunks (``per_thread`` per thread) that the pool's threads claim. ``cycles``: the
        address of an int64 per item, each call adding the time-stamp counter's ticks it took
        (a profile of the items in place: ``benchmarks/item_cycles.py``)."""
        entry = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [I64.as_pointer()]),
                            name="part")
        self.b = b = ir.IRBuilder(entry.append_basic_block("entry"))
        self.fn = entry
        table = entry.args[0]
        used = sorted({k for _, slots, _ in self.calls for k in slots})
        pointers = {k: b.inttoptr(b.load(b.gep(table, [const_int(k)])),
                                  _ELEM[self.nodes[k].prec].as_pointer()) for k in used}
        ticks = ir.Function(self.module, ir.FunctionType(I64, []), "llvm.readcyclecounter") \
            if cycles else None
        for j, (fn, slots, (split, per_thread)) in enumerate(self.calls):
            start = b.call(ticks, []) if ticks else None
            args = [pointers[k] for k in slots]
            if not split:
                b.call(fn, args)
            else:
                frame_ty = ir.LiteralStructType([a.type for a in args])
                frame = b.alloca(frame_ty)
                for k, a in enumerate(args):
                    b.store(a, b.gep(frame, [ir.Constant(I32, 0), ir.Constant(I32, k)]))
                b.call(self._pool_run(), [self._job(fn, frame_ty), b.bitcast(frame, _VOID_P),
                                          const_int(split), const_int(per_thread)])
            if ticks:
                count = b.inttoptr(const_int(cycles + 8 * j), I64.as_pointer())
                b.store(b.add(b.load(count), b.sub(b.call(ticks, []), start)), count)
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

    # The renderer core's words (``ocannl.backends.core.Spelling``): index arithmetic, reads,
    # values, stores and loops, as LLVM IR.

    def index(self, n: int) -> ir.Value:
        return const_int(n)

    def index_add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.add(a, b, flags=["nsw"])

    def index_scale(self, a: ir.Value, c: int) -> ir.Value:
        return a if c == 1 else self.b.mul(a, const_int(c), flags=["nsw"])

    def dynamic(self, node: Tnode) -> ir.Value:
        """The index node's value, loaded when the code runs."""
        b = self.b
        return b.fptosi(convert(b, b.load(self.buffer(node)), F32), I64)

    def at_least_zero(self, a: ir.Value) -> ir.Value:
        return self.b.icmp_signed(">=", a, const_int(0))

    def below(self, a: ir.Value, n: int) -> ir.Value:
        return self.b.icmp_signed("<", a, const_int(n))

    def both(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.b.and_(a, b)

    def literal(self, value: float, compute: Precision) -> ir.Value:
        return ir.Constant(_FLOAT[compute], value)

    def held(self, node: Tnode) -> ir.Value | None:
        """A node handed over in a register (``LoopGroup.registers``): its value, widened."""
        if node.id not in self.held_values:
            return None
        held = self.held_values[node.id]
        wide = like(held, F32) == held.type  # an exact 16-bit value held as it is (``store``)
        return self.widen(held, node.prec) if node.prec.is_narrow and not wide else held

    def read(self, node: Tnode, off: ir.Value, compute: Precision) -> ir.Value:
        """The cell's value, a 16-bit one widened to f32 (an f32 meeting an f64 widens where
        they meet, as C's rules say)."""
        value = self.b.load(self.b.gep(self.buffer(node), [off]))
        return self.widen(value, node.prec) if node.prec.is_narrow else value

    def pad(self, cond: ir.Value, value: ir.Value, compute: Precision) -> ir.Value:
        return self.b.select(cond, value, ir.Constant(value.type, 0.0))

    def guard_offset(self, cond: ir.Value, off: ir.Value) -> ir.Value:
        """Outside the node, the load reads cell 0 (its value then unused): a load always
        runs."""
        return self.b.select(cond, off, const_int(0))

    def op(self, name: str, compute: Precision, args: list[ir.Value]) -> ir.Value:
        return BUILDERS[name](self, _FLOAT[compute], *args)

    def any_order_add(self, acc: ir.Value, value: ir.Value, compute: Precision) -> ir.Value:
        """LLVM may keep several partial sums (in vectors): the same result."""
        return self.b.fadd(acc, convert(self.b, value, _FLOAT[compute]), flags=("reassoc",))

    def accumulator(self, value: ir.Value, compute: Precision) -> ir.Value:
        acc = self.local(_FLOAT[compute])
        self.b.store(value, acc)
        return acc

    def get(self, acc: ir.Value) -> ir.Value:
        return self.b.load(acc)

    def set(self, acc: ir.Value, value: ir.Value) -> None:
        self.b.store(convert(self.b, value, acc.type.pointee), acc)

    def over(self, nest: LoopNest, iters: dict[int, ir.Value], body: Callable[[], None]
             ) -> None:
        self._loops(list(nest.red), nest.space, iters, body)

    def when(self, cond: ir.Value, body: Callable[[], None]) -> None:
        with self.when_(cond):
            body()

    def store(self, node: Tnode, off: ir.Value, value: ir.Value, exact: bool = False) -> None:
        """``exact``: the value is representable in the node's precision
        (``LoopNest.exact_store``), so a bf16 store keeps its top half instead of rounding it
        (the same bits, NaN too)."""
        b = self.b
        if exact and node.id in self.registers:
            # One of the node's values: narrowing it and widening it back would give it again
            # (a NaN's payload is unspecified here), so later nests read it as it is.
            if like(value, F64) == value.type:
                value = b.fptrunc(value, like(value, F32))
            self.held_values[node.id] = value
            return
        if exact and node.prec is Precision.bf16:
            value = f32_to_bf16_exact(b, convert(b, value, F32))
        elif node.prec.is_narrow:
            value = self.narrow(value, node.prec)
        else:
            value = convert(b, value, _FLOAT[node.prec])
        if node.id in self.registers:  # later nests of the group read it here, not stored
            self.held_values[node.id] = value
            return
        b.store(value, b.gep(self.buffer(node), [off]))

    # The core's functions over LLVM types, for the CPU's own shapes (jammed reductions, row
    # walks, vectors of cells).

    def offset(self, node: Tnode, idx: Projection, iters: dict[int, ir.Value]) -> ir.Value:
        return core.offset(self, node, idx, iters)

    def in_bounds(self, node: Tnode, idx: Projection, space: tuple[int, ...],
                  iters: dict[int, ir.Value]) -> ir.Value | None:
        return core.in_bounds(self, node, idx, space, iters)

    def load(self, node: Tnode, idx: Projection, space: tuple[int, ...],
             iters: dict[int, ir.Value], compute: ir.Type) -> ir.Value:
        return core.load(self, node, idx, space, iters, _PREC[compute])

    def expr(self, e: Expr, compute: ir.Type, space: tuple[int, ...],
             iters: dict[int, ir.Value]) -> ir.Value:
        return core.expr(self, e, _PREC[compute], space, iters)

    def combine(self, accum: str, old: ir.Value, new: ir.Value, compute: ir.Type) -> ir.Value:
        return core.combine(self, accum, old, new, _PREC[compute])

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
        self.payload_rounds = lead.payload_rounds
        if g.row_sum:  # a lone row: no loop around it
            *heads, walk = g.nests
            self.registers = g.registers
            self._row_walk(walk, space, iters, point=lambda: self._bodies(heads, iters),
                           vector=g.inner_vector)
            self.registers, self.held_values = frozenset(), {}
        elif lead.walk_rows:
            self._loops(list(lead.par[:-1]), space, iters,
                        lambda: self._row_walk(lead, space, iters), outer=True)
        elif g.jam:
            if g.lanes:
                self._pack_reads(lead, g.jam, g.packed)
            self._loops(list(lead.par[:-1]), space, iters,
                        lambda: self._jammed(lead, g, space, iters), outer=True)
            self.packed = {}
        elif g.run:
            self._loops(list(lead.par[:-g.run]), space, iters,
                        lambda: self._copy_run(lead, g.run, space, iters), outer=True)
        elif g.flat:  # every access is the point's own cell: its flat offset
            self.registers = g.registers
            with self.loop(*(self.range or (const_int(0), const_int(math.prod(space))))) as i:
                self.cell = i
                self._par_body(g, space, iters)
            self.cell = None
            self.registers, self.held_values = frozenset(), {}
        else:
            self.registers = g.registers
            self._loops(list(lead.par), space, iters, lambda: self._par_body(g, space, iters),
                        outer=True, vector=g.inner_vector)
            self.registers, self.held_values = frozenset(), {}

    def _loops(self, order: list[int], space: tuple[int, ...], iters: dict[int, ir.Value],
               body: Callable[[], None], outer: bool = False, vector: int = 0) -> None:
        """Loops over ``order`` around ``body``; ``outer``: the first runs over this item's
        range when it has one (a thread's share); ``vector``: the innermost one is vectorized
        at that width."""
        if not order:
            body()
            return
        bounds = self.range if outer and self.range else (const_int(0), const_int(space[order[0]]))
        with self.loop(*bounds, vector=vector if len(order) == 1 else 0) as i:
            iters[order[0]] = i
            self._loops(order[1:], space, iters, body, vector=vector)

    def _par_body(self, g: LoopGroup, space: tuple[int, ...], iters: dict[int, ir.Value]) -> None:
        self._bodies(g.nests, iters)

    def _bodies(self, nests: Sequence[LoopNest], iters: dict[int, ir.Value]) -> None:
        """Every nest's body at the point (``core.nest``), its conversions keeping a NaN's
        payload where scheduling said so."""
        for nest in nests:
            self.payload_rounds = nest.payload_rounds
            self.copying = nest.keeps_payload
            core.nest(self, nest, iters)
            self.copying = False

    def _copy_run(self, nest: LoopNest, count: int, space: tuple[int, ...],
                  iters: dict[int, ir.Value]) -> None:
        """A padded copy's run of cells (``LoopGroup.run``: its last ``count`` iterators): the
        cells whose read falls outside the source are zeros, a stretch at either end of the
        run (the run's first iterator moves the one index that may leave its node) or the
        whole run (another index is outside); the stretch between is read and stored cell by
        cell, as the point-by-point nest would, in one loop the compiler vectorizes."""
        a = nest.assign
        get = a.expr
        assert isinstance(get, Get)
        run = nest.par[-count:]
        for it in run:
            iters[it] = const_int(0)
        cells = math.prod(space[it] for it in run)
        per_step = cells // space[run[0]]  # the cells of one step of the run's first iterator
        b = self.b
        lo: ir.Value = const_int(0)
        hi: ir.Value = const_int(cells)
        whole = None  # the indices the run does not move: all inside, or the run is zeros
        for i, dim in zip(get.idx, get.node.dims, strict=True):
            if not isinstance(i, Affine) or not any(i.outside(space, dim)):
                continue
            at = core.affine(self, i, iters)  # at the run's first cell
            if any(t == run[0] and c for c, t in i.terms):
                steps = const_int(space[run[0]])
                first = b.select(b.icmp_signed("<", at, const_int(0)), b.neg(at), const_int(0))
                first = b.select(b.icmp_signed("<", first, steps), first, steps)
                last = b.sub(const_int(dim), at)
                last = b.select(b.icmp_signed("<", last, steps), last, steps)
                last = b.select(b.icmp_signed("<", last, first), first, last)
                lo, hi = (self.index_scale(first, per_step), self.index_scale(last, per_step))
            else:
                inside = b.and_(self.at_least_zero(at), self.below(at, dim))
                whole = inside if whole is None else b.and_(whole, inside)
        if whole is not None:
            lo = b.select(whole, lo, const_int(0))
            hi = b.select(whole, hi, const_int(0))
        target, source = self.offset(a.lhs, a.lhs_idx, iters), self.offset(get.node, get.idx,
                                                                            iters)
        compute = a.lhs.prec.compute
        zero = self.literal(0.0, compute)
        self.payload_rounds = nest.payload_rounds
        self.copying = nest.keeps_payload

        def span(start: ir.Value, end: ir.Value, value: Callable[[ir.Value], ir.Value]) -> None:
            with self.when_(b.icmp_signed("<", start, end)), self.loop(start, end) as k:
                self.store(a.lhs, b.add(target, k, flags=["nsw"]), value(k), nest.exact_store)

        span(const_int(0), lo, lambda k: zero)
        span(lo, hi, lambda k: self.read(get.node, b.add(source, k, flags=["nsw"]), compute))
        span(hi, const_int(cells), lambda k: zero)
        self.copying = False

    def _jammed(self, nest: LoopNest, g: LoopGroup, space: tuple[int, ...],
                iters: dict[int, ir.Value]) -> None:
        """The reduction for ``width`` consecutive cells of its last parallel iterator at once:
        one accumulator each, every term of the reduction loop adding to all of them; or,
        where ``lanes``, one vector accumulator, every term a vector of the
        cells' terms. Each cell takes its terms in the usual order (the same bits); the
        cells' chains of dependent additions overlap instead of running one after another."""
        a = nest.assign
        width, lanes = g.jam, g.lanes
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

            if g.transposed:
                self._transposed_terms(nest, g, space, iters, cells, accs[0])
            else:
                self._loops(list(nest.red), space, iters, inner)
            if g.lane_store:
                self._store_lanes(nest, width, iters, b.load(accs[0]))
                return
            for u, cell in enumerate(cells):
                iters[last] = cell
                result = (b.extract_element(b.load(accs[0]), const_int(u, I32)) if lanes
                          else b.load(accs[u]))
                if not a.reset:
                    old = self.load(a.lhs, a.lhs_idx, space, iters, compute)
                    result = self.combine(a.accum, old, result, compute)
                self.store(a.lhs, self.offset(a.lhs, a.lhs_idx, iters), result)

    def _transposed_terms(self, nest: LoopNest, g: LoopGroup, space: tuple[int, ...],
                          iters: dict[int, ir.Value], cells: list[ir.Value],
                          acc: ir.Value) -> None:
        """The lanes' reduction loop, ``width`` terms at a time: each transposed read loaded as
        one vector of those terms per cell (contiguous along the reduction), the vectors
        transposed into one of the cells per term, and the terms added in order: each cell's
        additions are the scalar loop's (the same bits)."""
        a = nest.assign
        width, b = g.jam, self.b
        compute = _FLOAT[a.lhs.prec.compute]
        last, r = nest.par[-1], nest.red[0]
        gets = list(reads(a.expr))
        with self.loop(space[r] // width) as chunk:
            first = b.mul(chunk, const_int(width), flags=["nuw", "nsw"])
            rows: dict[int, list[ir.Value]] = {}  # each read's columns: a vector a term
            for k in g.transposed:
                get = gets[k]
                iters[r] = first
                loaded = []
                for cell in cells:
                    iters[last] = cell
                    loaded.append(self._vector_load(get.node, self.offset(get.node, get.idx, iters),
                                                    width, compute))
                rows[id(get)] = self._transpose(loaded)
            iters[last] = cells[0]
            for j in range(width):
                iters[r] = b.add(first, const_int(j), flags=["nuw", "nsw"])
                self.transposed = {key: columns[j] for key, columns in rows.items()}
                value = self._lanes_expr(a.expr, compute, width, last, space, iters)
                b.store(self.combine(a.accum, b.load(acc), value, compute), acc)
            self.transposed = {}

    def _transpose(self, rows: list[ir.Value]) -> list[ir.Value]:
        """The columns of ``rows`` (``w`` vectors of ``w`` lanes, ``w`` a power of two): the
        butterfly of shuffles, ``log2(w)`` stages, each swapping the off-diagonal blocks of
        its pairs of vectors ``g`` lanes wide."""
        b, w = self.b, len(rows)
        masks = ir.VectorType(I32, w)
        out, g = list(rows), 1
        while g < w:
            low = ir.Constant(masks, [p if p & g == 0 else w + p - g for p in range(w)])
            high = ir.Constant(masks, [p + g if p & g == 0 else w + p for p in range(w)])
            for i in range(w):
                if not i & g:
                    out[i], out[i + g] = (b.shuffle_vector(out[i], out[i + g], low),
                                          b.shuffle_vector(out[i], out[i + g], high))
            g *= 2
        return out

    def _vector_load(self, node: Tnode, off: ir.Value, width: int, compute: ir.Type
                     ) -> ir.Value:
        """``width`` consecutive values of ``node`` from ``off``, in ``compute`` (16-bit ones
        widened)."""
        b, narrow = self.b, node.prec.is_narrow
        loaded = ir.VectorType(I16, width) if narrow else ir.VectorType(compute, width)
        value = b.load(b.bitcast(b.gep(self.buffer(node), [off]), loaded.as_pointer()),
                       align=2 if narrow else (4 if compute == F32 else 8))
        return self.widen(value, node.prec) if narrow else value

    def _store_lanes(self, nest: LoopNest, width: int, iters: dict[int, ir.Value],
                     value: ir.Value) -> None:
        """Store a vector of a jammed reduction's cells (from ``iters[last]`` on) as one vector,
        rounded lane by lane to a 16-bit target (``LoopGroup.lane_store``)."""
        a = nest.assign
        lhs, b = a.lhs, self.b
        if lhs.prec.is_narrow:
            value = self.narrow(value, lhs.prec)
        elif value.type.element != _FLOAT[lhs.prec]:  # an f64 sum into an f32 target
            value = b.fptrunc(value, ir.VectorType(F32, width))
        at = b.gep(self.buffer(lhs), [self.offset(lhs, a.lhs_idx, iters)])
        b.store(value, b.bitcast(at, value.type.as_pointer()), align=lhs.prec.itemsize)

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
            return BUILDERS[e.op](self, compute, *args)
        assert isinstance(e, Get)
        b, node = self.b, e.node
        if id(e) in self.transposed:  # this term's, of each cell (_transposed_terms)
            return self.transposed[id(e)]
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
            value = self._vector_load(node, off, width, compute)
        else:
            if stride == 0:
                one = b.insert_element(ir.Constant(loaded, ir.Undefined),
                                       b.load(b.gep(base, [off])), const_int(0, I32))
                value = b.shuffle_vector(one, ir.Constant(loaded, ir.Undefined),
                                         ir.Constant(ir.VectorType(I32, width), [0] * width))
            else:
                value = ir.Constant(loaded, ir.Undefined)
                for u in range(width):
                    at = b.add(off, const_int(u * stride), flags=["nsw"])
                    value = b.insert_element(value, b.load(b.gep(base, [at])),
                                             const_int(u, I32))
            if narrow:
                value = self.widen(value, node.prec)
        if cond is not None:
            value = b.select(cond, value, ir.Constant(vec, 0.0))
        return value

    def _row_walk(self, nest: LoopNest, space: tuple[int, ...],
                  iters: dict[int, ir.Value], point: Callable[[], None] | None = None,
                  vector: int = 0) -> None:
        """The reduction with its last parallel iterator innermost: a row of accumulators,
        each taking its terms in the usual order, stored once at the end; ``point``, run at
        each point before its term is taken (``LoopGroup.row_sum``: the pointwise nests whose
        values the row sums); ``vector``: the row's loop vectorized at that width."""
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
            with self.loop(*cells, vector=vector) as i:
                iters[last] = i
                if point is not None:
                    point()
                    self.payload_rounds, self.copying = nest.payload_rounds, False
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

    def rounded(self, wide: ir.Value, source: Tnode, prec: Precision) -> ir.Value:
        """A read through a rounding (``Get.rounded``): ``wide`` rounded to ``prec`` as a store
        would round it, then widened as a load would: keeping a signalling NaN's bits where
        scheduling said so (``LoopNest.payload_rounds``: a virtual twin's copy would)."""
        copying, self.copying = self.copying, source.id in self.payload_rounds
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
        left, right = (g.b, g.a) if g.swapped else (g.a, g.b)  # the inline kernel's
        ok_right = right.node.prec is lhs.prec or (inline and right.node.prec.is_narrow)
        native = (not inline and g.a.node.prec is g.b.node.prec and lhs.prec is Precision.f32
                  and g.a.node.prec in self.native_products)
        if compute is None or not native and (left.node.prec is not lhs.prec or not ok_right):
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

def routine_ir(code: list[Lowered], nodes: list[Tnode], target: Target, cycles: int = 0
               ) -> list[str]:
    """The modules of a routine over ``nodes``, as LLVM IR text, each defining
    ``part(table)``: the routine runs them in order. Every array a routine uses is a node of
    its code (lowering's f32 copies too), its memory planned by the context with the others'.
    At most ``target.workers`` parts, each of at least ``PART_NESTS`` nests
    (``_part_bounds``). ``cycles``: the address of an int64 per item of ``code``, into which
    each run adds the counter ticks each item took (:meth:`RoutineIR.finish`)."""
    bounds = _part_bounds(code, target.workers)
    texts: list[str] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        r = RoutineIR(nodes, target)
        for item in code[lo:hi]:
            if isinstance(item, Gemm):
                # One block range per thread: each range packs its operands again.
                with r.item(stored_in(item), item.split_extent if item.split else None):
                    r.gemm(item)
            elif isinstance(item, Fill):
                with r.item(stored_in(item)):
                    r.fill(item)
            else:
                with r.item(stored_in(item), item.split, item.chunks):
                    r.group(item)
        texts.append(r.finish(cycles + 8 * lo if cycles else 0))
    return texts



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
                         f"{item.kernel} {item.swapped} {item.block} {item.split} "
                         f"{item.split_extent} {item.one_thread}")
        else:
            for nest in item.nests:
                a = nest.assign
                lines.append(f"nest {nest.par} {nest.red} {nest.scatter} {nest.walk_rows} "
                             f"{slot[a.lhs.id]}{a.lhs_idx!r} {a.accum} {a.reset} {a.space} "
                             f"{expr(a.expr)} {nest.keeps_payload} "
                             f"{sorted(slot[i] for i in nest.payload_rounds)} "
                             f"{nest.exact_store} {nest.any_order}")
            lines.append(f"end {sorted(slot[i] for i in item.registers)} {item.split} "
                         f"{item.chunks} {item.jam} {item.lanes} {item.packed} "
                         f"{item.transposed} "
                         f"{item.conversion} {item.flat} {item.lane_store} "
                         f"{item.inner_vector} {item.run} {item.row_sum}")
    return "\n".join(lines)


def one_thread_products(code: list[Lowered]) -> bool:
    """Whether scheduling runs the routine's library products single-threaded
    (``Gemm.one_thread``: it shares them over the pool's threads, a part each)."""
    return any(isinstance(item, Gemm) and item.one_thread for item in code)
