"""Sums over the global batch that one shard's code cannot compute alone (synced batch norm):
which nodes hold a shard's part of each, so a data-parallel step can replace them with the sum
over every shard before the code reads them."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from ocannl.ir.tnode import Tnode
from ocannl.tensor.tensor import Tensor


@dataclass(frozen=True)
class GlobalSums:
    """The global-batch sums of one op. Each group of ``groups`` is computed by the routine
    over the shard it runs on; a data-parallel step replaces the group's values, right after
    the item computing them, with their sum over every shard (in its shard tree's order), and
    the code after reads those. ``count`` holds the cells per channel the sums run over:
    ``rows`` (one shard's, its value when no one replaces anything: the shard is the batch)
    until the step sets it to ``rows * shards``. ``same_on_every_shard``: state the forward
    code updates from the global sums only (running statistics), so every shard ends with
    the same values."""

    label: str
    rows: int
    count: Tnode
    groups: tuple[tuple[Tnode, ...], ...]
    same_on_every_shard: tuple[Tnode, ...] = ()


# Tensor -> the global sums its code computes.
_SUMS: weakref.WeakKeyDictionary[Tensor, tuple[GlobalSums, ...]] = weakref.WeakKeyDictionary()


def register_global_sums(t: Tensor, sums: GlobalSums) -> None:
    """Record that ``t``'s code computes ``sums`` (for :func:`global_sums`)."""
    _SUMS[t] = (*_SUMS.get(t, ()), sums)


def global_sums(t: Tensor) -> list[GlobalSums]:
    """The global sums ``t``'s graph computes, in its topological order."""
    out: list[GlobalSums] = []
    for s in t.topo():
        out.extend(_SUMS.get(s, ()))
    return out


def sum_nodes(sums: Sequence[GlobalSums]) -> list[Tnode]:
    """Every node a step replaces, in order."""
    return [n for s in sums for g in s.groups for n in g]
