"""Kept twins: a cast twin held between steps, written in the pass that writes its master.

A cast twin placed ``"auto"`` (``ocannl.mixed_prec.cast_param``) is its master rounded to the
twin's precision. Cast again in every step, a large twin costs a pass over its master each time
a product reads it (twice a step: the forward product and the input gradient's), and on a CPU
without 16-bit product units a widening back to f32 on top. Scheduling keeps it instead: a
materialized node holding the master's values rounded to the twin's precision, stored in the
precision the target's products read it in (:func:`kept_precision`). Then:

- every nest that writes the master whole writes the kept twin in the same pass, reading the
  value it just stored (the optimizer's update: what fused mixed-precision optimizers do);
- a routine reading the twin reads the kept node, and its cast is dropped, unless the routine
  writes the master between the twin's cast and a read of it (then the twin stays local and is
  cast as before);
- the context recasts a kept twin (:func:`recast`) after anything else wrote its master
  (``set_values``, a checkpoint's load, a buffer handed out by ``device_buffer``), before the
  next routine reads it, and refuses to if the master was never initialized.

The values are the cast's, bit for bit: the kept node holds exactly what each read of the
twin would have computed from the master at that point.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

from ocannl.ir.assignments import Accum, Get
from ocannl.ir.lowered import (
    AccessIndex,
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    Lowered,
    copy_source,
    covers,
    loop_nest,
    nodes_of,
    renamed_item,
    renamed_nest,
)
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode, Tnode

__all__ = ["keep_twins", "kept_node", "kept_precision", "recast"]

# twin -> its kept node per storage precision (one per kind of target it was scheduled for)
_KEPT: weakref.WeakKeyDictionary[Tnode, dict[Precision, Tnode]] = weakref.WeakKeyDictionary()


def kept_precision(twin: Tnode, target: Target) -> Precision:
    """What a kept twin is stored in: the twin's precision where the target's products take it
    as stored, else the precision they compute in (f32). There, the 16-bit twin would be widened
    to f32 for every product that reads it; kept in f32 it is widened once, in the update's
    pass, for twice the bytes of a 16-bit copy held between steps."""
    return twin.prec if twin.prec in target.native_products else twin.prec.compute


def kept_node(twin: Tnode, target: Target) -> Tnode:
    """The materialized node keeping ``twin`` for ``target`` (the same node for every routine
    of every context with that storage precision)."""
    master = twin.cast_of
    if master is None:
        raise ValueError(f"{twin.name} is not a cast twin placed 'auto'")
    prec = kept_precision(twin, target)
    per = _KEPT.setdefault(twin, {})
    node = per.get(prec)
    if node is None:
        node = Tnode(f"{twin.label}_kept", master.dims, prec)
        node.keeps = (master, twin.prec)
        per[prec] = node
    return node


def recast(kept: Tnode) -> Accum:
    """``kept = master`` rounded to the twin's precision: the cast a context runs after the host
    wrote the master."""
    assert kept.keeps is not None
    master, prec = kept.keeps
    idx = tuple(range(len(kept.dims)))
    return Accum(kept, idx, "=", Get(master, idx, rounded=prec), kept.dims)


def _twins_of(master: Tnode) -> list[Tnode]:
    return [t for t in master.twins if t.memory_mode is MemoryMode.local]


def keep_twins(code: list[Lowered], target: Target) -> list[Lowered]:
    """``code`` reading kept twins in place of casting them, and writing each kept twin wherever
    it writes the twin's master (see the module docstring)."""
    nodes = nodes_of(code)
    index = AccessIndex(code)
    keeps: dict[int, list[Tnode]] = {  # master id -> its kept twins, for masters written here
        n.id: [kept_node(t, target) for t in _twins_of(n)]
        for n in nodes if n.twins and index.writers.get(n.id)}
    keeps = {i: ks for i, ks in keeps.items() if ks}
    read_kept: dict[int, Tnode] = {}  # twin id -> the kept node its reads read
    for t in nodes:
        if t.cast_of is None or t.memory_mode is not MemoryMode.local:
            continue
        if _casts_only(code, t) and not _written_while_read(index, t):
            read_kept[t.id] = kept_node(t, target)
    if not keeps and not read_kept:
        return code
    out: list[Lowered] = []
    for item in code:
        after: list[Tnode] = []  # masters this item writes other than in a pointwise pass
        if isinstance(item, LoopGroup):
            nests: list[LoopNest] = []
            for n in item.nests:
                if n.assign.lhs.id in read_kept:
                    continue  # the twin's cast: the kept node holds its values
                n = renamed_nest(n, read_kept)
                nests.append(n)
                if n.assign.lhs.id in keeps:
                    if _in_pass(n, item):
                        nests.extend(_write_kept(n, k) for k in keeps[n.assign.lhs.id])
                    else:
                        after.append(n.assign.lhs)
            if nests:
                out.append(replace(item, nests=tuple(nests)))
        elif isinstance(item, Gemm):
            out.append(renamed_item(item, read_kept))
            if item.assign.lhs.id in keeps:
                after.append(item.assign.lhs)
        else:
            assert isinstance(item, Fill)
            out.append(item)
            if item.node.id in keeps:
                after.append(item.node)
        for master in after:
            out.extend(LoopGroup((loop_nest(recast(k)),)) for k in keeps[master.id])
    return out


def _casts_only(code: list[Lowered], twin: Tnode) -> bool:
    """Whether every write of ``twin`` in ``code`` is its cast from its master, whole."""
    for item in code:
        if isinstance(item, LoopGroup):
            for n in item.nests:
                if n.assign.lhs.id == twin.id and copy_source(n) is not twin.cast_of:
                    return False
        elif isinstance(item, Gemm) and item.assign.lhs.id == twin.id:
            return False
        elif isinstance(item, Fill) and item.node.id == twin.id:
            return False
    return True


def _written_while_read(index: AccessIndex, twin: Tnode) -> bool:
    """Whether the master is written after the twin's first cast (or the routine's start) and
    before its last read: a read there must see the master's value at the cast, not the kept
    node's, which follows the master."""
    assert twin.cast_of is not None
    readers = index.readers.get(twin.id)
    if not readers:
        return False
    start = index.writers.get(twin.id, [0])[0]
    return any(start <= w <= readers[-1] for w in index.writers.get(twin.cast_of.id, []))


def _in_pass(n: LoopNest, group: LoopGroup) -> bool:
    """Whether the kept twins of the master ``n`` writes can be written in ``n``'s own pass:
    ``n`` overwrites every cell of the master point by point."""
    a = n.assign
    return (not n.red and not n.scatter and covers(a) and a.lhs.dims == tuple(
        a.space[i] for i in a.lhs_idx if isinstance(i, int)) and not group.lead.walk_rows
            and all(isinstance(i, int) for i in a.lhs_idx))


def _write_kept(n: LoopNest, kept: Tnode) -> LoopNest:
    """A nest beside ``n`` (which writes the master) storing the cell it just wrote, rounded
    to the twin's precision, into ``kept``."""
    assert kept.keeps is not None
    master, prec = kept.keeps
    a = n.assign
    return LoopNest(Accum(kept, a.lhs_idx, "=", Get(master, a.lhs_idx, rounded=prec), a.space),
                    n.par, n.red)
