"""Shapes: three rows of axes (batch, input, output), laid out as batch, output, input.

Pointwise ops broadcast row by row, aligning axes to the right: a missing axis broadcasts, and
so does a 1 that *stretches* (:data:`BCAST_ONE`: a reduction's kept axis, the project's own);
a 1 the user gave (a term's or a parameter's dims, an array's shape) does not, as at upstream
OCANNL's HEAD: it is a size like any other. ``a @ b`` contracts a's input row with b's output
row: the result has the broadcast batch row, b's input row and a's output row, as function
composition does. A shape with dims still to infer is ``ocannl.tensor.inference``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ocannl.ir.assignments import Fixed, Index

ROWS = ("batch", "output", "input")


class _Stretch(int):
    """A size 1 that broadcasts: equal to 1 everywhere (a buffer's dims drop the mark)."""

    def __repr__(self) -> str:
        return "1*"


BCAST_ONE = _Stretch(1)


def stretches(d: object) -> bool:
    """Whether ``d`` is a 1 that broadcasts (rather than a size the user gave)."""
    return type(d) is _Stretch


class Based(int):
    """A size with a *basis*, upstream's dim label (``("rgb", 3)``): a unit that must agree
    wherever the axis meets another (a buffer's dims drop it)."""

    basis: str

    def __new__(cls, size: int, basis: str) -> Based:
        out = super().__new__(cls, size)
        out.basis = basis
        return out

    def __repr__(self) -> str:
        return f"{int(self)}_{self.basis}"

    def __reduce__(self) -> tuple:
        return (Based, (int(self), self.basis))


def basis_of(d: object) -> str | None:
    """``d``'s basis (None: a plain size)."""
    return getattr(d, "basis", None)


def same_dim(a: int, b: int) -> bool:
    """Equal sizes of the same basis (a 1 that stretches is a plain 1 here)."""
    return int(a) == int(b) and basis_of(a) == basis_of(b)


@dataclass(frozen=True)
class Shape:
    """A shape whose every dim is known (an open one is ``inference.SymShape``)."""

    batch: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    input: tuple[int, ...] = ()

    @property
    def dims(self) -> tuple[int, ...]:
        """The buffer's dims: batch axes, then output axes, then input axes."""
        return self.batch + self.output + self.input

    def row(self, name: str) -> tuple[int, ...]:
        return getattr(self, name)

    def row_offsets(self) -> dict[str, int]:
        """Position of each row's first axis in ``dims``."""
        return {"batch": 0, "output": len(self.batch), "input": len(self.batch) + len(self.output)}

    def __str__(self) -> str:
        """As upstream OCANNL writes a shape: ``batch|input->output``, axes comma-separated
        (a 1 that stretches is ``1*``)."""
        return f"{_fmt(self.batch)}|{_fmt(self.row('input'))}->{_fmt(self.output)}"


def _fmt(row: tuple[int, ...]) -> str:
    return ",".join(f"{int(d)}*" if stretches(d) else repr(d) if basis_of(d) else str(int(d))
                    for d in row)


def broadcast(shapes: list[Shape], what: str) -> Shape:
    """The pointwise result shape of ``shapes``; raises naming every shape when they clash."""
    rows = {}
    for name in ROWS:
        width = max(len(s.row(name)) for s in shapes)
        out: list[int] = [BCAST_ONE] * width
        for s in shapes:
            r = s.row(name)
            for k, d in enumerate(r):
                j = width - len(r) + k
                if stretches(out[j]):
                    out[j] = d
                elif not stretches(d) and not same_dim(d, out[j]):
                    listed = " and ".join(str(x) for x in shapes)
                    hint = (" (`*` is pointwise here, OCANNL's `*.`; OCANNL's `*`, the "
                            "product contracting a's input axes with b's output axes, is `@`)"
                            if what == "mul" else "")
                    if 1 in (d, out[j]):
                        hint += (" (a 1 given by the user does not stretch: reduce with "
                                 "keepdims, or give the matching size)")
                    if int(d) == int(out[j]):
                        hint += (f" (solved dimensions for axis: different bases: {d!r} and "
                                 f"{out[j]!r})")
                    raise ValueError(f"{what}: shapes {listed} do not broadcast in the {name} "
                                     f"row{hint}")
        rows[name] = tuple(out)
    return Shape(**rows)


def broadcast_projection(operand: Shape, result: Shape) -> tuple[Index, ...]:
    """Index of ``operand`` at the result's point: result iterators, Fixed(0) where it broadcasts.

    The product space is the result's dims, iterator k being result axis k.
    """
    idx: list[Index] = []
    res_off = result.row_offsets()
    for name in ROWS:
        r, rr = operand.row(name), result.row(name)
        for k, d in enumerate(r):
            j = res_off[name] + len(rr) - len(r) + k
            idx.append(Fixed(0) if stretches(d) and rr[len(rr) - len(r) + k] != 1 else j)
    return tuple(idx)


def int_value(arg_name: str, value: object) -> int:
    """``value`` as an int, or ``TypeError`` naming ``arg_name`` and the value: a size, a stride
    or a window is a whole number, and a float (2.7, even 3.0) is refused rather than truncated
    (as torch refuses a float in a size)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{arg_name} must be an integer, got {value!r:.60} "
                        f"({type(value).__name__})")
    return int(value)


def int_dims(arg_name: str, value: object) -> tuple[int, ...]:
    """``value`` (a sequence of integers) as a tuple of ints, or ``TypeError`` naming
    ``arg_name`` and the value: an int where a list is expected (``output_dims=3``), a string,
    or any element that is not an integer (``[2.7]``, never truncated to 2)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{arg_name} must be a sequence of integers (e.g. [3]), got {value!r:.60} "
                        f"({type(value).__name__})")
    out = []
    for d in value:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{arg_name} must be a sequence of integers, got {value!r:.60}: "
                            f"{d!r:.30} ({type(d).__name__}) is not an integer")
        out.append(int(d))
    return tuple(out)
