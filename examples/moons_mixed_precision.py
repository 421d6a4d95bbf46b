"""Mixed-precision training on half-moons: f16 cast twins of f32 masters, dynamic loss scaling.

The model (a 2-16-16-2 relu MLP) reads f16 twins of its f32 master weights, and computes its
activations and their gradients in f16; the softmax cross-entropy runs in f32, as under
torch's autocast. The backprop is seeded with a dynamic loss scale (``Loss_scaler``), and a
step whose gradients overflow is skipped, either by the host after every step
(``--gate host``) or on the device inside one fused routine, the host sampling a skip count
every ``--check-interval`` steps (``--gate fused``). The optimizer updating the f32 masters is
SGD with momentum (``--optimizer sgd``), Adam or AdamW.

    python examples/moons_mixed_precision.py                        # fused gate, CPU or GPU
    python examples/moons_mixed_precision.py --gate host --steps 800
    python examples/moons_mixed_precision.py --checkpoint run.safetensors   # kill it, then
    python examples/moons_mixed_precision.py --checkpoint run.safetensors --resume

``--inject-nonfinite 200,201`` corrupts the input batch of those steps with an infinity, to
watch the gate skip them and the scale back off. With ``--checkpoint`` the state is saved every
``--checkpoint-every`` steps and at the end; ``--resume`` continues from it and ends exactly as
an uninterrupted run would. A PNG of the loss and the scale is written when matplotlib is there.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

import numpy as np

import ocannl.tensor as T
from ocannl import Context, Failure, checkpoint, datasets, mixed_prec, nn_blocks, optim, train

TRAIN_POINTS, TEST_POINTS = 512, 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gate", choices=["host", "fused"], default="fused",
                    help="skip overflowing steps on the host after each step, or on the device "
                         "in one fused routine (default: fused)")
    ap.add_argument("--check-interval", type=int, default=16,
                    help="fused gate: steps between two host reads of the overflow flag")
    ap.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    ap.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd",
                    help="the optimizer updating the f32 masters (default sgd)")
    ap.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    ap.add_argument("--init-scale", type=float, default=65536.0, help="initial loss scale")
    ap.add_argument("--growth-interval", type=int, default=50,
                    help="good steps before the scale grows (torch's default is 2000)")
    ap.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    ap.add_argument("--checkpoint", type=Path, help="save the training state to this file")
    ap.add_argument("--checkpoint-every", type=int, default=100,
                    help="steps between checkpoints (default 100)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from --checkpoint when it exists")
    ap.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: the GPU when CuPy sees one, else the CPU")
    ap.add_argument("--inject-nonfinite", default="",
                    help="comma-separated steps whose input batch gets an infinity")
    ap.add_argument("--plot", type=Path, default=Path("moons_mixed_precision.png"),
                    help="where to write the loss and scale plot")
    ap.add_argument("--no-plot", action="store_true", help="do not write the plot")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    for name in ("check_interval", "steps", "batch", "checkpoint_every", "growth_interval"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.resume and args.checkpoint is None:
        ap.error("--resume needs --checkpoint PATH")
    if args.checkpoint is not None and not args.checkpoint.absolute().parent.is_dir():
        ap.error(f"--checkpoint {args.checkpoint}: the folder {args.checkpoint.parent} does not "
                 f"exist")
    try:
        args.inject = {int(s) for s in args.inject_nonfinite.split(",") if s.strip()}
    except ValueError:
        ap.error(f"--inject-nonfinite expects comma-separated step numbers, got "
                 f"{args.inject_nonfinite!r}")
    return args


def make_context(backend: str) -> Context:
    if backend == "cpu":
        return Context.cpu()
    if backend == "auto":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = Context.auto()
        for w in caught:
            print(f"note: {w.message}", file=sys.stderr)
        return ctx
    try:
        return Context.cuda()
    except Exception as err:  # noqa: BLE001 - every reason means: no usable GPU here
        sys.exit(f"error: --backend cuda needs an NVIDIA GPU usable through CuPy, and none is "
                 f"usable here ({type(err).__name__}: {err}). Use --backend cpu or auto.")


def batch_indices(step: int, n: int, batch: int, seed: int) -> np.ndarray:
    """The points of a step: a fresh permutation per epoch, a function of the step alone (so a
    resumed run sees the batches the uninterrupted one would have)."""
    per_epoch = n // batch
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = make_context(args.backend)
    points, labels = datasets.half_moons(TRAIN_POINTS, seed=args.seed)
    test_points, test_labels = datasets.half_moons(TEST_POINTS, seed=args.seed + 1)
    targets = datasets.one_hot(labels, 2)

    # The model: f16 input, f16 twins of f32 masters, f32 loss.
    T.set_seed(args.seed)
    x = T.term(np.zeros((args.batch, 2)), label="x", prec="f16")
    y = T.term(np.zeros((args.batch, 2)), label="y")
    logits, _ = mixed_prec.with_master_weights(
        prec="f16", f=lambda: nn_blocks.mlp(x, [16, 16], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)

    scaler = mixed_prec.Loss_scaler.create(init_scale=args.init_scale,
                                           growth_interval=args.growth_interval)
    if args.optimizer == "sgd":
        opt: optim.Optimizer = optim.SGD(args.lr, momentum=args.momentum)
    else:
        opt = {"adam": optim.Adam, "adamw": optim.AdamW}[args.optimizer](args.lr)
    ctx = train.init_params(ctx, loss)
    t0 = time.perf_counter()
    recipe: mixed_prec.Recipe
    if args.gate == "fused":
        recipe = mixed_prec.gated_step(scaler, loss, opt, check_interval=args.check_interval)
    else:
        recipe = mixed_prec.scaled_step(scaler, loss, opt)
    ctx = recipe.compile(ctx)
    state = checkpoint.training_state(loss, opt) + recipe.state_nodes()
    ctx, forward_routine = ctx.compile(train.forward(logits))
    compile_s = time.perf_counter() - t0

    start = 0
    if args.resume and args.checkpoint.exists():
        try:
            ctx, progress = checkpoint.load(args.checkpoint, ctx, state)
            for flag in ("gate", "optimizer"):
                saved, mine = progress.extra.get(flag), getattr(args, flag)
                if saved != mine:
                    raise Failure(f"it was written with --{flag} {saved}, not --{flag} {mine}")
            ctx = scaler.restore_state(ctx, progress.extra["loss_scaler"])
            recipe.restore_state(progress.extra["recipe"])
        except (Failure, KeyError) as err:
            sys.exit(f"error: cannot resume from {args.checkpoint}: {err}")
        start = progress.step
        print(f"resumed from {args.checkpoint} at step {start}", flush=True)
    elif args.resume:
        print(f"no checkpoint at {args.checkpoint} yet: starting from step 0", flush=True)

    def save(step: int) -> None:
        extra = {"gate": args.gate, "optimizer": args.optimizer,
                 "loss_scaler": scaler.save_state(), "recipe": recipe.save_state()}
        progress = checkpoint.Progress(step=step, epoch=step // (TRAIN_POINTS // args.batch),
                                       extra=extra)
        checkpoint.save(args.checkpoint, ctx, state, progress)
        print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    # (step, loss, scale) samples. The fused recipe's point is not to wait for the device every
    # step, so it reads the loss only where it reads the overflow flag anyway: at window ends.
    history: list[tuple[int, float, float]] = []
    for step in range(start, args.steps):
        idx = batch_indices(step, TRAIN_POINTS, args.batch, args.seed)
        xb = points[idx].copy()
        if step in args.inject:
            xb[0, 0] = np.inf
        ctx = ctx.set_values(x, xb)
        ctx = ctx.set_values(y, targets[idx])
        scale = scaler.scale_value()
        ctx = recipe.step(ctx)
        if recipe.pending == 0:  # the host sampled this step: reading the loss costs no sync
            history.append((step, ctx.get_value(loss), scale))
        if args.checkpoint is not None and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                last = history[-1][1] if history else math.nan
                bar.set_postfix(loss=f"{last:.4f}", scale=f"{scale:g}")
    if bar is not None:
        bar.close()
    ran = start < args.steps
    if args.checkpoint is not None and ran and args.steps % args.checkpoint_every != 0:
        save(args.steps)

    correct = 0
    for k in range(0, TEST_POINTS - args.batch + 1, args.batch):
        ctx = ctx.set_values(x, test_points[k:k + args.batch])
        ctx = ctx.run(forward_routine)
        pred = np.argmax(ctx.get_values(logits).astype(np.float32), axis=-1)
        correct += int(np.sum(pred == test_labels[k:k + args.batch]))
    evaluated = (TEST_POINTS // args.batch) * args.batch
    # The host gate's windows are single steps.
    what = "windows" if args.gate == "fused" else "steps"
    print(f"backend {ctx.backend_name()}, gate {args.gate}, compile {compile_s:.1f} s")
    finite = [v for _, v, _ in history if math.isfinite(v)]
    if finite:
        print(f"final loss {finite[-1]:.4g}, loss scale {scaler.scale_value():g} "
              f"(good steps {scaler.good_steps}), skipped {what}: {recipe.skipped_windows}")
    print(f"accuracy: {100.0 * correct / evaluated:.2f}% on {evaluated} held-out points",
          flush=True)
    if not args.no_plot and history:
        write_plot(args.plot, history)
    return 0


def write_plot(path: Path, history: list[tuple[int, float, float]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    steps, losses, scales = (np.array(col) for col in zip(*history, strict=True))
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    ax1.plot(steps, losses, lw=1)
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax2.step(steps, scales, where="post", lw=1, color="tab:orange")
    ax2.set_yscale("log", base=2)
    ax2.set_ylabel("loss scale")
    ax2.set_xlabel("step")
    fig.suptitle("half-moons, f16 twins of f32 masters, dynamic loss scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
