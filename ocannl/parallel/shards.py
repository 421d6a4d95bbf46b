"""The shards of a global batch and the one tree their gradients are summed in, whatever the
number of ranks computing them."""

from __future__ import annotations

from typing import Any

import numpy as np


def shard(rows: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s equal part of ``rows`` (split along the first axis): rows
    ``[rank * n, (rank + 1) * n)`` with ``n = len(rows) // size``. Unequal shards are refused:
    the mean of the ranks' means would not be the global batch's mean."""
    total = len(rows)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard: rank {rank!r} is not in [0, {size!r})")
    if total % size:
        raise ValueError(f"shard: a global batch of {total} rows does not split into {size} "
                         f"equal shards: use a global batch divisible by the number of ranks")
    n = total // size
    return rows[rank * n:(rank + 1) * n]


class ShardTree:
    """The one order in which the gradients of ``shards`` shards are summed, whatever the
    number of ranks that computed them: a binary tree over the shards ``0 .. shards-1``, the
    node ``[lo, hi)`` being the sum of ``[lo, mid)`` and ``[mid, hi)`` with ``mid = lo + (hi -
    lo) // 2``, each addition one f32 rounding per element (IEEE addition is commutative, so
    ``a + b`` and ``b + a`` are the same bits; only the grouping matters, and it is fixed).

    With ``shards`` and the number of ranks powers of two, each rank's block of consecutive
    shards is one subtree: a rank sums its own block locally and sends one partial sum. In
    general a rank sends the partial sums of the largest subtrees inside its block
    (:meth:`cover`), and every rank evaluates the rest of the tree from them."""

    def __init__(self, shards: int) -> None:
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ValueError(f"ShardTree: shards must be an integer >= 1, got {shards!r}")
        self.shards = shards

    @staticmethod
    def split(lo: int, hi: int) -> int:
        return lo + (hi - lo) // 2

    def cover(self, a: int, b: int) -> list[tuple[int, int]]:
        """The largest nodes of the tree inside shards ``[a, b)``, in shard order."""
        out: list[tuple[int, int]] = []

        def walk(lo: int, hi: int) -> None:
            if hi <= a or b <= lo:
                return
            if a <= lo and hi <= b:
                out.append((lo, hi))
                return
            mid = self.split(lo, hi)
            walk(lo, mid)
            walk(mid, hi)

        walk(0, self.shards)
        return out

    def evaluate(self, known: dict[tuple[int, int], Any], lo: int = 0, hi: int | None = None,
                 out: Any = None) -> Any:
        """The sum over node ``[lo, hi)`` (the root by default) from the sums ``known`` (by
        node: leaves, or partial sums of subtrees), added in the tree's order. Arrays (NumPy
        or CuPy, elementwise) or numbers; ``out``: an array the sum is written into (it may be
        one of ``known``'s, read elementwise before it is written), returned."""
        hi = self.shards if hi is None else hi
        got = known.get((lo, hi))
        if got is not None:
            if out is not None and got is not out:
                self._fits(out, got)
                out[...] = got
            return got if out is None else out
        if hi - lo <= 1:
            raise KeyError(f"ShardTree.evaluate: shard {lo} is in no known node")
        mid = self.split(lo, hi)
        left, right = self.evaluate(known, lo, mid), self.evaluate(known, mid, hi)
        if out is None:
            return left + right
        self._fits(out, left)
        np.add(left, right, out=out)  # CuPy arrays take NumPy's ufuncs too
        return out

    @staticmethod
    def _fits(out: Any, like: Any) -> None:
        """``ValueError`` unless ``out`` is an array of ``like``'s shape and dtype."""
        if getattr(out, "shape", None) != getattr(like, "shape", ()) \
                or getattr(out, "dtype", None) != getattr(like, "dtype", None):
            raise ValueError(f"ShardTree.evaluate: out must be an array of the sum's shape "
                             f"{getattr(like, 'shape', ())} and dtype "
                             f"{getattr(like, 'dtype', type(like).__name__)}, got "
                             f"{type(out).__name__} {getattr(out, 'shape', '')} "
                             f"{getattr(out, 'dtype', '')}")

    def parents(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Every node's parent (the root has none)."""
        out: dict[tuple[int, int], tuple[int, int]] = {}

        def walk(lo: int, hi: int) -> None:
            if hi - lo > 1:
                mid = self.split(lo, hi)
                out[(lo, mid)] = out[(mid, hi)] = (lo, hi)
                walk(lo, mid)
                walk(mid, hi)

        walk(0, self.shards)
        return out

    def __repr__(self) -> str:
        return f"ShardTree({self.shards})"


def default_shards(global_batch: int, *, min_rows: int = 16, max_shards: int = 8) -> int:
    """A shard count for a global batch of ``global_batch`` rows: the largest power of two up
    to ``max_shards`` that divides it into shards of at least ``min_rows`` rows (1 when none
    does). Powers of two let 1, 2, 4 ... ``max_shards`` ranks each sum one subtree of the
    shard tree locally; ``min_rows`` is the smallest shard that still runs its products
    well (a workload's setting: 32 for a wide MLP, 16 for a small convnet)."""
    for name, v in (("global_batch", global_batch), ("min_rows", min_rows),
                    ("max_shards", max_shards)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"default_shards: {name} must be an integer >= 1, got {v!r}")
    best = 1
    s = 2
    while s <= max_shards:
        if global_batch % s == 0 and global_batch // s >= min_rows:
            best = s
        s *= 2
    return best


