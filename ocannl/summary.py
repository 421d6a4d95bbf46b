"""A model's summary in one call: its parameters by block, with their shapes (as upstream
OCANNL writes them, ``batch|input->output``; an open one with its row variables), element counts
and bytes, and the bytes by precision, f32 masters and their 16-bit cast twins both shown (a
twin placed ``"auto"`` or ``"virtual"`` holds no buffer of its own between routines: it is
counted as what a routine reads, and said so).

    from ocannl.summary import summary
    summary(loss)            # prints the table, returns its text
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

from ocannl.ir.tnode import MemoryMode
from ocannl.tensor.data import buffers
from ocannl.tensor.sharing import block_path
from ocannl.tensor.tensor import Tensor

__all__ = ["summary"]

_PLACES = {MemoryMode.materialized: "materialized", MemoryMode.local: "local to routines",
           MemoryMode.virtual: "recomputed at each read"}


def _dims(dims: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def summary(t: Tensor, *, file: TextIO | None = sys.stdout) -> str:
    """Print (to ``file``; None: do not print) and return the summary of the parameters
    ``t`` depends on (a loss, a model's output): one row per parameter under the block that
    created it (``nn_blocks``' blocks, nested blocks joined by ``/``), each cast twin on the
    row below its master, then the totals: parameters, bytes by precision, and the state
    buffers (running statistics, random-stream counters) the graph updates."""
    if not isinstance(t, Tensor):
        raise TypeError(f"summary expects a Tensor (a loss or a model's output), got "
                        f"{type(t).__name__}: {t!r:.100}")
    params = t.params
    twins: dict[int, list[Tensor]] = {}
    for s in t.topo():
        if s.master is not None:
            twins.setdefault(s.master.value.id, []).append(s)
    rows: list[tuple[str, str, str, str, str, str]] = []
    masters: dict[tuple[str, str], list[int]] = {}  # (precision, kind) -> [count, bytes]
    copies: dict[str, list[int]] = {}
    places: dict[str, set[str]] = {}
    last_block = None
    for p in params:
        block = "/".join(block_path(p)) or "(no block)"
        shown_block = block if block != last_block else ""
        last_block = block
        # Printing closes no inference: an open shape shows its row variables, uncounted.
        count = math.prod(p.value.dims_if_known) if p.shape_known else 0
        nbytes = count * p.prec.itemsize
        mine = twins.get(p.value.id, [])
        kind = "master" if mine else "param"
        shown = (f"{count:,}", f"{nbytes:,}") if p.shape_known else ("?", "?")
        rows.append((shown_block, p.label, p.shape_text(), shown[0],
                     f"{p.prec.value} {kind}", shown[1]))
        acc = masters.setdefault((p.prec.value, kind), [0, 0])
        acc[0] += count
        acc[1] += nbytes
        for tw in mine:
            tb = count * tw.prec.itemsize
            rows.append(("", f"  {tw.label}", tw.shape_text(), shown[0],
                         f"{tw.prec.value} twin", f"{tb:,}" if p.shape_known else "?"))
            acc = copies.setdefault(tw.prec.value, [0, 0])
            acc[0] += count
            acc[1] += tb
            places.setdefault(tw.prec.value, set()).add(_PLACES[tw.value.memory_mode])
    head = ("block", "parameter", "shape (batch|input->output)", "count", "precision", "bytes")
    widths = [max(len(r[k]) for r in [head, *rows]) for k in range(6)]
    right = {3, 5}

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if k in right else c.ljust(w)
                         for k, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()

    out = [f"summary of {t.label}: {len(params)} parameters, "
           f"{sum(c for c, _ in masters.values()):,} values", line(head),
           "-" * len(line(head))]
    out += [line(r) for r in rows]
    by_prec = [f"{prec} {kind}s {b:,} bytes ({c:,} values)"
               for (prec, kind), (c, b) in sorted(masters.items())]
    by_prec += [f"{prec} twins {b:,} bytes ({c:,} values; {', '.join(sorted(places[prec]))})"
                for prec, (c, b) in copies.items()]
    out.append("bytes by precision: " + "; ".join(by_prec) if by_prec
               else "bytes by precision: none (no parameters)")
    state = buffers(t)
    if state:
        out.append("state buffers: " + ", ".join(
            f"{n.label} {_dims(n.dims)} {n.prec.value}" for n in state))
    text = "\n".join(out)
    if file is not None:
        print(text, file=file)
    return text
