"""Reductions of ``ocannl.tensor.reductions`` with and without the reduced axes kept, and
``min``: values and gradients against PyTorch (``amax`` / ``amin`` share a tied extremum's
gradient) on hypothesis-drawn shapes and axes at f32. ``test_gradients.py`` has the
reductions' and ``matmul``'s gradients at f32 and f64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch_oracle import (
    check_parity,
    few,
    param_of,
    reduction_axes,
    run_forward,
    shapes,
    values,
)

import ocannl.tensor as T
from ocannl import Context, Precision

F32 = Precision.f32


def _torch_reduce(kind: str, x: torch.Tensor, axes: list[int], keepdim: bool) -> torch.Tensor:
    if not axes:
        return x * 1
    fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[kind]
    return fn(x, dim=axes, keepdim=keepdim)


@pytest.mark.parametrize("keepdims", [False, True], ids=["dropped", "kept"])
@pytest.mark.parametrize("kind", ["sum", "mean", "max", "min"])
@few(4)
@given(data=st.data())
def test_reductions_with_and_without_kept_axes(kind, keepdims, data):
    """``T.reduce`` (``T.min`` for min), reduced axes dropped or kept with size 1 in their
    rows. Integral values for max and min, so that ties occur (the gradient is shared evenly
    among them, as torch's ``amax`` / ``amin`` do)."""
    shape = data.draw(shapes(), label="shape")
    axes, positions = data.draw(reduction_axes(shape), label="axes")
    av = data.draw(values(shape.dims, -3.0, 3.0), label="a")
    if kind in ("max", "min"):
        av = np.round(av)
    a = param_of("a", shape, F32)
    out = T.reduce(a, kind, axes, keepdims=keepdims)
    if keepdims:
        assert out.dims == tuple(1 if k in positions else d for k, d in enumerate(shape.dims))
        assert len(out.shape.output) == len(shape.output)
    check_parity(out, lambda ta: _torch_reduce(kind, ta, positions, keepdims).reshape(out.dims),
                 [(a, av)])


@pytest.mark.parametrize("keepdims", [False, True], ids=["dropped", "kept"])
def test_min_shares_the_gradient_among_ties_like_torch_amin(keepdims):
    av = np.array([[1.0, -5.0, -5.0, 2.0], [3.0, 3.0, 3.0, 3.0], [0.5, 1.0, 2.0, 3.0]])
    a = T.param("a", batch_dims=(3,), output_dims=(4,), input_dims=())
    check_parity(T.min(a, "output", keepdims=keepdims),
                 lambda ta: torch.amin(ta, dim=1, keepdim=keepdims), [(a, av)])


def test_min_propagates_nan_like_torch():
    a = T.param("a", batch_dims=(2,), output_dims=(3,), input_dims=())
    m = T.min(a, "output")
    ctx = Context.cpu().set_values(a, [[1.0, np.nan, -2.0], [3.0, -1.0, 0.5]])
    run_forward(m, ctx)
    np.testing.assert_array_equal(ctx.get_values(m), [np.nan, -1.0])
