"""Checks of a CUDA context, shared by the tests through the stand-in ``cupy`` (no GPU) and
the ``gpu``-marked tests (a real device): ``make_ctx`` makes the context.

Kernel-level results (ops, reductions, GEMMs) are compared with an f64 reference of the same
computation over the stored inputs, with a tolerance scaled by the magnitude of the summed
terms (:mod:`f64_reference`); training runs are compared with the CPU backend's losses
and parameters at the benchmark's parity tolerances (relative), which are order-agnostic."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import cuda_cases
import cuda_models as M
import numpy as np
from f64_reference import assert_close, evaluate

from ocannl import Context, train
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
    state = list(p.params) + M.momenta(p)
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
    for m in M.momenta(p):
        ctx.set_values(m, np.zeros(m.dims))
    before = [ctx.get_values(t).copy() for t in p.params]
    ctx.run(step)
    for t, b in zip(p.params, before, strict=True):
        np.testing.assert_array_equal(ctx.get_values(t), b)
    ctx.set_values(p.lr, 0.5)
    ctx.run(step)
    assert not np.array_equal(ctx.get_values(p.params[0]), before[0])
    assert ctx.compile_count == count


def check_comp(make_ctx: MakeCtx, comp: Comp, outs: list[Tnode]) -> tuple[Context, object]:
    """Compile and run ``comp`` once on a fresh context; every output within the
    magnitude-scaled tolerance of its f64 reference. Returns the context and the routine."""
    ctx = make_ctx()
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    refs = evaluate(comp)
    for n in outs:
        assert_close(ctx.get_values(n), refs[n.id], n.prec, f"{n.label}")
    return ctx, routine


def ops(make_ctx: MakeCtx) -> None:
    """Every op at every precision, and ops over operands of other precisions (CUDA computes
    in the written node's precision, converting its operands first)."""
    for prec in Precision:
        comp, outs = cuda_cases.op_cases(prec)
        check_comp(make_ctx, comp, outs)
    comp, outs = cuda_cases.mixed_cases()
    check_comp(make_ctx, comp, outs)


def reductions(make_ctx: MakeCtx) -> None:
    comp, outs = cuda_cases.reduction_cases()
    gpu, _ = check_comp(make_ctx, comp, outs)
    by = {n.label: n for n in outs}
    np.testing.assert_array_equal(gpu.get_values(by["last"]), [49, 99, 149, 199])
    np.testing.assert_array_equal(gpu.get_values(by["filled"]), [[0] * 5, [1225] * 5])
    nan_max = gpu.get_values(by["nan_max"])
    assert np.isfinite(nan_max[0]) and np.isnan(nan_max[1])


def gemms(make_ctx: MakeCtx) -> None:
    """16-bit and transposed operands, accumulating and resetting."""
    check_comp(make_ctx, *cuda_cases.gemm_cases())


def f64_gemms(make_ctx: MakeCtx) -> Context:
    ctx, _ = check_comp(make_ctx, *cuda_cases.f64_gemm_cases())
    return ctx


def thin_gemms(make_ctx: MakeCtx) -> None:
    """One row or one column, at f32, f16 and f64."""
    check_comp(make_ctx, *cuda_cases.thin_gemm_cases())


def bit_identical_runs(make_ctx: MakeCtx, prec: str, *, dims: tuple[int, ...],
                       batch: int, steps: int = 4, comp: str = "gated") -> None:
    """Two contexts from the same parameters run the same step ``steps`` times: every loss,
    parameter and momentum bit-identical (no atomics; cuBLAS is deterministic on one GPU)."""
    p = M.build(prec, dims=dims, batch=batch)
    runs = []
    start = None
    for _ in range(2):
        ctx = make_ctx()
        ctx = train.init_params(ctx, p.loss)
        if start is None:
            start = [ctx.get_values(t) for t in p.params]
        else:
            for t, v in zip(p.params, start, strict=True):
                ctx.set_values(t, v)
        ctx, routine = ctx.compile(p.comps[comp])
        losses = []
        for _ in range(steps):
            ctx.run(routine)
            losses.append(ctx.get_values(p.loss).tobytes())
        state = [ctx.get_values(t).tobytes() for t in list(p.params) + M.momenta(p)]
        runs.append((losses, state))
    assert runs[0][0] == runs[1][0], "losses differ between two runs"
    assert runs[0][1] == runs[1][1], "parameters or momenta differ between two runs"


def data_parallel_shards() -> None:
    """4 shards on one rank of a CUDA context: the later shards' gradient routines rebound to
    buffers of their own (``Context.rebound`` on device buffers, each its own graph), the
    tree's additions on the device; with overlap the last shard's routine cut at the buckets
    and the update run part by part: the same bits, and the CPU's run within f32 rounding."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the workers
    import shard_worker as SW

    from ocannl import parallel

    plain = SW.run_plain(parallel.SingleProcess(), backend="cuda")
    over = SW.run_plain(parallel.SingleProcess(), backend="cuda", overlap=True)
    assert over["parts_read"] == [[b] for b in range(over["buckets"])]
    for a, b in zip(plain["state"], over["state"], strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    cpu = SW.run_plain(parallel.SingleProcess())
    for a, b in zip(plain["state"], cpu["state"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
