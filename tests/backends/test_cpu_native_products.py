"""bf16 (and f16) products multiplied by the BLAS as stored (``native_products.py``): the choice,
its refusals, and the benchmark workloads' bf16 steps trained through MKL's
``gemm_bf16bf16f32`` against PyTorch f32 and against the widened path.

The native runs are subprocesses: the BLAS and the product paths are decided once per process,
from the environment. MKL's bf16 routine runs on any x86-64 CPU (it widens internally where
the CPU has no bf16 units), so these run on every development machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ocannl.backends.cpu import blas, native_products
from ocannl.backends.cpu.native_products import decide
from ocannl.ir.ops import Precision

ROOT = Path(__file__).resolve().parents[2]
MKL_WHEEL = platform.machine() == "x86_64" and sys.platform == "linux"
BF16, F16 = Precision.bf16, Precision.f16
SPR = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"})
AMD = frozenset({"avx2", "f16c", "fma"})
MKL = blas.Blas("mkl", 1, 2, 32, None, "libmkl_core.so.2",
                (("bf16", "gemm_bf16bf16f32_", 11), ("f16", "gemm_f16f16f32_", 12)))
OPENBLAS = blas.Blas("numpy", 1, 2, 64, None, "libscipy_openblas64_.so")


def test_bf16_products_are_native_by_default_only_with_bf16_units_and_a_routine():
    path = decide(BF16, SPR, MKL)
    assert (path.native, path.routine, path.address) == (True, "gemm_bf16bf16f32_", 11)
    assert "amx_bf16 and avx512_bf16" in path.why
    assert decide(BF16, frozenset({"avx512_bf16"}), MKL).native
    amd = decide(BF16, AMD, MKL)
    assert not amd.native and "no amx_bf16 or avx512_bf16" in amd.why
    plain = decide(BF16, SPR, OPENBLAS)
    assert not plain.native and "(numpy) has no bf16 product" in plain.why


def test_f16_products_are_native_by_default_only_with_amx_fp16():
    """Sapphire Rapids has AVX512-FP16 but no AMX-FP16, where MKL's f16 routine lost to
    sgemm: widened there."""
    assert not decide(F16, SPR, MKL).native
    assert decide(F16, SPR | {"amx_fp16"}, MKL).native


def test_the_environment_forces_a_path_and_native_without_a_routine_is_refused():
    forced = decide(BF16, AMD, MKL, "native")
    assert forced.native and "as OCANNL_BF16_PRODUCTS asks (this CPU has no" in forced.why
    assert not decide(BF16, SPR, MKL, "widened").native
    with pytest.raises(ValueError, match=r"OCANNL_BF16_PRODUCTS=native: the BLAS in use "
                                         r"\(numpy, libscipy_openblas64_.so\) has no bf16"):
        decide(BF16, SPR, OPENBLAS, "native")
    with pytest.raises(ValueError, match=r"OCANNL_F16_PRODUCTS='on': expected 'native'"):
        decide(F16, SPR, MKL, "on")


def test_a_refused_choice_decides_nothing(monkeypatch):
    monkeypatch.setattr(native_products, "_decided", {})
    monkeypatch.setattr(blas, "chosen", lambda: OPENBLAS)
    monkeypatch.setenv("OCANNL_BF16_PRODUCTS", "native")
    with pytest.raises(ValueError, match="OCANNL_BF16_PRODUCTS=native"):
        native_products.paths()
    assert native_products._decided == {}
    monkeypatch.setenv("OCANNL_BF16_PRODUCTS", "widened")
    assert "bf16 products: widened to f32 copies (sgemm), as OCANNL_BF16_PRODUCTS asks" in \
        native_products.describe()


# --- the workloads' bf16 steps, native and widened ------------------------------------------

STEPS = """
import json, sys
import numpy as np
from benchmarks import fixtures, specs
from benchmarks.runners import make_runner
from ocannl.backends.cpu import jit, native_products
from ocannl.ir.lowered import Gemm, LoopGroup
from ocannl.ir.lowering import lower
out = {"paths": native_products.describe(), "target": sorted(
    p.value for p in jit.target().native_products)}
for name in sys.argv[1].split(","):
    w = specs.WORKLOADS[name]
    fx = fixtures.from_tensors(w, fixtures.generate(w))
    r = make_runner(fx, "ocannl", sys.argv[3], "cpu")
    r.build()
    losses = []
    for i in range(int(sys.argv[2])):
        r.step(i)
        losses.append(r.loss())
    # The step's products as lowered here: their operands' precisions and kernels, and how
    # many f32 copies of 16-bit nodes (widening conversion groups) the library's products read.
    from benchmarks.models import ocannl_optimizer
    from ocannl import train
    scale = r.scaler.scale if hasattr(r, "scaler") else None
    comp = train.grad_update(r.loss_t, loss_scale=scale) + ocannl_optimizer(w).update(r.loss_t)
    code = lower(comp, jit.target())
    copies = {n.assign.lhs.id for g in code if isinstance(g, LoopGroup) and g.conversion
              for n in g.nests if n.assign.lhs.prec.value == "f32"}
    gemms = [g for g in code if isinstance(g, Gemm)]
    out[name] = {"losses": [x.hex() for x in losses], "mem": r.ctx.mem(),
                 "operands": sorted({f"{g.a.node.prec.value}x{g.b.node.prec.value}:{g.kernel}"
                                     for g in gemms}),
                 "widened": sum(v.node.id in copies for g in gemms if g.kernel == "blas"
                                for v in (g.a, g.b))}
print(json.dumps(out))
"""


def _steps(env: dict[str, str], names: str, steps: int, variant: str = "bf16") -> dict:
    done = subprocess.run([sys.executable, "-c", STEPS, names, str(steps), variant], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


WORKLOADS, STEPS_RUN = "mlp_wide,convnet,gpt_mini", 6


def _torch_losses(name: str, steps: int) -> list[float]:
    from benchmarks import fixtures, specs
    from benchmarks.runners import make_runner
    from benchmarks.runners.base import trained_losses

    w = specs.WORKLOADS[name]
    fx = fixtures.from_tensors(w, fixtures.generate(w))
    return trained_losses(make_runner(fx, "torch", "eager", "cpu"), steps)


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_the_workloads_bf16_steps_multiply_bf16_operands_as_stored():
    """mlp_wide, convnet and gpt_mini's bf16 steps with MKL's bf16 products: every library
    product of two bf16 operands reads them as stored (no f32 copy of a 16-bit node feeds one),
    the step holds less memory than the widened one, its losses over six steps are within the
    bf16 parity gate of PyTorch f32, and its bits are the same on one thread as on two (each
    part of a shared product is one call, the same parts whatever the thread count)."""
    from benchmarks.specs import TOLERANCE

    mkl = {"OCANNL_BLAS": "mkl"}
    native = _steps({**mkl, "OCANNL_BF16_PRODUCTS": "native"}, WORKLOADS, STEPS_RUN)
    alone = _steps({**mkl, "OCANNL_BF16_PRODUCTS": "native", "OCANNL_THREADS": "1"},
                   WORKLOADS, STEPS_RUN)
    widened = _steps({**mkl, "OCANNL_BF16_PRODUCTS": "widened"}, WORKLOADS, STEPS_RUN)
    assert native["target"] == ["bf16"] and widened["target"] == []
    assert "bf16 products: native (gemm_bf16bf16f32_)" in native["paths"]
    for name in WORKLOADS.split(","):
        got, wide = native[name], widened[name]
        assert "bf16xbf16:blas" in got["operands"] and got["widened"] == 0, got
        assert not any(o.startswith("bf16") for o in wide["operands"]) and wide["widened"] > 0
        assert got["mem"] < wide["mem"], (name, got["mem"], wide["mem"])
        assert got["losses"] == alone[name]["losses"], name
        ours = [float.fromhex(x) for x in got["losses"]]
        theirs = _torch_losses(name, STEPS_RUN)
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
        assert worst < TOLERANCE["bf16"], (name, worst, ours, theirs)


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_f16_products_forced_native_run_on_mkls_f16_routine():
    """``OCANNL_F16_PRODUCTS=native``: mlp_wide's f16 step (dynamic loss scale, host gate)
    multiplies its f16 operands as stored through MKL's ``gemm_f16f16f32``, within the f16
    parity gate of PyTorch f32; bf16 stays widened where the CPU has no bf16 units."""
    from benchmarks.specs import TOLERANCE

    got = _steps({"OCANNL_BLAS": "mkl", "OCANNL_F16_PRODUCTS": "native"}, "mlp_wide", 4, "f16")
    assert "f16 products: native (gemm_f16f16f32_)" in got["paths"]
    step = got["mlp_wide"]
    assert "f16xf16:blas" in step["operands"] and step["widened"] == 0, step
    ours = [float.fromhex(x) for x in step["losses"]]
    theirs = _torch_losses("mlp_wide", 4)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    assert worst < TOLERANCE["f16"], (worst, ours, theirs)


def test_the_cpu_context_names_its_blas_and_each_16_bit_product_path():
    from ocannl import Context

    line = Context.cpu().describe()
    library = blas.chosen()
    assert line.startswith("cpu: ") and f"BLAS {library.name}" in line
    assert native_products.describe() in line
    assert "bf16 products: " in line and "f16 products: " in line


def test_a_refused_product_path_is_refused_when_the_cpu_context_is_made(monkeypatch):
    from ocannl import Context

    monkeypatch.setattr(native_products, "_decided", {})
    monkeypatch.setenv("OCANNL_F16_PRODUCTS", "fast")
    with pytest.raises(ValueError, match=r"OCANNL_F16_PRODUCTS='fast': expected 'native'"):
        Context.cpu()
