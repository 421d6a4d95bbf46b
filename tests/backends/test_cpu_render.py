"""The CPU renderer (``backends/cpu/codegen.py``, ``scalar.py``): its code against the reference
interpreter of lowered code (``ocannl.ir.interpret``), and its 16-bit conversions.

- Every computation of the lowering tests (``tests/ir/corpus.py``) and one training step of each
  benchmark workload in every variant, run on the backend and in the interpreter: every node
  compared bit for bit (any NaN equal to any NaN). A BLAS product and the math functions have no
  defined last bits: the step tests borrow those pieces from the backend (``tests/ir/shadow.py``)
  and check each apart, the corpus shows that a difference comes only from a product.
- Each op's CPU builder against ``ops.reference`` within ``interpret.ULP``.

16-bit conversions. Oracles: NumPy's float16 and ml_dtypes' bfloat16, compared bit for bit
(NaN payloads and the signs of zeros included) over all 65,536 patterns in both directions,
over the exact halfway points between neighbouring 16-bit values (round-to-nearest-even),
and over random f32 bit patterns. Every conversion runs in a generated ``cast`` routine;
``f16_soft`` is the integer-only f16 code used where the CPU has no conversion instructions.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context
from ocannl.backends.cpu.backend import CpuBackend
from ocannl.ir import interpret
from ocannl.ir.assignments import Accum, Affine, Comp, Const, Get, apply, reads
from ocannl.ir.interpret import stored
from ocannl.ir.lowering import Fill, Gemm, nodes_of
from ocannl.ir.ops import OPS, Precision, reference
from ocannl.ir.target import PRODUCTS, Target
from ocannl.ir.tnode import Tnode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ir"))
import corpus  # noqa: E402
import shadow  # noqa: E402

ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
KINDS = ["f16", "f16_soft", "bf16"]


def _cast(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``values`` (host values of precision ``src``) through a generated cast to ``dst``."""
    soft = "f16_soft" in (src, dst)
    src, dst = src.removesuffix("_soft"), dst.removesuffix("_soft")
    x = T.term(output_dims=(values.size,), label="x", prec=src)
    y = T.cast(x, dst)
    ctx = Context.cpu()
    ctx.set_values(x, values)
    with pytest.MonkeyPatch.context() as m:
        if soft:
            m.setenv("OCANNL_SOFT_F16", "1")
        ctx, r = ctx.compile(y.forward_comp())
    ctx.run(r)
    return ctx.get_values(y)


def _widen(kind: str, bits: np.ndarray) -> np.ndarray:
    return _cast(bits.view(DTYPES[kind.removesuffix("_soft")]), kind, "f32")


def _narrow(kind: str, values: np.ndarray) -> np.ndarray:
    return _cast(np.ascontiguousarray(values, np.float32), "f32", kind).view(np.uint16)


def _oracle_narrow(kind: str, values: np.ndarray) -> np.ndarray:
    kind = kind.removesuffix("_soft")
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return values.astype(np.float32).astype(DTYPES[kind]).view(np.uint16)


def _assert_same_bits(got: np.ndarray, want: np.ndarray, inputs: np.ndarray, what: str) -> None:
    bad = np.nonzero(got != want)[0]
    if bad.size:
        shown = ", ".join(
            f"{inputs.view(np.uint16 if inputs.itemsize == 2 else np.uint32)[i]:#x}: "
            f"got {got.view(np.uint32 if got.itemsize == 4 else np.uint16)[i]:#x} "
            f"want {want.view(np.uint32 if want.itemsize == 4 else np.uint16)[i]:#x}"
            for i in bad[:8]
        )
        pytest.fail(f"{what}: {bad.size} mismatches, e.g. {shown}")


@pytest.mark.parametrize("kind", KINDS)
def test_widen_all_patterns(kind):
    got = _widen(kind, ALL_BITS)
    assert got.dtype == np.float32
    want = ALL_BITS.view(DTYPES[kind.removesuffix("_soft")]).astype(np.float32)
    _assert_same_bits(got.view(np.uint32), want.view(np.uint32), ALL_BITS, f"widen {kind}")


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_all_patterns(kind):
    """Every 16-bit value, widened to f32, narrows back to the oracle's pattern (for all
    non-NaN values, the same pattern it came from)."""
    values = ALL_BITS.view(DTYPES[kind.removesuffix("_soft")]).astype(np.float32)
    got = _narrow(kind, values)
    _assert_same_bits(got, _oracle_narrow(kind, values), values, f"narrow {kind}")
    finite_or_inf = ~np.isnan(values)
    assert np.array_equal(got[finite_or_inf], ALL_BITS[finite_or_inf])


def _halfway_points(kind: str) -> np.ndarray:
    """The f32 midpoints between each pair of neighbouring finite 16-bit values of one sign,
    and the f32 values one ulp either side of each midpoint."""
    kind = kind.removesuffix("_soft")
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        values = ALL_BITS.view(DTYPES[kind]).astype(np.float64)
    pos = np.sort(values[np.isfinite(values) & (values >= 0)])
    pos = np.unique(pos)  # +0 and -0 collapse
    mids = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    # Every midpoint of 16-bit neighbours is exact in f32 (11 or 8 significant bits, plus one).
    assert np.array_equal(mids.astype(np.float64), (pos[:-1] + pos[1:]) / 2)
    # and the midpoint between the largest finite value and the next (overflow threshold).
    top = pos[-1]
    step = pos[-1] - pos[-2]
    overflow_mid = np.float32(top + step / 2)
    pts = np.concatenate([mids, [overflow_mid]])
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)),
                           np.nextafter(pts, np.float32(0))])
    return np.concatenate([near, -near]).astype(np.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_rounds_halfway_points_to_even(kind):
    pts = _halfway_points(kind)
    got = _narrow(kind, pts)
    _assert_same_bits(got, _oracle_narrow(kind, pts), pts, f"narrow {kind} halfway")
    # Ties go to the even pattern: on an exact midpoint the last bit is 0 (or it overflowed).
    mids = pts[: pts.size // 6]
    tie = _narrow(kind, mids)
    assert np.all((tie & 1) == 0)


@pytest.mark.parametrize("kind", KINDS)
def test_narrow_random_f32_patterns(kind):
    rng = np.random.default_rng(1234)
    raw = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    # Add the f32 special patterns: zeros, infinities, NaNs with and without payload,
    # the smallest and largest subnormals and normals.
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                        0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7F802000, 0x00000001,
                        0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x33000000,
                        0x33000001, 0x387FC000, 0x477FF000, 0x477FEFFF], dtype=np.uint32)
    values = np.concatenate([raw, special]).view(np.float32)
    got = _narrow(kind, values)
    _assert_same_bits(got, _oracle_narrow(kind, values), values, f"narrow {kind} random")


def test_f16_conversions_use_the_instructions_only_where_the_cpu_has_them(monkeypatch):
    """With F16C the IR converts with ``fpext``/``fptrunc`` through ``half``; the soft path,
    with integer code only (both are checked bit for bit above)."""
    from ocannl.backends.cpu.backend import emit_ir
    from ocannl.backends.cpu.codegen import routine_ir
    from ocannl.ir.lowering import lower, nodes_of

    x = T.term(output_dims=(4,), label="x", prec="f16")
    y = T.cast(T.cast(x, "f32") * 2.0, "f16")
    code = lower(y.forward_comp(), PRODUCTS)
    hw = "".join(routine_ir(code, nodes_of(code), replace(PRODUCTS, hardware_f16=True)))
    assert "to half" in hw
    soft = "".join(routine_ir(code, nodes_of(code), replace(PRODUCTS, hardware_f16=False)))
    assert "half" not in soft
    monkeypatch.setenv("OCANNL_SOFT_F16", "1")  # the setting reaches this process's target
    assert "half" not in "".join(emit_ir(code, nodes_of(code)))


# --- the interpreter as the oracle ---------------------------------------------------------------


def _on_cpu(code: list, values: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """``code`` compiled and run by the CPU backend on fresh buffers holding ``values``."""
    backend = CpuBackend()
    nodes = nodes_of(code)
    bufs = {n.id: backend.alloc(n) for n in nodes}
    for n in nodes:
        backend.write(n, bufs[n.id], values[n.id].reshape(-1))
    compiled, _ = backend.compile("corpus", code, nodes)
    backend.bind(compiled, tuple(bufs[n.id] for n in nodes))()
    return {n.id: backend.read(n, bufs[n.id]).reshape(n.dims) for n in nodes}


@pytest.mark.parametrize("name", sorted(corpus.BUILDERS))
def test_the_lowering_corpus_runs_as_the_interpreter_runs_it(name, monkeypatch):
    """Bit for bit with the interpreter's own products (the in-order sums: the loops and the
    inline small products compute them); where that differs, the code holds a product and
    borrowing that product from the backend's BLAS makes every node the same: only BLAS's
    order may differ, never a loop's."""
    c = corpus.BUILDERS[name]()
    got = _on_cpu(c.code, c.values)
    mine = {k: v.copy() for k, v in c.values.items()}
    lender = shadow.Lender(shadow.Tally())
    interpret.run(c.code, mine, ops=lender.ops())
    nodes = nodes_of(c.code)
    off = [n.name for n in nodes if not shadow.same(got[n.id], mine[n.id])]
    if off:
        assert any(isinstance(i, Gemm) for i in c.code), off
        mine = {k: v.copy() for k, v in c.values.items()}
        interpret.run(c.code, mine, gemm=lender.gemm, ops=lender.ops())
        off = [n.name for n in nodes if not shadow.same(got[n.id], mine[n.id])]
        assert not lender.tally.mismatches, lender.tally.mismatches
    assert not off, off


@pytest.mark.parametrize("name", sorted(corpus.BUILDERS))
def test_the_corpus_inexact_ops_are_within_their_ulp_bound(name):
    """The same corpus with the interpreter's own math functions (``ops.reference``): a node an
    inexact op writes, from nodes no inexact op wrote, is within the op's bound (beyond it, the
    error of an op depends on what follows it: a difference cancels, a product keeps it)."""
    c = corpus.BUILDERS[name]()
    got = _on_cpu(c.code, c.values)
    mine = {k: v.copy() for k, v in c.values.items()}
    lender = shadow.Lender(shadow.Tally())
    has_blas_order = any(isinstance(i, Gemm) for i in c.code)
    interpret.run(c.code, mine, gemm=lender.gemm if has_blas_order else "ordered")
    tainted: set[int] = set()
    for item in c.code:
        for nest in getattr(item, "nests", ()):
            n = nest.assign.lhs
            ops = {e.op for e in _applies(nest.assign.expr)}
            bound = max((interpret.ULP[op] for op in ops), default=0)
            if any(g.node.id in tainted for g in reads(nest.assign.expr)):
                tainted.add(n.id)
                continue
            if bound:
                tainted.add(n.id)
            d = interpret.ulp_distance(got[n.id], mine[n.id])
            assert int(d.max()) <= bound, (n.name, sorted(ops), int(d.max()))


def _applies(e):  # noqa: ANN001, ANN202
    from ocannl.ir.assignments import Apply

    if isinstance(e, Apply):
        yield e
        for a in e.args:
            yield from _applies(a)


WORKLOADS = ["mlp_small", "mlp_wide", "convnet", "gpt_mini"]
VARIANTS = ["f32", "bf16", "f16", "f16-static", "f16-gated16"]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_benchmark_step_runs_as_the_interpreter_runs_it(workload, variant, monkeypatch):
    """One training step of the workload's recipe (every routine it runs, its host gate
    included): each routine run again by the interpreter from the values it started from,
    every node it holds compared bit for bit. Borrowed from the CPU backend (as its alone, on
    the interpreter's values): each BLAS product (checked against the f64 product within
    ``2 n u sum|a||b|``, its order being BLAS's) and the math functions (``ULP``)."""
    from benchmarks.fixtures import load
    from benchmarks.runners import make_runner
    from benchmarks.specs import WORKLOADS as SPECS

    sh = shadow.Shadow(monkeypatch, lend=True)
    runner = make_runner(load(SPECS[workload]), "ocannl", variant, "cpu")
    runner.build()
    runner.step(0)
    t = sh.tally
    assert t.routines >= 1 and t.compared > 0 and t.gemms > 0
    assert not t.mismatches, t.mismatches[:10]
    assert t.exact == t.compared
    print(f"{workload} {variant}: {t.routines} routines, {t.compared} nodes, {t.exact} exact, "
          f"{t.gemms} products borrowed (worst {t.worst_gemm:.2f} of the bound), ops "
          f"{t.op_calls}")


SWEEP = np.concatenate([
    ALL_BITS.view(np.float16).astype(np.float32),
    ALL_BITS.view(ml_dtypes.bfloat16).astype(np.float32),
    np.random.default_rng(7).integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(
        np.uint32).view(np.float32),
    (np.random.default_rng(8).normal(size=1 << 16) * 4).astype(np.float32)])


def _run_op(op: str, prec: Precision, *args: np.ndarray) -> np.ndarray:
    n = args[0].size
    ins = [Tnode(f"a{k}", (n,), prec) for k in range(len(args))]
    out = Tnode(f"out_{op}", (n,), prec)
    ctx = Context.cpu()
    for t, a in zip(ins, args, strict=True):
        ctx.set_values(t, a)
    ctx, r = ctx.compile(Comp((Accum(out, (0,), "=", apply(op, *(Get(t, (0,)) for t in ins)),
                                     (n,)),)))
    ctx.run(r)
    return ctx.get_values(out)


MEASURED: dict[tuple[str, str], int] = {}


def _libm_pow(prec: Precision, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``pow`` / ``powf`` of the C library the compiled code calls, element by element. NumPy's
    ``power`` is no reference here: on an AVX-512 CPU it dispatches to its own vector kernels
    (SVML's), which differ from the C library's in the last bit for some operands (seen on an
    AMD EPYC with AVX-512)."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    c = ctypes.c_double if prec is Precision.f64 else ctypes.c_float
    fn = libm.pow if prec is Precision.f64 else libm.powf
    fn.restype, fn.argtypes = c, [c, c]
    return np.frompyfunc(fn, 2, 1)(x, y).astype(prec.numpy_dtype)


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
@pytest.mark.parametrize("op", sorted(OPS))
def test_each_op_is_within_its_ulp_bound_of_the_reference(op, prec):
    """Over every f16 and bf16 value (widened), 2**18 random f32 patterns and 2**16 normals
    (the second and third operands: the same values shuffled); hash operands as integers."""
    rng = np.random.default_rng(3)
    with np.errstate(all="ignore"):  # signalling NaNs among the patterns
        x = SWEEP.astype(prec.numpy_dtype)
        if op.startswith("hash"):
            x = np.floor(np.abs(x[np.isfinite(x)]) % 2.0 ** 40).astype(prec.numpy_dtype)
    args = [x] + [rng.permutation(x) for _ in range(OPS[op].arity - 1)]
    if op == "hash_xsm":
        args[1] = np.full_like(x, 23)
    with np.errstate(all="ignore"):
        want = (_libm_pow(prec, *args) if op == "pow" else
                reference(op, *args).astype(prec.numpy_dtype))
    got = _run_op(op, prec, *args)
    d = interpret.ulp_distance(got, want)
    MEASURED[(op, prec.value)] = int(d.max())
    print(f"{op} {prec.value}: max {int(d.max())} ulp, {int((d > 0).sum())} of {d.size} differ")
    assert int(d.max()) <= interpret.ULP[op], (op, prec.value, int(d.max()))


# --- moved from tests/ir: what the renderer makes of lowered code ---------------------------------

import test_ops as op_tests  # noqa: E402
from test_im2col import Conv, _values  # noqa: E402
from test_lowering import _matmul  # noqa: E402

from ocannl import train  # noqa: E402
from ocannl.backends.cpu.backend import emit_ir  # noqa: E402
from ocannl.backends.cpu.codegen import signature  # noqa: E402
from ocannl.ir import lowering  # noqa: E402
from ocannl.ir.lowering import LoopGroup, lower  # noqa: E402


@pytest.fixture
def any_size(monkeypatch):
    """im2col wherever a GEMM is recognised, however small."""
    monkeypatch.setattr(lowering, "IM2COL_MIN_INNER", 1)
    monkeypatch.setattr(lowering, "IM2COL_MIN_REUSE", 0)


def test_products_call_blas_only_past_the_small_product_size(monkeypatch):
    x = T.term(np.random.default_rng(0).normal(size=(64, 32)), label="x")
    w1 = T.param("w1", output_dims=[48])
    w2 = T.param("w2", output_dims=[16])
    code = lower(train.grad_update(T.sum(w2 @ T.relu(w1 @ x))), PRODUCTS)
    assert sum(isinstance(i, Gemm) for i in code) == 5
    text = "".join(emit_ir(code, nodes_of(code)))
    assert 'call void @"ocannl_sgemm"' not in text  # all five are small: inline loops
    code = lower(train.grad_update(T.sum(w2 @ T.relu(w1 @ x))),
                 replace(PRODUCTS, inline_product_work=0))
    assert all(i.kernel == "blas" for i in code if isinstance(i, Gemm))
    text = "".join(emit_ir(code, nodes_of(code)))
    assert text.count('call void @"ocannl_sgemm"') == 5


def test_sources_name_buffers_by_position():
    """The same code over other nodes of the same dims is the same IR (so it is reused)."""
    acc1, *_ = _matmul(5, 6, 7)
    acc2, *_ = _matmul(5, 6, 7)
    code1, code2 = lower(Comp((acc1,)), PRODUCTS), lower(Comp((acc2,)), PRODUCTS)
    assert emit_ir(code1, nodes_of(code1)) == emit_ir(code2, nodes_of(code2))
    acc3, *_ = _matmul(5, 6, 8)
    code3 = lower(Comp((acc3,)), PRODUCTS)
    assert emit_ir(code3, nodes_of(code3))[0] != emit_ir(code1, nodes_of(code1))[0]
    # the disk cache's key is made from the same things, without building the IR
    sig = [signature(c, nodes_of(c), Target(hardware_f16=True)) for c in (code1, code2, code3)]
    assert sig[0] == sig[1] != sig[2]
    # soft f16 conversions
    assert signature(code1, nodes_of(code1), Target(hardware_f16=False)) != sig[0]


def _attention_step(version: str, monkeypatch, tmp_path, held: bool):  # noqa: ANN202
    """One training step of a small attention block: its loss, parameters and context. ``held``
    False lowers without registers (and compiles apart: another code version, cache dir)."""
    from ocannl import nn_blocks, optim
    from ocannl.backends.cpu import codegen
    from ocannl.ir import schedule

    monkeypatch.setattr(codegen, "_VERSION", codegen._VERSION + version)
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    if not held:
        monkeypatch.setattr(schedule, "in_registers", lambda code: code)
    T.set_seed(2)
    x = T.term(np.random.default_rng(2).normal(size=(3, 6, 8)).astype(np.float32), label="xa",
               batch_dims=(3, 6), output_dims=(8,))
    y, _ = nn_blocks.multi_head_attention(x, num_heads=2, d_k=4, causal=True)
    loss = T.sum(y * y)
    ctx = train.init_params(Context.cpu(), loss)
    comp = train.grad_update(loss) + optim.Adam(1e-2).update(loss)
    code = ctx.lower(comp)
    ctx, step = ctx.compile(comp)
    ctx.run(step)
    monkeypatch.undo()
    return loss, ctx, code


def test_pointwise_chains_hand_values_over_in_registers_with_the_same_bits(monkeypatch,
                                                                           tmp_path):
    """The scores' gradient through attention's mask and scale is a chain of local pointwise
    nodes in one group: only its last value is stored. The step's bits are those of storing
    every node."""
    loss, ctx, code = _attention_step("-held", monkeypatch, tmp_path, held=True)
    held = {i for item in code if isinstance(item, LoopGroup) for i in item.registers}
    names = {n.id: n.label for n in nodes_of(code)}
    assert any(names[i].startswith("grad_where") for i in held), sorted(names[i] for i in held)
    for item in code:
        for i in getattr(item, "registers", ()):  # local, written and read in this group only
            assert names[i] and all(
                i not in {n.id for n in nodes_of([other])} for other in code if other is not item)
    ref_loss, ref_ctx, ref_code = _attention_step("-stored", monkeypatch, tmp_path, held=False)
    assert not any(getattr(item, "registers", ()) for item in ref_code)
    assert ctx.get_values(loss).tobytes() == ref_ctx.get_values(ref_loss).tobytes()
    for p, q in zip(loss.params, ref_loss.params, strict=True):
        assert ctx.get_values(p).tobytes() == ref_ctx.get_values(q).tobytes(), p.label


def _linear_step(version: str, monkeypatch, tmp_path, alias: bool):  # noqa: ANN202
    """One SGD step of a two-layer MLP: its loss, the parameters, the context, the code.
    ``alias`` False lowers without dropping copies (compiled apart)."""
    from ocannl import nn_blocks
    from ocannl.backends.cpu import codegen

    monkeypatch.setattr(codegen, "_VERSION", codegen._VERSION + version)
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    if not alias:
        monkeypatch.setattr(lowering, "_alias_copies", lambda code: code)
    T.set_seed(5)
    x = T.term(np.random.default_rng(5).normal(size=(16, 12)).astype(np.float32), label="xl",
               batch_dims=(16,), output_dims=(12,))
    y, _ = nn_blocks.mlp(x, (20,), 4, label="al")
    loss = T.sum(y * y)
    ctx = train.init_params(Context.cpu(), loss)
    comp = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.01)
    code = ctx.lower(comp)
    ctx, step = ctx.compile(comp)
    ctx.run(step)
    monkeypatch.undo()
    return loss, ctx, code


def test_a_gradient_copied_whole_is_read_where_it_is_with_the_same_bits(monkeypatch, tmp_path):
    """A bias add hands its gradient to the product's unchanged: the copy is dropped and the
    product's readers (its GEMMs) read the addition's gradient. The step's bits stay."""
    loss, ctx, code = _linear_step("-alias", monkeypatch, tmp_path, alias=True)
    ref_loss, ref_ctx, ref_code = _linear_step("-copy", monkeypatch, tmp_path, alias=False)

    def copies(code: list) -> list[str]:
        return [n.assign.lhs.label for item in code if isinstance(item, LoopGroup)
                for n in item.nests if isinstance(n.assign.expr, Get)
                and n.assign.lhs.label.startswith("grad_matmul")]

    assert copies(ref_code) and not copies(code)
    written = {n.id for item in code for n in nodes_of([item])}
    assert not any(n.label.startswith("grad_matmul") for n in nodes_of(code)), written
    assert ctx.get_values(loss).tobytes() == ref_ctx.get_values(ref_loss).tobytes()
    for p, q in zip(loss.params, ref_loss.params, strict=True):
        assert ctx.get_values(p).tobytes() == ref_ctx.get_values(q).tobytes(), p.label


def test_f16_patches_convert_plainly_with_the_bits_of_exact_copies(any_size, monkeypatch,
                                                                   tmp_path):
    """Patches only a product reads convert 16-bit values with the plain instructions, not
    the copy that keeps a signalling NaN's bits (``schedule.products_only``, decided into
    ``LoopNest.keeps_payload``): the product quiets a NaN either way, so the output has the
    same bits, signalling NaN in the image or not."""
    from ocannl.ir import schedule

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1, Precision.f16)
    comp = Comp((cv.forward(),))
    code = lower(comp, Target(batched_gemm=False))
    [patches] = [n for n in nodes_of(code) if n.name.startswith(f"{cv.x.name}_patches_")]
    assert patches.id in schedule.products_only(code)  # (with the kernel's f32 copy)
    [copy] = [n for item in code if isinstance(item, LoopGroup) for n in item.nests
              if n.assign.lhs.id == patches.id]
    assert not copy.keeps_payload

    def run(plain: bool) -> bytes:
        if not plain:
            monkeypatch.setattr(schedule, "products_only", lambda code: frozenset())
        code = lower(comp, Target(batched_gemm=False))
        backend = CpuBackend()
        nodes = nodes_of(code)
        bufs = {n.id: backend.alloc(n) for n in nodes}
        for n, v in _values(cv, 4).items():
            backend.write(n, bufs[n.id], np.asarray(v, np.float64).reshape(-1))
        bits = bufs[cv.x.id].view(np.uint16)
        bits[5], bits[40] = 0x7C01, 0xFE03  # a signalling NaN, a negative quiet one
        compiled, _ = backend.compile(comp.label, code, nodes)
        backend.bind(compiled, tuple(bufs[n.id] for n in nodes))()
        monkeypatch.undo()
        monkeypatch.setattr(lowering, "IM2COL_MIN_INNER", 1)
        monkeypatch.setattr(lowering, "IM2COL_MIN_REUSE", 0)
        monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
        return bufs[cv.y.id].tobytes()

    plain = run(True)
    assert np.isnan(np.frombuffer(plain, np.float16)).any()
    assert plain == run(False)


def _run_ops_on_cpu(ops: list[str], prec: Precision, *args: np.ndarray) -> dict[str, np.ndarray]:
    """``test_ops._run_ops`` on the CPU backend: every op in one generated routine."""
    comp, ins, outs = op_tests._comp(ops, prec, args[0].size)
    ctx = Context.cpu()
    for t, a in zip(ins, args, strict=True):
        ctx.set_values(t, a)
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    return {op: ctx.get_values(outs[op]) for op in ops}


@pytest.mark.parametrize("check", ["test_unary_op_semantics[f32]", "test_unary_op_semantics[f64]",
                                   "test_binary_op_semantics[f32]",
                                   "test_binary_op_semantics[f64]", "test_where_is_a_select",
                                   "test_nan_and_infinities_propagate_like_torch"])
def test_the_op_semantics_checks_on_the_cpu_code(check, monkeypatch):
    """The op table's checks (``tests/ir/test_ops.py``: NumPy on special values, ``where`` a
    select, NaN and infinities as PyTorch's) with the ops run by the CPU backend's code."""
    monkeypatch.setattr(op_tests, "_run_ops", _run_ops_on_cpu)
    name, _, prec = check.partition("[")
    args = [Precision(prec.rstrip("]"))] if prec else []
    getattr(op_tests, name)(*args)


# --- loop shapes scheduling chose --------------------------------------------------------------


def _special_values(n: int, prec: Precision, seed: int) -> np.ndarray:
    """``n`` values of ``prec`` with infinities, NaN, signed zeros and subnormals among them."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=n) * 3.0
    specials = [np.inf, -np.inf, np.nan, 0.0, -0.0, 6e-8, -3e-5, 65504.0]
    v[:min(n, len(specials))] = specials[:n]
    return stored(v, prec)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_group_of_same_cell_nests_is_one_loop_over_the_cells(threads, monkeypatch):
    """Pointwise nests that read and write every node at the point's own cell walk the cells
    in one loop (``LoopGroup.flat``; shared over threads by ranges of cells), with the bits of
    the interpreter's point by point run, on short odd extents and on special values; a group
    reading another cell (a transposed read) keeps its nested loops."""
    from ocannl.ir import schedule

    monkeypatch.setattr(schedule, "FLAT_PARALLEL_CELLS", 64)  # 255 cells: cut into ranges
    dims = (3, 5, 17)
    a, b = Tnode("fa", dims, Precision.f16), Tnode("fb", dims, Precision.f32)
    c, d = Tnode("fc", dims, Precision.bf16), Tnode("fd", (17, 5, 3), Precision.f32)
    same = tuple(range(3))
    comp = Comp((
        Accum(c, same, "=", apply("add", apply("relu", apply("mul", Get(a, same), Get(b, same))),
                                  Get(a, same)), dims),
        Accum(b, same, "=", apply("sub", Get(c, same), Get(a, same)), dims),
        Accum(d, (2, 1, 0), "=", Get(a, same), dims),
    ))
    target = replace(CpuBackend().target, threads=threads)
    code = lower(comp, target)
    groups = [i for i in code if isinstance(i, LoopGroup)]
    flat = [g for g in groups if g.flat]
    assert flat and all(not g.flat for g in groups if g.lead.assign.lhs is d), code
    if threads > 1:
        assert all(g.split == math.prod(dims) for g in flat), flat
    values = {n.id: _special_values(n.size, n.prec, k).reshape(n.dims)
              for k, n in enumerate(nodes_of(code))}
    got = _on_cpu(code, values)
    mine = {k: v.copy() for k, v in values.items()}
    interpret.run(code, mine)
    off = [n.name for n in nodes_of(code) if not shadow.same(got[n.id], mine[n.id])]
    assert not off, off


def test_a_scatter_into_zeroed_16_bit_storage_zeroes_its_f32_copy_instead():
    """A scatter into a 16-bit node accumulates in an f32 copy; where the node was just
    zeroed, the copy is zeroed itself (no widening pass) and the node's own fill is dropped, as
    the rounding after the scatter writes every cell of it: the interpreter's bits. A node read
    between its fill and the scatter keeps both."""
    x, g = Tnode("sx", (12,), Precision.f16), Tnode("sg", (10,), Precision.f32)
    w, r = Tnode("sw", (3,), Precision.f32), Tnode("sr", (12,), Precision.f32)
    scatter = Accum(x, (Affine(((1, 0), (1, 1))),), "+",
                    apply("mul", Get(g, (0,)), Get(w, (1,))), (10, 3))

    def run(between: tuple) -> list:
        comp = Comp((Accum(x, (0,), "=", Const(0.0), (12,)), *between, scatter))
        code = lower(comp, CpuBackend().target)
        values = {n.id: _special_values(n.size, n.prec, 3).reshape(n.dims)
                  for n in nodes_of(code)}
        values[g.id] = np.random.default_rng(1).normal(size=10).astype(np.float32)
        got = _on_cpu(code, values)
        mine = {k: v.copy() for k, v in values.items()}
        with np.errstate(invalid="ignore"):  # the weights hold infinities and NaN
            interpret.run(code, mine)
        assert not [n.name for n in nodes_of(code) if not shadow.same(got[n.id], mine[n.id])]
        return code

    code = run(())
    fills = [i for i in code if isinstance(i, Fill)]
    assert [f.node.prec for f in fills] == [Precision.f32], code
    assert not any(isinstance(i, LoopGroup) and i.conversion and i.lead.assign.lhs is not x
                   for i in code), code
    code = run((Accum(r, (0,), "=", Get(x, (0,)), (12,)),))
    assert any(isinstance(i, Fill) and i.node is x for i in code), code
