"""Buffers that share memory because they are never in use at the same time.

A routine's local nodes (``MemoryMode.local``: block internals, intermediate gradients,
lowering's own f32 copies and patches) live only while its items run; each is in use from the
first item that touches it to the last. Buffers whose spans of items overlap get disjoint
places in one arena; the others may share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Places start at multiples of this many bytes from the arena's start (a cache line; the CPU
# backend's arenas start on one too).
ALIGN_BYTES = 64


def pack(spans: Sequence[tuple[int, int, int]], align: int) -> tuple[list[int], int]:
    """Offsets (in elements) for buffers given as (size, first item, last item), and the
    arena's size: largest first, each at the lowest offset clear of the buffers already placed
    whose spans meet its own."""
    offsets = [0] * len(spans)
    placed: list[int] = []
    for k in sorted(range(len(spans)), key=lambda k: -spans[k][0]):
        size, first, last = spans[k]
        busy = sorted((offsets[j], offsets[j] + spans[j][0]) for j in placed
                      if spans[j][1] <= last and first <= spans[j][2])
        at = 0
        for lo, hi in busy:
            if at + size <= lo:
                break
            at = max(at, -(-hi // align) * align)
        offsets[k] = at
        placed.append(k)
    return offsets, max((o + s[0] for o, s in zip(offsets, spans, strict=True)), default=0)


def views(spans: Sequence[tuple[int, int, int]], alloc: Callable[[int], Any], itemsize: int,
          shared: bool = True) -> list[Any]:
    """Buffers for (size, first item, last item) as slices of one arena ``alloc(elements)``
    gives, of elements of ``itemsize`` bytes: placed by :func:`pack`, or (``shared`` False)
    one after another; each starts ``ALIGN_BYTES``-aligned in the arena."""
    align = max(1, ALIGN_BYTES // itemsize)
    if shared:
        offsets, total = pack(spans, align)
    else:
        offsets, total = [], 0
        for size, _, _ in spans:
            offsets.append(total)
            total = -(-(total + size) // align) * align
    arena = alloc(total)
    return [arena[o:o + s[0]] for o, s in zip(offsets, spans, strict=True)]
