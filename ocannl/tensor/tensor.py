"""Tensors: a value node, an optional gradient node, and the code that computes both.

Each tensor holds only its *own* forward assignments (computing its value from its children)
and its own backprop assignments (adding its gradient's contribution into its children's
gradients). ``forward_comp`` and ``backprop_comp`` gather them over the graph in dependency
order, each tensor's code once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from ocannl.ir.assignments import Accum, Comp, Const, Get
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor import inference
from ocannl.tensor.inference import SymShape
from ocannl.tensor.shape import Shape

InitFn = Callable[..., np.ndarray]  # (dims, fan_in, rng, fan_out) -> values


class Tensor:
    """A node of the model graph. Build tensors with the functions of ``ocannl.tensor``.

    Its shape is a :class:`Shape` once every dim is known. Until then (a parameter made
    without some dims, an op over one) ``sym`` holds its open rows, and its code waits: reading
    ``shape``, ``dims`` or its code (compiling it) closes the inference first (see
    ``ocannl.tensor.inference``). Cast twins (``mixed_prec.cast_param``) are tensors too:
    ``master`` is the full-precision parameter a twin is a rounded copy of (None for every
    other tensor).
    """

    def __init__(
        self,
        value: Tnode,
        shape: Shape | SymShape,
        *,
        kind: str,
        children: tuple[Tensor, ...] = (),
        differentiable: bool | None = None,
        const: float | None = None,
        init: InitFn | None = None,
    ) -> None:
        self.value = value
        self._shape: Shape | None = shape if isinstance(shape, Shape) else None
        self.sym: SymShape | None = shape if isinstance(shape, SymShape) else None
        self.kind = kind  # "param", "term", "number" or "op"
        self.children = children
        self.const = const
        self.init = init
        self._forward_code: tuple[Accum, ...] = ()
        self._backprop_code: tuple[Accum, ...] = ()
        self._build: Callable[[], None] | None = None
        self.master: Tensor | None = None
        if differentiable is None:
            differentiable = any(c.grad is not None for c in children)
        # A parameter's gradient is materialized (optimizers and the host read it); any other
        # tensor's is local to the routine computing it, as torch keeps no gradient of a
        # non-leaf tensor unless asked: ``retain_grad``.
        self.grad: Tnode | None = (
            Tnode(f"grad_{value.label}", value.dims_if_known, value.prec,
                  memory_mode=MemoryMode.materialized if kind == "param" else MemoryMode.local)
            if differentiable else None
        )
        if self.sym is not None:
            inference.register(self)
            value.resolve = self._resolve
            if self.grad is not None:
                self.grad.resolve = self._resolve

    # --- shape and code: known, or inferred when first needed ---------------------------------

    @property
    def shape(self) -> Shape:
        """The concrete shape; closes the shape inference of an open one (see the class)."""
        if self._shape is None:
            inference.close(self)
            if self._shape is None:  # pragma: no cover - close fixes every variable
                raise ValueError(f"{self.label}: shape {self.sym} left open")
        return self._shape

    @property
    def shape_known(self) -> bool:
        """Whether every dim is known (without closing anything)."""
        if self._shape is None:
            self.shape_inferred()
        return self._shape is not None

    def shape_text(self) -> str:
        """The shape as upstream writes it, ``batch|input->output``, with the row variables
        of an open one: printing finalizes nothing."""
        return str(self._shape) if self._shape is not None else str(self.sym)

    def shape_inferred(self) -> None:
        """Called when inference closed this tensor's rows: fix its shape and its nodes' dims."""
        if self.sym is None:
            return
        shape = self.sym.concrete()
        if shape is None:
            return
        self._shape, self.sym = shape, None
        for node in (self.value, self.grad):
            if node is not None:
                node.set_dims(shape.dims)
                node.resolve = None

    def _resolve(self) -> None:
        _ = self.shape

    def defer(self, build: Callable[[], None]) -> None:
        """Generate this tensor's code with ``build`` once every shape it reads is known: at
        once if they are, else when its code is first asked for."""
        if self.sym is None and all(c.sym is None for c in self.children):
            build()
        else:
            self._build = build

    def _built(self) -> None:
        build, self._build = self._build, None
        if build is not None:
            for t in (self, *self.children):
                _ = t.shape
            try:
                build()
            except BaseException:
                self._build = build
                raise

    @property
    def forward_code(self) -> tuple[Accum, ...]:
        self._built()
        return self._forward_code

    @forward_code.setter
    def forward_code(self, code: tuple[Accum, ...]) -> None:
        self._forward_code = code

    @property
    def backprop_code(self) -> tuple[Accum, ...]:
        self._built()
        return self._backprop_code

    @backprop_code.setter
    def backprop_code(self, code: tuple[Accum, ...]) -> None:
        self._backprop_code = code

    def retain_grad(self) -> Tensor:
        """Keep this tensor's gradient materialized, so the host can read it after a routine
        computes it (routines compiled before keep theirs local). A parameter's always is."""
        if self.grad is None:
            raise ValueError(f"{self.label} has no gradient: it depends on no parameter")
        self.grad.memory_mode = MemoryMode.materialized
        return self

    # --- graph traversal ----------------------------------------------------------------------

    @property
    def label(self) -> str:
        return self.value.label

    @property
    def prec(self) -> Precision:
        return self.value.prec

    @property
    def dims(self) -> tuple[int, ...]:
        if self._shape is None:
            _ = self.shape
        return self.value.dims

    def topo(self) -> list[Tensor]:
        """Every tensor this one depends on (itself last), children before parents."""
        order: list[Tensor] = []
        seen: set[int] = set()
        stack: list[tuple[Tensor, Iterator[Tensor]]] = [(self, iter(self.children))]
        seen.add(id(self))
        while stack:
            t, it = stack[-1]
            child = next(it, None)
            if child is None:
                stack.pop()
                order.append(t)
            elif id(child) not in seen:
                seen.add(id(child))
                stack.append((child, iter(child.children)))
        return order

    @property
    def params(self) -> list[Tensor]:
        """The parameters this tensor depends on, in creation order."""
        return sorted((t for t in self.topo() if t.kind == "param"), key=lambda t: t.value.id)

    def forward_comp(self) -> Comp:
        code = tuple(a for t in self.topo() for a in t.forward_code)
        return Comp(code, f"forward_{self.label}")

    def backprop_comp(self) -> Comp:
        """Zero every gradient in the graph, then propagate from this tensor's gradient.

        The caller seeds this tensor's gradient after the zeroing (see ``train.grad_update``).
        """
        order = [t for t in self.topo() if t.grad is not None]
        return Comp(tuple(a for t in _backprop_order(order) for a in t.backprop_code),
                    f"backprop_{self.label}")

    def zero_grads_comp(self) -> Comp:
        order = [t for t in self.topo() if t.grad is not None]
        return Comp(tuple(fill(t.grad, 0.0) for t in order), f"zero_grads_{self.label}")

    # --- operators (defined in ocannl.tensor.pointwise and .reductions) -------------------------

    def __repr__(self) -> str:
        return f"Tensor({self.label}, {self.shape_text()}, {self.prec.value}, {self.kind})"

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def _backprop_order(order: list[Tensor]) -> list[Tensor]:
    """The tensors of ``order`` (a topological order, the loss last) in the order their
    backprop code runs: each once every tensor whose backprop writes its gradient has run,
    and as soon as that is so (the most recently completed first). A gradient is then
    consumed right after it is complete, so a local one is held briefly: a cast twin's,
    which only flows into its master's, no longer waits for the rest of the backward pass."""
    by_grad = {t.grad.id: t for t in order if t.grad is not None}
    writes: dict[int, list[Tensor]] = {}
    pending: dict[int, int] = {id(t): 0 for t in order}
    for t in order:
        targets = {id(c): c for a in t.backprop_code
                   if (c := by_grad.get(a.lhs.id)) is not None and c is not t}
        writes[id(t)] = list(targets.values())
        for c in targets.values():
            pending[id(c)] += 1

    def sink(t: Tensor) -> bool:  # its backprop writes no local gradient: it only frees
        return all(c.grad.memory_mode is not MemoryMode.local for c in writes[id(t)])

    stack = [t for t in order if pending[id(t)] == 0]  # the loss last: popped first
    out: list[Tensor] = []
    while stack:
        t = stack.pop()
        out.append(t)
        ready = []
        for c in writes[id(t)]:
            pending[id(c)] -= 1
            if pending[id(c)] == 0:
                ready.append(c)
        # Popped first: sinks, then the first operand's branch.
        stack.extend(sorted(reversed(ready), key=sink))
    assert len(out) == len(order), "backprop writes form a cycle"
    return out


def fill(node: Tnode, value: float) -> Accum:
    """``node[...] = value`` over the node's whole extent."""
    n = len(node.dims)
    return Accum(node, tuple(range(n)), "=", Const(value), node.dims)


def copy_into(dst: Tnode, src: Get | Const) -> Accum:
    n = len(dst.dims)
    return Accum(dst, tuple(range(n)), "=", src, dst.dims)


# --- leaf tensors -----------------------------------------------------------------------------

_seed = {"base": 0}
_param_counter = itertools.count()


def _no_postprocess(t: Tensor) -> Tensor:
    return t


# OCANNL's ``Tensor.param_postprocess``: applied to every tensor ``param`` creates, before it is
# returned. ``mixed_prec.with_master_weights`` sets one that hands out cast twins for the
# duration of its model-building function (and resets it with the token, however it exits).
active_param_postprocess: ContextVar[Callable[[Tensor], Tensor]] = ContextVar(
    "active_param_postprocess", default=_no_postprocess)


def param_postprocess(t: Tensor) -> Tensor:
    """Apply the active postprocess to a freshly created parameter."""
    return active_param_postprocess.get()(t)


def set_seed(seed: int) -> None:
    """Seed parameter initialisation: the n-th parameter created after this draws from
    ``default_rng([seed, n])``."""
    global _param_counter
    _seed["base"] = int(seed)
    _param_counter = itertools.count()


@dataclass(frozen=True)
class Init:
    """How a parameter's values are drawn (on the host, by ``train.init_params``)."""

    kind: str = "kaiming_uniform"  # one of INIT_KINDS
    a: float = -1.0
    b: float = 1.0

    def draw(self, dims: tuple[int, ...], fan_in: int, rng: np.random.Generator,
             fan_out: int = 1) -> np.ndarray:
        """``fan_in``: the product of the input row's dims; ``fan_out``: the output row's."""
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, dims)
        if self.kind == "normal":
            return rng.normal(self.a, self.b, dims)
        if self.kind == "zeros":
            return np.zeros(dims)
        if self.kind == "constant":
            return np.full(dims, self.a)
        if self.kind == "uniform1":  # upstream OCANNL's uniform1: [0, 1)
            return rng.uniform(0.0, 1.0, dims)
        if self.kind == "xavier_uniform":  # Glorot: variance 2 / (fan_in + fan_out)
            bound = np.sqrt(6.0 / max(fan_in + fan_out, 1))
            return rng.uniform(-bound, bound, dims)
        bound = 1.0 / np.sqrt(max(fan_in, 1))
        return rng.uniform(-bound, bound, dims)


INIT_KINDS = ("uniform", "normal", "zeros", "constant", "kaiming_uniform", "uniform1",
              "xavier_uniform")

# The init of a parameter made without ``init=`` (upstream's ``default_param_init``).
_default_init = {"init": Init()}


def set_default_init(init: str | Init) -> None:
    """The init ``T.param`` uses when given none (``kaiming_uniform`` until set)."""
    _default_init["init"] = as_init(init)


def default_init() -> Init:
    return _default_init["init"]


def as_init(init: str | Init) -> Init:
    """``init`` as an :class:`Init`, or ``ValueError`` naming the unknown kind."""
    if isinstance(init, Init):
        if init.kind not in INIT_KINDS:
            raise ValueError(f"unknown init {init.kind!r}: expected one of {INIT_KINDS}")
        return init
    if not isinstance(init, str) or init not in INIT_KINDS:
        raise ValueError(f"unknown init {init!r}: expected one of {INIT_KINDS}")
    return Init(init)
