"""The recipes' clipping, accumulation and overflow names on the CUDA backend, run without a
GPU through the stand-in ``cupy`` and the kernel emulator (as test_cuda_emulated): the norm's
reductions, the per-parameter checksum cells and the fused gate's sticky flags as CUDA
kernels, against the CPU backend's run of the same recipe."""

from __future__ import annotations

import math

import cuda_checks as C
import fake_cupy
import numpy as np
import pytest
from cuda_emu import emulator_unavailable

import ocannl.tensor as T
from ocannl import Context, checkpoint, nn_blocks, optim, train
from ocannl.clipping import ClipNorm, ClipValue
from ocannl.mixed_prec import Loss_scaler, Recipe, gated_step, scaled_step, with_master_weights

_missing = emulator_unavailable()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"no emulator: {_missing}")


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)


def run(make_ctx, gate: str, clip, prec: str, inject: bool):  # noqa: ANN001, ANN201
    T.set_seed(5)
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((12, 5)).astype(np.float16).astype(np.float32),
                np.eye(3, dtype=np.float32)[rng.integers(0, 3, 12)]) for _ in range(4)]
    x = T.term(np.zeros((12, 5)), label="x", prec=prec)
    y = T.term(np.zeros((12, 3)), label="y")
    logits, _ = with_master_weights(prec=prec, f=lambda: nn_blocks.mlp(x, [10, 8], 3))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    sc = Loss_scaler.create(init_scale=1024.0)
    opt = optim.Adam(1e-2)
    kw = {"clip": clip, "accumulate": 2}
    recipe: Recipe = scaled_step(sc, loss, opt, **kw) if gate == "scaled" else \
        gated_step(sc, loss, opt, check_interval=2, **kw)
    ctx = recipe.compile(train.init_params(make_ctx(), loss))
    losses, norms = [], []
    for i in range(12):
        xb, yb = batches[i % 4]
        ctx = ctx.set_values(x, xb).set_values(y, yb)
        if inject and i == 9:  # between the micro-batches of the 5th step
            w1 = next(p for p in loss.params if p.value.label == "mlp_w1")
            g = ctx.get_values(w1.grad).copy()
            g.reshape(-1)[3] = math.inf
            ctx = ctx.set_values(w1.grad, g)
            before = [ctx.get_values(n).tobytes()
                      for n in checkpoint.training_state(loss, opt)]
        ctx = recipe.step(ctx)
        losses.append(ctx.get_value(loss))
        if recipe.micro == 0 and recipe.grad_norm is not None:
            norms.append(ctx.get_value(recipe.grad_norm))
        if inject and i == 9:
            after = [ctx.get_values(n).tobytes() for n in checkpoint.training_state(loss, opt)]
            assert after == before  # the skipped step, on this backend
            if gate == "scaled":
                assert recipe.last_overflow == ("mlp_w1",)
    ctx = recipe.flush(ctx)
    return losses, norms, recipe, [ctx.get_values(p).astype(np.float64) for p in loss.params]


@pytest.mark.parametrize(("gate", "clip", "prec"), [
    ("gated", ClipNorm(0.15), "f32"), ("scaled", ClipNorm(0.05, math.inf), "f16"),
    ("gated", ClipValue(0.02), "f16")])
def test_clipped_accumulated_recipes_match_the_cpu_backend(gate: str, clip, prec: str) -> None:  # noqa: ANN001
    cpu = run(Context.cpu, gate, clip, prec, inject=True)
    gpu = run(Context.cuda, gate, clip, prec, inject=True)
    tol = C.LOSS_RTOL[prec]
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=tol)
    np.testing.assert_allclose(gpu[1], cpu[1], rtol=max(tol, 1e-5))
    for g, c in zip(gpu[3], cpu[3], strict=True):
        np.testing.assert_allclose(g, c, rtol=1e-3, atol=1e-4)
    for recipe in (cpu[2], gpu[2]):
        assert (recipe.applied_steps, recipe.skipped_steps) == (5, 1)
        # host gate: named at the skip (checked in run), cleared by the applied 6th step;
        # fused gate: the window of steps 5 and 6 names it when it closes, after the 6th
        assert recipe.last_overflow == (() if gate == "scaled" else ("mlp_w1",))
        assert recipe.skipped_windows == 1
