"""The CPU backend's own f32 ``exp``, ``tanh`` and ``erf`` (``cpu/scalar.py``: f64 arithmetic that
vectorizes, where libm's are scalar calls): within one ulp of the f64 result rounded to f32,
over a dense grid, dense sweeps of f32 bit patterns (erf's every 101st from 0 to 4.5 and every
f32 near its pieces' boundaries), the subnormal and overflow edges and the special values, in a
vectorized loop and in its scalar remainder alike."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from ocannl import Context
from ocannl.ir import schedule
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.target import PRODUCTS, Target
from ocannl.ir.tnode import Tnode


def _run(op: str, x: np.ndarray) -> np.ndarray:
    a, out = Tnode("a", (x.size,), Precision.f32), Tnode("out", (x.size,), Precision.f32)
    ctx = Context.cpu()
    ctx.set_values(a, x)
    ctx, r = ctx.compile(Comp((Accum(out, (0,), "=", apply(op, Get(a, (0,))), (x.size,)),)))
    ctx.run(r)
    return ctx.get_values(out)


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Distance in units in the last place (f32 patterns as ordered integers)."""
    def ordered(v: np.ndarray) -> np.ndarray:
        i = v.astype(np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return np.abs(ordered(got) - ordered(want))


GRID = np.concatenate([
    np.linspace(-110.0, 95.0, 200_003, dtype=np.float32),  # odd count: a scalar remainder
    np.linspace(-1e-3, 1e-3, 2001, dtype=np.float32),
    np.array([0.0, -0.0, 88.72283, 88.72284, 88.7229, -87.33654, -103.97, -103.98, -104.5,
              1e-30, -1e-30, 2.0 ** -13, -(2.0 ** -12), 20.0, -20.0, 44.5], np.float32),
])


@pytest.mark.parametrize("op,f64", [("exp", np.exp), ("tanh", np.tanh),
                                    ("erf", np.vectorize(math.erf, otypes=[np.float64]))])
def test_f32_exp_and_tanh_are_within_an_ulp(op, f64):
    with np.errstate(over="ignore"):
        want = f64(GRID.astype(np.float64)).astype(np.float32)
    got = _run(op, GRID)
    assert np.array_equal(np.isinf(got), np.isinf(want)), op
    finite = np.isfinite(want)
    worst = _ulps(got[finite], want[finite]).max()
    assert worst <= 1, (op, int(worst))
    # how often it is exactly the rounded f64 value: nearly always
    assert np.mean(got[finite] == want[finite]) > 0.999


def _f32_from(lo: float, hi: float, stride: int = 1) -> np.ndarray:
    """Every ``stride``-th f32 from ``lo`` to ``hi`` (0 <= lo <= hi), by bit pattern."""
    a, b = np.array([lo, hi], np.float32).view(np.int32)
    return np.arange(a, b + 1, stride, dtype=np.int32).view(np.float32)


def _near(*points: float, ulps: int = 5000) -> np.ndarray:
    """Every f32 within ``ulps`` of each point (positive points)."""
    return np.concatenate([np.arange(p - ulps, p + ulps + 1, dtype=np.int32).view(np.float32)
                           for p in np.array(points, np.float32).view(np.int32)])


def _check(op: str, f64, x: np.ndarray, exact: float) -> None:
    """``op`` on ``x`` and ``-x``: within an ulp of ``f64`` rounded to f32, and equal to it at
    least a fraction ``exact`` of the time."""
    x = np.concatenate([x, -x])
    with np.errstate(over="ignore"):
        want = f64(x.astype(np.float64)).astype(np.float32)
    got = _run(op, x)
    assert np.array_equal(np.isinf(got), np.isinf(want)), op
    finite = np.isfinite(want)
    worst = _ulps(got[finite], want[finite])
    assert worst.max() <= 1, (op, int(worst.max()), x[finite][np.argmax(worst)])
    assert np.mean(got[finite] == want[finite]) >= exact, (op, np.mean(got == want))


def test_f32_erf_over_the_whole_line():
    """erf's pieces (``scalar.erf``) over every 101st f32 in [0, 4.5] (10.7 million, every
    binade from the subnormals up) and every f32 within 5000 ulps of where the pieces meet
    (1.35), where erf starts rounding to 1 (3.919206) and where |x| is clamped (4); both signs.
    Within an ulp of the f64 erf rounded (SciPy's, which rounds as ``math.erf`` does), equal to
    it all but a few times in a million (an exhaustive sweep of [0, 4.5]: 3201 of 1.08e9 off by
    one); 1 exactly from where erf rounds to 1, and 2 / sqrt(pi) x rounded for tiny x."""
    from scipy.special import erf

    _check("erf", erf, _f32_from(0.0, 4.5, 101), 0.99999)
    # erf is flat below 3.919206 (it moves 6e-14 an ulp of x) and within the polynomial's error
    # of 1 - 2^-25, the tie between 1 and the f32 below, for some 300 f32 (281 round up to 1)
    _check("erf", erf, _near(1.35, 3.919206, 4.0), 0.98)
    beyond = np.concatenate([_f32_from(3.919206, 4.5, 7), _f32_from(4.5, 3e38, 100_003)])
    assert np.all(_run("erf", beyond) == 1.0) and np.all(_run("erf", -beyond) == -1.0)
    tiny = _f32_from(0.0, 1e-8, 1009)
    assert np.array_equal(_run("erf", tiny),
                          (tiny.astype(np.float64) * (2 / math.sqrt(math.pi))).astype(np.float32))


@pytest.mark.parametrize("op,f64,top", [("exp", np.exp, 104.0), ("tanh", np.tanh, 12.0)])
def test_f32_exp_and_tanh_over_their_range(op, f64, top):
    """Every 97th f32 from 0 to ``top`` (beyond which exp is 0 or inf, tanh +-1), both signs:
    within an ulp of the f64 function rounded, equal to it all but a few times in a million."""
    _check(op, f64, _f32_from(0.0, top, 97), 0.99999)
    assert _run("exp", np.zeros(1, np.float32))[0] == 1.0


def test_the_polynomials_are_their_fits():
    """The tables in ``scalar.py`` are what ``_chebyshev_fit`` gives (up to the last bits a
    NumPy or libm may change)."""
    from ocannl.backends.cpu import scalar as s

    c0 = 2 / math.sqrt(math.pi)
    h = s._LN2 / 2
    fits = {
        "_ERF_SMALL": (c0, *s._chebyshev_fit(
            lambda u: (math.erf(math.sqrt(u)) / math.sqrt(u) - c0) / u, 0.0,
            s._ERF_SPLIT ** 2, 8, mapped=False)),
        "_ERF_LARGE": s._chebyshev_fit(math.erf, s._ERF_SPLIT, s._ERF_END, 16, mapped=True),
        "_EXP_POLY": (1.0, *s._chebyshev_fit(lambda r: math.expm1(r) / r, -h, h, 7,
                                             mapped=False)),
    }
    for name, fit in fits.items():
        np.testing.assert_allclose(getattr(s, name), fit, rtol=1e-9, atol=1e-15, err_msg=name)


def test_special_values():
    x = np.array([np.nan, np.inf, -np.inf, 1000.0, -1000.0], np.float32)
    e, t, f = _run("exp", x), _run("tanh", x), _run("erf", x)
    assert np.isnan(e[0]) and np.isnan(t[0]) and np.isnan(f[0])
    assert list(e[1:]) == [np.inf, 0.0, np.inf, 0.0]
    assert list(t[1:]) == [1.0, -1.0, 1.0, -1.0]
    assert list(f[1:]) == [1.0, -1.0, 1.0, -1.0]
    z = _run("erf", np.array([0.0, -0.0], np.float32))
    assert list(np.signbit(z)) == [False, True]


def test_loops_shared_over_threads_give_the_same_bits(monkeypatch):
    """A large loop group split over threads (``OCANNL_THREADS``) computes what one thread
    does, bit for bit: a pointwise chain, a row reduction, each over 2^17 points, and sums
    over the first axis, a lone row of partial sums shared by blocks of its cells (the last
    block partial)."""
    from ocannl.backends.cpu import jit
    from ocannl.ir.lowering import lower

    n, m, w = 512, 256, 200
    x, y = Tnode("x", (n, m), Precision.f32), Tnode("y", (n, m), Precision.f32)
    s = Tnode("s", (n,), Precision.f32)
    z, cols = Tnode("z", (n, w), Precision.f32), Tnode("cols", (w,), Precision.f32)
    comp = Comp((
        Accum(y, (0, 1), "=", apply("tanh", apply("mul", Get(x, (0, 1)), Get(x, (0, 1)))), (n, m)),
        Accum(s, (0,), "+", apply("exp", Get(y, (0, 1))), (n, m), reset=True),
        Accum(cols, (1,), "+", apply("exp", Get(z, (0, 1))), (n, w), reset=True),
    ))
    items = lower(comp, PRODUCTS)
    assert len(items) == 3 and items[2].lead.walk_rows
    two = replace(PRODUCTS, threads=2)
    assert schedule.group_split(items[2], two) == -(-w // schedule.ROW_BLOCK)
    rng = np.random.default_rng(0)
    xv = rng.normal(size=(n, m)).astype(np.float32)
    zv = rng.normal(size=(n, w)).astype(np.float32)

    def run(threads: int) -> list[np.ndarray]:
        monkeypatch.setattr(jit, "threads", lambda: threads)
        ctx = Context.cpu()
        ctx.set_values(x, xv).set_values(z, zv)
        ctx, r = ctx.compile(comp)
        ctx.run(r)
        return [ctx.get_values(t) for t in (y, s, cols)]

    one, three = run(1), run(3)
    assert [a.tobytes() for a in one] == [a.tobytes() for a in three]
    np.testing.assert_allclose(one[1], np.exp(np.tanh(xv.astype(np.float64) ** 2)).sum(1),
                               rtol=1e-5)
    np.testing.assert_allclose(one[2], np.exp(zv.astype(np.float64)).sum(0), rtol=1e-5)


@pytest.mark.parametrize("prec", [Precision.f32, Precision.bf16])
def test_products_shared_over_threads_give_the_same_bits(monkeypatch, prec):
    """Products shared out over threads (by blocks of rows, of columns, by batch points; each
    part a single-threaded BLAS call) compute what one thread does, bit for bit, 16-bit
    operands and targets included (their conversions shared out too), accumulating products
    too."""
    from ocannl.backends.cpu import blas, jit
    from ocannl.ir.lowering import Gemm, lower

    assert blas.chosen().threads is not None, f"{blas.chosen().name}'s thread controls not found"
    m, k, n, batch = 250, 64, 80, 6  # more rows than columns, a partial last block
    a, w = Tnode("a", (m, k), prec), Tnode("w", (n, k), prec)
    c = Tnode("c", (m, n), prec)
    q, v = Tnode("q", (batch, m, k), prec), Tnode("v", (batch, n, k), prec)
    s = Tnode("s", (batch, m, n), prec)
    m2, n2 = 40, 300  # more columns than rows; a stored transposed, accumulated into
    a2, w2 = Tnode("a2", (k, m2), prec), Tnode("w2", (k, n2), prec)
    c2 = Tnode("c2", (m2, n2), prec)
    comp = Comp((  # c[i, j] = sum_l a[i, l] w[j, l];  s[b, i, j] = sum_l q[b, i, l] v[b, j, l]
        Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(w, (1, 2))), (m, n, k), True),
        Accum(s, (0, 1, 2), "+", apply("mul", Get(q, (0, 1, 3)), Get(v, (0, 2, 3))),
              (batch, m, n, k), True),
        Accum(c2, (0, 1), "+", apply("mul", Get(a2, (2, 0)), Get(w2, (2, 1))), (m2, n2, k)),
    ))
    assert len([i for i in lower(comp, Target(im2col=False)) if isinstance(i, Gemm)]) == 3
    rng = np.random.default_rng(1)
    vals = {t: rng.normal(size=t.dims) for t in (a, w, q, v, a2, w2, c2)}

    def run(threads: int) -> list[bytes]:
        monkeypatch.setattr(jit, "threads", lambda: threads)
        ctx = Context.cpu()
        for t, x in vals.items():
            ctx.set_values(t, x)
        ctx, r = ctx.compile(comp)
        ctx.run(r)
        return [ctx.get_values(t).tobytes() for t in (c, s, c2)]

    one = run(1)
    assert run(3) == one
    got = np.frombuffer(one[2], dtype=prec.numpy_dtype).reshape(m2, n2).astype(np.float64)
    rounded = {t: vals[t].astype(prec.numpy_dtype).astype(np.float64) for t in (a2, w2, c2)}
    np.testing.assert_allclose(got, rounded[c2] + rounded[a2].T @ rounded[w2], rtol=0.02,
                               atol=0.3)


def test_a_silent_compiling_child_is_stopped_and_its_part_compiled_here(monkeypatch, tmp_path):
    """A large routine's parts compile in forked children; one that writes nothing (stuck, say,
    on a lock it inherited) is killed after ``CHILD_TIMEOUT_S`` and its part compiled in this
    process, so the routine still comes out, and computes the right values."""
    import os
    import time

    from ocannl.backends.cpu import jit

    parent = os.getpid()
    compile_here = jit._object

    def stuck_in_children(text: str, bits: int = 256) -> bytes:
        if os.getpid() != parent:
            time.sleep(60)
        return compile_here(text, bits)

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_object", stuck_in_children)
    monkeypatch.setattr(jit, "CHILD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(jit, "workers", lambda: 2)
    n = 200  # 200 separate items (each its own space): more than two parts' worth
    xs = [Tnode(f"x{k}", (k + 1,), Precision.f32) for k in range(n)]
    ys = [Tnode(f"y{k}", (k + 1,), Precision.f32) for k in range(n)]
    comp = Comp(tuple(Accum(y, (0,), "=", apply("exp", Get(x, (0,))), (x.size,))
                      for x, y in zip(xs, ys, strict=True)))
    ctx = Context.cpu()
    for x in xs:
        ctx.set_values(x, np.full(x.size, 0.5, np.float32))
    t0 = time.perf_counter()
    ctx, r = ctx.compile(comp)
    assert time.perf_counter() - t0 < 30
    ctx.run(r)
    assert all(np.allclose(ctx.get_values(y), np.exp(0.5)) for y in ys)


@pytest.mark.parametrize("cols", [24, 20, 6])  # jammed by 8, by 4; 6: by 2
def test_jammed_reductions_sum_each_cell_in_order(cols):
    """A lone reduction computes several cells at once (``LoopGroup.jam``, scheduling's
    choice): each cell still takes its terms in order, so an f32 sum is bitwise the
    sequential one and a max is exact."""
    from ocannl.ir.lowering import LoopGroup, lower

    rows, terms = 5, 37
    x = Tnode("xj", (rows, cols, terms), Precision.f32)
    s, m = Tnode("sj", (rows, cols), Precision.f32), Tnode("mj", (rows, cols), Precision.f32)
    comp = Comp((
        Accum(s, (0, 1), "+", apply("exp", Get(x, (0, 1, 2))), (rows, cols, terms), True),
        Accum(m, (0, 1), "max", Get(x, (0, 1, 2)), (rows, cols, terms), True),
    ))
    groups = [i for i in lower(comp, PRODUCTS) if isinstance(i, LoopGroup)]
    assert len(groups) == 2 and all(g.jam > 1 for g in groups)
    xv = np.random.default_rng(4).normal(size=(rows, cols, terms)).astype(np.float32) * 3
    ctx = Context.cpu()
    ctx.set_values(x, xv)
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    e = _run("exp", xv.reshape(-1)).reshape(xv.shape)  # the backend's own f32 exp
    expected = np.zeros((rows, cols), np.float32)
    for k in range(terms):  # in order, rounding to f32 after every addition
        expected = (expected + e[:, :, k]).astype(np.float32)
    assert ctx.get_values(s).tobytes() == expected.tobytes()
    assert ctx.get_values(m).tobytes() == xv.max(axis=2).tobytes()


@pytest.mark.parametrize("prec", ["f32", "bf16", "f16", "f64"])
def test_row_sums_transposed_in_registers_add_each_row_in_order(prec):
    """A row sum (the rows jammed, each read contiguous along the terms: a layer norm's) runs
    as vectors of its rows, each transposed from one vector load per row and ``jam`` terms
    (``LoopGroup.transposed``): every row still adds its terms in order, rounding to the
    sum's precision (f64 for f64 values, else f32) after every addition, from 16-bit values
    widened exactly; NaN and infinities pass as they do one by one."""
    from ocannl.ir.lowering import LoopGroup, lower

    rows, terms = 24, 64
    p = Precision(prec)
    acc = Precision.f64 if p is Precision.f64 else Precision.f32
    x, w = Tnode("tx", (2, rows, terms), p), Tnode("tw", (2, rows, terms), p)
    s, d = Tnode("ts", (2, rows), acc), Tnode("td", (2, rows), acc)
    comp = Comp((
        Accum(s, (0, 1), "+", Get(x, (0, 1, 2)), (2, rows, terms), True),
        Accum(d, (0, 1), "+", apply("mul", Get(x, (0, 1, 2)), Get(w, (0, 1, 2))),
              (2, rows, terms), True),
    ))
    groups = [i for i in lower(comp, PRODUCTS) if isinstance(i, LoopGroup)]
    assert [(g.jam, g.lanes, g.transposed) for g in groups] == [(8, True, (0,)),
                                                                (8, True, (0, 1))]
    rng = np.random.default_rng(5)
    xv = rng.normal(size=(2, rows, terms)) * 3
    wv = rng.normal(size=(2, rows, terms))
    xv[0, 3, 7], xv[1, 9, 60], wv[0, 12, 0] = np.nan, np.inf, -np.inf
    ctx = Context.cpu().set_values(x, xv).set_values(w, wv)
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    dt = acc.numpy_dtype
    xs = ctx.get_values(x).astype(dt)  # the values as stored (rounded to prec)
    ws = ctx.get_values(w).astype(dt)
    want_s, want_d = np.zeros((2, rows), dt), np.zeros((2, rows), dt)
    with np.errstate(invalid="ignore"):
        for k in range(terms):  # in order, rounding after every addition
            want_s = (want_s + xs[:, :, k]).astype(dt)
            want_d = (want_d + (xs[:, :, k] * ws[:, :, k]).astype(dt)).astype(dt)
    assert ctx.get_values(s).tobytes() == want_s.tobytes()
    assert ctx.get_values(d).tobytes() == want_d.tobytes()


@pytest.mark.parametrize("prec", ["f32", "bf16", "f16"])
def test_jammed_reductions_in_vectors_give_the_bits_of_scalar_cells(monkeypatch, tmp_path, prec):
    """A jammed reduction whose term vectors take (``schedule.lanes``) runs as one vector of
    its cells: a padded 3x3 convolution into 8 channels (its kernel, channels apart, packed
    first; its output stored as a vector) and a max across rows (each read gathered) over NaN,
    infinities and signed zeros. They give the bits of the cells computed one by one."""
    import ocannl.tensor as T
    from ocannl import train
    from ocannl.backends.cpu import codegen
    from ocannl.backends.cpu.backend import CpuBackend
    from ocannl.tensor.spatial import conv2d

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(11)
    xv, kv = rng.uniform(-1, 1, (4, 6, 6, 1)), rng.uniform(-1, 1, (8, 3, 3, 1))
    mv = rng.normal(size=(2, 16, 40)).astype(np.float32)
    mv[0, 3, 7], mv[0, 4, :] = np.nan, -0.0
    mv[0, 5, :20], mv[0, 5, 20:] = 0.0, -0.0
    mv[1, 6, 9], mv[1, 7, :] = np.inf, -np.inf
    vectors = []
    lanes = schedule.lanes

    def run(vector: bool) -> list[bytes]:
        monkeypatch.setattr(codegen, "_VERSION", f"{codegen._VERSION}-{vector}")
        monkeypatch.setattr(CpuBackend, "_compiled", {})
        monkeypatch.setattr(schedule, "lanes", lambda *a: (
            vectors.append(lanes(*a) is not None) or lanes(*a)) if vector else None)
        x = T.term(xv.astype(np.float32), label="lx", batch_dims=(4,), output_dims=(6, 6, 1),
                   prec=prec)
        kernel = T.term(kv.astype(np.float32), label="lk", output_dims=(8,),
                        input_dims=(3, 3, 1), prec=prec)
        y = conv2d(x, kernel, padding=1)
        m_in = Tnode("lm_in", (2, 16, 40), Precision(prec))
        m = Tnode("lm", (2, 16), Precision(prec))
        ctx = Context.cpu().set_values(m_in, mv)
        ctx, r = ctx.compile(train.forward(y) + Comp((
            Accum(m, (0, 1), "max", Get(m_in, (0, 1, 2)), (2, 16, 40), True),)))
        ctx.run(r)
        return [ctx.get_values(y).tobytes(), ctx.get_values(m).tobytes()]

    scalar = run(False)
    assert run(True) == scalar
    # Both ran as vectors: the convolution stored as vectors (rounded lane by lane to 16
    # bits), the 16-bit max widening its gathered cells lane by lane as it loads them.
    assert vectors == [True, True]
    conv, top = (np.frombuffer(v, Precision(prec).numpy_dtype) for v in scalar)
    expected = np.nanmax(np.where(np.isnan(mv), np.inf, mv), axis=2)
    expected[0, 3] = np.nan
    np.testing.assert_array_equal(top.astype(np.float32).reshape(2, 16),
                                  expected.astype(Precision(prec).numpy_dtype).astype(np.float32))
    assert np.isfinite(conv.astype(np.float32)).all()


@pytest.mark.parametrize("prec", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("channels", [8, 16])
def test_a_short_row_walk_runs_as_vectors_of_its_cells_with_the_walks_bits(
        monkeypatch, tmp_path, prec, channels):
    """Patch gradients summed back into a padded image (a convolution's input gradient): a row
    walk over the channels lowering chose, run as jammed vectors of the row's cells where the
    row is short (``schedule.SHORT_ROW``) and its read padded (checked cell by cell, the walk
    stays scalar code), each cell taking its nine terms in the walk's order,
    the padding's zeros included: the walk's bits, over NaN, infinities and negative zeros."""
    from ocannl.backends.cpu import codegen
    from ocannl.backends.cpu.backend import CpuBackend
    from ocannl.ir.assignments import Affine
    from ocannl.ir.lowering import LoopGroup, lower

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    p = Precision(prec)
    b, h, w = 2, 5, 6
    pg = Tnode("rpg", (b, h, w, 3, 3, channels), Precision.f32)
    img = Tnode("rimg", (b, h, w, channels), p)
    comp = Comp((Accum(img, (0, 1, 2, 3), "+", Get(pg, (
        0, Affine(((1, 1), (-1, 4)), 1), Affine(((1, 2), (-1, 5)), 1), 4, 5, 3)),
        (b, h, w, channels, 3, 3), reset=True),))
    rng = np.random.default_rng(3)
    values = rng.normal(size=pg.dims).astype(np.float32)
    values[0, 1, 2, 0, 0, 3], values[1, 2, 3, 1, 1, 5] = np.nan, np.inf
    values[0, 3, 3, :, :, 1], values[1, 0, 0, :, :, 2] = -0.0, -np.inf

    def run(short_row: int) -> tuple[LoopGroup, bytes]:
        monkeypatch.setattr(schedule, "SHORT_ROW", short_row)
        monkeypatch.setattr(codegen, "_VERSION", f"{codegen._VERSION}-{short_row}")
        monkeypatch.setattr(CpuBackend, "_compiled", {})
        [group] = [i for i in lower(comp, PRODUCTS) if isinstance(i, LoopGroup)]
        ctx = Context.cpu().set_values(pg, values)
        ctx, r = ctx.compile(comp)
        ctx.run(r)
        return group, ctx.get_values(img).tobytes()

    short = schedule.SHORT_ROW
    walk, walked = run(0)
    vectors, got = run(short)
    assert walk.lead.walk_rows and not walk.jam
    assert not vectors.lead.walk_rows and vectors.jam == 8 and vectors.lanes
    assert got == walked
    out = np.frombuffer(got, p.numpy_dtype).astype(np.float32).reshape(img.dims)
    assert np.isnan(out).any() and np.isinf(out).any()
    # an unpadded row walk (a bias's gradient over heads of 32) vectorizes as it is: kept
    g, bias = Tnode("rg", (64, 4, 32), p), Tnode("rb", (4, 32), Precision.f32)
    [kept] = [i for i in lower(Comp((Accum(bias, (1, 2), "+", Get(g, (0, 1, 2)), (64, 4, 32),
                                           reset=True),)), PRODUCTS) if isinstance(i, LoopGroup)]
    assert kept.lead.walk_rows and not kept.jam
