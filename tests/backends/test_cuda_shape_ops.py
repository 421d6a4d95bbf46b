"""The CUDA kernels of issue 39's ops (diagonal and fixed-index writes, a whole sum into one
cell, max-accumulating einsum, concatenation, block literals, a dynamic batch index), forward
and backward, compile with NVRTC of CUDA 12 and 13 for compute_90 (the H200), no GPU needed."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import train
from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import cuda_sources

MAJORS = (12, 13)
_missing = {m: nvrtc.available(m) for m in MAJORS}
if os.environ.get("CI") and any(_missing.values()):
    raise RuntimeError("CI must compile the CUDA kernels with NVRTC of CUDA 12 and 13: "
                       + "; ".join(r for r in _missing.values() if r))


def _steps() -> dict[str, object]:
    x = T.param("x", output_dims=[5], input_dims=[])
    a = T.param("a", output_dims=[3, 4], input_dims=[])
    y = T.param("y", output_dims=[2], input_dims=[])
    data = T.rebatch(np.arange(24, dtype=np.float32).reshape(12, 2), batch=3)
    i = T.static_index("i", range=4)
    return {
        "diagonal": train.grad_update(T.sum(T.einsum("i=>ii", x))),
        "fixed-index": train.grad_update(T.sum(T.einsum("ij=>i1j", a))),
        "sum-to-one-cell": train.grad_update(T.sum(T.einsum("...|...->... => 0", a))),
        "max": train.grad_update(T.sum(T.einsum("ij=>i", a, accum="max"))),
        "concat": train.grad_update(T.sum(T.concat("a; b => a^b", x, y))),
        "block": train.grad_update(T.sum(T.block([x, x * 2.0]))),
        "batch-slice": train.grad_update(T.sum(T.batch_slice(data, i)) * T.sum(x)),
    }


@pytest.mark.parametrize("major", [
    pytest.param(m, marks=pytest.mark.skipif(_missing[m] is not None, reason=str(_missing[m])))
    for m in MAJORS])
def test_the_shape_ops_kernels_compile(major: int) -> None:
    for name, comp in _steps().items():
        sources = cuda_sources(comp)
        assert sources, name
        for src in sources:
            ptx, _ = nvrtc.compile_ptx(src, "compute_90", major=major)
            assert ".entry" in ptx, name
