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


@njit(**_JIT)
def f16_to_f32(h):
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    e = (h >> np.uint32(10)) & np.uint32(0x1F)
    m = h & np.uint32(0x3FF)
    if e == 0:
        v = np.float32(m) * np.float32(5.960464477539063e-08)  # m * 2**-24, exact
        return -v if sign else v
    if e == 31:
        return bits_f32(np.uint32(sign | np.uint32(0x7F800000) | (m << np.uint32(13))))
    exponent = (e + np.uint32(112)) << np.uint32(23)
    return bits_f32(np.uint32(sign | exponent | (m << np.uint32(13))))


@njit(**_JIT)
def f32_to_f16(x):
    b = f32_bits(np.float32(x))
    sign = (b >> np.uint32(16)) & np.uint32(0x8000)
    exp = np.int32((b >> np.uint32(23)) & np.uint32(0xFF))
    mant = b & np.uint32(0x7FFFFF)
    if exp == 255:
        if mant == 0:
            return np.uint16(sign | np.uint32(0x7C00))
        payload = mant >> np.uint32(13)
        if payload == 0:
            payload = np.uint32(1)
        return np.uint16(sign | np.uint32(0x7C00) | payload)
    e = exp - 112  # re-biased exponent
    if e >= 31:
        return np.uint16(sign | np.uint32(0x7C00))
    if e <= 0:
        if e < -10:
            return np.uint16(sign)
        m = mant | np.uint32(0x800000)
        shift = np.uint32(14 - e)
        h = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (h & np.uint32(1))):
            h += np.uint32(1)
        return np.uint16(sign | h)
    h = (np.uint32(e) << np.uint32(10)) | (mant >> np.uint32(13))
    rem = mant & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (h & np.uint32(1))):
        h += np.uint32(1)
    return np.uint16(sign | h)


@njit(**_JIT)
def bf16_to_f32(h):
    return bits_f32(np.uint32(h) << np.uint32(16))


@njit(**_JIT)
def f32_to_bf16(x):
    b = f32_bits(np.float32(x))
    if (b & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (b & np.uint32(0x7FFFFF)):
        return np.uint16(((b >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0))  # NaN
    rounding = np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return np.uint16((b + rounding) >> np.uint32(16))


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
