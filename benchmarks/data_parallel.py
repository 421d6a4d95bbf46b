"""Data-parallel scaling on the CPU: steps per second of the wide MLP (``specs.mlp_wide``:
256 -> 1024 -> 1024 -> 10, softmax cross-entropy, plain SGD, global batch 256) at 1 and 2
ranks, this project (``ocannl.parallel`` over MPI) next to PyTorch DDP with gloo, as the anchor,
on the same machine.

    .venv/bin/python benchmarks/data_parallel.py [--ranks 1 2] [--steps 40] [--rounds 3]

Strong scaling: the global batch stays 256, so each of N ranks trains on 256 / N rows; both
frameworks run N processes with ``cores / N`` BLAS / OpenMP threads each (or
``--threads-per-rank``), launched by the project's ``mpiexec``. Steps per second are timed on
rank 0 between two barriers, after warm-up; the median over ``--rounds`` interleaved runs is
reported. Scaling efficiency at N ranks: steps per second at N over N times steps per second at
1 (1.0: perfect). A timing counts only where the parity gate passes: the first
``parity_steps`` global losses (the mean of the ranks' shard losses) within 1e-5 relative of
single-process PyTorch f32 over the global batch.

Measured, not asserted: writes ``DATA_PARALLEL.md`` and ``DATA_PARALLEL.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks import fixtures  # noqa: E402
from benchmarks.specs import TOLERANCE, WORKLOADS, Workload  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKLOAD = "mlp_wide"
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
    from ocannl import Context, nn_blocks, optim, parallel, train

    comm = parallel.world("mpi")
    fx = fixtures.load(w)
    onehot = fx.onehot()
    n = w.batch // comm.size
    t0 = time.perf_counter()
    x = T.term(np.zeros((n, w.sizes[0]), np.float32), label="x")
    y = T.term(np.zeros((n, w.classes), np.float32), label="y")
    logits, layers = nn_blocks.mlp(x, list(w.sizes[1:-1]), w.classes, label="mlp")
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    dp = parallel.DataParallel(comm, loss, inputs=[x, y])
    ctx = dp.setup(Context.cpu())
    opt = optim.SGD(w.learning_rate)
    ctx, grads = ctx.compile(train.grad_update(loss))
    ctx, update = ctx.compile(opt.update(loss, grad_unscale=dp.grad_unscale()))
    for (wt, bt), (wv, bv) in zip(layers, fx.weights, strict=True):
        ctx = ctx.set_values(wt, wv).set_values(bt, bv)
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
    layers: list[torch.nn.Module] = []
    for k, (wv, bv) in enumerate(fx.weights):
        lin = torch.nn.Linear(wv.shape[1], wv.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(wv))
            lin.bias.copy_(torch.from_numpy(bv))
        layers.append(lin)
        if k < len(fx.weights) - 1:
            layers.append(torch.nn.ReLU())
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=w.learning_rate)
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


def launch(framework: str, ranks: int, steps: int, warmup: int, threads: int,
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
               framework, "--steps", str(steps), "--warmup", str(warmup), "--port",
               str(free_port()), "--threads", str(threads), "--result", str(out)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                             start_new_session=True)
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(f"{framework} on {ranks} ranks failed (rc {res.returncode}):\n"
                               f"{(res.stdout + res.stderr)[-3000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    w = WORKLOADS[WORKLOAD]
    if args.worker:
        if args.worker == "ocannl":
            res = ocannl_worker(w, args.steps, args.warmup)
        else:
            res = torch_worker(w, args.steps, args.warmup, args.port, args.threads)
        if res["rank"] == 0:
            args.result.write_text(json.dumps(res))
        return 0

    cores = os.cpu_count() or 1
    bad = [n for n in args.ranks if n < 1 or w.batch % n]
    if bad:
        ap.error(f"--ranks {bad[0]}: must divide the global batch {w.batch}")
    def threads(n: int) -> int:
        return args.threads_per_rank or max(1, cores // n)

    ref = reference_losses(w)
    runs: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for n in args.ranks:
            for fw in FRAMEWORKS:
                res = launch(fw, n, args.steps, args.warmup, threads(n), args.timeout)
                runs.setdefault((fw, n), []).append(res)
                print(f"round {r + 1}: {fw:6s} {n} rank(s): "
                      f"{res['steps'] / res['seconds']:.2f} steps/s", flush=True)
    rows = []
    for fw in FRAMEWORKS:
        for n in args.ranks:
            rs = runs[(fw, n)]
            sps = statistics.median(x["steps"] / x["seconds"] for x in rs)
            err = max(abs(a - b) / abs(b) for a, b in zip(rs[0]["losses"], ref, strict=True))
            rows.append({"framework": fw, "ranks": n, "rows_per_rank": w.batch // n,
                         "threads_per_rank": threads(n), "steps_per_s": sps,
                         "samples_per_s": sps * w.batch, "parity_max_rel": err,
                         "parity_ok": err <= TOLERANCE["f32"],
                         "all_steps_per_s": [x["steps"] / x["seconds"] for x in rs]})
    base = {r["framework"]: r["steps_per_s"] for r in rows if r["ranks"] == 1}
    for r in rows:
        b = base.get(r["framework"])
        r["efficiency"] = None if b is None else r["steps_per_s"] / (r["ranks"] * b)
    from benchmarks.machine import commit, cpu_model

    info = {"cpu": cpu_model(), "cores": cores, "commit": commit(),
            "load_avg": os.getloadavg(), "workload": w.name, "global_batch": w.batch,
            "steps": args.steps, "rounds": args.rounds}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "DATA_PARALLEL.json").write_text(json.dumps({"info": info, "rows": rows},
                                                            indent=1) + "\n")
    text = render(rows, info)
    (args.out / "DATA_PARALLEL.md").write_text(text)
    print(text)
    return 0


def render(rows: list[dict], info: dict) -> str:
    lines = [
        "# Data-parallel scaling (CPU)", "",
        f"`{info['workload']}` (256 -> 1024 -> 1024 -> 10, plain SGD), global batch "
        f"{info['global_batch']} split over the ranks; {info['cpu']}, {info['cores']} cores, "
        f"commit {info['commit']}, load average at the end "
        f"{', '.join(f'{v:.1f}' for v in info['load_avg'])}. Median of {info['rounds']} runs "
        f"of {info['steps']} timed steps. Regenerate: `.venv/bin/python "
        f"benchmarks/data_parallel.py`.", "",
        "| framework | ranks | rows per rank | threads per rank | steps/s | samples/s "
        "| scaling efficiency | parity (max rel. loss err.) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = "ocannl (MPI)" if r["framework"] == "ocannl" else "PyTorch DDP (gloo)"
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}"
        sps = f"{r['steps_per_s']:.2f}" if r["parity_ok"] else "(parity failed)"
        lines.append(f"| {name} | {r['ranks']} | {r['rows_per_rank']} | "
                     f"{r['threads_per_rank']} | {sps} | {r['samples_per_s']:.0f} | {eff} | "
                     f"{'ok' if r['parity_ok'] else 'FAIL'} ({r['parity_max_rel']:.1e}) |")
    lines += ["", "Scaling efficiency: steps/s at N ranks / (N x steps/s at 1 rank)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
