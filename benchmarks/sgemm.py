"""The sgemm rate NumPy reaches on this machine: the yardstick for the wide step's GEMMs."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from benchmarks.specs import Product

FRAMEWORK = "numpy"  # how the rounds tell it from this project's rows (a pause around it)


def sgemm_rate(n: int = 1024, reps: int = 15, seed: int = 0) -> float:
    """Median FLOP/s of ``np.dot`` on two f32 ``n x n`` matrices (after one warm-up call),
    measured alone."""
    alone = SgemmInRounds(n, calls=reps, seed=seed)
    alone.time()
    rate = alone.rate()
    assert rate is not None
    return rate


class SgemmInRounds:
    """NumPy's sgemm timed inside a workload's interleaved rounds (``measure.time_steps``),
    ``calls`` products a round: the yardstick then meets the machine states the steps it
    measures meet. This machine switches between two speeds every few tens of milliseconds, so
    a rate measured once before or after the rounds may come from the other state."""

    framework = FRAMEWORK

    def __init__(self, n: int = 1024, calls: int = 3, seed: int = 0,
                 products: Sequence[Product] = ()) -> None:
        rng = np.random.default_rng(seed)
        self.n, self.calls = n, calls
        self.a = rng.standard_normal((n, n), dtype=np.float32)
        self.b = rng.standard_normal((n, n), dtype=np.float32)
        self.out = np.empty((n, n), np.float32)
        self.samples: list[float] = []
        np.dot(self.a, self.b, out=self.out)  # warm-up
        # A step's products (``Workload.gemm_products``), each with its operands stored as the
        # step stores them: one pass over them all a round, one sample.
        self.products = [_operands(p, rng) for p in products]
        self.product_samples: list[float] = []
        self.pass_products()  # warm-up

    def step(self) -> None:
        np.dot(self.a, self.b, out=self.out)

    def pass_products(self) -> None:
        for a, b, out in self.products:
            if out.ndim == 2:
                np.dot(a, b, out=out)
            else:
                np.matmul(a, b, out=out)

    def time(self) -> None:
        """Time ``calls`` products, one sample each; then, given a step's products, one pass
        over them, one sample."""
        clock = time.perf_counter
        for _ in range(self.calls):
            t0 = clock()
            self.step()
            self.samples.append(clock() - t0)
        if self.products:
            t0 = clock()
            self.pass_products()
            self.product_samples.append(clock() - t0)

    def rate(self) -> float | None:
        """FLOP/s at the median product time, or None before any round."""
        return 2.0 * self.n**3 / float(np.median(self.samples)) if self.samples else None

    def products_time(self) -> float | None:
        """The median time of a pass over the step's products, or None without them."""
        return float(np.median(self.product_samples)) if self.product_samples else None


def _operands(p: Product, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """``a``, ``b`` (views of transposed storage where the product says so) and ``out``,
    stacked ``p.batch`` deep for a batched product."""
    lead = (p.batch,) if p.batch > 1 else ()

    def matrix(rows: int, cols: int, transposed: bool) -> np.ndarray:
        if transposed:
            return np.swapaxes(rng.standard_normal((*lead, cols, rows), dtype=np.float32),
                               -1, -2)
        return rng.standard_normal((*lead, rows, cols), dtype=np.float32)

    return (matrix(p.rows, p.inner, p.a_transposed), matrix(p.inner, p.cols, p.b_transposed),
            np.empty((*lead, p.rows, p.cols), np.float32))
