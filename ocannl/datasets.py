"""Seeded, generated toy datasets: every run of the same seed sees the same points."""

from __future__ import annotations

import numpy as np


def half_moons(n: int, *, noise: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two interleaving half circles: points ``(n, 2)`` f32 and labels ``(n,)`` int in {0, 1}."""
    if n < 2:
        raise ValueError(f"half_moons needs n >= 2 points, got {n}")
    rng = np.random.default_rng(seed)
    n0 = n // 2
    t0 = rng.uniform(0, np.pi, n0)
    t1 = rng.uniform(0, np.pi, n - n0)
    upper = np.stack([np.cos(t0), np.sin(t0)], axis=1)
    lower = np.stack([1 - np.cos(t1), 0.5 - np.sin(t1)], axis=1)
    x = np.concatenate([upper, lower]) + rng.normal(0, noise, (n, 2))
    y = np.concatenate([np.zeros(n0, np.int64), np.ones(n - n0, np.int64)])
    perm = rng.permutation(n)
    return x[perm].astype(np.float32), y[perm]


def circles(n: int, *, noise: float = 0.05, factor: float = 0.5,
            seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A small circle inside a large one: points ``(n, 2)`` f32, labels ``(n,)`` (1 = inner)."""
    if n < 2 or not 0 < factor < 1:
        raise ValueError(f"circles needs n >= 2 and 0 < factor < 1, got n={n}, factor={factor}")
    rng = np.random.default_rng(seed)
    n0 = n // 2
    t = rng.uniform(0, 2 * np.pi, n)
    r = np.where(np.arange(n) < n0, 1.0, factor)
    x = np.stack([r * np.cos(t), r * np.sin(t)], axis=1) + rng.normal(0, noise, (n, 2))
    y = (np.arange(n) >= n0).astype(np.int64)
    perm = rng.permutation(n)
    return x[perm].astype(np.float32), y[perm]


def one_hot(labels: np.ndarray, classes: int) -> np.ndarray:
    """f32 one-hot rows, ``(*labels.shape, classes)``. Labels must be integers in
    ``[0, classes)``: ``ValueError`` names the first that is not (NumPy's indexing would make
    ``-1`` the last class)."""
    if isinstance(classes, bool) or not isinstance(classes, (int, np.integer)) or classes < 1:
        raise ValueError(f"one_hot: classes must be an integer >= 1, got {classes!r}")
    arr = np.asarray(labels)
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise ValueError(f"one_hot: labels must be integers, got dtype {arr.dtype}: "
                         f"{arr.reshape(-1)[:5].tolist()}")
    bad = (arr < 0) | (arr >= classes)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"one_hot: label {arr[pos].item()} at {pos} is not a class: expected "
                         f"an integer in [0, {classes})")
    return np.eye(classes, dtype=np.float32)[arr.astype(np.int64)]


def gaussian_classes(
    n: int, dim: int, classes: int, *, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs around random class centres: a synthetic task wide enough for GEMMs."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (classes, dim))
    y = rng.integers(0, classes, n)
    x = centres[y] + rng.normal(0, 1, (n, dim))
    return x.astype(np.float32), y
