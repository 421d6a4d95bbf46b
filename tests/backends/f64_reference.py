"""An f64 NumPy reference for computations, and the comparison of GPU results against it.

A GPU sums in its own order (cuBLAS, block reductions, FMA contraction), so its results are
compared with the exact-as-possible f64 value of the computation over the *stored* inputs, with
a tolerance scaled by the magnitude of the terms that were summed (``|x|^T |y| + |z|`` for
``z += x @ y``), never with the CPU's bits. :func:`evaluate` interprets the assignments in f64
and tracks, per written cell, that magnitude and the number of terms; :func:`assert_close`
turns them into the tolerance::

    |got - ref| <= K(n) * u * mag  +  ulp_out * |ref|  +  floor

``u``: the unit roundoff of the arithmetic (2**-24: f32, also for 16-bit data, which is
computed in f32; 2**-53: f64). ``K(n) = 16 + min(n, 4 * sqrt(n))`` for a sum of ``n`` terms:
16 ulps of slack for the math functions (libdevice against libm) and operand conversions,
plus the summation-order factor (any order is within ``n``; orders of blocks and trees, and
random data, stay near ``sqrt(n)``). ``ulp_out``: one ulp of the output precision, relative
(the final rounding into f16 / bf16 / f32). ``floor``: CuPy compiles with ``-ftz=true``, so an
f32 result below 2**-126 may be 0.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np

from ocannl.backends.rounding import to_precision
from ocannl.ir.assignments import Accum, Apply, Comp, Const, Expr, Fixed, Get
from ocannl.ir.ops import ACCUMS, Precision, reference
from ocannl.ir.tnode import Tnode

UNIT = {Precision.f64: 2.0**-53, Precision.f32: 2.0**-24, Precision.f16: 2.0**-24,
        Precision.bf16: 2.0**-24}
ULP_OUT = {Precision.f64: 2.0**-52, Precision.f32: 2.0**-23, Precision.f16: 2.0**-10,
           Precision.bf16: 2.0**-7}
FLOOR = {Precision.f64: 2.0**-1022, Precision.f32: 2.0**-126, Precision.f16: 2.0**-24,
         Precision.bf16: 2.0**-126}


def order_factor(n: int | np.ndarray) -> np.ndarray:
    """``K(n)``: see the module docstring."""
    n = np.asarray(n, dtype=np.float64)
    return 16.0 + np.minimum(n, 4.0 * np.sqrt(n))


class Ref:
    """The f64 reference of one node: values (unrounded), term magnitudes, terms per cell."""

    def __init__(self, value: np.ndarray, mag: np.ndarray, terms: np.ndarray) -> None:
        self.value, self.mag, self.terms = value, mag, terms


def _start(node: Tnode) -> np.ndarray:
    if node.host_data is not None:
        return np.asarray(node.host_data).astype(np.float64).reshape(node.dims)
    return np.zeros(node.dims)


def _index(idx: Sequence[int | Fixed], dims: tuple[int, ...], grids: np.ndarray,
           space: tuple[int, ...]) -> tuple:
    """Index arrays over the space for a projection; an axis of one cell is always read and
    written at 0, whatever iterator names it (as the emitters do)."""
    return tuple(np.zeros(space, dtype=np.intp) if d == 1 else
                 grids[i] if isinstance(i, int) else np.full(space, i.pos, dtype=np.intp)
                 for i, d in zip(idx, dims, strict=True))


def _rounded(values: np.ndarray, prec: Precision) -> np.ndarray:
    """``values`` rounded to ``prec``, as f64 (an overflow to infinity is meant: no warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(to_precision(values, prec)).astype(np.float64)


def _eval(e: Expr, values: dict[int, np.ndarray], grids: np.ndarray,
          space: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(value, magnitude) of an expression at every point of the space."""
    if isinstance(e, Const):
        v = np.full(space, e.value)
        return v, np.abs(v)
    if isinstance(e, Get):
        v = values[e.node.id][_index(e.idx, e.node.dims, grids, space)] if e.node.dims else np.full(
            space, values[e.node.id][()])
        return v, np.abs(v)
    assert isinstance(e, Apply)
    args = [_eval(a, values, grids, space) for a in e.args]
    vals = [a[0] for a in args]
    mags = [a[1] for a in args]
    with np.errstate(all="ignore"):
        v = np.asarray(reference(e.op, *vals), dtype=np.float64)
        op = e.op
        if op in ("add", "sub"):
            m = mags[0] + mags[1]
        elif op == "mul":
            m = mags[0] * mags[1]
        elif op == "div":
            m = mags[0] / np.abs(vals[1])
        elif op == "neg":
            m = mags[0]
        elif op == "relu":
            m = np.where(vals[0] < 0, 0.0, mags[0])
        elif op == "max":
            m = np.where((vals[0] >= vals[1]) | np.isnan(vals[0]), mags[0], mags[1])
        elif op == "where":
            m = np.where(vals[0] != 0, mags[1], mags[2])
        elif op == "pow":
            x, y = np.abs(vals[0]), np.abs(vals[1])
            m = np.abs(v) * (1.0 + y + y * np.abs(np.log(np.where(x > 0, x, 1.0))))
        else:  # exp, log, tanh, sigmoid, sqrt, eq, gt, isfinite: relative to the result
            m = np.abs(v)
    return np.broadcast_to(v, space), np.broadcast_to(m, space)


def evaluate(comp: Comp) -> dict[int, Ref]:
    """The f64 reference of every node ``comp`` writes, by node id, from the nodes' host data
    as stored (or zeros). A node read after being written reads the written values rounded to
    its precision, as the device holds them."""
    values: dict[int, np.ndarray] = {}
    refs: dict[int, Ref] = {}
    for a in comp.assignments:
        for n in a.nodes:
            if n.id not in values:
                values[n.id] = _start(n)
        refs[a.lhs.id] = _assign(a, values, refs.get(a.lhs.id))
        values[a.lhs.id] = _rounded(refs[a.lhs.id].value, a.lhs.prec)
    return refs


def _assign(a: Accum, values: dict[int, np.ndarray], prev: Ref | None) -> Ref:
    space = tuple(a.space)
    grids = np.indices(space) if space else np.zeros((0,), dtype=np.intp)
    t, m = _eval(a.expr, values, grids, space)
    lhs = a.lhs
    size = max(lhs.size, 1)
    if lhs.dims:
        lin = np.ravel_multi_index(_index(a.lhs_idx, lhs.dims, grids, space), lhs.dims).reshape(-1)
    else:
        lin = np.zeros(max(math.prod(space), 1), dtype=np.intp)
    t, m = np.asarray(t, dtype=np.float64).reshape(-1), np.asarray(m).reshape(-1)
    count = np.bincount(lin, minlength=size).astype(np.float64)
    if a.reset:
        start = np.full(size, ACCUMS[a.accum] if ACCUMS[a.accum] is not None else 0.0)
        start_mag, start_terms = np.zeros(size), np.zeros(size)
    else:
        start = values[lhs.id].reshape(-1).copy()
        start_mag = np.abs(start) + (prev.mag.reshape(-1) if prev is not None else 0.0)
        start_terms = np.ones(size) + (prev.terms.reshape(-1) if prev is not None else 0.0)
    out, mag, terms = start.copy(), start_mag.copy(), start_terms.copy()
    touched = count > 0
    with np.errstate(all="ignore"):
        if a.accum == "+":
            out = out + np.bincount(lin, weights=t, minlength=size)
            mag = mag + np.bincount(lin, weights=m, minlength=size)
            terms = terms + count
        elif a.accum == "max":
            cells, seg = _segments(lin)
            if seg is not None:  # cells in runs, as a row-major reduction gives them
                out[cells] = np.maximum(out[cells], np.maximum.reduceat(t, seg))
                mag[cells] = np.maximum(mag[cells], np.maximum.reduceat(m, seg))
            else:
                np.maximum.at(out, lin, t)
                np.maximum.at(mag, lin, m)
            terms = np.where(touched, 1.0, terms)
        elif count.max(initial=0) <= 1:  # "=", each cell written once
            out[lin], mag[lin], terms[lin] = t, m, 1.0
        else:  # "=": the last write of each cell wins (row-major order of the space)
            rev = lin[::-1]
            cells, first = np.unique(rev, return_index=True)
            last = len(lin) - 1 - first
            out[cells] = t[last]
            mag[cells] = m[last]
            terms[cells] = 1.0
    shape = lhs.dims
    return Ref(out.reshape(shape), mag.reshape(shape), terms.reshape(shape))


def _segments(lin: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """When equal cells come in runs (each cell's run contiguous): the cells in order and the
    start of each run, for ``reduceat``; else ``(cells, None)``."""
    if lin.size == 0:
        return lin, None
    starts = np.concatenate([[0], np.flatnonzero(lin[1:] != lin[:-1]) + 1])
    cells = lin[starts]
    if np.unique(cells).size != cells.size:
        return cells, None
    return cells, starts


def tolerance(ref: Ref, prec: Precision) -> np.ndarray:
    """The allowed ``|got - ref|`` per cell (see the module docstring)."""
    with np.errstate(all="ignore"):
        return (order_factor(ref.terms) * UNIT[prec] * ref.mag
                + ULP_OUT[prec] * np.abs(ref.value) + FLOOR[prec])


def assert_close(got: np.ndarray, ref: Ref, prec: Precision, what: str) -> None:
    """``got`` (as read back) within :func:`tolerance` of the reference; NaN exactly where the
    reference rounded to ``prec`` is NaN, the same infinities where it overflows."""
    got = np.asarray(got).astype(np.float64).reshape(ref.value.shape)
    want = _rounded(ref.value, prec)
    nan = np.isnan(want)
    bad = nan != np.isnan(got)
    inf = np.isinf(want)
    bad |= inf & (got != want)
    finite = ~nan & ~inf
    tol = tolerance(ref, prec)
    with np.errstate(all="ignore"):
        err = np.abs(got - ref.value)
    bad |= finite & ~(err <= tol)
    if bad.any():
        k = np.flatnonzero(bad.reshape(-1))
        rows = "\n".join(
            f"  [{np.unravel_index(i, got.shape) if got.shape else ()}] got {got.flat[i]!r}, "
            f"f64 reference {ref.value.flat[i]!r}, |err| {err.flat[i]:.3g} > tol "
            f"{tol.flat[i]:.3g} (terms {ref.terms.flat[i]:.0f}, magnitude {ref.mag.flat[i]:.3g})"
            for i in k[:8])
        raise AssertionError(f"{what} ({prec.value}): {len(k)} of {got.size} cells off the f64 "
                             f"reference\n{rows}")
