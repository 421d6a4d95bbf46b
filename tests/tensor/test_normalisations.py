"""``softmax``, ``log_softmax`` and ``standardize`` (``ocannl.tensor.normalisations``) over
drawn axes: values and gradients against PyTorch (``layer_norm`` for ``standardize``'s
gradient), stability, and bad arguments refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch_oracle import (
    assert_close,
    check_parity,
    few,
    param_of,
    reduction_axes,
    shapes,
    values,
)

import ocannl.tensor as T
from ocannl import Context, Precision, train

F32 = Precision.f32


# --- softmax ----------------------------------------------------------------------------------


def _torch_softmax(x: torch.Tensor, axes: list[int], log: bool) -> torch.Tensor:
    if not axes:
        return x * 0.0 if log else x * 0.0 + 1.0
    z = x - torch.amax(x, dim=axes, keepdim=True).detach()
    lse = torch.log(torch.exp(z).sum(dim=axes, keepdim=True))
    return z - lse if log else torch.exp(z - lse)


def run_grad_update(out: T.Tensor, params: list[tuple[T.Tensor, np.ndarray]],
                    seed: int = 0) -> tuple[Context, np.ndarray]:
    """ocannl's side of a parity check: ``loss = sum(out * r)`` (``r`` uniform in [-1, 1]),
    forward and backprop. Returns the context and ``r`` as stored."""
    r = np.random.default_rng(seed).uniform(-1.0, 1.0, out.dims)
    r_t = T.term(r, batch_dims=out.shape.batch, output_dims=out.shape.output,
                 input_dims=out.shape.input, label="r", prec=out.prec)
    loss = T.sum(out * r_t)
    ctx = Context.cpu()
    for p, v in params:
        ctx.set_values(p, v)
    ctx, routine = ctx.compile(train.grad_update(loss))
    ctx.run(routine)
    return ctx, ctx.get_values(r_t).astype(np.float64)


def _torch_value_and_grad(fn, av: np.ndarray, r: np.ndarray,
                          dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    ta = torch.tensor(av, dtype=dtype, requires_grad=True)
    out = fn(ta)
    (out * torch.tensor(r, dtype=dtype)).sum().backward()
    return out.detach().double().numpy(), ta.grad.double().numpy()


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@few(6)
@given(data=st.data())
def test_softmax_over_drawn_axes(log, data):
    """Over all axes, a row, or any set of positions, with values up to 30 in magnitude (the
    max is subtracted: nothing overflows).

    A saturated softmax's gradient is a small difference of large terms (``s_i (g_i -
    sum_j g_j s_j)`` with ``s_i`` near 1), so every f32 implementation, torch's included, is
    off by about ``eps * s_i (|g_i| + sum_j |g_j| s_j)``; that is the magnitude the relative
    1e-5 applies to (as ``torch_oracle`` does for sums that cancel), against the f64 result,
    and torch's f32 result is held to the same bound."""
    shape = data.draw(shapes(), label="shape")
    axes, positions = data.draw(reduction_axes(shape), label="axes")
    av = data.draw(values(shape.dims, -30.0, 30.0), label="a")
    a = param_of("a", shape, F32)
    out = (T.log_softmax if log else T.softmax)(a, axes)
    assert out.dims == a.dims
    ctx, r = run_grad_update(out, [(a, av)])

    def fn(ta: torch.Tensor) -> torch.Tensor:
        return _torch_softmax(ta, positions, log)

    want, want_grad = _torch_value_and_grad(fn, av, r, torch.float64)
    t32, t32_grad = _torch_value_and_grad(fn, av, r, torch.float32)
    s = np.exp(_torch_softmax(torch.tensor(av), positions, True).numpy())
    g = np.abs(r)
    gs = (g * s).sum(axis=tuple(positions), keepdims=True) if positions else g * s
    if log:
        lse = np.abs(av - want)  # |log sum exp|, up to the max shift
        value_mag, grad_mag = np.abs(av) + lse, g + s * (g.sum(axis=tuple(positions),
                                                              keepdims=True) if positions else g)
    else:
        value_mag, grad_mag = np.abs(want), s * (g + gs)
    for got, got_grad, who in ((ctx.get_values(out), ctx.get_values(a.grad), "ocannl"),
                               (t32, t32_grad, "torch f32")):
        assert_close(got, want, 1e-5, f"{who} value", value_mag)
        assert_close(got_grad, want_grad, 1e-5, f"{who} gradient", grad_mag)


def test_softmax_single_axis_matches_torch_softmax_and_is_stable():
    av = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -999.0]])
    a = T.param("a", batch_dims=(2,), output_dims=(3,), input_dims=())
    check_parity(T.softmax(a, "output"), lambda ta: torch.softmax(ta, dim=1), [(a, av)])
    b = T.param("b", batch_dims=(2,), output_dims=(3,), input_dims=())
    check_parity(T.log_softmax(b, -1), lambda tb: torch.log_softmax(tb, dim=1), [(b, av)])


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
def test_standardize_is_the_composition_forward_and_torch_layer_norm_backward(prec):
    """``standardize`` (a layer norm without gain and bias) computes the composed
    ``(x - mean) / sqrt(var + eps)`` bit for bit, and its gradient matches torch's
    ``layer_norm``'s, rows of one value (gradient 0) and of nearly equal values included."""
    rng = np.random.default_rng(5)
    xv = np.float32(rng.normal(size=(3, 4, 6))).astype(np.float64)
    xv[0, 0] = np.float32(0.5 + 0.05 * np.arange(6))  # a narrow row: the gradient's sums cancel
    a = T.param("a", batch_dims=(3, 4), output_dims=(6,), input_dims=(), prec=prec)
    check_parity(T.standardize(a, "output", 1e-5),
                 lambda ta: F.layer_norm(ta, (6,), eps=1e-5), [(a, xv)])
    b = T.param("b", batch_dims=(3, 4), output_dims=(6,), input_dims=(), prec=prec)
    xc = b - T.reduce(b, "mean", "output", keepdims=True)
    composed = xc / T.sqrt(T.reduce(xc * xc, "mean", "output", keepdims=True) + 1e-5)
    one = T.standardize(b, "output")
    ctx = Context.cpu().set_values(b, xv)
    ctx, r = ctx.compile(train.forward(composed) + train.forward(one))
    ctx.run(r)
    assert ctx.get_values(one).tobytes() == ctx.get_values(composed).tobytes()
    c = T.param("c", batch_dims=(2,), output_dims=(1,), input_dims=(), prec=prec)
    ctx = check_parity(T.standardize(c, "output"), lambda tc: F.layer_norm(tc, (1,)),
                       [(c, np.array([[0.5], [-3.0]]))])
    assert not ctx.get_values(c.grad).any()


@pytest.mark.parametrize("axes", [None, [0, 2], [1]], ids=["all", "first-and-last", "middle"])
def test_standardize_over_any_axes_matches_torch(axes):
    """Over all axes, or axes that are not trailing, against torch's own mean and biased
    variance (its autograd through them gives the same gradient in exact arithmetic)."""
    xv = np.float32(np.random.default_rng(6).normal(size=(3, 4, 5))).astype(np.float64)
    a = T.param("a", batch_dims=(3,), output_dims=(4, 5), input_dims=())
    dims = [0, 1, 2] if axes is None else axes

    def torch_fn(ta: torch.Tensor) -> torch.Tensor:
        mean = ta.mean(dim=dims, keepdim=True)
        var = ((ta - mean) ** 2).mean(dim=dims, keepdim=True)
        return (ta - mean) / torch.sqrt(var + 1e-5)

    check_parity(T.standardize(a, axes), torch_fn, [(a, xv)])


def test_standardize_refuses_a_bad_eps_or_axis():
    a = T.param("a", batch_dims=(3,), output_dims=(4,), input_dims=())
    for eps in (-1.0, float("nan"), float("inf"), "1e-5", True):
        with pytest.raises(ValueError, match=r"eps must be a finite number >= 0, got"):
            T.standardize(a, "output", eps)
    with pytest.raises(ValueError, match="axis 5 out of range"):
        T.standardize(a, 5)
    with pytest.raises(ValueError, match="axis 5 out of range"):
        T.softmax(a, 5)
