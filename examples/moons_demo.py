"""Train an f32 MLP on half-moons with plain SGD on the default (CPU) backend.

One routine holds the whole step (forward, backprop, SGD); each step has ``ocannl.loader``
write a fresh minibatch into the input tensors (``set_values``) and runs it. The points are
classified in one call of an evaluation routine (``ocannl.model``). Writes a
decision-boundary PNG when matplotlib is installed. Every flag is checked before any work: a
mistake is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from common import F32_MAX, ExampleParser, integer, output_path, real
from tqdm import tqdm

import ocannl.tensor as T
from ocannl import Context, datasets, nn_blocks, train
from ocannl.loader import Loader
from ocannl.model import Evaluation, Model, compile_eval

MAX_POINTS = 1_000_000


def build_parser() -> ExampleParser:
    ap = ExampleParser(description=__doc__)
    ap.add_argument("--points", type=integer(2, MAX_POINTS), default=1024,
                    help="training points")
    ap.add_argument("--batch", type=integer(1, MAX_POINTS), default=64,
                    help="batch size, at most --points")
    ap.add_argument("--epochs", type=integer(1, 10**9), default=40, help="passes over the points")
    ap.add_argument("--lr", type=real(0, F32_MAX, lo_open=True, f32=True), default=0.1,
                    help="learning rate (halved for the last quarter of the epochs)")
    ap.add_argument("--seed", type=integer(0, 2**63 - 1), default=0,
                    help="data, order and initialisation seed")
    ap.add_argument("--png", default="moons_demo.png",
                    help="where to write the decision-boundary plot (.png)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every one checked: a mistake exits with status 2 and one line on stderr."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.batch > args.points:
        ap.error(f"--batch {args.batch} is more than the {args.points} training points "
                 f"(--points)")
    problem = output_path(args.png, "--png")
    if problem is None and Path(args.png).suffix.lower() != ".png":
        problem = f"--png {args.png!r:.80}: the name must end in .png"
    if problem is not None:
        ap.error(problem)
    return args


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)

    T.set_seed(args.seed)
    points, labels = datasets.half_moons(args.points, seed=args.seed)
    targets = datasets.one_hot(labels, 2)
    x = T.term(label="x", batch_dims=[args.batch], output_dims=[2])
    y = T.term(label="y", batch_dims=[args.batch], output_dims=[2])
    # The model as a function of its input: built again (over the same parameters) to
    # classify any number of points in one call.
    model = Model(lambda inputs, *, train: nn_blocks.mlp(inputs, [16, 16])[0],
                  name="moons mlp")
    logits = model(x, train=True)
    loss = nn_blocks.softmax_cross_entropy(logits, y)
    lr = T.term(np.float32(args.lr), label="learning_rate")
    loader = Loader([points, targets], [x, y], batch=args.batch, seed=args.seed)

    ctx = train.init_params(Context.cpu(), loss)
    step = train.grad_update(loss) + train.sgd_update(loss, learning_rate=lr, momentum=0.9)
    ctx, step_routine = ctx.compile(step)

    batches = loader.steps_per_epoch
    halve_at = (3 * args.epochs // 4) * batches  # 0 with fewer than 2 epochs: never halved
    bar = tqdm(range(args.epochs * batches), desc="moons f32", file=sys.stdout)
    running = None
    for i in bar:
        # Halve the learning rate for the last quarter of training: no recompilation.
        if i == halve_at and halve_at > 0:
            ctx = ctx.set_values(lr, [args.lr / 2])
        ctx = loader.next(ctx).run(step_routine)
        value = float(ctx.get_values(loss))
        running = value if running is None else 0.9 * running + 0.1 * value
        bar.set_postfix(loss=f"{running:.4f}")

    evaluations: dict[int, tuple[T.Tensor, Evaluation]] = {}

    def classify(pts: np.ndarray) -> np.ndarray:
        """The class of each point, all in one call (an evaluation routine per count)."""
        nonlocal ctx
        if len(pts) not in evaluations:
            xs = T.term(label=f"x_{len(pts)}", batch_dims=[len(pts)], output_dims=[2])
            ctx, ev = compile_eval(ctx, model(xs, train=False))
            evaluations[len(pts)] = (xs, ev)
        xs, ev = evaluations[len(pts)]
        ctx, (out,) = ev.run(ctx, {xs: pts})
        return out.argmax(axis=1)

    accuracy = float((classify(points) == labels).mean())
    print(f"training accuracy: {accuracy:.2%} after {args.epochs} epochs")
    _plot(classify, points, labels, args.png)
    return accuracy


def _plot(classify, points: np.ndarray, labels: np.ndarray, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no decision-boundary plot")
        return
    xs = np.linspace(points[:, 0].min() - 0.5, points[:, 0].max() + 0.5, 120)
    ys = np.linspace(points[:, 1].min() - 0.5, points[:, 1].max() + 0.5, 120)
    gx, gy = np.meshgrid(xs, ys)
    grid = np.stack([gx.ravel(), gy.ravel()], axis=1).astype(np.float32)
    zone = classify(grid).reshape(gx.shape)
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.contourf(gx, gy, zone, alpha=0.3, cmap="coolwarm")
    ax.scatter(points[:, 0], points[:, 1], c=labels, s=6, cmap="coolwarm")
    ax.set_title("ocannl f32 MLP on half-moons")
    fig.savefig(path, dpi=100)
    print(f"decision boundary written to {Path(path).resolve()}")


if __name__ == "__main__":
    main()
