"""A LeNet-style convnet on scikit-learn's 8x8 handwritten digits, in mixed precision.

The model (``nn_blocks.lenet``: two 3x3 conv / relu / 2x2 max-pool stages, then a relu MLP)
reads f16 (or bf16) cast twins of its f32 master weights; Adam updates the masters. The
backprop is seeded with a dynamic loss scale and overflowing steps are skipped on the device
(the fused gate), the host sampling every ``--check-interval`` steps. The digits ship inside
scikit-learn (no download); 20% are held out, and the accuracy on them is printed at the end,
computed by an evaluation routine over all 360 at once (the same model built again over a
batch of 360: ``ocannl.model``). Training batches come from ``ocannl.loader.Loader``, whose
position travels in the checkpoint.

    python examples/digits_convnet.py                         # f16 twins, 700 steps
    python examples/digits_convnet.py --prec bf16
    python examples/digits_convnet.py --checkpoint digits.safetensors   # kill it, then
    python examples/digits_convnet.py --checkpoint digits.safetensors --resume
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    BACKENDS,
    F32_MAX,
    RESUME_HELP,
    ExampleParser,
    SkipReport,
    canonical,
    integer,
    make_context,
    output_path,
    real,
    recipe_extra,
    refuse_mpi_launch,
    restore_recipe,
    resume_problem,
    resuming,
    saved,
    twins_said,
)

import ocannl.tensor as T  # noqa: E402
from ocannl import Failure, checkpoint, mixed_prec, nn_blocks, optim, train  # noqa: E402
from ocannl.loader import Loader  # noqa: E402
from ocannl.model import Model, compile_eval  # noqa: E402

PROGRAM = "digits_convnet.py"
CLASSES = 10
# The settings a checkpoint was trained under (flag names): a resume must use the same. The
# step budget is not one: a resume may always run further.
CONFIG_KEYS = ("prec", "batch", "lr", "seed", "check-interval", "init-scale")


def build_parser() -> ExampleParser:
    ap = ExampleParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prec", choices=["f16", "bf16", "f32"], default="f16",
                    help="precision of the weights' cast twins (f32: no twins)")
    ap.add_argument("--steps", type=integer(1, 10**9), default=700, help="training steps")
    ap.add_argument("--batch", type=integer(1, 4096), default=64, help="batch size")
    ap.add_argument("--lr", type=real(0, F32_MAX, lo_open=True, f32=True), default=3e-3,
                    help="Adam's learning rate")
    ap.add_argument("--check-interval", type=integer(1, 2**24), default=16,
                    help="steps between two host reads of the skipped-step count")
    ap.add_argument("--init-scale", type=real(0, F32_MAX, lo_open=True, f32=True),
                    default=1024.0, help="initial loss scale")
    ap.add_argument("--seed", type=integer(0, 2**63 - 1), default=0,
                    help="data split, order and init seed")
    ap.add_argument("--checkpoint", type=Path, help="save the training state to this file")
    ap.add_argument("--checkpoint-every", type=integer(1), default=100,
                    help="steps between checkpoints (the training is the same at any value)")
    ap.add_argument("--resume", action="store_true", help=RESUME_HELP)
    ap.add_argument("--backend", choices=list(BACKENDS), default="auto",
                    help="auto: the GPU when CuPy sees one, else the CPU")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every one checked: a mistake exits with status 2 and one line on stderr,
    before anything is computed or written."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.resume and args.checkpoint is None:
        ap.error("--resume needs --checkpoint PATH")
    problem = output_path(args.checkpoint, "--checkpoint")
    if problem is not None:
        ap.error(problem)
    return args


def run_config(args: argparse.Namespace) -> dict[str, str]:
    return canonical({k: getattr(args, k.replace("-", "_")) for k in CONFIG_KEYS})


def load_digits(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Images (n, 8, 8, 1) scaled to [0, 1] and labels, split 80/20 by a seeded shuffle."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        sys.exit("error: this example needs scikit-learn (pip install -e '.[examples]')")
    d = sk_digits()
    images = (d.images / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    perm = np.random.default_rng(seed).permutation(len(images))
    cut = int(0.8 * len(images))
    tr, te = perm[:cut], perm[cut:]
    return images[tr], d.target[tr], images[te], d.target[te]


class Run:
    """The model, its training step, its loader and its held-out evaluation, compiled on one
    context: the evaluation graph is the same model built again over all 360 held-out images
    at once (``ocannl.model``), reading the training graph's parameter buffers."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits(args.seed)
        if args.batch > len(self.x_train):
            sys.exit(f"error: --batch {args.batch} is larger than the {len(self.x_train)} "
                     f"training images")
        ctx = make_context(args.backend)
        eye = np.eye(CLASSES, dtype=np.float32)
        T.set_seed(args.seed)
        self.x = T.term(np.zeros((args.batch, 8, 8, 1)), label="x", batch_dims=(args.batch,))
        self.y = T.term(np.zeros((args.batch, CLASSES)), label="y")

        def build(x: T.Tensor, *, train: bool) -> T.Tensor:
            def net():  # noqa: ANN202
                return nn_blocks.lenet(x, num_classes=CLASSES)

            if args.prec == "f32":
                return net()[0]
            return T.cast(mixed_prec.with_master_weights(prec=args.prec, f=net)[0], "f32")

        self.model = Model(build, name="lenet")
        self.logits = self.model(self.x, train=True)
        self.loss = nn_blocks.softmax_cross_entropy(self.logits, self.y)
        self.adam = optim.Adam(args.lr)
        self.scaler = mixed_prec.Loss_scaler.create(init_scale=args.init_scale)
        self.recipe = mixed_prec.gated_step(self.scaler, self.loss, self.adam,
                                            check_interval=args.check_interval)
        self.loader = Loader([self.x_train, eye[self.y_train]], [self.x, self.y],
                             batch=args.batch, seed=args.seed)
        ctx = train.init_params(ctx, self.loss)
        t0 = time.perf_counter()
        ctx = self.recipe.compile(ctx)
        self.x_eval = T.term(np.zeros((len(self.x_test), 8, 8, 1)), label="x_eval",
                             batch_dims=(len(self.x_test),))
        ctx, self.evaluation = compile_eval(ctx, self.model(self.x_eval, train=False))
        self.compile_s = time.perf_counter() - t0
        self.ctx = ctx
        self.state = checkpoint.training_state(self.loss, self.adam) + self.recipe.state_nodes()

    def accuracy(self) -> float:
        """The share of held-out digits classified right, all 360 in one call."""
        self.ctx, (logits,) = self.evaluation.run(self.ctx, {self.x_eval: self.x_test})
        return float(np.mean(np.argmax(logits, axis=-1) == self.y_test))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_mpi_launch(PROGRAM)
    config = run_config(args)
    resume = resuming(args)
    if resume:  # the checkpoint's settings first: another run's refuses before any work
        problem = resume_problem(args.checkpoint, PROGRAM, config, CONFIG_KEYS, args.steps)
        if problem is not None:
            sys.exit(f"error: cannot resume from {args.checkpoint}: {problem}")
    run = Run(args)
    recipe, scaler, loader, loss = run.recipe, run.scaler, run.loader, run.loss

    start = 0
    if resume:
        try:
            run.ctx, progress = checkpoint.load(args.checkpoint, run.ctx, run.state)
            run.ctx = restore_recipe(run.ctx, progress, scaler, recipe)
            loader.restore_state(saved(progress, "loader"))
        except (Failure, KeyError) as err:
            sys.exit(f"error: cannot resume from {args.checkpoint}: "
                     f"{type(err).__name__ + ' ' if isinstance(err, KeyError) else ''}{err}")
        start = progress.step
        print(f"resumed from {args.checkpoint} at step {start}", flush=True)

    def save(step: int) -> None:
        extra = {**recipe_extra(PROGRAM, config, scaler, recipe), "loader": loader.save_state()}
        checkpoint.save(args.checkpoint, run.ctx, run.state,
                        checkpoint.Progress(step=step, epoch=loader.epoch, extra=extra))

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    ctx = run.ctx
    skips = SkipReport(recipe)
    say = print if bar is None else bar.write
    for step in range(start, args.steps):
        ctx = recipe.step(loader.next(ctx))
        skips.say(step, say)
        if recipe.pending == 0 and bar is not None:  # a window's end: no extra sync
            bar.set_postfix(loss=f"{ctx.get_value(loss):.4f}", scale=f"{scaler.scale_value():g}")
        if bar is not None:
            bar.update(1)
        # A save reads the parameters and leaves the gate's window open: the scale changes
        # at the same steps whatever --checkpoint-every is (the checkpoint holds the window's
        # position and skip count: a resume closes it where this run would).
        if args.checkpoint is not None and (step + 1) % args.checkpoint_every == 0:
            run.ctx = ctx
            save(step + 1)
    if bar is not None:
        bar.close()
    run.ctx = ctx
    if args.checkpoint is not None and start < args.steps:
        save(args.steps)  # before the last window is sampled: a longer resume continues it
    run.ctx = ctx = recipe.flush(ctx)
    skips.say(args.steps - 1)
    # The last step's loss, whether or not a window (or a checkpoint) ended there.
    final_loss = ctx.get_value(loss) if start < args.steps else None

    accuracy = run.accuracy()
    print(f"backend {run.ctx.backend_name()}, {twins_said(args.prec)}, compile "
          f"{run.compile_s:.1f} s")
    ran = recipe.applied_steps + recipe.skipped_steps
    said = "" if final_loss is None else f"final loss {final_loss:.4f}, "
    print(f"{said}loss scale {scaler.scale_value():g}, skipped steps {recipe.skipped_steps} of "
          f"{ran}")
    print(f"accuracy: {100.0 * accuracy:.2f}% on {len(run.x_test)} held-out digits", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
