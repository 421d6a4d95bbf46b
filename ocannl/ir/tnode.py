"""Tensor nodes: the named, typed, shaped buffers the generated code reads and writes."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable

import numpy as np

from ocannl.ir.ops import Precision


class MemoryMode(enum.Enum):
    """Where a node's values live.

    ``virtual``: never stored, a constant folded into the code (numbers).
    ``materialized``: a device buffer that routines bind to and the host can read and write.
    ``local``: computed and consumed inside each routine that uses it (a tensor a block of
    ``nn_blocks`` computes and does not return, the gradient of an intermediate tensor,
    im2col's patches): every routine writes it whole before reading it,
    holds it in memory shared with its other local nodes whose uses do not overlap, and the
    host cannot read or write it (``Tensor.retain_grad`` keeps a gradient materialized).
    """

    virtual = "virtual"
    materialized = "materialized"
    local = "local"


_ids = itertools.count(1)
_issued = 0  # the latest id handed out


def ids_issued() -> int:
    """The latest node id handed out: nodes created from now on have larger ids."""
    return _issued


class Tnode:
    """One buffer of the IR. Tensors own nodes; backends own the buffers behind them.

    ``dims`` may be ``None`` for a parameter whose input axes are inferred from its first use;
    it is fixed once, by :meth:`set_dims`. ``host_data`` holds the values a data-backed node
    starts from (a term's array, a loss scale), copied into every context that allocates it.
    ``zero_start``: all zeros is the node's defined initial value (optimizer state: momentum,
    Adam's moments and step counter), so allocating it initializes it; any other node counts as
    initialized in a context only once something writes it (see ``Context.is_initialized``).
    ``needs_init``: its values must come from outside the routines (a parameter's init, data
    from the host): a routine reading it before anything initialized it refuses to run.
    ``check_values``: what host values must satisfy beyond shape (class ids: integers in range);
    ``Context.set_values`` calls it before writing, so bad values change nothing.

    Cast twins (``ocannl.mixed_prec.cast_param``, placed ``"auto"``): ``cast_of`` is a twin's
    master, ``twins`` a master's twins; ``keeps`` marks a node scheduling keeps a twin in
    between steps (``ocannl.ir.kept``): the master it holds rounded, and the twin's precision.
    """

    __slots__ = ("id", "label", "_dims", "_size", "prec", "memory_mode", "host_data", "zero_start",
                 "needs_init", "check_values", "resolve", "cast_of", "twins", "keeps",
                 "__weakref__")

    def __init__(
        self,
        label: str,
        dims: tuple[int, ...] | None,
        prec: Precision,
        *,
        memory_mode: MemoryMode = MemoryMode.materialized,
        host_data: np.ndarray | None = None,
        zero_start: bool = False,
        needs_init: bool = False,
    ) -> None:
        global _issued
        self.id = _issued = next(_ids)
        self.label = label
        self._dims = None if dims is None else tuple(int(d) for d in dims)
        # the cell count, once the dims are known: read by the host's every-step paths
        self._size = None if self._dims is None else math.prod(self._dims)
        self.prec = prec
        self.memory_mode = memory_mode
        self.host_data = host_data
        self.zero_start = zero_start
        self.needs_init = needs_init
        self.check_values: Callable[[np.ndarray], object] | None = None
        # Set by a tensor whose shape is still inferred: reading dims closes its inference.
        self.resolve: Callable[[], None] | None = None
        self.cast_of: Tnode | None = None
        self.twins: tuple[Tnode, ...] = ()
        self.keeps: tuple[Tnode, Precision] | None = None

    @property
    def dims(self) -> tuple[int, ...]:
        if self._dims is None and self.resolve is not None:
            self.resolve()
        if self._dims is None:
            raise ValueError(f"node {self.name} has dims not yet inferred")
        return self._dims

    @property
    def dims_known(self) -> bool:
        return self._dims is not None

    @property
    def dims_if_known(self) -> tuple[int, ...] | None:
        """The dims, or None while they are still to be inferred (read-only)."""
        return self._dims

    def set_dims(self, dims: tuple[int, ...]) -> None:
        if self._dims is not None and self._dims != tuple(dims):
            raise ValueError(f"node {self.name} already has dims {self._dims}, not {tuple(dims)}")
        self._dims = tuple(int(d) for d in dims)
        self._size = math.prod(self._dims)

    @property
    def size(self) -> int:
        size = self._size
        return size if size is not None else math.prod(self.dims)

    @property
    def strides(self) -> tuple[int, ...]:
        """Row-major element strides of the flat buffer."""
        out, acc = [], 1
        for d in reversed(self.dims):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))

    @property
    def name(self) -> str:
        """A unique, identifier-safe name: label plus id."""
        safe = "".join(c if c.isalnum() else "_" for c in self.label) or "n"
        return f"{safe}_{self.id}"

    def __repr__(self) -> str:
        dims = self._dims if self._dims is not None else "?"
        return f"Tnode({self.name}, dims={dims}, {self.prec.value}, {self.memory_mode.value})"
