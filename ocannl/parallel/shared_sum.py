"""The shard tree's sum in memory every rank maps (ranks on one node, on the CPU): no bytes go
through MPI. Each rank's flat gradient buffer is its block of a shared window; each rank sums
its ``1 / N`` of the elements over every block in the tree's order and copies that slice into
the others. :class:`SharedSum` does the whole buffer between two barriers; with overlap,
:class:`SharedBuckets` does it bucket by bucket, the ranks signalling each other through
shared counters as each bucket is written and summed, with no barrier. ZeRO-1's gather of the
parameters is a copy of each rank's slice into the others' blocks (:func:`copy_to_the_others`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ocannl.parallel.shards import ShardTree


class SharedSum:
    """The tree's sum of every rank's partial sum over the elements ``[a, b)``, each in its
    buffer ``blocks[q]`` (memory every rank maps: ``MpiCommunicator.shared_blocks``; one
    partial sum a rank, its node ``covers[q][0]``), written into every buffer; call it once
    every rank has written its own. After a barrier, each rank sums its ``1 / N`` of the
    elements over every buffer in the tree's order, into its own buffer, and copies that slice
    into the others; after the second barrier every buffer holds the whole sum. The additions
    are the tree's, elementwise: the bits of MPI's exchange, without its copies. They are
    worked out once (each an ``np.add`` of fixed views, a subtree's sum into a scratch array of
    its own): a step's host work is the calls alone."""

    def __init__(self, comm: Any, tree: ShardTree, covers: list[list[tuple[int, int]]],
                 blocks: list[np.ndarray], a: int = 0, b: int | None = None) -> None:
        size, rank = comm.size, comm.rank
        b = int(blocks[0].size) if b is None else b
        per = -(-(b - a) // size)
        lo, hi = min(a + rank * per, b), min(a + (rank + 1) * per, b)
        self.comm = comm
        self.adds: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # left, right, out
        self.copies: list[tuple[np.ndarray, np.ndarray]] = []  # (into, from)
        if lo >= hi:
            return
        known = {covers[q][0]: blocks[q][lo:hi] for q in range(size)}
        mine = blocks[rank][lo:hi]

        def node(a: int, z: int, out: np.ndarray | None) -> np.ndarray:
            got = known.get((a, z))
            if got is not None:
                if out is not None and got is not out:
                    self.copies.append((out, got))
                return got if out is None else out
            mid = tree.split(a, z)
            left, right = node(a, mid, None), node(mid, z, None)
            into = np.empty_like(left) if out is None else out
            self.adds.append((left, right, into))
            return into

        node(0, tree.shards, mine)
        self.copies += [(blk[lo:hi], mine) for q, blk in enumerate(blocks) if q != rank]

    def add_mine(self) -> None:
        """This rank's slice: summed over every block, then copied into the others."""
        for left, right, out in self.adds:
            np.add(left, right, out=out)
        for into, src in self.copies:
            np.copyto(into, src)

    def __call__(self) -> None:
        comm = self.comm
        comm.shared_sync("the shard tree's sum in shared memory (partial sums written)")
        self.add_mine()
        comm.shared_sync("the shard tree's sum in shared memory (sums written)")


def copy_to_the_others(blocks: list[np.ndarray], rank: int, part: slice) -> None:
    """``part`` of ``rank``'s shared block copied into every other rank's block."""
    mine = blocks[rank][part]
    for q, b in enumerate(blocks):
        if q != rank:
            b[part] = mine


class SharedBuckets:
    """The overlapped exchange in shared memory: each bucket's :class:`SharedSum` slice, done
    as soon as every rank has written that bucket, in the order the buckets were started
    (the same on every rank). A rank raises its *written* counter as it finishes writing each
    bucket (:meth:`start`); while its backward code goes on (:meth:`progress`, between the
    routine's parts) it sums the slice of every bucket the others have written too, then
    raises its *summed* counter; :meth:`finish` waits until every rank has summed a bucket,
    which is then whole in this rank's buffer. The counters count buckets over the whole
    run. Nothing waits at a barrier, and the additions are :class:`SharedSum`'s: the same
    bits. One thread a rank does the additions between its own routine's parts: the overlap
    is with the other rank's work and the barrier's wait, not a second core."""

    WRITTEN, SUMMED = 0, 1

    def __init__(self, comm: Any, tree: ShardTree, covers: list[list[tuple[int, int]]],
                 blocks: list[np.ndarray], buckets: list[tuple[int, int]]) -> None:
        self.counters = comm.shared_counters(2)
        self.sums = {(a, b): SharedSum(comm, tree, covers, blocks, a, b) for a, b in buckets}
        self.started = 0  # the buckets this rank has written, over the run
        self.summed = 0  # the buckets whose slice this rank has summed
        self.queue: list[SharedSum] = []  # the started buckets' sums not done here yet

    def start(self, a: int, b: int) -> SharedBucket:
        """This rank has written the bucket ``[a, b)`` (of its block's partial sum)."""
        self.queue.append(self.sums[(a, b)])
        self.started += 1
        self.counters.raise_to(self.WRITTEN, self.started)
        return SharedBucket(self, a, b, self.started)

    def progress(self) -> None:
        """Sum this rank's slice of every started bucket every rank has written, in order."""
        while self.queue and self.counters.reached(self.WRITTEN, self.summed + 1):
            self._sum_next()

    def finish(self, count: int, what: str) -> None:
        """Wait until the ``count``-th bucket is summed on every rank (this rank's slices up
        to it summed here first)."""
        self.counters.wait(self.WRITTEN, count, f"{what} (written)")
        while self.summed < count:
            self._sum_next()
        self.counters.wait(self.SUMMED, count, f"{what} (summed)")

    def _sum_next(self) -> None:
        self.queue.pop(0).add_mine()
        self.summed += 1
        self.counters.raise_to(self.SUMMED, self.summed)


class SharedBucket:
    """One bucket's exchange in :class:`SharedBuckets` (as ``BucketExchange``: ``test`` lets
    it progress, ``finish`` waits for it; its sum is then in the flat buffer)."""

    __slots__ = ("a", "b", "count", "owner")

    def __init__(self, owner: SharedBuckets, a: int, b: int, count: int) -> None:
        self.owner, self.a, self.b, self.count = owner, a, b, count

    def test(self) -> None:
        self.owner.progress()

    def finish(self) -> None:
        self.owner.finish(self.count, f"the shard tree's sum in shared memory, bucket "
                                      f"[{self.a}, {self.b})")
