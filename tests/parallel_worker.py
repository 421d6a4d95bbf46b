"""The training runs of tests/test_parallel.py: under ``mpiexec -n N python -m mpi4py`` (one
process per rank), or imported by the tests for the single-process references.

    python -m mpi4py tests/parallel_worker.py train --out DIR --variants sgd-host-f32,...
    python -m mpi4py tests/parallel_worker.py refuse --what shards
    python -m mpi4py tests/parallel_worker.py hang --out DIR
    python -m mpi4py tests/parallel_worker.py twins --out DIR

A *variant* is ``OPTIMIZER-GATE-PREC``: optimizer ``sgd`` (momentum) or ``adam``, gate
``host`` (``scaled_step``) or ``fused`` (``gated_step``, a window of 4 steps), ``prec`` the
model's: ``f32`` parameters, or ``f16`` cast twins of f32 masters. Each run trains a small MLP
on half-moons with a dynamic loss scale that grows every 3 good steps (so f16 runs overflow on
their own), with an infinity injected into global row ``INJECT_ROW`` of step ``INJECT_STEP``
(the first row of rank 1's shard), and writes, per rank, ``OUT/TAG-VARIANT-rankR.npz``: the
training state, the scaler and recipe counters, and the shard loss of every step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE / "backends")]

import ocannl.tensor as T  # noqa: E402
from ocannl import Context, checkpoint, datasets, mixed_prec, nn_blocks, optim, parallel, train  # noqa: E402,E501

VARIANTS = ("sgd-host-f32", "sgd-fused-f16", "adam-host-f16", "adam-fused-f32")
POINTS = 256
INJECT_STEP, INJECT_ROW = 5, 16
CHECK_INTERVAL = 4


def build(variant: str, local_batch: int) -> dict[str, Any]:
    """The model of a variant over a shard of ``local_batch`` rows (every rank builds the same
    parameters, in the same order)."""
    opt_name, gate, prec = variant.split("-")
    T.set_seed(0)
    x = T.term(np.zeros((local_batch, 2)), label="x", prec=prec)
    y = T.term(np.zeros((local_batch, 2)), label="y")
    if prec == "f32":
        logits, _ = nn_blocks.mlp(x, [16], 2)
    else:
        logits, _ = mixed_prec.with_master_weights(
            prec=prec, f=lambda: nn_blocks.mlp(x, [16], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    opt: optim.Optimizer = (optim.SGD(0.1, momentum=0.9) if opt_name == "sgd"
                            else optim.Adam(0.01))
    scaler = mixed_prec.Loss_scaler.create(init_scale=2.0**19, growth_interval=3)
    return {"x": x, "y": y, "loss": loss, "opt": opt, "scaler": scaler, "gate": gate}


def global_rows(step: int, global_batch: int) -> np.ndarray:
    """The global batch of a step: a fresh permutation per epoch, a function of the step."""
    per_epoch = POINTS // global_batch
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([7, epoch]).permutation(POINTS)
    return perm[k * global_batch:(k + 1) * global_batch]


class VirtualRanks:
    """A single-process stand-in for ``size`` ranks: the reference that sums the per-shard
    gradients in rank order. Its ``allreduce_sum`` keeps shard 0's gradients (computed by the
    recipe's gradient routine), computes shards 1.. with a second gradient routine, and adds
    them in order: ``((g0 + g1) + g2) ...``, which for two ranks is what MPI's sum gives."""

    name = "virtual"
    rank = 0

    def __init__(self, size: int) -> None:
        self.size = size
        self.feed: Any = None  # feed(ctx, shard) -> ctx: puts that shard's data in x and y
        self.grads: Any = None  # the gradient routine
        self.ctx: Context | None = None
        self.loss: Any = None
        self.shard_losses: list[float] = []

    def allreduce_sum(self, buf: np.ndarray) -> None:
        ctx = self.ctx
        assert ctx is not None
        self.shard_losses = [ctx.get_value(self.loss)]
        acc = np.array(buf, copy=True)
        for k in range(1, self.size):
            ctx = self.feed(ctx, k)
            ctx = ctx.run(self.grads)
            self.shard_losses.append(ctx.get_value(self.loss))
            acc += buf
        buf[...] = acc

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        pass

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        return [obj] * self.size

    def alltoall_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        raise NotImplementedError("virtual ranks sum through allreduce_sum: two of them only")

    def allgather_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        raise NotImplementedError("virtual ranks sum through allreduce_sum: two of them only")

    def allgather_inplace(self, buf: Any) -> None:
        raise NotImplementedError("virtual ranks hold the whole optimizer state")

    def start_allreduce_sum(self, buf: Any) -> Any:
        self.allreduce_sum(buf)  # at once: the other virtual ranks run inside it
        return parallel.comm.Pending.done()

    def start_alltoall(self, send: np.ndarray, recv: np.ndarray) -> None:
        raise NotImplementedError("virtual ranks sum through allreduce_sum: two of them only")

    start_allgather = start_alltoall

    def allreduce_max(self, value: int) -> int:
        return int(value)

    def barrier(self) -> None:
        pass

    def abort(self, code: int = 1) -> None:
        os._exit(code)


def make_comm(kind: str) -> Any:
    if kind.startswith("virtual:"):
        return VirtualRanks(int(kind.split(":")[1]))
    if kind == "fake-nccl":
        import fake_nccl

        fake_nccl.install()
        return parallel.NcclCommunicator()
    return parallel.world(kind)


def run(comm: Any, variant: str, *, global_batch: int = 32, steps: int = 12,
        inject: bool = True, ckpt: Path | None = None, every: int = 5, resume: bool = False,
        die_at: int | None = None, die_rank: int = 1, backend: str = "cpu",
        plain: bool = False, exact: bool = True, zero: bool = False,
        overlap: bool = False) -> dict[str, Any]:
    """Train ``variant`` for ``steps`` steps of ``global_batch`` rows over ``comm``; returns
    this rank's result. ``plain``: the recipe without a reducer (no data parallelism);
    ``zero``: the optimizer state sharded over the ranks; ``overlap``: the exchange in buckets
    of about a parameter each."""
    virtual = isinstance(comm, VirtualRanks)
    size = comm.size
    local = global_batch // size
    m = build(variant, local)
    x, y, loss, opt, scaler = m["x"], m["y"], m["loss"], m["opt"], m["scaler"]
    if backend == "cpu":
        ctx = Context.cpu()
    else:
        ctx = Context.cuda(comm.device_id)
    dp = parallel.DataParallel(comm, loss, inputs=[x, y], shard_optimizer=zero,
                               overlap=overlap, bucket_bytes=64)
    if not plain:
        ctx = dp.setup(ctx)
    reducer = None if plain else dp
    if m["gate"] == "host":
        recipe: mixed_prec.Recipe = mixed_prec.scaled_step(scaler, loss, opt, reducer=reducer)
    else:
        recipe = mixed_prec.gated_step(scaler, loss, opt, check_interval=CHECK_INTERVAL,
                                       reducer=reducer)
    ctx = dp.compile(ctx, recipe) if overlap else recipe.compile(ctx)
    ctx = train.init_params(ctx, loss)
    state = checkpoint.training_state(loss, opt) + recipe.state_nodes()
    if not plain:
        ctx = dp.broadcast(ctx, state)
    points, labels = datasets.half_moons(POINTS, seed=3)
    targets = datasets.one_hot(labels, 2)
    cur = {"step": 0}

    def feed(ctx: Context, shard: int) -> Context:
        rows = global_rows(cur["step"], global_batch)[shard * local:(shard + 1) * local]
        xb = points[rows].copy()
        if inject and cur["step"] == INJECT_STEP and shard * local <= INJECT_ROW < (
                shard + 1) * local:
            xb[INJECT_ROW - shard * local, 0] = np.inf
        ctx = ctx.set_values(x, xb)
        return ctx.set_values(y, targets[rows])

    if virtual:
        ctx, comm.grads = ctx.compile(recipe.grad_comp)
        comm.feed, comm.ctx, comm.loss = feed, ctx, loss
    start = 0
    if resume:
        ctx, progress = dp.load(ckpt, ctx, state, exact=exact)
        ctx = scaler.restore_state(ctx, progress.extra["loss_scaler"])
        recipe.restore_state(progress.extra["recipe"])
        start = progress.step
    losses = np.full((steps, size if virtual else 1), np.nan)
    for step in range(start, steps):
        cur["step"] = step
        ctx = feed(ctx, comm.rank)
        ctx = recipe.step(ctx)
        losses[step] = comm.shard_losses if virtual else ctx.get_value(loss)
        if ckpt is not None and not resume and (step + 1) % every == 0:
            extra = {"loss_scaler": scaler.save_state(), "recipe": recipe.save_state(),
                     "global_batch": str(global_batch)}
            dp.save(ckpt, ctx, state, checkpoint.Progress(step=step + 1, extra=extra))
        if die_at == step + 1 and comm.rank == die_rank:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    ctx = recipe.flush(ctx)
    if not plain:
        dp.check_equal(ctx, state)  # the ranks agree, or every rank raises
    return {
        **trained_state(ctx, state, scaler, recipe, None if plain else dp),
        "reductions": dp.reductions, "losses": losses, "start": start,
        "flat_size": dp.flat.size if dp.flat is not None else 0,
    }


def broadcast_twins(comm: Any, out: Path) -> None:
    """Each rank draws its own masters of bf16 twins and runs the forward pass once (its kept
    twins then hold its own masters, rounded); rank 0's masters are broadcast, and the forward
    pass is run again on the same rows everywhere. Writes ``OUT/twins-rankR.json``: both losses
    and every rank's second one."""
    m = build("sgd-host-bf16", 8)
    x, y, loss = m["x"], m["y"], m["loss"]
    points, labels = datasets.half_moons(POINTS, seed=3)
    ctx, fwd = Context.cpu().compile(train.forward(loss))
    ctx = train.init_params(ctx, loss)
    for p in loss.params:  # masters of this rank's own
        ctx = ctx.set_values(p, ctx.get_values(p) * (1 + comm.rank))
    ctx = ctx.set_values(x, points[:8]).set_values(y, datasets.one_hot(labels, 2)[:8])
    own = ctx.run(fwd).get_value(loss)
    dp = parallel.DataParallel(comm, loss, inputs=[x, y])
    ctx = dp.broadcast(ctx, [p.value for p in loss.params])
    shared = ctx.run(fwd).get_value(loss)
    (out / f"twins-rank{comm.rank}.json").write_text(json.dumps(
        {"own": own, "shared": shared, "everyone": comm.allgather(shared)}))


def trained_state(ctx: Context, state: list, scaler: Any, recipe: Any,
                  dp: Any = None) -> dict[str, Any]:
    """What a run ends with, to compare across runs: every state node's values and names, the
    scaler's and the recipe's counters. With ``dp``, read through ``dp.gather_state`` (a
    sharded optimizer's state whole)."""
    values = dp.gather_state(ctx, state) if dp is not None else \
        [np.asarray(ctx.get_values(n)) for n in state]
    return {
        "state": values,
        "state_names": checkpoint.node_names(state),
        "scale": scaler.scale_value(), "good_steps": scaler.good_steps,
        "applied": recipe.applied_steps, "skipped": recipe.skipped_steps,
        "windows": recipe.windows, "skipped_windows": recipe.skipped_windows,
    }


def save_result(path: Path, res: dict[str, Any]) -> None:
    arrays = {f"state{k}": a for k, a in enumerate(res["state"])}
    meta = {k: v for k, v in res.items() if k not in ("state", "losses")}
    np.savez(path, losses=res["losses"], meta=json.dumps(meta), **arrays)


def load_result(path: Path) -> dict[str, Any]:
    with np.load(path) as f:
        res = json.loads(str(f["meta"]))
        res["losses"] = f["losses"]
        res["state"] = [f[f"state{k}"] for k in range(len(res["state_names"]))]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["train", "refuse", "hang", "twins"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--comm", default="mpi")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "fake-cuda"])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--what", choices=["shards", "model", "zero"])
    ap.add_argument("--zero", action="store_true", help="shard the optimizer state (ZeRO-1)")
    ap.add_argument("--overlap", action="store_true", help="exchange in buckets, overlapped")
    args = ap.parse_args(argv)
    if args.cmd == "hang":  # for the harness: a job that never ends, and ignores SIGTERM
        comm = parallel.world("mpi")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (args.out / f"hang-rank{comm.rank}.pid").write_text(str(os.getpid()))
        comm.barrier()
        while True:
            time.sleep(1)
    comm = make_comm(args.comm)
    if args.cmd == "twins":
        broadcast_twins(comm, args.out)
        return 0
    if args.cmd == "refuse":
        # rank 1 differs: one row fewer (an unequal shard), a wider hidden layer, or it
        # shards the optimizer state
        odd = comm.rank == 1
        T.set_seed(0)
        x = T.term(np.zeros((16 - (odd and args.what == "shards"), 2)), label="x")
        y = T.term(np.zeros((16 - (odd and args.what == "shards"), 2)), label="y")
        logits, _ = nn_blocks.mlp(x, [16 + 8 * (odd and args.what == "model")], 2)
        loss = nn_blocks.softmax_cross_entropy(logits, y)
        dp = parallel.DataParallel(comm, loss, inputs=[x, y],
                                   shard_optimizer=odd and args.what == "zero")
        dp.setup(Context.cpu())  # raises on every rank
        return 0
    backend = "cuda" if args.backend == "fake-cuda" else args.backend
    for variant in args.variants.split(","):
        res = run(comm, variant, global_batch=args.global_batch, steps=args.steps,
                  ckpt=args.checkpoint, resume=args.resume, die_at=args.die_at,
                  backend=backend, zero=args.zero, overlap=args.overlap)
        if args.comm == "fake-nccl":
            import fake_nccl

            res["nccl_calls"] = fake_nccl.calls
            res["nccl_stream"] = comm.stream.ptr  # its own
            res["compute_stream"] = comm._follows.ptr  # the context's (DataParallel.setup)
        save_result(args.out / f"{args.tag}-{variant}-rank{comm.rank}.npz", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
