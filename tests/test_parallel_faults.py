"""Faults of a data-parallel run (ocannl.parallel): a rank that dies or hangs ends the others
within the communicator's timeout, with an error naming it and the step, the last checkpoint
intact; ranks that disagree at the start are refused, naming both values.

The jobs run under ``mpiexec -n 2`` (tests/parallel_faults_worker.py), each in its own session
with an outer timeout, as in tests/test_parallel.py (whose harness this reuses): on timeout
SIGTERM to the job's process group and every process of it, then SIGKILL, and each test checks
that no process of the job is left. The collectives wait ``TIMEOUT_S`` seconds once training
started, so a test takes seconds.
"""

from __future__ import annotations

import re
import shlex
import tempfile
from pathlib import Path

import numpy as np
import parallel_faults_worker as FW
import pytest
from test_parallel import Job, _no_mpi, mpirun
from test_parallel import _Disagreeing as _Other  # two ranks, the second reporting `other`

from ocannl import Context, Failure, checkpoint, parallel

HERE = Path(__file__).resolve().parent
WORKER = HERE / "parallel_faults_worker.py"
TIMEOUT_S = 3.0
# From the fault to the end of the job: the timeout, the grace in which the other ranks are
# asked (0.3 s here), MPI_Abort and the launcher's cleanup, on a busy 2-core machine.
WITHIN_S = TIMEOUT_S + 7.0
WAITED = r"\(waited 3\.\d s\)"  # the timeout, plus up to a nap (1% of it)

needs_mpi = pytest.mark.skipif(_no_mpi is not None, reason=str(_no_mpi))


def launch(n: int, *args: str | Path, out: Path, unseen_death: bool = False,
           timeout: float = 30.0, grace: float = 3.0) -> tuple[Job, float]:
    """``mpiexec -n N python -m mpi4py WORKER ARGS`` (``test_parallel.mpirun``), the outer
    timeout counted from ``OUT/started`` (written when training starts), with no
    ``OCANNL_COLLECTIVE_TIMEOUT`` of the caller's. ``unseen_death``: each rank runs under
    ``sh -c 'python ... || sleep 60'``, so the launcher does not see a rank die (as a lost
    node): only the communicator's timeout can end the others. Also returns the wall-clock
    time at which the job ended."""
    wrap = (lambda rank: ["sh", "-c", shlex.join(rank) + " || sleep 60"]) if unseen_death \
        else None
    job = mpirun(n, *args, timeout=timeout, grace=grace, script=WORKER,
                 ready=(out / "started").exists, wrap=wrap, unset=("OCANNL_COLLECTIVE_TIMEOUT",))
    return job, job.ended


def said(out: Path, job: Job) -> str:
    """What rank 0 said of the fault it met (``parallel_faults_worker.report``), from the file
    it wrote: the launcher may drop a rank's last output lines when the job aborts."""
    path = out / "faults-rank0.txt"
    assert path.exists(), f"rank 0 wrote no report of a fault; the job's output: {job.out[-3000:]}"
    return path.read_text()


def check_checkpoint(out: Path, ck: Path, step: int) -> None:
    """The checkpoint written before the fault is whole, loads, and holds what rank 0 saved;
    no temporary file is left beside it."""
    assert ck.exists() and [p.name for p in ck.parent.glob(".*.tmp")] == []
    m = FW.build()
    ctx, progress = checkpoint.load(ck, Context.cpu(), m["state"])
    assert progress.step == step
    with np.load(out / f"saved-step{step}.npz") as saved:
        for k, node in enumerate(m["state"]):
            assert np.array_equal(ctx.get_values(node), saved[f"arr_{k}"]), node.name


@needs_mpi
@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_stopped_or_dead_rank_ends_the_others_naming_it_and_the_step(fault: str,
                                                                       tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP: the launcher sees nothing) or dies (SIGKILL, under a
    shell that outlives it, so the launcher does not see it either: a lost node) after 7
    steps; rank 0 waits in step 7's gradient exchange (the barrier before the shard tree's
    sum in the memory both ranks map), times out, asks rank 1 where it is, gets no answer,
    and raises the named error, sleeping, not spinning, while it waits; the job ends. The
    checkpoint of step 5 is intact."""
    ck = tmp_path / "run.safetensors"
    job, ended = launch(2, "train", "--out", tmp_path, "--checkpoint", ck, "--fault", fault,
                        "--at", "7", "--timeout", TIMEOUT_S, out=tmp_path,
                        unseen_death=fault == "kill")
    assert not job.timed_out and job.rc != 0 and job.left == [], job.out[-3000:]
    assert not (tmp_path / "done").exists()
    report = said(tmp_path, job)
    pid = int(report.split("rank 1 (pid ")[1].split()[0])
    state = "stopped (SIGSTOP?)" if fault == "stop" else "gone (it died or exited)"
    want = (re.escape("ocannl.parallel.CollectiveTimeout: mpi rank 0: the shard tree's sum "
                      "in shared memory (partial sums written) (collective #") + r"\d+"
            + re.escape(") at step 7 did not complete within 3 s ") + WAITED
            + re.escape(f": rank 1 (pid {pid} on this host, {state}) did not answer. A rank "
                        f"that died, hung or is stuck outside the collectives ends the job"))
    assert re.search(want, report), report
    assert "OCANNL_COLLECTIVE_TIMEOUT" in report
    # from the fault to the end of the job: within the timeout and the cleanup
    fault_at = float((tmp_path / "fault").read_text())
    # (rank 0 may have entered step 7's allreduce a little before rank 1 stopped)
    assert TIMEOUT_S - 1.0 <= ended - fault_at < WITHIN_S, ended - fault_at
    # rank 0 slept while it waited: a spinning rank's CPU time would be its waiting time
    line = next(ln for ln in report.splitlines() if ln.startswith("faults: rank 0 waited"))
    waited, cpu = float(line.split()[4]), float(line.split()[6])
    assert waited >= TIMEOUT_S and cpu < 0.25 * waited, line
    assert "missing [1], step 7" in line
    check_checkpoint(tmp_path, ck, 5)


@needs_mpi
def test_a_stopped_rank_ends_the_others_in_an_overlapped_exchange(tmp_path: Path) -> None:
    """With overlap, the buckets are summed in the memory both ranks map, each rank signalling
    the other through shared counters (no barrier): rank 0 waits in step 7 for rank 1 to
    write a bucket, times out, names rank 1, stopped, and the bucket; the checkpoint of step
    5 is intact."""
    ck = tmp_path / "run.safetensors"
    job, _ = launch(2, "train", "--out", tmp_path, "--checkpoint", ck, "--fault", "stop",
                    "--at", "7", "--timeout", TIMEOUT_S, "--overlap", out=tmp_path)
    assert not job.timed_out and job.rc != 0 and job.left == [], job.out[-3000:]
    report = said(tmp_path, job)
    pid = int(report.split("rank 1 (pid ")[1].split()[0])
    want = (re.escape("ocannl.parallel.CollectiveTimeout: mpi rank 0: the shard tree's sum "
                      "in shared memory, bucket [") + r"\d+, \d+"
            + re.escape(") (written) (collective #") + r"\d+"
            + re.escape(") at step 7 did not complete within 3 s ") + WAITED
            + re.escape(f": rank 1 (pid {pid} on this host, stopped (SIGSTOP?)) did not "
                        f"answer."))
    assert re.search(want, report), report
    line = next(ln for ln in report.splitlines() if ln.startswith("faults: rank 0 waited"))
    waited, cpu = float(line.split()[4]), float(line.split()[6])
    assert waited >= TIMEOUT_S and cpu < 0.25 * waited, line
    check_checkpoint(tmp_path, ck, 5)


@needs_mpi
def test_a_killed_rank_seen_by_the_launcher_ends_the_job_at_once(tmp_path: Path) -> None:
    """A rank's death that ``mpiexec`` sees (its own child) ends the job at once, before any
    timeout: the launcher's cleanup (hydra names the pid and the signal); the checkpoint of
    step 5 is intact."""
    ck = tmp_path / "run.safetensors"
    job, ended = launch(2, "train", "--out", tmp_path, "--checkpoint", ck, "--fault", "kill",
                        "--at", "7", "--timeout", "30", out=tmp_path)
    assert not job.timed_out and job.rc != 0 and job.left == [], job.out[-3000:]
    assert ended - float((tmp_path / "fault").read_text()) < 15.0
    assert "Killed (signal 9)" in job.out
    check_checkpoint(tmp_path, ck, 5)


@needs_mpi
@pytest.mark.parametrize("fault", ["stop", "stuck"])
def test_nccl_through_the_stand_ins_ends_a_hung_job_naming_the_rank(fault: str,
                                                                   tmp_path: Path) -> None:
    """NcclCommunicator (tests/fake_nccl.py): rank 1 stopped, rank 0's barrier (MPI's, with
    its deadline) names it and the step; or rank 0's GPU never reaches the end of an
    allreduce: its next collective waits for the event with the deadline, aborts NCCL's
    communicator and names the operation, rank 1 answering from the barrier after it."""
    (tmp_path / "started").write_text("")
    flags = ["--fault", "stop"] if fault == "stop" else ["--stuck"]
    job, _ = launch(2, "nccl", *flags, "--timeout", TIMEOUT_S, "--out", tmp_path, out=tmp_path)
    assert not job.timed_out and job.rc != 0 and job.left == [], job.out[-3000:]
    report = said(tmp_path, job)
    if fault == "stop":
        pid = int(report.split("rank 1 (pid ")[1].split()[0])
        want = (rf"mpi rank 0: barrier \(collective #6\) at step 4 did not complete within "
                rf"3 s {WAITED}: rank 1 \(pid {pid} on this host, stopped \(SIGSTOP\?\)\) did "
                rf"not answer\.")
    else:
        want = (rf"mpi rank 0: barrier: waiting for NCCL allreduce_sum of 8 f32 at step 4 on "
                rf"the GPU \(collective #6\) at step 4 did not complete within 3 s {WAITED}: "
                rf"rank 1 answered from collective #7 \(barrier\) at step 4; every other rank "
                rf"is past it: this rank's own wait did not end")
    assert re.search(want, report), report
    if fault == "stuck":
        # each allreduce on the communicator's stream after the legacy one's work, which then
        # waits for it: record, wait, the call, record, wait
        one = "'event.record', 'wait_event', 'allReduce', 'event.record', 'wait_event'"
        assert (f"faults: rank 0 NCCL calls ['get_unique_id', 'init', {one}, {one}, "
                f"'abort']") in report


@needs_mpi
def test_ranks_with_other_precisions_are_refused_at_the_start_naming_both() -> None:
    """Rank 1 computes in bf16 cast twins, rank 0 in f16: the same parameters (f32 masters),
    so the model digest agrees, but the graphs differ: every rank refuses at setup."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "started").write_text("")  # the outer timeout counts from the launch
        job, _ = launch(2, "mismatch", "--what", "prec", out=out, timeout=60)
    assert not job.timed_out and job.rc != 0 and job.left == [], job.out[-3000:]
    assert ("data-parallel: the ranks compute the loss differently: first difference, rank 0 "
            "vs rank 1: tensor #2: mlp_w1_f16 (op) dims (2, 16) f16 vs mlp_w1_bf16 (op) dims "
            "(2, 16) bf16. Every rank must build the same model, in the same precisions"
            ) in job.out, job.out[-3000:]


@needs_mpi
def test_object_collectives_small_in_one_round_large_in_two(tmp_path: Path) -> None:
    """Every object collective runs nonblocking: a small pickle in one slot-sized round, a
    large one (on any rank) in a second; both ranks run the same collectives."""
    (tmp_path / "started").write_text("")
    job, _ = launch(2, "objects", out=tmp_path, timeout=60)
    assert not job.timed_out and job.rc == 0 and job.left == [], job.out[-3000:]
    # allgathers: 3 small, 1 large and 2 mixed (two rounds each); bcasts: 2 small and 2 large
    # (two rounds each); max; barrier
    for r in range(2):
        assert f"objects: rank {r} ran {3 + 3 * 2 + 2 + 2 * 2 + 2} collectives" in job.out


# --- in one process -----------------------------------------------------------------------------


def _dp(comm: parallel.Communicator, prec: str = "f16") -> parallel.DataParallel:
    m = FW.build(prec=prec)
    return parallel.DataParallel(comm, m["loss"], inputs=[m["x"], m["y"]])


def test_setup_refuses_other_precisions_or_code_naming_both_values() -> None:
    other = _dp(_Other({}), "bf16").description()
    dp = _dp(_Other(other))
    with pytest.raises(Failure, match=r"compute the loss differently: first difference, rank 0 "
                                      r"vs rank 1: tensor #2: mlp_w1_f16 \(op\) dims \(2, 16\) "
                                      r"f16 vs mlp_w1_bf16 \(op\) dims \(2, 16\) bf16"):
        dp.setup(Context.cpu())
    assert dp.flat is None
    other = _dp(_Other({})).description()
    mine = other["code"]
    other["code"] = {**mine, "ocannl source": "0123456789ab", "numpy": "1.26.4"}
    with pytest.raises(Failure, match=rf"run different code: rank 0 vs rank 1: numpy "
                                      rf"{np.__version__} vs 1.26.4, ocannl source "
                                      rf"{mine['ocannl source']} vs 0123456789ab\. Install"):
        _dp(_Other(other)).setup(Context.cpu())
    same = _dp(_Other({})).description()
    ctx = _dp(_Other(same)).setup(Context.cpu())  # the same everything: accepted
    assert ctx is not None


def test_the_timeout_setting() -> None:
    """``timeout=`` wins over ``OCANNL_COLLECTIVE_TIMEOUT``, which wins over the default;
    anything but a number of seconds > 0 (or inf) is refused by name."""
    mp = pytest.MonkeyPatch()
    try:
        mp.delenv("OCANNL_COLLECTIVE_TIMEOUT", raising=False)
        assert parallel.collective_timeout() == parallel.DEFAULT_TIMEOUT_S == 300.0
        assert parallel.collective_timeout(2.5) == 2.5
        mp.setenv("OCANNL_COLLECTIVE_TIMEOUT", "7")
        assert parallel.collective_timeout() == 7.0 and parallel.collective_timeout(1) == 1.0
        mp.setenv("OCANNL_COLLECTIVE_TIMEOUT", "inf")
        assert parallel.collective_timeout() == float("inf")
        mp.setenv("OCANNL_COLLECTIVE_TIMEOUT", "soon")
        with pytest.raises(ValueError, match=r"OCANNL_COLLECTIVE_TIMEOUT='soon': expected a "
                                             r"number of seconds > 0"):
            parallel.collective_timeout()
        mp.setenv("OCANNL_COLLECTIVE_TIMEOUT", "0")
        with pytest.raises(ValueError, match="OCANNL_COLLECTIVE_TIMEOUT must be a number of "
                                             "seconds > 0"):
            parallel.collective_timeout()
    finally:
        mp.undo()
    for bad in (-1, float("nan"), True, "3"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            parallel.collective_timeout(bad)  # type: ignore[arg-type]
    err = parallel.CollectiveTimeout("m", rank=0, missing=[1], step=7, what="barrier")
    assert isinstance(err, Failure) and isinstance(err, TimeoutError)
    assert (err.rank, err.missing, err.step, err.what) == (0, (1,), 7, "barrier")
