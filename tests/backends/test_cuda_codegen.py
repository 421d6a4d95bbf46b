"""Every CUDA kernel the test models and the benchmark steps generate compiles with NVRTC, of
CUDA 12 and of CUDA 13, no GPU needed.

A real compile, failing on any error and on any warning but NVRTC's notice that an old
architecture is deprecated; the PTX of f32 / f16 / bf16 kernels must hold no f64 instruction
(arithmetic in f32, no accidental double promotion). The architectures come from each NVRTC's
own list (``nvrtc.supported_archs``): the oldest one the project targets that it still supports
(compute_70, Volta, under CUDA 12; compute_75 under CUDA 13, which dropped Volta) and
compute_90 (the H200). Under ``CI`` both majors must be installed (the ``nvrtc-check`` extra).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cuda_cases
import cuda_models
import numpy as np
import pytest

from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import GemmCall, cuda_sources, cuda_target, plan_routine
from ocannl.backends.cuda.runtime import from_storage, storage_dtype, to_storage
from ocannl.ir.ops import Precision

MAJORS = (12, 13)  # the CUDA majors every kernel is compiled with
OLDEST_ARCH = 70  # the oldest GPU the project targets (Volta), where NVRTC still has it
_DEPRECATION = re.compile(r"nvrtc: warning: Architectures prior to .*? are deprecated.*\n?")

_missing = {m: nvrtc.available(m) for m in MAJORS}
if os.environ.get("CI") and any(_missing.values()):
    raise RuntimeError("CI must compile the CUDA kernels with NVRTC of CUDA 12 and 13: "
                       + "; ".join(r for r in _missing.values() if r))
pytestmark = pytest.mark.skipif(all(_missing.values()),
                                reason=f"NVRTC unavailable: {_missing}")
with_major = pytest.mark.parametrize("major", [
    pytest.param(m, marks=pytest.mark.skipif(_missing[m] is not None, reason=str(_missing[m])))
    for m in MAJORS])


def archs(major: int) -> tuple[str, ...]:
    """The architectures to compile for with the NVRTC of ``major``, from its own list."""
    supported = nvrtc.supported_archs(major)
    oldest = min(a for a in supported if a >= OLDEST_ARCH)
    return tuple(f"compute_{a}" for a in sorted({oldest, 90}))


MODELS = [((2, 16, 16, 2), 32), ((2, 64, 64, 2), 1024), ((256, 1024, 1024, 10), 256)]


@functools.cache
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


@functools.cache
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


def _check_one(src: str, where: str, arch: str, major: int) -> str | None:
    """Compile one kernel; None when it compiles cleanly, else the failure with its log."""
    at = f"{where} (NVRTC {major}, {arch})"
    try:
        ptx, log = nvrtc.compile_ptx(src, arch, major=major)
    except nvrtc.NvrtcError as err:
        return f"{at}: {err}\n{src}"
    log = _DEPRECATION.sub("", log).strip()
    if log:
        return f"{at}: warnings:\n{log}\n{src}"
    # CUDA's own f32 sin / cos reduce a huge argument with one f64 product (libdevice's
    # Payne-Hanek path): those f64 lines are CUDA's, not ours
    trig = re.compile(r"\b(?:sin|cos)\(")
    libdevice = {"\tcvt.rn.f64.s64", "\tmul.f64", "\tcvt.rn.f32.f64", "\t.reg .f64"}
    f64_lines = [ln for ln in ptx.splitlines() if ".f64" in ln]
    if trig.search(src):
        f64_lines = [ln for ln in f64_lines if not any(ln.startswith(k) for k in libdevice)]
    if "double" not in src and f64_lines:
        return f"{at}: f64 instructions in an f32 kernel\n{src}"
    return None


_NAME = re.compile(r"(__launch_bounds__\(\d+\) ocannl_\w+)\(")


def _compile_all(sources: dict[str, str], major: int | None = None,
                 arch_list: tuple[str, ...] | None = None, batch: int = 48) -> list[str]:
    """Compile every source for every arch of ``archs(major)`` (or ``arch_list``) with the
    NVRTC of ``major`` (None: with each of ``MAJORS`` found here); returns the failures with
    their logs.

    Kernels are compiled in batches, each kernel renamed apart in one translation unit (the
    per-program cost dominates NVRTC's time); a batch that fails is recompiled kernel by
    kernel to name the culprits. Batches run in parallel: NVRTC releases the GIL.
    """
    items = list(sources.items())
    groups = [[it for it in items if ("double" in it[0]) == f64] for f64 in (False, True)]
    majors = [major] if major is not None else [m for m in MAJORS if _missing[m] is None]
    jobs = [(g[k:k + batch], arch, m) for m in majors for g in groups
            for k in range(0, len(g), batch) for arch in (arch_list or archs(m))]

    def run(job: tuple[list[tuple[str, str]], str, int]) -> list[str]:
        chunk, arch, m = job
        text = "\n".join(_NAME.sub(rf"\1_{k}(", src, count=1) for k, (src, _) in enumerate(chunk))
        if _check_one(text, f"batch of {len(chunk)}", arch, m) is None:
            return []
        return [f for src, where in chunk
                if (f := _check_one(src, where, arch, m)) is not None]

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return [f for fails in pool.map(run, jobs) for f in fails]


class _RecordingCuda:
    """A backend that lowers for the CUDA target and records the code instead of running it:
    host buffers as the CUDA backend stores them, routines that do nothing. What
    ``Context.cuda()`` would be asked to compile, with no GPU and no CPU compile."""

    name = "cuda"

    def __init__(self) -> None:
        self.codes: list[list] = []

    @property
    def target(self):  # noqa: ANN201 - ocannl.ir.target.Target
        return cuda_target()

    def alloc(self, node):  # noqa: ANN001, ANN201
        return np.zeros(node.size, dtype=storage_dtype(node.prec))

    def write(self, node, buf, host) -> None:  # noqa: ANN001
        buf[:] = to_storage(node, host)

    def writer(self, node, buf):  # noqa: ANN001, ANN201
        return lambda host: self.write(node, buf, host)

    def read(self, node, buf):  # noqa: ANN001, ANN201
        return from_storage(node, buf.copy())

    def reader(self, node, buf, pos):  # noqa: ANN001, ANN201
        return lambda: float(self.read(node, buf)[pos])

    def compile(self, label, code, nodes):  # noqa: ANN001, ANN201
        self.codes.append(list(code))
        return code, True

    def bind(self, compiled, buffers):  # noqa: ANN001, ANN201
        return lambda: None

    def synchronize(self) -> None:
        return None


@functools.cache
def _benchmark_codes() -> dict[str, list[list]]:
    """The lowered code of every routine of every benchmark step (``benchmarks.specs``: each
    workload, each variant) by ``"workload variant"``, built by this project's runner (its
    model, weights and recipe) on a context lowering for the CUDA target."""
    from benchmarks.fixtures import from_tensors, generate
    from benchmarks.runners import make_runner, ocannl_runner
    from benchmarks.specs import VARIANTS, WORKLOADS
    from ocannl import Context

    out: dict[str, list[list]] = {}
    make_context = ocannl_runner.make_context
    for w in WORKLOADS.values():
        fx = from_tensors(w, generate(w))
        for variant in VARIANTS:
            backend = _RecordingCuda()
            ocannl_runner.make_context = lambda device, _b=backend: Context(_b)
            try:
                make_runner(fx, "ocannl", variant, "cpu").build()
            finally:
                ocannl_runner.make_context = make_context
            assert backend.codes, f"{w.name} {variant}: the runner compiled nothing"
            out[f"{w.name} {variant}"] = backend.codes
    return out


@functools.cache
def _benchmark_sources() -> dict[str, str]:
    """Distinct kernel source -> where it comes from, over every routine of every benchmark
    step, planned."""
    out: dict[str, str] = {}
    for where, codes in _benchmark_codes().items():
        for k, code in enumerate(codes):
            for src in plan_routine(code).sources():
                out.setdefault(src, f"{where} routine {k}")
    return out


def _kinds(sources: dict[str, str]) -> set[str]:
    return {re.search(r"void __launch_bounds__\(\d+\) ocannl_(\w+)", s).group(1)
            for s in sources}


@with_major
def test_every_model_kernel_compiles_for_the_oldest_arch_and_compute_90(major: int) -> None:
    sources = _model_sources()
    # The models reach these kernel kinds (the split reductions, partial and final, come from
    # the reduction cases below); precisions all appear.
    assert _kinds(sources) >= {"map", "serial", "reduce"}, _kinds(sources)
    assert any("__half" in s for s in sources) and any("__nv_bfloat16" in s for s in sources)
    failures = _compile_all(sources, major)
    assert not failures, f"{len(failures)} of {2 * len(sources)} compiles failed:\n" + \
        "\n\n".join(failures[:5])


@with_major
def test_every_op_reduction_and_gemm_case_compiles(major: int) -> None:
    sources = _case_sources()
    assert _kinds(sources) >= {"fill", "map", "serial", "reduce", "partial", "final"}
    assert any("double" in s for s in sources)
    failures = _compile_all(sources, major)
    assert not failures, "\n\n".join(failures[:5])


@with_major
def test_every_benchmark_step_kernel_compiles_for_compute_90(major: int) -> None:
    """mlp_small, mlp_wide, convnet and gpt_mini, f32, bf16 and every f16 variant: the kernels
    the H200 would run, compiled by the NVRTC of each CUDA major for its architecture."""
    sources = _benchmark_sources()
    wheres = {where.rsplit(" routine", 1)[0] for where in sources.values()}
    from benchmarks.specs import VARIANTS, WORKLOADS

    assert wheres == {f"{w} {v}" for w in WORKLOADS for v in VARIANTS}, wheres
    assert any("__half" in s for s in sources) and any("__nv_bfloat16" in s for s in sources)
    failures = _compile_all(sources, major, ("compute_90",))
    assert not failures, f"{len(failures)} of {len(sources)} compiles failed:\n" + \
        "\n\n".join(failures[:5])


def test_each_nvrtc_lists_its_own_architectures() -> None:
    """The arch list is NVRTC's own: CUDA 13 dropped Volta (compute_70), CUDA 12 has it; both
    have the H200's compute_90. An unsupported arch is refused before compiling, naming the
    supported ones."""
    for major in MAJORS:
        if _missing[major] is not None:
            continue
        supported = nvrtc.supported_archs(major)
        assert 90 in supported and archs(major)[-1] == "compute_90"
        assert (70 in supported) == (major < 13), (major, supported)
        assert archs(major)[0] == ("compute_70" if major < 13 else "compute_75")
    major = nvrtc.majors()[-1]
    unsupported = next(a for a in range(30, 200) if a not in nvrtc.supported_archs(major))
    with pytest.raises(nvrtc.NvrtcError, match=rf"compute_{unsupported}; it supports "):
        nvrtc.compile_ptx('extern "C" __global__ void k() {}', f"compute_{unsupported}")


@with_major
def test_the_builtins_library_is_loaded_beside_libnvrtc(major: int) -> None:
    """NVRTC opens libnvrtc-builtins.so.<major>.<minor> when it compiles; the loader loads the
    one beside the libnvrtc it loaded (the CUDA 13.0 wheel's libnvrtc cannot find it alone)."""
    lib = nvrtc.library(major)
    assert (lib.major, lib.minor) == nvrtc.version(major) and lib.major == major
    assert lib.builtins is not None, f"no libnvrtc-builtins beside {lib.path}"
    want = Path(os.path.realpath(lib.path)).with_name(
        f"libnvrtc-builtins.so.{lib.major}.{lib.minor}")
    assert Path(lib.builtins._name) == want
    ptx, _ = nvrtc.compile_ptx('extern "C" __global__ void k(float* b) { b[0] = sinf(b[1]); }',
                               "compute_90", major=major)
    assert ".entry k" in ptx


def test_a_missing_major_names_the_wheel_to_install() -> None:
    with pytest.raises(nvrtc.NvrtcError, match="no NVRTC of CUDA 11 found .*found: 1[23]"):
        nvrtc.library(11)
    for major, reason in _missing.items():
        if reason is not None:
            assert nvrtc.WHEELS[major][0] in reason


@with_major
def test_a_broken_kernel_fails_the_compile(major: int) -> None:
    """The check is a real compile: an undefined name is an error with the log attached."""
    src = 'extern "C" __global__ void k(float* b0) { b0[0] = undefined_name; }\n'
    with pytest.raises(nvrtc.NvrtcError, match="undefined_name"):
        nvrtc.compile_ptx(src, "compute_90", major=major)


@with_major
def test_half_headers_found_and_self_contained(major: int, tmp_path: Path) -> None:
    """cuda_fp16.h / cuda_bf16.h come from the CUDA runtime wheel of the same major and, under
    NVRTC, need no other header: a folder holding only them and their .hpp parts is enough."""
    inc = nvrtc.cuda_include_dir(major)
    assert inc is not None, f"no cuda_fp16.h of CUDA {major} (pip install {nvrtc.WHEELS[major][1]})"
    assert nvrtc._header_major(Path(inc)) == major
    for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp"):
        shutil.copy(Path(inc) / name, tmp_path / name)
    src = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
           'extern "C" __global__ void k(__half* a, __nv_bfloat16* b) {\n'
           "  a[0] = __float2half_rn(__half2float(a[0]) + __bfloat162float(b[0]));\n}\n")
    for arch in archs(major):
        ptx, _ = nvrtc.compile_ptx(src, arch, include_dirs=(str(tmp_path),), major=major)
        assert ".entry k" in ptx
    with pytest.raises(nvrtc.NvrtcError, match="cuda_fp16.h"):
        nvrtc.compile_ptx(src, "compute_90", include_dirs=(), major=major)


@with_major
def test_a_broken_kernel_in_a_batch_is_reported_by_name(major: int) -> None:
    good = cuda_sources(cuda_cases.op_cases(Precision.f32)[0])
    bad = good[0].replace("b0[", "undeclared_buffer[", 1)
    failures = _compile_all({**{s: "good" for s in good}, bad: "the broken one"}, major)
    assert failures and all(f.startswith("the broken one") for f in failures)
    assert len(failures) == len(archs(major))


def test_benchmark_products_take_16_bit_operands_as_stored_and_batch_attention() -> None:
    """Every benchmark step's products, as the CUDA plan renders them: no kernel widens a
    product's 16-bit operands where both are of one 16-bit precision (gemmEx reads them as
    stored), every product is a cuBLAS call, and gpt_mini's attention products (scores, and
    their values) are strided-batched calls, at every precision."""
    from benchmarks.cuda_plan_counts import _around_products

    batched: dict[str, int] = {}
    for where, codes in _benchmark_codes().items():
        for code in codes:
            assert _around_products(code)[0] == 0, where
            for step in plan_routine(code).steps:
                if isinstance(step, GemmCall):
                    g = step.gemm
                    assert g.kernel == "blas", where
                    if g.a.node.prec.is_narrow:
                        assert g.b.node.prec is g.a.node.prec, where
                        assert g.assign.lhs.prec is Precision.f32, where
                    batched[where] = batched.get(where, 0) + bool(g.batch)
    gpt = {w: n for w, n in batched.items() if w.startswith("gpt_mini")}
    assert gpt and all(n > 0 for n in gpt.values()), gpt
    narrow = [w for w, codes in _benchmark_codes().items()
              if any(isinstance(s, GemmCall) and s.gemm.a.node.prec.is_narrow
                     for code in codes for s in plan_routine(code).steps)]
    assert any("bf16" in w for w in narrow) and any("f16-gated16" in w for w in narrow), narrow
