"""Small computations that reach every corner of the CUDA code generator: every op at every
precision with non-finite operands, every reduction strategy (serial, block, split) for ``+``
and ``max``, with and without ``reset``, narrow left-hand sides, fills, and GEMMs with 16-bit
and transposed operands that accumulate."""

from __future__ import annotations

import numpy as np

from ocannl.ir.assignments import Accum, Comp, Fixed, Get, apply
from ocannl.ir.ops import OPS, Precision
from ocannl.ir.tnode import Tnode

SPECIAL_A = [-2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf, -np.inf, np.nan, 1e-3, 60.0]
SPECIAL_B = [2.0, 0.5, 1.0, -1.0, 0.0, 3.0, -2.0, 1.0, 2.0, 1.0, 4.0, 0.25]
SPECIAL_C = [1.0, 0.0, np.nan, 2.0, 0.0, -1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def _data(label: str, values: np.ndarray, prec: Precision) -> Tnode:
    values = np.asarray(values)
    return Tnode(label, values.shape, prec, host_data=values.astype(prec.numpy_dtype))


def op_cases(prec: Precision) -> tuple[Comp, list[Tnode]]:
    """One assignment per op of the table over special values; returns the outputs."""
    n = len(SPECIAL_A)
    a = _data("a", np.array(SPECIAL_A), prec)
    b = _data("b", np.array(SPECIAL_B), prec)
    c = _data("c", np.array(SPECIAL_C), prec)
    args = [Get(a, (0,)), Get(b, (0,)), Get(c, (0,))]
    code, outs = [], []
    for name, op in OPS.items():
        out = Tnode(f"out_{name}", (n,), prec)
        ordered = [args[2], args[0], args[1]] if name == "where" else args
        code.append(Accum(out, (0,), "=", apply(name, *ordered[: op.arity]), (n,)))
        outs.append(out)
    return Comp(tuple(code), f"ops_{prec.value}"), outs


def reduction_cases(seed: int = 0) -> tuple[Comp, list[Tnode]]:
    """Reductions of every strategy; returns the written nodes."""
    rng = np.random.default_rng(seed)
    f32, f16, bf16, f64 = Precision.f32, Precision.f16, Precision.bf16, Precision.f64
    code, outs = [], []

    def add(a: Accum) -> None:
        code.append(a)
        outs.append(a.lhs)

    big = _data("big", rng.normal(size=5000), f32)  # split sum into one cell
    s = Tnode("sum_all", (), f32)
    add(Accum(s, (), "+", Get(big, (0,)), (5000,), reset=True))
    rows = _data("rows", rng.normal(size=(3, 3000)), f32)  # split max per row
    m = Tnode("max_rows", (3,), f32)
    add(Accum(m, (0,), "max", Get(rows, (0, 1)), (3, 3000), reset=True))
    cols = _data("cols", rng.normal(size=(600, 40)), f32)  # block sum, accumulating, bf16
    acc = _data("acc_cols", rng.normal(size=40), bf16)
    add(Accum(acc, (1,), "+", Get(cols, (0, 1)), (600, 40)))
    last = Tnode("last", (4,), f32)  # "=" with a reduction: the last write wins
    seq = _data("seq", np.arange(200.0).reshape(4, 50), f32)
    add(Accum(last, (0,), "=", Get(seq, (0, 1)), (4, 50)))
    filled = _data("filled", np.full((2, 5), 7.0), f32)  # reset of a partly written node
    add(Accum(filled, (Fixed(1), 1), "+", Get(seq, (Fixed(0), 0)), (50, 5), reset=True))
    nan_rows = rng.normal(size=(2, 700))
    nan_rows[1, 333] = np.nan
    nr = _data("nan_rows", nan_rows, f32)
    nm = Tnode("nan_max", (2,), f32)
    add(Accum(nm, (0,), "max", Get(nr, (0, 1)), (2, 700), reset=True))
    one = Tnode("one_cell", (1,), f32)  # an iterator over a size-1 lhs axis reduces
    add(Accum(one, (0,), "+", Get(big, (0,)), (5000,), reset=False))
    d = _data("d64", rng.normal(size=3000), f64)
    ds = Tnode("sum64", (), f64)
    add(Accum(ds, (), "+", apply("mul", Get(d, (0,)), Get(d, (0,))), (3000,), reset=True))
    h = _data("h16", rng.normal(size=70000) * 0.01, f16)
    hs = Tnode("sum16", (), f16)
    add(Accum(hs, (), "+", Get(h, (0,)), (70000,), reset=True))
    chk = Tnode("check", (), f32)  # the checksum pattern: g * 0 over a narrow gradient
    add(Accum(chk, (), "+", apply("mul", Get(h, (0,)), Get(big, (Fixed(0),))), (70000,),
              reset=True))
    bias = _data("bias_src", rng.normal(size=(4096, 8)), f32)  # bias gradient, large batch
    bg = Tnode("bias_grad", (8,), f32)
    add(Accum(bg, (1,), "+", Get(bias, (0, 1)), (4096, 8), reset=True))
    return Comp(tuple(code), "reductions"), outs


def gemm_cases(seed: int = 0) -> tuple[Comp, list[Tnode]]:
    """GEMM-shaped assignments: 16-bit and transposed operands, accumulating or resetting."""
    rng = np.random.default_rng(seed)
    f32, f16, bf16 = Precision.f32, Precision.f16, Precision.bf16
    a = _data("ga", rng.normal(size=(32, 64)), f16)
    bt = _data("gbt", rng.normal(size=(48, 64)), bf16)  # read transposed
    c = _data("gc", rng.normal(size=(32, 48)), f16)
    x = _data("gx", rng.normal(size=(64, 32)), f32)  # read transposed
    y = _data("gy", rng.normal(size=(64, 48)), f32)
    z = _data("gz", rng.normal(size=(32, 48)), f32)
    w = Tnode("gw", (32, 48), bf16)
    space = (32, 48, 64)
    code = (
        Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(bt, (1, 2))), space),
        Accum(z, (0, 1), "+", apply("mul", Get(x, (2, 0)), Get(y, (2, 1))), space),
        Accum(w, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(y, (2, 1))), space, reset=True),
    )
    return Comp(code, "gemms"), [c, z, w]


def mixed_cases() -> tuple[Comp, list[Tnode]]:
    """Ops whose operands have other precisions than the written node (an f32 node reading
    f64 / f16 / bf16 data, an f64 node reading f32 / f16 data)."""
    code, outs = [], []
    n = len(SPECIAL_A)
    for lhs_prec, (pa, pb, pc) in ((Precision.f32, (Precision.f64, Precision.f16, Precision.bf16)),
                                   (Precision.f64, (Precision.f32, Precision.f16, Precision.f32))):
        a = _data(f"a_{pa.value}", np.array(SPECIAL_A), pa)
        b = _data(f"b_{pb.value}", np.array(SPECIAL_B), pb)
        c = _data(f"c_{pc.value}", np.array(SPECIAL_C), pc)
        ga, gb, gc = Get(a, (0,)), Get(b, (0,)), Get(c, (0,))
        for name in ("add", "div", "pow", "max", "eq", "gt", "where"):
            out = Tnode(f"mixed_{name}_{lhs_prec.value}", (n,), lhs_prec)
            expr = apply(name, gc, ga, gb) if name == "where" else apply(name, ga, gb)
            code.append(Accum(out, (0,), "=", expr, (n,)))
            outs.append(out)
        s = Tnode(f"mixed_sum_{lhs_prec.value}", (), lhs_prec)
        code.append(Accum(s, (), "+", apply("mul", ga, gb), (n,), reset=True))
    return Comp(tuple(code), "mixed"), outs
