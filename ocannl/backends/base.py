"""The backend protocol: what a :class:`~ocannl.context.Context` needs from a device, and the
target record (:class:`~ocannl.ir.target.Target`) lowering reads from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ocannl.ir.lowered import Lowered
from ocannl.ir.target import Target
from ocannl.ir.tnode import Tnode

Buffer = Any  # a NumPy array on the CPU, a CuPy array on CUDA: flat, in storage dtype

__all__ = ["Backend", "Buffer", "Target"]


class Backend(Protocol):
    """A device: buffers, and routines compiled from lowered code. What it can do is one
    value, :attr:`target`, from which lowering makes every choice (``ocannl.ir.schedule``);
    ``compile`` renders the lowered items as they are."""

    name: str

    @property
    def target(self) -> Target:
        """What lowering may rely on (products, threads, vectors, conversions)."""

    def describe(self) -> str:
        """One line for people: the device, its libraries and how it multiplies 16-bit
        operands."""

    def alloc(self, node: Tnode) -> Buffer:
        """A zero-filled flat buffer for the node, in its storage dtype."""

    def write(self, node: Tnode, buf: Buffer, host: np.ndarray) -> None:
        """Copy flat host values of any numeric dtype into the buffer in place, rounding them
        to the node's precision."""

    def writer(self, node: Tnode, buf: Buffer) -> Callable[[np.ndarray], None]:
        """:meth:`write` into this buffer, as a callable of the host values (made once, called
        every step: a data-parallel rank's staged batch)."""

    def read(self, node: Tnode, buf: Buffer) -> np.ndarray:
        """The buffer's values as a flat host array of the node's host dtype."""

    def reader(self, node: Tnode, buf: Buffer, pos: int) -> Callable[[], float]:
        """A callable returning the element at flat position ``pos`` as a Python float."""

    def bind(self, compiled: Callable, buffers: tuple[Buffer, ...]) -> Callable[[], None]:
        """A callable running the compiled code on these buffers (bound once, run often)."""

    def compile(self, label: str, code: list[Lowered], nodes: list[Tnode]) -> tuple[Any, bool]:
        """The compiled code over the nodes' buffers (in this order), to :meth:`bind`, and
        whether it was compiled anew (False: reused from the in-process cache)."""

