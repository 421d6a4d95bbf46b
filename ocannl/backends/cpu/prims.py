"""Scalar and array primitives the generated Numba code calls: exact 16-bit float conversions.

Numba has no float16 or bfloat16, so narrow buffers hold bit patterns (uint16). Loads widen to
f32 exactly; stores round an f32 to the nearest representable value, ties to even, with
subnormals and infinities exact; NaN as NumPy (f16: payload kept) and ml_dtypes (bf16: the
signed canonical quiet NaN) convert it. f16 uses the CPU's conversion instructions, emitted
inline, where LLVM has them (F16C), and exact integer code elsewhere (``*_soft``).
"""

from __future__ import annotations

import os
import platform

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


# The software conversions are written without branches (every case computed, one selected) so
# that LLVM vectorizes the loops that call them; the exhaustive tests pin them to NumPy.


@njit(**_JIT)
def f16_to_f32_soft(h):
    h = np.int32(h)
    sign = np.uint32(h & 0x8000) << np.uint32(16)
    em = h & 0x7FFF
    normal = np.uint32((em << 13) + 0x38000000)  # re-bias the exponent by 127 - 15
    special = np.uint32((em << 13) + 0x70000000)  # inf / NaN: all-ones exponent, payload kept
    tiny = f32_bits(np.float32(em) * np.float32(5.960464477539063e-08))  # em * 2**-24, exact
    bits = special if em >= 0x7C00 else (normal if em >= 0x400 else tiny)
    return bits_f32(bits | sign)


@njit(**_JIT)
def f32_to_f16_soft(x):
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


def _has_hardware_f16() -> bool:
    """Whether LLVM lowers half conversions to instructions here (F16C on x86, native on
    AArch64); elsewhere it would call a runtime routine the JIT may not provide."""
    if os.environ.get("OCANNL_SOFT_F16"):
        return False
    import llvmlite.binding as ll

    features = ll.get_host_cpu_features()
    machine = platform.machine().lower()
    return machine in ("aarch64", "arm64") or (
        machine in ("x86_64", "amd64") and features.get("f16c", False))


HARDWARE_F16 = _has_hardware_f16()
_I16, _I32, _F32 = llvm_ir.IntType(16), llvm_ir.IntType(32), llvm_ir.FloatType()


def _const(v: int) -> llvm_ir.Constant:
    return llvm_ir.Constant(_I32, v)


@intrinsic
def _f16_to_f32_hw(typingctx, h):  # noqa: ARG001 - numba intrinsic signature
    """Widen with the hardware instruction, emitted inline; a NaN keeps its payload unquieted,
    as NumPy's conversion does."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        h16 = builder.trunc(v, _I16) if h.bitwidth > 16 else builder.zext(v, _I16) \
            if h.bitwidth < 16 else v
        hw = builder.bitcast(builder.fpext(builder.bitcast(h16, llvm_ir.HalfType()), _F32), _I32)
        h32 = builder.zext(h16, _I32)
        is_nan = builder.icmp_unsigned(">", builder.and_(h32, _const(0x7FFF)), _const(0x7C00))
        sign = builder.shl(builder.and_(h32, _const(0x8000)), _const(16))
        payload = builder.shl(builder.and_(h32, _const(0x3FF)), _const(13))
        nan = builder.or_(builder.or_(sign, _const(0x7F800000)), payload)
        return builder.bitcast(builder.select(is_nan, nan, hw), _F32)

    return types.float32(h), codegen


@intrinsic
def _f32_to_f16_hw(typingctx, x):  # noqa: ARG001 - numba intrinsic signature
    """Round with the hardware instruction (nearest, ties to even), emitted inline; a NaN keeps
    its top payload bits unquieted (at least one set), as NumPy's conversion does."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, signature, args):
        f = args[0] if x.bitwidth == 32 else builder.fptrunc(args[0], _F32)
        hw = builder.bitcast(builder.fptrunc(f, llvm_ir.HalfType()), _I16)
        b = builder.bitcast(f, _I32)
        a = builder.and_(b, _const(0x7FFFFFFF))
        is_nan = builder.icmp_unsigned(">", a, _const(0x7F800000))
        payload = builder.and_(builder.lshr(a, _const(13)), _const(0x3FF))
        payload = builder.select(builder.icmp_unsigned("==", payload, _const(0)), _const(1),
                                 payload)
        sign = builder.and_(builder.lshr(b, _const(16)), _const(0x8000))
        nan = builder.trunc(builder.or_(builder.or_(sign, _const(0x7C00)), payload), _I16)
        return builder.select(is_nan, nan, hw)

    return types.uint16(x), codegen


if HARDWARE_F16:
    f16_to_f32, f32_to_f16 = _f16_to_f32_hw, _f32_to_f16_hw
else:
    f16_to_f32, f32_to_f16 = f16_to_f32_soft, f32_to_f16_soft


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


def _pointer_intrinsic(ty: types.Type):
    @intrinsic
    def as_pointer(typingctx, addr):  # noqa: ARG001 - numba intrinsic signature
        """An integer address as a typed pointer, for ``numba.carray`` in an entry point."""
        if not isinstance(addr, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(ty)))

        return types.CPointer(ty)(addr), codegen

    return as_pointer


ptr_f64 = _pointer_intrinsic(types.float64)
ptr_f32 = _pointer_intrinsic(types.float32)
ptr_u16 = _pointer_intrinsic(types.uint16)
