"""Scalar code for the CPU backend: the pieces the ops' LLVM builders are made of
(``op_builders.BUILDERS``: one per row of the op table, ``ocannl.ir.ops``), the f32 math built
for vectorization, and the exact 16-bit conversions. Nothing here imports the rest of ocannl.

Every builder takes the emitter (``codegen.RoutineIR``: its IR builder ``b``, its ``module``
and its declared ``functions``), the computation's type and the operands. Arithmetic follows
C's usual rules (an f32 meeting an f64 is widened); nothing is reassociated or contracted
except inside the polynomials of the f32 math, whose error budget allows fused
multiply-adds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from llvmlite import ir

I1, I16, I32, I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()

Emitter = Any  # codegen.RoutineIR (b, module, functions, function(name, type))


def const_int(v: int, ty: ir.IntType = I64) -> ir.Constant:
    return ir.Constant(ty, v)


# --- builders the op table's rows are made of ------------------------------------------


def convert(b: ir.IRBuilder, v: ir.Value, ty: ir.Type) -> ir.Value:
    if v.type == ty:
        return v
    return b.fpext(v, ty) if ty == F64 else b.fptrunc(v, ty)


def unify(b: ir.IRBuilder, *vs: ir.Value) -> list[ir.Value]:
    """Widen f32 operands meeting an f64 one (C's usual arithmetic conversions)."""
    ty = F64 if any(v.type == F64 for v in vs) else vs[0].type
    return [convert(b, v, ty) for v in vs]


def binary(name: str) -> Callable:
    """The builder of an arithmetic op: the IR builder's instruction ``name`` (``fadd``, ...)."""
    def op(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
        x, y = unify(r.b, x, y)
        return getattr(r.b, name)(x, y)
    return op


def compare(cmp: str, ordered: bool = True) -> Callable:
    """The builder of a comparison: 1 or 0 of the compute type (``ordered``: false at NaN)."""
    def op(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
        x, y = unify(r.b, x, y)
        test = (r.b.fcmp_ordered if ordered else r.b.fcmp_unordered)(cmp, x, y)
        return r.b.select(test, ir.Constant(compute, 1.0), ir.Constant(compute, 0.0))
    return op


def extremum(cmp: str) -> Callable:
    """max / min: ``x`` where ``x cmp y`` or ``x`` is NaN, else ``y`` (NaN propagates)."""
    def op(r: Emitter, compute: ir.Type, x: ir.Value, y: ir.Value) -> ir.Value:
        b = r.b
        x, y = unify(b, x, y)
        keep = b.or_(b.fcmp_ordered(cmp, x, y), b.fcmp_unordered("uno", x, x))
        return b.select(keep, x, y)
    return op


def call(name: str) -> Callable:
    """The builder of a unary op that calls ``name`` (an intrinsic or libm) at its type."""
    def op(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
        return r.b.call(r.function(name, x.type), [x])
    return op


# f32 exp, tanh and erf are computed in f64 with plain arithmetic, so that loops calling them
# vectorize (libm's expf, tanhf and erff are scalar calls), by short polynomials: each f64
# value is within 3e-11 (relative) of the function (exp's 2.2e-12, tanh's, through exp,
# 1e-11), far inside half an f32 ulp (3e-8 relative at least), so its rounding to f32 is within
# an ulp of the f64 function's rounded, and equal to it all but a few times in a million (the
# tests sweep f32 bit patterns against NumPy's f64 exp and tanh and SciPy's erf).
#
# The polynomials interpolate a function at the Chebyshev points of their interval (f64
# NumPy, ``_chebyshev_fit``; the tables below are what it gives, as a test checks), evaluated
# by Horner's rule; erf's two pieces are both computed and one selected, with no branches.


def _chebyshev_fit(f: Callable[[float], float], lo: float, hi: float, degree: int,
                   mapped: bool) -> tuple[float, ...]:
    """The polynomial of ``degree`` interpolating ``f`` at the ``degree + 1`` Chebyshev points
    (of the first kind) of [lo, hi]: its monomial coefficients in ``w`` itself, or, if
    ``mapped``, in ``t = (2 w - lo - hi) / (hi - lo)`` (in [-1, 1])."""
    import numpy as np
    from numpy.polynomial import Polynomial, chebyshev

    def on_t(t: np.ndarray) -> np.ndarray:
        return np.array([f(lo + (v + 1.0) * (hi - lo) / 2.0) for v in t])

    p = Polynomial(chebyshev.cheb2poly(chebyshev.chebinterpolate(on_t, degree)))
    if not mapped:
        p = p(Polynomial([-(hi + lo) / (hi - lo), 2.0 / (hi - lo)]))
    return tuple(float(c) for c in p.coef)


def _fmuladd(r: Emitter) -> ir.Function:
    key = ("llvm.fmuladd", F64)
    if key not in r.functions:
        r.functions[key] = ir.Function(r.module, ir.FunctionType(F64, [F64, F64, F64]),
                                       "llvm.fmuladd.f64")
    return r.functions[key]


def _horner(r: Emitter, t: ir.Value, coefs: Sequence[float]) -> ir.Value:
    """``sum(coefs[k] * t**k)`` in f64, by Horner's rule with fused multiply-adds where the
    CPU has them (``llvm.fmuladd``: these polynomials' error budget allows either)."""
    fma = _fmuladd(r)
    acc: ir.Value = ir.Constant(F64, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = r.b.call(fma, [acc, t, ir.Constant(F64, c)])
    return acc


def _horner2(r: Emitter, t: ir.Value, coefs: Sequence[float]) -> ir.Value:
    """The same sum as ``E(t^2) + t O(t^2)`` (even and odd terms): two chains of half the
    length, which a CPU overlaps."""
    t2 = r.b.fmul(t, t)
    return r.b.call(_fmuladd(r), [_horner(r, t2, coefs[1::2]), t, _horner(r, t2, coefs[0::2])])


def _fma(r: Emitter, x: ir.Value, y: float, z: float) -> ir.Value:
    return r.b.call(_fmuladd(r), [x, ir.Constant(F64, y), ir.Constant(F64, z)])


# exp: k = x / ln 2 + 1.5 2^52 rounds x / ln 2 to the integer n in k's low bits, r = x - n ln 2
# (|r| <= ln 2 / 2), e^r = 1 + r Q(r), Q of degree 7 interpolating (e^r - 1) / r (relative
# error 2.2e-12; e^0 is 1 exactly), times 2^n built from k's bits. Beyond [-104, 89] the result
# is 0 or inf; NaN stays NaN.
_LN2 = math.log(2.0)
_EXP_SHIFT = 1.5 * 2.0 ** 52
# (1, *_chebyshev_fit(lambda r: math.expm1(r) / r, -_LN2 / 2, _LN2 / 2, 7, mapped=False))
_EXP_POLY = (
    1.0, 0.9999999999955093, 0.49999999999955214, 0.16666666786304538, 0.04166666678622484,
    0.008333283539556983, 0.0013888839116445852, 0.0001990756885035752, 2.4867867340637677e-05,
)


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
    k = _fma(r, clamped, 1.0 / _LN2, _EXP_SHIFT)  # n + 1.5 2^52, exactly
    n = b.fsub(k, ir.Constant(F64, _EXP_SHIFT))
    red = b.call(_fmuladd(r), [n, ir.Constant(F64, -_LN2), clamped])
    poly = _horner(r, red, _EXP_POLY)
    # 2^n: n + 1023 in the exponent field (k's bits are 1.5 2^52's plus n; its high bits
    # shift out)
    scale = b.bitcast(b.shl(b.add(b.bitcast(k, I64), const_int(1023)), const_int(52)), F64)
    return b.fmul(poly, scale)


def exp(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    if x.type == F32:
        return _exp_f32(r, x)
    return r.b.call(r.function("llvm.exp", x.type), [x])


def tanh(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
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


# erf, odd, in two pieces, both computed and one selected (no branches, so loops vectorize):
# for |x| < 1.35, |x| P(x^2), P = 2 / sqrt(pi) + u R(u), R of degree 8 interpolating
# (erf(x) / x - 2 / sqrt(pi)) / x^2 in u = x^2 on [0, 1.35^2] (relative error below 3e-11, and
# no more than f64's rounding for tiny x); from 1.35, Q(t) of degree 16 in
# t = (2 |x| - 5.35) / 2.65, interpolating erf on [1.35, 4] (error below 2.4e-11), |x| clamped
# to 4, where erf is 1 - 1.5e-8 and rounds to 1 in f32. The sign is copied from x (so
# erf(-0) = -0; a NaN stays NaN).
_ERF_SPLIT, _ERF_END = 1.35, 4.0
# (2 / sqrt(pi), *_chebyshev_fit(lambda u: (math.erf(math.sqrt(u)) / math.sqrt(u)
#                                           - 2 / math.sqrt(math.pi)) / u,
#                                0, 1.35 ** 2, 8, mapped=False))
_ERF_SMALL = (
    1.1283791670955126, -0.3761263890189087, 0.11283791556035921, -0.02686615374874845,
    0.005223881538112766, -0.000854557343961089, 0.00012010615844053289,
    -1.4492746088457169e-05, 1.394877197054159e-06, -7.943133299334064e-08,
)
# _chebyshev_fit(math.erf, 1.35, 4, 16, mapped=True)
_ERF_LARGE = (
    0.9998450638371055, 0.0011668701168705761, -0.004135824617534135, 0.00908974334475114,
    -0.01368843451968875, 0.01461936388699974, -0.010863398806624031, 0.004889940679526778,
    -0.0002478638205555899, -0.0014734774134938903, 0.0011276059024032644,
    -0.00030427528989627724, -0.00013076086046899304, 0.0001474567580323208,
    -3.3241849735556206e-05, -1.672785533623132e-05, 7.94510770638341e-06,
)


def erf(r: Emitter, compute: ir.Type, x: ir.Value) -> ir.Value:
    if x.type != F32:
        return r.b.call(r.function("erf", x.type), [x])
    b = r.b
    ax = b.fpext(b.call(r.function("llvm.fabs", F32), [x]), F64)
    end = ir.Constant(F64, _ERF_END)
    ax = b.select(b.fcmp_ordered(">", ax, end), end, ax)  # a NaN stays NaN
    small = b.fmul(_horner(r, b.fmul(ax, ax), _ERF_SMALL), ax)
    lo, hi = _ERF_SPLIT, _ERF_END
    large = _horner2(r, _fma(r, ax, 2.0 / (hi - lo), -(hi + lo) / (hi - lo)), _ERF_LARGE)
    value = b.fptrunc(b.select(b.fcmp_ordered("<", ax, ir.Constant(F64, lo)), small, large),
                      F32)
    copysign = r.functions.setdefault(
        ("llvm.copysign", F32),
        r.module.declare_intrinsic("llvm.copysign", [F32], ir.FunctionType(F32, [F32, F32])))
    return b.call(copysign, [value, x])


# --- 16-bit conversions ----------------------------------------------------------------------
# Exact both ways, ties to even, subnormals and infinities exact; a NaN converts as NumPy (f16:
# payload kept, unquieted) and ml_dtypes (bf16: the signed canonical quiet NaN) convert it.
# The integer versions have no branches (every case computed, one selected) so loops calling
# them vectorize.


def _c32(v: int, of: ir.Value | None = None) -> ir.Constant:
    """An i32 constant, or a vector of it as wide as ``of``."""
    return ir.Constant(I32 if of is None else like(of, I32), v)


def like(value: ir.Value, scalar: ir.Type) -> ir.Type:
    """``scalar``, or a vector of as many of it as ``value`` has lanes."""
    ty = value.type
    return ir.VectorType(scalar, ty.count) if isinstance(ty, ir.VectorType) else scalar


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
    """f32 -> bf16 bits, nearest with ties to even; a NaN becomes the quiet NaN of its sign.
    ``f`` may be a vector (lane by lane)."""
    return b.trunc(b.lshr(_bf16_rounded_bits(b, f), _c32(16, f)), like(f, I16))


def f32_to_bf16_exact(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    """:func:`f32_to_bf16` of an ``f`` that bf16 represents (or a NaN): its top half, with no
    rounding to do; a NaN still becomes the quiet NaN of its sign."""
    bits = b.bitcast(f, I32)
    return b.trunc(b.lshr(b.select(b.fcmp_unordered("uno", f, f), _bf16_quiet_nan(b, bits),
                                   bits), _c32(16)), I16)


def f32_round_bf16(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    """``f`` rounded to bf16, kept as an f32: what widening :func:`f32_to_bf16`'s bits gives,
    without moving them down and back up."""
    return b.bitcast(b.and_(_bf16_rounded_bits(b, f), _c32(0xFFFF0000)), F32)


def _bf16_rounded_bits(b: ir.IRBuilder, f: ir.Value) -> ir.Value:
    """``f``'s bits with the top half rounded to nearest even (the bottom half is dropped
    next), or the quiet NaN of ``f``'s sign. NaN is found by an unordered compare: one vector
    instruction, where testing the bits takes two."""
    bits = b.bitcast(f, like(f, I32))
    odd = b.and_(b.lshr(bits, _c32(16, f)), _c32(1, f))
    rounded = b.add(b.add(bits, _c32(0x7FFF, f)), odd)
    return b.select(b.fcmp_unordered("uno", f, f), _bf16_quiet_nan(b, bits), rounded)


def _bf16_quiet_nan(b: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """The f32 bits whose top half is bf16's quiet NaN with the sign of ``bits``."""
    return b.or_(b.and_(bits, _c32(0x80000000, bits)), _c32(0x7FC00000, bits))
