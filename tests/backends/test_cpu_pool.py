"""The CPU backend's thread pool (``cpu/pool.py``): large loops shared over threads give one
thread's bits whoever runs them, from several Python threads at once, in a forked child, with
the pool resized; and idle workers sleep rather than spin."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ocannl import Context
from ocannl.backends.cpu import jit, pool
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

pytestmark = pytest.mark.skipif(not pool.supported(), reason="the pool serves Linux only")

N, M = 512, 256  # 2^17 points: shared out


def _routine(threads: int, monkeypatch, seed: int = 0):  # noqa: ANN001, ANN202
    """A context and routine over fresh nodes: a pointwise chain and a row reduction, compiled
    for ``threads``; with the inputs' values."""
    monkeypatch.setattr(jit, "threads", lambda: threads)
    x, y = Tnode("x", (N, M), Precision.f32), Tnode("y", (N, M), Precision.f32)
    s = Tnode("s", (N,), Precision.f32)
    comp = Comp((
        Accum(y, (0, 1), "=", apply("tanh", apply("mul", Get(x, (0, 1)), Get(x, (0, 1)))),
              (N, M)),
        Accum(s, (0,), "+", apply("exp", Get(y, (0, 1))), (N, M), reset=True),
    ))
    xv = np.random.default_rng(seed).normal(size=(N, M)).astype(np.float32)
    ctx = Context.cpu()
    ctx.set_values(x, xv)
    ctx, r = ctx.compile(comp)
    return ctx, r, (y, s)


def _bits(ctx, r, out) -> bytes:  # noqa: ANN001
    ctx.run(r)
    return b"".join(ctx.get_values(n).tobytes() for n in out)


def test_workers_are_started_and_the_bits_are_one_threads(monkeypatch):
    one = _bits(*_routine(1, monkeypatch))
    before = len(os.listdir("/proc/self/task"))
    many = _routine(4, monkeypatch)
    for _ in range(5):
        assert _bits(*many) == one
    assert len(os.listdir("/proc/self/task")) >= min(before + 3, 4)
    fewer = _routine(2, monkeypatch)  # resized: later jobs use one worker
    assert _bits(*fewer) == one
    assert _bits(*many) == one


def test_routines_run_from_several_python_threads_at_once(monkeypatch):
    """A caller finding the pool busy runs its whole loop itself: every result is right."""
    routines = [_routine(3, monkeypatch, seed) for seed in range(3)]
    expected = [_bits(*r) for r in routines]
    wrong: list[int] = []

    def hammer(k: int) -> None:
        for _ in range(20):
            if _bits(*routines[k]) != expected[k]:
                wrong.append(k)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_starts_workers_of_its_own(monkeypatch):
    ctx, r, out = _routine(3, monkeypatch)
    expected = _bits(ctx, r, out)  # the parent's workers exist now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's workers; the pool must start its own
        status = 1
        try:
            os.close(read)
            ok = all(_bits(ctx, r, out) == expected for _ in range(5))
            os.write(write, b"ok" if ok else b"wrong")
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0 and said == b"ok"


def test_idle_workers_sleep(monkeypatch):
    """Workers spin a few tens of microseconds after a job, then sleep: an idle process uses
    no CPU time."""
    ctx, r, out = _routine(3, monkeypatch)
    _bits(ctx, r, out)
    time.sleep(0.1)
    start = os.times()
    time.sleep(1.0)
    end = os.times()
    assert (end.user + end.system) - (start.user + start.system) < 0.2


@pytest.mark.parametrize("prec", [Precision.bf16, Precision.f16])
def test_a_shared_reduction_over_16_bit_nodes_gives_one_threads_bits(monkeypatch, prec):
    """A reduction reading 16-bit nodes many times reads their f32 copies, made first (shared
    too) when the reduction is shared: the bits are one thread's."""
    i, j, k = 64, 96, 48
    a, b = Tnode("a", (i, j), prec), Tnode("b", (j, k), prec)
    out = Tnode("out", (i, k), prec)
    comp = Comp((Accum(out, (0, 2), "+", apply("mul", apply("exp", Get(a, (0, 1))),
                                               Get(b, (1, 2))), (i, j, k), reset=True),))
    rng = np.random.default_rng(3)
    av, bv = rng.normal(size=(i, j)) * 0.5, rng.normal(size=(j, k))

    def run(threads: int) -> bytes:
        monkeypatch.setattr(jit, "threads", lambda: threads)
        ctx = Context.cpu()
        ctx.set_values(a, av)
        ctx.set_values(b, bv)
        ctx, r = ctx.compile(comp)
        ctx.run(r)
        return ctx.get_values(out).tobytes()

    one = run(1)
    assert run(3) == one
    got = np.frombuffer(one, dtype=prec.numpy_dtype).reshape(i, k).astype(np.float64)
    np.testing.assert_allclose(got, np.exp(av.astype(prec.numpy_dtype).astype(np.float64))
                               @ bv.astype(prec.numpy_dtype).astype(np.float64),
                               rtol=0.05, atol=0.05)


@pytest.mark.parametrize("prec", ["f32", "bf16"])
def test_a_shared_scatter_gives_one_threads_bits(monkeypatch, tmp_path, prec):
    """A max pool's gradient is a scatter (each window's cells written through affine
    indices); shared by batch points, its target's first axis, each thread writes a block
    of cells of its own (a 16-bit target: its block of the f32 accumulator too), and the
    bits are one thread's. (A 2x2 pool's gradient is a gather on a CPU, one term a cell:
    kept a scatter here, as a pool whose windows overlap stays.)"""
    import ocannl.tensor as T
    from ocannl import train
    from ocannl.backends.cpu import codegen
    from ocannl.ir import lowering, schedule
    from ocannl.tensor.spatial import max_pool2d

    monkeypatch.setattr(lowering, "scatter_as_gather", lambda a, target: None)

    rng = np.random.default_rng(8)
    xv = rng.normal(size=(64, 8, 8, 8))
    xv[:, 0, 0, :] = xv[:, 0, 1, :]  # ties in windows
    cv = rng.normal(size=(64, 4, 4, 8))
    split = schedule.group_split
    shared: list[bool] = []

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    version = codegen._VERSION

    def run(threads: int) -> bytes:
        monkeypatch.setattr(jit, "threads", lambda: threads)
        monkeypatch.setattr(codegen, "_VERSION", f"{version}-scatter-{threads}")  # compiled here
        monkeypatch.setattr(schedule, "group_split", lambda item, target: (
            shared.append(item.lead.scatter and split(item, target) is not None)
            or split(item, target)))
        x = T.param("px", batch_dims=(64,), output_dims=(8, 8, 8), input_dims=(), prec=prec)
        c = T.term(cv.astype(np.float32), label="pc", batch_dims=(64,), output_dims=(4, 4, 8))
        loss = T.sum(T.cast(max_pool2d(x), "f32") * c)
        ctx = train.init_params(Context.cpu(), loss)
        ctx.set_values(x, xv)
        ctx, r = ctx.compile(train.grad_update(loss))
        ctx.run(r)
        return ctx.get_values(x.grad).tobytes()

    one = run(1)
    assert not any(shared)
    assert run(3) == one
    assert any(shared)  # the scatter was shared
    grad = np.frombuffer(one, Precision(prec).numpy_dtype).astype(np.float64)
    assert np.count_nonzero(grad) >= 64 * 4 * 4 * 8  # a cell per window at least
