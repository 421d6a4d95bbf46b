"""Scalar code for the CPU backend: the op table's meaning as LLVM IR, the f32 math built for
vectorization, and the exact 16-bit conversions.

Every builder takes the emitter (``codegen.RoutineIR``: its IR builder ``b``, its ``module``
and its declared ``functions``), the computation's type and the operands. Arithmetic follows
C's usual rules (an f32 meeting an f64 is widened); nothing is reassociated or contracted
except inside the polynomials of the f32 math, whose error budget allows fused
multiply-adds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from llvmlite import ir

from ocannl.ir.ops import HASH_BITS, HASH_G

I1, I16, I32, I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()

Emitter = Any  # codegen.RoutineIR (b, module, functions, function(name, type))


def const_int(v: int, ty: ir.IntType = I64) -> ir.Constant:
    return ir.Constant(ty, v)


# --- the op table's meaning, as IR ------------------------------------------------------------


def convert(b: ir.IRBuilder, v: ir.Value, ty: ir.Type) -> ir.Value:
    if v.type == ty:
        return v
    return b.fpext(v, ty) if ty == F64 else b.fptrunc(v, ty)


def _unify(b: ir.IRBuilder, *vs: ir.Value) -> list[ir.Value]:
    """Widen f32 operands meeting an f64 one (C's usual arithmetic conversions)."""
    ty = F64 if any(v.type == F64 for v in vs) else vs[0].type
    return [convert(b, v, ty) for v in vs]


def _binary(name: str) -> Callable:
    def op(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
        x, y = _unify(r.b, x, y)
        return getattr(r.b, name)(x, y)
    return op


def _compare(cmp: str, ordered: bool = True) -> Callable:
    def op(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
        x, y = _unify(r.b, x, y)
        test = (r.b.fcmp_ordered if ordered else r.b.fcmp_unordered)(cmp, x, y)
        return r.b.select(test, ir.Constant(compute, 1.0), ir.Constant(compute, 0.0))
    return op


def _extremum(cmp: str) -> Callable:
    """max / min: ``x`` where ``x cmp y`` or ``x`` is NaN, else ``y`` (NaN propagates)."""
    def op(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
        b = r.b
        x, y = _unify(b, x, y)
        keep = b.or_(b.fcmp_ordered(cmp, x, y), b.fcmp_unordered("uno", x, x))
        return b.select(keep, x, y)
    return op


def _call(name: str) -> Callable:
    def op(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
        return r.b.call(r.function(name, x.type), [x])
    return op


# f32 exp (and what builds on it) computed in f64 with plain arithmetic, so that loops calling
# it vectorize (libm's expf is a scalar call): n = round(x / ln 2), r = x - n ln 2 (|r| <=
# ln 2 / 2), e^r by its Taylor polynomial to r^11 (remainder below 2e-13 relative), times 2^n
# built from exponent bits; rounding that f64 to f32 is within an ulp of e^x (the test checks
# against NumPy's f64 exp). Beyond [-104, 89] the result is 0 or inf; NaN stays NaN.
_EXP_TERMS = 11
_LN2 = math.log(2.0)


def _horner(r: Emitter, t: ir.Value, coefs: list[float]) -> ir.Value:
    """``sum(coefs[k] * t**k)`` in f64, by Horner's rule with fused multiply-adds where the
    CPU has them (``llvm.fmuladd``: these polynomials' error budget allows either)."""
    key = ("llvm.fmuladd", F64)
    if key not in r.functions:
        r.functions[key] = ir.Function(r.module, ir.FunctionType(F64, [F64, F64, F64]),
                                       "llvm.fmuladd.f64")
    fma = r.functions[key]
    acc = ir.Constant(F64, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = r.b.call(fma, [acc, t, ir.Constant(F64, c)])
    return acc


def _exp_f32(r: Emitter, x: ir.Value) -> ir.Value:
    value = r.b.fptrunc(_exp_wide(r, r.b.fpext(x, F64)), F32)
    return r.b.select(r.b.fcmp_unordered("uno", x, x), x, value)


def _exp_wide(r: Emitter, xd: ir.Value) -> ir.Value:
    """e^xd in f64 for an f64 holding an f32 (0 below -104, beyond f32's range above 89)."""
    b = r.b
    clamped = b.select(b.fcmp_ordered("<", xd, ir.Constant(F64, -104.0)),
                       ir.Constant(F64, -104.0),
                       b.select(b.fcmp_ordered(">", xd, ir.Constant(F64, 89.0)),
                                ir.Constant(F64, 89.0), xd))
    rint = r.functions.setdefault(("llvm.rint", F64), r.module.declare_intrinsic("llvm.rint",
                                                                                  [F64]))
    n = b.call(rint, [b.fmul(clamped, ir.Constant(F64, 1.0 / _LN2))])
    red = b.fsub(clamped, b.fmul(n, ir.Constant(F64, _LN2)))
    poly = _horner(r, red, [1.0 / math.factorial(k) for k in range(_EXP_TERMS + 1)])
    scale = b.bitcast(b.shl(b.add(b.fptosi(n, I64), const_int(1023)), const_int(52)), F64)
    return b.fmul(poly, scale)


def _exp(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    if x.type == F32:
        return _exp_f32(r, x)
    return r.b.call(r.function("llvm.exp", x.type), [x])


def _tanh(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    """f32: ``1 - 2 / (e^(2x) + 1)`` through the vectorizable exp, in f64 (``x`` itself where
    |x| < 2^-12, whose cube is below half an ulp; the sign kept for large |x|)."""
    if x.type != F32:
        return r.b.call(r.function("tanh", x.type), [x])
    b = r.b
    e = _exp_wide(r, b.fmul(b.fpext(x, F64), ir.Constant(F64, 2.0)))
    one = ir.Constant(F64, 1.0)
    value = b.fptrunc(b.fsub(one, b.fdiv(ir.Constant(F64, 2.0), b.fadd(e, one))), F32)
    small = b.fcmp_unordered("<", b.call(r.function("llvm.fabs", F32), [x]),
                             ir.Constant(F32, 2.0 ** -12))
    return b.select(small, x, value)  # a NaN too


# f32 erf in f64 arithmetic, for the same reason: below 3.919206 (from where erf rounds to 1 in
# f32) its Maclaurin series in x^2 to the 60th term (the alternating terms cancel by at most 6
# of f64's 16 digits there; the first term left out is below 1e-12 of the sum), else +-1.
_ERF_TERMS = 60
_ERF_ONE = 3.919206


def _erf(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    if x.type != F32:
        return r.b.call(r.function("erf", x.type), [x])
    b = r.b
    xd = b.fpext(x, F64)
    z = b.fmul(xd, xd)
    series = _horner(r, z, [(-1) ** n / (math.factorial(n) * (2 * n + 1))
                            for n in range(_ERF_TERMS + 1)])
    value = b.fptrunc(b.fmul(b.fmul(series, xd), ir.Constant(F64, 2.0 / math.sqrt(math.pi))),
                      F32)
    one = b.select(b.fcmp_ordered("<", x, ir.Constant(F32, 0.0)), ir.Constant(F32, -1.0),
                   ir.Constant(F32, 1.0))
    beyond = b.fcmp_ordered(">=", b.call(r.function("llvm.fabs", F32), [x]),
                            ir.Constant(F32, _ERF_ONE))
    return b.select(beyond, one, value)  # a NaN stays NaN (the series of a NaN)


def _pow(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
    x, y = _unify(r.b, x, y)
    fn = r.functions.setdefault(("llvm.pow", x.type),
                                r.module.declare_intrinsic("llvm.pow", [x.type]))
    return r.b.call(fn, [x, y])


def _relu(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    zero = ir.Constant(x.type, 0.0)
    return r.b.select(r.b.fcmp_ordered("<", x, zero), zero, x)


def _sigmoid(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    b = r.b
    one = ir.Constant(x.type, 1.0)
    e = _exp(r, compute, b.fneg(x))
    return b.fdiv(one, b.fadd(one, e))


def _isfinite(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    b = r.b
    magnitude = b.call(r.function("llvm.fabs", x.type), [x])
    finite = b.fcmp_ordered("!=", magnitude, ir.Constant(x.type, math.inf))
    return b.select(finite, ir.Constant(compute, 1.0), ir.Constant(compute, 0.0))


def _where(r: Emitter, compute: ir.Type, c: ir.Value, x: ir.Value, y: ir.Value) -> ir.Value:
    b = r.b
    x, y = _unify(b, x, y)
    return b.select(b.fcmp_unordered("!=", c, ir.Constant(c.type, 0.0)), x, y)


# Integer hashing (see ``ops.HASH_BITS``): operands are read as integers, modulo 2**52.
_MASK = (1 << HASH_BITS) - 1


def _u(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """``x`` truncated to an unsigned integer; 0 for a negative, non-finite or >= 2**53 one."""
    ok = b.and_(b.fcmp_ordered(">=", x, ir.Constant(x.type, 0.0)),
                b.fcmp_ordered("<", x, ir.Constant(x.type, 9007199254740992.0)))
    return b.select(ok, b.fptoui(x, I64), const_int(0))


def _hash_add(r: Emitter, compute: ir.Type, s: ir.Value, v: ir.Value) -> ir.Value:
    b = r.b
    step = b.mul(b.add(_u(b, v), const_int(1)), const_int(HASH_G))
    return b.uitofp(b.and_(b.add(_u(b, s), step), const_int(_MASK)), compute)


def _hash_xsm(r: Emitter, compute: ir.Type, x: ir.Value, shift: ir.Value,
              mult: ir.Value) -> ir.Value:
    b = r.b
    ux = _u(b, x)
    mixed = b.xor(ux, b.lshr(ux, b.and_(_u(b, shift), const_int(63))))
    return b.uitofp(b.and_(b.mul(mixed, _u(b, mult)), const_int(_MASK)), compute)


def _hash_unit(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    b = r.b
    top = b.uitofp(b.lshr(_u(b, x), const_int(HASH_BITS - 24)), compute)
    return b.fdiv(top, ir.Constant(compute, 16777216.0))


IR_OPS: dict[str, Callable[..., ir.Value]] = {
    "add": _binary("fadd"),
    "sub": _binary("fsub"),
    "mul": _binary("fmul"),
    "div": _binary("fdiv"),
    "pow": _pow,
    "max": _extremum(">="),
    "min": _extremum("<="),
    "eq": _compare("=="),
    "gt": _compare(">"),
    "lt": _compare("<"),
    "le": _compare("<="),
    "ge": _compare(">="),
    "ne": _compare("!=", ordered=False),
    "neg": lambda r, compute, x: r.b.fneg(x),
    "relu": _relu,
    "exp": _exp,
    "log": _call("llvm.log"),
    "sqrt": _call("llvm.sqrt"),
    "abs": _call("llvm.fabs"),
    "tanh": _tanh,
    "erf": _erf,
    "sigmoid": _sigmoid,
    "isfinite": _isfinite,
    "where": _where,
    "hash_add": _hash_add,
    "hash_xsm": _hash_xsm,
    "hash_unit": _hash_unit,
}


# --- 16-bit conversions ----------------------------------------------------------------------
# Exact both ways, ties to even, subnormals and infinities exact; a NaN converts as NumPy (f16:
# payload kept, unquieted) and ml_dtypes (bf16: the signed canonical quiet NaN) convert it.
# The integer versions have no branches (every case computed, one selected) so loops calling
# them vectorize.


def _c32(v: int) -> ir.Constant:
    return ir.Constant(I32, v)


def f16_to_f32_hw(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    hw = b.bitcast(b.fpext(b.bitcast(h, F16), F32), I32)
    return b.bitcast(b.select(*_f16_nan(b, h), hw), F32)


def _f16_nan(b: ir.IRBuilder, h: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Whether ``h`` is a NaN, and its f32 pattern with the payload kept as is."""
    h32 = b.zext(h, I32)
    is_nan = b.icmp_unsigned(">", b.and_(h32, _c32(0x7FFF)), _c32(0x7C00))
    sign = b.shl(b.and_(h32, _c32(0x8000)), _c32(16))
    payload = b.shl(b.and_(h32, _c32(0x3FF)), _c32(13))
    return is_nan, b.or_(b.or_(sign, _c32(0x7F800000)), payload)


def f16_to_f32_soft(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    h32 = b.zext(h, I32)
    sign = b.shl(b.and_(h32, _c32(0x8000)), _c32(16))
    em = b.and_(h32, _c32(0x7FFF))
    normal = b.add(b.shl(em, _c32(13)), _c32(0x38000000))  # re-bias the exponent by 127 - 15
    special = b.add(b.shl(em, _c32(13)), _c32(0x70000000))  # inf / NaN: payload kept
    tiny = b.bitcast(b.fmul(b.uitofp(em, F32), ir.Constant(F32, 2.0**-24)), I32)  # exact
    bits = b.select(b.icmp_unsigned(">=", em, _c32(0x7C00)), special,
                    b.select(b.icmp_unsigned(">=", em, _c32(0x400)), normal, tiny))
    return b.bitcast(b.or_(bits, sign), F32)


def _f16_nan_from_f32(b: ir.IRBuilder, f: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The pattern ``f`` as i32, its magnitude bits, and its f16 NaN (top payload bits kept,
    at least one set, sign kept)."""
    bits = b.bitcast(f, I32)
    a = b.and_(bits, _c32(0x7FFFFFFF))
    payload = b.and_(b.lshr(a, _c32(13)), _c32(0x3FF))
    payload = b.select(b.icmp_unsigned("==", payload, _c32(0)), _c32(1), payload)
    sign = b.and_(b.lshr(bits, _c32(16)), _c32(0x8000))
    return bits, a, b.or_(b.or_(sign, _c32(0x7C00)), payload)


def f32_to_f16_hw(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    hw = b.bitcast(b.fptrunc(f, F16), I16)
    _, a, nan = _f16_nan_from_f32(b, f)
    return b.select(b.icmp_unsigned(">", a, _c32(0x7F800000)), b.trunc(nan, I16), hw)


def f32_to_f16_soft(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    bits, a, nan = _f16_nan_from_f32(b, f)
    sign = b.and_(b.lshr(bits, _c32(16)), _c32(0x8000))
    odd = b.and_(b.lshr(a, _c32(13)), _c32(1))
    # Normal range: re-bias, then round to nearest even by adding just under half an ulp.
    normal = b.lshr(b.add(b.add(b.sub(a, _c32(0x38000000)), _c32(0xFFF)), odd), _c32(13))
    # Below 2**-14: adding 0.5 makes the FPU round at the f16 subnormal quantum (2**-24).
    tiny = b.sub(b.bitcast(b.fadd(b.bitcast(a, F32), ir.Constant(F32, 0.5)), I32),
                 _c32(0x3F000000))
    h = b.select(b.icmp_unsigned(">", a, _c32(0x7F800000)), nan,
                 b.select(b.icmp_unsigned(">=", a, _c32(0x477FF000)),
                          b.or_(_c32(0x7C00), sign),
                          b.or_(b.select(b.icmp_unsigned(">=", a, _c32(0x38800000)), normal,
                                         tiny), sign)))
    return b.trunc(h, I16)


def f32_to_bf16(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    bits = b.bitcast(f, I32)
    nan = b.or_(b.and_(b.lshr(bits, _c32(16)), _c32(0x8000)), _c32(0x7FC0))
    odd = b.and_(b.lshr(bits, _c32(16)), _c32(1))
    rounded = b.lshr(b.add(b.add(bits, _c32(0x7FFF)), odd), _c32(16))
    is_nan = b.icmp_unsigned(">", b.and_(bits, _c32(0x7FFFFFFF)), _c32(0x7F800000))
    return b.trunc(b.select(is_nan, nan, rounded), I16)
