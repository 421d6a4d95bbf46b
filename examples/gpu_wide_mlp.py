"""Train a wide MLP on synthetic Gaussian classes: a model big enough to be worth a GPU.

    python examples/gpu_wide_mlp.py                  # the GPU if CuPy sees one, else the CPU
    python examples/gpu_wide_mlp.py --backend cuda   # the GPU, or an error saying why not
    python examples/gpu_wide_mlp.py --prec bf16      # f32 master weights, bf16 compute
    python examples/gpu_wide_mlp.py --backend cpu --steps 50

The model is 256 -> 1024 -> 1024 -> 10 (relu, softmax cross-entropy, SGD with momentum) over
minibatches of 512 drawn from 32768 points. Each step is one compiled routine; a minibatch
reaches it through ``set_values`` (copied into the same device buffers, no recompilation). At
f16 / bf16 the model reads f32 master weights through cast twins and the optimizer step is
gated on the device by the gradient checksum (a non-finite gradient skips the step); f16 also
scales the loss by a fixed 1024, unscaling the gradients before the optimizer.
Without a usable GPU, ``--backend auto`` says why and trains on the CPU; ``--backend cuda``
exits with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ocannl.tensor as T  # noqa: E402
from ocannl import Context, datasets, train  # noqa: E402
from ocannl.ir.assignments import Get, apply  # noqa: E402
from ocannl.nn_blocks import softmax_cross_entropy  # noqa: E402
from ocannl.tensor.tensor import Tensor  # noqa: E402


def make_context(backend: str) -> Context:
    """The requested backend. ``auto``: CUDA when usable, else the CPU with the reason printed;
    ``cuda``: CUDA or an exit with the reason (never a silent CPU run)."""
    if backend == "cpu":
        return Context.cpu()
    try:
        return Context.cuda()
    except Exception as err:  # noqa: BLE001 - any reason the GPU is unusable
        if backend == "cuda":
            sys.exit(f"error: --backend cuda: no usable GPU: {err}")
        print(f"No usable GPU, training on the CPU instead.\n  reason: {err}", flush=True)
        return Context.cpu()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Wide MLP on synthetic data, GPU when available")
    ap.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--prec", choices=["f32", "bf16", "f16"], default="f32")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024])
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--points", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    ctx = make_context(args.backend)
    print(f"backend: {ctx.backend_name()}, precision: {args.prec}", flush=True)
    xs, labels = datasets.gaussian_classes(args.points, args.dim, args.classes, seed=args.seed)
    xs = xs / np.sqrt(args.dim)
    onehot = datasets.one_hot(labels, args.classes)
    rng = np.random.default_rng(args.seed)

    T.set_seed(args.seed)
    x = T.term(xs[: args.batch], label="x", prec=args.prec)
    y = T.term(onehot[: args.batch], label="y", prec=args.prec)
    lr = T.term(np.array(args.lr), label="lr")
    h: Tensor = x
    # Each weight's input row comes from what it multiplies, each bias's input row is empty,
    # and the last layer's width comes from the targets (through the loss).
    widths: list[int | None] = [*args.hidden, None]
    for k, width in enumerate(widths, start=1):
        out = None if width is None else [width]
        w = T.param(f"w{k}", output_dims=out)
        b = T.param(f"b{k}", output_dims=out, init="zeros")
        if args.prec != "f32":
            w, b = T.cast(w, args.prec), T.cast(b, args.prec)
        h = w @ h + b
        if k < len(widths):
            h = T.relu(h)
    logits = h
    loss = softmax_cross_entropy(logits, y)

    if args.prec == "f32":
        step = train.grad_update(loss) + train.sgd_update(loss, learning_rate=lr, momentum=0.9)
        flag = None
    else:
        scale = T.term(np.array(1024.0 if args.prec == "f16" else 1.0), label="loss_scale")
        unscale = T.term(np.array(1 / 1024.0 if args.prec == "f16" else 1.0), label="unscale")
        flag, checksum = train.grad_checksum(loss)
        gate = apply("isfinite", Get(flag.value, ()))
        step = (train.grad_update(loss, loss_scale=scale) + checksum
                + train.sgd_update(loss, learning_rate=lr, momentum=0.9, grad_unscale=unscale,
                                   gate=gate))

    ctx = train.init_params(ctx, loss)
    t0 = time.perf_counter()
    ctx, routine = ctx.compile(step)
    ctx, fwd = ctx.compile(train.forward(logits))
    print(f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)

    def batch() -> None:
        idx = rng.integers(0, args.points, args.batch)
        ctx.set_values(x, xs[idx])
        ctx.set_values(y, onehot[idx])

    skipped = 0
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        batch()
        ctx.run(routine)
        if flag is not None and i % 25 == 0 and not np.isfinite(ctx.get_value(flag)):
            skipped += 1
        if i % max(1, args.steps // 10) == 0 or i == 1:
            print(f"step {i:5d}  loss {ctx.get_value(loss):.4f}  "
                  f"({(time.perf_counter() - t0) / i * 1e3:.2f} ms/step)", flush=True)
    total = time.perf_counter() - t0

    correct = 0
    evals = 8
    for _ in range(evals):
        idx = rng.integers(0, args.points, args.batch)
        ctx.set_values(x, xs[idx])
        ctx.run(fwd)
        correct += int((ctx.get_values(logits).argmax(-1) == labels[idx]).sum())
    acc = correct / (evals * args.batch)
    print(f"done: {args.steps} steps in {total:.1f} s ({total / args.steps * 1e3:.2f} ms/step), "
          f"accuracy {acc:.3f}" + (f", sampled skipped steps {skipped}" if flag else ""))
    return 0 if acc > 1.5 / args.classes else 1


if __name__ == "__main__":
    raise SystemExit(main())
