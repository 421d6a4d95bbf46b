"""The CUDA backend run without a GPU: ``Context.cuda()`` (the real
:class:`~ocannl.backends.cuda.runtime.CupyCudaBackend`) over the stand-in ``cupy``
(:mod:`fake_cupy`), whose modules run on the CPU through the kernel emulator (:mod:`cuda_emu`).

These are the semantics checks of the GPU path that a machine without a GPU can make: the
kernel sources, the modules, the launch plans (thread mapping, block and split reductions, GEMM
conversions), the binding and the transfers are the real ones; only CuPy and the hardware are
substituted. Kernel results are compared with an f64 reference (magnitude-scaled tolerance),
training with the CPU backend.
"""

from __future__ import annotations

import warnings

import cuda_cases
import cuda_checks as C
import cuda_models as M
import fake_cupy
import pytest
from cuda_emu import emulator_unavailable

from ocannl import Context
from ocannl.backends.cuda import plan as cc
from ocannl.backends.cuda.plan import GemmCall
from ocannl.ir import schedule

_missing = emulator_unavailable()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"no emulator: {_missing}")


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_training_matches_the_cpu_backend(prec: str) -> None:
    ctx = C.training_parity(Context.cuda, prec)
    assert ctx.backend_name() == "cuda"


def test_large_batch_gated_step_uses_block_reductions_and_matches() -> None:
    """Batch 1024: the loss mean, the bias gradients and the checksum (its rows of partial
    sums, then their sum) are block reductions; GEMMs go through the cuBLAS path."""
    dims, batch = (2, 64, 64, 2), 1024
    ctx = C.training_parity(Context.cuda, "f32", dims=dims, batch=batch, steps=3, comp="gated")
    ctx, routine = ctx.compile(M.build("f32", dims=dims, batch=batch).comps["gated"])
    plan = routine.compiled.plan
    launched = {name for name, _, _ in fake_cupy.launches}
    kinds = {k.kind for k in plan.kernels if routine.compiled.names[k.source] in launched}
    assert {"reduce", "map", "serial"} <= kinds
    assert any(k.kind == "reduce" and k.nodes[0].name.startswith("checksum_rows_")
               for k in plan.kernels)
    assert any(isinstance(s, GemmCall) for s in plan.steps)


def test_non_finite_input_skips_the_gated_step() -> None:
    C.gated_injection(Context.cuda)
    C.gated_injection(Context.cuda, "bf16")


def test_set_values_reaches_the_kernels_without_recompiling() -> None:
    C.set_values_reach_kernels(Context.cuda)


def test_every_op_matches_the_f64_reference_at_every_precision() -> None:
    C.ops(Context.cuda)


def test_reductions_match_the_f64_reference() -> None:
    C.reductions(Context.cuda)


def test_gemms_match_the_f64_reference() -> None:
    """16-bit, transposed and accumulating GEMMs, f64 GEMMs, one-row and one-column GEMMs."""
    C.gemms(Context.cuda)


def test_a_context_on_device_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers, modules and launches all on device 1: the stand-in refuses any launch whose
    arrays or module are not on the current device."""
    fake_cupy.install(monkeypatch, devices=2)
    ctx = C.training_parity(lambda: Context.cuda(1), "f16", steps=3, comp="gated")
    p = M.build("f16")
    ctx, _ = ctx.compile(p.comps["gated"])
    assert ctx._buffer(p.x.value).device_id == 1
    assert fake_cupy.launches


def test_without_cublas_gemms_run_as_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, cublas=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ctx = C.training_parity(Context.cuda, "bf16", dims=(2, 64, 64, 2), batch=64, steps=2)
    assert sum("cuBLAS is not loadable" in str(w.message) for w in seen) == 1
    assert not ctx._backend.target.gemm
    ctx, routine = ctx.compile(M.build("bf16", dims=(2, 64, 64, 2), batch=64).comps["step"])
    assert not any(isinstance(s, GemmCall) for s in routine.compiled.plan.steps)


def test_grid_and_block_stride_loops_going_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU checks over more than 65,535 cells / 16.7M elements, scaled down: with the grid
    limited to 64 blocks, block reductions take several cells per block and maps go round
    their grid-stride loop several times."""
    monkeypatch.setattr(schedule, "MAX_GRID", 64)  # scheduling's launches
    monkeypatch.setattr(cc, "MAX_GRID", 64)  # the final pass of a split reduction
    for comp, outs in (cuda_cases.wide_reduction_cases(cells=300),
                       cuda_cases.long_map_cases(n=50_000)):
        ctx, routine = C.check_comp(Context.cuda, comp, outs)
        assert any(k.grid == 64 for k in routine.compiled.plan.kernels)


# --- against the reference interpreter of lowered code --------------------------------------------

_GPU_RTOL = {"f64": 1e-10, "f32": 1e-4, "f16": 4e-3, "bf16": 3e-2}


def _gpu_close(label: str, node, got, want) -> bool:  # noqa: ANN001 - a Shadow check
    """Within a GPU's rounding of the interpreter's value: its sums run in other orders (block
    reductions, cuBLAS), its multiply-adds may fuse and its math functions are not libm's, so
    cells are compared relative to the node's magnitude (one error of the precision's size,
    times a summation factor), NaN only where the interpreter has NaN."""
    import numpy as np

    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(w)):
        return False
    ok = ~np.isnan(w)
    rtol = _GPU_RTOL[node.prec.value]
    scale = float(np.abs(w[ok]).max()) if ok.any() else 0.0
    return bool(np.all(np.abs(g[ok] - w[ok]) <= rtol * np.abs(w[ok]) + rtol * scale))


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_every_routine_matches_the_reference_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                         prec: str) -> None:
    """Each run of the fused gated step (gradients, checksum, gated SGD with momentum: block
    reductions, cuBLAS products, casts) on the emulated GPU, run again by the interpreter from
    the values it started from (``tests/ir/shadow.py``): every node it holds within a GPU-style
    tolerance of the interpreter's (``_gpu_close``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ir"))
    import shadow

    sh = shadow.Shadow(monkeypatch, lend=False, check=_gpu_close)
    M.run_steps(Context.cuda(), M.build(prec, dims=(2, 64, 64, 2), batch=64), 3, "gated")
    t = sh.tally
    assert t.routines >= 3 and t.compared > 0
    assert not t.mismatches, t.mismatches[:10]
    print(f"{prec}: {t.routines} routines, {t.exact} of {t.compared} nodes within the "
          f"tolerance, {t.bitwise} of them bit for bit")
