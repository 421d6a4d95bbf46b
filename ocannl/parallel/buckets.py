"""Overlap: the gradients' exchange cut into buckets, each started as soon as the backward code
has written it, while the rest of the backward code runs.

A bucket is a range of the flat gradient buffer holding whole parameters (and the padding
between them), at least ``bucket_bytes`` long, taken from the buffer's end (the backward code
writes the last layers' gradients first). The gradient routine is compiled cut after the item
completing each bucket (``Context.compile_split``: the same items, the same bits). Each
bucket's exchange is the shard tree's, on the bucket's elements only: the order of every
addition is the tree's whatever the bucketing, and MPI or NCCL only move bytes (or add two
numbers, on 2 ranks), so the bits are those of one exchange after the whole backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ocannl.parallel.comm import Communicator, Pending
from ocannl.parallel.shards import ShardTree


def bucket_ranges(offsets: Sequence[int], sizes: Sequence[int], length: int,
                  bucket_bytes: int, itemsize: int = 4) -> list[tuple[int, int, list[int]]]:
    """Buckets over a flat buffer of ``length`` elements holding parameters at ``offsets``
    (ascending) of ``sizes``: ``(start, end, members)`` from the buffer's end, each holding
    whole parameters (``members``: their indices) and at least ``bucket_bytes`` unless it is
    the first; together they cover ``[0, length)``."""
    out: list[tuple[int, int, list[int]]] = []
    end, members = length, []
    for i in reversed(range(len(offsets))):
        members.append(i)
        if (end - offsets[i]) * itemsize >= bucket_bytes or i == 0:
            start = 0 if i == 0 else offsets[i]
            out.append((start, end, sorted(members)))
            end, members = start, []
    return out


class BucketExchange:
    """One bucket's exchange, started at construction: this rank's partial sums over the
    bucket's elements ``[a, b)`` of the flat buffer (the tree's nodes covering its block; the
    last one is the flat buffer itself) to the tree's sum there, in place. On 2 ranks (or with
    the order off) an allreduce; on more, an all-to-all of the slices, each rank's slice
    summed in the tree's order, an allgather (as ``DataParallel._scatter_sum`` on the whole
    buffer)."""

    def __init__(self, comm: Communicator, tree: ShardTree, covers: list[list[tuple[int, int]]],
                 flat: Any, a: int, b: int, partials: Sequence[Any], *,
                 fixed_order: bool = True) -> None:
        self.comm, self.tree, self.covers = comm, tree, covers
        self.flat, self.a, self.b = flat, a, b
        size = comm.size
        self._gather: Pending | None = None
        if size == 1:
            self._first: Pending | None = None
        elif size == 2 or not fixed_order:
            self._first = comm.start_allreduce_sum(flat[a:b])
        else:
            n, cmax = b - a, max(len(c) for c in covers)
            self.per = -(-n // size)
            work = np.zeros((cmax, size * self.per), np.float32)
            for i, p in enumerate(partials):
                work[i, :n] = _host(p[a:b])
            self._send = np.ascontiguousarray(
                work.reshape(cmax, size, self.per).transpose(1, 0, 2))
            self._recv = np.empty((size, cmax, self.per), np.float32)
            self._first = comm.start_alltoall(self._send, self._recv)

    def test(self) -> None:
        """Let it progress (MPI moves bytes inside its calls)."""
        if self._first is not None:
            self._first.test()

    def finish(self) -> None:
        """Wait for it; the bucket's sum is then in the flat buffer."""
        if self._first is None:
            return
        self._first.wait()
        if self.comm.size == 2 or not hasattr(self, "_recv"):
            return
        size = self.comm.size
        known = {node: self._recv[r, i] for r in range(size)
                 for i, node in enumerate(self.covers[r])}
        mine = np.ascontiguousarray(self.tree.evaluate(known), np.float32)  # under the
        # reduction's errstate: a non-finite gradient is the checksum's to see
        out = np.empty((size, self.per), np.float32)
        self.comm.start_allgather(mine, out).wait()
        whole = out.reshape(-1)[:self.b - self.a]
        if isinstance(self.flat, np.ndarray):
            self.flat[self.a:self.b] = whole
        else:
            self.flat[self.a:self.b].set(whole)


def _host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()
