"""ZeRO-1: each rank owns the optimizer state of one slice of the parameters' flat layout.

The parameters and their gradients lie in two flat buffers of one layout
(:func:`ocannl.context.flat_layout`), cut into ``size`` equal slices: rank ``r`` owns elements
``[r * per, (r + 1) * per)``. A slice is cut by elements, not by tensors (one weight matrix
may be most of a model), so it crosses parameters: its intersection with each parameter is a
:class:`Part`, a 1-D run of that parameter's elements, viewed in both flat buffers. The
optimizer's update runs over this rank's parts only, with state of the parts' size; an
allgather of the parameters' flat buffer then gives every rank the whole model.

The update is elementwise, and the code for an element is the same whether it runs over a part
or over the whole tensor (the CPU code is never reassociated or contracted), so the bits are
the unsharded run's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ocannl.context import flat_layout
from ocannl.ir.tnode import Tnode
from ocannl.tensor.tensor import Tensor

if TYPE_CHECKING:
    from ocannl.optim import Optimizer

#: The alignment, in elements, of each parameter in the flat buffers (``Context.share_flat``).
FLAT_ALIGN = 64


@dataclass(frozen=True, eq=False)
class Part:
    """The elements ``[start, start + size)`` of ``param`` (flattened) that this rank owns:
    ``value`` and ``grad`` are 1-D nodes viewing them in the flat buffers, at ``offset +
    start``."""

    param: Tensor
    offset: int  # the parameter's first element in the flat layout
    start: int
    size: int
    value: Tnode
    grad: Tnode


class OptimizerShard:
    """Rank ``rank`` of ``size``'s slice of the flat layout of ``params`` (a loss's, in its
    order), and its parts. Give it to ``Optimizer.update(..., shard=)``; the optimizer then
    keeps state for the parts only. Built by ``DataParallel(shard_optimizer=True)``."""

    def __init__(self, params: Sequence[Tensor], rank: int, size: int, *,
                 align: int = FLAT_ALIGN) -> None:
        self.params = list(params)
        self.rank, self.size = rank, size
        self.offsets, total = flat_layout([p.value.size for p in self.params], align)
        self.per = -(-total // size)  # elements of a slice
        self.length = self.per * size  # of the flat buffers: equal slices
        lo, hi = rank * self.per, (rank + 1) * self.per
        self.parts: list[Part] = []
        for p, off in zip(self.params, self.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + p.value.size)
            if a >= b:
                continue
            n, start = b - a, a - off
            assert p.grad is not None
            name = f"{p.value.label}_r{rank}of{size}"
            self.parts.append(Part(p, off, start, n, Tnode(name, (n,), p.value.prec),
                                   Tnode(f"grad_{name}", (n,), p.grad.prec)))
        self.optimizer: Optimizer | None = None  # the one whose update was built over the parts

    def bind(self, optimizer: Optimizer) -> None:
        """Record the optimizer whose update runs over this shard; a second one is refused (the
        state of one slice has one owner)."""
        if self.optimizer is not None and self.optimizer is not optimizer:
            raise ValueError(f"{self!r} already shards the state of {self.optimizer!r}: one "
                             f"optimizer per DataParallel(shard_optimizer=True)")
        self.optimizer = optimizer

    def owned(self, param: Tensor) -> Part | None:
        """This rank's part of ``param``, or None when another rank owns all of it."""
        return next((q for q in self.parts if q.param is param), None)

    def __repr__(self) -> str:
        return (f"OptimizerShard(rank {self.rank} of {self.size}, {len(self.parts)} part(s), "
                f"{sum(q.size for q in self.parts)} of {self.length} elements)")
