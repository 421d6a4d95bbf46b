"""The scale's arithmetic on the host, in f32 as the device holds it (so the host's schedule and
the device's ``unscale`` agree to the bit), and the number checks of its arguments."""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)
_F32_ROUNDS_TO_INF = Fraction(2) ** 128 - Fraction(2) ** 103  # midpoint of max and 2**128


def _f32(x: float) -> float:
    """``x`` rounded to f32 (to nearest, ties to even), as a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _f32_odd(v: float) -> int:
    return int(np.array(v, np.float32).view(np.uint32)) & 1


def _f32_of_fraction(x: Fraction) -> float:
    """The f32 nearest to the exact positive rational ``x`` (ties to even)."""
    if x >= _F32_ROUNDS_TO_INF:
        return math.inf
    c = np.float32(_f32(float(x)))
    inf32 = np.float32(np.inf)
    cands = {float(np.nextafter(c, -inf32)), float(c), float(np.nextafter(c, inf32))}
    cands = {v for v in cands if math.isfinite(v) and v >= 0}
    return min(cands, key=lambda v: (abs(Fraction(v) - x), _f32_odd(v)))


def _reciprocal_f32(scale: float) -> float:
    """What the device's ``unscale`` holds: the f32 rounding of the exact ``1 / scale``."""
    if scale == 0.0:
        return math.inf
    return _f32_of_fraction(1 / Fraction(scale))


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: object) -> bool:
    if type(x) is int:  # the common case, without the slower ABC check below
        return True
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_bool(name: str, x: object) -> bool:
    if x is True or x is False:
        return x
    if not isinstance(x, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {type(x).__name__}: {x!r}")
    return bool(x)
