"""Lowering (``ocannl.ir.lowering``): assignments to loop nests and GEMMs, run by the reference
interpreter (``ocannl.ir.interpret``), against hand values and NumPy's einsum. (The CPU
renderer's code is compared with the interpreter on these computations in
``tests/backends/test_cpu_render.py``.)"""

from __future__ import annotations

import math
from dataclasses import replace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ocannl.tensor as T
from ocannl import Context, Precision, train
from ocannl.ir import interpret, lowered, lowering
from ocannl.ir.assignments import Accum, Comp, Const, Fixed, Get, apply
from ocannl.ir.interpret import stored
from ocannl.ir.lowering import (
    GEMM_MIN_FLOPS,
    Fill,
    Gemm,
    LoopGroup,
    LoopNest,
    lower,
    lower_items,
    nests,
    nodes_of,
)
from ocannl.ir.target import LOOPS, PRODUCTS, Target
from ocannl.ir.tnode import Tnode

F32 = Precision.f32


def _node(label: str, dims: tuple[int, ...], prec: Precision = F32) -> Tnode:
    return Tnode(label, dims, prec)


def _run(comp: Comp, inputs: dict[Tnode, np.ndarray], *, gemm: bool,
         initial: dict[Tnode, np.ndarray] | None = None) -> dict[int, np.ndarray]:
    """Lower ``comp`` and run it in the interpreter on zeros (as a backend's fresh buffers)
    holding ``initial`` and ``inputs``; the values of every node by id."""
    code = lower(comp, Target(im2col=False) if gemm else LOOPS)
    values = {n.id: np.zeros(n.dims, n.prec.numpy_dtype) for n in nodes_of(code)}
    for n, v in {**(initial or {}), **inputs}.items():
        if n.id in values:  # (initial values may be given for nodes the code does not touch)
            values[n.id] = stored(np.asarray(v, np.float64).reshape(n.dims), n.prec)
    interpret.run(code, values)
    return values


def _run_from_init(loss: T.Tensor, comp: Comp, target: Target = PRODUCTS
                   ) -> dict[int, np.ndarray]:
    """``comp`` in the interpreter (lowered for ``target``) from the loss's parameters as
    ``train.init_params`` draws them (on a CPU context: their init routines), data from the
    nodes' host arrays."""
    ctx = train.init_params(Context.cpu(), loss)
    code = lower(comp, target)
    values = {}
    for n in nodes_of(code):
        if ctx.is_allocated(n):
            values[n.id] = ctx.get_values(n)
        elif n.host_data is not None:
            values[n.id] = stored(np.asarray(n.host_data, np.float64).reshape(n.dims), n.prec)
        else:
            values[n.id] = np.zeros(n.dims, n.prec.numpy_dtype)
    interpret.run(code, values)
    return values


def _matmul(m: int, k: int, n: int, *, reset: bool = True) -> tuple[Accum, Tnode, Tnode, Tnode]:
    """``c[i, j] (+)= a[i, l] * b[l, j]`` over the space (i, j, l)."""
    a, b, c = _node("a", (m, k)), _node("b", (k, n)), _node("c", (m, n))
    acc = Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))), (m, n, k),
                reset=reset)
    return acc, a, b, c


# --- loop nests -------------------------------------------------------------------------------


def test_pointwise_is_one_parallel_nest():
    x, y = _node("x", (3, 4)), _node("y", (3, 4))
    a = Accum(y, (0, 1), "=", apply("exp", Get(x, (0, 1))), (3, 4))
    [nest] = nests(lower(Comp((a,)), PRODUCTS))
    assert isinstance(nest, LoopNest)
    assert nest.par == (0, 1) and nest.red == ()
    assert nest.par_size == 12 and nest.red_size == 1


def test_reduction_iterators_are_the_ones_missing_from_the_target():
    x, y = _node("x", (3, 4, 5)), _node("y", (4,))
    a = Accum(y, (1,), "+", Get(x, (0, 1, 2)), (3, 4, 5), reset=True)
    [nest] = nests(lower(Comp((a,)), PRODUCTS))
    assert isinstance(nest, LoopNest)
    assert nest.par == (1,) and nest.red == (0, 2)
    assert nest.par_size == 4 and nest.red_size == 15
    xv = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    for gemm in (True, False):
        out = _run(Comp((a,)), {x: xv}, gemm=gemm)
        np.testing.assert_allclose(out[y.id], xv.sum(axis=(0, 2)), rtol=1e-6)


def test_reset_of_a_target_it_does_not_cover_fills_first():
    """A diagonal store resets the whole target to the neutral element, then writes."""
    x, y = _node("x", (3,)), _node("y", (3, 3))
    a = Accum(y, (0, 0), "+", Get(x, (0,)), (3,), reset=True)
    fill, group = lower(Comp((a,)), PRODUCTS)
    assert fill == Fill(y, 0.0)
    [nest] = group.nests
    assert isinstance(nest, LoopNest) and not nest.assign.reset
    out = _run(Comp((a,)), {x: [1, 2, 3]}, gemm=True, initial={y: np.full((3, 3), 7.0)})
    np.testing.assert_array_equal(out[y.id], np.diag([1.0, 2.0, 3.0]))
    m = Accum(y, (Fixed(1), 0), "max", Get(x, (0,)), (3,), reset=True)
    fill, _ = lower(Comp((m,)), PRODUCTS)
    assert fill == Fill(y, -np.inf)
    out = _run(Comp((m,)), {x: [1, 2, 3]}, gemm=True)
    np.testing.assert_array_equal(out[y.id], [[-np.inf] * 3, [1, 2, 3], [-np.inf] * 3])


def test_accumulation_operators():
    """``=`` overwrites, ``+`` adds to what the cell holds unless reset, ``max`` keeps the
    larger; a Fixed index reads one position; an operand ignoring an iterator broadcasts."""
    x, s, y = _node("x", (2, 3)), _node("s", (4,)), _node("y", (2, 3))
    xv = np.array([[1, -2, 3], [4, 5, -6]], np.float32)
    sv = np.array([10, 20, 30, 40], np.float32)
    y0 = np.full((2, 3), 100.0, np.float32)
    row = Get(x, (Fixed(1), 1))  # broadcast row 1 of x over the first iterator
    cases = {
        ("=", False): np.broadcast_to(xv[1][None, :] * sv[2], (2, 3)),
        ("+", False): y0 + xv[1][None, :] * sv[2],
        ("+", True): np.broadcast_to(xv[1][None, :] * sv[2], (2, 3)),
        ("max", False): np.maximum(y0, xv[1][None, :] * sv[2]),
        ("max", True): np.broadcast_to(xv[1][None, :] * sv[2], (2, 3)),
    }
    for (accum, reset), want in cases.items():
        a = Accum(y, (0, 1), accum, apply("mul", row, Get(s, (Fixed(2),))), (2, 3), reset=reset)
        out = _run(Comp((a,)), {x: xv, s: sv}, gemm=True, initial={y: y0})
        np.testing.assert_array_equal(out[y.id], want, err_msg=f"{accum} reset={reset}")


def test_max_reduction_with_and_without_reset():
    x, y = _node("x", (4, 3)), _node("y", (3,))
    xv = np.array([[1, 9, -3], [4, 2, -6], [0, 0, -5], [2, 1, -4]], np.float32)
    for reset, y0, want in [(True, [100, 100, 100], [4, 9, -3]),
                            (False, [3, 100, -10], [4, 100, -3])]:
        a = Accum(y, (1,), "max", Get(x, (0, 1)), (4, 3), reset=reset)
        out = _run(Comp((a,)), {x: xv}, gemm=True, initial={y: np.array(y0, np.float32)})
        np.testing.assert_array_equal(out[y.id], want)


def test_constants_and_narrow_targets():
    """A literal expression; a bf16 target accumulates in f32 and rounds once per store."""
    y = _node("y", (5,), Precision.bf16)
    a = Accum(y, (0,), "=", apply("add", Const(1.0), Const(2.0 ** -9)), (5,))
    out = _run(Comp((a,)), {}, gemm=True)
    np.testing.assert_array_equal(out[y.id].astype(np.float32), [1.0] * 5)  # tie to even
    x, z = _node("x", (300,)), _node("z", (), Precision.bf16)
    s = Accum(z, (), "+", Get(x, (0,)), (300,), reset=True)
    out = _run(Comp((s,)), {x: np.ones(300)}, gemm=True)
    # Summed in bf16 the total would stall at 256 (256 + 1 rounds back to 256).
    assert float(out[z.id]) == 300.0


# --- dropping and fusing fills ----------------------------------------------------------------


def _fill(node: Tnode, value: float) -> Accum:
    return Accum(node, tuple(range(len(node.dims))), "=", Const(value), node.dims)


def test_fills_lower_to_fill_items():
    y = _node("y", (2, 3))
    assert lower(Comp((_fill(y, 1.5),)), PRODUCTS) == [Fill(y, 1.5)]
    out = _run(Comp((_fill(y, 1.5),)), {}, gemm=True, initial={y: np.full((2, 3), 9.0)})
    np.testing.assert_array_equal(out[y.id], np.full((2, 3), 1.5))


def _fusion_case(case: str):
    """A zero (or other) fill of ``y`` followed by a use; the expected final ``y`` when every
    buffer starts out holding garbage (7), and whether the fill must stay (None: either)."""
    x, y, z = _node("x", (3, 4)), _node("y", (3,)), _node("z", (3,))
    xv = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    row_sum = xv.sum(axis=1)
    add_rows = Accum(y, (0,), "+", Get(x, (0, 1)), (3, 4))  # y[i] += sum_j x[i, j]
    cases = {
        # zero fill then a covering += that does not read y: becomes one reset accumulation
        "fused": ([_fill(y, 0.0), add_rows], row_sum, False),
        # a fill of another value must stay
        "nonzero": ([_fill(y, 1.0), add_rows], row_sum + 1, True),
        # the accumulation reads y itself: y[i] += y[i] * x[i, j] needs the zeros first
        "self_read": ([_fill(y, 0.0), Accum(y, (0,), "+", apply("mul", Get(y, (0,)),
                                                                  Get(x, (0, 1))), (3, 4))],
                      np.zeros(3), True),
        # y is read (into z) before it is accumulated into
        "read_first": ([_fill(y, 0.0), Accum(z, (0,), "=", Get(y, (0,)), (3,)), add_rows],
                       row_sum, True),
        # overwritten whole by a pointwise "=": a dead fill
        "overwritten": ([_fill(y, 3.0), Accum(y, (0,), "=", Get(x, (0, Fixed(2))), (3,))],
                        xv[:, 2], False),
        # "=" over a reduction space: the last write wins (whether the fill stays is free)
        "last_write": ([_fill(y, 0.0), Accum(y, (0,), "=", Get(x, (0, 1)), (3, 4))],
                       xv[:, 3], None),
        # a non-covering += (one fixed cell) must keep the fill for the other cells
        "partial": ([_fill(y, 0.0), Accum(y, (Fixed(1),), "+", Get(x, (Fixed(1), 0)), (4,))],
                    np.array([0, row_sum[1], 0]), True),
    }
    code, want, fill_kept = cases[case]
    return Comp(tuple(code)), x, xv, y, z, want, fill_kept


@pytest.mark.parametrize("case", ["fused", "nonzero", "self_read", "read_first", "overwritten",
                                  "last_write", "partial"])
def test_fills_are_dropped_only_when_dead(case):
    comp, x, xv, y, z, want, fill_kept = _fusion_case(case)
    code = lower(comp, PRODUCTS)
    fills = [it for it in code if isinstance(it, Fill) and it.node is y]
    if fill_kept is not None:
        assert bool(fills) == fill_kept, code
    if case == "fused":
        [nest] = nests(code)
        assert isinstance(nest, LoopNest) and nest.assign.reset
    garbage = {n: np.full(n.dims, 7.0) for n in (y, z)}
    out = _run(comp, {x: xv}, gemm=True, initial=garbage)
    np.testing.assert_array_equal(out[y.id], want)
    if case == "read_first":
        np.testing.assert_array_equal(out[z.id], np.zeros(3))


def test_zeroed_gradients_are_written_once():
    """In a gradient update, a gradient's zero fill fuses into its first accumulation."""
    x = T.term(np.ones((4, 3)), label="x")
    w = T.param("w", output_dims=(2,))
    loss = T.sum(T.tanh(w @ x))
    code = lower(train.grad_update(loss), PRODUCTS)
    assert not any(isinstance(it, Fill) and it.node is w.grad for it in code)
    writes = [it for it in [*nests(code), *(g for g in code if isinstance(g, Gemm))]
              if it.assign.lhs is w.grad]
    assert writes and writes[0].assign.reset


# --- GEMM recognition -------------------------------------------------------------------------


def test_matmul_becomes_a_gemm():
    acc, a, b, c = _matmul(32, 32, 32)
    assert math.prod(acc.space) >= GEMM_MIN_FLOPS
    [g] = lower(Comp((acc,)), PRODUCTS)
    assert isinstance(g, Gemm)
    assert (g.rows, g.cols, g.inner) == (32, 32, 32)
    assert g.a.node is a and not g.a.transposed and g.b.node is b and not g.b.transposed
    [nest] = nests(lower(Comp((acc,)), LOOPS))
    assert isinstance(nest, LoopNest)


def test_small_contractions_stay_loops():
    acc, *_ = _matmul(4, 4, 4)
    assert math.prod(acc.space) < GEMM_MIN_FLOPS
    assert isinstance(lower(Comp((acc,)), PRODUCTS)[0], LoopGroup)


def test_gemm_threshold(monkeypatch):
    acc, *_ = _matmul(4, 4, 4)
    monkeypatch.setattr(lowering, "GEMM_MIN_FLOPS", 64)
    assert isinstance(lower(Comp((acc,)), PRODUCTS)[0], Gemm)
    monkeypatch.setattr(lowering, "GEMM_MIN_FLOPS", 65)
    assert isinstance(lower(Comp((acc,)), PRODUCTS)[0], LoopGroup)


def test_transposed_operands_and_swapped_result():
    m, k, n = 24, 40, 20
    a, b, c = _node("a", (k, m)), _node("b", (n, k)), _node("c", (n, m))
    # c[j, i] += a[l, i] * b[j, l]  (space i, j, l): both operands transposed, result swapped
    acc = Accum(c, (1, 0), "+", apply("mul", Get(a, (2, 0)), Get(b, (1, 2))), (m, n, k),
                reset=True)
    [g] = lower(Comp((acc,)), PRODUCTS)
    assert isinstance(g, Gemm)
    assert (g.rows, g.cols, g.inner) == (n, m, k)
    assert g.a.node is b and not g.a.transposed
    assert g.b.node is a and not g.b.transposed
    # c[i, j] += a[l, i] * b[j, l]: a^T @ b^T
    c2 = _node("c2", (m, n))
    acc2 = Accum(c2, (0, 1), "+", apply("mul", Get(a, (2, 0)), Get(b, (1, 2))), (m, n, k),
                 reset=True)
    [g2] = lower(Comp((acc2,)), PRODUCTS)
    assert isinstance(g2, Gemm) and g2.a.node is a and g2.a.transposed
    assert g2.b.node is b and g2.b.transposed
    rng = np.random.default_rng(0)
    av, bv = rng.normal(size=(k, m)), rng.normal(size=(n, k))
    out = _run(Comp((acc, acc2)), {a: av, b: bv}, gemm=True)
    np.testing.assert_allclose(out[c.id], (av.T @ bv.T).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[c2.id], av.T @ bv.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "accumulate"])
@pytest.mark.parametrize("prec", [Precision.f16, Precision.bf16, Precision.f64],
                         ids=lambda p: p.value)
def test_gemms_at_every_precision(prec, reset):
    """A GEMM whose operands and target are 16-bit goes through f32 scratch: the product is
    the f32 product of the stored values, added to the target's old values when accumulating,
    rounded once into the target. Mixed operands (an f32 matrix times a 16-bit one) too."""
    m, k, n = 32, 24, 40
    a, b = _node("a", (k, m), prec), _node("b", (k, n), Precision.f32)
    c = _node("c", (m, n), prec)
    # c[i, j] (+)= a[l, i] * b[l, j]: a transposed
    acc = Accum(c, (0, 1), "+", apply("mul", Get(a, (2, 0)), Get(b, (2, 1))), (m, n, k),
                reset=reset)
    [g] = lower_items(Comp((acc,)), PRODUCTS)  # before scheduling gives it f32 copies
    assert isinstance(g, Gemm) and g.a.node is a and g.a.transposed
    rng = np.random.default_rng(9)
    dt = prec.numpy_dtype
    av = rng.normal(size=(k, m)).astype(dt)
    bv = rng.normal(size=(k, n)).astype(np.float32)
    c0 = rng.normal(size=(m, n)).astype(dt)
    out = _run(Comp((acc,)), {a: av, b: bv}, gemm=True, initial={c: c0})[c.id]
    assert out.dtype == dt
    want = av.astype(np.float64).T @ bv.astype(np.float64)
    if not reset:
        want = want + c0.astype(np.float64)
    if prec is Precision.f64:
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    else:
        eps = 2.0 ** -11 if prec is Precision.f16 else 2.0 ** -8
        err = np.abs(out.astype(np.float64) - want)
        assert np.all(err <= eps * np.abs(want) + 1e-5 * np.abs(want).max())


def test_grouped_axes_are_one_matrix_dimension():
    """A weight shared over two batch axes: the batch axes group into the GEMM's rows."""
    b1, b2, k, o = 8, 6, 20, 24
    x, w, y = _node("x", (b1, b2, k)), _node("w", (o, k)), _node("y", (b1, b2, o))
    acc = Accum(y, (0, 1, 2), "+", apply("mul", Get(w, (2, 3)), Get(x, (0, 1, 3))),
                (b1, b2, o, k), reset=True)
    [g] = lower(Comp((acc,)), PRODUCTS)
    assert isinstance(g, Gemm) and (g.rows, g.cols, g.inner) == (b1 * b2, o, k)


@pytest.mark.parametrize("case", ["batched", "outer", "fixed", "split_group", "max", "repeated",
                                  "add"])
def test_non_gemm_shapes_stay_loops(case):
    s = 32
    x, w = _node("x", (s, s, s)), _node("w", (s, s))
    y3, y2 = _node("y3", (s, s, s)), _node("y2", (s, s))
    mul = apply("mul", Get(w, (0, 2)), Get(x, (1, 0, 2)))
    acc = {
        # y[b, i, j] += w[b, i, l] * x[b, l, j]: an iterator in all three
        "batched": Accum(y3, (0, 1, 2), "+",
                         apply("mul", Get(x, (0, 1, 3)), Get(x, (0, 3, 2))), (s, s, s, s)),
        # y[i, j] += w[i] * x[j]: nothing contracted
        "outer": Accum(_node("o", (s * 8, s * 8)), (0, 1), "+",
                       apply("mul", Get(_node("u", (s * 8,)), (0,)),
                             Get(_node("v", (s * 8,)), (1,))), (s * 8, s * 8)),
        "fixed": Accum(y2, (0, 1), "+",
                       apply("mul", Get(w, (0, 2)), Get(x, (Fixed(3), 2, 1))), (s, s, s)),
        # y[m1, n, m2]: the rows are not one contiguous run of the target
        "split_group": Accum(y3, (0, 1, 2), "+",
                             apply("mul", Get(x, (0, 2, 3)), Get(w, (3, 1))), (s, s, s, s)),
        "max": Accum(y2, (1, 0), "max", mul, (s, s, s)),
        # the same iterator twice in one operand (a diagonal)
        "repeated": Accum(y2, (0, 1), "+",
                          apply("mul", Get(x, (0, 2, 2)), Get(w, (2, 1))), (s, s, s)),
        "add": Accum(y2, (1, 0), "+", apply("add", Get(w, (0, 2)), Get(x, (1, 0, 2))),
                     (s, s, s)),
    }[case]
    assert math.prod(acc.space) >= GEMM_MIN_FLOPS
    [nest] = nests(lower(Comp((acc,)), PRODUCTS))
    assert isinstance(nest, LoopNest), case


def test_matmul_backprop_lowers_to_gemms():
    x = T.term(np.random.default_rng(0).normal(size=(64, 32)), label="x")
    w1 = T.param("w1", output_dims=[48])
    w2 = T.param("w2", output_dims=[16])
    loss = T.sum(w2 @ T.relu(w1 @ x))
    code = lower(train.grad_update(loss), PRODUCTS)
    gemms = [it for it in code if isinstance(it, Gemm)]
    # forward: two products; backprop: grad w2, grad h, grad w1 (x is a term: no grad)
    assert len(gemms) == 5
    lhs = {g.assign.lhs.id for g in gemms}
    assert {w1.grad.id, w2.grad.id} <= lhs


# --- any contraction computes what einsum computes, as a GEMM or as loops ----------------------

LETTERS = "abcdefgh"


@st.composite
def contractions(draw):
    """A random ``out[R] (+)= x[X] * y[Y]``. ``grouped``: the row (m), column (n) and inner (k)
    axes each form one run, in the same order in every operand, the runs in any order: the
    shapes a GEMM can take. Otherwise every operand's axes are in any order, and an axis may be
    in all three (batched)."""
    grouped = draw(st.booleans())
    n_m = draw(st.integers(0, 2))
    n_n = draw(st.integers(0, 2))
    n_k = draw(st.integers(1, 2))
    n_b = 0 if grouped else draw(st.integers(0, 1))
    labels = list(LETTERS[: n_m + n_n + n_k + n_b])
    sizes = draw(st.lists(st.integers(1, 24), min_size=len(labels), max_size=len(labels)))
    while math.prod(sizes) > 60000:
        sizes = [max(1, s // 2) for s in sizes]
    ms, ns = labels[:n_m], labels[n_m:n_m + n_n]
    ks, bs = labels[n_m + n_n:n_m + n_n + n_k], labels[n_m + n_n + n_k:]
    if grouped:
        ms, ns, ks = (draw(st.permutations(g)) for g in (ms, ns, ks))

        def runs(a, b):
            return a + b if draw(st.booleans()) else b + a

        xs, ys, rs = runs(ms, ks), runs(ks, ns), runs(ms, ns)
    else:
        xs = draw(st.permutations(ms + ks + bs))
        ys = draw(st.permutations(ks + ns + bs))
        rs = draw(st.permutations(ms + ns + bs))
    reset = draw(st.booleans())
    prec = draw(st.sampled_from([Precision.f32, Precision.f64, Precision.bf16]))
    return (grouped, "".join(xs), "".join(ys), "".join(rs),
            dict(zip(labels, sizes, strict=True)), reset, prec)


@settings(max_examples=25, deadline=None)
@given(contractions(), st.integers(0, 2**32 - 1))
def test_contractions_match_einsum(spec, seed):
    """Every GEMM-shaped contraction is recognised (with the size threshold lowered to 1) and
    every contraction computes einsum's result, the grouped ones as GEMMs (transposed views,
    grouped axes, accumulating or reset, narrow targets), the others as loop nests."""
    grouped, xs, ys, rs, size, reset, prec = spec
    order = list(dict.fromkeys(rs + xs + ys))
    it = {c: k for k, c in enumerate(order)}
    space = tuple(size[c] for c in order)
    x = _node("x", tuple(size[c] for c in xs), prec)
    y = _node("y", tuple(size[c] for c in ys), prec)
    out = _node("out", tuple(size[c] for c in rs), prec)
    acc = Accum(out, tuple(it[c] for c in rs), "+",
                apply("mul", Get(x, tuple(it[c] for c in xs)), Get(y, tuple(it[c] for c in ys))),
                space, reset=reset)
    with mock.patch.object(lowering, "GEMM_MIN_FLOPS", 1):
        kinds = [type(item) for item in lower_items(Comp((acc,)), PRODUCTS)]
        if grouped:
            assert kinds == [Gemm], spec
        elif set(xs) & set(ys) & set(rs):
            assert kinds == [LoopGroup], spec
    rng = np.random.default_rng(seed)
    dt = prec.numpy_dtype
    xv = rng.normal(size=x.dims).astype(dt)
    yv = rng.normal(size=y.dims).astype(dt)
    o0 = rng.normal(size=out.dims).astype(dt)
    want = np.einsum(f"{xs},{ys}->{rs}", xv.astype(np.float64), yv.astype(np.float64))
    if not reset:
        want = want + o0.astype(np.float64)
    inner = math.prod(size[c] for c in xs if c not in rs)
    scale = np.abs(xv.astype(np.float64)).max() * np.abs(yv.astype(np.float64)).max()
    # rounding of the stored result (bf16: once per store), plus the accumulation's error
    rel = {Precision.f64: 1e-13, Precision.f32: 1e-6, Precision.bf16: 2.0 ** -8}[prec]
    acc_eps = 1e-15 if prec is Precision.f64 else 1e-6
    tol = rel * np.abs(want) + acc_eps * inner * scale
    with mock.patch.object(lowering, "GEMM_MIN_FLOPS", 1):
        got = _run(Comp((acc,)), {x: xv, y: yv}, gemm=True, initial={out: o0})
    err = np.abs(got[out.id].astype(np.float64) - want)
    assert np.all(err <= tol), (spec, float(err.max()))


def _attention_products(b: int, t: int, h: int, d: int) -> tuple[Accum, Accum, list[Tnode]]:
    """``scores[b,h,t,s] = q[b,t,h,d] . k[b,s,h,d]`` and ``out[b,t,h,d] = scores[b,h,t,s] .
    v[b,s,h,d]``: products per (batch, head) whose matrices' rows are strided in q, k, v."""
    q, k, v = (_node(n, (b, t, h, d)) for n in "qkv")
    scores, out = _node("scores", (b, h, t, t)), _node("out", (b, t, h, d))
    # iterators: 0 b, 1 h, 2 t, 3 s, 4 d
    s1 = Accum(scores, (0, 1, 2, 3), "+", apply("mul", Get(q, (0, 2, 1, 4)), Get(k, (0, 3, 1, 4))),
               (b, h, t, t, d), reset=True)
    # iterators: 0 b, 1 t, 2 h, 3 d, 4 s
    s2 = Accum(out, (0, 1, 2, 3), "+", apply("mul", Get(scores, (0, 2, 1, 4)),
                                             Get(v, (0, 4, 2, 3))), (b, t, h, d, t), reset=True)
    return s1, s2, [q, k, v, scores, out]


def test_batched_products_become_one_gemm_per_batch_point_and_match_einsum():
    """With ``batched``, attention's two products are GEMMs over (batch, head), their operands'
    rows strided (q's rows are h * d apart); without, loop nests. Both compute einsum's
    result."""
    s1, s2, (q, k, v, scores, out) = _attention_products(3, 16, 4, 8)
    gemms = [item for item in lower(Comp((s1, s2)), Target(im2col=False)) if isinstance(item, Gemm)]
    assert len(gemms) == 2 and [len(g.batch) for g in gemms] == [2, 2]
    assert gemms[0].a.ld == 4 * 8 and gemms[0].b.transposed
    assert all(isinstance(i, LoopGroup) for i in lower(Comp((s1, s2)), PRODUCTS))
    rng = np.random.default_rng(0)
    vals = {n: rng.normal(size=n.dims).astype(np.float32) for n in (q, k, v)}
    want_s = np.einsum("bthd,bshd->bhts", vals[q], vals[k])
    want_o = np.einsum("bhts,bshd->bthd", want_s, vals[v])
    for gemm in (True, False):
        got = _run(Comp((s1, s2)), vals, gemm=gemm)
        np.testing.assert_allclose(got[scores.id], want_s, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[out.id], want_o, rtol=1e-5, atol=1e-4)


def test_a_batch_axis_last_in_an_operand_stays_a_loop_nest():
    """BLAS needs a unit stride along each matrix's rows: a batch axis last in an operand
    leaves none, so the product stays loops (and still computes einsum's result)."""
    x, y, out = _node("x", (6, 8, 5)), _node("y", (8, 7, 5)), _node("out", (6, 7, 5))
    # out[m, n, b] = sum_k x[m, k, b] * y[k, n, b]; iterators 0 m, 1 n, 2 b, 3 k
    acc = Accum(out, (0, 1, 2), "+", apply("mul", Get(x, (0, 3, 2)), Get(y, (3, 1, 2))),
                (6, 7, 5, 8), reset=True)
    assert [type(i) for i in lower(Comp((acc,)), Target(im2col=False))] == [LoopGroup]
    rng = np.random.default_rng(1)
    xv, yv = rng.normal(size=x.dims).astype(np.float32), rng.normal(size=y.dims).astype(np.float32)
    got = _run(Comp((acc,)), {x: xv, y: yv}, gemm=True)
    np.testing.assert_allclose(got[out.id], np.einsum("mkb,knb->mnb", xv, yv), rtol=1e-5,
                               atol=1e-5)


# --- parallel vs reduction iterators, and what fuses ------------------------------------------


def _sum_then_scale() -> tuple[Comp, Comp, Tnode, Tnode]:
    """``y += x[i]`` (y has one cell), then ``z[i] = y * x[i]``: the second must see the whole
    sum, so the two must not share a loop."""
    x = Tnode("x", (5,), F32, host_data=np.arange(1, 6, dtype=np.float32))
    y, z = _node("y", (1,)), _node("z", (5,))
    a1 = Accum(y, (0,), "+", Get(x, (0,)), (5,))
    a2 = Accum(z, (0,), "=", apply("mul", Get(y, (0,)), Get(x, (0,))), (5,))
    return Comp((a1,), "sum"), Comp((a2,), "scale"), y, z


def test_an_iterator_over_a_size_one_axis_of_the_target_is_a_reduction():
    s1, s2, _, _ = _sum_then_scale()
    [first, second] = lower(s1 + s2, PRODUCTS)
    assert isinstance(first, LoopGroup) and isinstance(second, LoopGroup)
    [nest] = first.nests
    assert nest.par == () and nest.red == (0,)


def test_a_reduction_is_never_fused_with_a_reader_of_its_result():
    s1, s2, y, z = _sum_then_scale()
    x = lowering.reads(s1.assignments[0].expr).__next__().node
    one = _run(s1 + s2, {x: x.host_data}, gemm=True)
    np.testing.assert_array_equal(one[z.id], [15, 30, 45, 60, 75])
    first = _run(s1, {x: x.host_data}, gemm=True)
    apart = _run(s2, {x: x.host_data, y: first[y.id]}, gemm=True)
    np.testing.assert_array_equal(apart[z.id], [15, 30, 45, 60, 75])


def test_pointwise_nests_over_one_space_fuse_into_one_group():
    x, y, z, w = (_node(n, (4, 3)) for n in "xyzw")
    a1 = Accum(y, (0, 1), "=", apply("exp", Get(x, (0, 1))), (4, 3))
    a2 = Accum(z, (0, 1), "=", apply("mul", Get(y, (0, 1)), Get(x, (0, 1))), (4, 3))
    a3 = Accum(w, (1, 0), "=", Get(z, (1, 0)), (3, 4))  # other space: a group of its own
    a4 = Accum(x, (0, 1), "=", Get(w, (1, 0)), (4, 3))  # writes what the group read
    groups = lower(Comp((a1, a2, a3, a4)), PRODUCTS)
    assert [len(g.nests) for g in groups] == [2, 1, 1]


def test_a_nest_reading_a_group_result_elsewhere_does_not_fuse():
    x, y, z = _node("x", (4,)), _node("y", (4,)), _node("z", (4,))
    a1 = Accum(y, (0,), "=", apply("exp", Get(x, (0,))), (4,))
    a2 = Accum(z, (0,), "=", Get(y, (Fixed(0),)), (4,))  # reads y at another point
    assert [len(g.nests) for g in lower(Comp((a1, a2)), PRODUCTS)] == [1, 1]


def test_effects_name_inputs_and_writes():
    s1, s2, y, z = _sum_then_scale()
    eff = lowering.effects(lower(s1 + s2, PRODUCTS))
    assert [n.label for n in eff.inputs] == ["x", "y"]  # y is accumulated into, not reset
    assert [n.label for n in eff.written] == ["y", "z"]


@pytest.mark.parametrize("accum,reset,prec", [("+", True, F32), ("+", False, F32),
                                              ("max", True, F32), ("+", True, Precision.bf16),
                                              ("+", False, Precision.f64)])
def test_a_column_reduction_walks_rows_with_the_same_bits(monkeypatch, accum, reset, prec):
    """``b[j] (accum)= g[i, j]`` over ``i`` (a bias gradient) is marked to read ``g`` by rows;
    the flag changes no value (the interpreter runs both the same, and NumPy agrees). That the
    CPU's row walk keeps the bits is ``test_cpu_render``'s (the corpus's ``column_*`` cases:
    terms of mixed magnitudes, which would show any reordering)."""
    g, b = Tnode("g", (37, 24), prec), Tnode("b", (24,), prec)
    acc = Accum(b, (1,), accum, Get(g, (0, 1)), (37, 24), reset=reset)  # iterators: 0 i, 1 j
    [item] = lower(Comp((acc,)), PRODUCTS)
    assert isinstance(item, LoopGroup) and item.lead.walk_rows
    rng = np.random.default_rng(3)
    gv = rng.normal(size=(37, 24)) * 10.0 ** rng.integers(-6, 6, size=(37, 24))
    b0 = rng.normal(size=24)
    walked = _run(Comp((acc,)), {g: gv}, gemm=True, initial={b: b0})[b.id]
    monkeypatch.setattr(lowered, "_walks_rows", lambda *args: False)
    [item] = lower(Comp((acc,)), PRODUCTS)
    assert not item.lead.walk_rows
    plain = _run(Comp((acc,)), {g: gv}, gemm=True, initial={b: b0})[b.id]
    assert walked.tobytes() == plain.tobytes()
    stored = gv.astype(prec.numpy_dtype).astype(np.float64)
    want = stored.sum(0) if accum == "+" else stored.max(0)
    if not reset:
        want = want + b0.astype(prec.numpy_dtype).astype(np.float64)
    np.testing.assert_allclose(walked.astype(np.float64), want, rtol=1e-2 if prec is
                               Precision.bf16 else 1e-5)


def test_a_pointwise_nest_moves_back_to_a_group_only_past_what_it_does_not_touch(monkeypatch):
    """``y = x * 2`` then an unrelated reduction ``s = sum(u)``, then ``z = y + 1``: ``z``
    joins ``y``'s loop (it moves past the sum, which neither reads ``y``/``z`` nor writes ``y``).
    A ``w = y + s`` reading the sum's result cannot move past it. Values equal unmoved code's."""
    x, y, z, w = (_node(n, (6,)) for n in "xyzw")
    u, s = _node("u", (6, 5)), _node("s", (6,))
    ay = Accum(y, (0,), "=", apply("mul", Get(x, (0,)), Const(2.0)), (6,))
    asum = Accum(s, (0,), "+", Get(u, (0, 1)), (6, 5), reset=True)
    az = Accum(z, (0,), "=", apply("add", Get(y, (0,)), Const(1.0)), (6,))
    aw = Accum(w, (0,), "=", apply("add", Get(y, (0,)), Get(s, (0,))), (6,))
    code = lower(Comp((ay, asum, az, aw)), PRODUCTS)
    assert [[n.assign.lhs.name for n in i.nests] for i in code] == [
        [y.name, z.name], [s.name], [w.name]]
    rng = np.random.default_rng(5)
    vals = {x: rng.normal(size=6), u: rng.normal(size=(6, 5))}
    moved = _run(Comp((ay, asum, az, aw)), vals, gemm=True)
    monkeypatch.setattr(lowering, "HOIST_WINDOW", 0)
    assert len(lower(Comp((ay, asum, az, aw)), PRODUCTS)) == 4
    unmoved = _run(Comp((ay, asum, az, aw)), vals, gemm=True)
    for n in (y, z, s, w):
        assert moved[n.id].tobytes() == unmoved[n.id].tobytes()


# --- values handed over in registers (LoopGroup.registers) ------------------------------------


def test_a_retained_gradient_is_stored_not_held():
    """A materialized node (a retained gradient) is never held in a register: the host reads
    it, and it holds d loss / d h."""
    w = T.param("wr", output_dims=[5], input_dims=())
    x = T.term(np.linspace(-1, 1, 5).astype(np.float32), label="xr")
    h = T.exp(w * x)
    loss = T.sum(T.tanh(h))
    comp = train.grad_update(loss)
    held = {i for item in lower(comp, PRODUCTS) if isinstance(item, LoopGroup)
            for i in item.registers}
    assert h.grad.id in held
    h.retain_grad()
    held = {i for item in lower(comp, PRODUCTS) if isinstance(item, LoopGroup)
            for i in item.registers}
    assert h.grad.id not in held
    got = _run_from_init(loss, comp)
    expect = 1 - np.tanh(got[h.value.id]) ** 2
    np.testing.assert_allclose(got[h.grad.id], expect, rtol=1e-5)


def test_a_retained_gradient_is_not_aliased():
    w = T.param("wa", output_dims=[6], input_dims=[3])
    x = T.term(np.ones((3,), np.float32), label="xa3")
    m = w @ x
    loss = T.sum(T.exp(m + 1.0))
    comp = train.grad_update(loss)
    assert not any(n.id == m.grad.id for n in nodes_of(lower(comp, PRODUCTS)))
    m.retain_grad()
    assert any(n.id == m.grad.id for n in nodes_of(lower(comp, PRODUCTS)))
    got = _run_from_init(loss, comp)
    np.testing.assert_allclose(got[m.grad.id], np.exp(got[m.value.id] + 1.0), rtol=1e-5)


def test_a_cast_twins_gradient_flows_into_its_master_right_after_its_product():
    """The group adding a twin's gradient into its master's moves up past the input
    gradient's product (which touches neither), to right after the product computing it."""
    from ocannl import mixed_prec, nn_blocks

    x = T.term(np.zeros((24, 40), np.float32), label="xp", batch_dims=(24,),
               output_dims=(40,), prec="bf16")
    y, _ = mixed_prec.with_master_weights(
        prec="bf16", f=lambda: nn_blocks.mlp(x, (48,), 6, label="pu"))
    loss = T.sum(T.cast(y, "f32"))
    code = lower_items(train.grad_update(loss), PRODUCTS)
    twin_grads = [k for k, item in enumerate(code) if isinstance(item, Gemm)
                  and item.assign.lhs.label.startswith("grad_pu_w1_bf16")]
    [k] = twin_grads
    master = code[k + 1]
    assert isinstance(master, LoopGroup)
    assert any(n.assign.lhs.label == "grad_pu_w1" for n in master.nests)
    # the same, moved or not
    unmoved = lowering._alias_copies(lower_items(train.grad_update(loss), PRODUCTS))
    assert sorted(map(repr, nodes_of(unmoved))) == sorted(map(repr, nodes_of(code)))


def test_a_product_moves_down_to_its_consumer_when_the_consumer_cannot_move_up():
    """With the update of the master hoisted into the group adding the twin's gradient, that
    group must stay after the input gradient's product (which reads the twin, a copy of the
    master): the twin gradient's product moves down to it instead."""
    from ocannl import mixed_prec, nn_blocks

    x = T.term(np.zeros((24, 40), np.float32), label="xd", batch_dims=(24,),
               output_dims=(40,), prec="bf16")
    y, _ = mixed_prec.with_master_weights(
        prec="bf16", f=lambda: nn_blocks.mlp(x, (48,), 6, label="pd"))
    loss = T.sum(T.cast(y, "f32"))
    code = lower_items(train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.1),
                       PRODUCTS)
    gemms = {item.assign.lhs.label: k for k, item in enumerate(code) if isinstance(item, Gemm)}
    twin_grad, input_grad = gemms["grad_pd_w1_bf16"], gemms["grad_relu"]
    assert input_grad < twin_grad
    group = code[twin_grad + 1]
    assert {n.assign.lhs.label for n in group.nests} >= {"grad_pd_w1", "pd_w1"}


@pytest.mark.parametrize("native", [False, True])
def test_a_twins_gradient_product_writes_its_masters_gradient_and_rounds_it_in_place(
        monkeypatch, native):
    """The product computing a bf16 twin's gradient, whose one reader resets the master's f32
    gradient to it rounded, writes the master's gradient itself, rounded in place after: no f32
    buffer of its own; the same bits as through that buffer (in the interpreter)."""
    from ocannl import mixed_prec, nn_blocks
    from ocannl.ir import schedule

    rng = np.random.default_rng(5)
    x = T.term(rng.normal(size=(24, 40)).astype(np.float32), label="xq", batch_dims=(24,),
               output_dims=(40,), prec="bf16")
    y, _ = mixed_prec.with_master_weights(
        prec="bf16", f=lambda: nn_blocks.mlp(x, (48,), 6, label="pq"))
    loss = T.sum(T.cast(y, "f32"))
    comp = train.grad_update(loss)
    target = replace(PRODUCTS, inline_product_work=0, inline_native_work=0,
                     native_products=frozenset({Precision.bf16}) if native else frozenset())
    code = lower(comp, target)
    [g] = [item for item in code if isinstance(item, Gemm)
           and item.assign.lhs.label == "grad_pq_w1"]
    assert g.assign.lhs.prec is F32 and (g.a.node.prec is Precision.bf16) is native
    assert not any(n.label.startswith("grad_pq_w1_bf16") and n.prec is F32
                   for n in nodes_of(code))
    got = _run_from_init(loss, comp, target)
    monkeypatch.setattr(schedule, "_into_reader", lambda item, pending, out: item)
    through = _run_from_init(loss, comp, target)
    assert any(n.label.startswith("grad_pq_w1_bf16") and n.prec is F32
               for n in nodes_of(lower(comp, target)))
    for p in loss.params:
        node = p.grad
        assert got[node.id].tobytes() == through[node.id].tobytes(), node.name

