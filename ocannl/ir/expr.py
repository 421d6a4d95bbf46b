"""The expression language of the IR: reads, literals and op applications.

:func:`reads` lists an expression's reads (lowering's hottest function, kept apart),
:func:`walk` every sub-expression, and :func:`rewrite_reads` is the one rewriter (a function
from a read to an expression, applied over an expression).

It sits below the op table (``ops.py``), whose gradient rules build expressions, and above
nothing of the IR: an application names its op by a string, and :func:`ocannl.ir.ops.apply`
(re-exported by ``assignments``), the way applications are built, checks the name and the
arity against the table. ``assignments`` builds assignments over these expressions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: tnode and assignments import the op table, above this
    from ocannl.ir.assignments import Projection
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode


@dataclass(frozen=True, eq=False)
class Get:
    """Read ``node`` at the projection ``idx`` of the current product-space point; ``rounded``:
    the value rounded to that (16-bit) precision as a store into a node of it would round it,
    then widened back: a read of a virtual node through its source (``ocannl.ir.schedule``)."""

    node: Tnode
    idx: Projection
    rounded: Precision | None = None


@dataclass(frozen=True)
class Const:
    """A literal folded into the code."""

    value: float


@dataclass(frozen=True, eq=False)
class Apply:
    """An op from the op table applied to sub-expressions (build it with ``ops.apply``, which
    checks the op's name and arity)."""

    op: str
    args: tuple[Expr, ...]


Expr = Get | Const | Apply


# Set once an ``assignments.Dynamic`` index exists: until then no read looks for one (this is
# the hottest function of lowering).
dynamic_seen = False


def reads(expr: Expr) -> Iterator[Get]:
    """Every buffer read in an expression, a dynamic index's node too (read when the code
    runs, as a one-cell ``Get``)."""
    if isinstance(expr, Get):
        if dynamic_seen:
            for i in expr.idx:
                node = getattr(i, "node", None)  # ``assignments.Dynamic``
                if node is not None:
                    yield Get(node, ())
        yield expr
    elif isinstance(expr, Apply):
        for a in expr.args:
            yield from reads(a)


def walk(expr: Expr) -> Iterator[Expr]:
    """Every sub-expression of ``expr``, itself first, then each operand's, in order
    (pre-order): the one generic walker, for questions about every node of an expression."""
    yield expr
    if isinstance(expr, Apply):
        for a in expr.args:
            yield from walk(a)


def rewrite_reads(expr: Expr, read: Callable[[Get], Expr]) -> Expr:
    """``expr`` with every read ``g`` replaced by ``read(g)`` (an expression): the one rewriter
    of expressions. Applications are rebuilt around the rewritten operands; literals stay."""
    if isinstance(expr, Get):
        return read(expr)
    if isinstance(expr, Apply):
        return Apply(expr.op, tuple(rewrite_reads(x, read) for x in expr.args))
    return expr
