"""Data-parallel scaling on the CPU: steps per second at 1 and 2 ranks, this project
(``ocannl.parallel`` over MPI) next to PyTorch DDP with gloo, as the anchor, on the same
machine, for the workloads (``benchmarks.specs``, models from ``benchmarks.models``):

- ``mlp_wide``: 256 -> 1024 -> 1024 -> 10 relu MLP, plain SGD, global batch 256;
- ``convnet``: ``nn_blocks.lenet`` on scikit-learn's 8x8 digits, Adam (lr 1e-3), global
  batch 64;
- ``gpt_mini``: ``nn_blocks.gpt`` (2 blocks, d_model 128) over 16 sequences of 64 tokens.

    .venv/bin/python benchmarks/data_parallel.py [--workloads mlp_wide convnet gpt_mini]
        [--ranks 1 2] [--steps N] [--rounds 3] [--threads-per-rank 1] [--shards N]

Strong scaling: the global batch stays fixed. This project runs twice: with the fixed shard
tree (``DataParallel(shards=S)``, S per workload from ``MIN_SHARD_ROWS``: each rank computes
S / N shards one after the other and the shard gradients are summed in one order, the same bits
on any rank count) and with one shard per rank summed by MPI's allreduce (the order off); the
ratio of the two is the order's cost. Every framework runs N processes with ``cores / N``
threads each (or ``--threads-per-rank``): ``OCANNL_THREADS``, OpenMP's, the BLASes' and
PyTorch's (``torch.set_num_threads``), launched by the project's ``mpiexec``. Each rank reports
the thread counts its libraries ran with (threadpoolctl, this project's pool, PyTorch's) and
the cores it kept busy in the timed loop (CPU time over wall time); a row where a rank's
threads differ from the row's label, or it kept more cores busy than its threads (beyond
``CORES_SLACK``), is refused (shown without a timing, the reason listed).

All start from the fixture's weights and train on the same batches. Steps per second are timed
on rank 0 between two barriers, after warm-up; the median over ``--rounds`` interleaved runs is
reported. Scaling efficiency at N ranks: steps per second at N over N times steps per second at
1 (1.0: perfect). A timing counts only where the parity gate passes: the first
``parity_steps`` global losses within 1e-5 relative of single-process PyTorch f32 over the
global batch (a failing row keeps its raw timings in the JSON, not in the table).

Measured, not asserted: writes ``DATA_PARALLEL.md`` and ``DATA_PARALLEL.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks import fixtures, models  # noqa: E402
from benchmarks.specs import TOLERANCE, WORKLOADS, Workload  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_WORKLOADS = ("mlp_wide", "convnet", "gpt_mini")
# The workloads whose batches shard by rows (of features, images, or a gpt's sequences).
SHARDABLE = tuple(name for name, w in WORKLOADS.items() if w.model in ("mlp", "lenet", "gpt"))
# This project with the fixed shard tree (the same bits on any rank count), this project with
# one shard per rank summed by MPI's allreduce (the order off: bits depend on the rank count),
# PyTorch DDP over gloo.
FRAMEWORKS = ("ocannl", "ocannl-overlap", "ocannl-zero", "ocannl-allreduce", "ocannl-alone",
              "torch")
NAMES = {"ocannl": "ocannl (MPI, fixed shard tree)",
         "ocannl-overlap": "ocannl (fixed shard tree, overlapped buckets)",
         "ocannl-zero": "ocannl (fixed shard tree, ZeRO-1)",
         "ocannl-allreduce": "ocannl (MPI allreduce, order off)",
         "ocannl-alone": "ocannl (no exchange: each rank its block alone, the ceiling)",
         "torch": "PyTorch DDP (gloo)"}
# The fewest rows a shard keeps, per workload (``parallel.default_shards``): 4 shards for
# convnet (1, 2 and 4 ranks give the same bits), 2 for mlp_wide and gpt_mini (1 and 2 ranks;
# ``--shards 4`` for 4). A rank computing several shards pays for each shard's whole gradient
# write: one thread on an AMD EPYC (Zen 3), the gradient routine per global batch cut into 1 /
# 2 / 4 / 8 shards took mlp_wide 67 / 67 / 76 / 96 ms, gpt_mini 210 / 205 / 207 / 257 ms,
# convnet 0.37 / 0.61 / 0.64 / 0.61 ms (its 64-row routine is lowered otherwise). On an AMD EPYC
# (Zen 5, AVX-512), this benchmark's order cost for mlp_wide (steps/s with MPI's allreduce over
# the tree's) was 1.257x at 1 rank and 1.275x at 2 with 4 shards, 1.082x and 0.971x with 2; in
# ``ab_shard_order.py`` on the same CPU, gpt_mini's was 1.051x with 4 shards (its 4 shard
# routines 1.031x its whole one) and 1.002x with 2, convnet's 1.036x with 4 (1.008x-1.013x
# once the later shards read their inputs where set_batch staged them).
MIN_SHARD_ROWS = {"mlp_small": 8, "mlp_wide": 128, "convnet": 16, "gpt_mini": 8}
# Timed steps per run (``--steps`` overrides): at least about half a second of this project's
# one-rank step. convnet's step is about 0.2 ms: 40 steps timed 9 ms, where one preemption
# moved a row by 20% (an AMD EPYC, Zen 5: one run's three 2-rank rounds of convnet read 7339,
# 7356 and 6026 steps/s).
TIMED_STEPS = {"convnet": 2000}
DEFAULT_STEPS = 40


def timed_steps(w: Workload, given: int = 0) -> int:
    """The timed steps of a run of ``w``: ``given``, else ``TIMED_STEPS`` or ``DEFAULT_STEPS``."""
    return given or TIMED_STEPS.get(w.name, DEFAULT_STEPS)


def shard_count(w: Workload, given: int = 0) -> int:
    """The workload's shard count: ``given``, else ``parallel.default_shards`` with its
    ``MIN_SHARD_ROWS``."""
    from ocannl.parallel import default_shards

    return given or default_shards(w.batch, min_rows=MIN_SHARD_ROWS.get(w.name, 16))
# Every thread count a rank's libraries read: this project's loop threads (``OCANNL_THREADS``,
# which also sizes the products' share), OpenMP, the BLASes, Numba (PyTorch's own is set in
# its worker with ``torch.set_num_threads``).
THREAD_VARS = ("OCANNL_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMBA_NUM_THREADS")
# A rank's CPU time over its wall time in the timed loop may exceed its threads by this much
# (MPI's progress polling, gloo's I/O thread, the interpreter) before its row is refused.
CORES_SLACK = 0.35


# --- one rank -----------------------------------------------------------------------------------


def threads_in_use(framework: str) -> dict[str, int]:
    """The thread counts this process's libraries run with now: this project's loop threads
    (``ocannl``) or PyTorch's intra-op threads (``torch``), and every BLAS / OpenMP library
    loaded (threadpoolctl), by name."""
    out: dict[str, int] = {}
    if framework == "ocannl":
        from ocannl.backends.cpu import jit

        out["ocannl"] = int(jit.threads())
    else:
        import torch

        out["torch"] = int(torch.get_num_threads())
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return out
    for lib in threadpool_info():
        name = f"{lib.get('internal_api', '?')}:{Path(lib.get('filepath', '?')).name}"
        out[name] = int(lib.get("num_threads", 0))
    return out


def check_threads(label: int, reports: list[dict]) -> list[str]:
    """Why a row labelled ``label`` threads per rank is refused (empty: it is not): a rank
    whose libraries run another thread count, or whose CPU time over wall time in the timed
    loop (the cores it kept busy) exceeds ``label`` by more than ``CORES_SLACK``."""
    problems = []
    for r, rep in enumerate(reports):
        for lib, n in sorted(rep["threads"].items()):
            if n != label:
                problems.append(f"rank {r}: {lib} ran {n} thread(s), not {label}")
        cores = rep["cpu_s"] / rep["seconds"] if rep["seconds"] > 0 else 0.0
        if cores > label + CORES_SLACK:
            problems.append(f"rank {r}: kept {cores:.2f} cores busy (CPU time / wall time), "
                            f"more than its {label} thread(s)")
    return problems


def _shard(w: Workload, rank: int, size: int, step: int, fx: fixtures.Fixture,
           onehot: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    k = step % w.n_batches
    n = w.batch // size
    rows = slice(rank * n, (rank + 1) * n)
    return fx.x[k][rows], None if onehot is None else onehot[k][rows], fx.labels[k][rows]


def shard_model(w: Workload, fx: fixtures.Fixture, rows: int) -> tuple[Any, Any, Any, Any]:
    """This project's model of ``w`` over a shard of ``rows`` rows: its inputs, targets, loss
    and layers (for the fixture's weights)."""
    import ocannl.tensor as T

    if w.model == "gpt":
        x = T.class_ids(fx.x[0][:rows], num_classes=w.vocab, label="ids")
        y = T.class_ids(fx.labels[0][:rows], num_classes=w.vocab, label="targets")
    else:
        x = models.ocannl_input(np.zeros((rows, *w.input_shape), np.float32))
        y = T.term(np.zeros((rows, w.classes), np.float32), label="y")
    logits, layers = models.ocannl_model(w, x)
    return x, y, models.ocannl_loss(w, logits, y), layers


def ocannl_worker(w: Workload, steps: int, warmup: int, shards: int, zero: bool = False,
                  overlap: bool = False, alone: bool = False) -> dict:
    """This project's rank: ``shards`` shards summed in the shard tree's order (0: one shard
    per rank summed by MPI's allreduce, the order off); ``zero``: the optimizer state
    sharded over the ranks (ZeRO-1); ``overlap``: the exchange in buckets (the default
    ``bucket_bytes``) started while the last shard's backward code runs; ``alone``: each rank
    trains its own block of the tree's shards with no exchange at all (what the ranks reach
    with nothing between them: the ceiling of the others' scaling on this machine). Reports
    the optimizer state's bytes the rank holds."""
    from ocannl import Context, parallel, train

    comm = parallel.world("mpi")
    fx = fixtures.load(w)
    targets = models.feed_targets(fx)
    fixed = shards > 0
    count = shards if fixed else comm.size
    n = w.batch // count  # rows of a shard: what the model is built over
    block = slice(None)  # the rows of the global batch this rank's reducer is given
    if alone:
        count //= comm.size
        block = slice(comm.rank * count * n, (comm.rank + 1) * count * n)
    t0 = time.perf_counter()
    x, y, loss, layers = shard_model(w, fx, n)
    dp = parallel.DataParallel(parallel.SingleProcess() if alone else comm, loss,
                               inputs=[x, y], shards=count, fixed_order=fixed,
                               shard_optimizer=zero, overlap=overlap)
    ctx = dp.setup(Context.cpu())
    opt = models.ocannl_optimizer(w)
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss))
    dp.use_routines(grads)
    # with overlap, the update runs part by part as its buckets' sums arrive
    ctx, update = dp.compile_update(ctx, opt.update(loss, grad_unscale=dp.grad_unscale(),
                                                    shard=dp.optimizer_shard,
                                                    order=dp.update_order))
    whole = [n for p in loss.params for n in opt.state_of(p).values()]
    held = whole if not zero else \
        [n for q in dp.optimizer_shard.parts for n in opt.part_state(q).values()]
    state_bytes = sum(ctx.mem(n) for n in held)
    whole_bytes = sum(n.size * n.prec.itemsize for n in whole)
    ctx = models.set_ocannl_weights(ctx, layers, fx.weights)
    build_s = time.perf_counter() - t0

    def step(i: int) -> None:
        k = i % w.n_batches
        dp.set_batch(ctx, fx.x[k][block], targets[k][block])  # dp takes this rank's block
        dp.after_update(dp.run_and_reduce(ctx, grads, update=update))

    losses = []
    for i in range(w.parity_steps):
        step(i)
        losses.append(dp.global_loss())
    for i in range(warmup):
        step(w.parity_steps + i)
    comm.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        step(i)
    c1 = time.process_time()
    comm.barrier()
    elapsed = time.perf_counter() - t0
    mine = {"threads": threads_in_use("ocannl"), "cpu_s": c1 - c0, "seconds": elapsed,
            "state_bytes": state_bytes, "whole_state_bytes": whole_bytes}
    return {"rank": comm.rank, "size": comm.size, "losses": losses, "seconds": elapsed,
            "steps": steps, "build_s": build_s, "ranks": comm.allgather(mine)}


def torch_worker(w: Workload, steps: int, warmup: int, port: int, threads: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank, size = int(os.environ.get("PMI_RANK", 0)), int(os.environ.get("PMI_SIZE", 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        return _torch_timed(w, steps, warmup, rank, size, threads)
    finally:
        # DDP's reducer gone before its process group (the timed run's locals are): the other
        # way round, gloo's threads were still joinable at exit and about one 2-rank run in
        # three ended in std::terminate ("terminate called without an active exception",
        # exit code 15) after writing its result
        gc.collect()
        dist.destroy_process_group()


def _torch_timed(w: Workload, steps: int, warmup: int, rank: int, size: int,
                 threads: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    fx = fixtures.load(w)
    onehot = None
    t0 = time.perf_counter()
    model = DistributedDataParallel(models.torch_model(w, fx.weights))
    opt = models.torch_optimizer(w, model.parameters())
    build_s = time.perf_counter() - t0

    def step(i: int) -> torch.Tensor:
        xb, _, labels = _shard(w, rank, size, i, fx, onehot)
        opt.zero_grad()
        loss = models.torch_loss(w, model(torch.from_numpy(xb)), torch.from_numpy(labels))
        loss.backward()
        opt.step()
        return loss

    losses = []
    for i in range(w.parity_steps):
        loss = step(i).detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / size)
    for i in range(warmup):
        step(w.parity_steps + i)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        step(i)
    c1 = time.process_time()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    mine = {"threads": threads_in_use("torch"), "cpu_s": c1 - c0, "seconds": elapsed}
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine)
    return {"rank": rank, "size": size, "losses": losses, "seconds": elapsed, "steps": steps,
            "build_s": build_s, "ranks": everyone}


# --- the driver ---------------------------------------------------------------------------------


def reference_losses(w: Workload) -> list[float]:
    """Single-process PyTorch f32 over the global batch: the parity reference."""
    from benchmarks.runners import make_runner

    r = make_runner(fixtures.load(w), "torch", "eager", "cpu")
    r.build()
    out = []
    for i in range(w.parity_steps):
        r.step(i)
        out.append(r.loss())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(w: Workload, framework: str, ranks: int, steps: int, warmup: int, threads: int,
           timeout: float, shards: int = 0) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    ours = framework.startswith("ocannl")
    py = [sys.executable, "-m", "mpi4py"] if ours else [sys.executable]
    worker = ["ocannl", "--shards", str(0 if framework == "ocannl-allreduce" else shards),
              *(["--zero"] if framework == "ocannl-zero" else []),
              *(["--overlap"] if framework == "ocannl-overlap" else []),
              *(["--alone"] if framework == "ocannl-alone" else [])] if ours \
        else [framework]
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = str(threads)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rank0.json"
        cmd = [str(mpiexec), "-n", str(ranks), *py, str(Path(__file__).resolve()), "--worker",
               *worker, "--workloads", w.name, "--steps", str(steps), "--warmup",
               str(warmup), "--port", str(free_port()), "--threads", str(threads), "--result",
               str(out)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             start_new_session=True)
        if not out.exists():
            raise RuntimeError(f"{w.name}: {framework} on {ranks} ranks failed "
                               f"(rc {res.returncode}):\n"
                               f"{(res.stdout + res.stderr)[-3000:]}")
        got = json.loads(out.read_text())
        # A run that wrote its result and then failed on its way out (PyTorch's gloo has
        # aborted in its threads' teardown): the timing stands, the exit is recorded.
        got["exit_code"] = res.returncode
        if res.returncode != 0:
            got["exit_tail"] = (res.stdout + res.stderr)[-300:]
        return got


def launch_retried(*args: Any, tries: int = 3) -> dict:
    """:func:`launch`, again after a run that ended before writing its result (up to
    ``tries`` runs; each failure printed); the last failure raised."""
    for k in range(tries):
        try:
            return launch(*args)
        except RuntimeError as err:
            if k == tries - 1:
                raise
            print(f"{err}\n(run again: attempt {k + 2} of {tries})", flush=True)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(SHARDABLE),
                    default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps per run (default: per workload, TIMED_STEPS)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the parity ones")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs per row (median)")
    ap.add_argument("--threads-per-rank", type=int, default=0,
                    help="BLAS / OpenMP threads of each rank (default: cores / ranks); 1 keeps "
                         "a loaded machine from oversubscribing its cores at 1 rank")
    ap.add_argument("--out", type=Path, default=HERE, help="where DATA_PARALLEL.md/.json go")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--shards", type=int, default=0,
                    help="shards of the global batch for the fixed shard tree (default: per "
                         "workload, MIN_SHARD_ROWS); a multiple of every --ranks")
    ap.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    ap.add_argument("--worker", choices=("ocannl", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--zero", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    used = [WORKLOADS[name] for name in dict.fromkeys(args.workloads)]
    if args.worker:
        w = used[0]
        if args.worker == "ocannl":
            res = ocannl_worker(w, args.steps, args.warmup, args.shards, args.zero,
                                args.overlap, args.alone)
        else:
            res = torch_worker(w, args.steps, args.warmup, args.port, args.threads)
        if res["rank"] == 0:
            args.result.write_text(json.dumps(res))
        return 0

    cores = os.cpu_count() or 1
    for w in used:
        bad = [n for n in args.ranks if n < 1 or w.batch % n]
        if bad:
            ap.error(f"--ranks {bad[0]}: must divide {w.name}'s global batch {w.batch}")
        bad = [n for n in args.ranks if shard_count(w, args.shards) % n]
        if bad and "ocannl" in args.frameworks:
            ap.error(f"--ranks {bad[0]}: must divide {w.name}'s {shard_count(w, args.shards)} "
                     f"shards (--shards)")

    def threads(n: int) -> int:
        return args.threads_per_rank or max(1, cores // n)

    load_start = os.getloadavg()
    rows = []
    for w in used:
        ref = reference_losses(w)  # also writes the fixture before the ranks read it
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for n in args.ranks:
                for fw in args.frameworks:
                    res = launch_retried(w, fw, n, timed_steps(w, args.steps), args.warmup,
                                         threads(n),
                                         args.timeout, shard_count(w, args.shards))
                    runs.setdefault((fw, n), []).append(res)
                    print(f"{w.name} round {r + 1}: {fw:16s} {n} rank(s): "
                          f"{res['steps'] / res['seconds']:.2f} steps/s", flush=True)
        rows += workload_rows(w, runs, ref, args.ranks, threads, args.frameworks)
    from benchmarks.machine import commit, cpu_model

    command = ["benchmarks/data_parallel.py", *(argv if argv is not None else sys.argv[1:])]
    info = {"cpu": cpu_model(), "cpu_detail": cpu_detail(), "cores": cores, "commit": commit(),
            "load_avg_start": load_start, "load_avg": os.getloadavg(),
            "workloads": {w.name: {"describe": w.describe(), "dataset": w.dataset,
                                   "global_batch": w.batch,
                                   "shards": shard_count(w, args.shards),
                                   "steps": timed_steps(w, args.steps)} for w in used},
            "rounds": args.rounds,
            "command": ".venv/bin/python " + shlex.join(command)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "DATA_PARALLEL.json").write_text(json.dumps({"info": info, "rows": rows},
                                                            indent=1) + "\n")
    text = render(rows, info)
    (args.out / "DATA_PARALLEL.md").write_text(text)
    print(text)
    return 0


def workload_rows(w: Workload, runs: dict[tuple[str, int], list[dict]], ref: list[float],
                  ranks: list[int], threads: Callable[[int], int],
                  frameworks: Sequence[str] = FRAMEWORKS) -> list[dict]:
    """One row per (framework, ranks): the median steps/s, parity, scaling efficiency."""
    rows = []
    for fw in frameworks:
        for n in ranks:
            rs = runs[(fw, n)]
            sps = statistics.median(x["steps"] / x["seconds"] for x in rs)
            # each rank alone trains its own block: its losses are not the global batch's
            na = fw == "ocannl-alone" and n > 1
            err = 0.0 if na else max(abs(a - b) / abs(b)
                                     for a, b in zip(rs[0]["losses"], ref, strict=True))
            label = threads(n)
            refused = sorted({p for x in rs for p in check_threads(label, x["ranks"])})
            rows.append({"workload": w.name, "framework": fw, "ranks": n,
                         "rows_per_rank": w.batch // n, "threads_per_rank": label,
                         "steps_per_s": sps, "samples_per_s": sps * w.batch,
                         "parity_max_rel": err, "parity_ok": err <= TOLERANCE["f32"],
                         "parity_na": na,
                         "threads_refused": refused,
                         "losses": [x["losses"] for x in rs],
                         "threads_seen": [x["ranks"] for x in rs],
                         "all_steps_per_s": [x["steps"] / x["seconds"] for x in rs],
                         "exit_codes": [x.get("exit_code", 0) for x in rs],
                         "build_s": [x["build_s"] for x in rs]})
    for r in rows:  # a timing counts where parity passed and the threads were the label's
        r["timed"] = r["parity_ok"] and not r["threads_refused"]
    base = {r["framework"]: r for r in rows if r["ranks"] == 1}
    for r in rows:
        b = base.get(r["framework"])
        r["efficiency"] = None if b is None else r["steps_per_s"] / (r["ranks"] * b["steps_per_s"])
        # only timings that count, at N ranks and at 1, make an efficiency
        r["efficiency_ok"] = b is not None and r["timed"] and b["timed"]
    return rows


ON_PAPER = """## Beyond one machine (on paper)

Per step, with G the bytes of the f32 gradient buffer (P = G / 4 elements; mlp_wide: 1,323,018
parameters, 5.3 MB), N ranks and S shards (a multiple of N), each rank summing its own block of
S / N shards first:

| exchange | bytes each rank sends | messages per rank | additions per rank after its block |
|---|---|---|---|
| ring allreduce (MPI's, NCCL's; order off) | 2 (N - 1) / N G | 2 (N - 1) | (N - 1) / N P |
| shard tree, N = 2 (an allreduce of two) | G | as the allreduce | as the allreduce |
| shard tree, N > 2 (all-to-all, sum, allgather) | (c + 1)(N - 1)/N G | 2 (N - 1) | (cN - 1)/N P |
| shard tree, N > 2 over NCCL (allgather of the partials, sum) | (N - 1) c G | N - 1 | (cN - 1) P |

``c``: partial sums per rank, 1 when the shard and rank counts are powers of two (every
block is a subtree), at most S / N otherwise (3 ranks over 6 shards: 2). With ``c = 1`` the
fixed order sends a ring allreduce's bytes at every scale:

| N | ring allreduce | fixed shard tree (c = 1) | gathering every partial instead (N - 1) G |
|---:|---:|---:|---:|
| 8 | 1.75 G | 1.75 G | 7 G |
| 64 | 1.97 G | 1.97 G | 63 G |
| 512 | 2.00 G | 2.00 G | 511 G |

So the tree's price is not in bytes: an all-to-all of N - 1 messages of G / N (mlp_wide at
512 ranks: 10 KB each) is latency-bound like the ring's steps (a Bruck or pairwise all-to-all
inside MPI). Over NCCL (no all-to-all without grouped send / recv) the tree's sum gathers every
rank's partial sums and each GPU adds all of them: the right-hand column's bytes, bound by the
interconnect past a few ranks; the all-to-all there is not built. The order costs what cutting
the batch into S shards costs a rank that computes several of them one after the other: S must be a
multiple of every rank count the run should move between (512 ranks: S >= 512, a 1-rank
resume running 512 small shards a step). Measured here: the "Cost of the fixed shard order"
lines above (the same rank count, the tree against MPI's allreduce of one shard per rank).

ZeRO-1 (`DataParallel(shard_optimizer=True)`): Adam's 2 G of state per rank is 2 G / N (SGD's
momentum, G / N), and each rank updates P / N elements. As built, every rank still receives the
whole summed gradient (the loss scaler's checksum and clipping's norm read every gradient, and
computing those from slices would sum them in another order, so other bits), then sends its
updated slice of the parameters in one allgather: (N - 1) / N G more per rank and step than
without it (at N = 8, 64, 512: 0.88 G, 0.98 G, 1.00 G). Where neither reads the whole gradient,
the exchange could stop at the summed slices (the all-to-all and the tree sum, without the
gradients' allgather): then ZeRO-1 sends what the plain tree does, the parameters' allgather in
place of the gradients'; not built.

Overlap (`DataParallel(overlap=True)`) sends the same bytes as the exchange after the backward
code, in one collective per bucket (each the tree's: an allreduce of two at N = 2, else an
all-to-all and an allgather of the bucket): B buckets make B times the messages, each G / B
long, so it pays where a message of G / B still moves at the link's rate (a bucket of 1 MiB,
the default, does on any network) and the link runs beside the cores. On one machine's CPU
the ranks' gradient buffers share memory and no bytes move: each rank sums its half of a bucket
as soon as both have written it, between the parts of its own backward code (one thread a rank,
so the sum is interleaved with the backward code, not run beside it), with no barrier; the
rows above measure what that gains over the one sum after the backward code.
"""


def cores_busy(row: dict) -> float | None:
    """The median over a row's runs of its ranks' mean CPU time over wall time in the timed
    loop: 1.0 a core kept busy, less where the rank waited (for the others, or for a core the
    machine's other processes held)."""
    runs = [[x["cpu_s"] / x["seconds"] for x in ranks if x["seconds"] > 0]
            for ranks in row.get("threads_seen", [])]
    means = [sum(r) / len(r) for r in runs if r]
    return statistics.median(means) if means else None


def cpu_detail() -> str:
    """The CPU's family, model and vector units from /proc/cpuinfo (the model name alone may
    be as vague as "AMD EPYC")."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = (p.strip() for p in line.split(":", 1))
            fields.setdefault(k, v)
        elif fields:
            break
    flags = set(fields.get("flags", "").split())
    units = ", ".join(u for u in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if u in flags)
    return (f"family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, "
            f"{units or 'no AVX2'}")


def same_bits(rows: list[dict]) -> list[tuple[int, bool]]:
    """Per rank count above 1 and per fixed-order framework (the shard tree, with and without
    ZeRO-1): whether every run gave the very losses of every 1-rank run of the shard tree
    without ZeRO-1 (the same bits on any rank count, sharded or not)."""
    ours = {(r["framework"], r["ranks"]): r.get("losses") for r in rows
            if r["framework"] in ("ocannl", "ocannl-zero", "ocannl-overlap")}
    base = ours.get(("ocannl", 1))
    if not base:
        return []
    extra = {"ocannl-zero": " with ZeRO-1", "ocannl-overlap": " overlapped"}
    return [(f"{n} rank(s){extra.get(fw, '')}",
             all(x == base[0] for x in ls + base))
            for (fw, n), ls in sorted(ours.items()) if (fw, n) != ("ocannl", 1) and ls]


def overlap_gain(rows: list[dict]) -> list[tuple[int, float]]:
    """Per rank count where both were timed: the overlapped shard tree's steps/s over the
    plain one's (above 1: overlap pays)."""
    by = {(r["framework"], r["ranks"]): r for r in rows if r.get("timed", r["parity_ok"])}
    return [(n, by[("ocannl-overlap", n)]["steps_per_s"] / by[("ocannl", n)]["steps_per_s"])
            for fw, n in sorted(by) if fw == "ocannl" and ("ocannl-overlap", n) in by]


def state_per_rank(rows: list[dict]) -> list[tuple[int, int, int, float]]:
    """Per rank count of the ZeRO-1 rows: the most optimizer-state bytes a rank held, the
    whole state's bytes, and their ratio times the rank count (1.0: exactly 1 / N each)."""
    out = []
    for r in rows:
        if r["framework"] != "ocannl-zero" or not r.get("threads_seen"):
            continue
        ranks = r["threads_seen"][0]
        most = max(x.get("state_bytes", 0) for x in ranks)
        whole = ranks[0].get("whole_state_bytes", 0)
        if whole:
            out.append((r["ranks"], most, whole, most / whole * r["ranks"]))
    return out


def scaling_ceiling(rows: list[dict]) -> list[tuple[int, float, float]]:
    """Per rank count above 1 where both were timed: the scaling efficiency of the ranks
    training alone (``ocannl-alone``, against the fixed shard tree's 1 rank: the same work per
    rank, no exchange) and the fixed shard tree's own."""
    by = {(r["framework"], r["ranks"]): r for r in rows if r.get("timed", r["parity_ok"])}
    one = by.get(("ocannl", 1))
    if one is None:
        return []
    return [(n, by[("ocannl-alone", n)]["steps_per_s"] / (n * one["steps_per_s"]),
             by[("ocannl", n)]["steps_per_s"] / (n * one["steps_per_s"]))
            for fw, n in sorted(by) if fw == "ocannl" and n > 1 and ("ocannl-alone", n) in by]


def shard_order_cost(rows: list[dict]) -> list[tuple[int, float]]:
    """Per rank count where both were timed: ocannl-allreduce's steps/s over ocannl's."""
    by = {(r["framework"], r["ranks"]): r for r in rows if r.get("timed", r["parity_ok"])}
    return [(n, by[("ocannl-allreduce", n)]["steps_per_s"] / by[("ocannl", n)]["steps_per_s"])
            for fw, n in sorted(by) if fw == "ocannl" and ("ocannl-allreduce", n) in by]


def _steps_said(info: dict) -> str:
    """The timed steps of a run: one count, or each workload's (older reports: ``steps``)."""
    if "steps" in info:
        return str(info["steps"])
    counts = {name: wi["steps"] for name, wi in info["workloads"].items()}
    if len(set(counts.values())) == 1:
        return str(next(iter(counts.values())))
    return ", ".join(f"{n} ({name})" for name, n in counts.items())


def render(rows: list[dict], info: dict) -> str:
    load = ", ".join(f"{v:.1f}" for v in info["load_avg"])
    load0 = ", ".join(f"{v:.1f}" for v in info.get("load_avg_start", info["load_avg"]))
    lines = [
        "# Data-parallel scaling (CPU)", "",
        f"{info['cpu']} ({info.get('cpu_detail', '')}), {info['cores']} cores, commit "
        f"{info['commit']}; load average (1, 5, "
        f"15 min) at the start {load0}, at the end {load} (other processes share the cores: "
        f"every figure is noisy). Median of {info['rounds']} runs of "
        f"{_steps_said(info)} timed steps. Generated by `{info['command']}`.", "",
        "Each workload's global batch is split over the ranks; every run starts from the "
        "same fixture weights and trains on the same batches. Parity: the first steps' global "
        "losses against single-process PyTorch f32, max relative error, tolerance "
        f"{TOLERANCE['f32']:.0e}; a row failing it shows no timing.", "",
    ]
    for name, wi in info["workloads"].items():
        lines += [f"## {name}", "",
                  f"{wi['describe']}; {wi['dataset']}, global batch {wi['global_batch']}, "
                  f"{wi.get('shards', '?')} shards for the fixed shard tree.", "",
                  "| framework | ranks | rows per rank | threads per rank | cores busy per rank "
                  "| steps/s | samples/s | scaling efficiency | parity (max rel. loss err.) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["workload"] == name):
            fw = NAMES.get(r["framework"], r["framework"])
            ok = r["parity_ok"]
            timed = r.get("timed", ok)
            eff = f"{r['efficiency']:.2f}" if r["efficiency_ok"] else "-"
            sps = (f"{r['steps_per_s']:.2f}" if timed else
                   "(parity failed)" if not ok else "(refused: threads)")
            samples = f"{r['samples_per_s']:.0f}" if timed else "-"
            busy = cores_busy(r)
            parity = "n/a (no exchange)" if r.get("parity_na") else \
                f"{'ok' if ok else 'FAIL'} ({r['parity_max_rel']:.1e})"
            lines.append(f"| {fw} | {r['ranks']} | {r['rows_per_rank']} | "
                         f"{r['threads_per_rank']} | {'-' if busy is None else f'{busy:.2f}'} | "
                         f"{sps} | {samples} | {eff} | {parity} |")
        same = same_bits([r for r in rows if r["workload"] == name])
        if same:
            lines += ["", "The fixed shard tree's global losses over the parity steps, at each "
                      "rank count against 1 rank's (every run): " + ", ".join(
                          f"{n} {'identical' if ok else 'DIFFERENT'}"
                          for n, ok in same) + "."]
        gain = overlap_gain([r for r in rows if r["workload"] == name])
        if gain:
            lines += ["", "Overlap (steps/s with the buckets' exchanges started during the "
                      "backward code over steps/s with one exchange after it): " + ", ".join(
                          f"{n} rank(s) {g:.3f}x" for n, g in gain) + "."]
        state = state_per_rank([r for r in rows if r["workload"] == name])
        if state:
            lines += ["", "Optimizer state per rank with ZeRO-1 (the most a rank held, of the "
                      "whole): " + ", ".join(
                          f"{n} rank(s) {most:,} of {whole:,} bytes ({most / whole:.3f}, "
                          f"{ratio:.3f} x 1/{n})" for n, most, whole, ratio in state) + "."]
        ceiling = scaling_ceiling([r for r in rows if r["workload"] == name])
        if ceiling:
            lines += ["", "The ceiling (each rank training its own block of the tree's shards "
                      "with no exchange at all: what the ranks of this machine reach with "
                      "nothing between them): " + ", ".join(
                          f"{n} ranks {c:.2f}, the fixed shard tree {t:.2f} ({t / c:.2f} of it)"
                          for n, c, t in ceiling) + " (scaling efficiency)."]
        cost = shard_order_cost([r for r in rows if r["workload"] == name])
        if cost:
            lines += ["", "Cost of the fixed shard order (steps/s with MPI's allreduce over "
                      "steps/s with the shard tree): " + ", ".join(
                          f"{n} rank(s) {c:.3f}x" for n, c in cost) + "."]
        lines.append("")
    lines += ["Scaling efficiency: steps/s at N ranks / (N x steps/s at 1 rank). Cores busy "
              "per rank: CPU time over wall time in the timed loop (1.0: a whole core; well "
              "below it, the machine's other processes held the cores: the row measures them "
              "as much as the framework)."]
    lines += ["", ON_PAPER]
    refused = [r for r in rows if r.get("threads_refused")]
    if refused:
        lines += ["", "Rows refused because a rank ran another thread count than its label "
                  "(not timed here; raw figures in `DATA_PARALLEL.json`):", ""]
        lines += [f"- {r['workload']}, {r['framework']}, {r['ranks']} rank(s): "
                  + "; ".join(r["threads_refused"]) for r in refused]
    if not all(r["parity_ok"] for r in rows):
        lines += ["", "A row that failed the parity gate is not timed here; its measured "
                  "steps/s stay in `DATA_PARALLEL.json` (`all_steps_per_s`), for diagnosis only."]
    crashed = [r for r in rows if any(r.get("exit_codes", ()))]
    if crashed:
        lines += ["", "Runs that wrote their result, then exited with an error (their timing "
                  "stands; `exit_codes` in `DATA_PARALLEL.json`):", ""]
        lines += [f"- {r['workload']}, {r['framework']}, {r['ranks']} rank(s): exit codes "
                  f"{r['exit_codes']}" for r in crashed]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
