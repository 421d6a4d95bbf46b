"""Host values rounded to a node's precision once, from the value given.

NumPy and ml_dtypes do not always round once: ml_dtypes converts f64 (and 64-bit integers) to
bfloat16 through f32, so ``1 + 2**-8 + 2**-30`` becomes 1.0 (the f32 step lands exactly on a
bf16 tie) where rounding the given value gives 1.0078125. :func:`to_precision` rounds the value
first to f64 and then to f32 *to odd* (an inexact result keeps an odd last bit, which remembers
that it was not exact), then once to nearest-even in the target. Rounding to odd into a format
with at least two more bits than the target, then to nearest, equals one rounding to nearest
(Boldo and Melquiond); f32 has 13 more bits than f16 and 16 more than bf16 at every exponent the
targets reach, subnormals included.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np

from ocannl.ir.ops import Precision

__all__ = ["to_precision"]

_EXACT_IN_F32 = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16),
                 np.dtype(np.bool_), np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16),
                 np.dtype(np.uint16)}


def _nudge_to_odd(y: np.ndarray, inexact: np.ndarray, away: np.ndarray) -> np.ndarray:
    """``y`` (the value rounded to nearest) made odd where it is inexact: one step away from 0
    where the exact value is larger in magnitude (``away``), one toward 0 otherwise. The odd
    neighbour is the other side of the exact value, so the result is its rounding to odd."""
    bits = y.view(np.dtype(f"u{y.dtype.itemsize}")).copy()
    fix = inexact & ((bits & 1) == 0)
    bits[fix & away] += 1
    bits[fix & ~away] -= 1  # never below 0 in magnitude: a 0 is never above the exact value
    return bits.view(y.dtype)


def _f64_to_odd(x: np.ndarray) -> np.ndarray:
    """Any real array as f64, rounded to odd (exactly, where f64 holds the value)."""
    dt = x.dtype
    if dt.kind in "iu" and dt.itemsize > 4:
        # 64-bit integers: hi * 2**32 + lo, each exact in f64; the error of their f64 sum is
        # exact too (two-sum), and says which way the sum was rounded.
        hi = (x >> 32).astype(np.float64) * 2.0**32
        lo = (x & 0xFFFFFFFF).astype(np.float64)
        s = hi + lo
        b = s - hi
        err = (hi - (s - b)) + (lo - b)
        return _nudge_to_odd(s, err != 0, (err > 0) == (s > 0))
    if dt.kind == "f" and dt.itemsize > 8:  # long double
        with np.errstate(over="ignore"):
            y = x.astype(np.float64)
        back = y.astype(dt)
        return _nudge_to_odd(y, (back != x) & ~np.isnan(x), np.abs(x) > np.abs(back))
    return x.astype(np.float64)  # exact: every other real dtype fits in f64


def _f32_to_odd(x: np.ndarray) -> np.ndarray:
    if x.dtype in _EXACT_IN_F32:
        return x.astype(np.float32)
    x64 = _f64_to_odd(x)
    with np.errstate(over="ignore"):
        y = x64.astype(np.float32)  # an overflow to inf is undone by the nudge (to f32's max)
    back = y.astype(np.float64)
    return _nudge_to_odd(y, (back != x64) & ~np.isnan(x64), np.abs(x64) > np.abs(back))


def to_precision(host: np.ndarray, prec: Precision) -> np.ndarray:
    """``host`` (any real or boolean array) as an array of ``prec``'s host dtype, each value
    rounded once to nearest, ties to even, from the value given (overflow gives infinity).

    f32 and f64 targets use NumPy's cast, which rounds once; f16 and bf16 go through f32
    rounded to odd (see the module docstring), since a plain cast may round twice.
    """
    host = np.asarray(host)
    if host.dtype == prec.numpy_dtype:
        return host.copy()  # bit for bit, NaN payloads included
    if not prec.is_narrow:
        return host.astype(prec.numpy_dtype)  # warns on overflow, as NumPy does
    with np.errstate(over="ignore", invalid="ignore"):
        out = _f32_to_odd(host).astype(prec.numpy_dtype)
        inf = np.isinf(out)
        overflow = inf.any() and (inf & ~np.isinf(host)).any()
    if overflow:
        warnings.warn(f"overflow encountered in cast to {prec.value}: finite values beyond its "
                      f"range became infinities", RuntimeWarning, stacklevel=2)
    return out
