"""Scatters lowered as gathers (``lowering.gather_of``, ``scatter_as_gather``): where the rule
takes them (a GPU: wherever invertible within the waste limit; a CPU: where each cell sums
enough terms, or exactly one, every point inside), the values are the scatter's within f32
rounding, the CPU backend's are the interpreter's bit for bit, the gradients are PyTorch's,
and on CUDA a convnet's convolution input gradient runs over at least an H200's 132 SMs of
blocks."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import ocannl.tensor as T
from ocannl import Context, nn_blocks, train
from ocannl.backends.cpu.backend import CpuBackend
from ocannl.backends.cuda.plan import SMS as GATHER_MIN_BLOCKS  # cuda_target().gpu_sms
from ocannl.backends.cuda.plan import Kernel, cuda_target, plan_routine
from ocannl.ir import interpret, lowering
from ocannl.ir.assignments import Accum, Affine, Comp, Const, Get, apply
from ocannl.ir.lowering import gather_of, lower, nests
from ocannl.ir.ops import Precision
from ocannl.ir.target import PRODUCTS
from ocannl.ir.tnode import Tnode
from ocannl.tensor.spatial import conv2d

F32 = Precision.f32
CPU = PRODUCTS  # a CPU's record (parallel scatters), without im2col
GPU = replace(cuda_target(), im2col=False)  # a GPU's record, without im2col (as CPU)


def _conv_dx(b: int, h: int, c: int, o: int, k: int, pad: int, stride: int = 1):  # noqa: ANN202
    """``dx[b, s*oh + kh - p, s*ow + kw - p, c] =+ dy[b, oh, ow, o] * w[o, kh, kw, c]``."""
    oh = (h + 2 * pad - k) // stride + 1
    dx = Tnode("dx", (b, h, h, c), F32)
    dy, w = Tnode("dy", (b, oh, oh, o), F32), Tnode("w", (o, k, k, c), F32)
    idx = (0, Affine(((stride, 1), (1, 4)), -pad), Affine(((stride, 2), (1, 5)), -pad), 6)
    a = Accum(dx, idx, "+", apply("mul", Get(dy, (0, 1, 2, 3)), Get(w, (3, 4, 5, 6))),
              (b, oh, oh, o, k, k, c), reset=True)
    return Comp((a,)), dx, (dy, w)


def _pool_dx(b: int, h: int, c: int, k: int, stride: int):  # noqa: ANN202
    """A sum pool's input gradient ``dx[b, s*oh + kh, s*ow + kw, c] += g[b, oh, ow, c]``."""
    oh = (h - k) // stride + 1
    dx, g = Tnode("dx", (b, h, h, c), F32), Tnode("g", (b, oh, oh, c), F32)
    idx = (0, Affine(((stride, 1), (1, 3))), Affine(((stride, 2), (1, 4))), 5)
    return Comp((Accum(dx, idx, "+", Get(g, (0, 1, 2, 5)), (b, oh, oh, k, k, c), reset=True),)
                ), dx, (g,)


def _kinds(comp: Comp, target) -> list[str]:  # noqa: ANN001
    return ["gather" if n.gather else "scatter" if n.scatter else "nest"
            for n in nests(lower(comp, target))]


@pytest.mark.parametrize(("case", "cpu", "gpu"), [
    (lambda: _conv_dx(2, 6, 2, 4, 3, 1), "gather", "gather"),  # 36 terms a cell
    (lambda: _conv_dx(2, 10, 2, 4, 3, 0), "gather", "gather"),  # no padding: 1.56x points
    (lambda: _conv_dx(2, 6, 2, 4, 3, 0), "scatter", "scatter"),  # 2.25x points: too many
    (lambda: _conv_dx(2, 6, 1, 2, 3, 1), "scatter", "gather"),  # 18 terms: short for a CPU
    (lambda: _conv_dx(2, 9, 2, 4, 3, 1, stride=2), "scatter", "gather"),  # phases: 9 terms
    (lambda: _conv_dx(2, 9, 2, 4, 1, 0, stride=2), "scatter", "scatter"),  # a phase gets none
    (lambda: _pool_dx(2, 10, 3, 3, 1), "scatter", "gather"),  # 9 terms
    (lambda: _pool_dx(2, 8, 3, 2, 2), "gather", "gather"),  # phases: 1 term, a pass
    (lambda: _pool_dx(2, 9, 3, 2, 2), "scatter", "gather"),  # the last row and column get none
])
def test_where_the_rule_takes_the_gather(case, cpu, gpu):
    comp = case()[0]
    assert set(_kinds(comp, CPU)) == {cpu}
    assert set(_kinds(comp, GPU)) == {gpu}


@pytest.mark.parametrize(("h", "k", "stride", "pad", "merged"), [
    (9, 3, 2, 1, False), (8, 3, 2, 1, False), (8, 2, 2, 0, True), (9, 2, 2, 0, False),
    (10, 4, 2, 2, True), (11, 3, 3, 1, False), (7, 5, 2, 2, False),
])
def test_a_strided_window_is_gathered_by_phases_to_the_scatters_values(h, k, stride, pad,
                                                                         merged, monkeypatch):
    """On a GPU, a stride-s window's target axis is cut into its s phases (one gather per
    phase, or the phase an iterator of one gather where everything divides), each cell's
    terms exactly once: the scatter's values within f32 rounding."""
    comp, dx, inputs = _conv_dx(2, h, 3, 4, k, pad, stride)
    code = lower(comp, GPU)
    gathers = [n for n in nests(code) if n.gather]
    assert gathers and not any(n.scatter for n in nests(code))
    assert len(gathers) == (1 if merged else stride * stride)
    points = sum(math.prod(n.space) for n in gathers)
    # few points outside the windows (solving for k instead would read about h / k times
    # the scatter's points per axis)
    assert points <= 1.5 * math.prod(comp.assignments[0].space)
    monkeypatch.setattr(lowering, "GPU_GATHER_MAX_WASTE", 0)
    scattered = lower(comp, GPU)
    assert [n.scatter for n in nests(scattered)] == [True]
    base = _values(inputs, seed=3)
    want = {**base, dx.id: np.full(dx.dims, np.nan, np.float32)}
    got = dict(want)
    interpret.run(scattered, want)
    interpret.run(code, got)
    np.testing.assert_allclose(got[dx.id], want[dx.id], rtol=1e-5, atol=1e-5)


def _values(nodes, seed: int = 0):  # noqa: ANN001, ANN202
    rng = np.random.default_rng(seed)
    return {n.id: rng.normal(size=n.dims).astype(np.float32) for n in nodes}


@pytest.mark.parametrize(("pad", "stride", "o"), [(1, 1, 4), (2, 1, 4), (1, 2, 20)])
def test_the_gather_is_the_scatter_within_rounding_and_the_cpu_its_interpreter_bit_for_bit(
        pad, stride, o, monkeypatch):
    """A convolution too small for im2col (a product under ``GEMM_MIN_FLOPS``), 36 terms a
    cell (stride 2: 39 on average, in 4 phases)."""
    comp, dx, inputs = _conv_dx(1, 5, 1, o, 3, pad, stride)
    gathered = lower(comp, CpuBackend().target)
    assert [n.gather for n in nests(gathered)] == [True] * stride ** 2
    assert all(n.red and not n.scatter for n in nests(gathered))  # a reduction per cell
    monkeypatch.setattr(lowering, "CPU_GATHER_MAX_WASTE", 0)
    scattered = lower(comp, CpuBackend().target)
    assert [n.scatter for n in nests(scattered)] == [True]
    base = _values(inputs)
    want = {**base, dx.id: np.full(dx.dims, np.nan, np.float32)}
    got = dict(want)
    interpret.run(scattered, want)
    interpret.run(gathered, got)
    np.testing.assert_allclose(got[dx.id], want[dx.id], rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    ctx = Context.cpu()
    for n in inputs:
        ctx.set_values(n, base[n.id])
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    assert ctx.get_values(dx).tobytes() == got[dx.id].tobytes()


def test_a_gather_sums_in_one_order_whatever_the_threads(monkeypatch):
    """Shared over 1, 2, 3 threads (im2col off, as on a GPU): the same bits."""
    from ocannl.backends.cpu import jit

    comp, dx, inputs = _conv_dx(16, 8, 4, 8, 3, 1)
    base = _values(inputs, seed=2)
    plain = jit.target
    bits = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(jit, "threads", lambda t=threads: t)
        monkeypatch.setattr(jit, "target", lambda: replace(plain(), im2col=False))
        [group] = lower(comp, jit.target())
        assert group.lead.gather and (group.split is not None) == (threads > 1)
        ctx = Context.cpu()
        for n in inputs:
            ctx.set_values(n, base[n.id])
        ctx, r = ctx.compile(comp)
        ctx.run(r)
        bits.append(ctx.get_values(dx).tobytes())
    assert bits[0] == bits[1] == bits[2]


def test_an_expression_that_does_not_vanish_outside_is_no_gather():
    """A point whose solved iterator falls outside is no point of the scatter: its term must
    be 0 there. ``g[oh] + 1`` is 1 there, ``g[oh] * w[kh]`` 0 (``g`` read outside)."""
    x, g, w = Tnode("x", (6,), F32), Tnode("g", (4,), F32), Tnode("w", (3,), F32)
    at = (Affine(((1, 0), (1, 1))),)  # x[oh + kh] over (4, 3)
    plus = Accum(x, at, "+", apply("add", Get(g, (0,)), Const(1.0)), (4, 3))
    times = Accum(x, at, "+", apply("mul", Get(g, (0,)), Get(w, (1,))), (4, 3))
    assert gather_of(plus, 100) is None
    # two solved iterators: a term must vanish outside each (g[oh] ignores ow)
    x2, g2 = Tnode("x2", (6, 6), F32), Tnode("g2", (4,), F32)
    at2 = (Affine(((1, 0), (1, 2))), Affine(((1, 1), (1, 3))))  # x2[oh + kh, ow + kw]
    assert gather_of(Accum(x2, at2, "+", Get(g2, (0,)), (4, 4, 3, 3)), 100) is None
    gather = gather_of(times, 100)
    assert gather is not None and gather.lhs_idx == (0,) and gather.space == (6, 3)
    values = {g.id: np.arange(1, 5, dtype=np.float32), w.id: np.array([1, 10, 100], np.float32),
              x.id: np.zeros(6, np.float32)}
    interpret.run(lower(Comp((gather,)), PRODUCTS), values)
    np.testing.assert_array_equal(values[x.id], [1, 12, 123, 234, 340, 400])


@pytest.mark.parametrize(("h", "o", "stride"), [(4, 4, 1), (5, 20, 2)])
def test_the_input_gradient_of_a_direct_convolution_is_torchs(h, o, stride):
    """A convolution im2col leaves direct on the CPU (too small for BLAS) whose input
    gradient sums 36 terms a cell (stride 2: 39 on average, in 4 phases): gathers, and
    PyTorch's gradient."""
    rng = np.random.default_rng(4)
    xv = rng.normal(size=(1, h, h, 1)).astype(np.float32)
    kv = rng.normal(size=(o, 3, 3, 1)).astype(np.float32)
    x = T.param("x", batch_dims=(1,), output_dims=(h, h, 1), input_dims=())
    kernel = T.param("kernel", output_dims=(o,), input_dims=(3, 3, 1))
    y = conv2d(x, kernel, padding=1, stride=stride)
    loss = T.sum(T.mul(y, y))
    comp = train.grad_update(loss)
    assert any(n.gather and n.assign.lhs is x.grad for n in nests(lower(comp, CpuBackend()
                                                                             .target)))
    ctx = Context.cpu().set_values(x, xv).set_values(kernel, kv)
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    tx = torch.tensor(xv).permute(0, 3, 1, 2).requires_grad_()
    tk = torch.tensor(kv).permute(0, 3, 1, 2)
    (torch.nn.functional.conv2d(tx, tk, padding=1, stride=stride) ** 2).sum().backward()
    np.testing.assert_allclose(ctx.get_values(x.grad), tx.grad.permute(0, 2, 3, 1).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_convnets_input_gradients_are_gathers_that_fill_an_h200_on_cuda():
    """convnet's (benchmarks/specs.py) input gradients on CUDA: no scatter is left; the second
    convolution's (a reduction of 144 terms a cell) launches at least ``GATHER_MIN_BLOCKS``
    blocks; each pool's is a thread per cell of its target, no zero fill before it, on at least
    as many blocks too (``schedule.gpu_launch``)."""
    rng = np.random.default_rng(0)
    x = T.term(rng.uniform(0, 1, (64, 8, 8, 1)), label="x", batch_dims=(64,),
               output_dims=(8, 8, 1))
    y = T.term(np.eye(10)[rng.integers(0, 10, 64)], label="y")
    logits, _ = nn_blocks.lenet(x, num_classes=10, channels=(8, 16), hidden=64)
    comp = train.grad_update(nn_blocks.softmax_cross_entropy(logits, y))
    code = lower(comp, GPU)
    assert not [n.assign.lhs.name for n in nests(code) if n.scatter]
    gathers = [n for n in nests(code) if n.gather]
    conv = [n for n in gathers if n.red]
    pools = [n for n in gathers if not n.red]
    assert len(conv) == 1 and len(pools) == 2
    plan = plan_routine(code)

    def kernels(node: Tnode) -> list[Kernel]:
        return [s for s in plan.steps if isinstance(s, Kernel) and node in s.nodes[:1]]

    [kernel] = kernels(conv[0].assign.lhs)
    assert kernel.grid >= GATHER_MIN_BLOCKS and kernel.name == "ocannl_reduce"
    for pool in pools:
        [kernel] = kernels(pool.assign.lhs)  # no fill kernel: the gather resets its target
        assert kernel.name == "ocannl_map" and kernel.grid * kernel.block >= pool.assign.lhs.size
        assert kernel.grid >= GATHER_MIN_BLOCKS  # blocks of fewer threads, every SM busy


def _emulator():  # noqa: ANN202
    """The stand-in ``cupy`` and why the emulator cannot run here (None: it can); they live
    beside the CUDA backend's tests."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
    import fake_cupy
    from cuda_emu import emulator_unavailable

    return fake_cupy, emulator_unavailable()


def _run(ctx: Context, comp: Comp, dx: Tnode, inputs, base) -> np.ndarray:  # noqa: ANN001
    for n in inputs:
        ctx.set_values(n, base[n.id])
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    return ctx.get_values(dx)


@pytest.mark.parametrize(("case", "mapping"), [
    (lambda: _conv_dx(4, 4, 3, 4, 3, 1), "reduce"),  # 192 cells: a block each
    (lambda: _conv_dx(9, 32, 4, 2, 3, 1), "serial"),  # 36,864 cells: a thread each
    (lambda: _conv_dx(2, 9, 3, 4, 3, 1, stride=2), "serial"),  # 4 phases, 9 terms
    (lambda: _pool_dx(2, 8, 3, 2, 2), "map"),  # one gather, the phases its iterators
    (lambda: _conv_dx(2, 9, 3, 16, 3, 1, stride=2), "reduce"),  # 4 phases, 16 to 64 terms
])
def test_the_emulated_cuda_gather_gives_the_cpus_values(case, mapping, monkeypatch):
    fake_cupy, why = _emulator()
    if why is not None:
        pytest.skip(f"no emulator: {why}")
    comp, dx, inputs = case()
    code = lower(comp, GPU)
    groups = [item for item in code if hasattr(item, "nests")]
    assert all(g.lead.gather for g in groups) and mapping in {g.mapping for g in groups}
    base = _values(inputs, seed=5)
    want = {**base, dx.id: np.full(dx.dims, np.nan, np.float32)}
    interpret.run(code, want)  # the gather, in order (the CUDA reduce sums in a tree)
    cpu = _run(Context.cpu(), comp, dx, inputs, base)
    fake_cupy.install(monkeypatch)
    got = _run(Context.cuda(), comp, dx, inputs, base)
    np.testing.assert_allclose(got, want[dx.id], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, cpu, rtol=1e-5, atol=1e-5)


def test_convnets_input_gradients_fill_an_h200_with_cudas_im2col_too():
    """With the CUDA record as it is (im2col on, through cuBLAS), convnet's input gradients are
    gathers still (the second convolution's through its patch gradient: col2im), none a
    scatter, each kernel on at least ``GATHER_MIN_BLOCKS`` blocks."""
    rng = np.random.default_rng(0)
    x = T.term(rng.uniform(0, 1, (64, 8, 8, 1)), label="x", batch_dims=(64,),
               output_dims=(8, 8, 1))
    y = T.term(np.eye(10)[rng.integers(0, 10, 64)], label="y")
    logits, _ = nn_blocks.lenet(x, num_classes=10, channels=(8, 16), hidden=64)
    code = lower(train.grad_update(nn_blocks.softmax_cross_entropy(logits, y)), cuda_target())
    assert not [n.assign.lhs.name for n in nests(code) if n.scatter]
    gathered = {n.assign.lhs.id for n in nests(code) if n.gather}
    assert len(gathered) == 3  # two pools' and the second convolution's
    grids = [s.grid for s in plan_routine(code).steps
             if isinstance(s, Kernel) and s.nodes[0].id in gathered]
    assert len(grids) == 3 and min(grids) >= GATHER_MIN_BLOCKS, grids
