"""One launch per routine call, without a GPU: routines captured as CUDA graphs by the real
backend over the stand-in ``cupy`` (:mod:`fake_cupy`, which records a capture and replays it,
refusing what CUDA refuses while capturing), products through cuBLAS's ``gemmEx`` family with
16-bit operands as stored, and the switches (``OCANNL_CUDA_GRAPHS``, ``OCANNL_CUDA_TF32``)."""

from __future__ import annotations

import warnings

import cuda_cases
import cuda_checks as C
import cuda_models as M
import fake_cupy
import numpy as np
import pytest
import test_cuda_recipes as R
from cuda_emu import emulator_unavailable
from f64_reference import evaluate

from ocannl import Context, train
from ocannl.backends.cuda.plan import GemmCall, Kernel, cuda_target, plan_routine
from ocannl.backends.cuda.runtime import BoundRoutine, CupyCudaBackend
from ocannl.clipping import ClipNorm
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.lowering import BatchAxis, lower
from ocannl.ir.ops import Precision
from ocannl.ir.schedule import batch_runs
from ocannl.ir.tnode import Tnode

_missing = emulator_unavailable()
needs_emu = pytest.mark.skipif(_missing is not None, reason=f"no emulator: {_missing}")


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    monkeypatch.delenv("OCANNL_CUDA_GRAPHS", raising=False)
    monkeypatch.delenv("OCANNL_CUDA_TF32", raising=False)


def _host_submissions() -> list[tuple[str, str]]:
    """What the host submitted to the device, copies in left out."""
    return [s for s in fake_cupy.submissions if s[0] != "copy"]


def _gated_run(prec: str, steps: int, *, lr: list[float] | None = None
               ) -> tuple[Context, object, list[bytes]]:
    """``steps`` runs of the fused gated step of the test MLP (a learning rate written before
    step ``k`` when ``lr[k]`` is given), and the parameters' bits after."""
    p = M.build(prec, dims=(2, 16, 16, 2), batch=64)
    ctx = train.init_params(Context.cuda(), p.loss)
    ctx, routine = ctx.compile(p.comps["gated"])
    for k in range(steps):
        if lr is not None and lr[k] is not None:
            ctx.set_values(p.lr, lr[k])
        ctx.run(routine)
    return ctx, routine, [ctx.get_values(t).tobytes() for t in p.params]


@needs_emu
@pytest.mark.parametrize("prec", ["f32", "bf16", "f16"])
def test_each_routine_call_is_one_graph_launch(prec: str) -> None:
    """The first call captures the routine's kernels and cuBLAS calls (nothing runs while
    capturing) and launches the graph; every call is exactly one graph launch."""
    fake_cupy.submissions.clear()
    ctx, routine, _ = _gated_run(prec, 3)
    call = routine.call
    assert isinstance(call, BoundRoutine) and call.graph is not None
    assert _host_submissions() == [("graph", str(call.graph.id))] * 3
    assert call.graph.launches == 3
    plan = routine.compiled.plan
    kinds = [k for k, _, _ in call.graph.steps]
    assert kinds.count("kernel") == len(plan.kernels)
    assert kinds.count("gemm") == sum(isinstance(s, GemmCall) for s in plan.steps) > 0
    assert fake_cupy._streams[call.stream.ptr] is call.stream  # the backend's own stream


@needs_emu
@pytest.mark.parametrize("prec", ["f32", "bf16", "f16"])
def test_graph_replay_equals_eager_launches_bit_for_bit(
        monkeypatch: pytest.MonkeyPatch, prec: str) -> None:
    _, graphed, replayed = _gated_run(prec, 3)
    assert graphed.call.graph is not None
    monkeypatch.setenv("OCANNL_CUDA_GRAPHS", "0")
    fake_cupy.submissions.clear()
    _, eager, launched = _gated_run(prec, 3)
    assert eager.call.graph is None
    assert not any(kind == "graph" for kind, _ in fake_cupy.submissions)
    assert len(_host_submissions()) == 3 * len(eager.call.launches)
    assert replayed == launched


@needs_emu
def test_set_values_between_replays_reaches_the_next_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A learning rate written between replays (an asynchronous copy on the routine's stream)
    changes what the next replay computes, with no recapture, bit for bit as eager launches
    with that learning rate."""
    schedule = [None, 0.3, None, 0.05]
    ctx, routine, changed = _gated_run("f16", 4, lr=schedule)
    graph = routine.call.graph
    assert graph is not None and graph.launches == 4
    streams = {id(s) for s in fake_cupy.copied}
    assert streams == {id(routine.call.stream)}  # every write on the routine's stream
    _, _, steady = _gated_run("f16", 4)
    assert changed != steady
    monkeypatch.setenv("OCANNL_CUDA_GRAPHS", "0")
    _, _, eager = _gated_run("f16", 4, lr=schedule)
    assert changed == eager


@needs_emu
def test_a_failed_capture_runs_eagerly_saying_so_once() -> None:
    """Both captures fail (the first call's and the retry at the second): one warning naming the
    routine and the reason, every call's launches one by one, the values of a graphed run."""
    _, _, graphed = _gated_run("bf16", 3)
    fake_cupy.capture_failures.extend(["cudaErrorStreamCaptureUnsupported: on demand"] * 2)
    fake_cupy.submissions.clear()
    with pytest.warns(RuntimeWarning) as caught:
        ctx, routine, fell_back = _gated_run("bf16", 3)
    said = [str(w.message) for w in caught if "graph capture failed" in str(w.message)]
    assert len(said) == 1
    assert routine.label in said[0] and "on demand" in said[0]
    assert routine.call.graph is None and routine.call.eager
    assert not fake_cupy.capture_failures  # no third capture
    assert not any(kind == "graph" for kind, _ in fake_cupy.submissions)
    assert len(_host_submissions()) == 3 * len(routine.call.launches)
    assert fell_back == graphed


@needs_emu
def test_one_failed_capture_is_retried_at_the_next_call_silently() -> None:
    """A first use may initialise what a capture refuses: the first call then runs eagerly and
    the second captures; no warning."""
    _, _, graphed = _gated_run("f16", 3)
    fake_cupy.capture_failures.append("cudaErrorStreamCaptureUnsupported: first use")
    fake_cupy.submissions.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*graph capture failed")
        _, routine, retried = _gated_run("f16", 3)
    call = routine.call
    assert call.graph is not None and call.graph.launches == 2 and not call.eager
    subs = _host_submissions()
    n = len(call.launches)
    assert {kind for kind, _ in subs[:n]} == {"kernel", "gemm"}  # the first call, eager
    assert subs[n:] == [("graph", str(call.graph.id))] * 2
    assert retried == graphed


def test_the_stand_in_refuses_what_a_capture_refuses() -> None:
    """An allocation, a synchronizing copy or call, and work on another stream void the capture
    (``end_capture`` then fails, as CUDA's ``cudaErrorStreamCaptureInvalidated``)."""
    cp = fake_cupy.sys.modules["cupy"]
    buf = cp.zeros(4, dtype=np.float32)
    for bad in (lambda s: cp.zeros(4, dtype=np.float32), lambda s: buf.get(),
                lambda s: s.synchronize(), lambda s: cp.cuda.Device(0).synchronize()):
        s = cp.cuda.Stream()
        with s:
            s.begin_capture()
            with pytest.raises(fake_cupy.CUDARuntimeError, match="during stream capture"):
                bad(s)
            with pytest.raises(fake_cupy.CUDARuntimeError, match="Invalidated"):
                s.end_capture()
    s = cp.cuda.Stream()
    s.begin_capture()
    with pytest.raises(fake_cupy.CUDARuntimeError, match="legacy stream"):
        fake_cupy._submit(None, "kernel", "k", lambda: None)
    with pytest.raises(fake_cupy.CUDARuntimeError, match="Invalidated"):
        s.end_capture()


@needs_emu
def test_a_recipe_step_is_one_graph_launch_per_routine_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The f16 recipe with clipping, accumulation and the fused gate, then the host gate: every
    routine call after its first is one graph launch and nothing else; the host gate's checksum
    read is a read, outside any graph."""
    calls = []
    real = BoundRoutine.__call__

    def counted(self: BoundRoutine) -> None:
        calls.append(self)
        real(self)

    monkeypatch.setattr(BoundRoutine, "__call__", counted)
    for gate in ("gated", "scaled"):
        calls.clear()
        fake_cupy.submissions.clear()
        R.run(Context.cuda, gate, ClipNorm(0.05), "f16", inject=False)
        graphs = [s for s in _host_submissions() if s[0] == "graph"]
        assert len(graphs) == len(calls) >= 12
        assert len(_host_submissions()) == len(calls)  # no launch outside a graph
        assert all(c.graph is not None for c in calls)


def test_graphs_and_tf32_switches_are_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CupyCudaBackend().graphs and not CupyCudaBackend().tf32
    monkeypatch.setenv("OCANNL_CUDA_GRAPHS", "0")
    monkeypatch.setenv("OCANNL_CUDA_TF32", "1")
    be = CupyCudaBackend()
    assert not be.graphs and be.tf32
    assert CupyCudaBackend(graphs=True, tf32=False).graphs
    for name, value in (("OCANNL_CUDA_GRAPHS", "yes"), ("OCANNL_CUDA_TF32", "2")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got '{value}'"):
            Context.cuda()
        monkeypatch.setenv(name, "0")


# --- products through gemmEx ---------------------------------------------------------------


def _data(name: str, dims: tuple[int, ...], prec: Precision, seed: int) -> Tnode:
    rng = np.random.default_rng(seed)
    return Tnode(name, dims, prec, host_data=rng.normal(size=dims).astype(prec.numpy_dtype))


def native_cases() -> tuple[Comp, list[Tnode]]:
    """Products cuBLAS takes as stored: f16 @ f16 and bf16 @ bf16 into f32 (setting, and
    accumulating with a transposed operand), a batched product over one batch axis (an
    attention score's shape) and over two that fold into one stride, and one over two that
    do not (the output's batch axes in the other order)."""
    f32, f16, bf16 = Precision.f32, Precision.f16, Precision.bf16
    a = _data("na", (32, 64), f16, 0)
    b = _data("nb", (64, 48), f16, 1)
    at = _data("nat", (64, 32), bf16, 2)  # read transposed
    bt = _data("nbt", (48, 64), bf16, 3)  # read transposed
    acc = _data("nacc", (32, 48), f32, 4)
    q = _data("nq", (2, 3, 16, 8), bf16, 5)
    k = _data("nk", (2, 3, 16, 8), bf16, 6)
    x = _data("nx", (4, 5, 16, 16), f16, 7)
    y = _data("ny", (4, 5, 16, 12), f16, 8)
    out = Tnode("nout", (32, 48), f32)
    scores = Tnode("nscores", (2, 3, 16, 16), f32)
    cross = Tnode("ncross", (5, 4, 16, 12), f32)  # batch axes swapped in the output
    code = (
        Accum(out, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))), (32, 48, 64),
              reset=True),
        Accum(acc, (0, 1), "+", apply("mul", Get(at, (2, 0)), Get(bt, (1, 2))), (32, 48, 64)),
        Accum(scores, (0, 1, 2, 3), "+", apply("mul", Get(q, (0, 1, 2, 4)),
                                               Get(k, (0, 1, 3, 4))), (2, 3, 16, 16, 8),
              reset=True),
        Accum(cross, (1, 0, 2, 3), "+", apply("mul", Get(x, (0, 1, 2, 4)),
                                              Get(y, (0, 1, 4, 3))), (4, 5, 16, 12, 16),
              reset=True),
    )
    return Comp(code, "native"), [out, acc, scores, cross]


def test_16_bit_products_are_gemm_ex_as_stored_and_batched_ones_strided() -> None:
    comp, (out, acc, scores, cross) = native_cases()
    plan = plan_routine(lower(comp, cuda_target()))
    assert all(isinstance(s, GemmCall) for s in plan.steps), [
        s.kind for s in plan.steps if isinstance(s, Kernel)]  # no conversion kernel
    by_lhs = {s.gemm.assign.lhs.id: s.gemm for s in plan.steps}
    assert {by_lhs[out.id].a.node.prec, by_lhs[acc.id].a.node.prec} == {Precision.f16,
                                                                        Precision.bf16}
    outer, run = batch_runs(by_lhs[scores.id].batch)
    assert outer == () and run is not None and run.size == 6  # two batch axes, one stride
    outer, run = batch_runs(by_lhs[cross.id].batch)
    assert [x.size for x in outer] == [5] and run is not None and run.size == 4  # 5 calls


def test_batch_axes_fold_only_where_their_strides_do() -> None:
    assert batch_runs(()) == ((), None)
    assert batch_runs((BatchAxis(1, 99, 7, 3),)) == ((), None)
    folded = batch_runs((BatchAxis(2, 60, 24, 24), BatchAxis(3, 20, 8, 8)))
    assert folded == ((), BatchAxis(6, 20, 8, 8))
    kept = batch_runs((BatchAxis(2, 60, 24, 24), BatchAxis(3, 20, 8, 9)))
    assert kept == ((BatchAxis(2, 60, 24, 24),), BatchAxis(3, 20, 8, 9))


@needs_emu
@pytest.mark.parametrize("tf32", ["0", "1"])
def test_gemm_ex_products_match_the_reference(monkeypatch: pytest.MonkeyPatch, tf32: str) -> None:
    """Through the stand-in's cuBLAS, which reads raw pointers with their data types and leading
    dimensions: f16 / bf16 as stored into f32 with CUBLAS_COMPUTE_32F (whatever TF32 says), f32
    with TF32 only when asked."""
    monkeypatch.setenv("OCANNL_CUDA_TF32", tf32)
    comp, outs = native_cases()
    fake_cupy.gemms.clear()
    C.check_comp(Context.cuda, comp, outs)
    calls = fake_cupy.gemms
    assert {(c["Atype"], c["Ctype"], c["compute"]) for c in calls} == {
        (fake_cupy.CUDA_R_16F, fake_cupy.CUDA_R_32F, fake_cupy.CUBLAS_COMPUTE_32F),
        (fake_cupy.CUDA_R_16BF, fake_cupy.CUDA_R_32F, fake_cupy.CUBLAS_COMPUTE_32F)}
    assert [c["name"] for c in calls].count("gemmStridedBatchedEx") == 1 + 5  # scores; cross
    fake_cupy.gemms.clear()
    comp, (_, z, _) = cuda_cases.gemm_cases()  # f32 products (mixed operands widened)
    ctx = Context.cuda()
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    want = fake_cupy.CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 == "1" else fake_cupy.CUBLAS_COMPUTE_32F
    assert {c["compute"] for c in fake_cupy.gemms} == {want}
    ref = evaluate(comp)[z.id].value
    err = np.abs(ctx.get_values(z).astype(np.float64) - ref).max() / np.abs(ref).max()
    # f32 within a few f32 ulps of the scale; TF32's 10-bit mantissas, far more
    assert (err > 2**-16) if tf32 == "1" else (err < 2**-20), err


def test_the_stand_in_gemm_is_strict() -> None:
    """A wrong leading dimension, data type or transposition fails in the stand-in, as it would
    read other memory on a GPU."""
    cp = fake_cupy.sys.modules["cupy"]
    lib = fake_cupy.sys.modules["cupy_backends.cuda.libs.cublas"]
    h = lib.create()
    a = cp.zeros(6, dtype=np.float16)
    c = cp.zeros(4, dtype=np.float32)
    one = np.ones(1, np.float32)
    args = dict(m=2, n=2, k=3, A=a.data.ptr, lda=2, B=a.data.ptr, ldb=3)

    def call(**kw: object) -> None:
        x = {**args, **kw}
        lib.gemmEx(h, lib.CUBLAS_OP_N, x.get("transb", lib.CUBLAS_OP_N), x["m"], x["n"], x["k"],
                   one.ctypes.data, x["A"], x.get("Atype", fake_cupy.CUDA_R_16F), x["lda"],
                   x["B"], x.get("Atype", fake_cupy.CUDA_R_16F), x["ldb"], one.ctypes.data,
                   c.data.ptr, fake_cupy.CUDA_R_32F, 2, lib.CUBLAS_COMPUTE_32F,
                   lib.CUBLAS_GEMM_DEFAULT)

    call()
    with pytest.raises(AssertionError, match="leading dimension 1 < 2"):
        call(lda=1)
    with pytest.raises(AssertionError, match="data type"):
        call(Atype=fake_cupy.CUDA_R_16BF)
    with pytest.raises(AssertionError, match="ends at element"):
        call(transb=lib.CUBLAS_OP_T, ldb=3)  # B read as 2 x 3, columns 3 apart: 9 elements


def test_the_context_names_its_products_and_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Context.describe()`` on CUDA: CuPy's wheel and CUDA major, the 16-bit products through
    gemmEx, the TF32 choice and whether routines are graphs."""
    line = Context.cuda().describe()
    assert line.startswith("cuda: device 0, CuPy ")
    assert "f16 and bf16 products through cuBLAS gemmEx" in line and "in full f32" in line
    assert line.endswith("CUDA graphs on")
    monkeypatch.setenv("OCANNL_CUDA_GRAPHS", "0")
    monkeypatch.setenv("OCANNL_CUDA_TF32", "1")
    line = Context.cuda().describe()
    assert "with TF32" in line and line.endswith("CUDA graphs off (OCANNL_CUDA_GRAPHS=0)")


@needs_emu
def test_a_data_parallel_rank_of_several_shards_on_the_cuda_backend() -> None:
    C.data_parallel_shards()
