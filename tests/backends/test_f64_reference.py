"""The comparison GPU results go through: an f64 reference and a tolerance scaled by the
magnitude of the summed terms admit any summation order, and still catch a wrong result."""

from __future__ import annotations

import cuda_cases
import numpy as np
import pytest
from f64_reference import assert_close, evaluate

from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode


def _f32_gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, order: str) -> np.ndarray:
    """``c + a @ b`` summed in f32 in a given order over k."""
    a, b, acc = a.astype(np.float32), b.astype(np.float32), c.astype(np.float32).copy()
    k = a.shape[1]
    if order == "forward":
        for j in range(k):
            acc += a[:, j:j + 1] * b[j:j + 1, :]
    elif order == "reverse":
        for j in reversed(range(k)):
            acc += a[:, j:j + 1] * b[j:j + 1, :]
    else:  # blocked: partial sums of 8 terms, combined pairwise, then added to c
        parts = [sum((a[:, j:j + 1] * b[j:j + 1, :] for j in range(s, min(s + 8, k))),
                     np.zeros_like(acc)) for s in range(0, k, 8)]
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        acc += parts[0]
    return acc


def _cancelling_gemm() -> tuple[Comp, Tnode, np.ndarray, np.ndarray, np.ndarray]:
    """``z += x @ y`` at f32 over k = 256 with terms of about 8 whose sums cancel to ~1e-4."""
    rng = np.random.default_rng(5)
    m, n, k = 16, 12, 256
    x = rng.normal(size=(m, k)).astype(np.float32) * 4
    y = rng.normal(size=(k, n)).astype(np.float32) * 2
    exact = x.astype(np.float64) @ y.astype(np.float64)
    z0 = (-exact + rng.normal(size=(m, n)) * 1e-4).astype(np.float32)  # cancels the product
    f32 = Precision.f32
    xn = Tnode("x", (m, k), f32, host_data=x)
    yn = Tnode("y", (k, n), f32, host_data=y)
    zn = Tnode("z", (m, n), f32, host_data=z0)
    prod = apply("mul", Get(xn, (0, 2)), Get(yn, (2, 1)))
    comp = Comp((Accum(zn, (0, 1), "+", prod, (m, n, k)),))
    return comp, zn, x, y, z0


@pytest.mark.parametrize("order", ["forward", "reverse", "blocked"])
def test_any_summation_order_passes(order: str) -> None:
    comp, z, x, y, z0 = _cancelling_gemm()
    ref = evaluate(comp)[z.id]
    got = _f32_gemm(x, y, z0, order)
    assert np.max(np.abs(ref.value)) < 0.01 < np.max(ref.mag)  # results tiny, terms large
    assert_close(got, ref, Precision.f32, f"z summed {order}")


def test_the_summation_orders_differ_beyond_a_relative_tolerance() -> None:
    """Why a relative check of one order against another fails: the cancelled results differ
    by far more than 1e-5 of themselves."""
    _, _, x, y, z0 = _cancelling_gemm()
    a, b = _f32_gemm(x, y, z0, "forward"), _f32_gemm(x, y, z0, "reverse")
    nz = b != 0
    assert np.max(np.abs(a - b)[nz] / np.abs(b)[nz]) > 1e-5


def test_a_missing_term_fails() -> None:
    comp, z, x, y, z0 = _cancelling_gemm()
    ref = evaluate(comp)[z.id]
    got = _f32_gemm(x[:, 1:], y[1:, :], z0, "forward")  # the first term of every cell dropped
    with pytest.raises(AssertionError, match="cells off the f64 reference"):
        assert_close(got, ref, Precision.f32, "z")


def test_nan_and_infinity_must_sit_where_the_reference_has_them() -> None:
    comp, outs = cuda_cases.op_cases(Precision.f32)
    refs = evaluate(comp)
    div = next(n for n in outs if n.label == "out_div")
    ref = refs[div.id]
    got = ref.value.astype(np.float32)
    assert_close(got, ref, Precision.f32, "div")
    for i in (int(np.flatnonzero(np.isnan(ref.value))[0]),
              int(np.flatnonzero(np.isinf(ref.value))[0])):
        bad = got.copy()
        bad[i] = 1.0
        with pytest.raises(AssertionError):
            assert_close(bad, ref, Precision.f32, "div")
