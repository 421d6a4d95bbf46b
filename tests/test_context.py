"""Context: buffers, host transfers, compile/run, the compile count and the on-disk cache."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, Routine, train
from ocannl.ir.assignments import Comp


def _unique() -> float:
    """A constant no other test's code contains: the routine that folds it is new code."""
    return 1.0 + (uuid.uuid4().int % 10**9) / 10**10


def _scaled(n: int = 6):
    """``y = x * s * c`` with ``s`` a scalar term the host sets (a scalar broadcasts; a term of
    shape [1] would not: a 1 the user gives does not stretch), ``c`` a folded constant unique
    to this call."""
    c = _unique()
    x = T.term(np.arange(n, dtype=np.float64), label="x")
    s = T.term(2.0, label="s")
    y = x * s * c
    return x, s, y, c


# --- set_values / get_values ------------------------------------------------------------------


def test_set_values_wrong_size_raises_naming_both_sizes_and_keeps_the_buffer():
    p = T.param("p", batch_dims=(2,), output_dims=(3,), input_dims=())
    ctx = Context.cpu()
    before = np.arange(6, dtype=np.float32).reshape(2, 3)
    ctx.set_values(p, before)
    for bad in (np.ones(5), np.ones((2, 4)), [], np.ones(7)):
        with pytest.raises(ValueError) as err:
            ctx.set_values(p, bad)
        msg = str(err.value)
        assert f"got {np.size(bad)} values" in msg and "expected 6" in msg, msg
        assert p.value.name in msg
        np.testing.assert_array_equal(ctx.get_values(p), before)


def test_set_values_wrong_size_on_a_new_node_allocates_nothing():
    p = T.param("p", output_dims=(4,), input_dims=())
    ctx = Context.cpu()
    with pytest.raises(ValueError, match="got 3 values .* expected 4"):
        ctx.set_values(p, [1, 2, 3])
    assert not ctx.is_initialized(p)
    assert ctx.mem() == 0


def test_set_values_takes_any_array_like_of_the_right_size():
    p = T.param("p", batch_dims=(2,), output_dims=(3,), input_dims=())
    ctx = Context.cpu()
    assert ctx.set_values(p, [[1, 2, 3], [4, 5, 6]]) is ctx  # allocates
    assert ctx.is_initialized(p)
    got = ctx.get_values(p)
    assert got.dtype == np.float32 and got.shape == (2, 3)
    ctx.set_values(p, np.arange(6))  # flat, row-major
    np.testing.assert_array_equal(ctx.get_values(p), np.arange(6).reshape(2, 3))
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):  # same size, another shape
        ctx.set_values(p, np.arange(6).reshape(3, 2))
    np.testing.assert_array_equal(ctx.get_values(p), np.arange(6).reshape(2, 3))
    ctx.set_values(p, range(6, 12))
    np.testing.assert_array_equal(ctx.get_values(p).ravel(), np.arange(6, 12))
    # the returned array is a copy: changing it does not change the buffer
    got = ctx.get_values(p)
    got[:] = -1
    assert ctx.get_values(p)[0, 0] == 6


def test_non_numeric_values_are_rejected():
    p = T.param("p", output_dims=(2,), input_dims=())
    ctx = Context.cpu()
    ctx.set_values(p, [1.0, 2.0])
    for bad in (np.array(["a", "b"]), np.array([1 + 2j, 3j])):
        with pytest.raises(ValueError, match="must be numbers"):
            ctx.set_values(p, bad)
    np.testing.assert_array_equal(ctx.get_values(p), [1.0, 2.0])


def test_unknown_node_is_a_clear_error():
    p = T.param("p", output_dims=(2,), input_dims=())
    ctx = Context.cpu()
    for op in (ctx.get_values, ctx.get_value, ctx.mem, ctx.to_host):
        with pytest.raises(ValueError) as err:
            op(p)
        assert p.value.name in str(err.value) and "no buffer" in str(err.value)
    with pytest.raises(TypeError, match="expected a Tensor or a Tnode, got str"):
        ctx.get_values("p")


def test_get_and_set_value():
    p = T.param("p", batch_dims=(2,), output_dims=(3,), input_dims=())
    s = T.term([0.5], label="s")
    ctx = Context.cpu()
    ctx.set_value(p, 7.0, (1, 2))  # allocates, the rest zero
    np.testing.assert_array_equal(ctx.get_values(p), [[0, 0, 0], [0, 0, 7]])
    ctx.set_value(p, -1.5, (0, 1))
    assert ctx.get_value(p, (0, 1)) == -1.5 and ctx.get_value(p, (1, 2)) == 7.0
    ctx.set_value(s, 3.25)
    assert ctx.get_value(s) == 3.25
    with pytest.raises(ValueError, match=r"has dims \(2, 3\): give an index"):
        ctx.get_value(p)
    for idx in [(2, 0), (0, 3), (0,), (0, 0, 0), (-1, 0)]:
        with pytest.raises(ValueError, match=r"out of range for p_\d+ with dims \(2, 3\)"):
            ctx.set_value(p, 1.0, idx)
    np.testing.assert_array_equal(ctx.get_values(p), [[0, -1.5, 0], [0, 0, 7]])


@pytest.mark.parametrize("prec", ["f64", "f32", "f16", "bf16"])
def test_host_round_trip_per_precision(prec):
    p = T.param("p", output_dims=(4,), input_dims=(), prec=prec)
    ctx = Context.cpu()
    ctx.set_values(p, [1.0, 1.0 / 3.0, -2.5e-3, 1e4])
    got = ctx.get_values(p)
    dtype = {"f64": np.float64, "f32": np.float32, "f16": np.float16,
             "bf16": ml_dtypes.bfloat16}[prec]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, np.array([1.0, 1.0 / 3.0, -2.5e-3, 1e4]).astype(dtype))
    assert ctx.mem(p) == 4 * np.dtype(dtype).itemsize


@pytest.mark.parametrize("prec", ["f64", "f32", "f16", "bf16"])
def test_a_reader_returns_the_current_value_as_a_python_float(prec):
    """``reader`` is ``get_value`` bound once: every call reads the buffer as it is now,
    after host writes and routine runs alike, with ``get_value``'s checks done up front."""
    p = T.param("p", output_dims=(3,), input_dims=(), prec=prec)
    s = T.term([0.0], label="s", prec=prec)
    y = s * 2.0
    ctx = Context.cpu()
    ctx.set_values(p, [1.0, 1.0 / 3.0, -7.0])
    second = ctx.reader(p, (1,))
    third = 1.0 / 3.0
    got = second()
    assert type(got) is float and got == float(np.array(third).astype(ctx.get_values(p).dtype))
    assert got == ctx.get_value(p, (1,))
    ctx.set_values(p, [0.0, 2.5, 0.0])
    assert second() == 2.5
    ctx, r = ctx.compile(train.forward(y))
    whole, read_y = ctx.reader(s), ctx.reader(y)
    ctx.set_value(s, 1.5).run(r)
    assert whole() == 1.5 and read_y() == 3.0
    ctx.set_value(s, -0.25).run(r)
    assert whole() == -0.25 and read_y() == -0.5
    with pytest.raises(ValueError, match=r"has dims \(3,\): give an index"):
        ctx.reader(p)
    with pytest.raises(ValueError, match=r"index \(3,\) out of range"):
        ctx.reader(p, (3,))
    with pytest.raises(ValueError, match="no buffer"):
        Context.cpu().reader(s)


def test_a_gated_pair_runs_the_second_routine_only_after_a_finite_value():
    """``Context._gated`` (the host gate's every step on the CPU, in one call): the first
    routine, then the second only when the f32 the first wrote is finite, and which it was;
    ``None`` for a value that is not one f32, refused for a routine of another context."""
    from ocannl.ir.assignments import Accum, Const, Get
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode

    x, flag = Tnode("gx", (3,), Precision.f32), Tnode("gflag", (), Precision.f32)
    count = Tnode("gcount", (2,), Precision.f32)
    ctx = Context.cpu().set_values(count, [0.0, 5.0]).set_values(x, [0.0, 0.0, 0.0])
    ctx, first = ctx.compile(Comp((Accum(flag, (), "+", Get(x, (0,)), (3,), reset=True),)))
    ctx, second = ctx.compile(Comp((Accum(count, (0,), "+", Const(1.0), (2,)),)))
    ctx.run(first).run(second)
    both = ctx._gated(first, second, flag)
    assert both is not None
    runs = 1
    for values, finite in (([1.0, 2.0, 3.0], True), ([1.0, np.inf, 2.0], False),
                           ([np.nan, 0.0, 0.0], False), ([3e38, 3e38, 0.0], False),
                           ([-np.inf, np.inf, 0.0], False), ([-1.0, 0.5, 0.0], True)):
        ctx.set_values(x, values)
        got = both()
        runs += finite
        assert got is finite, values
        if finite:
            assert ctx.get_value(flag) == sum(values)
        np.testing.assert_array_equal(ctx.get_values(count), [runs, 5.0 + runs])
    assert ctx._gated(first, second, x) is None  # three values, not one
    other, r = Context.cpu().set_values(x, [0.0] * 3).compile(Comp((Accum(
        flag, (), "+", Get(x, (0,)), (3,), reset=True),)))
    with pytest.raises(ValueError, match="another context"):
        ctx._gated(r, second, flag)


def test_from_host_to_host_mem_and_nodes():
    x = T.term(np.arange(4.0), label="x")
    ctx = Context.cpu()
    assert not ctx.is_initialized(x)
    ctx.from_host(x)
    np.testing.assert_array_equal(ctx.get_values(x), np.arange(4.0))
    ctx.set_values(x, [9, 8, 7, 6])
    ctx.to_host(x)
    np.testing.assert_array_equal(x.value.host_data, [9, 8, 7, 6])
    assert ctx.mem(x) == 16 and ctx.mem() == 16
    assert ctx.nodes() == [x.value]
    assert ctx.backend_name() == "cpu"
    assert "cpu" in repr(ctx)
    p = T.param("p", output_dims=(2,), input_dims=())
    with pytest.raises(ValueError, match="no host array"):
        ctx.from_host(p)


def test_compile_allocates_and_initialises_data_nodes():
    x, s, y, c = _scaled()
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(y))
    assert isinstance(r, Routine)
    assert ctx.is_initialized(x) and ctx.is_initialized(s)  # from their host data
    assert ctx.is_allocated(y) and not ctx.is_initialized(y)  # until a routine writes it
    ctx = ctx.run(r)
    assert ctx.is_initialized(y)
    np.testing.assert_allclose(ctx.get_values(y), np.arange(6) * 2.0 * c, rtol=1e-6)


# --- compile / run ----------------------------------------------------------------------------


def test_routines_see_set_values_without_recompiling():
    x, s, y, c = _scaled()
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(y))
    assert ctx.compile_count == 1
    for scale in (2.0, -0.5, 10.0):
        ctx.set_values(s, [scale])
        ctx.run(r)
        np.testing.assert_allclose(ctx.get_values(y), np.arange(6) * scale * c, rtol=1e-6)
    ctx.set_values(x, np.ones(6))
    ctx.run(r)
    np.testing.assert_allclose(ctx.get_values(y), np.full(6, 10.0 * c), rtol=1e-6)
    assert ctx.compile_count == 1


def test_compiling_the_same_code_twice_reuses_the_function():
    x, s, y, c = _scaled()
    ctx = Context.cpu()
    ctx, r1 = ctx.compile(train.forward(y))
    assert ctx.compile_count == 1
    ctx, r2 = ctx.compile(train.forward(y))
    assert ctx.compile_count == 1
    assert r2.compiled is r1.compiled and r2.buffers == r1.buffers
    # The same code over other nodes of the same dims is the same function, bound elsewhere.
    x2 = T.term(np.ones(6), label="x2")
    y2 = x2 * s * c  # the same folded constant: the same source
    ctx, r3 = ctx.compile(train.forward(y2))
    assert ctx.compile_count == 1 and r3.compiled is r1.compiled
    assert r3.buffers[0] is not r1.buffers[0]
    # Another context reuses the process's compiled function too, with its own buffers.
    other = Context.cpu()
    other, r4 = other.compile(train.forward(y))
    assert other.compile_count == 0 and r4.compiled is r1.compiled
    assert all(b1 is not b4 for b1, b4 in zip(r1.buffers, r4.buffers, strict=True))
    # New code is compiled anew.
    ctx, _ = ctx.compile(train.forward(x * _unique()))
    assert ctx.compile_count == 2


def test_lowered_items_compiled_one_by_one_compute_what_the_routine_does():
    """``Context.lower`` and ``compile_lowered`` (what ``benchmarks/profile_items.py`` times):
    each item as a routine of its own, run in order, leaves the routine's values."""
    from ocannl.ir.assignments import Accum, Get, apply
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode

    x, w = Tnode("xl", (6, 8), Precision.f32), Tnode("wl", (8, 5), Precision.f32)
    h, y = Tnode("hl", (6, 5), Precision.f32), Tnode("yl", (6,), Precision.f32)
    comp = Comp((  # a product, a pointwise step, a reduction
        Accum(h, (0, 1), "+", apply("mul", Get(x, (0, 2)), Get(w, (2, 1))), (6, 5, 8), True),
        Accum(h, (0, 1), "=", apply("tanh", Get(h, (0, 1))), (6, 5)),
        Accum(y, (0,), "+", apply("exp", Get(h, (0, 1))), (6, 5), reset=True),
    ))
    ctx = Context.cpu()
    ctx.set_values(x, np.linspace(-2.0, 2.0, 48))
    ctx.set_values(w, np.linspace(0.5, 1.5, 40))
    ctx, whole = ctx.compile(comp)
    ctx.run(whole)
    expected = ctx.get_values(y)
    ctx.set_values(y, np.zeros(6))
    items = ctx.lower(comp)
    assert len(items) == 3
    for item in items:
        ctx, part = ctx.compile_lowered("item", [item])
        ctx.run(part)
    assert ctx.get_values(y).tobytes() == expected.tobytes()


def test_each_context_owns_its_buffers():
    x, s, y, c = _scaled()
    a, b = Context.cpu(), Context.cpu()
    a, ra = a.compile(train.forward(y))
    b, rb = b.compile(train.forward(y))
    b.set_values(s, [5.0])
    a.run(ra)
    b.run(rb)
    np.testing.assert_allclose(a.get_values(y), np.arange(6) * 2.0 * c, rtol=1e-6)
    np.testing.assert_allclose(b.get_values(y), np.arange(6) * 5.0 * c, rtol=1e-6)
    with pytest.raises(ValueError, match="compiled by another context"):
        a.run(rb)


def test_ocaml_style_calls():
    x, s, y, c = _scaled()
    ctx = Context.cpu()
    ctx, r = Context.compile(ctx, train.forward(y), {})
    ctx = Context.set_values(ctx, s, [3.0])
    ctx = Context.run(ctx, r)
    np.testing.assert_allclose(Context.get_values(ctx, y), np.arange(6) * 3.0 * c, rtol=1e-6)
    assert Context.get_value(ctx, s) == 3.0 and Context.is_initialized(ctx, y)
    ctx, r2 = train.to_routine(ctx, train.forward(y))
    assert r2.compiled is r.compiled


def test_compile_argument_errors():
    _, _, y, _ = _scaled()
    ctx = Context.cpu()
    with pytest.raises(ValueError, match="static index bindings are not supported"):
        ctx.compile(train.forward(y), {"i": 3})
    with pytest.raises(TypeError, match="compile expects a Comp, got Tensor"):
        ctx.compile(y)


def test_empty_computation():
    ctx = Context.cpu()
    ctx, r = ctx.compile(Comp())
    assert ctx.run(r) is ctx


def test_auto_falls_back_to_the_cpu_and_says_why_once(monkeypatch):
    def no_gpu(cls, device_id=0):
        raise RuntimeError("no CUDA device here")

    monkeypatch.setattr(Context, "cuda", classmethod(no_gpu))
    monkeypatch.setattr(Context, "_fallback_said", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = Context.auto()
        second = Context.auto()
    assert first.backend_name() == "cpu" and second.backend_name() == "cpu"
    said = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == 1 and "no CUDA device here" in str(said[0].message)


# --- the on-disk cache ------------------------------------------------------------------------

_COLD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import ocannl.tensor as T
    from ocannl import Context, train

    c = float(sys.argv[1])
    x = T.term(np.arange(5.0), label="x")
    y = T.exp(x * c)
    ctx = Context.cpu()
    ctx, r = ctx.compile(train.forward(y))
    ctx.run(r)
    first = ctx.compile_count
    ctx, r2 = ctx.compile(train.forward(y))
    print(json.dumps({
        "compile_count": first,
        "after_recompile": ctx.compile_count,
        "same_fn": r2.compiled is r.compiled,
        "from_disk": r.compiled.loaded_from_disk,
        "y": ctx.get_values(y).tolist(),
    }))
    """
)


def _cold(cache: Path, c: float) -> dict:
    env = {**os.environ, "OCANNL_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", _COLD, repr(c)], env=env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cold_process_reuses_the_on_disk_cache(tmp_path):
    """OCANNL_CACHE_DIR selects the folder; the first process compiles and writes the
    routine's object file there, the second loads it (no compile) and computes the same."""
    cache = tmp_path / "cache"
    c = 0.25
    first = _cold(cache, c)
    folder = cache / "llvm"
    objects = sorted(folder.glob("*.objects"))
    assert len(objects) == 1
    assert not first["from_disk"]
    assert first["compile_count"] == 1 and first["after_recompile"] == 1 and first["same_fn"]
    stamp = {p: p.stat().st_mtime_ns for p in objects}

    second = _cold(cache, c)
    assert second["from_disk"]
    assert second["after_recompile"] == second["compile_count"] and second["same_fn"]
    assert second["y"] == first["y"]
    np.testing.assert_allclose(second["y"], np.exp(np.arange(5.0) * c), rtol=1e-6)
    # nothing was rewritten
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    assert sorted(folder.glob("*.objects")) == objects

    # Other code in the same folder is a miss, and adds its own files.
    third = _cold(cache, 0.5)
    assert not third["from_disk"]
    assert len(list(folder.glob("*.objects"))) == 2
    # A damaged cache file (truncated, or one byte of machine code changed) is compiled again
    # and replaced, with the same results.
    whole = objects[0].read_bytes()
    flipped = bytearray(whole)
    flipped[-50] ^= 0x40
    for damage in (whole[:100], bytes(flipped)):
        objects[0].write_bytes(damage)
        damaged = _cold(cache, c)
        assert not damaged["from_disk"] and damaged["y"] == first["y"]
        assert objects[0].read_bytes() == whole
        assert _cold(cache, c)["from_disk"]
    # A different folder starts cold.
    fourth = _cold(tmp_path / "elsewhere", c)
    assert not fourth["from_disk"]


# --- allocation is not initialization ---------------------------------------------------------


def _tiny_model(seed: int):
    from ocannl import nn_blocks

    T.set_seed(seed)
    x = T.term(np.linspace(-1, 1, 12).reshape(6, 2), label="x")
    y = T.term(np.eye(2)[[0, 1, 0, 1, 1, 0]], label="y")
    logits, _ = nn_blocks.mlp(x, [5], 2)
    return nn_blocks.softmax_cross_entropy(logits, y)


def _trained_losses(init_first: bool) -> list[float]:
    loss = _tiny_model(7)
    ctx = Context.cpu()
    step = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.5)
    if init_first:
        ctx = train.init_params(ctx, loss)
        ctx, r = ctx.compile(step)
    else:
        ctx, r = ctx.compile(step)
        ctx = train.init_params(ctx, loss)
    out = []
    for _ in range(5):
        ctx = ctx.run(r)
        out.append(float(ctx.get_values(loss)))
    return out


def test_init_params_before_or_after_compile_gives_the_same_model():
    before, after = _trained_losses(True), _trained_losses(False)
    assert before == after
    assert before[0] != before[-1]  # it trains: the weights are not all zero


def test_compile_allocates_but_does_not_initialize_parameters():
    loss = _tiny_model(3)
    ctx, r = Context.cpu().compile(train.forward(loss))
    assert all(ctx.is_allocated(p) and not ctx.is_initialized(p) for p in loss.params)
    ctx = train.init_params(ctx, loss)
    assert all(ctx.is_initialized(p) for p in loss.params)
    assert any(np.abs(ctx.get_values(p)).sum() > 0 for p in loss.params)


def test_running_before_init_params_names_the_uninitialized_parameters():
    loss = _tiny_model(4)
    ctx, r = Context.cpu().compile(train.grad_update(loss))
    with pytest.raises(ValueError, match="nothing has initialized") as err:
        ctx.run(r)
    for p in loss.params:
        assert p.value.name in str(err.value)
        assert not ctx.is_initialized(p)  # the refused run wrote nothing
    ctx = train.init_params(ctx, loss)
    ctx = ctx.run(r)  # now it runs
    assert np.isfinite(float(ctx.get_values(loss)))


def test_a_data_node_without_values_must_be_set_before_a_run():
    x = T.term(None, label="batch", output_dims=(3,))
    y = T.exp(x)
    ctx, r = Context.cpu().compile(train.forward(y))
    with pytest.raises(ValueError, match=x.value.name):
        ctx.run(r)
    ctx = ctx.set_values(x, [0.0, 1.0, 2.0]).run(r)
    np.testing.assert_allclose(ctx.get_values(y), np.exp([0.0, 1.0, 2.0]), rtol=1e-6)


def test_optimizer_state_starts_at_zero_and_counts_as_initialized():
    loss = _tiny_model(5)
    step = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.1, momentum=0.9)
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(step)
    state = [n for n in r.inputs if n.zero_start]
    assert state and all(ctx.is_initialized(n) for n in state)
    assert all(not ctx.get_values(n).any() for n in state)
    ctx.run(r)


def test_a_routine_runs_only_on_the_context_that_compiled_it():
    _, _, y, _ = _scaled()
    ctx_a, r = Context.cpu().compile(train.forward(y))
    ctx_b = Context.cpu()
    with pytest.raises(ValueError, match="compiled by another context"):
        ctx_b.run(r)
    assert r.context is ctx_a


# --- local nodes: intermediate gradients ------------------------------------------------------


def _deep(seed: int = 0):  # noqa: ANN202 - a small tanh network and its pieces
    from ocannl import nn_blocks

    rng = np.random.default_rng(seed)
    x = T.term(rng.normal(size=(16, 12)).astype(np.float32), label="xd", batch_dims=(16,),
               output_dims=(12,))
    y, layers = nn_blocks.mlp(x, (24, 24, 24), 6, label="deep")
    h = T.tanh(y)
    loss = T.sum(h * h)
    return x, h, loss, layers


def test_an_intermediate_gradient_is_local_unless_retained():
    """Like torch's non-leaf ``.grad``: an intermediate tensor's gradient lives only inside the
    routine computing it; reading or writing it names ``retain_grad``. Retained, it holds
    d loss / d h = 2 h."""
    from ocannl.ir.tnode import MemoryMode

    _, h, loss, _ = _deep()
    assert h.grad.memory_mode is MemoryMode.local
    assert all(p.grad.memory_mode is MemoryMode.materialized for p in loss.params)
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(train.grad_update(loss))
    ctx.run(r)
    for call in (lambda: ctx.get_values(h.grad), lambda: ctx.set_values(h.grad, np.zeros(96)),
                 lambda: ctx.get_value(h.grad, (0, 0))):
        with pytest.raises(ValueError, match=r"grad_.* is local .* retain_grad\(\)"):
            call()
    assert h.grad not in ctx.nodes() and not ctx.is_allocated(h.grad)
    assert h.retain_grad() is h
    with pytest.raises(ValueError, match="xd has no gradient: it depends on no parameter"):
        _deep()[0].retain_grad()
    ctx, r = ctx.compile(train.grad_update(loss))
    ctx.run(r)
    np.testing.assert_allclose(ctx.get_values(h.grad), 2 * ctx.get_values(h), rtol=1e-6)


def test_a_routine_reading_a_local_node_it_did_not_write_is_refused():
    from ocannl.ir.assignments import Accum, Get
    from ocannl.ir.ops import Precision
    from ocannl.ir.tnode import Tnode

    _, h, loss, _ = _deep()
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(train.grad_update(loss))
    out = Tnode("sum_of_grad", (), Precision.f32)
    reader = Comp((Accum(out, (), "+", Get(h.grad, (0, 1)), h.grad.dims, reset=True),))
    with pytest.raises(ValueError, match=r"reads grad_\S+ before writing it whole"):
        ctx.compile(reader)
    assert not ctx.is_allocated(out)


def test_local_nodes_share_memory_and_compute_the_same_bits():
    """The gradients of a deep network's intermediates share an arena (smaller than their
    sum) and the parameters' gradients are bitwise those of one buffer per local node."""
    from ocannl.ir.lowering import stored_nodes
    from ocannl.ir.tnode import MemoryMode

    grads = []
    for check in (True, False):
        _, _, loss, _ = _deep(3)
        ctx = train.init_params(Context.cpu(), loss)
        for k, p in enumerate(loss.params):  # the same weights in both contexts
            ctx.set_values(p, np.random.default_rng(k).normal(size=p.value.dims) * 0.3)
        code = ctx.lower(train.grad_update(loss))
        ctx, r = ctx.compile_lowered("step", code, local_check=check)
        ctx.run(r)
        grads.append([ctx.get_values(p.grad).tobytes() for p in loss.params])
        # (nodes handed over in registers have no memory at all)
        local = [n for n in stored_nodes(code) if n.memory_mode is MemoryMode.local]
        total = sum(n.size * n.prec.itemsize for n in local)
        if check:
            assert 0 < ctx._local_bytes < total
        else:
            assert ctx._local_bytes >= total
    assert grads[0] == grads[1]


# --- reads of values nothing wrote are refused as a run refuses them (issue 28) ---------------


def test_get_values_of_a_parameter_before_init_params_is_refused_by_name():
    loss = _tiny_model(5)
    ctx, _ = Context.cpu().compile(train.forward(loss))
    p = loss.params[0]
    with pytest.raises(ValueError, match=rf"get_values reads {p.value.name}, which nothing has "
                                         rf"initialized in this context: call "
                                         rf"train.init_params"):
        ctx.get_values(p)
    with pytest.raises(ValueError, match="nothing has initialized"):
        ctx.get_value(p, (0,) * len(p.dims))
    assert not ctx.is_initialized(p)
    ctx = train.init_params(ctx, loss)
    assert ctx.get_values(p).shape == p.dims


def test_get_value_of_a_result_after_compile_before_any_run_is_refused():
    loss = _tiny_model(6)
    ctx = train.init_params(Context.cpu(), loss)
    ctx, r = ctx.compile(train.forward(loss))
    with pytest.raises(ValueError, match=rf"get_value reads {loss.value.name}, which nothing"):
        ctx.get_value(loss)
    with pytest.raises(ValueError, match="get_values reads"):
        ctx.get_values(loss)
    read = ctx.reader(loss)  # made before the run: it checks until something wrote the loss
    with pytest.raises(ValueError, match="nothing has initialized"):
        read()
    ctx = ctx.run(r)
    assert read() == ctx.get_value(loss) == float(ctx.get_values(loss))
    assert np.isfinite(read())


def test_a_reader_of_an_initialized_node_is_the_backends_own():
    """No check left on the every-step path once the node has values."""
    x = T.term(np.array([1.5], np.float32), label="x")
    ctx = Context.cpu()
    ctx, _ = ctx.compile(train.forward(T.exp(x)))
    read = ctx.reader(x)
    assert type(read) is functools.partial and read() == 1.5


def test_set_value_on_a_node_with_no_values_yet_starts_from_zeros():
    x = T.term(None, label="batch", output_dims=(3,))
    ctx, _ = Context.cpu().compile(train.forward(T.exp(x)))
    ctx = ctx.set_value(x, 2.0, (1,))
    assert ctx.get_values(x).tolist() == [0.0, 2.0, 0.0]


def test_an_allocation_too_large_names_its_node():
    x = T.term(None, label="huge_batch", output_dims=(1 << 20, 1 << 20, 1 << 12))
    y = T.exp(x)
    ctx = Context.cpu()
    with pytest.raises(MemoryError, match=r"bytes for node (huge_batch|exp)_\d+ \(dims "
                                          r"\(1048576, 1048576, 4096\), f32\) on the cpu "
                                          r"backend"):
        ctx.compile(train.forward(y))
