"""What synced batch norm costs a data-parallel step against per-shard statistics, on one rank
(``DataParallel(SingleProcess)``), in one process, steps interleaved.

    .venv/bin/python benchmarks/ab_synced_bn.py [--rounds 20] [--steps 20] [--shards 1 4]

The model: 256 features, two 512-wide layers each followed by batch norm and ReLU, a 10-class
head; a global batch of 256 rows, SGD. With 1 shard the synced step runs its routine cut at
the statistics' sums (3 cuts a layer) with nothing to exchange; with 4 shards on one rank it
also runs each part on each shard in turn, saving and restoring what a shard reads again.
Per round each side runs ``--steps`` steps, timed one by one after one untimed step, the side
going first alternating by round. Printed per shard count: each side's p50 step, the p50 of
the rounds' ratios (synced / per-shard) and their spread (p10-p90).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ocannl.tensor as T  # noqa: E402
from benchmarks.interleaved import interleaved  # noqa: E402
from ocannl import Context, nn_blocks, optim, parallel, train  # noqa: E402

BATCH, FEATURES, WIDTH, CLASSES = 256, 256, 512, 10


def step_of(shards: int, sync: bool, batch: int = BATCH) -> Callable[[], None]:
    """One training step of the model, ``batch`` rows cut into ``shards`` shards."""
    T.set_seed(0)
    rows = batch // shards
    x = T.term(np.zeros((rows, FEATURES)), label="x")
    y = T.term(np.zeros((rows, CLASSES)), label="y")
    h = x
    for k in range(2):
        h, _ = nn_blocks.mlp(h, [], WIDTH, label=f"layer{k}")
        h, _ = nn_blocks.batch_norm(h, train=True, label=f"bn{k}", sync=sync)
        h = T.relu(h)
    logits, _ = nn_blocks.mlp(h, [], CLASSES, label="head")
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    dp = parallel.DataParallel(parallel.SingleProcess(), loss, inputs=[x, y], shards=shards)
    ctx = dp.setup(Context.cpu())
    ctx, grads = dp.compile_gradients(ctx, train.grad_update(loss))
    dp.use_routines(grads)
    ctx, update = ctx.compile(optim.SGD(0.01).update(loss, grad_unscale=dp.grad_unscale()))
    ctx = train.init_params(ctx, loss)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(batch, FEATURES))
    ys = np.eye(CLASSES)[rng.integers(0, CLASSES, batch)]

    def step() -> None:
        dp.set_batch(ctx, xs, ys)
        dp.run_and_reduce(ctx, grads)
        ctx.run(update)

    return step


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side and round")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args(argv)
    print(f"{args.rounds} rounds x {args.steps} steps a side (a shared machine: noisy)",
          flush=True)
    out = []
    for shards in args.shards:
        sides = [step_of(shards, sync) for sync in (False, True)]
        times, ratios = interleaved(sides, args.rounds, args.steps)
        deciles = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
        row = {"shards": shards, "per_shard_s": statistics.median(times[0]),
               "synced_s": statistics.median(times[1]), "ratio": statistics.median(ratios),
               "p10": deciles[0], "p90": deciles[-1]}
        out.append(row)
        print(f"{shards} shard(s) on one rank: per-shard {row['per_shard_s'] * 1e3:.2f} ms, "
              f"synced {row['synced_s'] * 1e3:.2f} ms, synced / per-shard {row['ratio']:.3f} "
              f"(p10-p90 {row['p10']:.3f}-{row['p90']:.3f})", flush=True)
    return out


if __name__ == "__main__":
    main()
