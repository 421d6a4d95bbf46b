"""One fused gated f16 step on the GPU, for ``compute-sanitizer`` to watch (run by
``test_cuda_gpu.py::test_compute_sanitizer_on_a_fused_gated_step``, not collected itself).

The model's batch of 1024 makes the loss mean and the bias gradients block reductions (shared
memory, warp shuffles) and the checksum a split one; its GEMMs go through cuBLAS with 16-bit
conversions. CuPy's memory pool is off: every buffer is its own ``cudaMalloc``, so memcheck
sees each one's bounds.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

import cuda_models as M  # noqa: E402
import cupy  # noqa: E402

from ocannl import Context  # noqa: E402


def main() -> int:
    cupy.cuda.set_allocator(None)
    p = M.build("f16", dims=(2, 16, 16, 2), batch=1024)
    losses, _ = M.run_steps(Context.cuda(), p, 2, "gated")
    cupy.cuda.Device().synchronize()
    if not all(math.isfinite(v) for v in losses):
        print(f"sanitizer target: non-finite losses {losses}")
        return 1
    print(f"sanitizer target: ok (losses {losses})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
