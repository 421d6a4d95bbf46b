"""The IR: accumulating assignments over a product space, and computations built from them.

One form covers everything: ``lhs[lhs_idx] (accum)= expr`` for every point of a product space
of iterators ``0 .. len(space)-1``. Each buffer access carries a *projection*: one index per
axis, either an iterator number or a fixed position. Broadcasting is an operand that ignores
some iterators; a reduction is an iterator absent from ``lhs_idx``; backprop is more
assignments of the same form into gradient nodes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ocannl.ir import expr as expr_module
from ocannl.ir.expr import Apply, Const, Expr, Get, reads
from ocannl.ir.ops import ACCUMS, apply
from ocannl.ir.tnode import Tnode

# The expressions (``expr.py``) and their checked constructor (``ops.apply``), re-exported:
# the IR's users import them from here.
__all__ = ["ACCUMS", "Accum", "Affine", "Apply", "Comp", "Const", "Dynamic", "Expr", "Fixed",
           "Get",
           "Index", "Projection", "apply", "iterators_of", "reads"]


@dataclass(frozen=True)
class Fixed:
    """A fixed position along an axis (a broadcast dimension of size 1, an element pick)."""

    pos: int


@dataclass(frozen=True)
class Dynamic(Fixed):
    """A position read when the routine runs from ``node``, a one-cell index node the host
    sets (``Context.set_values``): a static index, as upstream's batch slicing ``x @| i``
    binds. Every analysis treats it as a fixed position (``pos`` is unused); the code loads
    it. Reads only: the node's ``check_values`` keeps it inside the axis."""

    node: Tnode | None = None

    def __post_init__(self) -> None:
        expr_module.dynamic_seen = True


@dataclass(frozen=True)
class Affine:
    """``sum(coef * iterator) + offset`` along one axis (a convolution's ``stride * oh + kh -
    pad``). A read at a position outside the axis gives 0 (zero padding); a write there does
    not happen."""

    terms: tuple[tuple[int, int], ...]  # (coefficient, iterator number)
    offset: int = 0

    @property
    def iterators(self) -> tuple[int, ...]:
        return tuple(i for _, i in self.terms)

    def bounds(self, space: tuple[int, ...]) -> tuple[int, int]:
        """The least and the greatest position it takes over the product space."""
        lo = hi = self.offset
        for c, i in self.terms:
            lo += min(0, c * (space[i] - 1))
            hi += max(0, c * (space[i] - 1))
        return lo, hi

    def outside(self, space: tuple[int, ...], dim: int) -> tuple[bool, bool]:
        """Whether it takes a position below 0, and one at or past ``dim``, over the product
        space: the padding a read along an axis of ``dim`` cells checks for."""
        lo, hi = self.bounds(space)
        return lo < 0, hi >= dim


Index = int | Fixed | Affine  # an iterator number, a fixed position, or an affine combination
Projection = tuple[Index, ...]


def iterators_of(idx: Projection) -> set[int]:
    """Every iterator a projection mentions."""
    out: set[int] = set()
    for i in idx:
        if isinstance(i, Affine):
            out.update(i.iterators)
        elif isinstance(i, int):
            out.add(i)
    return out


@dataclass(frozen=True, eq=False)
class Accum:
    """``lhs[lhs_idx] (accum)= expr`` over ``space``; ``reset`` first fills lhs with the
    accumulator's neutral element (``=+`` in OCANNL)."""

    lhs: Tnode
    lhs_idx: Projection
    accum: str
    expr: Expr
    space: tuple[int, ...]
    reset: bool = False

    def __post_init__(self) -> None:
        if any(isinstance(i, Dynamic) for i in self.lhs_idx):
            raise ValueError(f"a dynamic index may only read, not write {self.lhs.name}")
        if self.accum not in ACCUMS:
            raise ValueError(f"unknown accumulation {self.accum!r}: expected one of {list(ACCUMS)}")
        if len(self.lhs_idx) != len(self.lhs.dims):
            raise ValueError(
                f"projection {self.lhs_idx} has {len(self.lhs_idx)} indices for node "
                f"{self.lhs.name} with dims {self.lhs.dims}"
            )
        for g in reads(self.expr):
            if len(g.idx) != len(g.node.dims):
                raise ValueError(
                    f"projection {g.idx} has {len(g.idx)} indices for node {g.node.name} "
                    f"with dims {g.node.dims}"
                )
        for idx in (self.lhs_idx, *(g.idx for g in reads(self.expr))):
            bad = [i for i in iterators_of(idx) if not 0 <= i < len(self.space)]
            if bad:
                raise ValueError(f"projection {idx} names iterators {bad} outside the product "
                                 f"space {self.space}")

    @property
    def nodes(self) -> list[Tnode]:
        return [self.lhs, *(g.node for g in reads(self.expr))]


@dataclass(frozen=True)
class Comp:
    """A computation: assignments run in order. ``+`` sequences two computations."""

    assignments: tuple[Accum, ...] = ()
    label: str = "comp"

    def __add__(self, other: Comp) -> Comp:
        return Comp(
            self.assignments + other.assignments,
            f"{self.label}+{other.label}" if self.assignments else other.label,
        )

    @staticmethod
    def seq(comps: Iterable[Comp], label: str) -> Comp:
        out = Comp(label=label)
        for c in comps:
            out = out + c
        return Comp(out.assignments, label)

    @property
    def nodes(self) -> list[Tnode]:
        """Every node the computation touches, in first-use order."""
        seen: dict[int, Tnode] = {}
        for a in self.assignments:
            for n in a.nodes:
                seen.setdefault(n.id, n)
        return list(seen.values())
