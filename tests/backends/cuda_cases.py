"""Small computations that reach every corner of the CUDA code generator: every op at every
precision with non-finite operands, every reduction strategy (serial, block, split) for ``+``
and ``max``, with and without ``reset``, narrow left-hand sides, fills, and GEMMs with 16-bit
and transposed operands that accumulate."""

from __future__ import annotations

import numpy as np

from ocannl.ir.assignments import Accum, Comp, Const, Fixed, Get, apply
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


def f64_gemm_cases(seed: int = 1) -> tuple[Comp, list[Tnode]]:
    """f64 GEMMs (cuBLAS dgemm): plain, transposed operands, accumulating. The accumulated
    output's terms cancel to a small fraction of their magnitude."""
    rng = np.random.default_rng(seed)
    f64 = Precision.f64
    a = _data("da", rng.normal(size=(33, 70)) * 4, f64)
    bt = _data("dbt", rng.normal(size=(45, 70)) * 2, f64)  # read transposed
    at = _data("dat", rng.normal(size=(70, 33)), f64)  # read transposed
    b = _data("db", rng.normal(size=(70, 45)), f64)
    c = _data("dc", rng.normal(size=(33, 45)) * 50, f64)
    out = Tnode("dout", (33, 45), f64)
    space = (33, 45, 70)
    code = (
        Accum(out, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(bt, (1, 2))), space,
              reset=True),
        Accum(c, (0, 1), "+", apply("mul", Get(at, (2, 0)), Get(b, (2, 1))), space),
    )
    return Comp(code, "gemms_f64"), [out, c]


def thin_gemm_cases(seed: int = 2) -> tuple[Comp, list[Tnode]]:
    """GEMMs with one row or one column (a matrix-vector product either way, as a vector or as
    a 1 x n / n x 1 matrix), stored plain or transposed, at f32, f16 and f64, resetting or
    accumulating: the shapes where cuBLAS's leading dimensions are degenerate."""
    rng = np.random.default_rng(seed)
    f32, f16, f64 = Precision.f32, Precision.f16, Precision.f64
    k, n, m = 300, 48, 40
    code, outs = [], []
    for prec in (f32, f16, f64):
        p = prec.value
        x = _data(f"x_{p}", rng.normal(size=k), prec)
        row = _data(f"row_{p}", rng.normal(size=(1, k)), prec)
        w = _data(f"w_{p}", rng.normal(size=(k, n)), prec)
        wt = _data(f"wt_{p}", rng.normal(size=(n, k)), prec)  # read transposed
        a = _data(f"a_{p}", rng.normal(size=(m, k)), prec)
        at = _data(f"at_{p}", rng.normal(size=(k, m)), prec)  # read transposed
        col = _data(f"col_{p}", rng.normal(size=(k, 1)), prec)
        cases = [
            (Tnode(f"xw_{p}", (n,), prec), (1,), apply("mul", Get(x, (0,)), Get(w, (0, 1))),
             (k, n), True),
            (_data(f"xwt_{p}", rng.normal(size=n), prec), (1,),
             apply("mul", Get(x, (0,)), Get(wt, (1, 0))), (k, n), False),
            (Tnode(f"roww_{p}", (1, n), prec), (0, 1),
             apply("mul", Get(row, (0, 2)), Get(w, (2, 1))), (1, n, k), True),
            (_data(f"ax_{p}", rng.normal(size=m), prec), (0,),
             apply("mul", Get(a, (0, 1)), Get(x, (1,))), (m, k), False),
            (Tnode(f"atx_{p}", (m,), prec), (0,), apply("mul", Get(at, (1, 0)), Get(x, (1,))),
             (m, k), True),
            (_data(f"acol_{p}", rng.normal(size=(m, 1)), prec), (0, 1),
             apply("mul", Get(a, (0, 2)), Get(col, (2, 1))), (m, 1, k), False),
        ]
        for lhs, idx, expr, space, reset in cases:
            code.append(Accum(lhs, idx, "+", expr, space, reset=reset))
            outs.append(lhs)
    return Comp(tuple(code), "thin_gemms"), outs


def wide_reduction_cases(cells: int = 70_000, seed: int = 3) -> tuple[Comp, list[Tnode]]:
    """Reductions into more than 65,535 cells (the launch grid's limit): each block of a block
    reduction then covers several cells in turn, and a serial one's threads go round. A GPU
    check (the emulator would take minutes)."""
    rng = np.random.default_rng(seed)
    f32 = Precision.f32
    long_rows = _data("long_rows", rng.normal(size=(cells, 300)).astype(np.float32), f32)
    short_rows = _data("short_rows", rng.normal(size=(cells, 40)).astype(np.float32), f32)
    row_sum = Tnode("row_sum", (cells,), f32)  # block per cell (300 > SERIAL_RED_WIDE)
    row_max = Tnode("row_max", (cells,), f32)
    short_sum = _data("short_sum", rng.normal(size=cells), f32)  # serial, accumulating
    code = (
        Accum(row_sum, (0,), "+", Get(long_rows, (0, 1)), (cells, 300), reset=True),
        Accum(row_max, (0,), "max", Get(long_rows, (0, 1)), (cells, 300), reset=True),
        Accum(short_sum, (0,), "+", Get(short_rows, (0, 1)), (cells, 40)),
    )
    return Comp(code, "wide_reductions"), [row_sum, row_max, short_sum]


def long_map_cases(n: int = 17_000_000, seed: int = 4) -> tuple[Comp, list[Tnode]]:
    """Maps over more than 65,535 x 256 = 16.7M elements: a grid-stride loop goes round more
    than once. An f32 affine map and an f32 -> f16 narrowing map (exact: one rounding)."""
    rng = np.random.default_rng(seed)
    f32, f16 = Precision.f32, Precision.f16
    x = _data("long_x", rng.normal(size=n).astype(np.float32), f32)
    y = Tnode("long_y", (n,), f32)
    h = Tnode("long_h", (n,), f16)
    code = (
        Accum(y, (0,), "=", apply("add", apply("mul", Get(x, (0,)), Const(3.0)), Const(0.5)),
              (n,)),
        Accum(h, (0,), "=", Get(x, (0,)), (n,)),
    )
    return Comp(code, "long_maps"), [y, h]


# --- the ops beyond the MLP, as the tensor DSL generates them ----------------------------------


def random_cases(seed: int = 1234) -> tuple[Comp, list[Tnode], object]:
    """Counter-based draws (``Rng.uniform``) of several shapes from one generator: the same
    bits on every backend. Returns the computation, the draws and the generator."""
    import ocannl.tensor as T

    rng = T.Rng(seed, label="case_rng")
    draws = [rng.uniform(output_dims=(1,)), rng.uniform(batch_dims=(3,), output_dims=(5, 7)),
             rng.uniform(batch_dims=(2, 1), output_dims=(33,), input_dims=(4,))]
    comp = Comp.seq([d.forward_comp() for d in draws], "random_draws")
    return comp, [d.value for d in draws], rng


def beyond_mlp_cases(prec: str = "f32", seed: int = 0, *,
                     full: bool = True) -> tuple[Comp, object, list[tuple]]:
    """A training step (forward and backprop) through the ops and blocks beyond the MLP:
    embedding of class ids, causal multi-head attention (its softmax), dropout, layer and batch
    norm, where / comparisons / minimum / maximum / min / abs / erf / tanh-gelu, and
    cross-entropy; ``full`` runs the attention inside a pre-norm decoder block (layer norms,
    exact-gelu MLP, two dropouts) -- about twice the code, which the CPU backend takes minutes
    to compile. Returns the computation, the loss, and the (parameter, values) pairs to set."""
    import ocannl.tensor as T
    from ocannl import nn_blocks, train

    rng_np = np.random.default_rng(seed)
    batch, seq, vocab, d = 2, 3, 5, 4
    ids = T.class_ids(rng_np.integers(0, vocab, size=(batch, seq)), num_classes=vocab,
                      label="case_ids")
    targets = T.class_ids(rng_np.integers(0, vocab, size=(batch, seq)), num_classes=vocab,
                          label="case_targets")
    drop = T.Rng(seed + 1, label="case_dropout")
    h, _ = nn_blocks.embedding(ids, vocab=vocab, dim=d, label="case_emb", prec=prec)
    if full:
        h, _ = nn_blocks.decoder_block(h, num_heads=2, d_ff=6, dropout_rate=0.25, train=True,
                                       rng=drop, label="case_dec")
    else:
        a, _ = nn_blocks.multi_head_attention(h, num_heads=2, d_k=2, causal=True,
                                              label="case_attn")
        h, _, _ = nn_blocks.layer_norm(h + nn_blocks.dropout(a, rate=0.25, train=True, rng=drop),
                                       label="case_ln")
    h, _ = nn_blocks.batch_norm(h, train=True, label="case_bn")
    a = T.where(T.gt(h, 0.0), T.minimum(h, 1.5), T.maximum(h, -1.5) * 0.5)
    a = a + T.abs(h) * T.erf(h) + T.gelu(h, approximate="tanh") - T.min(h, "output",
                                                                         keepdims=True)
    a = a * T.le(T.lt(h, 2.0), T.ge(h, -2.0)) + T.eq(h, h) - T.ne(h, h)
    logits, _ = nn_blocks.mlp(a, [], vocab, label="case_head", prec=prec)
    loss = nn_blocks.cross_entropy(logits, targets)
    values = []
    for p in loss.params:
        fan_in = int(np.prod(p.shape.input or (1,)))
        v = rng_np.uniform(-1.0, 1.0, p.dims) / np.sqrt(fan_in)
        values.append((p, v + (1.0 if "gamma" in p.label else 0.0)))
    return train.grad_update(loss), loss, values
