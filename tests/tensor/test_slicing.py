"""Batch slicing over data held whole (upstream's ``rebatch`` and ``x @| i``): one routine,
the static index set between runs, each batch read in place; bad indices refused."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, train
from ocannl.backends.cpu import jit
from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda.plan import cuda_sources
from ocannl.ir import interpret
from ocannl.ir.lowering import lower


def _data():
    return np.arange(24, dtype=np.float32).reshape(12, 2)


def test_each_batch_is_read_at_the_index_set_between_runs():
    x = T.rebatch(_data(), batch=3, label="flat")
    assert x.shape.batch == (4, 3) and x.shape.output == (2,)
    i = T.static_index("batch_n", range=4)
    y = T.batch_slice(x, i) * 2.0 + 1.0
    assert y.shape.batch == (3,)
    ctx, routine = Context.cpu().compile(train.forward(y))
    for k in (0, 3, 1, 2):  # no recompilation: the index is a buffer the routine reads
        ctx = ctx.set_values(i, [k]).run(routine)
        np.testing.assert_array_equal(ctx.get_values(y), _data()[3 * k:3 * k + 3] * 2 + 1)


def test_a_trained_model_steps_through_the_batches():
    T.set_seed(0)
    xs = T.rebatch(_data() / 24, batch=4, label="xs")
    ys = T.rebatch(_data() / 24 @ np.array([[2.0], [-1.0]], np.float32), batch=4, label="ys")
    i = T.static_index("i", range=3)
    w = T.param("w")
    err = w @ T.batch_slice(xs, i) - T.batch_slice(ys, i)
    loss = T.einsum("...|... => 0", err * err)
    ctx = train.init_params(Context.cpu(), loss)
    ctx, step = ctx.compile(train.grad_update(loss)
                            + train.sgd_update(loss, learning_rate=0.1))
    losses = []
    for _ in range(40):
        for k in range(3):
            ctx = ctx.set_values(i, [k]).run(step)
            losses.append(float(ctx.get_values(loss)[0]))
    assert w.shape.input == (2,) and w.shape.output == (1,)
    assert losses[-1] < 0.1 * losses[0]


def test_the_interpreter_reads_the_same_batch():
    x = T.rebatch(_data(), batch=3, label="flat")
    i = T.static_index("bn", range=4)
    y = T.batch_slice(x, i) + 0.0
    comp = train.forward(y)
    ctx, routine = Context.cpu().compile(comp)
    ctx = ctx.set_values(i, [2]).run(routine)
    values = {i.value.id: np.array(2.0, np.float32), x.value.id: x.value.host_data}
    interpret.run(lower(comp, jit.target()), values)
    np.testing.assert_array_equal(values[y.value.id], ctx.get_values(y))
    np.testing.assert_array_equal(values[y.value.id], _data()[6:9])


def test_the_cuda_kernel_reads_the_index_node():
    """The CUDA renderer loads the index from its node (compiled with NVRTC by
    tests/backends/test_cuda_codegen.py's kernels; here the source is checked)."""
    x = T.rebatch(_data(), batch=3, label="flat")
    i = T.static_index("bn", range=4)
    sources = cuda_sources(train.forward(T.batch_slice(x, i) + 1.0))
    assert any("((long long)(" in s and "[0]))" in s for s in sources), sources
    for major in (12, 13):  # both are installed by the project's test extra (CI requires it)
        if nvrtc.available(major) is None:
            for src in sources:
                ptx, _ = nvrtc.compile_ptx(src, "compute_90", major=major)
                assert ".entry" in ptx


def test_bad_uses_are_refused_naming_them():
    x = T.rebatch(_data(), batch=3, label="flat")
    i = T.static_index("bn", range=4)
    ctx, routine = Context.cpu().compile(train.forward(T.batch_slice(x, i) + 0.0))
    for bad in (4, -1, 1.5):
        with pytest.raises(ValueError, match=rf"static index bn: \[{float(bad)}\] is not an "
                                             rf"integer in \[0, 4\)"):
            ctx.set_values(i, [bad])
    with pytest.raises(ValueError, match="flat 4,3\\|->2 has 4 batches, static index j ranges "
                                         "over 5"):
        T.batch_slice(x, T.static_index("j", range=5))
    with pytest.raises(TypeError, match="must come from T.static_index"):
        T.batch_slice(x, T.term(np.zeros(()), label="k"))
    with pytest.raises(ValueError, match="12 rows do not divide into batches of 5"):
        T.rebatch(_data(), batch=5)
    w = T.param("w", output_dims=[2], input_dims=[])
    with pytest.raises(ValueError, match="depends on parameters"):
        T.batch_slice(x * w, i)


def test_a_batch_below_one_and_a_size_below_one_are_refused():
    with pytest.raises(ValueError, match="rebatch data: batch must be >= 1, got 0"):
        T.rebatch(_data(), batch=0)
    d = T.Dims()
    T.einsum("i;i=>i", T.param("p"), T.param("q"), capture=d)
    with pytest.raises(ValueError, match="set_dim i: the size must be an integer >= 1, got -1"):
        d.set_dim("i", -1)
