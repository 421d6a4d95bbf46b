"""Batch slicing over data held whole: upstream OCANNL's ``rebatch`` and ``x @| i``.

``rebatch`` puts a whole data set on the device as one term whose leftmost batch axis counts
the batches; ``batch_slice(x, i)`` reads batch ``i`` of it, ``i`` a *static index*: a
one-cell node the host sets between runs (``Context.set_values``), read by the routine when
it runs (``ir.assignments.Dynamic``). Stepping through the batches is then one compile and
one write of a number per step, with no copy of the data (beside the torch-shaped
``ocannl.loader.Loader``, which writes each batch into the input terms).
"""

from __future__ import annotations

import numpy as np

from ocannl.ir.assignments import Accum, Dynamic, Get
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.tensor.leaves import _all, _lift, term
from ocannl.tensor.shape import Shape, int_value
from ocannl.tensor.tensor import Tensor


class StaticIndex(Tensor):
    """A static index: a one-cell term over ``0 .. range-1``."""

    range: int


def static_index(label: str, *, range: int) -> StaticIndex:  # noqa: A002 - upstream's name
    """A static index over ``0 .. range-1`` (upstream's ``IDX.get_static_symbol
    ~static_range``): a one-cell term, 0 until set; a value that is not an integer in range
    is refused by ``set_values``, naming it, before anything is written."""
    n = int_value(f"static_index {label}: range", range)
    if n < 1:
        raise ValueError(f"static_index {label}: range must be >= 1, got {n}")
    node = Tnode(label, (), Precision.f32, host_data=np.zeros((), np.float32), needs_init=True)

    def check(values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        if v.size != 1 or not float(v[0]).is_integer() or not 0 <= v[0] < n:
            raise ValueError(f"static index {label}: {v.tolist()!r:.40} is not an integer in "
                             f"[0, {n})")

    node.check_values = check
    t = StaticIndex(node, Shape(), kind="term", differentiable=False)
    t.range = n
    return t


def rebatch(values: object, *, batch: int, label: str = "data",
            prec: Precision | str = Precision.f32) -> Tensor:
    """``values`` (rows first) as one term of ``len(values) // batch`` batches of ``batch``
    rows: batch row ``(n_batches, batch)``, the rest of each row its output row. The rows must
    divide into whole batches (a partial last batch is refused, not dropped)."""
    arr = np.asarray(values)
    batch = int_value(f"rebatch {label}: batch", batch)
    if batch < 1:
        raise ValueError(f"rebatch {label}: batch must be >= 1, got {batch}")
    if arr.ndim < 1 or arr.shape[0] % batch:
        raise ValueError(f"rebatch {label}: {arr.shape[0] if arr.ndim else 0} rows do not "
                         f"divide into batches of {batch}")
    shaped = arr.reshape(arr.shape[0] // batch, batch, *arr.shape[1:])
    return term(shaped, label=label, batch_dims=shaped.shape[:2], prec=prec)


def batch_slice(x: Tensor, index: StaticIndex) -> Tensor:
    """Batch ``index`` of ``x`` (upstream's ``x @| index``): ``x`` without its leftmost batch
    axis, read at the position the static index holds when the routine runs. ``x`` is data (a
    tensor no parameter feeds: the slice has no gradient), and the index's range is that
    axis's size."""
    x = _lift(x)
    if not isinstance(index, StaticIndex):
        raise TypeError(f"batch_slice: the index must come from T.static_index, got "
                        f"{index!r:.60}")
    n = index.range
    if x.grad is not None:
        raise ValueError(f"batch_slice: {x.label} depends on parameters; batch slicing reads "
                         f"data (its gradient would be written at a dynamic index)")
    if not x.shape.batch:
        raise ValueError(f"batch_slice: {x.label} {x.shape} has no batch axis to slice")
    if x.shape.batch[0] != n:
        raise ValueError(f"batch_slice: {x.label} {x.shape} has {x.shape.batch[0]} batches, "
                         f"static index {index.label} ranges over {n}")
    shape = Shape(x.shape.batch[1:], x.shape.output, x.shape.input)
    out = Tensor(Tnode(f"{x.label}_slice", shape.dims, x.prec), shape, kind="op",
                 children=(x, index), differentiable=False)
    res = _all(len(shape.dims))
    out.forward_code = (Accum(out.value, res, "=",
                              Get(x.value, (Dynamic(0, index.value), *res)), shape.dims),)
    return out


__all__ = ["StaticIndex", "batch_slice", "rebatch", "static_index"]

