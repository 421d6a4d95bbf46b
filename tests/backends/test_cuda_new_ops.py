"""The ops beyond the MLP on the CUDA backend, without a GPU (and with one, marked ``gpu``).

- Every kernel of a training step through every new op and block (``cuda_cases.
  beyond_mlp_cases``: embedding, decoder block with dropout, batch norm, comparisons, where,
  minimum / maximum / min, abs, erf, both gelus, cross-entropy) and of the counter-based draws
  compiles with NVRTC for compute_70 and compute_90, at f32, f16 and bf16.
- Through the stand-in ``cupy`` (kernel emulator): the draws are the CPU backend's bit for bit
  (so are the dropout masks), and a training step's loss and gradients match the CPU's (the
  step without the decoder block around the attention: the CPU backend compiles the full one
  in minutes).
- On a GPU (``gpu`` mark): the same two checks on the device.
"""

from __future__ import annotations

import cuda_cases
import fake_cupy
import numpy as np
import pytest
from cuda_emu import emulator_unavailable
from test_cuda_codegen import _compile_all

from ocannl import Context
from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import cuda_sources
from ocannl.backends.cuda.runtime import cuda_unavailable_reason
from ocannl.ir.ops import uniform_reference

_no_nvrtc = nvrtc.available()
_no_emulator = emulator_unavailable()
_no_gpu = cuda_unavailable_reason()


@pytest.mark.skipif(_no_nvrtc is not None, reason=f"NVRTC unavailable: {_no_nvrtc}")
def test_new_op_kernels_compile_for_compute_70_and_90() -> None:
    sources: dict[str, str] = {}
    for prec in ("f32", "f16", "bf16"):
        comp, _, _ = cuda_cases.beyond_mlp_cases(prec)
        for use_cublas in (True, False):
            for s in cuda_sources(comp, use_cublas=use_cublas):
                sources.setdefault(s, f"beyond-MLP step {prec}")
    comp, _, _ = cuda_cases.random_cases()
    for s in cuda_sources(comp):
        sources.setdefault(s, "random draws")
    assert any("erf(" in s for s in sources)
    assert any("0xfffffffffffffULL" in s for s in sources)  # the hash rows
    failures = _compile_all(sources)
    assert not failures, f"{len(failures)} of {2 * len(sources)} compiles failed:\n" + \
        "\n\n".join(failures[:3])


def _draws(ctx: Context) -> list[np.ndarray]:
    comp, outs, rng = cuda_cases.random_cases()
    ctx, routine = ctx.compile(comp)
    got = []
    for _ in range(2):
        ctx.run(routine)
        got += [ctx.get_values(n) for n in outs]
    assert ctx.get_value(rng.counter) == 2 * len(outs)
    return got


def _step(ctx: Context, prec: str = "f32") -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    comp, loss, values = cuda_cases.beyond_mlp_cases(prec, full=False)
    for p, v in values:
        ctx.set_values(p, v)
    ctx, routine = ctx.compile(comp)
    out = {}
    for k in range(2):
        ctx.run(routine)
        out[f"loss{k}"] = ctx.get_values(loss)
    for p, _ in values:
        out[p.label] = ctx.get_values(p.grad)
    masks = [ctx.get_values(t) != 0 for t in loss.topo() if t.label == "dropout"]
    return masks, out


def _same_as_cpu(make_ctx) -> None:
    cpu = _draws(Context.cpu())
    dev = _draws(make_ctx())
    for a, b in zip(cpu, dev, strict=True):
        np.testing.assert_array_equal(a, b)
    # and both are the NumPy model's (seed 1234, counters 0, 1, 2 then 3, 4, 5)
    np.testing.assert_array_equal(cpu[1], uniform_reference(1234.0, 1.0,
                                                            np.arange(105).reshape(3, 5, 7)))
    cpu_masks, cpu_out = _step(Context.cpu())
    dev_masks, dev_out = _step(make_ctx())
    assert len(cpu_masks) == 1 and 0 < cpu_masks[0].mean() < 1
    for a, b in zip(cpu_masks, dev_masks, strict=True):
        np.testing.assert_array_equal(a, b)
    for k, want in cpu_out.items():
        # different summation orders (block reductions, cuBLAS): relative to the largest
        np.testing.assert_allclose(dev_out[k], want, rtol=1e-4,
                                   atol=1e-5 * max(1.0, float(np.abs(want).max())), err_msg=k)


@pytest.mark.skipif(_no_emulator is not None, reason=f"no emulator: {_no_emulator}")
def test_emulated_cuda_draws_and_steps_as_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    _same_as_cpu(Context.cuda)


@pytest.mark.gpu
@pytest.mark.skipif(_no_gpu is not None, reason=f"no GPU: {_no_gpu}")
def test_gpu_draws_and_steps_as_the_cpu() -> None:
    _same_as_cpu(Context.cuda)
