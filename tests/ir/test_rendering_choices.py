"""The last choices out of the renderers (``schedule.rendering``): how a nest converts and stores,
how products run, how a GPU launches; and the interpreter and the CPU renderer reading the same
fields, bit for bit, NaN payloads included."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from ocannl.backends.cpu import jit
from ocannl.backends.cpu.backend import CpuBackend
from ocannl.backends.cuda.plan import cuda_target
from ocannl.ir import interpret, schedule
from ocannl.ir.assignments import Accum, Comp, Const, Get, apply
from ocannl.ir.lowering import Fill, Gemm, LoopGroup, LoopNest, Lowered, lower, nodes_of
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode, Tnode

BF16 = np.dtype(ml_dtypes.bfloat16)
N = 1 << 16  # every 16-bit pattern


def _nests(code: list[Lowered]) -> list[LoopNest]:
    return [n for item in code if isinstance(item, LoopGroup) for n in item.nests]


def _on_cpu(code: list[Lowered], values: dict[int, np.ndarray], tmp_path, monkeypatch
            ) -> dict[int, np.ndarray]:
    """``code`` run by the CPU backend from ``values`` (host arrays by node id)."""
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    backend = CpuBackend()
    nodes = nodes_of(code)
    bufs = {n.id: backend.alloc(n) for n in nodes}
    for n in nodes:
        if n.id in values:
            bufs[n.id].view(np.uint8)[...] = np.ascontiguousarray(values[n.id]).view(np.uint8)
    compiled, _ = backend.compile("choices", code, nodes)
    backend.bind(compiled, tuple(bufs[n.id] for n in nodes))()
    return {n.id: backend.read(n, bufs[n.id]) for n in nodes}


def test_a_copy_keeps_payloads_arithmetic_and_scheduling_s_conversions_do_not():
    x = Tnode("x", (8,), Precision.f16)
    y = Tnode("y", (8,), Precision.f16)
    z = Tnode("z", (8,), Precision.f16)
    code = lower(Comp((Accum(y, (0,), "=", Get(x, (0,)), (8,)),
                       Accum(z, (0,), "=", apply("neg", Get(x, (0,))), (8,)))), Target())
    by_lhs = {n.assign.lhs.id: n for n in _nests(code)}
    assert by_lhs[y.id].keeps_payload and not by_lhs[z.id].keeps_payload
    # scheduling's own copies (an f32 copy of a reduction's 16-bit operand) convert plainly
    w = Tnode("w", (4,), Precision.f16)  # each cell read by every cell of s
    s = Tnode("s", (64,), Precision.f32)
    code = lower(Comp((Accum(s, (0,), "+", Get(w, (1,)), (64, 4), reset=True),)), Target())
    copies = [g for g in code if isinstance(g, LoopGroup) and g.conversion]
    assert copies and not any(n.keeps_payload for g in copies for n in g.nests)


def test_exact_bf16_stores_and_any_order_sums_are_decided_per_nest():
    x = Tnode("x", (8,), Precision.bf16)
    y = Tnode("y", (8,), Precision.bf16)
    v = Tnode("v", (8,), Precision.bf16)
    s = Tnode("s", (), Precision.f32)
    code = lower(Comp((
        Accum(y, (0,), "=", apply("relu", Get(x, (0,))), (8,)),
        Accum(v, (0,), "=", apply("mul", Get(x, (0,)), Const(3.0)), (8,)),
        Accum(s, (), "+", apply("mul", Get(x, (0,)), Const(0.0)), (8,), reset=True),
    )), Target())
    by_lhs = {n.assign.lhs.id: n for n in _nests(code)}
    assert by_lhs[y.id].exact_store and not by_lhs[v.id].exact_store
    assert by_lhs[s.id].any_order and not by_lhs[y.id].any_order


def test_the_interpreter_and_the_cpu_store_the_same_bits_nan_payloads_included(
        tmp_path, monkeypatch):
    """Exact bf16 stores (their top half) give rounding's bits in both, a NaN its sign's quiet
    NaN; a copy (``keeps_payload``) keeps a signalling f16 NaN in both."""
    x = Tnode("x", (N,), Precision.bf16, memory_mode=MemoryMode.materialized)
    y = Tnode("y", (N,), Precision.bf16, memory_mode=MemoryMode.materialized)
    h = Tnode("h", (N,), Precision.f16, memory_mode=MemoryMode.materialized)
    kept = Tnode("kept", (N,), Precision.f16, memory_mode=MemoryMode.materialized)
    code = lower(Comp((Accum(y, (0,), "=", apply("relu", Get(x, (0,))), (N,)),
                       Accum(kept, (0,), "=", Get(h, (0,)), (N,)))), Target())
    [copy] = [n for n in _nests(code) if n.assign.lhs.id == kept.id]
    assert copy.keeps_payload
    patterns = np.arange(N, dtype=np.uint32).astype(np.uint16)
    values = {x.id: patterns.view(BF16), h.id: patterns.view(np.float16)}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        want = {k: v.copy() for k, v in values.items()}
        interpret.run(code, want)
        got = _on_cpu(code, values, tmp_path, monkeypatch)
    bits = {n.id: (want[n.id].view(np.uint16), got[n.id].view(np.uint16))
            for n in (y, kept)}
    for node in (y, kept):
        w, g = bits[node.id]
        bad = np.nonzero(w != g)[0]
        assert bad.size == 0, (f"{node.name}: {bad.size} patterns differ, e.g. "
                               f"{patterns[bad[0]]:#x}: interpreter {w[bad[0]]:#x}, "
                               f"cpu {g[bad[0]]:#x}")
    nan_x = np.isnan(patterns.view(BF16).astype(np.float32))
    relu_nan = bits[y.id][0][nan_x]
    assert np.array_equal(relu_nan, (patterns[nan_x] & 0x8000) | 0x7FC0)  # its sign's quiet NaN
    assert bits[kept.id][0][0x7C01] == 0x7C01  # a signalling NaN copied


def test_tf32_rounds_to_ten_bits_of_mantissa_nearest_even():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)
    x = np.array([one + ulp / 2, one + 3 * ulp / 2, one + ulp / 4, one + 3 * ulp / 4,
                  np.nan, np.inf, -2.5], np.float32)
    got = interpret.tf32(x)
    np.testing.assert_array_equal(got[:4], [one, one + 2 * ulp, one, one + ulp])
    assert np.isnan(got[4]) and got[5] == np.inf and got[6] == -2.5


def test_products_run_single_threaded_where_the_routine_shares_them():
    a = Tnode("a", (256, 512), Precision.f32)
    b = Tnode("b", (512, 256), Precision.f32)
    c = Tnode("c", (256, 256), Precision.f32)
    product = Accum(c, (0, 2), "+", apply("mul", Get(a, (0, 1)), Get(b, (1, 2))),
                    (256, 512, 256), reset=True)
    shared = Target(threads=2, products_shared=True, product_parts=8)
    [g] = [i for i in lower(Comp((product,)), shared) if isinstance(i, Gemm)]
    assert g.split is not None and g.one_thread
    [g] = [i for i in lower(Comp((product,)), Target()) if isinstance(i, Gemm)]
    assert g.split is None and not g.one_thread


def test_a_gpu_s_launches_batched_calls_and_tf32_are_scheduling_s():
    target = cuda_target(tf32=True)
    x = Tnode("x", (16384,), Precision.f32)
    y = Tnode("y", (16384,), Precision.f32)
    code = lower(Comp((Accum(y, (0,), "=", apply("exp", Get(x, (0,))), (16384,)),)), target)
    [group] = [i for i in code if isinstance(i, LoopGroup)]
    assert (group.grid, group.block) == schedule.gpu_launch(16384, target) == (171, 96)
    fill = [i for i in lower(Comp((Accum(y, (0,), "=", Const(0.0), (16384,)),)), target)
            if isinstance(i, Fill)]
    assert fill and all((f.grid, f.block) == (171, 96) for f in fill)
    q = Tnode("q", (16, 64, 64), Precision.f32)
    k = Tnode("k", (16, 64, 64), Precision.f32)
    s = Tnode("s", (16, 64, 64), Precision.f32)
    scores = Accum(s, (0, 1, 3), "+", apply("mul", Get(q, (0, 1, 2)), Get(k, (0, 2, 3))),
                   (16, 64, 64, 64), reset=True)
    [g] = [i for i in lower(Comp((scores,)), target) if isinstance(i, Gemm)]
    assert g.tf32 and g.strided == schedule.batch_runs(g.batch)
    assert g.strided[1] is not None and g.strided[1].size == 16
    [g] = [i for i in lower(Comp((scores,)), cuda_target()) if isinstance(i, Gemm)]
    assert not g.tf32
    assert cuda_target().fma and not cuda_target(fma=False).fma


def test_reading_the_cpu_target_leaves_the_pool_as_it_is(monkeypatch):
    """``jit.target()`` is a record: reading it sizes no pool; ``size_pool`` does, to the
    record's threads."""
    jit.target()  # the engine and the pool made
    if "pool_size" not in jit._state:
        pytest.skip("no thread pool on this platform (pool.supported())")
    calls: list[int] = []
    monkeypatch.setitem(jit._state, "pool_size", calls.append)
    monkeypatch.setenv("OCANNL_THREADS", "3")
    target = jit.target()
    assert target.threads == 3 and calls == []
    jit.size_pool(target)
    assert calls == [2]


@pytest.mark.parametrize("flag", ["fma", "tf32"])
def test_the_cuda_target_refuses_a_flag_that_is_not_a_bool(flag):
    with pytest.raises(TypeError, match=rf"cuda_target: {flag} must be True or False, got 'no'"):
        cuda_target(**{flag: "no"})


@pytest.mark.parametrize("prec", [Precision.bf16, Precision.f16, Precision.f32])
def test_a_short_inner_loop_vectorized_whole_stores_the_interpreter_s_bits(
        prec, tmp_path, monkeypatch):
    """``y = relu(x + b)``, the bias ``b`` broadcast over the rows of 8 (``inner_vector``):
    rendered with the loop id asking LLVM for 8 lanes, and over every 16-bit pattern of ``x``
    (f32: those patterns as the top halves, so every class of value) the bits of the
    interpreter and of the same code with the loop left to LLVM (unrolled, scalar)."""
    from ocannl.backends.cpu.codegen import routine_ir

    x = Tnode("x", (N // 8, 8), prec, memory_mode=MemoryMode.materialized)
    b = Tnode("b", (8,), prec, memory_mode=MemoryMode.materialized)
    y = Tnode("y", (N // 8, 8), prec, memory_mode=MemoryMode.materialized)
    comp = Comp((Accum(y, (0, 1), "=", apply("relu", apply("add", Get(x, (0, 1)),
                                                              Get(b, (1,)))), (N // 8, 8)),))
    patterns = np.arange(N, dtype=np.uint32).astype(np.uint16)
    if prec is Precision.f32:
        xs = (patterns.astype(np.uint32) << 16 | 0x1234).view(np.float32)
    else:
        xs = patterns.view(prec.numpy_dtype)
    bias = np.array([0.0, -0.0, 1.5, -3.25, 1e-3, np.inf, -np.inf, np.nan], np.float32)
    values = {x.id: xs.reshape(N // 8, 8), b.id: bias.astype(prec.numpy_dtype)}
    # Which payload an f32 addition of two NaNs keeps is the compiler's (LLVM may order a
    # commutative operation's operands either way); the 16-bit stores make every NaN their
    # sign's quiet one.
    both_nan = (np.isnan(values[x.id].astype(np.float32)) & np.isnan(bias)
                if prec is Precision.f32 else np.zeros((N // 8, 8), bool))

    def run(width: int) -> tuple[np.ndarray, str]:
        monkeypatch.setattr(schedule, "SHORT_INNER", width)
        code = lower(comp, Target())
        [group] = [g for g in code if isinstance(g, LoopGroup)]
        assert group.inner_vector == (8 if width else 0)
        text = "\n".join(routine_ir(code, nodes_of(code), Target()))
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)
            got = _on_cpu(code, {k: v.ravel() for k, v in values.items()}, tmp_path,
                          monkeypatch)[y.id].reshape(y.dims)
            want = {k: v.copy() for k, v in values.items()}
            interpret.run(code, want)
        _same_bits_but_two_nans_payload(got, want[y.id], both_nan)
        return got, text

    vector, vector_ir = run(schedule.SHORT_INNER)
    scalar, scalar_ir = run(0)
    assert '!"llvm.loop.vectorize.width", i32 8' in vector_ir
    assert "llvm.loop" not in scalar_ir
    _same_bits_but_two_nans_payload(vector, scalar, both_nan)
    assert both_nan.sum() == (prec is Precision.f32) * np.isnan(xs).sum() // 8


def _same_bits_but_two_nans_payload(got: np.ndarray, want: np.ndarray, both_nan: np.ndarray
                                    ) -> None:
    """The same bits in every cell but those of ``both_nan``, where both are a NaN."""
    g, w = (a.view(np.uint16 if a.itemsize == 2 else np.uint32) for a in (got, want))
    bad = np.argwhere((g != w) & ~both_nan)
    assert bad.size == 0, f"{len(bad)} cells differ, e.g. {tuple(bad[0])}: {g[tuple(bad[0])]:#x}" \
                          f" against {w[tuple(bad[0])]:#x}"
    assert np.isnan(got[both_nan].astype(np.float32)).all()
    assert np.isnan(want[both_nan].astype(np.float32)).all()


def test_a_copy_of_a_value_arithmetic_just_wrote_converts_plainly_with_the_same_bits(
        tmp_path, monkeypatch):
    """Only a signalling NaN's bits depend on the conversion, and arithmetic never leaves one:
    a copy of a cell an earlier nest of its pass computed (an optimizer's update, then the
    master's kept twin), or of a product's result, converts with the plain instructions; a
    copy of a stored value, or of one a pass-through op (``where``) may hand on unchanged,
    keeps the payload. The interpreter keeps payloads everywhere: every f32 pattern's high
    half (each sign, exponent and NaN kind) gives its bits on the CPU."""
    m = Tnode("m", (N,), Precision.f32, memory_mode=MemoryMode.materialized)
    g = Tnode("g", (N,), Precision.f32, memory_mode=MemoryMode.materialized)
    c = Tnode("c", (N,), Precision.f32, memory_mode=MemoryMode.materialized)
    kept, held, passed = (Tnode(name, (N,), Precision.f16, memory_mode=MemoryMode.materialized)
                          for name in ("kept", "held", "passed"))
    w = Tnode("w", (N,), Precision.f32, memory_mode=MemoryMode.materialized)
    i = (0,)
    code = lower(Comp((
        Accum(m, i, "=", apply("add", Get(m, i), Get(g, i)), (N,)),
        Accum(kept, i, "=", Get(m, i), (N,)),  # just computed: plain
        Accum(held, i, "=", Get(g, i), (N,)),  # stored: keeps the payload
        Accum(w, i, "=", apply("where", Get(c, i), Get(m, i), Get(w, i)), (N,)),
        Accum(passed, i, "=", Get(w, i), (N,)),  # maybe w's old value: keeps it
    )), Target())
    by_lhs = {n.assign.lhs.id: n for n in _nests(code)}
    assert not by_lhs[kept.id].keeps_payload
    assert by_lhs[held.id].keeps_payload and by_lhs[passed.id].keeps_payload
    # a product's result, then a rounded read of it in place (a twin's gradient into its
    # master's), and a rounded read of a stored node
    a, b, p = (Tnode(name, (8, 8), Precision.f32, memory_mode=MemoryMode.materialized)
               for name in ("a", "b", "p"))
    q = Tnode("q", (8, 8), Precision.f32, memory_mode=MemoryMode.materialized)
    two = (0, 1)
    product = lower(Comp((
        Accum(p, two, "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))), (8, 8, 8),
              reset=True),
        Accum(p, two, "=", Get(p, two, rounded=Precision.f16), (8, 8)),
        Accum(q, two, "=", Get(a, two, rounded=Precision.f16), (8, 8)),
    )), Target())
    rounds = {n.assign.lhs.id: n for n in _nests(product)}
    assert not rounds[p.id].keeps_payload and not rounds[p.id].payload_rounds
    assert rounds[q.id].payload_rounds == {a.id}

    patterns = np.arange(N, dtype=np.uint32) << 16 | 0x1234
    values = {m.id: np.zeros(N, np.float32), g.id: patterns.view(np.float32),
              c.id: np.zeros(N, np.float32), w.id: patterns.view(np.float32)[::-1].copy()}
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        want = {k: v.copy() for k, v in values.items()}
        interpret.run(code, want)
        got = _on_cpu(code, values, tmp_path, monkeypatch)
    for node in (m, kept, held, w, passed):
        bits = want[node.id].view(np.uint8), got[node.id].view(np.uint8)
        assert np.array_equal(*bits), node.name
    # 0x7F811234, a signalling NaN: copied from storage it stays one (payload 0x8, no quiet
    # bit); summed into m, it is quiet before its copy
    assert got[held.id].view(np.uint16)[0x7F81] == 0x7C08
    assert got[kept.id].view(np.uint16)[0x7F81] == 0x7E08


def _patches(b: int, h: int, w: int, c: int, k: int, stride: int, pad: int, src: Precision,
             dst: Precision) -> tuple[Comp, Tnode, Tnode]:
    """im2col's gather ``P[b, oh, ow, kh, kw, c] = X[b, s*oh + kh - p, s*ow + kw - p, c]``
    (0 outside ``X``), from ``src`` cells into ``dst`` ones."""
    from ocannl.ir.assignments import Affine

    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    x = Tnode("x", (b, h, w, c), src, memory_mode=MemoryMode.materialized)
    p = Tnode("p", (b, oh, ow, k, k, c), dst, memory_mode=MemoryMode.materialized)
    read = Get(x, (0, Affine(((stride, 1), (1, 3)), -pad), Affine(((stride, 2), (1, 4)), -pad),
                   5))
    return Comp((Accum(p, tuple(range(6)), "=", read, (b, oh, ow, k, k, c)),)), x, p


def _patches_reference(x: np.ndarray, k: int, stride: int, pad: int) -> np.ndarray:
    b, h, w, c = x.shape
    padded = np.zeros((b, h + 2 * pad, w + 2 * pad, c), x.dtype)
    padded[:, pad:pad + h, pad:pad + w] = x
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    out = np.zeros((b, oh, ow, k, k, c), x.dtype)
    for i in range(oh):
        for j in range(ow):
            out[:, i, j] = padded[:, i * stride:i * stride + k, j * stride:j * stride + k]
    return out


@pytest.mark.parametrize(("shape", "run"), [
    ((2, 4, 4, 8, 3, 1, 1), 2),  # a window row's offsets and channels: runs of 24 cells
    ((2, 5, 7, 3, 3, 2, 1), 2),  # stride 2, 9 cells a run
    ((1, 6, 6, 8, 5, 1, 2), 2),  # padding 2: up to two cells of zeros at either end
    ((2, 4, 4, 8, 3, 1, 4), 2),  # padding past the window: whole runs of zeros
    ((2, 4, 4, 16, 1, 1, 1), 2),  # a 1 x 1 window over padding: runs of 16 (kw of 1, c)
    ((2, 8, 8, 1, 3, 1, 1), 0),  # runs of 3 cells: point by point (RUN_MIN_CELLS)
])
@pytest.mark.parametrize(("src", "dst"), [(Precision.f32, Precision.f32),
                                          (Precision.f16, Precision.f32),
                                          (Precision.bf16, Precision.bf16)])
def test_padded_copies_run_as_runs_with_the_bits_of_the_points(shape, run, src, dst, tmp_path,
                                                               monkeypatch):
    """im2col's patches: where a window row's offsets and channels are contiguous in the
    patches and in the image, each run of them is copied as zeros, a read and zeros
    (``LoopGroup.run``), with the point-by-point nest's bits (a 16-bit image widened, or
    copied as stored), NaN payloads and signed zeros included, and NumPy's values."""
    b, h, w, c, k, stride, pad = shape
    comp, x, p = _patches(b, h, w, c, k, stride, pad, src, dst)
    code = lower(comp, Target())  # a 16-bit image into f32 patches: gathered from a copy
    (group,) = [g for g in code if isinstance(g, LoopGroup) and g.lead.assign.lhs is p]
    assert group.run == run
    rng = np.random.default_rng(sum(shape))
    values = rng.standard_normal(x.dims).astype(src.numpy_dtype)
    flat = values.reshape(-1)
    flat[::7] = -0.0
    bits = flat.view(np.uint32 if src is Precision.f32 else np.uint16)
    bits[3::11] = 0x7FC00001 if src is Precision.f32 else 0x7E01  # a quiet NaN's payload
    got = _on_cpu(code, {x.id: values.reshape(-1)}, tmp_path / "runs", monkeypatch)[p.id]
    monkeypatch.setattr(schedule, "copy_run", lambda item: 0)
    points = lower(comp, Target())
    assert all(g.run == 0 for g in points if isinstance(g, LoopGroup))
    want = _on_cpu(points, {x.id: values.reshape(-1)}, tmp_path / "points", monkeypatch)[p.id]
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    ref = _patches_reference(values.astype(dst.numpy_dtype), k, stride, pad)
    np.testing.assert_array_equal(got.reshape(ref.shape), ref)


def test_a_copy_run_needs_contiguous_cells_and_one_moving_index():
    """No run where the innermost cells of the read are not those of the patches (the channels
    outermost in the image), or where the run's second iterator moves an index (a window
    offset before the channels is not the run's first)."""
    from ocannl.ir.assignments import Affine

    x = Tnode("x", (2, 4, 8, 8), Precision.f32, memory_mode=MemoryMode.materialized)  # b c h w
    p = Tnode("p", (2, 4, 4, 3, 3, 4), Precision.f32, memory_mode=MemoryMode.materialized)
    read = Get(x, (0, 5, Affine(((2, 1), (1, 3)), -1), Affine(((2, 2), (1, 4)), -1)))
    comp = Comp((Accum(p, tuple(range(6)), "=", read, (2, 4, 4, 3, 3, 4)),))
    (group,) = [g for g in lower(comp, Target()) if isinstance(g, LoopGroup)]
    assert group.run == 0
    q = Tnode("q", (2, 4, 4, 4, 3), Precision.f32, memory_mode=MemoryMode.materialized)
    y = Tnode("y", (2, 4, 4, 4), Precision.f32, memory_mode=MemoryMode.materialized)
    # q[b, i, j, c, kw] = y[b, i, j + kw - 1, c]: the run (c, kw) moves the index by kw, last
    read = Get(y, (0, 1, Affine(((1, 2), (1, 4)), -1), 3))
    comp = Comp((Accum(q, tuple(range(5)), "=", read, (2, 4, 4, 4, 3)),))
    (group,) = [g for g in lower(comp, Target()) if isinstance(g, LoopGroup)]
    assert group.run == 0
