"""Normalisations over some axes of a tensor (``softmax``, ``log_softmax``, ``standardize``):
each its own op with torch's gradient, its row statistics in nodes local to the routines
computing them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from ocannl.errors import real
from ocannl.ir.assignments import Accum, Const, Expr, Fixed, Get, Index, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor.global_sums import GlobalSums, register_global_sums
from ocannl.tensor.leaves import _all, _lift, _new, _read
from ocannl.tensor.pointwise import exp, log, sub
from ocannl.tensor.reductions import _axes, _kept_shape, _reduce_keep
from ocannl.tensor.tensor import Tensor


def _rows(x: Tensor, axes: None | str | int | Sequence[int]
          ) -> tuple[tuple[int, ...], tuple[Index, ...], tuple[int, ...], int]:
    """For an op over ``axes`` whose per-row results broadcast back against ``x``: every
    cell's index, a row result's index (``Fixed(0)`` on the reduced axes), a row result
    node's dims, and how many cells a row has."""
    red = set(_axes(x, axes))
    n = len(x.dims)
    kept = tuple(Fixed(0) if k in red else k for k in range(n))
    return _all(n), kept, _kept_shape(x, red).dims, math.prod(x.dims[k] for k in red)


def _local(name: str, dims: tuple[int, ...], prec: Precision) -> Tnode:
    """An op's intermediate node: local to the routines computing it."""
    return Tnode(name, dims, prec, memory_mode=MemoryMode.local)


def _cancelling_sum_prec(prec: Precision) -> Precision:
    """Where an op's gradient subtracts a sum that nearly cancels its terms (softmax's and
    a normalization's): f64 at f32 and f64 (products of f32 values are exact there, and the
    difference is taken in f64), f32 for 16-bit data."""
    return Precision.f32 if prec.is_narrow else Precision.f64


def softmax(x: Tensor, axes: None | str | int | Sequence[int]) -> Tensor:
    """``exp(x) / sum(exp(x))`` over ``axes`` (a row name, positions, or None for all),
    computed stably: the maximum over the axes is subtracted first.

    One op with its own gradient, torch's: ``(g - sum(g * y)) * y`` over the axes, one
    reduction without divisions; the chain rule through the division by the sum would
    reduce ``g * e / s^2`` and then pass the gradient through the exponential too. Its
    intermediates (the maximum, the exponentials, the sum, the gradient's dot product) are
    local to the routines computing them."""
    x = _lift(x)
    cells, kept, kept_dims, _ = _rows(x, axes)
    top, e, total = _local("softmax_max", kept_dims, x.prec), \
        _local("softmax_exp", x.dims, x.prec), _local("softmax_sum", kept_dims, x.prec)
    out = _new("softmax", x.shape, x.prec, (x,))
    y = Get(out.value, cells)
    out.forward_code = (
        Accum(top, kept, "max", _read(x, cells), x.dims, reset=True),
        Accum(e, cells, "=", apply("exp", apply("sub", _read(x, cells), Get(top, kept))),
              x.dims),
        Accum(total, kept, "+", Get(e, cells), x.dims, reset=True),
        Accum(out.value, cells, "=", apply("div", Get(e, cells), Get(total, kept)), x.dims),
    )
    if out.grad is not None and x.grad is not None:
        g = Get(out.grad, cells)
        dot = _local("softmax_dot", kept_dims, _cancelling_sum_prec(x.prec))
        out.backprop_code = (
            Accum(dot, kept, "+", apply("mul", g, y), x.dims, reset=True),
            Accum(x.grad, cells, "+", apply("mul", apply("sub", g, Get(dot, kept)), y), x.dims),
        )
    return out


def _standardize_code(out: Tensor, x: Tensor, axes: None | str | int | Sequence[int], eps: float,
                      count: Expr, row_dims: tuple[int, ...], prefix: str,
                      sum_node: Callable[[str, Precision], Tnode], sum_prec: Precision
                      ) -> tuple[tuple[Tnode, Tnode], tuple[Tnode, Tnode] | None]:
    """``out``'s code: ``x`` standardized over ``axes`` (the rows), each row's sums divided
    by ``count``; its forward and (where ``x`` has a gradient) backward code, torch's gradient.
    The four sums are nodes of ``row_dims`` from ``sum_node(name, prec)`` (the forward's in
    ``sum_prec``, the gradient's in the cancelling-sum precision); the centered values and the
    deviations are local. Returns the forward sums and the gradient's (None without one)."""
    cells, kept, _, _ = _rows(x, axes)
    whole = _all(len(row_dims))
    total, squares = sum_node(f"{prefix}_sum", sum_prec), sum_node(f"{prefix}_squares", sum_prec)
    centered, std = _local(f"{prefix}_centered", x.dims, x.prec), \
        _local(f"{prefix}_std", row_dims, x.prec)
    xc, deviation = Get(centered, cells), Get(std, kept)
    out.forward_code = (
        Accum(total, kept, "+", _read(x, cells), x.dims, reset=True),
        Accum(centered, cells, "=",
              apply("sub", _read(x, cells), apply("div", Get(total, kept), count)), x.dims),
        Accum(squares, kept, "+", apply("mul", xc, xc), x.dims, reset=True),
        Accum(std, whole, "=", apply("sqrt", apply("add", apply(
            "div", Get(squares, whole), count), Const(eps))), row_dims),
        Accum(out.value, cells, "=", apply("div", xc, deviation), x.dims),
    )
    if out.grad is None or x.grad is None:
        return (total, squares), None
    g, y = Get(out.grad, cells), Get(out.value, cells)
    wide = _cancelling_sum_prec(x.prec)
    g_sum, gy_sum = sum_node(f"{prefix}_grad_sum", wide), sum_node(f"{prefix}_grad_dot", wide)
    mean_g, mean_gy = (apply("div", Get(t, kept), count) for t in (g_sum, gy_sum))
    out.backprop_code = (
        Accum(g_sum, kept, "+", g, x.dims, reset=True),
        Accum(gy_sum, kept, "+", apply("mul", g, y), x.dims, reset=True),
        Accum(x.grad, cells, "+", apply("div", apply("sub", apply("sub", g, mean_g),
                                                     apply("mul", y, mean_gy)), deviation),
              x.dims),
    )
    return (total, squares), (g_sum, gy_sum)


def _eps(what: str, eps: float) -> float:
    e = real(f"{what}: eps", eps, "a finite number >= 0")
    if not 0 <= e < math.inf:
        raise ValueError(f"{what}: eps must be a finite number >= 0, got {eps!r}")
    return e


def standardize(x: Tensor, axes: None | str | int | Sequence[int], eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over ``axes``, the variance biased: a layer norm
    without its gain and bias (``nn_blocks.layer_norm``).

    One op with torch's gradient, ``(g - mean(g) - y * mean(g * y)) / sqrt(var + eps)``: two
    sums with no division in them and one pass, where the chain rule through the division,
    the square root and both means took several passes, one of them dividing per element. The
    two sums are taken, and subtracted, in f64 at f32 and f64 (they cancel). The forward
    values are those of the composition. Its intermediates are local to the routines computing
    them."""
    x = _lift(x)
    e = _eps("standardize", eps)
    _, _, kept_dims, per_row = _rows(x, axes)
    out = _new("standardize", x.shape, x.prec, (x,))
    _standardize_code(out, x, axes, e, Const(float(per_row)), kept_dims, "standardize",
                      lambda name, prec: _local(name, kept_dims, prec), x.prec)
    return out


def log_softmax(x: Tensor, axes: None | str | int | Sequence[int]) -> Tensor:
    """``x - log(sum(exp(x)))`` over ``axes``, computed stably (max-shifted)."""
    z = sub(x, _reduce_keep("log_softmax_max", x, axes, "max", differentiable=False))
    return sub(z, log(_reduce_keep("log_softmax_sum", exp(z), axes, "+")))


def global_standardize(x: Tensor, axes: None | str | int | Sequence[int], eps: float = 1e-5,
                       *, label: str = "global_standardize",
                       same_on_every_shard: Sequence[Tnode] = ()) -> tuple[Tensor, GlobalSums]:
    """:func:`standardize` over the global batch of a data-parallel step (synced batch norm):
    the statistics and the gradient's two sums are taken over every shard's rows, as if the
    global batch were one.

    The code runs on one shard; its four sums over ``axes`` (the values', the centered
    squares', the gradient's and the gradient times the output's) are materialized nodes,
    taken in the cancelling-sum precision (f64 at f32), that a ``DataParallel`` replaces,
    right after the item computing each, with the sum over every shard in its shard tree's
    order (:class:`ocannl.tensor.global_sums.GlobalSums`, returned and registered on the
    result); it sets the count they are divided by to the global batch's. Without one the
    shard is the batch: the count stays this tensor's cells per row, and the result is a
    batch standardization of ``x`` (its sums in the wider precision). ``same_on_every_shard``:
    state the caller's code updates from these sums only (batch norm's running statistics),
    which every shard then ends with the same values of."""
    x = _lift(x)
    e = _eps("global_standardize", eps)
    _, _, row_dims, per_row = _rows(x, axes)
    kept_dims = tuple(int(d) for d in row_dims)  # plain sizes: the sums are buffers
    wide = _cancelling_sum_prec(x.prec)
    count_node = Tnode(f"{label}_count", (1,), wide,
                       host_data=np.array([per_row], wide.numpy_dtype))
    out = _new(label, x.shape, x.prec, (x,))
    forward, backward = _standardize_code(
        out, x, axes, e, Get(count_node, (Fixed(0),)), kept_dims, label,
        lambda name, prec: Tnode(name, kept_dims, prec), wide)
    groups = ((forward[0],), (forward[1],)) + (() if backward is None else (backward,))
    sums = GlobalSums(label, per_row, count_node, groups, tuple(same_on_every_shard))
    register_global_sums(out, sums)
    return out, sums
