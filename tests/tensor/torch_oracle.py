"""PyTorch (CPU) as the oracle for the tensor DSL's values and gradients.

A check builds the same function in both frameworks from the same leaf values, reduces it to
a scalar with the same random weights (``loss = sum(out * r)``, so every element of the
incoming gradient differs), runs ``train.grad_update`` on the ocannl side and ``backward`` on
the torch side, and compares the result, the loss and every leaf's gradient.

Tolerance: relative ``TOL[prec]`` (1e-5 at f32, 1e-10 at f64), measured against the magnitude
of what was summed. A sum that cancels (a matmul entry, a broadcast operand's gradient, the
loss) carries rounding errors of the size of its terms, not of its result, so every element
is judged against the larger of its torch value and its *magnitude*: the same function of the
leaves' absolute values (its result and gradients, in f64, in absolute value), plus a floor of
the tensor's largest element. An error in the op itself is of the order of the values, far
beyond these bounds.

Layouts agree: an ocannl tensor's buffer is its batch axes, then output axes, then input axes;
the torch tensor holds the same array. Broadcasting aligns axes to the right within each row,
so :func:`view_as_row_broadcast` pads each row with size-1 axes for torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ocannl.tensor as T
from ocannl import Context, Precision, train
from ocannl.tensor import Shape, Tensor
from ocannl.tensor.shape import ROWS

TOL = {Precision.f32: 1e-5, Precision.f64: 1e-10}
TORCH_DTYPE = {Precision.f32: torch.float32, Precision.f64: torch.float64,
               Precision.f16: torch.float16, Precision.bf16: torch.bfloat16}
PRECS = [Precision.f32, Precision.f64]


def assert_close(got: np.ndarray, want: np.ndarray, rel: float, what: str,
                 magnitude: np.ndarray | float | None = None) -> None:
    """``|got - want| <= rel * (max(|want|, magnitude) + max|want|)`` elementwise."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, torch has {want.shape}"
    assert np.all(np.isfinite(want)), f"{what}: the oracle is not finite: {want}"
    scale = np.abs(want) if magnitude is None else np.maximum(np.abs(want), magnitude)
    floor = rel * float(np.max(np.abs(want), initial=0.0))
    err = np.abs(got - want)
    bad = ~(err <= rel * scale + floor)
    if bad.any():
        k = np.unravel_index(np.argmax(np.where(bad, err, -1)), got.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {got.size} elements differ beyond rel {rel:g}; "
            f"worst at {tuple(int(i) for i in k)}: got {got[k]!r}, torch {want[k]!r}"
            + ("" if magnitude is None else f", magnitude {np.broadcast_to(scale, got.shape)[k]!r}")
        )


def view_as_row_broadcast(x: torch.Tensor, shape: Shape, result: Shape) -> torch.Tensor:
    """``x`` (laid out as ``shape``) with size-1 axes inserted at the front of each row, so
    that torch's broadcasting of it against ``result`` is ocannl's row-wise broadcasting."""
    dims: list[int] = []
    for row in ROWS:
        r, rr = shape.row(row), result.row(row)
        dims += [1] * (len(rr) - len(r)) + list(r)
    return x.reshape(dims)


def _leaf(values: np.ndarray, prec: Precision, dtype: torch.dtype) -> torch.Tensor:
    stored = np.asarray(values, prec.numpy_dtype).astype(np.float64)  # as ocannl stores it
    return torch.tensor(stored, dtype=dtype, requires_grad=True)


def check_parity(
    out: Tensor,
    torch_fn: Callable[..., torch.Tensor],
    params: Sequence[tuple[Tensor, np.ndarray]],
    *,
    seed: int = 0,
    rel: float | None = None,
) -> Context:
    """Compare ``out`` and the gradients of ``params`` with ``torch_fn`` of torch leaves made
    from the same values (each at its parameter's precision), in the same order.

    torch runs with oneDNN off: its channels-last 1x1 stride-2 convolution (torch 2.13 CPU,
    oneDNN 3.12) returns a wrong kernel gradient in some runs, depending on where its
    buffers land (found by ``tests/ir/test_hash_order.py``'s investigation; ocannl's value
    matched a NumPy reference every time)."""
    with warnings.catch_warnings():  # the flags' own note on Intel GPUs' TF32
        warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")
        with torch.backends.mkldnn.flags(enabled=False):
            return _check_parity(out, torch_fn, params, seed=seed, rel=rel)


def _check_parity(out: Tensor, torch_fn: Callable[..., torch.Tensor],
                  params: Sequence[tuple[Tensor, np.ndarray]], *, seed: int,
                  rel: float | None) -> Context:
    rel = TOL[out.prec] if rel is None else rel
    leaves = [_leaf(v, p.prec, TORCH_DTYPE[p.prec]) for p, v in params]
    torch_out = torch_fn(*leaves)
    assert tuple(torch_out.shape) == out.dims, (
        f"test bug: torch result {tuple(torch_out.shape)} vs ocannl {out.dims} {out.shape}")
    r = np.random.default_rng(seed).uniform(-1.0, 1.0, out.dims)
    r_t = T.term(r, batch_dims=out.shape.batch, output_dims=out.shape.output,
                 input_dims=out.shape.input, label="r", prec=out.prec)
    loss = T.sum(out * r_t)
    assert loss.dims == ()
    ctx = Context.cpu()
    for p, values in params:
        assert p.dims == values.shape, f"test bug: {p} vs values {values.shape}"
        ctx.set_values(p, values)
    ctx, routine = ctx.compile(train.grad_update(loss))
    ctx.run(routine)

    r_used = ctx.get_values(r_t).astype(np.float64)
    torch_loss = (torch_out * torch.tensor(r_used, dtype=torch_out.dtype)).sum()
    torch_loss.backward()

    # magnitudes: the function of the absolute values, its result and gradients, in f64
    abs_leaves = [_leaf(np.abs(v.astype(p.prec.numpy_dtype)), p.prec, torch.float64)
                  for p, v in params]
    mag_out = torch_fn(*abs_leaves).double()
    want_out = torch_out.detach().double().numpy()
    out_mag = np.maximum(np.abs(mag_out.detach().numpy()), np.abs(want_out))
    (mag_out * torch.tensor(np.abs(r_used))).sum().backward()

    assert_close(ctx.get_values(out), want_out, rel, "forward value", out_mag)
    assert_close(ctx.get_values(loss), torch_loss.detach().double().numpy(), rel, "loss",
                 float(np.sum(np.abs(r_used) * out_mag)))
    for (p, _), tp, mp in zip(params, leaves, abs_leaves, strict=True):
        assert tp.grad is not None, f"torch gives no gradient for {p.label}"
        mag = None if mp.grad is None else np.abs(mp.grad.numpy())
        assert_close(ctx.get_values(p.grad), tp.grad.double().numpy(), rel, f"grad of {p.label}",
                     mag)
    return ctx


# --- hypothesis strategies --------------------------------------------------------------------

DIM = st.integers(1, 3)


def rows(max_axes: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(DIM, max_size=max_axes).map(tuple)


def shapes(batch: int = 2, output: int = 2, inp: int = 1) -> st.SearchStrategy[Shape]:
    return st.builds(Shape, rows(batch), rows(output), rows(inp))


@st.composite
def broadcast_operand(draw: Callable, result: Shape) -> Shape:
    """A shape that broadcasts to ``result``: each row a suffix of the result's row (the
    missing axes broadcast; a 1 the user gives does not stretch, as at upstream's HEAD, so
    no axis of the suffix is replaced by a 1)."""
    out = {}
    for name in ROWS:
        r = result.row(name)
        out[name] = r[draw(st.integers(0, len(r))):]
    return Shape(**out)


def values(dims: tuple[int, ...], lo: float, hi: float, *, unique: bool = False,
           nonzero: bool = False) -> st.SearchStrategy[np.ndarray]:
    """Arrays of the given dims with elements in [lo, hi] (and in [-hi, -lo] too when
    ``nonzero``: magnitudes kept away from zero)."""
    elems = st.floats(lo, hi, allow_subnormal=False)
    if nonzero:
        elems = st.one_of(elems, st.floats(-hi, -lo, allow_subnormal=False))
    # f32-exact values: both frameworks then start from the very same numbers at any precision
    elems = elems.map(lambda v: float(np.float32(v)))
    return hnp.arrays(np.float64, dims, elements=elems, unique=unique)


def param_of(label: str, shape: Shape, prec: Precision) -> Tensor:
    return T.param(label, batch_dims=shape.batch, output_dims=shape.output,
                   input_dims=shape.input, prec=prec)


@st.composite
def reduction_axes(draw, shape: Shape):
    """None (all), a row name, one position (maybe negative), or several positions."""
    n = len(shape.dims)
    kind = draw(st.sampled_from(["all", "row", "position", "positions"] if n else ["all", "row"]))
    if kind == "all":
        return None, list(range(n))
    if kind == "row":
        row = draw(st.sampled_from(["batch", "output", "input"]))
        off = shape.row_offsets()[row]
        return row, list(range(off, off + len(shape.row(row))))
    if kind == "position":
        k = draw(st.integers(-n, n - 1))
        return k, [k % n]
    ks = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    return ks, sorted(ks)


# --- running the ocannl side ------------------------------------------------------------------

EXAMPLES = 5


def few(n: int = EXAMPLES) -> Callable:
    """Hypothesis settings: ``n`` examples, no deadline (a compile takes a while)."""
    return settings(max_examples=n, deadline=None)


def run_forward(t: Tensor, ctx: Context | None = None) -> Context:
    """Compile and run ``t``'s forward code (in ``ctx``, or a fresh CPU context)."""
    ctx = ctx or Context.cpu()
    ctx, r = ctx.compile(train.forward(t))
    ctx.run(r)
    return ctx
