"""Convolution and pooling on the CUDA backend without a GPU: every kernel of a LeNet training
step (affine reads with zero padding, scatters into the image gradient, first-maximum pooling
gradients) compiles with NVRTC for compute_70 and compute_90 at f32, f16 and bf16, and through
the stand-in ``cupy`` (kernel emulator) the step's loss and gradients match the CPU backend's."""

from __future__ import annotations

import fake_cupy
import numpy as np
import pytest
from cuda_emu import emulator_unavailable
from test_cuda_codegen import _compile_all

import ocannl.tensor as T
from ocannl import Context, mixed_prec, nn_blocks, train
from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import cuda_sources

_no_nvrtc = nvrtc.available()
_no_emulator = emulator_unavailable()


def _lenet_step(prec: str, seed: int = 0):  # noqa: ANN202
    rng = np.random.default_rng(seed)
    T.set_seed(seed)
    x = T.term(rng.uniform(0, 1, (4, 8, 8, 1)), label="x", batch_dims=(4,),
               output_dims=(8, 8, 1))
    x.value.host_data[:, :2] = 0.0  # blank rows: tied maxima in the pools, as in the digits
    y = T.term(np.eye(10)[rng.integers(0, 10, 4)], label="y")

    def build():  # noqa: ANN202
        return nn_blocks.lenet(x, num_classes=10, channels=(3, 4), hidden=8)

    if prec == "f32":
        logits, _ = build()
    else:
        logits, _ = mixed_prec.with_master_weights(prec=prec, f=build)
        logits = T.cast(logits, "f32")
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    return train.grad_update(loss), loss


@pytest.mark.skipif(_no_nvrtc is not None, reason=f"no NVRTC: {_no_nvrtc}")
def test_conv_and_pool_kernels_compile_for_compute_70_and_90() -> None:
    sources: dict[str, str] = {}
    for prec in ("f32", "f16", "bf16"):
        comp, _ = _lenet_step(prec)
        for use_cublas in (True, False):
            for s in cuda_sources(comp, use_cublas=use_cublas):
                sources.setdefault(s, f"lenet step {prec}")
    assert any(">= 0 &&" in s for s in sources)  # zero-padding guards
    assert any("if (" in s for s in sources)  # guarded scatters
    failures = _compile_all(sources)
    assert not failures, "\n\n".join(failures[:3])


def _run(ctx: Context) -> dict[str, np.ndarray]:
    comp, loss = _lenet_step("f32", seed=1)
    ctx = train.init_params(ctx, loss)
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    out = {"loss": ctx.get_values(loss)}
    out.update({p.label: ctx.get_values(p.grad) for p in loss.params})
    return out


@pytest.mark.skipif(_no_emulator is not None, reason=f"no emulator: {_no_emulator}")
def test_emulated_cuda_lenet_step_matches_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    want = _run(Context.cpu())
    fake_cupy.install(monkeypatch)
    got = _run(Context.cuda())
    for k, w in want.items():
        scale = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=1e-5 * scale, err_msg=k)


def test_convolutions_go_through_patches_and_cublas_on_cuda() -> None:
    """im2col on CUDA (``cuda_target().im2col``): the LeNet step's large enough convolution is a
    patch-gathering nest and a cuBLAS product over the patches, at every precision; without
    cuBLAS, loops only."""
    from ocannl.backends.cuda.plan import GemmCall, cuda_target, plan_routine
    from ocannl.ir.lowering import lower

    for prec in ("f32", "f16", "bf16"):
        comp, _ = _lenet_step(prec)
        plan = plan_routine(lower(comp, cuda_target()))
        over_patches = [s for s in plan.steps if isinstance(s, GemmCall)
                        and "_patches" in s.gemm.a.node.label + s.gemm.b.node.label]
        assert over_patches, prec
        assert not cuda_target(cublas=False).im2col


@pytest.mark.skipif(_no_emulator is not None, reason=f"no emulator: {_no_emulator}")
@pytest.mark.parametrize("prec", ["f16", "bf16"])
def test_emulated_16_bit_lenet_step_matches_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                                    prec: str) -> None:
    """The 16-bit step's patches, products and scatters on CUDA, against the CPU backend's run
    of the same step (16-bit rounding: a tolerance of a few 16-bit ulps of the scale)."""

    def run(ctx: Context) -> dict[str, np.ndarray]:
        comp, loss = _lenet_step(prec, seed=1)
        ctx = train.init_params(ctx, loss)
        ctx, routine = ctx.compile(comp)
        ctx.run(routine)
        out = {"loss": ctx.get_values(loss).astype(np.float64)}
        out.update({p.label: ctx.get_values(p.grad).astype(np.float64) for p in loss.params})
        return out

    want = run(Context.cpu())
    fake_cupy.install(monkeypatch)
    got = run(Context.cuda())
    tol = {"f16": 2e-3, "bf16": 1.6e-2}[prec]
    for k, w in want.items():
        scale = max(1e-3, float(np.abs(w).max()))
        np.testing.assert_allclose(got[k], w, rtol=tol, atol=tol * scale, err_msg=k)
