"""The op table (``ocannl.ir.ops``): precisions, promotion, and the scalar meaning of every op
as the reference interpreter computes it, against NumPy on ordinary and special values (zeros,
infinities, NaN: NaN and infinities must propagate as in PyTorch). ``test_cpu_render.py`` runs
the same checks on the CPU backend's code."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
import torch

from ocannl import Precision
from ocannl.backends.cpu.backend import storage_dtype
from ocannl.ir import interpret
from ocannl.ir.assignments import Accum, Comp, Const, Get, apply
from ocannl.ir.lowering import lower
from ocannl.ir.ops import ACCUMS, OPS, precision_of, promote, reference
from ocannl.ir.tnode import Tnode

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, 1e-3, 60.0, -60.0, 1e30, np.inf, -np.inf,
           np.nan]
EXACT = {"add", "sub", "mul", "div", "max", "eq", "gt", "neg", "relu", "isfinite", "where"}
UNARY = [name for name, op in OPS.items() if op.arity == 1]
BINARY = [name for name, op in OPS.items() if op.arity == 2]


def test_op_table_is_complete():
    """Every op the DSL needs has a C template, an LLVM IR builder (the CPU backend's, in
    ``cpu/scalar.py``) and a NumPy reference."""
    from ocannl.backends.cpu.scalar import IR_OPS as LLVM_OPS

    needed = {"add", "sub", "mul", "div", "pow", "max", "eq", "gt", "neg", "relu", "exp", "log",
              "tanh", "sigmoid", "sqrt", "isfinite", "where"}
    assert needed <= set(OPS)
    x = np.array([1.5, -2.0])
    for name, op in OPS.items():
        assert op.arity in (1, 2, 3)
        for k in range(op.arity):
            assert "{" + str(k) + "}" in op.c, (name, op.c)
        assert name in LLVM_OPS, name
        assert reference(name, *[x] * op.arity).shape == x.shape
    assert set(LLVM_OPS) == set(OPS)
    assert set(ACCUMS) == {"=", "+", "max"}


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
    interpret.run(lower(comp), values)
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
