"""Learning-rate schedules on the CUDA path without a GPU: the kernels of a scheduled update
(f64 cosine, floor and pow from the f32 counter) compile with NVRTC (every major installed, for
its oldest architecture from compute_70 on and compute_90), and the real CUDA backend over the
emulated ``cupy`` computes, step by step, the rates the CPU backend computes."""

from __future__ import annotations

import fake_cupy
import numpy as np
import pytest
from cuda_emu import emulator_unavailable

import ocannl.tensor as T
from ocannl import Context, datasets, nn_blocks, optim, schedules, train
from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import cuda_sources


def three_phases() -> schedules.Schedule:
    return schedules.SequentialLR([
        schedules.LinearLR(0.1, start_factor=0.01, total_iters=30),
        schedules.CosineAnnealingLR(0.1, T_max=80, eta_min=1e-4),
        schedules.StepLR(0.1, step_size=25, gamma=0.5)], milestones=[30, 150])


def test_scheduled_update_kernels_compile_for_the_oldest_architecture_and_90() -> None:
    from test_cuda_codegen import archs
    points, labels = datasets.half_moons(16)
    x = T.term(points, label="x")
    logits, _ = nn_blocks.mlp(x, [8], 2)
    loss = nn_blocks.softmax_cross_entropy(logits, T.term(datasets.one_hot(labels, 2)))
    opt = optim.Adam(three_phases())
    sources = cuda_sources(train.grad_update(loss) + opt.update(loss))
    rate = [s for s in sources if "cos(" in s and "floor(" in s]
    assert rate and all("double" in s for s in rate)  # the rate is computed in f64
    majors = nvrtc.majors()
    assert majors, "no NVRTC found"
    for major in majors:
        for src in sources:
            for arch in archs(major):
                nvrtc.compile_ptx(src, arch, major=major)  # raises with the log on an error


@pytest.mark.skipif(emulator_unavailable() is not None, reason="no CUDA kernel emulator")
def test_emulated_cuda_rates_equal_the_cpu_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = {}
    for name, make in (("cpu", Context.cpu), ("cuda", Context.cuda)):
        if name == "cuda":
            fake_cupy.install(monkeypatch)
        opt = optim.SGD(three_phases())
        ctx, tick = make().compile(opt.schedule_tick())
        got = []
        for _ in range(260):
            ctx = ctx.run(tick)
            got.append(ctx.get_value(opt.lr_node))
        assert ctx.get_value(opt.schedule_counter) == 260.0
        rates[name] = np.asarray(got, np.float32)
    assert ctx.backend_name() == "cuda"
    assert np.array_equal(rates["cuda"], rates["cpu"])
    assert len(set(rates["cpu"].tolist())) > 100
