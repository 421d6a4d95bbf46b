"""Data-parallel training (ocannl.parallel): the flat gradient buffer, the communicators, and
real multi-process runs under ``mpiexec -n 2`` (and ``-n 3`` on this 2-core machine) compared
bit for bit with single-process references (tests/parallel_worker.py runs both).

Every ``mpiexec`` starts in its own session with a timeout; on timeout the harness sends
SIGTERM to its process group and to every process it started, then SIGKILL, and each test
checks that no process of the job is left.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import parallel_worker as W
import pytest

import ocannl.tensor as T
from ocannl import Context, Failure, checkpoint, mixed_prec, nn_blocks, optim, parallel, train
from ocannl.ir.ops import Precision

HERE = Path(__file__).resolve().parent
WORKER = HERE / "parallel_worker.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
# How long a job given a ``ready`` test may take to get ready before it counts as hung.
START_S = 120.0
F32 = [v for v in W.VARIANTS if v.endswith("f32")]

_no_mpi = None
if importlib.util.find_spec("mpi4py") is None:
    _no_mpi = "mpi4py is not installed (pip install -e '.[dist]')"
elif not (MPIEXEC.exists() or shutil.which("mpiexec")):
    _no_mpi = "no mpiexec (pip install mpich)"
needs_mpi = pytest.mark.skipif(_no_mpi is not None, reason=str(_no_mpi))


# --- the launcher -------------------------------------------------------------------------------


def _procs() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, start time, state) of every process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        rest = text[text.rindex(")") + 2:].split()
        out[int(entry)] = (int(rest[1]), rest[19], rest[0])
    return out


def _descendants(root: int, known: dict[int, str]) -> None:
    """Add every live descendant of ``root`` to ``known`` (pid -> start time)."""
    procs = _procs()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            known.setdefault(c, procs[c][1])
            todo.append(c)


def _alive(known: dict[int, str]) -> list[int]:
    procs = _procs()
    return [p for p, start in known.items()
            if p in procs and procs[p][1] == start and procs[p][2] != "Z"]


@dataclass
class Job:
    rc: int
    out: str
    timed_out: bool
    seconds: float
    left: list[int]  # processes of the job still alive after it ended (must be empty)
    ended: float = 0.0  # the wall-clock time at which it ended


def mpirun(n: int, *args: str | Path, timeout: float = 90.0, grace: float = 3.0,
           script: Path = WORKER, ready: Callable[[], bool] | None = None,
           wrap: Callable[[list[str]], list[str]] | None = None,
           unset: tuple[str, ...] = ()) -> Job:
    """``mpiexec -n N python -m mpi4py SCRIPT ARGS`` (the worker by default), in a new
    session; on timeout SIGTERM to its process group and every process of the job, then
    SIGKILL. ``ready``: the timeout counts from when it first holds (what the job wrote, not
    how long its start took on a busy machine), and ``Job.seconds`` too. ``wrap``: each
    rank's command line made another (a shell around it); ``unset``: environment variables
    the job does not inherit."""
    mpiexec = str(MPIEXEC) if MPIEXEC.exists() else str(shutil.which("mpiexec"))
    rank = [sys.executable, "-m", "mpi4py", str(script), *map(str, args)]
    cmd = [mpiexec, "-n", str(n), *(wrap(rank) if wrap else rank)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in unset:
        env.pop(name, None)
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        known: dict[int, str] = {}
        timed_out = False
        waiting = ready is not None  # for the job to be ready, at most START_S
        try:
            while proc.poll() is None:
                _descendants(proc.pid, known)
                if waiting and ready():  # type: ignore[misc]
                    waiting, t0 = False, time.monotonic()
                if time.monotonic() - t0 > (START_S if waiting else timeout):
                    timed_out = True
                    _stop(proc, known, grace)
                    break
                time.sleep(0.1)
        except BaseException:  # pytest-timeout's failure, Ctrl-C: the job goes too
            _stop(proc, known, grace)
            raise
        proc.wait()
        ended = time.time()
        seconds = time.monotonic() - t0
        deadline = time.monotonic() + grace
        left = _alive(known)
        while left and time.monotonic() < deadline:  # the job's own cleanup, still running
            time.sleep(0.1)
            left = _alive(known)
        for pid in left:  # never leave a process behind, even when the test then fails
            os.kill(pid, signal.SIGKILL)
        log.seek(0)
        out = log.read()
    return Job(proc.returncode, out, timed_out, seconds, left, ended)


def _stop(proc: subprocess.Popen, known: dict[int, str], grace: float) -> None:
    _descendants(proc.pid, known)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for pid in _alive(known):  # ranks run in sessions of their own (hydra's setsid)
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        if not _alive(known):
            return


def ok(job: Job) -> Job:
    assert not job.timed_out and job.rc == 0, f"rc={job.rc}, timed out={job.timed_out}:\n" \
                                              f"{job.out[-4000:]}"
    assert job.left == []
    return job


# --- results ------------------------------------------------------------------------------------


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state_names"] == b["state_names"] and all(
        x.dtype == y.dtype and np.array_equal(_bits(x), _bits(y))
        for x, y in zip(a["state"], b["state"], strict=True))


COUNTERS = ("scale", "good_steps", "applied", "skipped", "windows", "skipped_windows")


def counters(r: dict[str, Any]) -> tuple:
    return tuple(r[k] for k in COUNTERS)


def ranks(out: Path, tag: str, variant: str, n: int) -> list[dict[str, Any]]:
    return [W.load_result(out / f"{tag}-{variant}-rank{r}.npz") for r in range(n)]


@pytest.fixture(scope="module")
def refs() -> dict[str, dict[str, Any]]:
    """Single-process references, run in this process (which also compiles, once, the code
    the ranks then load from the cache): the per-shard gradients of 2 virtual ranks summed in
    rank order, and (f32) the whole global batch at once."""
    out = {}
    for v in W.VARIANTS:
        out[f"sum2-{v}"] = W.run(W.VirtualRanks(2), v)
    for v in F32:
        out[f"global-{v}"] = W.run(parallel.SingleProcess(), v)
    return out


@pytest.fixture(scope="module")
def two(refs: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant trained by ``mpiexec -n 2``."""
    if _no_mpi:
        pytest.skip(_no_mpi)
    out = tmp_path_factory.mktemp("dp2")
    ok(mpirun(2, "train", "--out", out, "--tag", "two"))
    return out


# --- in one process -----------------------------------------------------------------------------


def test_importing_parallel_does_not_start_mpi() -> None:
    code = "import sys, ocannl.parallel; sys.exit('mpi4py' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_communicators_share_one_protocol() -> None:
    for cls in (parallel.SingleProcess, parallel.MpiCommunicator, parallel.NcclCommunicator):
        for name in ("allreduce_sum", "bcast_buffer", "bcast", "allgather", "allreduce_max",
                     "barrier", "abort"):
            assert callable(getattr(cls, name)), (cls, name)
    one = parallel.SingleProcess()
    assert isinstance(one, parallel.Communicator) and (one.rank, one.size) == (0, 1)
    buf = np.arange(4, dtype=np.float32)
    one.allreduce_sum(buf)
    one.bcast_buffer(buf)
    assert buf.tolist() == [0, 1, 2, 3] and one.allgather("a") == ["a"] and one.bcast(5) == 5
    assert one.allreduce_max(3) == 3
    with pytest.raises(ValueError, match="f32"):
        one.allreduce_sum(np.zeros(2, np.float16))
    with pytest.raises(ValueError, match="root"):
        one.bcast(1, root=1)
    assert isinstance(parallel.world("single"), parallel.SingleProcess)
    with pytest.raises(ValueError, match="kind"):
        parallel.world("tcp")


@needs_mpi
def test_a_broadcast_of_masters_reaches_their_kept_twins(tmp_path: Path) -> None:
    """Ranks that drew different masters of bf16 twins, each run its forward pass once (its
    kept twins then hold its own masters), broadcast rank 0's and run it again: every rank gets
    rank 0's loss, not one from twins of the masters it drew (``ocannl.ir.kept``)."""
    import json

    ok(mpirun(2, "twins", "--out", tmp_path, timeout=120))
    r0, r1 = (json.loads((tmp_path / f"twins-rank{r}.json").read_text()) for r in (0, 1))
    assert r0["own"] != r1["own"]  # the ranks drew different masters
    assert r0["everyone"] == r1["everyone"] == [r0["own"], r0["own"]]


def test_shard_refuses_unequal_parts() -> None:
    rows = np.arange(12)
    assert parallel.shard(rows, 1, 3).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="10 rows does not split into 3 equal shards"):
        parallel.shard(rows[:10], 0, 3)
    with pytest.raises(ValueError, match="rank"):
        parallel.shard(rows, 3, 3)


def _model(batch: int = 16, prec: str = "f32", hidden: int = 16) -> tuple:
    T.set_seed(0)
    x = T.term(np.zeros((batch, 2)), label="x")
    y = T.term(np.zeros((batch, 2)), label="y")
    logits, _ = nn_blocks.mlp(x, [hidden], 2, prec=prec)
    return x, y, nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)


def test_gradients_are_views_of_one_flat_buffer() -> None:
    x, y, loss = _model()
    ctx = Context.cpu()
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y])
    ctx = dp.setup(ctx)
    flat = dp.flat
    assert flat is not None and flat.prec is Precision.f32
    buf = ctx.device_buffer(flat)
    offsets = []
    for p in loss.params:
        view = ctx.device_buffer(p.grad)
        assert np.shares_memory(view, buf) and view.size == p.grad.size
        offsets.append((view.ctypes.data - buf.ctypes.data) // 4)
    assert all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets)
    assert ctx.mem() == flat.size * 4  # the views are not counted twice
    values = np.arange(flat.size, dtype=np.float32)
    ctx = ctx.set_values(flat, values)
    p = loss.params[1]
    got = ctx.get_values(p.grad).reshape(-1)
    assert np.array_equal(got, values[offsets[1]:offsets[1] + p.grad.size])
    with pytest.raises(ValueError, match="setup was already called"):
        dp.setup(ctx)
    with pytest.raises(ValueError, match="already has a buffer"):
        ctx.share_flat([loss.params[0].grad])
    with pytest.raises(ValueError, match="one precision"):
        Context.cpu().share_flat([loss.params[0].value, T.term(np.zeros(2), prec="f16")])
    with pytest.raises(ValueError, match="no nodes"):
        Context.cpu().share_flat([])


def _one_flat() -> tuple:
    """``_model()``'s gradients in one flat buffer (one rank), its gradient routine compiled,
    the parameters initialized: ``(x, y, loss, dp, ctx, grads)``."""
    x, y, loss = _model()
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y])
    ctx = dp.setup(Context.cpu())
    ctx, grads = ctx.compile(train.grad_update(loss))
    return x, y, loss, dp, train.init_params(ctx, loss), grads


def test_a_routine_rebound_writes_its_gradients_into_other_memory() -> None:
    """A data-parallel rank's later shards write their gradients into buffers of their own: the
    same machine code bound there (no compile), the same bits, flat untouched."""
    x, y, loss, dp, ctx, grads = _one_flat()
    rng = np.random.default_rng(3)
    ctx = ctx.set_values(x, rng.normal(size=(16, 2)))
    ctx = ctx.set_values(y, np.eye(2)[rng.integers(0, 2, 16)])
    want = np.array(ctx.run(grads).get_values(dp.flat))
    assert np.count_nonzero(want) > 0
    compiles = ctx.compile_count
    spare = ctx.new_buffer(dp.flat)
    moved = ctx.rebound(grads, dp.flat, spare)
    sentinel = np.full(dp.flat.size, 7.0, np.float32)
    ctx = ctx.set_values(dp.flat, sentinel).run(moved)
    assert ctx.compile_count == compiles
    assert np.array_equal(spare, want)  # every bit, the padding's zeros too
    assert np.array_equal(ctx.get_values(dp.flat), sentinel)
    with pytest.raises(ValueError, match=r"storage must be a buffer like .*float32 \(\d+,\).*"
                                         r"float64"):
        ctx.rebound(grads, dp.flat, np.zeros(dp.flat.size))
    with pytest.raises(ValueError, match=r"storage must be a buffer like .* got ndarray float32 "
                                         r"\(3,\)"):
        ctx.rebound(grads, dp.flat, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="is not a flat buffer from share_flat"):
        ctx.rebound(grads, loss.params[0].value, spare)
    with pytest.raises(ValueError, match="is not a routine of this context"):
        Context.cpu().rebound(grads, dp.flat, spare)


def test_a_routine_rebound_to_read_staged_inputs_computes_their_gradients() -> None:
    """``rebound(reads=)``: the routine reads the inputs from staged blocks instead of their
    own buffers: the gradients of those rows, bit for bit as writing them into the inputs,
    the inputs untouched. A node the routine writes, or does not read, or a buffer unlike the
    node's own, is refused naming it."""
    x, y, loss, dp, ctx, grads = _one_flat()
    rng = np.random.default_rng(4)
    xs, ys = rng.normal(size=(32, 2)), np.eye(2)[rng.integers(0, 2, 32)]
    ctx = ctx.set_values(x, xs[16:]).set_values(y, ys[16:])
    want = np.array(ctx.run(grads).get_values(dp.flat))
    ctx = ctx.set_values(x, xs[:16]).set_values(y, ys[:16])
    sx, sy = ctx.staged(x, 2), ctx.staged(y, 2)
    sx.write(sx.check(xs))
    sy.write(sy.check(ys))
    spare = ctx.new_buffer(dp.flat)
    moved = ctx.rebound(grads, dp.flat, spare, reads={x: sx.views[1], y: sy.views[1]})
    ctx.run(moved)
    assert np.array_equal(spare, want)
    assert np.array_equal(ctx.get_values(x), np.float32(xs[:16]))
    with pytest.raises(ValueError, match=rf"writes {loss.value.name}: reads= moves a node the "
                                         r"routine only reads"):
        ctx.rebound(grads, dp.flat, spare, reads={loss: np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=r"does not read stray"):
        ctx.rebound(grads, dp.flat, spare,
                    reads={T.term(np.zeros(2), label="stray"): np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match=r"x\w*'s reads must move to a buffer like its own "
                                         r"\(ndarray float32 \(32,\)\), got ndarray float64"):
        ctx.rebound(grads, dp.flat, spare, reads={x: np.zeros(32)})


def test_narrow_gradients_are_never_summed() -> None:
    _, _, loss = _model(prec="f16")
    with pytest.raises(ValueError, match=r"must be f32.*narrow buffers are never summed.*"
                                         r"with_master_weights"):
        parallel.DataParallel(parallel.SingleProcess(), loss)
    with pytest.raises(TypeError, match="Communicator"):
        parallel.DataParallel(object(), loss)  # type: ignore[arg-type]
    _, _, f32_loss = _model()
    with pytest.raises(TypeError, match="track_losses must be True or False, got 'no'"):
        parallel.DataParallel(parallel.SingleProcess(), f32_loss, track_losses="no")


class _Disagreeing(parallel.SingleProcess):
    """Two ranks whose second one reports ``other`` (a description of another model)."""

    size = 2

    def __init__(self, other: dict) -> None:
        self.other = other

    def allgather(self, obj: Any) -> list[Any]:
        return [obj, self.other]


def test_ranks_disagreeing_on_the_model_or_shards_are_refused_before_any_collective() -> None:
    x, y, loss = _model()
    x2, y2, wider = _model(hidden=24)
    other = parallel.DataParallel(parallel.SingleProcess(), wider, inputs=[x2, y2]).description()
    dp = parallel.DataParallel(_Disagreeing(other), loss, inputs=[x, y])
    with pytest.raises(Failure, match=r"disagree on the model .*mlp_w0 dims \(16, 2\) f32 vs "
                                      r"mlp_w0 dims \(24, 2\) f32"):
        dp.setup(Context.cpu())
    assert dp.flat is None
    xs, ys, loss3 = _model(batch=15)
    other = parallel.DataParallel(parallel.SingleProcess(), loss3, inputs=[xs, ys]).description()
    dp = parallel.DataParallel(_Disagreeing(other), loss, inputs=[x, y])
    with pytest.raises(Failure, match=r"shards differ \(rank 0: x \(16, 2\).*rank 1: x \(15, 2\)"):
        dp.setup(Context.cpu())


def test_a_world_of_one_is_the_plain_recipe_bit_for_bit() -> None:
    """SingleProcess: the gradient routine, a no-op allreduce, then the checksum and the
    update give the bits of the recipe without a reducer (gradients and checksum fused)."""
    for v in ("sgd-host-f32",):
        dp = W.run(parallel.SingleProcess(), v, global_batch=16)
        plain = W.run(parallel.SingleProcess(), v, global_batch=16, plain=True)
        assert same_state(dp, plain) and counters(dp) == counters(plain)
        assert np.array_equal(dp["losses"], plain["losses"], equal_nan=True)
        assert dp["reductions"] == 12


def test_without_loss_scaling_the_mean_folds_into_grad_unscale() -> None:
    """Plain f32 training: the optimizer multiplies the summed gradients by 1 / world."""
    x, y, loss = _model()
    comm = W.VirtualRanks(2)
    dp = parallel.DataParallel(comm, loss, inputs=[x, y])
    ctx = dp.setup(Context.cpu())
    unscale = dp.grad_unscale()
    opt = optim.SGD(0.1)
    ctx, grads = ctx.compile(train.grad_update(loss))
    ctx, update = ctx.compile(opt.update(loss, grad_unscale=unscale))
    ctx = train.init_params(ctx, loss)
    rng = np.random.default_rng(0)
    xb, yb = rng.normal(size=(2, 16, 2)), np.eye(2)[rng.integers(0, 2, (2, 16))]

    def feed(ctx: Context, k: int) -> Context:
        return ctx.set_values(x, xb[k]).set_values(y, yb[k])

    comm.feed, comm.ctx, comm.loss, comm.grads = feed, ctx, loss, grads
    before = [ctx.get_values(p).copy() for p in loss.params]
    shard_grads = []
    for k in range(2):
        ctx = feed(ctx, k).run(grads)
        shard_grads.append([ctx.get_values(p.grad).copy() for p in loss.params])
    ctx = feed(ctx, 0).run(grads)
    ctx = dp.reduce(ctx)  # sums shard 1's gradients into shard 0's
    assert ctx.get_value(unscale) == 0.5
    ctx = ctx.run(update)
    for b, p, g0, g1 in zip(before, loss.params, *shard_grads, strict=True):
        assert np.array_equal(ctx.get_values(p.grad), g0 + g1)
        want = b - np.float32(0.1) * ((g0 + g1) * np.float32(0.5))
        assert np.allclose(ctx.get_values(p), want, rtol=1e-6, atol=1e-7)


def test_the_unscale_set_in_one_context_does_not_reach_another() -> None:
    """reduce brings grad_unscale in step with the scaler in the context it is given only: a
    context allocating the tensor later starts from 1 / world, and its own first reduce
    brings it in step."""
    x, y, loss = _model()
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y])
    sc = mixed_prec.Loss_scaler.create(init_scale=1024.0)
    recipe = mixed_prec.scaled_step(sc, loss, optim.SGD(0.1), reducer=dp)
    first = recipe.compile(dp.setup(Context.cpu()))
    first = train.init_params(first, loss)
    rng = np.random.default_rng(0)
    first = first.set_values(x, rng.normal(size=(16, 2)))
    first = first.set_values(y, np.eye(2)[rng.integers(0, 2, 16)])
    first = recipe.step(first)
    assert first.get_value(dp.grad_unscale()) == 1 / 1024 and dp.reductions == 1
    probe = T.term(np.ones(2), label="probe") * dp.grad_unscale()
    second, _ = Context.cpu().compile(train.forward(probe))
    assert second.get_value(dp.grad_unscale()) == 1.0  # not the first context's 1 / 1024
    assert float(dp.grad_unscale().value.host_data) == 1.0
    assert first.get_value(dp.grad_unscale()) == 1 / 1024


# --- under mpiexec ------------------------------------------------------------------------------


@needs_mpi
@pytest.mark.parametrize("variant", W.VARIANTS)
def test_two_ranks_agree_and_match_the_summed_shards_bit_for_bit(two: Path, refs: dict,
                                                                 variant: str) -> None:
    r0, r1 = ranks(two, "two", variant, 2)
    assert same_state(r0, r1) and counters(r0) == counters(r1)
    ref = refs[f"sum2-{variant}"]
    assert same_state(r0, ref) and counters(r0) == counters(ref)
    # each rank's shard losses are the reference's, shard by shard
    shards = np.concatenate([r0["losses"], r1["losses"]], axis=1)
    assert np.array_equal(shards, ref["losses"], equal_nan=True)
    assert r0["reductions"] == 12


@needs_mpi
@pytest.mark.parametrize("variant", F32)
def test_two_ranks_match_one_process_over_the_global_batch(two: Path, refs: dict,
                                                            variant: str) -> None:
    r0, r1 = ranks(two, "two", variant, 2)
    g = refs[f"global-{variant}"]
    mean = (r0["losses"][:, 0] + r1["losses"][:, 0]) / 2
    want = g["losses"][:, 0]
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(mean), finite) and not finite[W.INJECT_STEP]
    assert np.allclose(mean[finite], want[finite], rtol=1e-6, atol=0)
    assert counters(r0) == counters(g)  # the same skipped steps, scale and good steps
    for a, b in zip(r0["state"], g["state"], strict=True):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-6)


@needs_mpi
@pytest.mark.parametrize("variant", W.VARIANTS)
def test_an_inf_in_one_shard_makes_every_rank_skip_and_back_off(two: Path,
                                                                 variant: str) -> None:
    r0, r1 = ranks(two, "two", variant, 2)
    step = W.INJECT_STEP
    assert np.isfinite(r0["losses"][step, 0]) and not np.isfinite(r1["losses"][step, 0])
    assert r0["skipped"] == r1["skipped"] >= 1
    if variant.endswith("f32"):  # no overflow of its own: the injected step alone
        assert r0["skipped"] == 1 and r0["applied"] == 11
        # 2**19 grows every 3 good steps and halves at the skip: steps 0-2 good (2**20),
        # 3-4 good, 5 skipped (2**19), 6-8 (2**20), 9-11 (2**21); the fused gate samples
        # windows of 4: [0-3] good (2**20), [4-7] skipped (2**19), [8-11] good (2**20).
        assert r0["scale"] == (2.0**21 if "-host-" in variant else 2.0**20)


@needs_mpi
@pytest.mark.whole_machine  # three ranks on two cores: no other test's processes beside them
def test_three_ranks_on_two_cores(refs: dict, tmp_path: Path) -> None:
    """Oversubscribed. (``refs`` compiled the code of these 16-row shards already.)"""
    job = ok(mpirun(3, "train", "--out", tmp_path, "--tag", "three", "--global-batch", "48",
                    "--variants", "sgd-fused-f16,adam-host-f32"))
    for v in ("sgd-fused-f16", "adam-host-f32"):
        rs = ranks(tmp_path, "three", v, 3)
        assert all(same_state(rs[0], r) and counters(rs[0]) == counters(r) for r in rs[1:])
        assert rs[0]["skipped"] >= 1 and not np.isfinite(rs[1]["losses"][W.INJECT_STEP, 0])
    assert job.seconds < 60


@needs_mpi
@pytest.mark.parametrize(("what", "message"), [
    ("shards", "shards differ (rank 0: x (16, 2), y (16, 2); rank 1: x (15, 2), y (15, 2))"),
    ("model", "first difference, rank 0 vs rank 1: parameter #0: mlp_w0 dims (16, 2) f32 vs "
              "mlp_w0 dims (24, 2) f32"),
    ("zero", "the ranks disagree on the shards: rank 0 has shards=2, fixed_order=True, "
             "shard_optimizer=False; rank 1 has shards=2, fixed_order=True, "
             "shard_optimizer=True"),
])
def test_refusals_end_the_job_with_the_reason(what: str, message: str) -> None:
    job = mpirun(2, "refuse", "--what", what, timeout=60)
    assert not job.timed_out and job.rc != 0 and job.left == []
    assert message in job.out


@needs_mpi
def test_sigkill_of_one_rank_aborts_and_a_resume_is_bit_identical(two: Path, refs: dict,
                                                                  tmp_path: Path) -> None:
    v = "adam-fused-f32"  # a checkpoint at step 5 is mid-window (windows of 4)
    ck = tmp_path / "run.safetensors"
    killed = mpirun(2, "train", "--out", tmp_path, "--tag", "killed", "--variants", v,
                    "--checkpoint", ck, "--die-at", "7", timeout=60)
    assert not killed.timed_out and killed.rc != 0 and killed.left == []
    assert not (tmp_path / f"killed-{v}-rank0.npz").exists()
    uninterrupted = ranks(two, "two", v, 2)[0]
    # on 2 ranks again
    ok(mpirun(2, "train", "--out", tmp_path, "--tag", "resumed", "--variants", v,
              "--checkpoint", ck, "--resume"))
    for r in ranks(tmp_path, "resumed", v, 2):
        assert r["start"] == 5
        assert same_state(r, uninterrupted) and counters(r) == counters(uninterrupted)
    # on 1 rank summing the 2 shards in order: the same bits
    one = W.run(W.VirtualRanks(2), v, ckpt=ck, resume=True)
    assert one["start"] == 5 and same_state(one, uninterrupted)
    assert counters(one) == counters(uninterrupted)
    # on 1 rank over the global batch at once (one shard, not two): refused, as it could not
    # continue exactly; loaded anyway (exact=False), the same training up to rounding
    with pytest.raises(Failure, match="written by a run with shards=2 fixed_order=True, this "
                                      "run has shards=1"):
        W.run(parallel.SingleProcess(), v, ckpt=ck, resume=True)
    whole = W.run(parallel.SingleProcess(), v, ckpt=ck, resume=True, exact=False)
    assert counters(whole) == counters(uninterrupted)
    for a, b in zip(whole["state"], uninterrupted["state"], strict=True):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-6)


@needs_mpi
def test_a_hung_job_is_terminated_then_killed_leaving_nothing(tmp_path: Path) -> None:
    """Both ranks started (their pid files written), then hung, ignoring SIGTERM: stopped by
    SIGKILL within the grace, nothing left. The timeout counts from their start, however
    long a busy machine took to start them."""
    files = [tmp_path / f"hang-rank{r}.pid" for r in range(2)]
    job = mpirun(2, "hang", "--out", tmp_path, timeout=1, grace=2,
                 ready=lambda: all(f.exists() for f in files))
    assert job.timed_out and job.left == [] and job.seconds < 8
    pids = [int(f.read_text()) for f in files]  # they ran
    procs = _procs()
    assert [p for p in pids if p in procs and procs[p][2] != "Z"] == []


def _on_own_stream(calls: list, own: int, compute: int) -> list[list]:
    """The device collectives of an NCCL call log, each checked to run on the communicator's
    stream after the compute stream's work (an event recorded there, waited for by its own
    stream) and to be waited for by the compute stream later (its end's event)."""
    kinds = {"allReduce", "allGather", "bcast"}
    out = []
    for i, c in enumerate(calls):
        if c[0] not in kinds:
            continue
        ready, waits, done = calls[i - 2], calls[i - 1], calls[i + 1]
        assert ready[:2] == ["event.record", compute] and waits == ["wait_event", own, ready[2]]
        assert done[:2] == ["event.record", own]
        assert ["wait_event", compute, done[2]] in calls[i + 2:], f"{c} is never waited for"
        out.append(c)
    return out


@needs_mpi
def test_nccl_path_through_a_stand_in_reducing_over_mpi(two: Path, tmp_path: Path) -> None:
    """NcclCommunicator's bootstrap and calls, on the stand-in CuPy (tests/backends) and
    tests/fake_nccl.py: rank 0 draws the id, every rank joins on its own device, the state is
    broadcast from rank 0, and each step is one in-place allReduce of the flat f32 buffer, on
    the communicator's own stream after the context's kernels (the stand-in refuses it
    otherwise), the context's stream waiting for it afterwards."""
    cuda_emu = pytest.importorskip("cuda_emu")
    why = cuda_emu.emulator_unavailable()
    if why:
        pytest.skip(f"no CUDA emulator: {why}")
    v = "adam-fused-f32"
    ok(mpirun(2, "train", "--out", tmp_path, "--tag", "nccl", "--comm", "fake-nccl",
              "--backend", "fake-cuda", "--variants", v))
    rs = ranks(tmp_path, "nccl", v, 2)
    assert same_state(rs[0], rs[1]) and counters(rs[0]) == counters(rs[1])
    cpu = ranks(two, "two", v, 2)[0]
    assert counters(rs[0]) == counters(cpu)
    assert np.allclose(rs[0]["losses"], cpu["losses"], rtol=1e-5, equal_nan=True)
    n_state = len(rs[0]["state"])
    for rank, r in enumerate(rs):
        calls = r["nccl_calls"]
        kinds = [c[0] for c in calls if c[0] not in ("event.record", "wait_event")]
        own, compute = int(r["nccl_stream"]), int(r["compute_stream"])
        assert own != compute
        assert kinds[:2] == (["get_unique_id", "init"] if rank == 0 else ["init", "bcast"])[:2]
        assert ["init", 2, rank, rank] in calls
        device = _on_own_stream(calls, own, compute)
        bcasts = [c for c in device if c[0] == "bcast"]
        assert len(bcasts) == n_state and all(c[3] == 0 and c[4] == own for c in bcasts)
        reduces = [c for c in device if c[0] == "allReduce"]
        assert len(reduces) == 12
        assert all(c == ["allReduce", r["flat_size"], 7, 0, own, True] for c in reduces)
        assert not any(c[0] == "allGather" for c in calls)
    # The optimizer state sharded (ZeRO-1) and the exchange in buckets (overlap): each step's
    # in-place allReduces of the buckets cover the flat buffer once, then an in-place allGather
    # of the parameters' halves; the bits of the plain run. A bucket's exchange is waited for
    # by the context's stream only after the later buckets' have started (the backward code
    # going on meanwhile).
    ok(mpirun(2, "train", "--out", tmp_path, "--tag", "nccl-zero", "--comm", "fake-nccl",
              "--backend", "fake-cuda", "--variants", v, "--zero", "--overlap"))
    zs = ranks(tmp_path, "nccl-zero", v, 2)
    for z in zs:
        assert same_state(z, rs[0]) and counters(z) == counters(rs[0])
        own, compute = int(z["nccl_stream"]), int(z["compute_stream"])
        calls = z["nccl_calls"]
        device = _on_own_stream(calls, own, compute)
        gathers = [c for c in device if c[0] == "allGather"]
        assert len(gathers) == 12
        assert all(c == ["allGather", z["flat_size"] // 2, 7, own, True] for c in gathers)
        buckets = [c for c in device if c[0] == "allReduce"]
        assert len(buckets) % 12 == 0 and len(buckets) > 12
        assert sum(c[1] for c in buckets) == 12 * z["flat_size"]
        assert all(c[2:] == [7, 0, own, True] for c in buckets)
        first = calls.index(buckets[0])
        done = calls[first + 1][2]
        waited = calls.index(["wait_event", compute, done])
        assert [c[0] for c in calls[first + 1:waited]].count("allReduce") >= 1


@needs_mpi
def test_nccl_sums_the_shard_tree_on_the_device_over_three_ranks(tmp_path: Path) -> None:
    """Three ranks over the stand-in NCCL: the tree's sum of each bucket is an allGather of
    every rank's partial sums and the tree's additions, on the communicator's stream (no
    allReduce, no host exchange): the bits of three ranks on the CPU."""
    cuda_emu = pytest.importorskip("cuda_emu")
    why = cuda_emu.emulator_unavailable()
    if why:
        pytest.skip(f"no CUDA emulator: {why}")
    v = "sgd-fused-f32"
    for tag, comm, backend in (("cpu3", "mpi", "cpu"), ("nccl3", "fake-nccl", "fake-cuda")):
        ok(mpirun(3, "train", "--out", tmp_path, "--tag", tag, "--comm", comm, "--backend",
                  backend, "--variants", v, "--global-batch", "48", "--steps", "4"))
    cpu, gpu = ranks(tmp_path, "cpu3", v, 3), ranks(tmp_path, "nccl3", v, 3)
    for g in gpu:
        assert same_state(g, cpu[0]) and counters(g) == counters(cpu[0])
        device = _on_own_stream(g["nccl_calls"], int(g["nccl_stream"]), int(g["compute_stream"]))
        sums = [c for c in device if c[0] == "allGather"]
        assert len(sums) == 4 and not any(c[0] == "allReduce" for c in device)


@needs_mpi
def test_the_readme_command_trains_the_example_data_parallel(tmp_path: Path) -> None:
    """``make demo-dp``'s command, shortened: rank 0 alone prints; an unequal split is refused
    on every rank."""
    example = HERE.parent / "examples" / "moons_mixed_precision.py"
    flags = ["--data-parallel", "--steps", "40", "--no-plot", "--no-progress", "--backend", "cpu"]
    job = ok(mpirun(2, *flags, script=example, timeout=120))
    assert job.out.count("data-parallel: 2 rank(s) (mpi), global batch 64 = 2 x 32") == 1
    assert job.out.count("accuracy: ") == 1 and "skipped steps: " in job.out
    # the optimizer state sharded and the exchange overlapped: the same run, to the digit
    same = ok(mpirun(2, *flags, "--shard-optimizer", "--overlap", script=example, timeout=120))
    tail = [line for line in job.out.splitlines() if "accuracy: " in line or "loss" in line]
    assert tail and tail == [line for line in same.out.splitlines()
                             if "accuracy: " in line or "loss" in line]
    job = mpirun(2, *flags, "--batch", "63", script=example, timeout=60)
    assert job.rc != 0 and not job.timed_out and job.left == []
    assert "--batch 63 (the global batch) does not split into 2 equal shards" in job.out


@pytest.mark.gpu
def test_nccl_for_real_one_rank_per_device(tmp_path: Path) -> None:
    """On a machine with GPUs, CuPy and NCCL: one rank per device, the real collectives."""
    if _no_mpi:
        pytest.skip(_no_mpi)
    try:
        import cupy

        ndev = int(cupy.cuda.runtime.getDeviceCount())
        if ndev < 1:
            raise RuntimeError("no device")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing
            from cupy.cuda import nccl

        nccl.get_unique_id()
    except Exception as err:  # noqa: BLE001 - any reason means: no usable GPU with NCCL
        pytest.skip(f"no GPU with CuPy and NCCL: {type(err).__name__}: {err}")
    variants = "sgd-fused-f16,adam-host-f32"
    ok(mpirun(ndev, "train", "--out", tmp_path, "--tag", "gpu", "--comm", "nccl",
              "--backend", "cuda", "--global-batch", str(16 * ndev), "--variants", variants,
              timeout=300))
    for v in variants.split(","):
        rs = ranks(tmp_path, "gpu", v, ndev)
        assert all(same_state(rs[0], r) and counters(rs[0]) == counters(r) for r in rs[1:])
        assert rs[0]["skipped"] >= 1 and rs[0]["reductions"] == 12
    # the optimizer state sharded and the exchange in buckets: the same bits on the GPU
    ok(mpirun(ndev, "train", "--out", tmp_path, "--tag", "gpu-zero", "--comm", "nccl",
              "--backend", "cuda", "--global-batch", str(16 * ndev), "--variants", variants,
              "--zero", "--overlap", timeout=300))
    for v in variants.split(","):
        plain = ranks(tmp_path, "gpu", v, ndev)[0]
        for r in ranks(tmp_path, "gpu-zero", v, ndev):
            assert same_state(r, plain) and counters(r) == counters(plain)


def test_checkpoint_helpers_in_a_world_of_one(tmp_path: Path) -> None:
    """DataParallel.save / load / check_equal / mean on one rank (the MPI runs above use
    them on two)."""
    x, y, loss = _model()
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y])
    ctx = dp.setup(Context.cpu())
    ctx = train.init_params(ctx, loss)
    params = [p.value for p in loss.params]
    dp.check_equal(ctx, params)
    path = tmp_path / "c.safetensors"
    dp.save(path, ctx, params, checkpoint.Progress(step=3))
    ctx2 = Context.cpu()
    ctx2, progress = dp.load(path, ctx2, params)
    assert progress.step == 3 and dp.mean(2.5) == 2.5
    assert all(np.array_equal(ctx.get_values(p), ctx2.get_values(p)) for p in params)
    with pytest.raises(Failure, match="rank 0 could not load it"):
        dp.load(tmp_path / "missing.safetensors", ctx2, params)
    with pytest.raises(ValueError, match="not initialized"):
        dp.broadcast(Context.cpu(), params)
    assert mixed_prec.GradReducer  # the protocol the recipes take


@needs_mpi
@pytest.mark.parametrize(("n", "rounds"), [(2, 2000), (3, 500)])
def test_shared_memory_is_written_and_read_between_its_barriers(n: int, rounds: int) -> None:
    """``shared_sync`` (a barrier at counters in the shared memory itself): over every round
    every rank sees every other's block of the round it is in, never the one before or
    after (3 ranks: on 2 cores, one rank always waits for a core, so fewer rounds: about
    18 s for 2,000 beside another busy process)."""
    job = ok(mpirun(n, "--rounds", str(rounds), script=HERE / "shared_memory_worker.py",
                    timeout=120))
    assert f"{rounds} rounds ok" in job.out
