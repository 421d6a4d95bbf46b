"""Leaves of the model graph (parameters, data-backed terms, literal numbers), and how an op's
operands become tensors and reads: every op module builds on these."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ocannl.ir.assignments import Const, Expr, Get, Index
from ocannl.ir.ops import Precision, precision_of, promote
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor import sharing
from ocannl.tensor import tensor as _t
from ocannl.tensor.shape import Shape, int_dims
from ocannl.tensor.tensor import INIT_KINDS, Init, Tensor

Operand = Tensor | float | int


def _dims_row(name: str, dims: Sequence[int] | None) -> tuple[int, ...] | None:
    if dims is None:
        return None
    out = int_dims(f"{name}_dims", dims)
    if any(d < 1 for d in out):
        raise ValueError(f"{name} dims must be positive, got {tuple(dims)}")
    return out


def param(
    label: str,
    *,
    output_dims: Sequence[int],
    input_dims: Sequence[int] | None = None,
    batch_dims: Sequence[int] = (),
    init: str | Init = "kaiming_uniform",
    prec: Precision | str = Precision.f32,
) -> Tensor:
    """A trainable tensor. ``input_dims=None`` infers the input axes from its first ``@``."""
    if isinstance(init, str):
        if init not in INIT_KINDS:
            raise ValueError(f"unknown init {init!r}: expected one of {INIT_KINDS}")
        init = Init(init)
    prec = precision_of(prec)
    shape = Shape(_dims_row("batch", batch_dims), _dims_row("output", output_dims),
                  _dims_row("input", input_dims))

    def make() -> Tensor:
        node = Tnode(label, shape.dims if shape.input is not None else None, prec,
                     needs_init=True)
        seed = (_t._seed["base"], next(_t._param_counter))

        def draw(dims: tuple[int, ...], fan_in: int, _rng: object = None) -> np.ndarray:
            return init.draw(dims, fan_in, np.random.default_rng(list(seed)))

        t = Tensor(node, shape, kind="param", differentiable=True, init=draw)
        sharing.record_block_path(t)
        return t

    scope = sharing.active_scope.get()
    if scope is None:
        t = make()
    else:  # a model built again over other inputs gets its first build's parameter back
        spec = (shape.batch, shape.output, shape.input, prec, init)
        shown = (f"batch {shape.batch}, output {shape.output}, input "
                 f"{'inferred' if shape.input is None else shape.input}, {prec.value}, "
                 f"init {init.kind}")
        t = scope.param(label, spec, shown, make)
    return _t.param_postprocess(t)


def term(
    values: object = None,
    *,
    label: str = "term",
    batch_dims: Sequence[int] | None = None,
    input_dims: Sequence[int] = (),
    output_dims: Sequence[int] | None = None,
    prec: Precision | str = Precision.f32,
) -> Tensor:
    """A non-differentiable, data-backed tensor (inputs, targets, a learning rate, a scale).

    Without explicit rows, a 1-D array is an output row and a 2-D or wider array has its last
    axis as the output row and the rest as batch axes.
    """
    prec = precision_of(prec)
    arr = None if values is None else np.asarray(values, dtype=np.float64)
    if arr is not None and arr.dtype.kind not in "biuf":
        raise ValueError(f"term {label}: values must be numeric, got dtype {arr.dtype}")
    if output_dims is None:
        if arr is None:
            raise ValueError(f"term {label}: give values or output_dims")
        output_dims = arr.shape[-1:] if arr.ndim >= 1 else ()
        if batch_dims is None:
            batch_dims = arr.shape[:-1]
    shape = Shape(_dims_row("batch", batch_dims or ()), _dims_row("output", output_dims),
                  _dims_row("input", input_dims))
    if arr is not None and arr.size != int(np.prod(shape.dims)):
        raise ValueError(f"term {label}: {arr.size} values (shape {arr.shape}) do not fill {shape}")
    host = None if arr is None else arr.reshape(shape.dims).astype(prec.numpy_dtype)
    node = Tnode(label, shape.dims, prec, host_data=host, needs_init=True)
    return Tensor(node, shape, kind="term", differentiable=False)


def number(value: float, *, prec: Precision | str = Precision.f32) -> Tensor:
    """A constant folded into the generated code (never a buffer: use ``term`` for values the
    host changes)."""
    node = Tnode(f"c{value:g}", (), precision_of(prec), memory_mode=MemoryMode.virtual)
    return Tensor(node, Shape(), kind="number", differentiable=False, const=float(value))


def _lift(x: Operand) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (int, float, np.floating, np.integer)):
        return number(float(x))
    raise TypeError(f"expected a Tensor or a number, got {type(x).__name__}: {x!r}")


def _read(t: Tensor, idx: tuple[Index, ...]) -> Expr:
    return Const(t.const) if t.const is not None else Get(t.value, idx)


def _result_prec(ts: Sequence[Tensor]) -> Precision:
    precs = [t.prec for t in ts if t.kind != "number"]
    return promote(*precs) if precs else Precision.f32


def _new(label: str, shape: Shape, prec: Precision, children: tuple[Tensor, ...]) -> Tensor:
    return Tensor(Tnode(label, shape.dims, prec), shape, kind="op", children=children)


def _all(n: int) -> tuple[int, ...]:
    return tuple(range(n))
