"""The CUDA runtime's structure, without a GPU: one ``RawModule`` per routine (names unique,
cached per device and source, and accepted by NVRTC as CuPy compiles it), binding once, the
storage dtypes and the host conversions rounding once, the FMA option."""

from __future__ import annotations

import re
import warnings

import cuda_models as M
import fake_cupy
import ml_dtypes
import numpy as np
import pytest
from cuda_emu import emulator_unavailable

from ocannl import Context, train
from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import Plan, cuda_target, plan_routine
from ocannl.backends.cuda.runtime import CupyCudaBackend, module_source, storage_dtype
from ocannl.ir.lowering import lower
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

_no_emu = emulator_unavailable()
needs_emu = pytest.mark.skipif(_no_emu is not None, reason=f"no emulator: {_no_emu}")


def _gated_plan(prec: str = "f16", dims: tuple[int, ...] = (2, 64, 64, 2), batch: int = 1024):
    return plan_routine(lower(M.build(prec, dims=dims, batch=batch).comps["gated"],
                              cuda_target()))


# --- the module of a routine ----------------------------------------------------------------


def test_module_source_names_every_kernel_apart() -> None:
    f16, bf16 = _gated_plan("f16"), _gated_plan("bf16")
    plan = Plan(f16.steps + bf16.steps, f16.scratch + bf16.scratch)
    source, names = module_source(plan)
    assert set(names) == set(plan.sources())
    assert len(set(names.values())) == len(names)  # unique within the module
    defined = re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", source)
    assert sorted(defined) == sorted(names.values())
    for k in plan.kernels:  # each name keeps the kernel's own, plus its position
        assert re.fullmatch(rf"{k.name}_\d+", names[k.source])
    includes = re.findall(r"^#include .*$", source, flags=re.M)
    assert len(includes) == len(set(includes)) == 2  # cuda_fp16.h and cuda_bf16.h, once each
    assert source.index(includes[-1]) < source.index("__global__")


@pytest.mark.skipif(nvrtc.available() is not None, reason=f"no NVRTC: {nvrtc.available()}")
def test_a_routine_module_compiles_as_cupy_compiles_it() -> None:
    """The whole module of the wide f16 gated step, with CuPy's own additions to the options
    (``-std=c++17`` since CuPy 14, ``-ftz=true`` last), with and without ``--fmad=false``."""
    source, names = module_source(_gated_plan("f16", (256, 1024, 1024, 10), 256))
    fmas = {}
    for fmad in (True, False):
        opts = (() if fmad else ("--fmad=false",)) + ("-std=c++17", "-ftz=true")
        ptx, _ = nvrtc.compile_ptx(source, "compute_90", opts)
        for name in names.values():
            assert f".entry {name}(" in ptx
        assert ".ftz.f32" in ptx  # flush to zero, as every CuPy kernel
        fmas[fmad] = ptx.count("fma.rn")
    assert fmas[True] > fmas[False]  # contraction is the default; the option turns it off


# --- the backend through the stand-in cupy ---------------------------------------------------


@needs_emu
def test_one_module_per_routine_cached_per_device_and_source(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, devices=2)
    p = M.build("f16")
    ctx = train.init_params(Context.cuda(), p.loss)
    before = fake_cupy.RawModule.compiles
    ctx, routine = ctx.compile(p.comps["gated"])
    assert fake_cupy.RawModule.compiles == before + 1
    count = ctx.compile_count
    ctx, again = ctx.compile(p.comps["gated"])  # same code: the same module
    assert fake_cupy.RawModule.compiles == before + 1 and ctx.compile_count == count
    assert again.compiled.functions == routine.compiled.functions
    other = train.init_params(Context.cuda(), p.loss)  # another context, same device
    other, _ = other.compile(M.build("f16").comps["gated"])  # fresh nodes, same sources
    assert fake_cupy.RawModule.compiles == before + 1
    dev1 = train.init_params(Context.cuda(1), p.loss)  # another device: its own module
    dev1, r1 = dev1.compile(p.comps["gated"])
    assert fake_cupy.RawModule.compiles == before + 2
    dev1.run(r1)


@needs_emu
def test_binding_builds_every_launch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bind`` makes one launch per step; running is calling them: no compile, no lookup of a
    function, no allocation."""
    fake_cupy.install(monkeypatch)
    p = M.build("f32", dims=(2, 64, 64, 2), batch=1024)
    ctx = train.init_params(Context.cuda(), p.loss)
    ctx, routine = ctx.compile(p.comps["gated"])
    plan = routine.compiled.plan
    assert len(routine.call.launches) == len(plan.steps)
    assert len(routine.call.scratch) == len(plan.scratch)

    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a run compiled, looked up or allocated something")

    monkeypatch.setattr(fake_cupy.RawModule, "compile", refuse)
    monkeypatch.setattr(fake_cupy.RawModule, "get_function", refuse)
    monkeypatch.setattr(fake_cupy, "_empty", refuse)
    fake_cupy.launches.clear()
    ctx.run(routine)
    ctx.run(routine)
    assert len(fake_cupy.launches) == 2 * len(plan.kernels)


@needs_emu
def test_storage_dtypes_and_exact_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """f64 / f32 / f16 buffers as such, bf16 as uint16; every 16-bit pattern (NaN payloads
    included) and f32 / f64 specials survive a write and a read bit for bit."""
    fake_cupy.install(monkeypatch)
    ctx = Context.cuda()
    for prec in Precision:
        n = 65536 if prec.is_narrow else 1000
        node = Tnode(f"rt_{prec.value}", (n,), prec)
        if prec.is_narrow:
            host = np.arange(n, dtype=np.uint16).view(prec.numpy_dtype)
        else:
            host = np.random.default_rng(0).normal(size=n).astype(prec.numpy_dtype)
            host[:5] = [np.inf, -np.inf, np.nan, -0.0, np.finfo(host.dtype).smallest_subnormal]
        ctx.set_values(node, host)
        buf = ctx._buffer(node)
        assert buf.dtype == storage_dtype(prec) and isinstance(buf, fake_cupy.FakeArray)
        back = ctx.get_values(node)
        assert back.dtype == prec.numpy_dtype
        assert back.tobytes() == host.tobytes()


@needs_emu
def test_f64_host_values_round_once_into_16_bit_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounding from the value given: through f32 first, each of these would land on a tie and
    round down (ml_dtypes' own f64 -> bfloat16 cast does that)."""
    fake_cupy.install(monkeypatch)
    ctx = Context.cuda()
    h = Tnode("h", (2,), Precision.f16)
    b = Tnode("b", (2,), Precision.bf16)
    ctx.set_values(h, np.array([1 + 2**-11 + 2**-40, -(1 + 2**-11 + 2**-40)]))
    with warnings.catch_warnings():  # the overflow to infinity is reported; it is meant
        warnings.simplefilter("ignore", RuntimeWarning)
        ctx.set_values(b, np.array([1 + 2**-8 + 2**-30, 3e38 * 1.2]))
    assert ctx.get_values(h).tolist() == [1 + 2**-10, -(1 + 2**-10)]
    assert ctx._buffer(b).get().tolist() == [0x3F81, 0x7F80]  # 1 + 2**-7, and inf
    assert ctx.get_values(b).dtype == ml_dtypes.bfloat16
    ctx.set_value(b, 2.5, (1,))
    assert ctx.get_value(b, (1,)) == 2.5


def test_fmad_is_on_by_default_and_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    monkeypatch.delenv("OCANNL_CUDA_FMAD", raising=False)
    assert CupyCudaBackend().fmad and "--fmad=false" not in CupyCudaBackend().options
    assert "--fmad=false" in CupyCudaBackend(fmad=False).options
    monkeypatch.setenv("OCANNL_CUDA_FMAD", "0")
    assert "--fmad=false" in Context.cuda()._backend.options
    assert CupyCudaBackend(fmad=True).fmad
    monkeypatch.setenv("OCANNL_CUDA_FMAD", "maybe")
    with pytest.raises(ValueError, match="OCANNL_CUDA_FMAD must be 0 or 1"):
        Context.cuda()
    monkeypatch.delenv("OCANNL_CUDA_FMAD")
    for flag in ("fmad", "graphs", "tf32"):  # "no" would be true: refused, named
        with pytest.raises(TypeError, match=rf"{flag} must be True or False, got 'no'"):
            CupyCudaBackend(**{flag: "no"})
