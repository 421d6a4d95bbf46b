"""Small products computed inline (``ocannl.backends.cpu.small_product``): bitwise the plain
reduction loops, for every layout of the operands, accumulating or not, batched or not."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ocannl import Context
from ocannl.backends.cpu import jit
from ocannl.ir import lowering
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.lowering import Gemm, lower
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import Tnode


def _four_layouts(prec: Precision, m: int, n: int, k: int
                  ) -> tuple[list[Accum], dict[Tnode, np.ndarray], list[Tnode]]:
    """``m x k @ k x n`` products with each operand plain or transposed, the last accumulating
    into its target (of another scale: the order shows): the assignments, the inputs, the
    targets."""
    a, at = Tnode("a", (m, k), prec), Tnode("at", (k, m), prec)
    b, bt = Tnode("b", (k, n), prec), Tnode("bt", (n, k), prec)
    outs = [Tnode(f"c{u}", (m, n), prec) for u in range(4)]

    def mm(out: Tnode, x: Get, y: Get, reset: bool = True) -> Accum:
        return Accum(out, (0, 1), "+", apply("mul", x, y), (m, n, k), reset=reset)

    accums = [mm(outs[0], Get(a, (0, 2)), Get(b, (2, 1))),
              mm(outs[1], Get(at, (2, 0)), Get(b, (2, 1))),
              mm(outs[2], Get(a, (0, 2)), Get(bt, (1, 2))),
              mm(outs[3], Get(at, (2, 0)), Get(bt, (1, 2)), reset=False)]
    rng = np.random.default_rng(m * n * k)
    inputs = {t: rng.normal(size=t.dims) for t in (a, at, b, bt, outs[3])}
    inputs[outs[3]] *= 1e3
    return accums, inputs, outs


def _products(prec: Precision) -> tuple[Comp, dict[Tnode, np.ndarray], list[Tnode]]:
    """Products with each operand plain or transposed, a row count that is not a multiple of
    the register block, one accumulating into its target, and attention's batched pair."""
    h = 3
    accums, inputs, outs = _four_layouts(prec, 7, 32, 12)
    q, kk = Tnode("q", (2, 16, h, 8), prec), Tnode("k", (2, 16, h, 8), prec)
    s = Tnode("scores", (2, h, 16, 16), prec)
    v, o = Tnode("v", (2, 16, h, 16), prec), Tnode("o", (2, 16, h, 16), prec)
    comp = Comp((
        *accums,
        # scores[b, h, i, j] = sum_d q[b, i, h, d] k[b, j, h, d]
        Accum(s, (0, 1, 2, 3), "+", apply("mul", Get(q, (0, 2, 1, 4)), Get(kk, (0, 3, 1, 4))),
              (2, h, 16, 16, 8), reset=True),
        # o[b, i, h, e] = sum_j scores[b, h, i, j] v[b, j, h, e]
        Accum(o, (0, 2, 1, 3), "+", apply("mul", Get(s, (0, 1, 2, 4)), Get(v, (0, 4, 1, 3))),
              (2, h, 16, 16, 16), reset=True),
    ))
    rng = np.random.default_rng(7)
    inputs.update({t: rng.normal(size=t.dims) for t in (q, kk, v)})
    return comp, inputs, [*outs, s, o]


def _run(comp: Comp, inputs: dict, outputs: list[Tnode]) -> list[bytes]:
    ctx = Context.cpu()
    for t, x in inputs.items():
        ctx.set_values(t, x)
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    return [ctx.get_values(t).tobytes() for t in outputs]


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64, Precision.bf16, Precision.f16])
def test_small_products_are_bitwise_the_loops(monkeypatch, prec):
    """At 16 bits the products read their right operands' buffers directly, widening as
    they load (no f32 copies of them): still the loops' bits."""
    comp, inputs, outputs = _products(prec)
    code = lower(comp, Target(im2col=False))
    gemms = [item for item in code if isinstance(item, Gemm)]
    assert len(gemms) == 6 and all(g.kernel == "inline" for g in gemms)
    if prec.is_narrow:  # the right operand as stored, the left and the target in f32 copies
        assert all(g.b.node.prec is prec and g.a.node.prec is Precision.f32
                   and g.assign.lhs.prec is Precision.f32 for g in gemms)
        blas = lower(comp, Target(im2col=False, inline_product_work=0))
        assert all(g.kernel == "blas" and g.b.node.prec is Precision.f32
                   for g in blas if isinstance(g, Gemm))
    assert {(g.a.transposed, g.b.transposed) for g in gemms} >= {
        (False, False), (True, False), (False, True), (True, True)}
    _the_loops_bits_near_blas(monkeypatch, comp, inputs, outputs, prec)


def _the_loops_bits_near_blas(monkeypatch: pytest.MonkeyPatch, comp: Comp, inputs: dict,
                              outputs: list[Tnode], prec: Precision) -> None:
    """``comp``'s products compute the plain loops' bits, and near BLAS's values (another
    order of the same sums)."""
    inline = _run(comp, inputs, outputs)
    monkeypatch.setattr(lowering, "GEMM_MIN_FLOPS", 1 << 40)  # every product a loop nest
    assert not any(isinstance(item, Gemm) for item in lower(comp, Target(im2col=False)))
    assert _run(comp, inputs, outputs) == inline
    monkeypatch.undo()
    every_product_in_blas = replace(jit.target(), inline_product_work=0)
    monkeypatch.setattr(jit, "target", lambda: every_product_in_blas)
    blas = _run(comp, inputs, outputs)
    tol = {Precision.f64: 1e-12, Precision.f32: 1e-5, Precision.bf16: 2e-2,
           Precision.f16: 3e-3}[prec]
    for x, y in zip(inline, blas, strict=True):
        got, want = (np.frombuffer(z, dtype=prec.numpy_dtype).astype(np.float64) for z in (x, y))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 1e3)


def test_batched_small_products_shared_over_threads_give_the_same_bits(monkeypatch):
    """Attention-sized batches, shared out by batch points, compute what one thread does."""
    n_batch, heads, ctx_len, d = 16, 4, 64, 32
    q = Tnode("q", (n_batch, ctx_len, heads, d), Precision.f32)
    kk = Tnode("k", (n_batch, ctx_len, heads, d), Precision.f32)
    s = Tnode("scores", (n_batch, heads, ctx_len, ctx_len), Precision.f32)
    comp = Comp((Accum(s, (0, 1, 2, 3), "+",
                       apply("mul", Get(q, (0, 2, 1, 4)), Get(kk, (0, 3, 1, 4))),
                       (n_batch, heads, ctx_len, ctx_len, d), reset=True),))
    [g] = lower(comp, Target(im2col=False))
    assert isinstance(g, Gemm) and g.b.transposed and g.kernel == "inline"
    rng = np.random.default_rng(3)
    inputs = {q: rng.normal(size=q.dims), kk: rng.normal(size=kk.dims)}
    runs = []
    for threads in (1, 2):
        monkeypatch.setattr(jit, "threads", lambda t=threads: t)
        runs.append(_run(comp, inputs, [s]))
    assert runs[0] == runs[1]
    got = np.frombuffer(runs[0][0], np.float32).reshape(s.dims)
    want = np.einsum("bihd,bjhd->bhij", *(inputs[t].astype(np.float32).astype(np.float64)
                                          for t in (q, kk)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _narrow_products(prec: Precision) -> tuple[Comp, dict[Tnode, np.ndarray], list[Tnode]]:
    """Products whose columns are no whole number of vectors (2, 9) and whose rows are (32, 8):
    each operand plain or transposed, one accumulating; and a convolution's first kernel
    gradient, 9 window offsets by 8 channels over 4,096 terms, its patches stored offsets
    first: an output too small for a library call to pay, whatever its inner length."""
    accums, inputs, outs = _four_layouts(prec, 32, 2, 40)
    grad = Tnode("grad", (4096, 8), prec)  # a convolution's output gradient, channels last
    patches = Tnode("patches", (9, 4096), prec)  # its input's patches, window offsets first
    kernel_grad = Tnode("kernel_grad", (8, 9), prec)
    comp = Comp((
        *accums,
        # kernel_grad[c, w] = sum_p grad[p, c] patches[w, p]
        Accum(kernel_grad, (0, 1), "+", apply("mul", Get(grad, (2, 0)), Get(patches, (1, 2))),
              (8, 9, 4096), reset=True),
    ))
    rng = np.random.default_rng(8)
    inputs.update({t: rng.normal(size=t.dims) for t in (grad, patches)})
    return comp, inputs, [*outs, kernel_grad]


@pytest.mark.parametrize("prec", [Precision.f32, Precision.f64, Precision.f16])
def test_products_swapped_into_vectors_are_bitwise_the_loops(monkeypatch, prec):
    """A product whose columns are no whole number of vectors is computed transposed, its
    vectors along the rows, each cell stored where the target keeps it (``Gemm.swapped``);
    one whose whole output fits in registers, whatever its inner length, in one block.
    Each cell is the same sum in the same order as the loops: the same bits."""
    comp, inputs, outputs = _narrow_products(prec)
    *small, held = [g for g in lower(comp, Target(im2col=False)) if isinstance(g, Gemm)]
    assert len(small) == 4 and all(g.kernel == "inline" and g.swapped for g in small)
    assert held.rows * held.inner * held.cols > Target().inline_product_work
    if prec is Precision.f64:  # 9 rows of 8 f64 take 18 of a 256-bit target's registers
        assert held.kernel == "blas"
    else:
        assert held.kernel == "inline" and held.swapped and held.block == (9, 8)
    _the_loops_bits_near_blas(monkeypatch, comp, inputs, outputs, prec)
