"""The reference interpreter of lowered code (``ocannl.ir.interpret``) against hand values and
NumPy: summation order, rounding at each store, padding, scatters, products, and the groups it
refuses."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest

from ocannl import Precision
from ocannl.ir import interpret
from ocannl.ir.assignments import Accum, Affine, Comp, Const, Get, apply
from ocannl.ir.lowering import Gemm, LoopGroup, LoopNest, MatrixView, loop_nest, lower
from ocannl.ir.target import LOOPS, PRODUCTS
from ocannl.ir.tnode import MemoryMode, Tnode

F32, BF16 = Precision.f32, Precision.bf16


def _values(**arrays: tuple[Tnode, object]) -> dict[int, np.ndarray]:
    return {n.id: np.asarray(v, np.float64).astype(n.prec.numpy_dtype).reshape(n.dims)
            for n, v in arrays.values()}


def test_a_sum_takes_its_terms_in_order_from_zero_in_f32():
    """1e8 + 1 - 1e8 + 1 in f32, in order: the 1s are lost one at a time as f32 rounds."""
    x, y = Tnode("x", (4,), F32), Tnode("y", (), F32)
    code = lower(Comp((Accum(y, (), "+", Get(x, (0,)), (4,), reset=True),)), PRODUCTS)
    vals = _values(x=(x, [1e8, 1.0, -1e8, 1.0]), y=(y, 0.0))
    interpret.run(code, vals)
    want = np.float32(0)
    for t in np.float32([1e8, 1.0, -1e8, 1.0]):
        want = np.float32(want + t)
    assert vals[y.id] == want == np.float32(1.0)


def test_a_bf16_target_rounds_once_per_store_to_nearest_even():
    x, y = Tnode("x", (300,), F32), Tnode("y", (), BF16)
    z = Tnode("z", (3,), BF16)
    code = lower(Comp((Accum(y, (), "+", Get(x, (0,)), (300,), reset=True),
                       Accum(z, (0,), "=", apply("add", Const(1.0), Const(2.0 ** -9)), (3,)))),
                 PRODUCTS)
    vals = _values(x=(x, np.ones(300)), y=(y, 0.0), z=(z, np.zeros(3)))
    interpret.run(code, vals)
    assert float(vals[y.id]) == 300.0  # summed in f32, rounded once (in bf16: stuck at 256)
    assert vals[z.id].dtype == ml_dtypes.bfloat16 and list(vals[z.id].astype(float)) == [1.0] * 3


def test_padding_reads_zero_and_a_scatter_skips_cells_outside():
    x, y = Tnode("x", (5,), F32), Tnode("y", (5,), F32)
    shifted = Affine(((1, 0),), -1)  # x[i - 1]
    code = lower(Comp((Accum(y, (0,), "=", Get(x, (shifted,)), (5,)),)), PRODUCTS)
    vals = _values(x=(x, [1, 2, 3, 4, 5]), y=(y, np.zeros(5)))
    interpret.run(code, vals)
    np.testing.assert_array_equal(vals[y.id], [0, 1, 2, 3, 4])
    s = Tnode("s", (4,), F32)  # s[i + j - 1] += x[i] over (5, 2): a scatter
    a = Accum(s, (Affine(((1, 0), (1, 1)), -1),), "+", Get(x, (0,)), (5, 2))
    [group] = lower(Comp((a,)), PRODUCTS)
    assert group.lead.scatter
    vals = _values(x=(x, [1, 2, 3, 4, 5]), s=(s, np.zeros(4)))
    interpret.run([group], vals)
    np.testing.assert_array_equal(vals[s.id], [1 + 2, 2 + 3, 3 + 4, 4 + 5])


def test_a_product_is_the_in_order_sum_and_matches_einsum():
    rng = np.random.default_rng(0)
    a, b, c = Tnode("a", (32, 40), F32), Tnode("b", (40, 24), F32), Tnode("c", (32, 24), F32)
    acc = Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))), (32, 24, 40))
    [g] = lower(Comp((acc,)), PRODUCTS)
    assert isinstance(g, Gemm) and not g.assign.reset
    av, bv, cv = (rng.normal(size=n.dims).astype(np.float32) for n in (a, b, c))
    vals = {a.id: av, b.id: bv, c.id: cv.copy()}
    interpret.run([g], vals)
    want = np.zeros((32, 24), np.float32)
    for k in range(40):
        want = want + av[:, k, None] * bv[None, k, :]
    assert vals[c.id].tobytes() == (cv + want).tobytes()
    loops = {a.id: av, b.id: bv, c.id: cv.copy()}
    interpret.run(lower(Comp((acc,)), LOOPS), loops)  # the same sum as a reduction
    assert loops[c.id].tobytes() == vals[c.id].tobytes()
    blas = {a.id: av, b.id: bv, c.id: cv.copy()}
    interpret.run([g], blas, gemm="matmul")
    np.testing.assert_allclose(blas[c.id], cv + av @ bv, rtol=1e-5, atol=1e-5)


def test_f64_meets_f32_widened():
    x, d, y = Tnode("x", (1,), F32), Tnode("d", (1,), Precision.f64), Tnode("y", (1,), F32)
    code = lower(Comp((Accum(y, (0,), "=", apply("add", Get(x, (0,)), Get(d, (0,))), (1,)),)),
                 PRODUCTS)
    vals = _values(x=(x, [1.0]), d=(d, [2.0 ** -30]), y=(y, [0.0]))
    interpret.run(code, vals)
    assert vals[y.id][0] == np.float32(1.0 + 2.0 ** -30)  # f64 sum, rounded once (to 1)


def test_a_group_reading_another_points_cell_is_refused():
    x, y, z = (Tnode(n, (4,), F32) for n in "xyz")
    first = loop_nest(Accum(y, (0,), "=", Get(x, (0,)), (4,)))
    shifted = loop_nest(Accum(z, (0,), "=", Get(y, (Affine(((1, 0),), 1),)), (4,)))
    with pytest.raises(interpret.GroupingError, match="accessed at"):
        interpret.run([LoopGroup((first, shifted))], _values(x=(x, np.ones(4))))
    red = LoopNest(Accum(Tnode("s", (), F32), (), "+", Get(y, (0,)), (4,)), (), (0,))
    with pytest.raises(interpret.GroupingError, match="pointwise"):
        interpret.check_group(LoopGroup((first, red)))


def test_a_row_sum_group_must_end_in_a_row_walk_over_its_points_in_order():
    """``LoopGroup.row_sum``: pointwise nests, then a lone row walk over their space whose
    reductions then row are their points' order; anything else is refused."""
    x, g = Tnode("x", (6, 8), F32), Tnode("g", (6, 8), F32)
    b = Tnode("b", (8,), F32)
    pointwise = loop_nest(Accum(g, (0, 1), "=", apply("relu", Get(x, (0, 1))), (6, 8)))
    walk = LoopNest(Accum(b, (1,), "+", Get(g, (0, 1)), (6, 8), reset=True), (1,), (0,),
                    walk_rows=True)
    vals = _values(x=(x, np.arange(-24.0, 24.0).reshape(6, 8)))
    interpret.run([LoopGroup((pointwise, walk), row_sum=True)], vals)
    np.testing.assert_array_equal(vals[b.id], np.maximum(vals[x.id], 0).sum(0))
    with pytest.raises(interpret.GroupingError, match="lone row walk"):
        interpret.check_group(LoopGroup((pointwise, replace(walk, walk_rows=False)),
                                        row_sum=True))
    crossed = replace(pointwise, par=(1, 0))  # its points column by column
    with pytest.raises(interpret.GroupingError, match="pointwise"):
        interpret.check_group(LoopGroup((crossed, walk), row_sum=True))


def test_register_nodes_are_poisoned_after_their_group():
    x = Tnode("x", (4,), F32)
    t = Tnode("t", (4,), F32, memory_mode=MemoryMode.local)
    y, z = Tnode("y", (4,), F32), Tnode("z", (4,), F32)
    g = LoopGroup((loop_nest(Accum(t, (0,), "=", apply("exp", Get(x, (0,))), (4,))),
                   loop_nest(Accum(y, (0,), "=", apply("neg", Get(t, (0,))), (4,)))),
                  registers=frozenset({t.id}))
    later = LoopGroup((loop_nest(Accum(z, (0,), "=", Get(t, (0,)), (4,))),))
    vals = _values(x=(x, [0, 1, 2, 3]))
    interpret.run([g, later], vals)
    np.testing.assert_array_equal(vals[y.id], -np.exp(np.float32([0, 1, 2, 3])))
    assert np.isnan(vals[z.id]).all()  # a later reader of a register node reads garbage


def test_missing_inputs_are_named():
    x, y = Tnode("x", (2,), F32), Tnode("y", (2,), F32)
    code = lower(Comp((Accum(y, (0,), "=", Get(x, (0,)), (2,)),)), PRODUCTS)
    with pytest.raises(ValueError, match=f"no values for {x.name}"):
        interpret.run(code, {})


def test_ulp_distance():
    a = np.float32([1.0, -0.0, np.nan, 1.0])
    b = np.float32([np.nextafter(np.float32(1), np.float32(2)), 0.0, np.nan, np.nan])
    d = interpret.ulp_distance(a, b)
    assert list(d[:3]) == [1, 1, 0] and d[3] > 1 << 40
    with pytest.raises(ValueError, match="float32 against float64"):
        interpret.ulp_distance(a, b.astype(np.float64))


def test_a_gemm_view_reads_a_transposed_operand():
    a, b, c = Tnode("a", (3, 2), F32), Tnode("b", (3, 4), F32), Tnode("c", (2, 4), F32)
    acc = Accum(c, (0, 1), "+", apply("mul", Get(a, (2, 0)), Get(b, (2, 1))), (2, 4, 3), True)
    g = Gemm(acc, MatrixView(a, 2, 3, True, 2), MatrixView(b, 3, 4, False, 4), 2, 4, 3, 4)
    av, bv = np.arange(6, dtype=np.float32).reshape(3, 2), np.ones((3, 4), np.float32)
    vals = {a.id: av, b.id: bv, c.id: np.zeros((2, 4), np.float32)}
    interpret.run([g], vals)
    np.testing.assert_array_equal(vals[c.id], av.T @ bv)
