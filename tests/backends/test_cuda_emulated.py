"""The generated CUDA kernels, run on the CPU through an emulation of the CUDA built-ins
(:mod:`cuda_emu`), against the Numba CPU backend: same losses, same parameters, same gating,
and the CuPy-facing backend code driven through a stand-in ``cupy`` (:mod:`fake_cupy`).

These are the semantics checks of the GPU path that a machine without a GPU can make: the
kernel sources, the launch plans (thread mapping, block and split reductions, GEMM conversions)
and the routine binding are the real ones; only CuPy and the hardware are substituted.
"""

from __future__ import annotations

import warnings

import cuda_checks as C
import cuda_models as M
import fake_cupy
import pytest
from cuda_emu import EmulatedCudaBackend, emulator_unavailable

from ocannl import Context
from ocannl.backends.cuda.runtime import CupyCudaBackend
from ocannl.ir.ops import Precision

_missing = emulator_unavailable()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"no emulator: {_missing}")


def emu() -> Context:
    return Context(EmulatedCudaBackend())


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_training_matches_the_cpu_backend(prec: str) -> None:
    C.training_parity(emu, prec)


def test_large_batch_gated_step_uses_block_reductions_and_matches() -> None:
    """Batch 1024: the loss mean, the bias gradients and the checksum are block reductions
    (the checksum split over blocks); GEMMs go through the cuBLAS path."""
    ctx = C.training_parity(emu, "f32", dims=(2, 64, 64, 2), batch=1024, steps=3,
                            comp="gated")
    kinds = {kind for kind, _, _ in ctx._backend.devices[-1].launches}
    assert {"reduce", "partial", "final", "map", "serial"} <= kinds


def test_non_finite_input_skips_the_gated_step() -> None:
    C.gated_injection(emu)


def test_set_values_reaches_the_kernels_without_recompiling() -> None:
    C.set_values_reach_kernels(emu)


def test_every_op_matches_the_cpu_at_every_precision() -> None:
    C.ops(emu, {Precision.f64: 1e-13, Precision.f32: 1e-6, Precision.f16: 1e-3,
                Precision.bf16: 8e-3})


def test_reductions_match_the_cpu() -> None:
    C.reductions(emu)


def test_gemms_match_the_cpu() -> None:
    C.gemms(emu)


# --- the CuPy-facing backend, driven through a stand-in cupy ---------------------------------


def test_cupy_backend_through_a_fake_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    ctx = C.training_parity(Context.cuda, "f16", steps=4, comp="gated")
    assert ctx.backend_name() == "cuda"
    p = M.build("f16")
    compiled = fake_cupy.RawKernel.compiles
    count = ctx.compile_count
    ctx, _ = ctx.compile(p.comps["gated"])  # same code: every kernel from the cache
    assert fake_cupy.RawKernel.compiles == compiled and ctx.compile_count == count
    ctx.set_values(p.x, M.build("f16").x.value.host_data)
    x = ctx.get_values(p.x)
    assert x.dtype.name == "float16" and x.shape == (32, 2)
    C.gated_injection(Context.cuda, "bf16")


def test_cupy_backend_without_cublas_runs_gemms_as_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, cublas=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        C.training_parity(lambda: Context(CupyCudaBackend()), "bf16", dims=(2, 64, 64, 2),
                          batch=64, steps=2)
    assert sum("cuBLAS is not loadable" in str(w.message) for w in seen) == 1
