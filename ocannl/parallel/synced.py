"""Sums over the global batch inside a data-parallel step (synced batch norm): the gradient
routine cut right after each sum a shard computes, so the sums over every shard can be put
in between, and a rank's shards each kept apart across the cuts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ocannl.context import Context, Routine
from ocannl.ir.lowering import effects
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor.global_sums import GlobalSums


@dataclass(eq=False)  # by identity: a reducer's caches are keyed by it
class SyncedRoutine:
    """A gradient routine cut at its global sums. ``parts`` run in order; ``done[p]``: the
    groups of sums complete after part ``p`` (each replaced, before part ``p + 1``, by its sum
    over every shard); ``buckets``: per gradient bucket given, the part after which it is
    written.

    What a rank computing several shards keeps of each (local nodes included): ``saves[p +
    1]``, what a shard's part ``p`` wrote that it reads later (``saves[0]``: its data, which
    the host wrote first); ``restores[q]``, what part ``q`` reads that the shard wrote
    before; ``last_restores``, what the host reads after the last part (gradients, loss,
    statistics) that the last part did not write; ``start``, the state the parts update in
    place (random-stream counters, running statistics), which every shard starts from."""

    parts: list[Routine]
    done: list[list[tuple[Tnode, ...]]]
    buckets: list[int]
    saves: list[list[Tnode]]
    restores: list[list[Tnode]]
    last_restores: list[Tnode]
    start: list[Tnode]


def compile_synced(ctx: Context, comp: Any, sums: Sequence[GlobalSums],
                   set_per_shard: Sequence[Tnode], finals: Sequence[Tnode],
                   buckets: Sequence[Sequence[Tnode]] = ()) -> tuple[Context, SyncedRoutine]:
    """Compile ``comp`` cut after each group of ``sums`` (``Context.compile_split``; an
    assignment that would read a sum before its cut is refused) and after each of
    ``buckets`` (gradients, for an overlapped exchange). ``set_per_shard``: the nodes the
    host writes for each shard before its first part (its data, its row offset);
    ``finals``: what the host reads after a shard's last part (gradients, loss, statistics)."""
    groups = [g for s in sums for g in s.groups]
    ctx, parts, ready = ctx.compile_split(
        comp, [*groups, *buckets], replaced=[True] * len(groups) + [False] * len(buckets))
    done: list[list[tuple[Tnode, ...]]] = [[] for _ in parts]
    for g, r in zip(groups, ready, strict=False):
        done[r].append(g)
    fx = [effects(list(r.lowered)) for r in parts]
    reads = [{n.id for n in f.inputs} for f in fx]
    writes = [{n.id for n in f.written} for f in fx]
    every = [n for f in fx for n in (*f.inputs, *f.written)]
    local = parts[0].local_views
    # What a shard holds: stored (a node neither materialized nor in local memory is computed
    # where it is read), not a kept twin (recast from its master when the master is restored).
    nodes = {n.id: n for n in [*set_per_shard, *finals, *every]
             if (n.memory_mode is MemoryMode.materialized or n.id in local) and n.keeps is None}
    # State updated in place (read before the step writes it): each shard's from the start.
    start = [n for n in effects([i for r in parts for i in r.lowered]).inputs
             if n.id in nodes and any(n.id in w for w in writes)]
    held = {n.id for n in [*set_per_shard, *start]}  # by a shard from before its first part
    last = len(parts) - 1
    need = {i: max([q for q in range(len(parts)) if i in reads[q]], default=-1) for i in nodes}
    need.update({n.id: len(parts) for n in finals if n.id in nodes})
    saves = [[nodes[i] for i in held if need[i] > 0 and nodes[i] in set_per_shard]]
    saves += [[nodes[i] for i in writes[p] if i in nodes and need[i] > p] for p in range(last)]
    restores = [[nodes[i] for i in reads[q] if i in nodes
                 and (i in held or any(i in writes[p] for p in range(q)))]
                for q in range(len(parts))]
    restores[0] = [n for n in start if n.id in reads[0]]  # the shard's data: just written
    last_restores = [n for n in finals if n.id in nodes and n.id not in writes[last]
                     and n.id not in reads[last] and any(n.id in w for w in writes)]
    return ctx, SyncedRoutine(parts, done, ready[len(groups):], saves, restores,
                              last_restores, start)


class ShardMemory:
    """What a rank's shards leave between the parts of a :class:`SyncedRoutine`: a copy per
    shard of what it reads again, saved after the part writing it and restored before the
    part reading it; every shard's copy of the in-place state starts at the step's."""

    def __init__(self, ctx: Context, routine: SyncedRoutine, shards: int) -> None:
        self.routine = routine
        ids = {n.id: n for ns in [*routine.saves, *routine.restores, routine.start,
                                  routine.last_restores] for n in ns}
        local = routine.parts[0].local_views
        self.buffers = {i: local[i] if n.memory_mode is MemoryMode.local
                        else ctx.device_buffer(n) for i, n in ids.items()}
        self.copies = [{i: b.copy() for i, b in self.buffers.items()} for _ in range(shards)]

    def save_start(self) -> None:
        """The step's in-place state, as every shard's own until it runs."""
        for n in self.routine.start:
            for copies in self.copies:
                copies[n.id][...] = self.buffers[n.id]

    def save(self, j: int, p: int) -> None:
        """Keep what shard ``j``'s part ``p`` wrote that it reads later (``-1``: its data)."""
        copies = self.copies[j]
        for n in self.routine.saves[p + 1]:
            copies[n.id][...] = self.buffers[n.id]

    def put(self, values: Sequence[tuple[Tnode, Any]]) -> None:
        """Write the same values of nodes into every shard's copy (the sums over every
        shard, which replace each shard's own)."""
        for n, v in values:
            for copies in self.copies:
                copies[n.id][...] = v.reshape(-1)

    def restore(self, ctx: Context, j: int, q: int | None) -> Context:
        """Put back what shard ``j``'s part ``q`` reads (``None``: what the host reads after
        its last part); the kept twins of what it restores are recast before their next
        read."""
        copies = self.copies[j]
        for n in self.routine.restores[q] if q is not None else self.routine.last_restores:
            self.buffers[n.id][...] = copies[n.id]
            if n.twins:  # a master: its kept twins, if any, are stale
                ctx = ctx.mark_written(n)
        return ctx
