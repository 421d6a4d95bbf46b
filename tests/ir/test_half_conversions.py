"""The 16-bit float conversions of the CPU backend (``ocannl.backends.cpu.prims``).

Oracles: NumPy's float16 and ml_dtypes' bfloat16, compared bit for bit (NaN payloads and the
signs of zeros included) over all 65,536 patterns in both directions, over the exact halfway
points between neighbouring 16-bit values (round-to-nearest-even), and over random f32 bit
patterns. The same conversions are then checked through generated code (a ``cast`` routine).
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from numba import njit

import ocannl.tensor as T
from ocannl import Context, Precision
from ocannl.backends.cpu import prims as P

ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
_WIDEN_INTO = {"f16": P.widen_f16_into, "bf16": P.widen_bf16_into}


def _widen(kind: str, bits: np.ndarray) -> np.ndarray:
    out = np.empty(bits.size, np.float32)
    _WIDEN_INTO[kind](bits, out)
    return out

NARROW = {"f16": P.narrow_f16, "bf16": P.narrow_bf16}
# The scalar conversions the generated code calls; the hardware f16 ones are intrinsics, usable
# only inside compiled code, hence the njit wrappers. The software f16 ones are checked too.
TO_F32 = {
    "f16": njit(lambda h: P.f16_to_f32(h)),
    "f16_soft": P.f16_to_f32_soft,
    "bf16": P.bf16_to_f32,
}
FROM_F32 = {
    "f16": njit(lambda x: P.f32_to_f16(x)),
    "f16_soft": P.f32_to_f16_soft,
    "bf16": P.f32_to_bf16,
}


def _oracle_narrow(kind: str, values: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return values.astype(np.float32).astype(DTYPES[kind]).view(np.uint16)


def _narrow(kind: str, values: np.ndarray) -> np.ndarray:
    out = np.empty(values.size, np.uint16)
    NARROW[kind](np.ascontiguousarray(values, np.float32), out)
    return out


def _assert_same_bits(got: np.ndarray, want: np.ndarray, inputs: np.ndarray, what: str) -> None:
    bad = np.nonzero(got != want)[0]
    if bad.size:
        shown = ", ".join(
            f"{inputs.view(np.uint16 if inputs.itemsize == 2 else np.uint32)[i]:#x}: "
            f"got {got.view(np.uint32 if got.itemsize == 4 else np.uint16)[i]:#x} "
            f"want {want.view(np.uint32 if want.itemsize == 4 else np.uint16)[i]:#x}"
            for i in bad[:8]
        )
        pytest.fail(f"{what}: {bad.size} mismatches, e.g. {shown}")


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_widen_all_patterns(kind):
    got = _widen(kind, ALL_BITS)
    assert got.dtype == np.float32
    want = ALL_BITS.view(DTYPES[kind]).astype(np.float32)
    _assert_same_bits(got.view(np.uint32), want.view(np.uint32), ALL_BITS, f"widen {kind}")


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_narrow_all_patterns(kind):
    """Every 16-bit value, widened to f32, narrows back to the oracle's pattern (for all
    non-NaN values, the same pattern it came from)."""
    values = ALL_BITS.view(DTYPES[kind]).astype(np.float32)
    got = _narrow(kind, values)
    _assert_same_bits(got, _oracle_narrow(kind, values), values, f"narrow {kind}")
    finite_or_inf = ~np.isnan(values)
    assert np.array_equal(got[finite_or_inf], ALL_BITS[finite_or_inf])


def _halfway_points(kind: str) -> np.ndarray:
    """The f32 midpoints between each pair of neighbouring finite 16-bit values of one sign,
    and the f32 values one ulp either side of each midpoint."""
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        values = ALL_BITS.view(DTYPES[kind]).astype(np.float64)
    pos = np.sort(values[np.isfinite(values) & (values >= 0)])
    pos = np.unique(pos)  # +0 and -0 collapse
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    # Every midpoint of 16-bit neighbours is exact in f32 (11 or 8 significant bits, plus one).
    assert np.array_equal(mids.astype(np.float64), (pos[:-1] + pos[1:]) / 2)
    # and the midpoint between the largest finite value and the next (overflow threshold).
    top = pos[-1]
    step = pos[-1] - pos[-2]
    overflow_mid = np.float32(top + step / 2)
    pts = np.concatenate([mids, [overflow_mid]])
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                           np.nextafter(pts, np.float32(0))])
    return np.concatenate([near, -near]).astype(np.float32)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_narrow_rounds_halfway_points_to_even(kind):
    pts = _halfway_points(kind)
    got = _narrow(kind, pts)
    _assert_same_bits(got, _oracle_narrow(kind, pts), pts, f"narrow {kind} halfway")
    # Ties go to the even pattern: on an exact midpoint the last bit is 0 (or it overflowed).
    mids = pts[: pts.size // 6]
    tie = _narrow(kind, mids)
    assert np.all((tie & 1) == 0)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_narrow_random_f32_patterns(kind):
    rng = np.random.default_rng(1234)
    raw = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    # Add the f32 special patterns: zeros, infinities, NaNs with and without payload,
    # the smallest and largest subnormals and normals.
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                        0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F802000, 0x00000001,
                        0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x33000000,
                        0x33000001, 0x387FC000, 0x477FF000, 0x477FEFFF], dtype=np.uint32)
    values = np.concatenate([raw, special]).view(np.float32)
    got = _narrow(kind, values)
    _assert_same_bits(got, _oracle_narrow(kind, values), values, f"narrow {kind} random")


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_scalar_primitives_agree_with_array_ones(kind):
    """The scalar functions the generated loop bodies call match the array ones. (Called from
    Python, a scalar result crosses as a Python float, which quiets signalling NaNs: NaNs are
    compared as NaNs here; the routine tests below check their exact bits in generated code.)"""
    rng = np.random.default_rng(7)
    bits = rng.choice(ALL_BITS, 300, replace=False)
    widened = _widen(kind, bits)
    for b, w in zip(bits, widened, strict=True):
        v = np.float32(TO_F32[kind](np.uint16(b)))
        if np.isnan(w):
            assert np.isnan(v) and np.signbit(v) == np.signbit(w)
        else:
            assert v.view(np.uint32) == w.view(np.uint32)
    values = rng.integers(0, 1 << 32, 300, dtype=np.uint64).astype(np.uint32).view(np.float32)
    narrowed = _narrow(kind, values)
    for x, n in zip(values, narrowed, strict=True):
        assert int(FROM_F32[kind](np.float32(x))) == int(n)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_cast_routine_narrows_like_the_oracle(kind):
    """A generated ``cast`` routine from f32 to a 16-bit precision stores the oracle's bits:
    every 16-bit value plus the halfway points, in one buffer."""
    values = np.concatenate([ALL_BITS.view(DTYPES[kind]).astype(np.float32),
                             _halfway_points(kind)])
    x = T.term(output_dims=(values.size,), label="x")
    y = T.cast(x, kind)
    assert y.prec is Precision(kind)
    ctx = Context.cpu()
    ctx.set_values(x, values)
    ctx, r = ctx.compile(y.forward_comp())
    ctx.run(r)
    got = ctx.get_values(y)
    assert got.dtype == DTYPES[kind]
    _assert_same_bits(got.view(np.uint16), _oracle_narrow(kind, values), values,
                      f"cast f32->{kind}")


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_cast_routine_widens_like_the_oracle(kind):
    x = T.term(output_dims=(ALL_BITS.size,), label="x", prec=kind)
    y = T.cast(x, "f32")
    ctx = Context.cpu()
    ctx.set_values(x, ALL_BITS.view(DTYPES[kind]))
    # the host round trip keeps every pattern (NaN payloads included)
    assert np.array_equal(ctx.get_values(x).view(np.uint16), ALL_BITS)
    ctx, r = ctx.compile(y.forward_comp())
    ctx.run(r)
    got = ctx.get_values(y)
    want = ALL_BITS.view(DTYPES[kind]).astype(np.float32)
    _assert_same_bits(got.view(np.uint32), want.view(np.uint32), ALL_BITS, f"cast {kind}->f32")


@njit
def _soft_widen(bits: np.ndarray) -> np.ndarray:
    out = np.empty(bits.size, np.float32)
    for i in range(bits.size):
        out[i] = P.f16_to_f32_soft(bits[i])
    return out


@njit
def _soft_narrow(values: np.ndarray) -> np.ndarray:
    out = np.empty(values.size, np.uint16)
    for i in range(values.size):
        out[i] = P.f32_to_f16_soft(values[i])
    return out


def test_software_f16_conversions_match_numpy_exhaustively():
    """The integer-only f16 path (used where the CPU has no conversion instructions) is exact
    too: every pattern widens as NumPy's does, and narrows back, and random f32 patterns
    narrow as NumPy's cast does."""
    widened = _soft_widen(ALL_BITS)
    want = ALL_BITS.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(widened.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(_soft_narrow(want), ALL_BITS)
    rng = np.random.default_rng(99)
    raw = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        oracle = raw.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(_soft_narrow(raw), oracle)
