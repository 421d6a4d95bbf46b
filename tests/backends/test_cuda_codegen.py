"""Every CUDA kernel the test models generate compiles with NVRTC, no GPU needed.

A real compile for compute_70 and compute_90, failing on any error and on any warning but
NVRTC's notice that compute_70 is deprecated; the PTX of f32 / f16 / bf16 kernels must hold no
f64 instruction (arithmetic in f32, no accidental double promotion).
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cuda_cases
import cuda_models
import pytest

from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import cuda_sources
from ocannl.ir.ops import Precision

ARCHS = ("compute_70", "compute_90")
_DEPRECATION = re.compile(r"nvrtc: warning: Architectures prior to .*? are deprecated.*\n?")

_missing = nvrtc.available()
if _missing is not None and os.environ.get("CI"):
    raise RuntimeError(f"CI must compile the CUDA kernels with NVRTC: {_missing}")
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"NVRTC unavailable: {_missing}")

MODELS = [((2, 16, 16, 2), 32), ((2, 64, 64, 2), 1024), ((256, 1024, 1024, 10), 256)]


def _model_sources() -> dict[str, str]:
    """Distinct kernel source -> where it comes from, over the models at every precision."""
    out: dict[str, str] = {}
    for prec in ("f32", "f16", "bf16"):
        for dims, batch in MODELS:
            p = cuda_models.build(prec, dims=dims, batch=batch)
            for name, comp in p.comps.items():
                for use_cublas in (True, False):
                    for s in cuda_sources(comp, use_cublas=use_cublas):
                        out.setdefault(s, f"{prec} {dims} batch {batch}: {name}")
    return out


def _case_sources() -> dict[str, str]:
    out: dict[str, str] = {}
    for prec in Precision:
        comp, _ = cuda_cases.op_cases(prec)
        for s in cuda_sources(comp):
            out.setdefault(s, f"ops {prec.value}")
    for label, (comp, _) in (("mixed precisions", cuda_cases.mixed_cases()),
                             ("reductions", cuda_cases.reduction_cases()),
                             ("gemms", cuda_cases.gemm_cases())):
        for s in cuda_sources(comp):
            out.setdefault(s, label)
    return out


def _check_one(src: str, where: str, arch: str) -> str | None:
    """Compile one kernel; None when it compiles cleanly, else the failure with its log."""
    try:
        ptx, log = nvrtc.compile_ptx(src, arch)
    except nvrtc.NvrtcError as err:
        return f"{where} ({arch}): {err}\n{src}"
    log = _DEPRECATION.sub("", log).strip()
    if log:
        return f"{where} ({arch}): warnings:\n{log}\n{src}"
    # CUDA's own f32 sin / cos reduce a huge argument with one f64 product (libdevice's
    # Payne-Hanek path): those f64 lines are CUDA's, not ours
    trig = re.compile(r"\b(?:sin|cos)\(")
    libdevice = {"\tcvt.rn.f64.s64", "\tmul.f64", "\tcvt.rn.f32.f64", "\t.reg .f64"}
    f64_lines = [ln for ln in ptx.splitlines() if ".f64" in ln]
    if trig.search(src):
        f64_lines = [ln for ln in f64_lines if not any(ln.startswith(k) for k in libdevice)]
    if "double" not in src and f64_lines:
        return f"{where} ({arch}): f64 instructions in an f32 kernel\n{src}"
    return None


_NAME = re.compile(r"(__launch_bounds__\(\d+\) ocannl_\w+)\(")


def _compile_all(sources: dict[str, str], batch: int = 48) -> list[str]:
    """Compile every source for every arch; returns the failures with their logs.

    Kernels are compiled in batches, each kernel renamed apart in one translation unit (the
    per-program cost dominates NVRTC's time); a batch that fails is recompiled kernel by
    kernel to name the culprits. Batches run in parallel: NVRTC releases the GIL.
    """
    items = list(sources.items())
    groups = [[it for it in items if ("double" in it[0]) == f64] for f64 in (False, True)]
    jobs = [(g[k:k + batch], arch) for g in groups for k in range(0, len(g), batch)
            for arch in ARCHS]

    def run(job: tuple[list[tuple[str, str]], str]) -> list[str]:
        chunk, arch = job
        text = "\n".join(_NAME.sub(rf"\1_{k}(", src, count=1) for k, (src, _) in enumerate(chunk))
        if _check_one(text, f"batch of {len(chunk)}", arch) is None:
            return []
        return [f for src, where in chunk if (f := _check_one(src, where, arch)) is not None]

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return [f for fails in pool.map(run, jobs) for f in fails]


def test_every_model_kernel_compiles_for_compute_70_and_90() -> None:
    sources = _model_sources()
    kinds = {re.search(r"void __launch_bounds__\(\d+\) ocannl_(\w+)", s).group(1)
             for s in sources}
    # The models reach these kernel kinds (the split reductions, partial and final, come from
    # the reduction cases below); precisions all appear.
    assert kinds >= {"map", "serial", "reduce"}, kinds  # (conversions are lowering's maps)
    assert any("__half" in s for s in sources) and any("__nv_bfloat16" in s for s in sources)
    failures = _compile_all(sources)
    assert not failures, f"{len(failures)} of {2 * len(sources)} compiles failed:\n" + \
        "\n\n".join(failures[:5])


def test_every_op_reduction_and_gemm_case_compiles() -> None:
    sources = _case_sources()
    kinds = {re.search(r"void __launch_bounds__\(\d+\) ocannl_(\w+)", s).group(1)
             for s in sources}
    assert kinds >= {"fill", "map", "serial", "reduce", "partial", "final"}, kinds
    assert any("double" in s for s in sources)
    failures = _compile_all(sources)
    assert not failures, "\n\n".join(failures[:5])


def test_a_broken_kernel_fails_the_compile() -> None:
    """The check is a real compile: an undefined name is an error with the log attached."""
    src = 'extern "C" __global__ void k(float* b0) { b0[0] = undefined_name; }\n'
    with pytest.raises(nvrtc.NvrtcError, match="undefined_name"):
        nvrtc.compile_ptx(src, "compute_90")


def test_half_headers_found_and_self_contained(tmp_path: Path) -> None:
    """cuda_fp16.h / cuda_bf16.h come from the nvidia-cuda-runtime-cu12 wheel and, under
    NVRTC, need no other header: a folder holding only them and their .hpp parts is enough."""
    inc = nvrtc.cuda_include_dir()
    assert inc is not None
    for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"):
        shutil.copy(Path(inc) / name, tmp_path / name)
    src = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
           'extern "C" __global__ void k(__half* a, __nv_bfloat16* b) {\n'
           "  a[0] = __float2half_rn(__half2float(a[0]) + __bfloat162float(b[0]));\n}\n")
    for arch in ARCHS:
        ptx, _ = nvrtc.compile_ptx(src, arch, include_dirs=(str(tmp_path),))
        assert ".entry k" in ptx
    with pytest.raises(nvrtc.NvrtcError, match="cuda_fp16.h"):
        nvrtc.compile_ptx(src, "compute_90", include_dirs=())


def test_a_broken_kernel_in_a_batch_is_reported_by_name() -> None:
    good = cuda_sources(cuda_cases.op_cases(Precision.f32)[0])
    bad = good[0].replace("b0[", "undeclared_buffer[", 1)
    failures = _compile_all({**{s: "good" for s in good}, bad: "the broken one"})
    assert failures and all(f.startswith("the broken one") for f in failures)
    assert len(failures) == len(ARCHS)
