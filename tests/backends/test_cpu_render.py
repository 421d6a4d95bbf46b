"""The 16-bit float conversions of the CPU backend's generated code (``cpu/codegen.py``).

Oracles: NumPy's float16 and ml_dtypes' bfloat16, compared bit for bit (NaN payloads and the
signs of zeros included) over all 65,536 patterns in both directions, over the exact halfway
points between neighbouring 16-bit values (round-to-nearest-even), and over random f32 bit
patterns. Every conversion runs in a generated ``cast`` routine; ``f16_soft`` is the
integer-only f16 code used where the CPU has no conversion instructions.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context
from ocannl.backends.cpu import jit

ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
KINDS = ["f16", "f16_soft", "bf16"]


def _cast(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``values`` (host values of precision ``src``) through a generated cast to ``dst``."""
    soft = "f16_soft" in (src, dst)
    src, dst = src.removesuffix("_soft"), dst.removesuffix("_soft")
    x = T.term(output_dims=(values.size,), label="x", prec=src)
    y = T.cast(x, dst)
    ctx = Context.cpu()
    ctx.set_values(x, values)
    with pytest.MonkeyPatch.context() as m:
        if soft:
            m.setattr(jit, "hardware_f16", lambda: False)
        ctx, r = ctx.compile(y.forward_comp())
    ctx.run(r)
    return ctx.get_values(y)


def _widen(kind: str, bits: np.ndarray) -> np.ndarray:
    return _cast(bits.view(DTYPES[kind.removesuffix("_soft")]), kind, "f32")


def _narrow(kind: str, values: np.ndarray) -> np.ndarray:
    return _cast(np.ascontiguousarray(values, np.float32), "f32", kind).view(np.uint16)


def _oracle_narrow(kind: str, values: np.ndarray) -> np.ndarray:
    kind = kind.removesuffix("_soft")
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return values.astype(np.float32).astype(DTYPES[kind]).view(np.uint16)


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


@pytest.mark.parametrize("kind", KINDS)
def test_widen_all_patterns(kind):
    got = _widen(kind, ALL_BITS)
    assert got.dtype == np.float32
    want = ALL_BITS.view(DTYPES[kind.removesuffix("_soft")]).astype(np.float32)
    _assert_same_bits(got.view(np.uint32), want.view(np.uint32), ALL_BITS, f"widen {kind}")


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_all_patterns(kind):
    """Every 16-bit value, widened to f32, narrows back to the oracle's pattern (for all
    non-NaN values, the same pattern it came from)."""
    values = ALL_BITS.view(DTYPES[kind.removesuffix("_soft")]).astype(np.float32)
    got = _narrow(kind, values)
    _assert_same_bits(got, _oracle_narrow(kind, values), values, f"narrow {kind}")
    finite_or_inf = ~np.isnan(values)
    assert np.array_equal(got[finite_or_inf], ALL_BITS[finite_or_inf])


def _halfway_points(kind: str) -> np.ndarray:
    """The f32 midpoints between each pair of neighbouring finite 16-bit values of one sign,
    and the f32 values one ulp either side of each midpoint."""
    kind = kind.removesuffix("_soft")
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


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_rounds_halfway_points_to_even(kind):
    pts = _halfway_points(kind)
    got = _narrow(kind, pts)
    _assert_same_bits(got, _oracle_narrow(kind, pts), pts, f"narrow {kind} halfway")
    # Ties go to the even pattern: on an exact midpoint the last bit is 0 (or it overflowed).
    mids = pts[: pts.size // 6]
    tie = _narrow(kind, mids)
    assert np.all((tie & 1) == 0)


@pytest.mark.parametrize("kind", KINDS)
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


def test_f16_conversions_use_the_instructions_only_where_the_cpu_has_them(monkeypatch):
    """With F16C the IR converts with ``fpext``/``fptrunc`` through ``half``; the soft path,
    with integer code only (both are checked bit for bit above)."""
    from ocannl.backends.cpu.backend import emit_ir
    from ocannl.ir.lowering import lower, nodes_of

    x = T.term(output_dims=(4,), label="x", prec="f16")
    y = T.cast(T.cast(x, "f32") * 2.0, "f16")
    code = lower(y.forward_comp())
    has_instructions = jit.hardware_f16()
    hw = "".join(emit_ir(code, nodes_of(code))[0])
    assert ("to half" in hw) == has_instructions
    monkeypatch.setattr(jit, "hardware_f16", lambda: False)
    soft = "".join(emit_ir(code, nodes_of(code))[0])
    assert "half" not in soft
