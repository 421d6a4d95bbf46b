"""bf16 stores of values bf16 already represents (``schedule.representable``, decided into
``LoopNest.exact_store``): the generated
code keeps their top half instead of rounding them, and every bit, NaN included, must still
be what rounding gives. Oracle: the op in NumPy f32, rounded by ml_dtypes, over every bf16
pattern; the values that need rounding (an f32 operand, a constant bf16 lacks, a product by
3) are in the same routines, so a rule that let them through unrounded would fail here."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from ocannl import Context
from ocannl.backends.cpu import codegen
from ocannl.ir import lowering, ops, schedule
from ocannl.ir.assignments import Accum, Comp, Const, Expr, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode, Tnode

N = 1 << 16
BF16 = np.dtype(ml_dtypes.bfloat16)


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every bf16 pattern; the same patterns in another order; f32 values bf16 lacks, with
    the special ones."""
    x = np.arange(N, dtype=np.uint32).astype(np.uint16).view(BF16)
    x2 = np.random.default_rng(7).permutation(x)
    w = np.random.default_rng(8).standard_normal(N).astype(np.float32) * 100
    w[:8] = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e38]
    return x, x2, w


def _oracle(f32: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return f32.astype(np.float32).astype(BF16).view(np.uint16)


def _cases(x: Tnode, x2: Tnode, w: Tnode) -> dict[str, tuple[Expr, bool]]:
    """name -> (expression, whether bf16 represents its value exactly)."""
    gx, gx2, gw = Get(x, (0,)), Get(x2, (0,)), Get(w, (0,))
    return {
        "relu": (apply("relu", gx), True),
        "neg": (apply("neg", gx), True),
        "abs": (apply("abs", gx), True),
        "max": (apply("max", gx, gx2), True),
        "min_const": (apply("min", gx, Const(-1.0)), True),
        "where": (apply("where", apply("gt", gx, Const(0.0)), gx, gx2), True),
        "relu_grad": (apply("mul", gx2, apply("gt", gx, Const(0.0))), True),
        "times_minus_one": (apply("mul", Const(-1.0), gx), True),
        "times_zero": (apply("mul", gx, Const(0.0)), True),
        "flag": (apply("isfinite", gw), True),
        "relu_f32": (apply("relu", gw), False),
        "max_const": (apply("max", gx, Const(0.3)), False),
        "times_three": (apply("mul", gx, Const(3.0)), False),
        "where_f32": (apply("where", apply("gt", gx, Const(0.0)), gx, gw), False),
        "add": (apply("add", gx, gx2), False),
    }


def _numpy(e: Expr, values: dict[int, np.ndarray]) -> np.ndarray:
    if isinstance(e, Const):
        return np.full(N, e.value, np.float32)
    if isinstance(e, Get):
        return values[e.node.id]
    return ops.reference(e.op, *(_numpy(a, values) for a in e.args)).astype(np.float32)


def _run(comp: Comp, inputs: dict[Tnode, np.ndarray], outs: list[Tnode]) -> list[np.ndarray]:
    ctx = Context.cpu()
    for node, values in inputs.items():
        ctx.set_values(node, values)
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    return [ctx.get_values(o).view(np.uint16) for o in outs]


def test_bf16_stores_of_representable_values_keep_rounding_s_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x, x2, w = (Tnode(n, (N,), p) for n, p in
                (("x", Precision.bf16), ("x2", Precision.bf16), ("w", Precision.f32)))
    cases = _cases(x, x2, w)
    outs = [Tnode(name, (N,), Precision.bf16) for name in cases]
    comp = Comp(tuple(Accum(o, (0,), "=", e, (N,))
                      for o, (e, _) in zip(outs, cases.values(), strict=True)))
    hx, hx2, hw = _inputs()
    inputs = {x: hx, x2: hx2, w: hw}
    got = _run(comp, inputs, outs)
    # The same routine with every store rounding (a code version of its own: another key).
    monkeypatch.setattr(codegen, "_VERSION", codegen._VERSION + " every store rounds")
    monkeypatch.setattr(schedule, "representable", lambda *_: False)
    rounded = _run(comp, inputs, outs)
    host = {x.id: hx.astype(np.float32), x2.id: hx2.astype(np.float32), w.id: hw}
    for name, e, bits, want_bits in zip(cases, (e for e, _ in cases.values()), got, rounded,
                                        strict=True):
        bad = np.nonzero(bits != want_bits)[0]
        assert bad.size == 0, (f"{name}: {bad.size} patterns differ from rounding's, e.g. "
                               f"x={hx.view(np.uint16)[bad[0]]:#x} got {bits[bad[0]]:#x} "
                               f"want {want_bits[bad[0]]:#x}")
        # And both are NumPy's f32 result rounded by ml_dtypes (a NaN's sign aside: LLVM may
        # make a product by -1 a negation).
        want = _oracle(_numpy(e, host))
        nan = np.isnan(want.view(BF16))
        np.testing.assert_array_equal(np.isnan(bits.view(BF16)), nan, err_msg=name)
        np.testing.assert_array_equal(bits[~nan], want[~nan], err_msg=name)


def test_the_rule_calls_exact_only_what_bf16_represents() -> None:
    x, x2, w = (Tnode(n, (4,), p) for n, p in
                (("x", Precision.bf16), ("x2", Precision.bf16), ("w", Precision.f32)))
    for name, (e, representable) in _cases(x, x2, w).items():
        assert schedule.representable(e, Precision.bf16) is representable, name
    # f16 and bf16 represent different values: a bf16 read is not exact in f16.
    assert not schedule.representable(Get(x, (0,)), Precision.f16)


def test_a_rounded_twin_read_by_a_pointwise_nest_rounds_the_wide_node() -> None:
    """A bf16 twin of an f32 node, local and read once, is not stored: lowering makes it
    virtual, its reader reading the f32 node rounded (``Get.rounded``, rendered through
    ``round_to``). The bits are the stored twin's."""
    n = 4096
    w = Tnode("w", (n,), Precision.f32)
    twin = Tnode("w_bf16", (n,), Precision.bf16, memory_mode=MemoryMode.local)
    x = Tnode("x", (n,), Precision.bf16)
    y = Tnode("y", (n,), Precision.bf16)
    comp = Comp((Accum(twin, (0,), "=", Get(w, (0,)), (n,)),
                 Accum(y, (0,), "=", apply("add", Get(twin, (0,)), Get(x, (0,))), (n,))))
    code = lowering.lower(comp, Target())
    assert twin.id not in {n.id for n in lowering.nodes_of(code)}
    [group] = code
    assert group.lead.assign.expr.args[0].rounded is Precision.bf16
    rng = np.random.default_rng(3)
    hw = (rng.standard_normal(n) * 10).astype(np.float32)
    hw[:6] = [np.nan, -np.nan, np.inf, 3.3895314e38, -1e-40, 1.00390625]  # overflow, tie
    hx = (rng.standard_normal(n)).astype(BF16)
    ctx = Context.cpu().set_values(w, hw).set_values(x, hx)
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    want = _oracle(hw.astype(BF16).astype(np.float32) + hx.astype(np.float32))
    np.testing.assert_array_equal(ctx.get_values(y).view(np.uint16), want)


@pytest.mark.parametrize("prec", [Precision.f16, Precision.bf16])
def test_an_exact_value_held_in_registers_is_read_as_computed(
        prec: Precision, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-bit node a group hands over in registers (``LoopGroup.registers``) whose value its
    precision represents (a relu's gradient: a 16-bit read times a 0/1 mask) is read by the
    group's later nests as computed: no narrowing and widening back (f16's two conversions a
    cell). Every 16-bit pattern: the f32 copy and the 16-bit sum read from it have rounding's
    bits, a NaN's payload aside (unspecified in registers), and the rendered group converts
    to 16 bits only for the sum's store."""
    dtype = np.dtype(np.float16) if prec is Precision.f16 else BF16
    x, x2 = (Tnode(n, (N,), prec) for n in ("x", "x2"))
    held = Tnode("held", (N,), prec, memory_mode=MemoryMode.local)
    wide, out = Tnode("wide", (N,), Precision.f32), Tnode("out", (N,), prec)
    gx, gx2, gh = Get(x, (0,)), Get(x2, (0,)), Get(held, (0,))
    comp = Comp((Accum(held, (0,), "=", apply("mul", gx2, apply("gt", gx, Const(0.0))), (N,)),
                 Accum(wide, (0,), "=", gh, (N,)),
                 Accum(out, (0,), "=", apply("add", gh, gx), (N,))))
    [group] = lowering.lower(comp, Target(hardware_f16=True))
    assert group.registers == frozenset({held.id}) and group.nests[0].exact_store
    hx = np.arange(N, dtype=np.uint32).astype(np.uint16).view(dtype)
    hx2 = np.random.default_rng(9).permutation(hx)
    inputs = {x: hx, x2: hx2}

    def run() -> tuple[np.ndarray, np.ndarray, str]:
        ctx = Context.cpu()
        for node, values in inputs.items():
            ctx.set_values(node, values)
        ctx, routine = ctx.compile(comp)
        ctx.run(routine)
        code = lowering.lower(comp, Target(hardware_f16=True))
        text = "".join(codegen.routine_ir(code, lowering.nodes_of(code),
                                          Target(hardware_f16=True)))
        return ctx.get_values(wide), ctx.get_values(out).view(np.uint16), text

    got_wide, got_out, text = run()
    monkeypatch.setattr(codegen, "_VERSION", codegen._VERSION + " every store rounds")
    monkeypatch.setattr(schedule, "representable", lambda *_: False)
    want_wide, want_out, rounding_text = run()
    for got, want in ((got_wide, want_wide), (got_out.view(dtype), want_out.view(dtype))):
        nan = np.isnan(want.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(got[~nan].view(f"u{got.itemsize}"),
                                      want[~nan].view(f"u{want.itemsize}"))
    # And both are NumPy's: the masked value is exact, the sum rounded once.
    with np.errstate(all="ignore"):
        masked = hx2.astype(np.float32) * (hx.astype(np.float32) > 0)
        want = (masked + hx.astype(np.float32)).astype(dtype)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(got_out.view(dtype)[~nan].view(np.uint16),
                                  want[~nan].view(np.uint16))
    narrowings = {"f16": "to half", "bf16": "lshr"}[prec.value]
    assert text.count(narrowings) < rounding_text.count(narrowings)
