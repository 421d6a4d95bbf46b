"""The op table (``ocannl.ir.ops``): precisions, promotion, every row complete and consistent;
the scalar meaning of every op as the reference interpreter computes it, against NumPy on
ordinary and special values (zeros, infinities, NaN: NaN and infinities must propagate as in
PyTorch; ``test_cpu_render.py`` runs the same checks on the CPU backend's code); each row's LLVM
builder against its NumPy reference within its row's ulps (over every 16-bit pattern, a sweep
of f32 patterns and random f64 ones); the rows' lane and representability flags against what
the code does."""

from __future__ import annotations

import inspect
import itertools

import ml_dtypes
import numpy as np
import pytest
import torch

import ocannl.tensor as T
from ocannl import Context, Precision
from ocannl.backends.cpu.backend import storage_dtype
from ocannl.backends.cpu.op_builders import BUILDERS
from ocannl.backends.emit import C_TEMPLATES
from ocannl.ir import interpret
from ocannl.ir.assignments import Accum, Apply, Comp, Const, Get, apply
from ocannl.ir.lowering import lower
from ocannl.ir.ops import ACCUMS, OPS, precision_of, promote, reference
from ocannl.ir.target import PRODUCTS
from ocannl.ir.tnode import Tnode

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 1e-3, 60.0, -60.0, 1e30, np.inf, -np.inf,
           np.nan]
EXACT = {"add", "sub", "mul", "div", "max", "eq", "gt", "neg", "relu", "isfinite", "where"}
UNARY = [name for name, op in OPS.items() if op.arity == 1]
BINARY = [name for name, op in OPS.items() if op.arity == 2]


LANE_OPS = {"add", "sub", "mul", "max", "min", "relu"}  # what the renderer runs in vectors
# The DSL's differentiable pointwise functions and the ops they apply.
DIFFERENTIATED = {
    "add": T.add, "sub": T.sub, "mul": T.mul, "div": T.div, "neg": T.neg, "relu": T.relu,
    "exp": T.exp, "log": T.log, "tanh": T.tanh, "sigmoid": T.sigmoid, "sqrt": T.sqrt,
    "pow": lambda a: T.pow_const(a, 3.0), "max": T.maximum, "min": T.minimum, "abs": T.abs,
    "erf": T.erf, "where": lambda a, b: T.where(a, a, b), "cos": T.cos, "sin": T.sin,
    "floor": T.floor,
}


def _positional(f: object) -> int:
    """How many operands a callable takes (a ufunc says it itself)."""
    nin = getattr(f, "nin", None)
    if nin is not None:
        return nin
    return len([p for p in inspect.signature(f).parameters.values()
                if p.default is inspect.Parameter.empty])


def test_every_row_is_complete_and_consistent():
    """Every op's row: its arity is its reference's and its LLVM builder's
    (``op_builders.BUILDERS``, past the emitter and the compute type), its C template
    (``emit.C_TEMPLATES``) names exactly its operands, a gradient rule exactly
    where the result is differentiable (not a 0 / 1 flag, not a hash), returning one entry per
    operand, and its representability flags only where they hold (checked on values in
    ``test_flags_and_selections_hold_on_values``)."""
    needed = {"add", "sub", "mul", "div", "pow", "max", "eq", "gt", "neg", "relu", "exp", "log",
              "tanh", "sigmoid", "sqrt", "isfinite", "where"}
    assert needed <= set(OPS)
    x = np.array([1.5, -2.0])
    for name, op in OPS.items():
        assert op.name == name
        assert op.arity in (1, 2, 3)
        assert _positional(op.ref) == op.arity, name
        assert _positional(BUILDERS[name]) == op.arity + 2, name
        template = C_TEMPLATES[name]
        for k in range(4):
            assert ("{" + str(k) + "}" in template) == (k < op.arity), (name, template)
        template.format(*(f"x{k}" for k in range(op.arity)), zero="0", one="1")
        assert reference(name, *[x] * op.arity).shape == x.shape
        assert (op.grad is None) == (op.flag or name.startswith("hash_")), name
        if op.grad is not None:
            t = Tnode("t", (2,), Precision.f32)
            operands = [Get(t, (0,)) for _ in range(op.arity)]
            if name == "pow":
                operands[1] = Const(3.0)
            grads = op.grad(operands, Get(t, (0,)), Get(t, (0,)))
            assert len(grads) == op.arity, name
            assert any(d is not None for d in grads), name
        assert not (op.flag and op.selects), name
        assert op.selects is None or all(0 <= k < op.arity for k in op.selects), name
        assert op.ulps >= 0
    assert {name for name, op in OPS.items() if op.lanes} == LANE_OPS
    assert set(ACCUMS) == {"=", "+", "max"}


def test_every_op_the_dsl_differentiates_has_its_rule():
    """The ops with a gradient rule are exactly the ones the DSL's differentiable pointwise
    functions apply, and each writes a backprop assignment from it."""
    applied = set()
    for name, fn in DIFFERENTIATED.items():
        args = [T.param(f"p{k}", output_dims=(3,), input_dims=()) for k in range(2)]
        y = fn(*args[:_positional(fn)])
        (assign,) = y.forward_code
        assert isinstance(assign.expr, Apply) and assign.expr.op == name
        assert y.backprop_code, name
        applied.add(assign.expr.op)
    assert applied == {name for name, op in OPS.items() if op.grad is not None}


def test_pow_backprop_refuses_a_tensor_exponent():
    t = Tnode("t", (2,), Precision.f32)
    with pytest.raises(ValueError, match="pow: backprop needs a constant exponent"):
        OPS["pow"].grad([Get(t, (0,)), Get(t, (0,))], Get(t, (0,)), Get(t, (0,)))


def test_precisions():
    assert [p.value for p in Precision] == ["f64", "f32", "f16", "bf16"]
    assert precision_of("f16") is Precision.f16
    assert precision_of(Precision.bf16) is Precision.bf16
    assert storage_dtype(Precision.f16) == np.uint16 == storage_dtype(Precision.bf16)
    assert Precision.f16.numpy_dtype == np.float16
    assert Precision.bf16.numpy_dtype == ml_dtypes.bfloat16
    assert storage_dtype(Precision.f32) == np.float32 and Precision.f64.itemsize == 8
    assert Precision.f16.itemsize == Precision.bf16.itemsize == 2
    assert Precision.f16.compute is Precision.f32 and Precision.bf16.compute is Precision.f32
    assert Precision.f64.compute is Precision.f64
    assert Precision.f16.is_narrow and not Precision.f32.is_narrow


@pytest.mark.parametrize("bad", ["f8", "float32", "int8", "", None, 16])
def test_unsupported_precision_is_named(bad):
    with pytest.raises(ValueError) as err:
        precision_of(bad)
    msg = str(err.value)
    assert repr(bad) in msg
    for name in ("f64", "f32", "f16", "bf16"):
        assert name in msg


def test_promotion():
    P = Precision
    assert promote(P.f32, P.f64) is P.f64
    assert promote(P.f16, P.f32) is P.f32
    assert promote(P.bf16, P.bf16) is P.bf16
    assert promote(P.f16, P.f16) is P.f16
    assert promote(P.f16, P.bf16) is P.f32  # neither holds the other
    assert promote(P.bf16, P.f64) is P.f64


def test_ir_rejects_malformed_assignments():
    x = Tnode("x", (3,), Precision.f32)
    with pytest.raises(ValueError, match="unknown op 'frobnicate'"):
        apply("frobnicate", Get(x, (0,)))
    with pytest.raises(ValueError, match="op add takes 2 operands, got 1"):
        apply("add", Get(x, (0,)))
    with pytest.raises(ValueError, match="unknown accumulation '\\*'"):
        Accum(x, (0,), "*", Const(1.0), (3,))
    with pytest.raises(ValueError, match=r"projection \(0, 1\) has 2 indices for node x_\d+"):
        Accum(x, (0, 1), "=", Const(1.0), (3, 2))
    y = Tnode("y", (3, 2), Precision.f32)
    with pytest.raises(ValueError, match=r"projection \(0,\) has 1 indices for node y_\d+"):
        Accum(x, (0,), "=", Get(y, (0,)), (3,))


def _comp(ops: list[str], prec: Precision, n: int
          ) -> tuple[Comp, list[Tnode], dict[str, Tnode]]:
    """One assignment per op, each into its own output, over ``n`` operands of ``prec``."""
    ins = [Tnode(f"a{k}", (n,), prec) for k in range(max(OPS[op].arity for op in ops))]
    outs = {op: Tnode(f"out_{op}", (n,), prec) for op in ops}
    comp = Comp(tuple(
        Accum(outs[op], (0,), "=", apply(op, *(Get(t, (0,)) for t in ins[:OPS[op].arity])),
              (n,)) for op in ops), "ops")
    return comp, ins, outs


def _run_ops(ops: list[str], prec: Precision, *args: np.ndarray) -> dict[str, np.ndarray]:
    """Evaluate each op elementwise over equally long 1-D operands in the reference
    interpreter (the CPU renderer's tests run these tests on the backend)."""
    comp, ins, outs = _comp(ops, prec, args[0].size)
    values = {t.id: np.asarray(a, prec.numpy_dtype) for t, a in zip(ins, args, strict=True)}
    interpret.run(lower(comp, PRODUCTS), values)
    return {op: values[outs[op].id] for op in ops}


def _check(op: str, got: np.ndarray, want: np.ndarray, prec: Precision) -> None:
    assert got.dtype == prec.numpy_dtype
    assert np.array_equal(np.isnan(got), np.isnan(want)), (op, got, want)
    if op in EXACT:
        np.testing.assert_array_equal(got, want, err_msg=op)
    else:
        rtol = 1e-6 if prec is Precision.f32 else 1e-14
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=op)


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
def test_unary_op_semantics(prec):
    x = np.array(SPECIAL + list(np.linspace(-5, 5, 21)), dtype=prec.numpy_dtype)
    got = _run_ops(UNARY, prec, x)
    for op in UNARY:
        _check(op, got[op], reference(op, x), prec)


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
def test_binary_op_semantics(prec):
    pairs = np.array(list(itertools.product(SPECIAL, repeat=2)), dtype=prec.numpy_dtype)
    a, b = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    got = _run_ops(BINARY, prec, a, b)
    for op in BINARY:
        _check(op, got[op], reference(op, a, b), prec)


def test_where_is_a_select():
    """``where`` picks without multiplying: an infinity on the unpicked side leaves no NaN."""
    cond = np.array([1.0, 0.0, np.nan, 0.0, -0.0], np.float32)
    a = np.array([np.inf, np.inf, 2.0, 3.0, 4.0], np.float32)
    b = np.array([5.0, -1.0, np.nan, np.nan, 6.0], np.float32)
    got = _run_ops(["where"], Precision.f32, cond, a, b)["where"]
    np.testing.assert_array_equal(got, [np.inf, -1.0, 2.0, np.nan, 6.0])


def test_nan_and_infinities_propagate_like_torch():
    x = np.array([np.nan, np.inf, -np.inf, -1.0, 0.0, 2.0], np.float32)
    tx = torch.tensor(x)
    fns = {"relu": torch.relu, "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
           "neg": torch.neg}
    got = _run_ops(list(fns), Precision.f32, x)
    for op, tfn in fns.items():
        np.testing.assert_allclose(got[op], tfn(tx).numpy(), rtol=1e-6, atol=0, err_msg=op)
    y = np.array([1.0, np.nan, 3.0, np.inf, -np.inf, np.nan], np.float32)
    got = _run_ops(["max"], Precision.f32, x, y)["max"]
    np.testing.assert_array_equal(got, torch.maximum(tx, torch.tensor(y)).numpy())


# --- each builder against its reference, within its row's ulps --------------------------------


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in ulps (patterns as ordered integers: -0 is one from +0); two NaNs are 0
    apart, a NaN and a number infinitely."""
    int_t, uint_t = (np.int32, np.uint32) if got.dtype == np.float32 else (np.int64, np.uint64)
    g, w = got.view(int_t), want.view(int_t)
    mg, mw = (v & np.iinfo(int_t).max for v in (g, w))  # magnitudes, as integers
    same_sign = (g < 0) == (w < 0)
    with np.errstate(over="ignore"):
        apart = np.where(same_sign, np.maximum(mg, mw) - np.minimum(mg, mw),
                         mg.astype(uint_t) + mw.astype(uint_t) + uint_t(1))
    d = apart.astype(uint_t).astype(np.float64)
    d[np.isnan(got) & np.isnan(want)] = 0.0
    d[np.isnan(got) ^ np.isnan(want)] = np.inf
    return d


def _patterns(prec: Precision) -> np.ndarray:
    """f32: every f16 and every bf16 value, every 9973rd f32 bit pattern and normals; f64:
    random bit patterns, normals and every bf16 value."""
    rng = np.random.default_rng(5)
    bits16 = np.arange(1 << 16, dtype=np.uint16)
    if prec is Precision.f32:
        parts = [bits16.view(np.float16).astype(np.float32),
                 bits16.view(ml_dtypes.bfloat16).astype(np.float32),
                 np.arange(0, 1 << 32, 9973, dtype=np.uint64).astype(np.uint32)
                 .view(np.float32),
                 rng.standard_normal(100_000).astype(np.float32) * 4]
    else:
        with np.errstate(invalid="ignore"):  # ml_dtypes warns widening a NaN: it stays a NaN
            wide = bits16.view(ml_dtypes.bfloat16).astype(np.float64)
        parts = [rng.integers(-2**63, 2**63 - 1, 200_000, dtype=np.int64).view(np.float64),
                 rng.standard_normal(100_000) * 4, wide]
    return np.concatenate(parts).astype(prec.numpy_dtype)


def _operands(name: str, prec: Precision) -> list[np.ndarray]:
    """Operands for ``name``: the patterns and two shuffles of them; integers for a hash
    (below 2**24 at f32, 2**52 at f64; shifts below 64)."""
    rng = np.random.default_rng(6)
    x = _patterns(prec)
    if not name.startswith("hash_"):
        return [x, rng.permutation(x), rng.permutation(x)][:OPS[name].arity]
    top = 2**24 if prec is Precision.f32 else 2**52
    ints = [rng.integers(0, top, x.size).astype(x.dtype) for _ in range(2)]
    shifts = rng.integers(0, 64, x.size).astype(x.dtype)
    return {"hash_add": ints, "hash_xsm": [ints[0], shifts, ints[1]],
            "hash_unit": ints[:1]}[name]


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64], ids=lambda p: p.value)
def test_every_builder_is_within_its_ulps_of_its_reference(prec):
    """The generated code of every op against its row's NumPy reference: within the row's
    ``ulps`` (0: the same bits, a NaN for a NaN, the sign of a zero too)."""
    worst = {}
    for arity in (1, 2, 3):
        names = [n for n, op in OPS.items() if op.arity == arity and not n.startswith("hash_")]
        got = _run_ops(names, prec, *_operands(names[0], prec))
        for n in names:
            worst[n] = _ulps(got[n], reference(n, *_operands(n, prec))).max()
    for n in (n for n in OPS if n.startswith("hash_")):
        args = _operands(n, prec)
        worst[n] = _ulps(_run_ops([n], prec, *args)[n], reference(n, *args)).max()
    over = {n: (w, OPS[n].ulps) for n, w in worst.items() if not w <= OPS[n].ulps}
    assert not over, over


def test_flags_and_selections_hold_on_values():
    """A ``flag`` row gives only 0 and 1; a ``selects`` row gives, bit for bit, one of the
    operands it names up to sign, or a zero (relu); a ``scales`` row (the product) gives
    +-the other operand, or a zero or a NaN, when one operand is 0 or +-1."""
    prec = Precision.f32
    for arity in (1, 2, 3):
        names = [n for n, op in OPS.items() if op.arity == arity and (op.flag or op.selects)]
        args = _operands(names[0], prec)
        got = _run_ops(names, prec, *args)
        for n in names:
            v = got[n]
            if OPS[n].flag:
                assert set(np.unique(v)) <= {0.0, 1.0}, n
                continue
            bits = np.abs(v).view(np.uint32)
            hit = (v == 0) | (np.isnan(v) & np.any([np.isnan(args[k]) for k in OPS[n].selects],
                                                   axis=0))
            for k in OPS[n].selects:
                hit |= bits == np.abs(args[k]).view(np.uint32)
            assert hit.all(), (n, v[~hit][:5])
    x = _patterns(prec)
    units = np.resize(np.array([0.0, -0.0, 1.0, -1.0], np.float32), x.size)
    v = _run_ops(["mul"], prec, x, units)["mul"]
    same = np.abs(v).view(np.uint32) == np.abs(x).view(np.uint32)
    assert (same | (v == 0) | np.isnan(v)).all()
    assert [n for n, op in OPS.items() if op.scales] == ["mul"]


def test_the_lane_ops_are_the_ones_the_renderer_runs_in_vectors(monkeypatch, tmp_path):
    """A jammed reduction ``s[i, j] max= op(x[i, j, k], ...)`` runs as a vector of its cells
    exactly when its op's row says ``lanes``, and then with the bits of the cells computed one
    by one."""
    from ocannl.backends.cpu import codegen
    from ocannl.backends.cpu.backend import CpuBackend
    from ocannl.ir import schedule

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    rows, cols, terms = 2, 16, 40
    rng = np.random.default_rng(7)
    values = [rng.normal(size=(rows, cols, terms)).astype(np.float32) * 3 for _ in range(3)]
    values[0][0, 2, 3], values[1][1, 4, 5], values[2][1, 6, 7] = np.nan, np.inf, -0.0
    lanes = schedule.lanes
    decided: list[bool] = []

    def run(name: str, vector: bool) -> bytes:
        monkeypatch.setattr(codegen, "_VERSION", f"{codegen._VERSION}-{vector}")
        monkeypatch.setattr(CpuBackend, "_compiled", {})
        monkeypatch.setattr(schedule, "lanes", lambda *a: (
            decided.append(lanes(*a) is not None) or lanes(*a)) if vector else None)
        ins = [Tnode(f"v{k}", (rows, cols, terms), Precision.f32)
               for k in range(OPS[name].arity)]
        s = Tnode("s", (rows, cols), Precision.f32)
        term = apply(name, *(Get(t, (0, 1, 2)) for t in ins))
        ctx = Context.cpu()
        for t, v in zip(ins, values, strict=False):
            ctx.set_values(t, v)
        ctx, r = ctx.compile(Comp((Accum(s, (0, 1), "max", term, (rows, cols, terms), True),)))
        ctx.run(r)
        return ctx.get_values(s).tobytes()

    for name, op in OPS.items():
        if name.startswith("hash_"):
            continue
        decided.clear()
        vector = run(name, True)
        assert decided == [op.lanes], name
        if op.lanes:
            assert vector == run(name, False), name
