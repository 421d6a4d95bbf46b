"""The CUDA plan renders lowering's loop groups: one kernel per group, as the CPU backend
renders one loop per group (plus GEMMs, their 16-bit conversions and split-reduction passes)."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import mixed_prec, train
from ocannl.backends.cuda import plan as cc
from ocannl.ir.lowering import Fill, Gemm, LoopGroup, lower
from ocannl.nn_blocks import mlp, softmax_cross_entropy


def _step(variant: str):
    """The benchmark's MLP step (narrower, same structure): SGD with momentum at f32, or the
    fused gated step over f16 twins of f32 masters."""
    T.set_seed(0)
    x = T.term(np.random.default_rng(0).normal(size=(64, 32)), label="x")
    y = T.term(np.eye(10)[np.arange(64) % 10], label="y")
    if variant == "f32":
        logits, _ = mlp(x, [128, 128], 10)
        loss = softmax_cross_entropy(logits, y)
        return train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.1, momentum=0.9)
    logits, _ = mixed_prec.with_master_weights(prec="f16", f=lambda: mlp(x, [128, 128], 10))
    loss = softmax_cross_entropy(T.cast(logits, "f32"), y)
    scaler = mixed_prec.Loss_scaler.create(init_scale=1024.0)
    return mixed_prec.gated_step(scaler, loss, _sgd(), check_interval=16).comp


def _sgd():
    from ocannl import optim

    return optim.SGD(learning_rate=0.1, momentum=0.9)


@pytest.mark.parametrize("variant", ["f32", "f16-gated"])
def test_one_kernel_per_loop_group(variant: str) -> None:
    code = lower(_step(variant), cc.cuda_target())
    groups = [it for it in code if isinstance(it, LoopGroup)]
    fills = [it for it in code if isinstance(it, Fill)]
    gemms = [it for it in code if isinstance(it, Gemm)]
    plan = cc.plan_routine(code)
    kinds = [s.kind if isinstance(s, cc.Kernel) else "gemm" for s in plan.steps]
    per_group = [k for k in kinds if k in ("map", "serial", "reduce", "partial")]
    assert len(per_group) == len(groups)
    assert kinds.count("fill") == len(fills) and kinds.count("gemm") == len(gemms)
    assert kinds.count("final") == kinds.count("partial")
    assert len(kinds) == (len(groups) + len(fills) + len(gemms) + kinds.count("final")
                          + kinds.count("convert"))
    # Fusion is real: fewer kernels than loop nests.
    assert len(groups) < sum(len(g.nests) for g in groups)
