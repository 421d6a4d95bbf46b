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


@dataclass
class SyncedRoutine:
    """A gradient routine cut at its global sums. ``parts`` run in order; ``done[p]``: the
    groups of sums complete after part ``p`` (each replaced, before part ``p + 1``, by its sum
    over every shard); ``buckets``: per gradient bucket given, the part after which it is
    written.

    What a rank computing several shards saves per shard: ``live[p]``, the nodes a shard's
    run has written by the end of part ``p`` and reads after it (or the host does, after the
    last part: ``finals``), with ``local_live[p]`` when some local node is among them (the
    local memory is then saved whole); ``start``, the state the parts update in place
    (random-stream counters, running statistics), which every shard starts the step from."""

    parts: list[Routine]
    done: list[list[tuple[Tnode, ...]]]
    buckets: list[int]
    live: list[list[Tnode]]
    local_live: list[bool]
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
    written = {n.id for f in fx for n in f.written}
    # State updated in place (read before the step writes it): each shard's from the start.
    start = [n for n in effects([i for r in parts for i in r.lowered]).inputs
             if n.id in written and n.memory_mode is MemoryMode.materialized]
    # The host writes the shard's data first; a shard's own start state is there from the start.
    first: dict[int, int] = {n.id: -1 for n in [*set_per_shard, *start]}
    need: dict[int, int] = {n.id: len(parts) for n in finals}
    nodes: dict[int, Tnode] = {n.id: n for n in [*set_per_shard, *finals]}
    for p, f in enumerate(fx):
        for n in f.written:
            first.setdefault(n.id, p)
            nodes.setdefault(n.id, n)
        for n in f.inputs:
            need[n.id] = max(need.get(n.id, -1), p)
            nodes.setdefault(n.id, n)
    live: list[list[Tnode]] = []
    local_live: list[bool] = []
    for p in range(len(parts) - 1):
        across = [n for i, n in nodes.items() if first.get(i, len(parts)) <= p < need.get(i, -1)
                  and n.keeps is None]  # a kept twin is recast from its master when restored
        live.append([n for n in across if n.memory_mode is MemoryMode.materialized])
        local_live.append(any(n.memory_mode is MemoryMode.local for n in across))
    return ctx, SyncedRoutine(parts, done, ready[len(groups):], live, local_live, start)


class ShardMemory:
    """What a rank's shards leave between the parts of a :class:`SyncedRoutine`, a copy per
    shard (saved after a part, restored before the shard's next), and the step's start."""

    def __init__(self, ctx: Context, routine: SyncedRoutine, shards: int) -> None:
        self.routine = routine
        ids = {n.id: n for ns in [*routine.live, routine.start] for n in ns}
        self.buffers = {i: ctx.device_buffer(n) for i, n in ids.items()}
        self.local = routine.parts[0].local_memory
        self.copies = [{i: b.copy() for i, b in self.buffers.items()} for _ in range(shards)]
        self.local_copies = [[b.copy() for b in self.local] if any(routine.local_live) else []
                             for _ in range(shards)]
        self.at_start = {n.id: self.buffers[n.id].copy() for n in routine.start}

    def save_start(self) -> None:
        """Keep the step's start state, as every shard's own until it runs."""
        for i, kept in self.at_start.items():
            kept[...] = self.buffers[i]
            for copies in self.copies:
                copies[i][...] = kept

    def restore_start(self, ctx: Context) -> Context:
        """Every shard's first part starts from the step's state."""
        for n in self.routine.start:
            self.buffers[n.id][...] = self.at_start[n.id]
            ctx = ctx.mark_written(n)
        return ctx

    def save(self, j: int, p: int) -> None:
        """Keep what shard ``j`` left after part ``p`` for its later parts."""
        copies = self.copies[j]
        for n in self.routine.live[p]:
            copies[n.id][...] = self.buffers[n.id]
        if self.routine.local_live[p]:
            for kept, b in zip(self.local_copies[j], self.local, strict=True):
                kept[...] = b

    def restore(self, ctx: Context, j: int, p: int) -> Context:
        """Put back what shard ``j`` left after part ``p``; the kept twins of what it restores
        are recast before their next read."""
        copies = self.copies[j]
        for n in self.routine.live[p]:
            self.buffers[n.id][...] = copies[n.id]
            ctx = ctx.mark_written(n)
        if self.routine.local_live[p]:
            for kept, b in zip(self.local_copies[j], self.local, strict=True):
                b[...] = kept
        return ctx
