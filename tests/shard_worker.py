"""The training runs of tests/test_parallel_shards.py: a global batch cut into a fixed number
of shards, computed by however many ranks, summed in the shard tree's order. Run under
``mpiexec -n N python -m mpi4py`` (one process per rank) or imported (one rank in the test's
process)::

    python -m mpi4py tests/shard_worker.py --out DIR --tag T [--shards 4] [--variants ...]
        [--steps 8] [--save-at 4 --checkpoint F] [--resume F]

A *variant* names the optimizer, the gate, the model's precision and what else is on:

- ``sgd-host-f32``: SGD with momentum, the host gate (``scaled_step``);
- ``adamw-fused-f16-clip``: AdamW over f16 cast twins of f32 masters, the fused gate
  (``gated_step``, windows of 4), gradients clipped by norm;
- ``amsgrad-host-f32-acc2``: Adam with amsgrad, the host gate, clipped by value, two
  micro-batches accumulated per optimizer step;
- ``dropbn-host-f32``: an MLP with batch norm (per-shard statistics, running statistics
  averaged through the tree) and dropout (masks keyed by the global row), SGD, host gate;
- ``syncbn-host-f32``: the same with synced batch norm (statistics over the global batch,
  exchanged inside the forward and backward code).

Every run has a dynamic loss scale growing every 3 good steps and an infinity injected into
global row ``INJECT_ROW`` of step ``INJECT_STEP`` (so every rank count skips that step). The
data come from ``ocannl.loader.Loader`` over half-moons (the loader's position is in the
checkpoint). Each rank writes ``OUT/TAG-VARIANT-rankR.npz``: every state node, the scaler and
recipe counters, the global loss of every step and the loader's position.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from parallel_worker import (  # noqa: E402,F401 - the same files and records
    load_result,
    save_result,
    trained_state,
)

import ocannl.tensor as T  # noqa: E402
from ocannl import (  # noqa: E402
    Context,
    checkpoint,
    clipping,
    datasets,
    loader,
    mixed_prec,
    nn_blocks,
    optim,
    parallel,
    train,
)

VARIANTS = ("sgd-host-f32", "adamw-fused-f16-clip", "amsgrad-host-f32-acc2", "dropbn-host-f32",
            "syncbn-host-f32")
POINTS = 512
SHARD_ROWS = 8
INJECT_STEP = 3  # the optimizer step whose batch holds an infinity
INJECT_ROW = 11  # its global row (in shard 1 of 4)
BUCKET_BYTES = 64  # with --overlap: about a parameter a bucket (the models are small)


def build(variant: str, rows: int) -> dict[str, Any]:
    """The model of a variant over a shard of ``rows`` rows."""
    name, gate, prec, *rest = variant.split("-")
    T.set_seed(0)
    x = T.term(np.zeros((rows, 2)), label="x", prec=prec)
    y = T.term(np.zeros((rows, 2)), label="y")
    rng = None
    if name in ("dropbn", "syncbn"):
        rng = T.Rng(5)
        h, _ = nn_blocks.mlp(x, [16], 16, label="body")
        h, _ = nn_blocks.batch_norm(h, train=True, label="bn", sync=name == "syncbn")
        h = nn_blocks.dropout(T.relu(h), rate=0.25, train=True, rng=rng)
        logits, _ = nn_blocks.mlp(h, [], 2, label="head")
    elif prec == "f32":
        logits, _ = nn_blocks.mlp(x, [16], 2)
    else:
        logits, _ = mixed_prec.with_master_weights(
            prec=prec, f=lambda: nn_blocks.mlp(x, [16], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    opt: optim.Optimizer
    if name in ("sgd", "dropbn", "syncbn"):
        opt = optim.SGD(0.1, momentum=0.9)
    elif name == "adamw":
        opt = optim.AdamW(0.01, weight_decay=0.01)
    else:
        opt = optim.Adam(0.01, amsgrad=True)
    clip = None
    if "clip" in rest:
        clip = clipping.ClipNorm(1.0)
    elif name == "amsgrad":
        clip = clipping.ClipValue(0.5)
    accumulate = 2 if "acc2" in rest else 1
    scaler = mixed_prec.Loss_scaler.create(init_scale=2.0**19, growth_interval=3)
    return {"x": x, "y": y, "loss": loss, "opt": opt, "scaler": scaler, "gate": gate,
            "clip": clip, "accumulate": accumulate, "rng": rng}


def run(comm: Any, variant: str, *, shards: int = 4, steps: int = 8,
        save_at: int | None = None, ckpt: Path | None = None, resume: Path | None = None,
        zero: bool = False, overlap: bool = False, fixed_order: bool = True
        ) -> dict[str, Any]:
    """Train ``variant`` for ``steps`` optimizer steps of ``shards * SHARD_ROWS`` rows over
    ``comm`` (``zero``: the optimizer state sharded over the ranks; ``overlap``: the exchange
    in buckets of about a parameter each, started as the backward code writes them); returns
    this rank's result, with the optimizer state's bytes this rank holds. ``fixed_order=False``:
    one shard per rank, summed by the communicator's allreduce."""
    m = build(variant, SHARD_ROWS)
    x, y, loss, opt, scaler = m["x"], m["y"], m["loss"], m["opt"], m["scaler"]
    dp = parallel.DataParallel(comm, loss, inputs=[x, y], shards=shards, shard_optimizer=zero,
                               overlap=overlap, bucket_bytes=BUCKET_BYTES,
                               fixed_order=fixed_order)
    ctx = dp.setup(Context.cpu())
    kw = {"reducer": dp, "clip": m["clip"], "accumulate": m["accumulate"]}
    if m["gate"] == "host":
        recipe: Any = mixed_prec.scaled_step(scaler, loss, opt, **kw)
    else:
        recipe = mixed_prec.gated_step(scaler, loss, opt, check_interval=4, **kw)
    ctx = dp.compile(ctx, recipe)
    ctx = train.init_params(ctx, loss)
    state = checkpoint.training_state(loss, opt) + recipe.state_nodes() + T.buffers(loss)
    ctx = dp.broadcast(ctx, state)
    points, labels = datasets.half_moons(POINTS, seed=3)
    targets = datasets.one_hot(labels, 2)
    batch = shards * SHARD_ROWS
    # The infinity goes into the data set's row that the injected step's batch holds at
    # INJECT_ROW (epoch 0's order, as the loader draws it).
    order = loader.Loader([points, targets], [x, y], batch=batch, seed=7,
                          parallel=dp).permutation(0)
    points = points.copy()
    points[order[INJECT_STEP * m["accumulate"] * batch + INJECT_ROW], 0] = np.inf
    data = loader.Loader([points, targets], [x, y], batch=batch, seed=7, parallel=dp)
    start = 0
    if resume is not None:
        ctx, progress = dp.load(resume, ctx, state)
        ctx = scaler.restore_state(ctx, progress.extra["loss_scaler"])
        recipe.restore_state(progress.extra["recipe"])
        data.restore_state(progress.extra["loader"])
        start = progress.step
    losses = np.full(steps, np.nan)
    for step in range(start, steps):
        for _ in range(m["accumulate"]):
            ctx = data.next(ctx)
            ctx = recipe.step(ctx)
        losses[step] = dp.global_loss()
        if ckpt is not None and save_at == step + 1:
            extra = {"loss_scaler": scaler.save_state(), "recipe": recipe.save_state(),
                     "loader": data.save_state()}
            dp.save(ckpt, ctx, state, checkpoint.Progress(step=step + 1, extra=extra))
    ctx = recipe.flush(ctx)
    dp.check_equal(ctx, state)  # the ranks agree, or every rank raises
    held = [n for p in loss.params for n in opt.state_of(p).values()] if not zero else \
        [n for q in dp.optimizer_shard.parts for n in opt.part_state(q).values()]
    return {
        **trained_state(ctx, state, scaler, recipe, dp),
        "state_bytes": sum(ctx.mem(n) for n in held),
        "losses": losses, "start": start, "loader": data.save_state(),
        "size": comm.size, "shards": shards, "shared_memory": dp.shared_memory,
        "shared_buckets": _shared_buckets(dp),
    }


def _shared_buckets(dp: Any) -> int:
    """How many buckets this rank has summed in shared memory (overlap, ranks on one node)."""
    return 0 if dp._bucket_sums is None else dp._bucket_sums.summed


def run_plain(comm: Any, *, shards: int = 4, steps: int = 6, overlap: bool = False,
              zero: bool = False, backend: str = "cpu") -> dict[str, Any]:
    """SGD with momentum and no recipe (``train.grad_update`` and ``optimizer.update``
    compiled by the reducer), the update run by ``run_and_reduce``: with ``overlap``, cut at
    the buckets and in ``dp.update_order``, each part waiting only for the buckets it reads.
    ``zero``: the optimizer state sharded (ZeRO-1); ``backend``: ``cpu`` or ``cuda``. Returns
    the parameters' and momenta's values (whole), the global losses and what each of the
    update's parts reads."""
    m = build("sgd-host-f32", SHARD_ROWS)
    x, y, loss, opt = m["x"], m["y"], m["loss"], m["opt"]
    dp = parallel.DataParallel(comm, loss, inputs=[x, y], shards=shards, overlap=overlap,
                               bucket_bytes=BUCKET_BYTES, shard_optimizer=zero)
    ctx = dp.setup(Context.cuda() if backend == "cuda" else Context.cpu())
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss))
    dp.use_routines(grads)
    ctx, update = dp.compile_update(ctx, opt.update(loss, grad_unscale=dp.grad_unscale(),
                                                    shard=dp.optimizer_shard,
                                                    order=dp.update_order))
    ctx = train.init_params(ctx, loss)
    state = checkpoint.training_state(loss, opt)
    ctx = dp.broadcast(ctx, state)
    points, labels = datasets.half_moons(POINTS, seed=3)
    targets = datasets.one_hot(labels, 2)
    batch = shards * SHARD_ROWS
    losses = []
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        dp.set_batch(ctx, points[rows], targets[rows])
        ctx = dp.after_update(dp.run_and_reduce(ctx, grads, update=update))
        losses.append(dp.global_loss())
    plan = dp._update_splits.get(update, [])
    return {"state_names": [n.name for n in state],
            "state": [np.array(a, copy=True) for a in dp.gather_state(ctx, state)],
            "losses": np.array(losses), "parts_read": [reads for _, reads in plan],
            "buckets": len(dp._buckets), "shared_buckets": _shared_buckets(dp)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-at", type=int)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--zero", action="store_true", help="shard the optimizer state (ZeRO-1)")
    ap.add_argument("--overlap", action="store_true", help="exchange in buckets, overlapped")
    ap.add_argument("--order-off", action="store_true", help="MPI's allreduce, a shard a rank")
    ap.add_argument("--plain", action="store_true", help="run_plain, no recipe")
    args = ap.parse_args(argv)
    comm = parallel.world("mpi")
    if args.plain:
        res = run_plain(comm, shards=args.shards, steps=args.steps, overlap=args.overlap,
                        zero=args.zero)
        save_result(args.out / f"{args.tag}-plain-rank{comm.rank}.npz", res)
        return 0
    for variant in args.variants.split(","):
        ck = None if args.checkpoint is None else args.checkpoint.with_suffix(
            f".{variant}.safetensors")
        resume = None if args.resume is None else args.resume.with_suffix(
            f".{variant}.safetensors")
        res = run(comm, variant, shards=args.shards, steps=args.steps, save_at=args.save_at,
                  ckpt=ck, resume=resume, zero=args.zero, overlap=args.overlap,
                  fixed_order=not args.order_off)
        save_result(args.out / f"{args.tag}-{variant}-rank{comm.rank}.npz", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
