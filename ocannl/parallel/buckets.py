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
    elements ``[a, b)`` of the flat buffer (the tree's nodes covering its block; the last one
    is the flat buffer itself) to the tree's sum there, in place, on every rank. The whole
    buffer's exchange is the bucket ``[0, size)``.

    With one partial sum a rank (1 or 2 ranks, or the order off): the communicator's
    allreduce, on 2 ranks one addition per element (``a + b`` and ``b + a`` are the same bits:
    the tree's order). On more ranks, the tree's sum with the bytes of a ring allreduce: each
    rank owns ``1 / N`` of the elements; an all-to-all sends each rank every partial sum's
    slice it owns, each rank sums its slice in the tree's order, and an allgather brings every
    slice to every rank. MPI only moves bytes; every addition is the tree's, elementwise, so
    slicing changes no bit. A communicator summing on the device (NCCL's ``start_tree_sum``)
    does the tree's sum there instead, on its own stream. ``scratch``: host buffers kept
    between steps, by range."""

    def __init__(self, comm: Communicator, tree: ShardTree, covers: list[list[tuple[int, int]]],
                 flat: Any, a: int, b: int, partials: Sequence[Any], *,
                 fixed_order: bool = True,
                 scratch: dict[tuple[int, int], tuple[np.ndarray, ...]] | None = None) -> None:
        self.comm, self.tree, self.covers = comm, tree, covers
        self.flat, self.a, self.b = flat, a, b
        self._bufs: tuple[np.ndarray, ...] | None = None  # the all-to-all's (work, recv, out)
        size = comm.size
        if size == 1:
            self._first: Pending | None = None
        elif size == 2 or not fixed_order:
            self._first = comm.start_allreduce_sum(flat[a:b])
        elif hasattr(comm, "start_tree_sum"):  # NCCL's: device buffers, summed there
            self._first = comm.start_tree_sum(tree, covers, flat, a, b, partials)
        else:
            n, cmax = b - a, max(len(c) for c in covers)
            per = -(-n // size)
            bufs = None if scratch is None else scratch.get((a, b))
            if bufs is None:
                bufs = (np.zeros((cmax, size * per), np.float32),
                        np.empty((size, cmax, per), np.float32),
                        np.empty((size, per), np.float32))
                if scratch is not None:
                    scratch[(a, b)] = bufs
            self._bufs = bufs
            work, recv, _ = bufs
            for i, p in enumerate(partials):
                work[i, :n] = host_values(p[a:b])
            send = np.ascontiguousarray(work.reshape(cmax, size, per).transpose(1, 0, 2))
            self._first = comm.start_alltoall(send, recv)

    def test(self) -> None:
        """Let it progress (MPI moves bytes inside its calls)."""
        if self._first is not None:
            self._first.test()

    def finish(self) -> None:
        """Wait for it; the bucket's sum is then in the flat buffer."""
        if self._first is None:
            return
        self._first.wait()
        if self._bufs is None:
            return
        _, recv, out = self._bufs
        known = {node: recv[r, i] for r in range(self.comm.size)
                 for i, node in enumerate(self.covers[r])}
        mine = np.ascontiguousarray(self.tree.evaluate(known), np.float32)  # under the
        # reduction's errstate: a non-finite gradient is the checksum's to see
        self.comm.start_allgather(mine, out).wait()
        whole = out.reshape(-1)[:self.b - self.a]
        if isinstance(self.flat, np.ndarray):
            self.flat[self.a:self.b] = whole
        else:
            self.flat[self.a:self.b].set(whole)


def host_values(a: Any) -> np.ndarray:
    """A device buffer's values as a NumPy array (itself on the CPU)."""
    return a if isinstance(a, np.ndarray) else a.get()
