"""Data-parallel scaling on the CPU: steps per second at 1 and 2 ranks, this project
(``ocannl.parallel`` over MPI) next to PyTorch DDP with gloo, as the anchor, on the same
machine, for the workloads (``benchmarks.specs``, models from ``benchmarks.models``):

- ``mlp_wide``: 256 -> 1024 -> 1024 -> 10 relu MLP, plain SGD, global batch 256;
- ``convnet``: ``nn_blocks.lenet`` on scikit-learn's 8x8 digits, Adam (lr 1e-3), global
  batch 64.

    .venv/bin/python benchmarks/data_parallel.py [--workloads mlp_wide convnet]
        [--ranks 1 2] [--steps 40] [--rounds 3]

Strong scaling: the global batch stays fixed, so each of N ranks trains on batch / N rows; both
frameworks run N processes with ``cores / N`` BLAS / OpenMP threads each (or
``--threads-per-rank``), launched by the project's ``mpiexec``. Both start from the fixture's
weights and train on the same batches. Steps per second are timed on rank 0 between two
barriers, after warm-up; the median over ``--rounds`` interleaved runs is reported. Scaling
efficiency at N ranks: steps per second at N over N times steps per second at 1 (1.0:
perfect). A timing counts only where the parity gate passes: the first ``parity_steps`` global
losses (the mean of the ranks' shard losses) within 1e-5 relative of single-process PyTorch f32
over the global batch (a failing row keeps its raw timings in the JSON, not in the table).

Measured, not asserted: writes ``DATA_PARALLEL.md`` and ``DATA_PARALLEL.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks import fixtures, models  # noqa: E402
from benchmarks.specs import TOLERANCE, WORKLOADS, Workload  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_WORKLOADS = ("mlp_wide", "convnet")
# The workloads whose batches shard by rows of features or images (not yet gpt's token ids).
SHARDABLE = tuple(name for name, w in WORKLOADS.items() if w.model in ("mlp", "lenet"))
FRAMEWORKS = ("ocannl", "torch")


# --- one rank -----------------------------------------------------------------------------------


def _shard(w: Workload, rank: int, size: int, step: int, fx: fixtures.Fixture,
           onehot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = step % w.n_batches
    n = w.batch // size
    rows = slice(rank * n, (rank + 1) * n)
    return fx.x[k][rows], onehot[k][rows], fx.labels[k][rows]


def ocannl_worker(w: Workload, steps: int, warmup: int) -> dict:
    import ocannl.tensor as T
    from ocannl import Context, nn_blocks, parallel, train

    comm = parallel.world("mpi")
    fx = fixtures.load(w)
    onehot = fx.onehot()
    n = w.batch // comm.size
    t0 = time.perf_counter()
    x = models.ocannl_input(np.zeros((n, *w.input_shape), np.float32))
    y = T.term(np.zeros((n, w.classes), np.float32), label="y")
    logits, layers = models.ocannl_model(w, x)
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    dp = parallel.DataParallel(comm, loss, inputs=[x, y])
    ctx = dp.setup(Context.cpu())
    opt = models.ocannl_optimizer(w)
    ctx, grads = ctx.compile(train.grad_update(loss))
    ctx, update = ctx.compile(opt.update(loss, grad_unscale=dp.grad_unscale()))
    ctx = models.set_ocannl_weights(ctx, layers, fx.weights)
    build_s = time.perf_counter() - t0

    def step(i: int) -> None:
        xb, yb, _ = _shard(w, comm.rank, comm.size, i, fx, onehot)
        ctx.set_values(x, xb).set_values(y, yb)
        ctx.run(grads)
        dp.reduce(ctx)
        ctx.run(update)

    losses = []
    for i in range(w.parity_steps):
        step(i)
        losses.append(dp.mean(ctx.get_value(loss)))
    for i in range(warmup):
        step(w.parity_steps + i)
    comm.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    comm.barrier()
    elapsed = time.perf_counter() - t0
    return {"rank": comm.rank, "size": comm.size, "losses": losses, "seconds": elapsed,
            "steps": steps, "build_s": build_s}


def torch_worker(w: Workload, steps: int, warmup: int, port: int, threads: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    rank, size = int(os.environ.get("PMI_RANK", 0)), int(os.environ.get("PMI_SIZE", 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    fx = fixtures.load(w)
    onehot = fx.onehot()
    t0 = time.perf_counter()
    model = DistributedDataParallel(models.torch_model(w, fx.weights))
    opt = models.torch_optimizer(w, model.parameters())
    ce = torch.nn.functional.cross_entropy
    build_s = time.perf_counter() - t0

    def step(i: int) -> torch.Tensor:
        xb, _, labels = _shard(w, rank, size, i, fx, onehot)
        opt.zero_grad()
        loss = ce(model(torch.from_numpy(xb)), torch.from_numpy(labels))
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
    t0 = time.perf_counter()
    for i in range(steps):
        step(i)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"rank": rank, "size": size, "losses": losses, "seconds": elapsed, "steps": steps,
            "build_s": build_s}


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
           timeout: float) -> dict:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    py = [sys.executable, "-m", "mpi4py"] if framework == "ocannl" else [sys.executable]
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS"):
        env[var] = str(threads)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rank0.json"
        cmd = [str(mpiexec), "-n", str(ranks), *py, str(Path(__file__).resolve()), "--worker",
               framework, "--workloads", w.name, "--steps", str(steps), "--warmup",
               str(warmup), "--port", str(free_port()), "--threads", str(threads), "--result",
               str(out)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             start_new_session=True)
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(f"{w.name}: {framework} on {ranks} ranks failed "
                               f"(rc {res.returncode}):\n"
                               f"{(res.stdout + res.stderr)[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(SHARDABLE),
                    default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the parity ones")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs per row (median)")
    ap.add_argument("--threads-per-rank", type=int, default=0,
                    help="BLAS / OpenMP threads of each rank (default: cores / ranks); 1 keeps "
                         "a loaded machine from oversubscribing its cores at 1 rank")
    ap.add_argument("--out", type=Path, default=HERE, help="where DATA_PARALLEL.md/.json go")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    used = [WORKLOADS[name] for name in dict.fromkeys(args.workloads)]
    if args.worker:
        w = used[0]
        if args.worker == "ocannl":
            res = ocannl_worker(w, args.steps, args.warmup)
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

    def threads(n: int) -> int:
        return args.threads_per_rank or max(1, cores // n)

    load_start = os.getloadavg()
    rows = []
    for w in used:
        ref = reference_losses(w)  # also writes the fixture before the ranks read it
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for n in args.ranks:
                for fw in FRAMEWORKS:
                    res = launch(w, fw, n, args.steps, args.warmup, threads(n), args.timeout)
                    runs.setdefault((fw, n), []).append(res)
                    print(f"{w.name} round {r + 1}: {fw:6s} {n} rank(s): "
                          f"{res['steps'] / res['seconds']:.2f} steps/s", flush=True)
        rows += workload_rows(w, runs, ref, args.ranks, threads)
    from benchmarks.machine import commit, cpu_model

    command = ["benchmarks/data_parallel.py", *(argv if argv is not None else sys.argv[1:])]
    info = {"cpu": cpu_model(), "cores": cores, "commit": commit(),
            "load_avg_start": load_start, "load_avg": os.getloadavg(),
            "workloads": {w.name: {"describe": w.describe(), "dataset": w.dataset,
                                   "global_batch": w.batch} for w in used},
            "steps": args.steps, "rounds": args.rounds,
            "command": ".venv/bin/python " + shlex.join(command)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "DATA_PARALLEL.json").write_text(json.dumps({"info": info, "rows": rows},
                                                            indent=1) + "\n")
    text = render(rows, info)
    (args.out / "DATA_PARALLEL.md").write_text(text)
    print(text)
    return 0


def workload_rows(w: Workload, runs: dict[tuple[str, int], list[dict]], ref: list[float],
                  ranks: list[int], threads: Callable[[int], int]) -> list[dict]:
    """One row per (framework, ranks): the median steps/s, parity, scaling efficiency."""
    rows = []
    for fw in FRAMEWORKS:
        for n in ranks:
            rs = runs[(fw, n)]
            sps = statistics.median(x["steps"] / x["seconds"] for x in rs)
            err = max(abs(a - b) / abs(b) for a, b in zip(rs[0]["losses"], ref, strict=True))
            rows.append({"workload": w.name, "framework": fw, "ranks": n,
                         "rows_per_rank": w.batch // n, "threads_per_rank": threads(n),
                         "steps_per_s": sps, "samples_per_s": sps * w.batch,
                         "parity_max_rel": err, "parity_ok": err <= TOLERANCE["f32"],
                         "all_steps_per_s": [x["steps"] / x["seconds"] for x in rs],
                         "build_s": [x["build_s"] for x in rs]})
    base = {r["framework"]: r for r in rows if r["ranks"] == 1}
    for r in rows:
        b = base.get(r["framework"])
        r["efficiency"] = None if b is None else r["steps_per_s"] / (r["ranks"] * b["steps_per_s"])
        # only timings that passed the gate, at N ranks and at 1, make an efficiency
        r["efficiency_ok"] = b is not None and r["parity_ok"] and b["parity_ok"]
    return rows


def render(rows: list[dict], info: dict) -> str:
    load = ", ".join(f"{v:.1f}" for v in info["load_avg"])
    load0 = ", ".join(f"{v:.1f}" for v in info.get("load_avg_start", info["load_avg"]))
    lines = [
        "# Data-parallel scaling (CPU)", "",
        f"{info['cpu']}, {info['cores']} cores, commit {info['commit']}; load average (1, 5, "
        f"15 min) at the start {load0}, at the end {load} (other processes share the cores: "
        f"every figure is noisy). Median of {info['rounds']} runs of {info['steps']} timed "
        f"steps. Generated by `{info['command']}`.", "",
        "Each workload's global batch is split over the ranks; both frameworks start from the "
        "same fixture weights and train on the same batches. Parity: the first steps' global "
        "losses against single-process PyTorch f32, max relative error, tolerance "
        f"{TOLERANCE['f32']:.0e}; a row failing it shows no timing.", "",
    ]
    for name, wi in info["workloads"].items():
        lines += [f"## {name}", "",
                  f"{wi['describe']}; {wi['dataset']}, global batch {wi['global_batch']}.", "",
                  "| framework | ranks | rows per rank | threads per rank | steps/s | samples/s "
                  "| scaling efficiency | parity (max rel. loss err.) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["workload"] == name):
            fw = "ocannl (MPI)" if r["framework"] == "ocannl" else "PyTorch DDP (gloo)"
            ok = r["parity_ok"]
            eff = f"{r['efficiency']:.2f}" if r["efficiency_ok"] else "-"
            sps = f"{r['steps_per_s']:.2f}" if ok else "(parity failed)"
            samples = f"{r['samples_per_s']:.0f}" if ok else "-"
            lines.append(f"| {fw} | {r['ranks']} | {r['rows_per_rank']} | "
                         f"{r['threads_per_rank']} | {sps} | {samples} | {eff} | "
                         f"{'ok' if ok else 'FAIL'} ({r['parity_max_rel']:.1e}) |")
        lines.append("")
    lines += ["Scaling efficiency: steps/s at N ranks / (N x steps/s at 1 rank)."]
    if not all(r["parity_ok"] for r in rows):
        lines += ["", "A row that failed the parity gate is not timed here; its measured "
                  "steps/s stay in `DATA_PARALLEL.json` (`all_steps_per_s`), for diagnosis only."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
