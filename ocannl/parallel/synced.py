"""Sums over the global batch inside a data-parallel step (synced batch norm): the gradient
routine cut right after each sum a shard computes, so the sums over every shard can be put
in between, and a rank's shards each kept apart across the cuts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ocannl.context import Context, Routine
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor.global_sums import GlobalSums


@dataclass
class SyncedRoutine:
    """A gradient routine cut at its global sums. ``parts`` run in order; ``done[p]``: the
    groups of sums complete after part ``p`` (each replaced, before part ``p + 1``, by its sum
    over every shard). ``nodes`` and ``buffers``: what one shard's run leaves for its next
    part besides the routines' local memory (every node the parts write, the shard's
    inputs and row offsets), which a rank computing several shards saves per shard."""

    parts: list[Routine]
    done: list[list[tuple[Tnode, ...]]]
    nodes: list[Tnode]
    buffers: list[Any]
    local_memory: tuple[Any, ...]
    buckets: list[int]  # per gradient bucket given: the part after which it is written


def compile_synced(ctx: Context, comp: Any, sums: Sequence[GlobalSums],
                   set_per_shard: Sequence[Tnode], keep_out: set[int],
                   buckets: Sequence[Sequence[Tnode]] = ()) -> tuple[Context, SyncedRoutine]:
    """Compile ``comp`` cut after each group of ``sums`` (``Context.compile_split``; an
    assignment that would read a sum before its cut is refused) and after each of
    ``buckets`` (gradients, for an overlapped exchange). ``set_per_shard``: the nodes the
    host writes for each shard (its data, its row offset); ``keep_out``: node ids every
    shard shares, never saved (the parameters)."""
    groups = [g for s in sums for g in s.groups]
    ctx, parts, ready = ctx.compile_split(
        comp, [*groups, *buckets], replaced=[True] * len(groups) + [False] * len(buckets))
    done: list[list[tuple[Tnode, ...]]] = [[] for _ in parts]
    for g, r in zip(groups, ready, strict=False):
        done[r].append(g)
    seen: dict[int, Tnode] = {}
    for n in [*(m for r in parts for m in r.written), *set_per_shard]:
        # A kept twin is recast from its master when the master is restored, never saved;
        # a local node lies in the local memory (or in no memory: computed where it is read).
        if n.id not in keep_out and n.keeps is None and n.memory_mode is MemoryMode.materialized:
            seen.setdefault(n.id, n)
    nodes = list(seen.values())
    return ctx, SyncedRoutine(parts, done, nodes, [ctx.device_buffer(n) for n in nodes],
                              parts[0].local_memory, ready[len(groups):])


class ShardMemory:
    """Copies of what a shard's run leaves between the parts of a :class:`SyncedRoutine`: one
    per shard of a rank's block, and the step's start (every shard starts from it)."""

    def __init__(self, routine: SyncedRoutine, shards: int) -> None:
        self.routine = routine
        self.live = [*routine.buffers, *routine.local_memory]
        self.copies = [[b.copy() for b in self.live] for _ in range(shards + 1)]

    def save(self, j: int) -> None:
        """Keep shard ``j``'s memory (``-1``: the step's start)."""
        for kept, b in zip(self.copies[j], self.live, strict=True):
            kept[...] = b

    def restore(self, ctx: Context, j: int) -> Context:
        """Put shard ``j``'s memory back (``-1``: the step's start); the kept twins of what
        it restores are recast before their next read."""
        for kept, b in zip(self.copies[j], self.live, strict=True):
            b[...] = kept
        for n in self.routine.nodes:
            ctx = ctx.mark_written(n)
        return ctx
