"""The port's own exception (OCaml's ``Failure``), and the few argument checks every module
shares, so that one rule holds everywhere: a NumPy real scalar is a number, a bool is not a
number, and a flag is a bool."""

from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["Failure", "f32_positive", "finite_real", "is_int", "is_real", "real",
           "require_bool"]


class Failure(ValueError):
    """OCaml's ``Failure``: an operation could not be carried out on well-typed input."""


def is_real(x: object) -> bool:
    """Whether ``x`` is a real number: int, float, Fraction, NumPy's real scalars (np.float32,
    np.int64, ...), but no bool (``True`` is not a rate: it is a mistyped flag)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def is_int(x: object) -> bool:
    """Whether ``x`` is an integer (NumPy's included), but no bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def real(what: str, x: object, expected: str = "a real number") -> float:
    """``x`` as a float, or ``ValueError`` naming ``what``, ``x`` and ``expected`` when it is no
    real number or too large for a float (``float(10**400)`` raises ``OverflowError``)."""
    if not is_real(x):
        raise ValueError(f"{what} must be {expected}, got {type(x).__name__}: {x!r:.80}")
    try:
        return float(x)  # type: ignore[arg-type]
    except (OverflowError, ValueError):
        raise ValueError(f"{what} must be {expected}, got {x!r:.60}, which is too large for a "
                         f"float") from None


def finite_real(what: str, x: object) -> float:
    """``x`` as a float if it is a finite real number, else ``ValueError`` naming ``what``."""
    v = real(what, x)
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {x!r}")
    return v


def f32_positive(what: str, x: object) -> float:
    """``x`` as a float if it is a finite number > 0 that stays one in f32, where the code
    computes with it; else ``ValueError`` naming it. The rule ``Loss_scaler.create`` applies to
    the scale: a threshold of 1e-50 is "> 0" but 0 in f32, and 1e39 is infinite there."""
    expected = "a finite number > 0 (in f32)"
    v = real(what, x, expected)
    if not math.isfinite(v) or not v > 0:
        raise ValueError(f"{what} must be {expected}, got {x!r:.60}")
    with np.errstate(over="ignore", under="ignore"):
        v32 = float(np.float32(v))
    if v32 == 0.0 or not math.isfinite(v32):
        f32 = np.finfo(np.float32)
        raise ValueError(f"{what}={x!r:.60} rounds to {v32!r} in f32: expected a value that "
                         f"f32 holds as a finite number > 0 (from "
                         f"{float(f32.smallest_subnormal)!r} to {float(f32.max)!r})")
    return v


def require_bool(what: str, x: object) -> bool:
    """``x`` as a bool, or ``TypeError`` naming it: a flag given as ``"no"`` or ``1`` would be
    taken as true (or false) without a word."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {x!r:.60} ({type(x).__name__})")
    return bool(x)
