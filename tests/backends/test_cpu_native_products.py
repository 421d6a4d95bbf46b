"""bf16 (and f16) products multiplied as stored (``native_products.py``, ``onednn.py``): the
choice, its refusals, and the benchmark workloads' bf16 steps trained through MKL's
``gemm_bf16bf16f32`` and through oneDNN's ``dnnl_gemm_bf16bf16f32`` against PyTorch f32 and
against the widened path.

The native runs are subprocesses: the BLAS and the product paths are decided once per process,
from the environment. MKL's bf16 routine runs on any x86-64 CPU (it widens internally where
the CPU has no bf16 units); oneDNN's on any with AVX-512 (``ONEDNN_MAX_CPU_ISA=AVX2`` shows
its refusal on every such machine)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import cpus
import pytest
from cpus import DNNL, MKL, OPENBLAS

from ocannl.backends.cpu import blas, native_products, onednn
from ocannl.backends.cpu.native_products import decide
from ocannl.ir.ops import Precision

ROOT = Path(__file__).resolve().parents[2]
MKL_WHEEL = platform.machine() == "x86_64" and sys.platform == "linux"
BF16, F16 = Precision.bf16, Precision.f16
SPR, ZEN, AMD = cpus.SAPPHIRE_RAPIDS, cpus.ZEN5, cpus.ZEN3


def with_dnnl() -> onednn.OneDnn:
    return DNNL


def without_dnnl() -> str:
    return "no libdnnl.so.3 under /x/lib"


def test_bf16_products_are_native_by_default_only_with_bf16_units_and_a_routine():
    path = decide(BF16, SPR, MKL)
    assert (path.native, path.routine, path.address) == (True, "gemm_bf16bf16f32_", 11)
    assert "amx_bf16 and avx512_bf16" in path.why
    assert decide(BF16, cpus.COOPER_LAKE, MKL).native
    amd = decide(BF16, AMD, MKL)
    assert not amd.native and "no amx_bf16 or avx512_bf16" in amd.why
    plain = decide(BF16, SPR, OPENBLAS)
    assert not plain.native and "(numpy, libscipy_openblas64_.so) has no bf16 product" in \
        plain.why


def test_bf16_products_call_onednn_where_the_blas_has_no_routine_of_the_cpus_units():
    """MKL's on Intel's CPUs; oneDNN's on another vendor's (MKL's widens there) and beside a
    BLAS with none; MKL's still where oneDNN is missing; f16 never oneDNN's."""
    intel = decide(BF16, SPR, MKL, second=with_dnnl)
    assert (intel.routine, intel.address) == ("gemm_bf16bf16f32_", 11)
    zen = decide(BF16, ZEN, MKL, second=with_dnnl)
    assert (zen.native, zen.routine, zen.address) == (True, "oneDNN 3.2.0 "
                                                      "dnnl_gemm_bf16bf16f32", 21)
    assert zen.why == "this CPU has avx512_bf16"
    assert (zen.inline_work, intel.inline_work) == (onednn.INLINE_WORK, 0)  # MKL's: unmeasured
    assert decide(BF16, ZEN, OPENBLAS, second=with_dnnl).address == 21
    assert decide(BF16, ZEN, MKL, second=without_dnnl).address == 11
    missing = decide(BF16, ZEN, OPENBLAS, second=without_dnnl)
    assert not missing.native and missing.why.endswith(
        "has no bf16 product, and oneDNN's is not there: no libdnnl.so.3 under /x/lib")
    assert not decide(F16, cpus.GRANITE_RAPIDS, OPENBLAS, second=with_dnnl).native


def test_onednn_is_not_looked_for_where_it_is_not_needed():
    def looked() -> str:
        raise AssertionError("oneDNN was loaded")

    assert not decide(BF16, AMD, OPENBLAS, second=looked).native  # no bf16 units
    assert decide(BF16, SPR, MKL, second=looked).address == 11
    assert not decide(BF16, ZEN, OPENBLAS, "widened", second=looked).native


def test_f16_products_are_native_by_default_only_with_amx_fp16():
    """Sapphire Rapids has AVX512-FP16 but no AMX-FP16, where MKL's f16 routine lost to
    sgemm: widened there."""
    assert not decide(F16, SPR, MKL).native
    assert decide(F16, cpus.GRANITE_RAPIDS, MKL).native


def test_the_environment_forces_a_path_and_native_without_a_routine_is_refused():
    forced = decide(BF16, AMD, MKL, "native")
    assert forced.native and "as OCANNL_BF16_PRODUCTS asks (this CPU has no" in forced.why
    assert not decide(BF16, SPR, MKL, "widened").native
    with pytest.raises(ValueError, match=r"OCANNL_BF16_PRODUCTS=native: the BLAS in use "
                                         r"\(numpy, libscipy_openblas64_.so\) has no bf16 "
                                         r"product, and oneDNN's is not there: no libdnnl"
                                         r".* or install oneDNN \(pip install onednn-cpu"):
        decide(BF16, SPR, OPENBLAS, "native", second=without_dnnl)
    with pytest.raises(ValueError, match=r"OCANNL_F16_PRODUCTS=native: .* has no f16 product; "
                                         r"install MKL \(pip install mkl\) and set "
                                         r"OCANNL_BLAS=mkl, or unset"):
        decide(F16, SPR, OPENBLAS, "native", second=with_dnnl)
    with pytest.raises(ValueError, match=r"OCANNL_F16_PRODUCTS='on': expected one of "
                                         r"'native'"):
        decide(F16, SPR, MKL, "on")


def test_a_refused_choice_decides_nothing(monkeypatch):
    monkeypatch.setattr(native_products, "_decided", {})
    monkeypatch.setattr(blas, "chosen", lambda: OPENBLAS)
    monkeypatch.setattr(onednn, "bf16_product", lambda bits: without_dnnl())
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
from ocannl.ir.lowered import Gemm, LoopGroup, copy_source, nodes_of
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
    # many f32 copies of 16-bit nodes the library's products read (a widening nest, in a pass
    # of its own or in the pass writing the node, or a cast twin kept in f32).
    from benchmarks.models import ocannl_optimizer
    from ocannl import train
    scale = r.scaler.scale if hasattr(r, "scaler") else None
    comp = train.grad_update(r.loss_t, loss_scale=scale) + ocannl_optimizer(w).update(r.loss_t)
    code = lower(comp, jit.target())
    copies = {n.assign.lhs.id for g in code if isinstance(g, LoopGroup) for n in g.nests
              if n.assign.lhs.prec.value == "f32" and copy_source(n) is not None
              and copy_source(n).prec.is_narrow}
    copies |= {n.id for n in nodes_of(code) if n.keeps is not None and n.prec.value == "f32"}
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


def _onednn_here() -> str:
    """Why oneDNN's bf16 product cannot run here (``""``: it can)."""
    found = onednn.bf16_product(blas.chosen().int_bits)
    return found if isinstance(found, str) else ""


# Each routine as a run asks for it (``OCANNL_BF16_PRODUCTS``), whatever this CPU's default
# would pick: MKL's (``blas``, with ``OCANNL_BLAS=mkl``) and oneDNN's beside the default BLAS.
ROUTINES = {"mkl": ({"OCANNL_BLAS": "mkl", "OCANNL_BF16_PRODUCTS": "blas"},
                    "native (gemm_bf16bf16f32_)"),
            "onednn": ({"OCANNL_BF16_PRODUCTS": "onednn"}, "native (oneDNN ")}


def _cannot_run(routine: str) -> str:
    """Why ``routine`` cannot run on this machine (``""``: it can)."""
    if not MKL_WHEEL:
        return "the mkl and onednn wheels are built for x86-64 Linux only"
    if routine == "onednn" and _onednn_here():
        return f"oneDNN's bf16 product cannot run here: {_onednn_here()}"
    return ""


@pytest.mark.parametrize("routine", sorted(ROUTINES))
def test_the_workloads_bf16_steps_multiply_bf16_operands_as_stored(routine):
    """mlp_wide, convnet and gpt_mini's bf16 steps on the routine asked for, MKL's or
    oneDNN's, on any CPU where it runs (MKL's on every x86-64 one, oneDNN's on those with
    AVX-512): every library product of two bf16 operands reads them as stored (no f32 copy of
    a 16-bit node feeds one), the step holds less memory than the widened one, its losses over
    six steps are within the bf16 parity gate of PyTorch f32, and its bits are the same on one
    thread as on two (each part of a shared product is one call, the same parts whatever the
    thread count)."""
    from benchmarks.specs import TOLERANCE

    why = _cannot_run(routine)
    if why:
        pytest.skip(why)
    env, named = ROUTINES[routine]
    got_all = _steps(env, WORKLOADS, STEPS_RUN)
    alone = _steps({**env, "OCANNL_THREADS": "1"}, WORKLOADS, STEPS_RUN)
    widened = _steps({**env, "OCANNL_BF16_PRODUCTS": "widened"}, WORKLOADS, STEPS_RUN)
    assert got_all["target"] == ["bf16"] and widened["target"] == []
    assert f"bf16 products: {named}" in got_all["paths"], got_all["paths"]
    for name in WORKLOADS.split(","):
        got, wide = got_all[name], widened[name]
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


def test_onednn_refuses_a_cpu_without_its_bf16_kernels():
    """Capped at AVX2, oneDNN has no bf16 product: said, with its version and file; forced
    native beside a BLAS without one is then refused when the context is made."""
    probe = ("from ocannl.backends.cpu import onednn, blas\n"
             "print(onednn.bf16_product(blas.chosen().int_bits))\n"
             "from ocannl import Context\n"
             "Context.cpu()\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OCANNL_BLAS": "numpy",
                               "ONEDNN_MAX_CPU_ISA": "AVX2", "OCANNL_BF16_PRODUCTS": "native"})
    if not (Path(sys.prefix) / "lib" / onednn.LIBRARY).is_file():
        assert "no libdnnl.so.3 under" in done.stdout, done.stdout
    else:
        assert "has no bf16 product on this CPU (status 3)" in done.stdout, done
    assert done.returncode != 0
    assert "OCANNL_BF16_PRODUCTS=native: the BLAS in use (numpy" in done.stderr, done.stderr
    assert "oneDNN's is not there: " in done.stderr


def test_a_refused_product_path_is_refused_when_the_cpu_context_is_made(monkeypatch):
    from ocannl import Context

    monkeypatch.setattr(native_products, "_decided", {})
    monkeypatch.setenv("OCANNL_F16_PRODUCTS", "fast")
    with pytest.raises(ValueError, match=r"OCANNL_F16_PRODUCTS='fast': expected one of "
                                         r"'native'"):
        Context.cpu()


def _column_major_gemm16(calls: list[int]):  # noqa: ANN202 - a ctypes callback
    """A bf16 product with the BLAS's column-major signature, in NumPy, counting its calls in
    ``calls``: what a native path's address points at."""
    import ctypes

    import numpy as np

    int_t = ctypes.c_int64 if blas.chosen().int_bits == 64 else ctypes.c_int32
    pi, pf = ctypes.POINTER(int_t), ctypes.POINTER(ctypes.c_float)
    pc, pu = ctypes.POINTER(ctypes.c_char), ctypes.POINTER(ctypes.c_uint16)

    def matrix(ptr, rows: int, cols: int, ld: int) -> np.ndarray:  # noqa: ANN001
        raw = np.ctypeslib.as_array(ptr, shape=(cols * ld,)).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(cols, ld)[:, :rows].T.astype(np.float64)

    def gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):  # noqa: ANN001, ANN202
        calls.append(1)
        m, n, k = m[0], n[0], k[0]
        opa = matrix(a, k, m, lda[0]).T if ta[0] in b"Tt" else matrix(a, m, k, lda[0])
        opb = matrix(b, n, k, ldb[0]).T if tb[0] in b"Tt" else matrix(b, k, n, ldb[0])
        out = np.ctypeslib.as_array(c, shape=(n * ldc[0],)).reshape(n, ldc[0])
        out[:, :m] = (alpha[0] * (opa @ opb).T + beta[0] * out[:, :m]).astype(np.float32)

    kind = ctypes.CFUNCTYPE(None, pc, pc, pi, pi, pi, pf, pu, pi, pu, pi, pf, pf, pi)
    return kind(gemm)


def test_a_native_path_decided_after_the_jit_engine_is_made_is_linked(monkeypatch):
    """The 16-bit product symbol is bound when a routine is loaded, not once with the engine:
    an engine made while bf16 products were widened still links a later native path (before,
    the routine called address 0 and the process died)."""
    import ctypes

    import numpy as np

    import ocannl.tensor as T
    from ocannl import Context, train
    from ocannl.backends.cpu import jit
    from ocannl.backends.rounding import to_precision

    jit._setup()  # the engine exists before the path below is decided
    calls: list[int] = []
    callback = _column_major_gemm16(calls)
    address = ctypes.cast(callback, ctypes.c_void_p).value
    monkeypatch.setattr(native_products, "_decided", {
        Precision.bf16: native_products.ProductPath(Precision.bf16, True, "numpy", address,
                                                     "the test's", 1),
        Precision.f16: native_products.ProductPath(Precision.f16, False, "", 0, "the test's")})
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(48, 40)), rng.normal(size=(40, 24))
    x = T.term(a, label="na", output_dims=(48,), input_dims=(40,))
    w = T.term(b, label="nb", output_dims=(40,), input_dims=(24,))
    y = T.cast(T.matmul(T.cast(x, "bf16"), T.cast(w, "bf16")), "f32")
    ctx, r = Context.cpu().compile(train.forward(y))
    ctx = ctx.run(r)
    assert calls, "the bf16 product did not call the native path"

    def bf16(values: np.ndarray) -> np.ndarray:  # f32 values rounded to bf16, as f64
        return to_precision(values.astype(np.float32), Precision.bf16).astype(np.float64)

    np.testing.assert_array_equal(ctx.get_values(y), bf16(bf16(a) @ bf16(b)))
