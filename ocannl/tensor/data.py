"""Data on the device that is not a parameter: integer class ids (validated; one-hot,
embedding lookup), counter-based random draws (``Rng``, ``dropout``), and the state a graph
keeps across steps besides its parameters (``buffers``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from ocannl.errors import real
from ocannl.ir.assignments import Accum, Const, Expr, Get, apply
from ocannl.ir.ops import HASH_MIX, Precision, precision_of
from ocannl.ir.tnode import Tnode
from ocannl.tensor.leaves import _all, _dims_row
from ocannl.tensor.pointwise import pointwise
from ocannl.tensor.reductions import _contract
from ocannl.tensor.shape import Shape
from ocannl.tensor.tensor import Tensor

# --- integer class ids as data: one-hot, embedding lookup ------------------------------------

# The largest class count whose ids a precision holds exactly (every integer below it).
_EXACT_INTS = {Precision.f64: 2**53, Precision.f32: 2**24, Precision.f16: 2**11,
               Precision.bf16: 2**8}


class ClassIds(Tensor):
    """A data-backed tensor of integer class ids in ``[0, num_classes)``, one per position of
    its batch axes (no output or input axes). Made by :func:`class_ids`; set new ids with
    :meth:`set` (or :func:`set_class_ids`), which validates them before anything is written.

    ``Context.set_values`` validates them too (through ``Tnode.check_values``): ids out of
    range or not integers are refused naming the first, and nothing is written.
    """

    num_classes: int

    def check(self, values: object) -> np.ndarray:
        """``values`` as an array of this tensor's dims, or ``ValueError`` naming the first
        offending value and its position (not an integer, out of range), or the shape."""
        return _checked_ids(self.label, values, self.num_classes, self.dims)

    def set(self, ctx: object, values: object) -> object:
        """Validate, then write the ids into ``ctx`` (nothing is written if they are invalid).
        Returns the context."""
        return ctx.set_values(self, self.check(values))  # type: ignore[attr-defined]


def _checked_ids(label: str, values: object, num_classes: int,
                 dims: tuple[int, ...] | None) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as err:
        raise ValueError(f"class ids {label}: not an array of numbers ({err})") from None
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf":
        raise ValueError(f"class ids {label}: expected integers, got an array of dtype "
                         f"{arr.dtype}")
    if dims is not None:
        size = int(np.prod(dims))
        if arr.shape != tuple(dims) and arr.shape != (size,):
            raise ValueError(f"class ids {label}: got {arr.size} ids of shape {arr.shape}, "
                             f"expected shape {tuple(dims)} (or flat ({size},))")
        arr = arr.reshape(dims)
    if arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.trunc(arr))
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"class ids {label}: value {float(arr[pos])!r} at position {pos} "
                             f"is not an integer")
    bad = (arr < 0) | (arr >= num_classes)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        v = arr[pos]
        v = int(v) if arr.dtype.kind in "iu" else float(v)
        raise ValueError(f"class ids {label}: value {v!r} at position {pos} is out of range: "
                         f"expected an integer in [0, {num_classes})")
    return arr


def class_ids(
    ids: object = None,
    *,
    num_classes: int,
    label: str = "class_ids",
    batch_dims: Sequence[int] | None = None,
    prec: Precision | str = Precision.f32,
) -> ClassIds:
    """A tensor of integer class ids, validated now (each an integer in ``[0, num_classes)``;
    ``ValueError`` names the first that is not). All its axes are batch axes (``batch_dims``
    defaults to the array's shape); without ``ids``, give ``batch_dims`` and set them later
    with :meth:`ClassIds.set`. Ids are stored as floats of ``prec``, which must hold every id
    exactly (f32: fewer than 2**24 classes)."""
    prec = precision_of(prec)
    if not isinstance(num_classes, (int, np.integer)) or isinstance(num_classes, bool) or \
            num_classes < 1:
        raise ValueError(f"class ids {label}: num_classes must be an integer >= 1, "
                         f"got {num_classes!r}")
    if num_classes > _EXACT_INTS[prec]:
        raise ValueError(f"class ids {label}: {prec.value} holds integers exactly only below "
                         f"{_EXACT_INTS[prec]}, not {num_classes} classes: use a wider prec")
    if ids is None:
        if batch_dims is None:
            raise ValueError(f"class ids {label}: give ids or batch_dims")
        dims = _dims_row("batch", batch_dims)
        host = None
    else:
        dims = None if batch_dims is None else _dims_row("batch", batch_dims)
        arr = _checked_ids(label, ids, int(num_classes), dims)
        dims = tuple(arr.shape)
        host = arr.astype(prec.numpy_dtype)
    shape = Shape(dims, (), ())
    node = Tnode(label, shape.dims, prec, host_data=host, needs_init=True)
    node.check_values = lambda v: _checked_ids(label, v, int(num_classes), shape.dims)
    t = ClassIds(node, shape, kind="term", differentiable=False)
    t.num_classes = int(num_classes)
    return t


def set_class_ids(ctx: object, ids: ClassIds, values: object) -> object:
    """``ids.set(ctx, values)``: validate the class ids, then write them. Returns the context."""
    if not isinstance(ids, ClassIds):
        raise TypeError(f"set_class_ids expects a tensor made by class_ids, got {ids!r}")
    return ids.set(ctx, values)


def _iota(label: str, n: int, prec: Precision) -> Tensor:
    """A constant data tensor ``0, 1, ..., n-1`` along one output axis."""
    node = Tnode(label, (n,), prec, host_data=np.arange(n, dtype=prec.numpy_dtype))
    return Tensor(node, Shape((), (n,), ()), kind="term", differentiable=False)


def one_hot(ids: ClassIds, *, prec: Precision | str | None = None) -> Tensor:
    """``[ids == v for v in range(num_classes)]`` along a new output axis (not differentiable).

    A row whose id matched no class (out of range or not an integer: ids set by
    ``Context.set_values`` are not validated) is NaN throughout, so what is computed from it
    shows the error rather than treating the id as absent."""
    if not isinstance(ids, ClassIds):
        raise TypeError(f"one_hot expects a tensor made by class_ids, got {ids!r}")
    n_cls = ids.num_classes
    prec = ids.prec if prec is None else precision_of(prec)
    iota = _iota(f"{ids.label}_classes", n_cls, ids.prec)
    nb = len(ids.dims)
    space = ids.dims + (n_cls,)
    hit = apply("eq", Get(ids.value, _all(nb)), Get(iota.value, (nb,)))
    hits = Tensor(Tnode(f"{ids.label}_hits", ids.dims, prec), ids.shape, kind="op",
                  children=(ids, iota), differentiable=False)
    hits.forward_code = (Accum(hits.value, _all(nb), "+", hit, space, reset=True),)
    shape = Shape(ids.shape.batch, (n_cls,), ())
    out = Tensor(Tnode(f"{ids.label}_one_hot", shape.dims, prec), shape, kind="op",
                 children=(ids, iota, hits), differentiable=False)
    out.forward_code = (Accum(out.value, _all(nb + 1), "=",
                              apply("div", hit, Get(hits.value, _all(nb))), space),)
    return out


def embedding(ids: ClassIds, table: Tensor) -> Tensor:
    """Row ``ids[b]`` of ``table`` (dims ``(num_classes, dim)``, as torch.nn.Embedding's
    weight) at every batch position ``b``: the result has ``ids``' batch axes and output row
    ``(dim,)``. A one-hot contraction (a GEMM when large): its gradient scatters into the rows
    of the table that were looked up."""
    if not isinstance(ids, ClassIds):
        raise TypeError(f"embedding expects class ids made by class_ids, got {ids!r}")
    if len(table.dims) != 2 or table.dims[0] != ids.num_classes:
        raise ValueError(f"embedding: the table {table.label} has dims {table.dims}, expected "
                         f"({ids.num_classes}, dim) for {ids.num_classes} classes")
    oh = one_hot(ids, prec=table.prec)
    nb = len(ids.dims)
    dim = table.dims[1]
    shape = Shape(ids.shape.batch, (dim,), ())
    space = ids.dims + (dim, ids.num_classes)
    v, d = nb + 1, nb
    return _contract("embedding", oh, table, _all(nb) + (v,), (v, d), shape, space)


# --- counter-based random numbers on the device -----------------------------------------------


_U52 = 2**52


class Rng:
    """A counter-based random generator on the device: a seed and a step counter, each a
    one-element f64 node. Every draw (:meth:`uniform`) is a pure integer hash of
    ``(seed, counter, element index)`` (the op table's ``hash_*`` rows), so the CPU and CUDA
    backends draw identical numbers, and each draw adds 1 to the counter as it runs: a routine
    draws new numbers every time it runs, and a run resumed with the counter restored (it is in
    :meth:`state_nodes`, and in ``buffers(loss)``) continues the same stream exactly.

    ``seed``: an integer in ``[0, 2**52)``; ``ctx.set_values(rng.seed, s)`` reseeds.

    A draw shaped with batch axes is keyed by the global row: its element index is offset by
    ``row_offset`` (a device scalar, 0 unless a data-parallel run sets it per shard) times the
    elements per row of its first batch axis, so a shard of rows ``[o, o + n)`` of a global
    batch draws what the whole batch draws over those rows.
    """

    def __init__(self, seed: int = 0, *, label: str = "rng") -> None:
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or \
                not 0 <= seed < _U52:
            raise ValueError(f"Rng {label}: seed must be an integer in [0, 2**52), got {seed!r}")
        self.label = label
        self.seed = Tnode(f"{label}_seed", (), Precision.f64,
                          host_data=np.array(float(seed), np.float64))
        self.counter = Tnode(f"{label}_counter", (), Precision.f64, zero_start=True)
        # The global row of a draw's first batch row: 0 but in a data-parallel run, where
        # ``ocannl.parallel.DataParallel`` sets it to each shard's first row of the global
        # batch before running the shard, so a mask is keyed by the global row, the same
        # whichever rank draws it. Not state: set for every shard, never checkpointed.
        self.row_offset = Tnode(f"{label}_row_offset", (), Precision.f64, zero_start=True)

    def state_nodes(self) -> list[Tnode]:
        """What a checkpoint must hold to continue the stream: the seed and the counter."""
        return [self.seed, self.counter]

    def uniform(self, *, batch_dims: Sequence[int] = (), output_dims: Sequence[int] = (),
                input_dims: Sequence[int] = (), label: str | None = None) -> Tensor:
        """A tensor of independent uniform draws in ``[0, 1)`` (multiples of 2**-24, exact at
        f32), new ones every time its forward code runs. f64 (the hash is exact there); not
        differentiable."""
        shape = Shape(_dims_row("batch", batch_dims) or (), _dims_row("output", output_dims) or (),
                      _dims_row("input", input_dims) or ())
        return _uniform(self, shape, label or f"{self.label}_uniform")

    def uniform_like(self, t: Tensor, *, label: str | None = None) -> Tensor:
        """Draws shaped as ``t``."""
        return _uniform(self, t.shape, label or f"{self.label}_uniform")

    def __repr__(self) -> str:
        return f"Rng({self.label}, seed node {self.seed.name}, counter {self.counter.name})"


def _hash_mix(z: Expr) -> Expr:
    for shift, mult in HASH_MIX:
        z = apply("hash_xsm", z, Const(float(shift)), Const(float(mult)))
    return z


def uniform_expr(seed: Expr, counter: Expr, index: Expr) -> Expr:
    """The draw at ``(seed, counter, index)`` as an expression (``ops.uniform_reference`` in
    NumPy); exact in an f64 computation."""
    h = _hash_mix(apply("hash_add", Const(0.0), seed))
    h = _hash_mix(apply("hash_add", h, counter))
    h = _hash_mix(apply("hash_add", h, index))
    return apply("hash_unit", h)


def _uniform(rng: Rng, shape: Shape, label: str) -> Tensor:
    dims = shape.dims
    f64 = Precision.f64
    if int(np.prod(dims)) >= _U52:
        raise ValueError(f"{label}: {int(np.prod(dims))} draws exceed the 2**52 indices")
    iotas = [_iota(f"{label}_ax{k}", d, f64) for k, d in enumerate(dims)]
    strides = [int(np.prod(dims[k + 1:])) for k in range(len(dims))]
    index: Expr = Const(0.0)
    for k, (io, st) in enumerate(zip(iotas, strides, strict=True)):
        if dims[k] == 1:
            continue
        term: Expr = Get(io.value, (k,))
        index = apply("add", index, term if st == 1 else apply("mul", term, Const(float(st))))
    if shape.batch:  # keyed by the global row (exact: integers below 2**52 in f64)
        shift: Expr = Get(rng.row_offset, ())
        if strides[0] != 1:
            shift = apply("mul", shift, Const(float(strides[0])))
        index = apply("add", index, shift)
    out = Tensor(Tnode(label, dims, f64), shape, kind="op", children=tuple(iotas),
                 differentiable=False)
    counter = Get(rng.counter, ())
    out.forward_code = (
        Accum(out.value, _all(len(dims)), "=", uniform_expr(Get(rng.seed, ()), counter, index),
              dims),
        Accum(rng.counter, (), "=", apply("add", counter, Const(1.0)), ()),
    )
    _BUFFERS[out] = tuple(rng.state_nodes())
    _RNGS[out] = rng
    return out


def dropout_rate(rate: object) -> float:
    """``rate`` as a float in [0, 1), or ``ValueError`` naming it; the one check of both
    dropouts (this op and ``nn_blocks.dropout``): NumPy scalars are numbers, bools are not."""
    v = real("dropout: rate", rate, "a number in [0, 1)")
    if not 0.0 <= v < 1.0:
        raise ValueError(f"dropout: rate must be a number in [0, 1), got {rate!r}")
    return v


def dropout(x: Tensor, *, rate: float, rng: Rng) -> Tensor:
    """Inverted dropout: each element kept with probability ``1 - rate`` and scaled by
    ``1 / (1 - rate)``, else 0; a new mask every time it runs (drawn from ``rng``). The
    gradient flows through the kept elements, scaled alike."""
    rate = dropout_rate(rate)
    if not isinstance(rng, Rng):
        raise TypeError(f"dropout: rng must be an ocannl.tensor.Rng, got {rng!r}")
    u = rng.uniform_like(x, label=f"{x.label}_dropout_u")
    scale = Const(1.0 / (1.0 - rate))
    zero = Const(0.0)

    def fwd(a: list[Expr]) -> Expr:
        return apply("where", apply("ge", a[1], Const(float(rate))), apply("mul", a[0], scale),
                     zero)

    def grads(a: Sequence[Expr], v: Expr, g: Expr) -> list[Expr | None]:
        return [apply("where", apply("ge", a[1], Const(float(rate))), apply("mul", g, scale),
                      zero), None]

    return pointwise("dropout", [x, u], fwd, grads, prec=x.prec)


# --- state that is neither a parameter nor optimizer state ------------------------------------

# Tensor -> the nodes it keeps across steps (random-stream counters, running statistics).
_BUFFERS: weakref.WeakKeyDictionary[Tensor, tuple[Tnode, ...]] = weakref.WeakKeyDictionary()
# A draw (Rng.uniform's tensor) -> the Rng it draws from.
_RNGS: weakref.WeakKeyDictionary[Tensor, Rng] = weakref.WeakKeyDictionary()


def register_buffers(t: Tensor, nodes: Sequence[Tnode]) -> None:
    """Record that running ``t``'s forward code updates ``nodes`` (state to checkpoint)."""
    _BUFFERS[t] = tuple(_BUFFERS.get(t, ())) + tuple(nodes)


def random_streams(t: Tensor) -> list[Rng]:
    """The :class:`Rng` s ``t``'s graph draws from, each once, in the order first met."""
    seen: dict[int, Rng] = {}
    for s in t.topo():
        r = _RNGS.get(s)
        if r is not None:
            seen.setdefault(id(r), r)
    return list(seen.values())


def buffers(t: Tensor) -> list[Tnode]:
    """The nodes ``t``'s graph updates as it runs besides its parameters: random-stream seeds
    and counters, batch-norm running statistics. A resumed run needs them to continue exactly:
    checkpoint ``training_state(loss, optimizer) + buffers(loss)``."""
    seen: dict[int, Tnode] = {}
    for s in t.topo():
        for n in _BUFFERS.get(s, ()):
            seen.setdefault(n.id, n)
    return list(seen.values())
