"""The CUDA backend's decisions, checked on the CPU: launch configurations, which reductions
run in parallel, literal spelling, source caching, and why ``Context.cuda()`` refuses."""

from __future__ import annotations

import math
import sys
import types
import warnings

import cuda_cases
import cuda_models
import fake_cupy
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ocannl import Context
from ocannl.backends.cuda import plan as cc
from ocannl.backends.cuda import runtime as rt
from ocannl.ir import schedule
from ocannl.ir.lowering import lower
from ocannl.ir.ops import Precision

# --- thread mapping policy --------------------------------------------------------------------


def _launch(n: int) -> tuple[int, int]:
    """Scheduling's launch of a map over ``n`` cells for the CUDA target."""
    return schedule.gpu_launch(n, cc.cuda_target())


def test_strategy_table() -> None:
    assert schedule.gpu_mapping(10**6, 1, "=", False) == "map"
    assert schedule.gpu_mapping(256, 10, "max", True) == "serial"  # softmax max over classes
    assert schedule.gpu_mapping(1, 32, "+", True) == "serial"
    assert schedule.gpu_mapping(4, 10**5, "=", True) == "serial"  # last write wins, in order
    assert schedule.gpu_mapping(1, 33, "+", True) == "reduce"  # a loss mean over a batch
    assert schedule.gpu_mapping(1, 2**20, "+", True) == "reduce"  # a whole-gradient checksum
    assert schedule.gpu_mapping(8, 4096, "+", True) == "reduce"  # a bias gradient, large batch
    assert schedule.gpu_mapping(1024, 256, "+", True) == "serial"  # many cells, short sums
    assert schedule.gpu_mapping(1023, 256, "+", True) == "reduce"
    assert schedule.gpu_mapping(4096, 257, "max", True) == "reduce"


@given(st.integers(1, 10**6), st.integers(1, 10**8))
def test_reduce_splits_cover_every_element_once(par: int, red: int) -> None:
    splits, chunk = schedule.reduce_splits(par, red, cc.BLOCK)
    assert splits >= 1 and chunk >= 1
    assert splits * chunk >= red and (splits - 1) * chunk < red  # no empty split
    assert par * splits <= max(schedule.MAX_REDUCE_BLOCKS, par)
    if splits > 1:  # each thread of a split block gets a fair share of work
        assert chunk > cc.BLOCK * schedule.PER_THREAD // 2


def test_reduce_splits_examples() -> None:
    assert schedule.reduce_splits(1, 2**20, cc.BLOCK) == (512, 2048)  # 1024x1024 gradient checksum
    assert schedule.reduce_splits(1, 256, cc.BLOCK) == (1, 256)
    assert schedule.reduce_splits(2000, 10**5, cc.BLOCK) == (1, 10**5)


@given(st.integers(1, 10**10))
def test_map_launch_covers_the_range(n: int) -> None:
    grid, block = _launch(n)
    assert block % schedule.WARP == 0 and schedule.WARP <= block <= cc.BLOCK
    assert 1 <= grid <= schedule.MAX_GRID
    assert grid * block >= n or grid == schedule.MAX_GRID  # else the grid-stride loop goes round
    assert (grid - 1) * block < n  # no block entirely idle


def test_map_launch_examples() -> None:
    assert _launch(1) == (1, 32)
    assert _launch(100) == (4, 32)
    assert _launch(16384) == (171, 96)  # 132 SMs busy, not 64 blocks of 256
    assert _launch(132 * 256) == (132, 256)
    assert _launch(10**6) == (3907, 256)
    assert _launch(10**9) == (schedule.MAX_GRID, 256)


@given(st.integers(cc.SMS * schedule.WARP, 10**8))
def test_a_map_with_a_warp_for_every_sm_fills_them(n: int) -> None:
    assert _launch(n)[0] >= cc.SMS


def test_the_mapping_onto_threads_is_lowerings_and_the_plan_renders_it() -> None:
    """Lowering for CUDA writes each group's mapping and a long reduction's cut into the
    items; the plan launches what they say (a split reduction's two passes cover its chunks),
    and refuses code lowered for a target with no GPU threads, naming the node."""
    from ocannl.ir.assignments import Accum, Comp, Get
    from ocannl.ir.lowering import LoopGroup
    from ocannl.ir.target import PRODUCTS
    from ocannl.ir.tnode import Tnode

    x, total = Tnode("mx", (1 << 20,), Precision.f32), Tnode("mtotal", (), Precision.f32)
    comp = Comp((Accum(total, (), "+", Get(x, (0,)), (1 << 20,), reset=True),))
    (group,) = [i for i in lower(comp, cc.cuda_target()) if isinstance(i, LoopGroup)]
    assert (group.mapping, group.reduce_splits, group.reduce_chunk) == ("reduce", 512, 2048)
    plan = cc.plan_routine([group])
    assert [k.kind for k in plan.kernels] == ["partial", "final"]
    assert "q / 512" in plan.kernels[0].source and "2048" in plan.kernels[0].source
    (cpu_group,) = [i for i in lower(comp, PRODUCTS) if isinstance(i, LoopGroup)]
    assert cpu_group.mapping == ""
    with pytest.raises(ValueError, match="mtotal.*cuda_target"):
        cc.plan_routine([cpu_group])


# --- plans of the models ----------------------------------------------------------------------


def _plan(comp: object, *, use_cublas: bool = True) -> cc.Plan:
    return cc.plan_routine(lower(comp, cc.cuda_target(use_cublas)))


def test_wide_mlp_checksum_and_loss_are_block_reductions() -> None:
    p = cuda_models.build("f32", dims=(256, 1024, 1024, 10), batch=256)
    plan = _plan(p.comps["gated"])
    ks = plan.kernels
    flag = p.flag.value
    # The 1024x1024 gradient's checksum: its row of 1024 partial sums is a block reduction
    # (a block per cells, its threads over the gradient's rows), then one block sums the row
    # into the parameter's flag cell, and the cells (one per parameter) sum into the flag.
    rows = [k for k in ks if k.nodes[0].name.startswith("checksum_rows_")
            and k.nodes[1].dims == (1024, 1024)]
    assert len(rows) == 1 and rows[0].kind == "reduce" and rows[0].block == cc.BLOCK
    cells = [k for k in ks if k.kind == "reduce" and k.grid == 1
             and k.nodes[1:] == (rows[0].nodes[0],)]
    assert len(cells) == 1 and cells[0].nodes[0].name.startswith("grad_flags_")
    assert any(k.nodes == (flag, cells[0].nodes[0]) for k in ks)
    # No kernel reduces serially over more than SERIAL_RED_WIDE elements.
    for k in ks:
        for bound in map(int, _loop_bounds(k.source)):
            assert k.kind != "serial" or bound <= schedule.SERIAL_RED_WIDE, k.source
    # The loss mean over the batch is a block reduction.
    assert any(k.kind == "reduce" and k.nodes[0] is p.loss.children[0].value for k in ks)
    assert {s.kind if isinstance(s, cc.Kernel) else "gemm" for s in plan.steps} >= {
        "map", "serial", "reduce", "gemm"}


def _loop_bounds(src: str) -> list[str]:
    import re

    return re.findall(r"for \(int i\d+ = 0; i\d+ < (\d+);", src)


def test_bias_gradient_over_a_large_batch_is_parallel() -> None:
    comp, outs = cuda_cases.reduction_cases()
    plan = _plan(comp)
    bias = next(n for n in outs if n.label == "bias_grad")
    part, final = [k for k in plan.kernels if k.nodes[0] is bias]
    # 8 cells of 4096 rows: each cell split over 2 blocks, then one block per cell combines.
    assert (part.kind, part.grid, part.block) == ("partial", 16, cc.BLOCK)
    assert (final.kind, final.grid) == ("final", 8)


def test_kernel_launch_shapes_are_sane() -> None:
    for dims, batch in [((2, 16, 16, 2), 32), ((256, 1024, 1024, 10), 256)]:
        for prec in ("f32", "f16", "bf16"):
            p = cuda_models.build(prec, dims=dims, batch=batch)
            for k in _plan(p.comps["gated"]).kernels:
                assert 1 <= k.grid <= schedule.MAX_GRID and k.block % schedule.WARP == 0
                assert f"__launch_bounds__({k.block})" in k.source
                if k.kind in ("reduce", "partial", "final"):
                    assert k.block == cc.BLOCK and f"sh[{cc.BLOCK // schedule.WARP}]" in k.source


def test_narrow_gemm_copies_are_lowerings_nests_around_cublas() -> None:
    """A 16-bit operand or target of a product reaches cuBLAS through f32 nodes that lowering
    made, copied and rounded by its own nests (map kernels): the plan converts nothing."""
    comp, (c, z, w) = cuda_cases.gemm_cases()
    steps = _plan(comp).steps
    kinds = [s.kind if isinstance(s, cc.Kernel) else "gemm" for s in steps]
    # c (f16) += a (f16) @ bt.T (bf16): copy both operands and c to f32, GEMM with beta 1,
    # round back into c.
    assert kinds[:5] == ["map", "map", "map", "gemm", "map"]
    g = steps[3]
    assert g.beta == 1.0 and g.gemm.b.transposed
    assert {g.gemm.a.node.prec, g.gemm.b.node.prec, g.gemm.assign.lhs.prec} == {Precision.f32}
    assert steps[4].nodes[0] is c
    # z (f32) += x.T @ y: straight into z's buffer.
    assert kinds[5] == "gemm" and steps[5].gemm.assign.lhs is z and steps[5].gemm.a.transposed
    # w (bf16) = a @ y, reset: the f32 copy of a is current (nothing wrote a); no copy of w
    # first, beta 0, then w rounded from the f32 result.
    assert kinds[6:] == ["gemm", "map"] and steps[6].beta == 0.0 and steps[7].nodes[0] is w
    assert not any(isinstance(s, cc.Kernel) and s.kind == "convert" for s in steps)


def test_without_cublas_gemms_are_loop_nests() -> None:
    comp, _ = cuda_cases.gemm_cases()
    plan = _plan(comp, use_cublas=False)
    assert not any(isinstance(s, cc.GemmCall) for s in plan.steps)
    assert {k.kind for k in plan.kernels} <= {"reduce", "serial", "partial", "final", "fill",
                                               "map"}


def test_sources_do_not_depend_on_labels_or_node_ids() -> None:
    """The same model built twice (fresh node ids) gives the same kernels: the cache by
    source is shared across identical code."""
    a = cuda_models.build("f16")
    b = cuda_models.build("f16")
    assert cc.cuda_sources(a.comps["gated"]) == cc.cuda_sources(b.comps["gated"])


# --- literals ---------------------------------------------------------------------------------


def test_literals_are_exact_and_parenthesised() -> None:
    f = cc.CudaFlavour([])
    text = f.literal(0.1, Precision.f32)
    assert text.endswith("f") and np.float32(float(text[:-1])) == np.float32(0.1)
    assert float(text[:-1]) == float(np.float32(0.1))  # the float32 value, exactly
    assert f.literal(0.1, Precision.f64) == "0.1"
    assert f.literal(-0.5, Precision.f32) == "(-0.5f)"  # never "--0.5f" after a minus
    assert f.literal(math.inf, Precision.f32) == "__int_as_float(0x7f800000)"
    assert f.literal(-math.inf, Precision.f32) == "(-__int_as_float(0x7f800000))"
    assert "0x7fc00000" in f.literal(math.nan, Precision.f32)
    assert "0x7ff0000000000000" in f.literal(-math.inf, Precision.f64)
    assert f.literal(1e-45, Precision.f32) != "0.0f"  # subnormal f32 kept
    assert f.literal(1e300, Precision.f32) == "__int_as_float(0x7f800000)"  # overflows to inf


# --- when no GPU is usable --------------------------------------------------------------------


def test_no_cupy_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(rt.CudaUnavailable, match="CuPy is not installed"):
        Context.cuda()


def test_no_device_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, devices=0)
    with pytest.raises(rt.CudaUnavailable, match="no CUDA device"):
        Context.cuda()


def test_bad_device_id_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, devices=1)
    with pytest.raises(rt.CudaUnavailable, match="device_id 3 is out of range: 1 CUDA"):
        Context.cuda(3)


def test_no_driver_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    cp = fake_cupy.install(monkeypatch)

    def fail() -> int:
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    cp.cuda.runtime = types.SimpleNamespace(getDeviceCount=fail)
    with pytest.raises(rt.CudaUnavailable, match="no usable NVIDIA driver"):
        Context.cuda()


def test_auto_falls_back_to_the_cpu_saying_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(Context, "_fallback_said", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a, b = Context.auto(), Context.auto()
    assert a.backend_name() == b.backend_name() == "cpu"
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "CuPy is not installed" in msgs[0]


def test_this_machine_reports_a_reason_or_none() -> None:
    reason = rt.cuda_unavailable_reason()
    assert reason is None or any(w in reason for w in ("CuPy", "driver", "device"))
