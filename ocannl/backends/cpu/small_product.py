"""Small matrix products as register-blocked loops, inline, instead of a BLAS call each.

Attention's products are many tiny ones (a 64x32 by 32x64 product per head and batch point):
a BLAS call costs about as much as the arithmetic there, and OpenBLAS's small-matrix path is
slower still when an operand is transposed. Here a block of output rows by one vector of
columns (``Gemm.block``, scheduling's) stays in registers while the inner dimension is walked
in order: each cell takes ``acc + a * b`` term by term from +0.0, multiply and add apart, as
the plain reduction loop does, so the result is bitwise that of the loops (then ``old + acc``
when accumulating, as theirs). A right operand stored transposed is first packed row-major on
the stack. A swapped product (``Gemm.swapped``) is computed as ``out^T = b^T @ a^T``, each
cell stored where ``out`` keeps it: the same sums.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llvmlite import ir

from ocannl.backends.cpu.scalar import F16, F32, I16, I32, const_int
from ocannl.ir.lowered import MatrixView
from ocannl.ir.lowering import Gemm
from ocannl.ir.ops import Precision

if TYPE_CHECKING:
    from ocannl.backends.cpu.codegen import RoutineIR


def _transposed(v: MatrixView) -> MatrixView:
    """``v`` read as its transpose: the same storage."""
    return MatrixView(v.node, v.cols, v.rows, not v.transposed, v.ld)


def emit(r: RoutineIR, g: Gemm, compute: ir.Type, a: ir.Value, bm: ir.Value, out: ir.Value,
         offsets: tuple[ir.Value, ir.Value, ir.Value]) -> None:
    """One product, ``out (+)= a @ b`` at ``offsets`` (out, a, b) in the three arrays
    (scheduling chose this kernel for it, its orientation and its register block:
    ``ocannl.ir.schedule.inline_product``)."""
    b = r.b
    o_out, o_a, o_b = offsets
    left, right, rows, cols = g.a, g.b, g.rows, g.cols
    if g.swapped:  # out^T = b^T @ a^T
        left, right, rows, cols = _transposed(g.b), _transposed(g.a), g.cols, g.rows
        a, bm, o_a, o_b = bm, a, o_b, o_a
    block_rows, w = g.block
    vec = ir.VectorType(compute, w)
    elem = 4 if compute == F32 else 8
    # A 16-bit right operand read directly (``RoutineIR.reads_directly``): widened as loaded.
    b_prec = right.node.prec if bm.type.pointee == I16 else None
    rows_b, ld_b = bm, right.ld
    if right.transposed:  # stored cols x inner: pack it inner x cols, widened
        pack = r.entry.alloca(ir.ArrayType(compute, g.inner * cols))
        rows_b, ld_b = r.entry.bitcast(pack, compute.as_pointer()), cols
        with r.loop(cols) as j, r.loop(g.inner) as k:
            src = b.add(o_b, b.add(b.mul(j, const_int(right.ld)), k))
            dst = b.add(b.mul(k, const_int(cols)), j)
            value = b.load(b.gep(bm, [src]))
            b.store(r.widen(value, b_prec) if b_prec else value, b.gep(rows_b, [dst]))
        o_b, b_prec = const_int(0), None
    zero = ir.Constant(vec, [0.0] * w)
    splat_mask = ir.Constant(ir.VectorType(I32, w), [0] * w)

    def a_at(i: ir.Value, k: ir.Value) -> ir.Value:
        """``a[i, k]``, wherever the view stores it."""
        at = (b.add(b.mul(k, const_int(left.ld)), i) if left.transposed
              else b.add(b.mul(i, const_int(left.ld)), k))
        return b.load(b.gep(a, [b.add(o_a, at)]))

    def vector_at(base: ir.Value, at: ir.Value) -> ir.Value:
        return b.bitcast(b.gep(base, [at]), vec.as_pointer())

    def b_row_at(at: ir.Value) -> ir.Value:
        """``w`` values of b's rows from ``at``: a vector load, widened from 16 bits."""
        if not b_prec:
            return b.load(vector_at(rows_b, at), align=elem)
        bits = b.load(b.bitcast(b.gep(rows_b, [at]), ir.VectorType(I16, w).as_pointer()),
                      align=2)
        if b_prec is Precision.bf16:
            wide = b.shl(b.zext(bits, ir.VectorType(I32, w)),
                         ir.Constant(ir.VectorType(I32, w), [16] * w))
            return b.bitcast(wide, vec)
        return b.fpext(b.bitcast(bits, ir.VectorType(F16, w)), vec)

    def put(i: ir.Value, col: ir.Value, value: ir.Value) -> None:
        """Row ``i``'s columns ``col ..< col + w`` into ``out`` (added to it when
        accumulating): a vector store, or, swapped, a cell each down ``out``'s column."""
        if not g.swapped:
            ptr = vector_at(out, b.add(o_out, b.add(b.mul(i, const_int(g.out_ld)), col)))
            if not g.assign.reset:
                value = b.fadd(b.load(ptr, align=elem), value)
            b.store(value, ptr, align=elem)
            return
        for lane in range(w):
            at = b.add(b.mul(b.add(col, const_int(lane)), const_int(g.out_ld)), i)
            ptr = b.gep(out, [b.add(o_out, at)])
            cell = b.extract_element(value, const_int(lane, I32))
            if not g.assign.reset:
                cell = b.fadd(b.load(ptr), cell)
            b.store(cell, ptr)

    def block(first: ir.Value, n: int, col: ir.Value) -> None:
        """Output rows ``first ..< first + n``, columns ``col ..< col + w``."""
        accs = [r.local(vec) for _ in range(n)]
        for acc in accs:
            b.store(zero, acc)
        row_ids = [b.add(first, const_int(u)) for u in range(n)]
        with r.loop(g.inner) as k:
            bv = b_row_at(b.add(o_b, b.add(b.mul(k, const_int(ld_b)), col)))
            for i, acc in zip(row_ids, accs, strict=True):
                s = b.insert_element(ir.Constant(vec, ir.Undefined), a_at(i, k), const_int(0, I32))
                splat = b.shuffle_vector(s, ir.Constant(vec, ir.Undefined), splat_mask)
                b.store(b.fadd(b.load(acc), b.fmul(splat, bv)), acc)
        for i, acc in zip(row_ids, accs, strict=True):
            put(i, col, b.load(acc))

    full, rest = divmod(rows, block_rows)
    with r.loop(cols // w) as jb:
        col = b.mul(jb, const_int(w))
        if full:
            with r.loop(full) as ib:
                block(b.mul(ib, const_int(block_rows)), block_rows, col)
        if rest:
            block(const_int(full * block_rows), rest, col)
