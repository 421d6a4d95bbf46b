"""The CPU-backend parity checks rerun on a real GPU through ``Context.cuda()``.

Marked ``gpu``: skipped where CuPy sees no usable device; ``scripts/gpu_check.sh`` runs them.
Tolerances against the Numba CPU backend: losses 1e-5 relative at f32, 2e-3 at f16, 4e-3 at
bf16 (cuBLAS and the block reductions sum in another order than the CPU's loops).
"""

from __future__ import annotations

import cuda_checks as C
import pytest

from ocannl import Context
from ocannl.backends.cuda.runtime import cuda_unavailable_reason
from ocannl.ir.ops import Precision

_reason = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_reason is not None, reason=f"no GPU: {_reason}")]


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_training_matches_the_cpu_backend(prec: str) -> None:
    C.training_parity(Context.cuda, prec, steps=8)


@pytest.mark.parametrize("prec", ["f32", "f16"])
def test_large_batch_gated_step_matches(prec: str) -> None:
    C.training_parity(Context.cuda, prec, dims=(2, 64, 64, 2), batch=1024, steps=5,
                      comp="gated")


def test_wide_mlp_matches() -> None:
    """256 -> 1024 -> 1024 -> 10 at batch 256: the cuBLAS GEMMs and split checksums."""
    C.training_parity(Context.cuda, "f32", dims=(256, 1024, 1024, 10), batch=256, steps=3,
                      comp="gated")


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_non_finite_input_skips_the_gated_step(prec: str) -> None:
    C.gated_injection(Context.cuda, prec)


def test_set_values_reaches_the_kernels_without_recompiling() -> None:
    C.set_values_reach_kernels(Context.cuda)


def test_every_op_matches_the_cpu_at_every_precision() -> None:
    # CUDA's libdevice math is within a few ulps of glibc's.
    C.ops(Context.cuda, {Precision.f64: 1e-12, Precision.f32: 1e-5, Precision.f16: 1e-3,
                         Precision.bf16: 8e-3})


def test_reductions_match_the_cpu() -> None:
    C.reductions(Context.cuda)


def test_gemms_match_the_cpu() -> None:
    C.gemms(Context.cuda)


def test_buffers_keep_their_device_pointer() -> None:
    """set_values copies in place: the routine's bound pointer never changes."""
    import cuda_models as M

    p = M.build("f32")
    ctx = Context.cuda()
    M.run_steps(ctx, p, 1)
    buf = ctx._buffer(p.lr.value)
    ptr = buf.data.ptr
    ctx.set_values(p.lr, 0.25)
    assert ctx._buffer(p.lr.value).data.ptr == ptr and ctx.get_value(p.lr) == 0.25
