"""Scalar and array primitives the generated Numba code calls: exact 16-bit float conversions.

Numba has no float16 or bfloat16, so narrow buffers hold bit patterns (uint16). Loads widen to
f32 exactly; stores round an f32 to the nearest representable value, ties to even, with
subnormals and infinities exact; NaN as NumPy (f16: payload kept) and ml_dtypes (bf16: the
signed canonical quiet NaN) convert it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic

_JIT = {"cache": True, "nogil": True}


@intrinsic
def f32_bits(typingctx, x):  # noqa: ARG001 - numba intrinsic signature
    """Reinterpret a float32 as its uint32 bit pattern."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvm_ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):  # noqa: ARG001 - numba intrinsic signature
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], llvm_ir.IntType(32)) if x.bitwidth > 32 else args[0]
        return builder.bitcast(low, llvm_ir.FloatType())

    return types.float32(x), codegen


# The conversions are written without branches (every case computed, one selected) so that
# LLVM vectorizes the loops that call them; the exhaustive tests pin them to NumPy/ml_dtypes.


@njit(**_JIT)
def f16_to_f32(h):
    h = np.int32(h)
    sign = np.uint32(h & 0x8000) << np.uint32(16)
    em = h & 0x7FFF
    normal = np.uint32((em << 13) + 0x38000000)  # re-bias the exponent by 127 - 15
    special = np.uint32((em << 13) + 0x70000000)  # inf / NaN: all-ones exponent, payload kept
    tiny = f32_bits(np.float32(em) * np.float32(5.960464477539063e-08))  # em * 2**-24, exact
    bits = special if em >= 0x7C00 else (normal if em >= 0x400 else tiny)
    return bits_f32(bits | sign)


@njit(**_JIT)
def f32_to_f16(x):
    b = f32_bits(np.float32(x))
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    a = b & np.uint32(0x7FFFFFFF)
    payload = (a >> np.uint32(13)) & np.uint32(0x3FF)
    nan = np.uint32(0x7C00) | (payload if payload != 0 else np.uint32(1))
    odd = (a >> np.uint32(13)) & np.uint32(1)
    # Normal range: re-bias, then round to nearest even by adding just under half an ulp.
    normal = (a - np.uint32(0x38000000) + np.uint32(0xFFF) + odd) >> np.uint32(13)
    # Below 2**-14: adding 0.5 makes the FPU round at the f16 subnormal quantum (2**-24).
    tiny = f32_bits(bits_f32(a) + np.float32(0.5)) - np.uint32(0x3F000000)
    h = nan if a > np.uint32(0x7F800000) else (
        np.uint32(0x7C00) if a >= np.uint32(0x477FF000) else (
            normal if a >= np.uint32(0x38800000) else tiny))
    return np.uint16(h | sign)


@njit(**_JIT)
def bf16_to_f32(h):
    return bits_f32(np.uint32(h) << np.uint32(16))


@njit(**_JIT)
def f32_to_bf16(x):
    b = f32_bits(np.float32(x))
    nan = ((b >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.uint16(nan if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@njit(**_JIT)
def widen_f16_into(bits, out):
    for i in range(bits.size):
        out[i] = f16_to_f32(bits[i])


@njit(**_JIT)
def widen_bf16_into(bits, out):
    for i in range(bits.size):
        out[i] = bf16_to_f32(bits[i])


@njit(**_JIT)
def widen_f16(bits):
    out = np.empty(bits.size, np.float32)
    for i in range(bits.size):
        out[i] = f16_to_f32(bits[i])
    return out


@njit(**_JIT)
def widen_bf16(bits):
    out = np.empty(bits.size, np.float32)
    for i in range(bits.size):
        out[i] = bf16_to_f32(bits[i])
    return out


@njit(**_JIT)
def narrow_f16(values, out):
    for i in range(values.size):
        out[i] = f32_to_f16(values[i])


@njit(**_JIT)
def narrow_bf16(values, out):
    for i in range(values.size):
        out[i] = f32_to_bf16(values[i])


@njit(**_JIT)
def fill(buf, value):
    """A call to one compiled loop: cheaper to compile into a routine than an inlined loop."""
    for i in range(buf.size):
        buf[i] = value
