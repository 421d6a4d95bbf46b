"""The CPU renderer's spelling of every op: its LLVM IR builder, by the op table's row name.

The op table (``ocannl.ir.ops``) says what an op is (arity, reference, gradient, flags) and
imports no backend; each renderer spells the ops in a table of its own keyed by the rows'
names: this one for LLVM IR, :data:`ocannl.backends.emit.C_TEMPLATES` for C.
``tests/backends/test_op_spellings.py`` checks that both tables have exactly the table's rows.

A builder takes the emitter (``codegen.RoutineIR``: its IR builder ``b``, its ``module`` and its
declared ``functions``), the computation's type and the operands, scalars or vectors (an op
whose row says ``lanes`` builds a vector of the scalar results). It is made of the pieces in
:mod:`ocannl.backends.cpu.scalar` (the f32 polynomials, C's conversions) and written so that
NaN and infinities propagate the way PyTorch's ops do (``relu(nan)`` is ``nan``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from llvmlite import ir

from ocannl.backends.cpu import scalar
from ocannl.backends.cpu.scalar import Emitter
from ocannl.ir.ops import HASH_BITS, HASH_G

Builder = Callable[..., ir.Value]  # (emitter, compute type, *operands) -> value


def _pow_ir(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
    x, y = scalar.unify(r.b, x, y)
    fn = r.functions.setdefault(("llvm.pow", x.type),
                                r.module.declare_intrinsic("llvm.pow", [x.type]))
    return r.b.call(fn, [x, y])


def _relu_ir(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    zero = ir.Constant(x.type, 0.0)
    return r.b.select(r.b.fcmp_ordered("<", x, zero), zero, x)


def _sigmoid_ir(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    b = r.b
    one = ir.Constant(x.type, 1.0)
    e = scalar.exp(r, compute, b.fneg(x))
    return b.fdiv(one, b.fadd(one, e))


def _isfinite_ir(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    b = r.b
    magnitude = b.call(r.function("llvm.fabs", x.type), [x])
    finite = b.fcmp_ordered("!=", magnitude, ir.Constant(x.type, math.inf))
    return b.select(finite, ir.Constant(compute, 1.0), ir.Constant(compute, 0.0))


def _where_ir(r: Emitter, compute: ir.Type, c: ir.Value, x: ir.Value, y: ir.Value) -> ir.Value:
    b = r.b
    x, y = scalar.unify(b, x, y)
    return b.select(b.fcmp_unordered("!=", c, ir.Constant(c.type, 0.0)), x, y)


# Integer hashing (see the comment above ``ocannl.ir.ops.HASH_BITS``): operands are read as
# integers, modulo 2**52.
_MASK = (1 << HASH_BITS) - 1


def _u_ir(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``x`` truncated to an unsigned integer; 0 for a negative, non-finite or >= 2**53 one."""
    ok = b.and_(b.fcmp_ordered(">=", x, ir.Constant(x.type, 0.0)),
                b.fcmp_ordered("<", x, ir.Constant(x.type, 9007199254740992.0)))
    return b.select(ok, b.fptoui(x, scalar.I64), scalar.const_int(0))


def _hash_add_ir(r: Emitter, compute: ir.Type, s: ir.Value, v: ir.Value) -> ir.Value:
    b, k = r.b, scalar.const_int
    step = b.mul(b.add(_u_ir(b, v), k(1)), k(HASH_G))
    return b.uitofp(b.and_(b.add(_u_ir(b, s), step), k(_MASK)), compute)


def _hash_xsm_ir(r: Emitter, compute: ir.Type, x: ir.Value, shift: ir.Value,
                 mult: ir.Value) -> ir.Value:
    b, k = r.b, scalar.const_int
    ux = _u_ir(b, x)
    mixed = b.xor(ux, b.lshr(ux, b.and_(_u_ir(b, shift), k(63))))
    return b.uitofp(b.and_(b.mul(mixed, _u_ir(b, mult)), k(_MASK)), compute)


def _hash_unit_ir(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    b = r.b
    top = b.uitofp(b.lshr(_u_ir(b, x), scalar.const_int(HASH_BITS - 24)), compute)
    return b.fdiv(top, ir.Constant(compute, 16777216.0))


BUILDERS: dict[str, Builder] = {
    # binary
    "add": scalar.binary("fadd"),
    "sub": scalar.binary("fsub"),
    "mul": scalar.binary("fmul"),
    "div": scalar.binary("fdiv"),
    "pow": _pow_ir,
    "max": scalar.extremum(">="),
    "eq": scalar.compare("=="),
    "gt": scalar.compare(">"),
    # unary
    "neg": lambda r, compute, x: r.b.fneg(x),
    "relu": _relu_ir,
    "exp": scalar.exp,
    "log": scalar.call("llvm.log"),
    "tanh": scalar.tanh,
    "sigmoid": _sigmoid_ir,
    "sqrt": scalar.call("llvm.sqrt"),
    "isfinite": _isfinite_ir,
    # ternary: a select, never a multiply (inf * 0 is nan)
    "where": _where_ir,
    # comparisons beyond eq / gt (false against NaN, but ne)
    "lt": scalar.compare("<"),
    "le": scalar.compare("<="),
    "ge": scalar.compare(">="),
    "ne": scalar.compare("!=", ordered=False),
    "min": scalar.extremum("<="),
    "abs": scalar.call("llvm.fabs"),
    "erf": scalar.erf,
    # libm's
    "cos": scalar.call("llvm.cos"),
    "sin": scalar.call("llvm.sin"),
    "floor": scalar.call("llvm.floor"),
    # integer hashing for counter-based random draws
    "hash_add": _hash_add_ir,
    "hash_xsm": _hash_xsm_ir,
    "hash_unit": _hash_unit_ir,
}
