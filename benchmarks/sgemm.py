"""The sgemm rate NumPy reaches on this machine: the yardstick for the wide step's GEMMs."""

from __future__ import annotations

import time

import numpy as np


def sgemm_rate(n: int = 1024, reps: int = 15, seed: int = 0) -> float:
    """Median FLOP/s of ``np.dot`` on two f32 ``n x n`` matrices (after one warm-up call)."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), np.float32)
    np.dot(a, b, out=out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.dot(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / float(np.median(times))
