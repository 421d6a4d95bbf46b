"""Checks of a CUDA-path context against the Numba CPU backend, shared by the emulated tests
(no GPU) and the ``gpu``-marked tests (a real device): ``make_ctx`` makes the context."""

from __future__ import annotations

from collections.abc import Callable

import cuda_cases
import cuda_models as M
import numpy as np

from ocannl import Context
from ocannl.ir.assignments import Comp
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

MakeCtx = Callable[[], Context]
LOSS_RTOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 4e-3}


def training_parity(make_ctx: MakeCtx, prec: str, *, dims: tuple[int, ...] = (2, 16, 16, 2),
                    batch: int = 32, steps: int = 5, comp: str = "step") -> Context:
    """Losses within LOSS_RTOL of the CPU backend's, parameters close, training progresses."""
    p = M.build(prec, dims=dims, batch=batch)
    cpu_losses, cpu_params = M.run_steps(Context.cpu(), p, steps, comp)
    ctx = make_ctx()
    gpu_losses, gpu_params = M.run_steps(ctx, p, steps, comp)
    err = M.rel_err(gpu_losses, cpu_losses)
    assert err <= LOSS_RTOL[prec], (prec, err, gpu_losses, cpu_losses)
    assert cpu_losses[-1] < cpu_losses[0]
    for k in cpu_params:
        np.testing.assert_allclose(gpu_params[k], cpu_params[k], rtol=1e-3, atol=1e-4,
                                   err_msg=k)
    return ctx


def gated_injection(make_ctx: MakeCtx, prec: str = "f32") -> None:
    """A non-finite input makes the checksum non-finite and the fused step a no-op on the
    device (parameters and momenta bit-identical); a finite one steps again."""
    p = M.build(prec)
    ctx = make_ctx()
    M.run_steps(ctx, p, 2, "gated")  # initialises, and trains a little (same context)
    ctx, step = ctx.compile(p.comps["gated"])
    count = ctx.compile_count
    state = list(p.params) + [t.optimizer_state["momentum"] for t in p.params]
    before = [ctx.get_values(t).copy() for t in state]
    good_x = ctx.get_values(p.x).copy()
    bad_x = good_x.copy()
    bad_x[3, 1] = np.inf
    ctx.set_values(p.x, bad_x)
    ctx.run(step)
    assert not np.isfinite(ctx.get_value(p.flag))
    for t, b in zip(state, before, strict=True):
        np.testing.assert_array_equal(ctx.get_values(t), b)
    ctx.set_values(p.x, good_x)
    ctx.run(step)
    assert ctx.get_value(p.flag) == 0.0
    assert not np.array_equal(ctx.get_values(p.params[0]), before[0])
    assert ctx.compile_count == count


def set_values_reach_kernels(make_ctx: MakeCtx, prec: str = "f16") -> None:
    """A learning rate written from the host changes what the compiled step does, with no
    recompilation: 0 freezes the parameters, 0.5 moves them."""
    p = M.build(prec)
    ctx = make_ctx()
    M.run_steps(ctx, p, 1)
    ctx, step = ctx.compile(p.comps["step"])
    count = ctx.compile_count
    ctx.set_values(p.lr, 0.0)
    for m in (t.optimizer_state["momentum"] for t in p.params):
        ctx.set_values(m, np.zeros(m.dims))
    before = [ctx.get_values(t).copy() for t in p.params]
    ctx.run(step)
    for t, b in zip(p.params, before, strict=True):
        np.testing.assert_array_equal(ctx.get_values(t), b)
    ctx.set_values(p.lr, 0.5)
    ctx.run(step)
    assert not np.array_equal(ctx.get_values(p.params[0]), before[0])
    assert ctx.compile_count == count


def compare(make_ctx: MakeCtx, comp: Comp, outs: list[Tnode],
            rtol: dict[Precision, float]) -> Context:
    """Run ``comp`` once on both backends and compare every output (NaN where NaN)."""
    cpu, gpu = Context.cpu(), make_ctx()
    cpu, r1 = cpu.compile(comp)
    gpu, r2 = gpu.compile(comp)
    cpu.run(r1)
    gpu.run(r2)
    for n in outs:
        want = cpu.get_values(n).astype(np.float64)
        got = gpu.get_values(n).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=rtol[n.prec], atol=0, equal_nan=True,
                                   err_msg=f"{n.label} ({n.prec.value})")
    return gpu


def ops(make_ctx: MakeCtx, tol: dict[Precision, float]) -> None:
    """Every op at every precision, and ops over operands of other precisions."""
    for prec in Precision:
        comp, outs = cuda_cases.op_cases(prec)
        compare(make_ctx, comp, outs, tol)
    comp, outs = cuda_cases.mixed_cases()
    # CUDA computes in the written node's precision; the CPU backend in its operands' widest
    # (an f32 node reading f64 data: f64; an f64 node reading f32 data: f32). They differ by
    # an f32 rounding.
    loose = max(tol[Precision.f32], 1e-6)
    compare(make_ctx, comp, outs, {**tol, Precision.f32: loose, Precision.f64: loose})


def reductions(make_ctx: MakeCtx) -> None:
    comp, outs = cuda_cases.reduction_cases()
    tol = {Precision.f64: 1e-12, Precision.f32: 1e-5, Precision.f16: 2e-3,
           Precision.bf16: 8e-3}
    gpu = compare(make_ctx, comp, outs, tol)
    by = {n.label: n for n in outs}
    np.testing.assert_array_equal(gpu.get_values(by["last"]), [49, 99, 149, 199])
    np.testing.assert_array_equal(gpu.get_values(by["filled"]), [[0] * 5, [1225] * 5])
    nan_max = gpu.get_values(by["nan_max"])
    assert np.isfinite(nan_max[0]) and np.isnan(nan_max[1])


def gemms(make_ctx: MakeCtx) -> None:
    comp, outs = cuda_cases.gemm_cases()
    compare(make_ctx, comp, outs, {Precision.f32: 1e-5, Precision.f16: 2e-3,
                                   Precision.bf16: 8e-3})
