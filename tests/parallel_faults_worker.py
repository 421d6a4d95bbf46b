"""The runs of tests/test_parallel_faults.py, under ``mpiexec -n N python -m mpi4py``:

    python -m mpi4py tests/parallel_faults_worker.py train --out DIR --fault stop --at 7
    python -m mpi4py tests/parallel_faults_worker.py mismatch --what prec

``train``: plain f32 SGD on half-moons over an :class:`ocannl.parallel.MpiCommunicator`, a
checkpoint every ``--every`` steps (rank 0 also writes the saved values to
``DIR/saved-stepS.npz``, for the test to compare with the file), and with ``--fault kill`` or
``stop``, rank ``--rank`` sends itself SIGKILL or SIGSTOP after ``--at`` steps (writing the
time to ``DIR/fault``). The collectives wait ``--timeout`` seconds once training starts
(``DIR/started``); setup and compiling keep the default. A rank that catches
:class:`ocannl.parallel.CollectiveTimeout` prints the wall and CPU seconds it waited, then
re-raises it (``-m mpi4py`` aborts the job).

``mismatch``: rank 1 builds its model with another setting (``--what prec``: bf16 cast twins
where rank 0 has f16); ``DataParallel.setup`` refuses it on every rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]

import ocannl.tensor as T  # noqa: E402
from ocannl import Context, checkpoint, datasets, mixed_prec, nn_blocks, optim, parallel, train  # noqa: E402,E501

POINTS = 256
LOCAL = 16  # rows of a rank's shard


def build(local: int = LOCAL, prec: str = "f32") -> dict[str, Any]:
    """The model over a shard of ``local`` rows: f32, or ``prec`` cast twins of f32 masters."""
    T.set_seed(0)
    x = T.term(np.zeros((local, 2)), label="x")
    y = T.term(np.zeros((local, 2)), label="y")
    if prec == "f32":
        logits, _ = nn_blocks.mlp(x, [16], 2)
    else:
        logits, _ = mixed_prec.with_master_weights(prec=prec, f=lambda: nn_blocks.mlp(x, [16], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    opt = optim.SGD(0.1, momentum=0.9)
    return {"x": x, "y": y, "loss": loss, "opt": opt,
            "state": checkpoint.training_state(loss, opt)}


def train_run(args: argparse.Namespace) -> None:
    comm = parallel.MpiCommunicator()
    m = build()
    x, y, loss, opt, state = m["x"], m["y"], m["loss"], m["opt"], m["state"]
    dp = parallel.DataParallel(comm, loss, inputs=[x, y], overlap=args.overlap,
                               bucket_bytes=64)
    ctx = dp.setup(Context.cpu())
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss)) if args.overlap else \
        ctx.compile(train.grad_update(loss))
    ctx, update = ctx.compile(opt.update(loss, grad_unscale=dp.grad_unscale()))
    ctx = train.init_params(ctx, loss)
    ctx = dp.broadcast(ctx, state)
    points, labels = datasets.half_moons(POINTS, seed=3)
    targets = datasets.one_hot(labels, 2)
    glob = LOCAL * comm.size
    comm.timeout = args.timeout  # from here on, a missing rank is found within it
    if comm.rank == 0:
        (args.out / "started").write_text(str(time.time()))
    t_wait = c_wait = 0.0
    try:
        for step in range(args.steps):
            rows = np.random.default_rng([7, step]).permutation(POINTS)[:glob]
            mine = rows[comm.rank * LOCAL:(comm.rank + 1) * LOCAL]
            ctx = ctx.set_values(x, points[mine]).set_values(y, targets[mine])
            if not args.overlap:
                ctx = ctx.run(grads)
            t_wait, c_wait = time.monotonic(), time.process_time()
            ctx = dp.run_and_reduce(ctx, grads) if args.overlap else dp.reduce(ctx)
            ctx = ctx.run(update)
            if (step + 1) % args.every == 0:
                progress = checkpoint.Progress(step=step + 1)
                dp.save(args.checkpoint, ctx, state, progress)
                if comm.rank == 0:
                    np.savez(args.out / f"saved-step{step + 1}.npz",
                             *[np.asarray(ctx.get_values(n)) for n in state])
            if args.fault and step + 1 == args.at and comm.rank == args.rank:
                (args.out / "fault").write_text(str(time.time()))
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
    except parallel.CollectiveTimeout as err:
        report(args.out, comm.rank,
               f"rank {comm.rank} waited {time.monotonic() - t_wait:.2f} s, "
               f"{time.process_time() - c_wait:.3f} s of CPU; missing {list(err.missing)}, "
               f"step {err.step}", _last_line(err))
        raise
    if comm.rank == 0:
        (args.out / "done").write_text("ok")


def report(out: Path, rank: int, *lines: str) -> None:
    """What a rank says of the fault it met, each line ``faults: ...``: into
    ``OUT/faults-rank<r>.txt`` (the tests read it there), then to its output in one write.
    The launcher forwards a rank's output through a pipe and may drop the last of it when the
    job aborts (on a loaded machine, the second of two printed lines went missing)."""
    text = "".join(f"faults: {line}\n" for line in lines)
    (out / f"faults-rank{rank}.txt").write_text(text)
    sys.stdout.write(text)
    sys.stdout.flush()


def _last_line(err: BaseException) -> str:
    """The traceback's last line (``module.Class: message``), which a rank prints itself
    before ``-m mpi4py`` aborts the job: the launcher's abort may cut the traceback off before
    it forwards its last lines (seen on a loaded machine)."""
    return traceback.format_exception_only(err)[-1].rstrip("\n")


def nccl_run(args: argparse.Namespace) -> None:
    """NcclCommunicator on the stand-ins (tests/backends/fake_cupy.py, tests/fake_nccl.py):
    one allreduce; then, at step 4, rank 1 stops itself (``--fault stop``: rank 0's barrier,
    an MPI one, times out), or rank 0's GPU never reaches the end of a second allreduce
    (``--stuck``: its barrier, waiting for the event, times out and aborts NCCL)."""
    sys.path.insert(0, str(HERE / "backends"))
    import fake_nccl

    fake_nccl.install()
    comm = parallel.NcclCommunicator()  # the default deadline while the ranks start
    import cupy

    with cupy.cuda.Device(comm.device_id):
        buf = cupy.zeros(8, np.float32)
        buf[...] = comm.rank + 1
    comm.allreduce_sum(buf)
    assert (np.asarray(buf) == 3).all(), buf
    # Every rank started and met the others in that sum (a loaded machine may start one
    # seconds after the other): from here on, the short deadline.
    comm.timeout = args.timeout
    comm.step = 4
    if args.fault == "stop" and comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    if args.stuck:
        fake_nccl.stuck = comm.rank == 0
        if comm.rank == 1:  # rank 0 times out first, and names what it waited for
            comm.timeout = 3 * args.timeout
        comm.allreduce_sum(buf)
    try:
        comm.barrier()
    except parallel.CollectiveTimeout as err:
        report(args.out, comm.rank, f"rank {comm.rank} NCCL calls "
               f"{[c[0] for c in fake_nccl.calls]}", _last_line(err))
        raise


def objects(args: argparse.Namespace) -> None:
    """The object collectives, with objects that fit their slot and ones that do not, on some
    ranks or all; then each rank's count of collectives (one per small object)."""
    comm = parallel.MpiCommunicator(timeout=30)
    r, n = comm.rank, comm.size
    first = comm._seq
    for obj in (1.5, None, "x" * 300, {"r": r}):
        assert comm.allgather(obj) == [obj if not isinstance(obj, dict) else {"r": k}
                                       for k in range(n)]
    assert comm.allgather("z" * (10 if r == 0 else 5000)) == ["z" * 10] + ["z" * 5000] * (n - 1)
    assert comm.allgather("z" * (5000 if r == 0 else 10)) == ["z" * 5000] + ["z" * 10] * (n - 1)
    for root in range(n):
        for obj in (("small", root), ("large", "y" * 1000)):
            assert comm.bcast(obj if r == root else None, root=root) == obj
    assert comm.allreduce_max(10 * r) == 10 * (n - 1)
    comm.barrier()
    print(f"objects: rank {r} ran {comm._seq - first} collectives", flush=True)


def mismatch(args: argparse.Namespace) -> None:
    comm = parallel.MpiCommunicator()
    prec = "bf16" if comm.rank == 1 and args.what == "prec" else "f16"
    m = build(prec=prec)
    dp = parallel.DataParallel(comm, m["loss"], inputs=[m["x"], m["y"]])
    dp.setup(Context.cpu())  # raises on every rank


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["train", "mismatch", "nccl", "objects"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--fault", choices=["kill", "stop"])
    ap.add_argument("--at", type=int, default=7)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3.0)
    ap.add_argument("--what", choices=["prec"], default="prec")
    ap.add_argument("--stuck", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="the exchange in buckets")
    args = ap.parse_args(argv)
    if args.cmd == "train":
        train_run(args)
    elif args.cmd == "nccl":
        nccl_run(args)
    elif args.cmd == "objects":
        objects(args)
    else:
        mismatch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
