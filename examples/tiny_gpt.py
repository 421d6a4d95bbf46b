"""A tiny character-level GPT trained on the Python standard library's own source, in mixed
precision.

The model (``nn_blocks.gpt``: token and learned position embeddings, pre-norm decoder blocks
with causal self-attention, a final layer norm and a linear head to one logit per character)
reads f16 (or bf16) cast twins of its f32 master weights; Adam updates the masters. The
backprop is seeded with a dynamic loss scale and overflowing steps are skipped on the device
(the fused gate), the host sampling every ``--check-interval`` steps.

The text is what every Python installation has: the ``.py`` files at the top of
``sysconfig.get_paths()["stdlib"]``, in sorted order, read until ``--corpus-chars``
characters; the last 10% is held out for validation. Characters are printable ASCII plus the
newline; any other character is one "unknown" token. The training windows of one epoch are a
fixed-size, non-overlapping tiling of the training text, in an order drawn from ``--seed``.
Batches come from ``ocannl.loader.Loader``, whose position travels in the checkpoint. Train
and validation losses are the mean over fixed windows of each part, each set's logits computed
in one call of an evaluation routine: the model built again over those windows, sharing the
training graph's parameters (``ocannl.model``). At the end, text is sampled from a prompt on
the host from the logits of the model built over one sequence (greedy with
``--temperature 0``).

    python examples/tiny_gpt.py                      # f16 twins, 2000 steps
    python examples/tiny_gpt.py --prec bf16 --compare-torch
    python examples/tiny_gpt.py --checkpoint gpt.safetensors         # kill it, then
    python examples/tiny_gpt.py --checkpoint gpt.safetensors --resume

``--compare-torch`` also trains the same architecture in PyTorch (f32) from the same initial
weights on the same batches, and prints both validation losses and their relative difference:
with the defaults (f16 twins, 2000 steps) 1.8059 against 1.8040, 0.11% (measured on a 2-core
AMD EPYC at commit 2ae35bb, when evaluations still closed the loss-scale window early; the
README's "Reproducibility" says what the bits depend on). Evaluating and saving read the
parameters only: the training is the same at any --eval-every and --checkpoint-every.
A checkpoint records the run's settings (and the corpus's digest); a resume under other ones
stops, naming each. The step budget may always grow.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import sysconfig
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
    batch_indices,
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
from ocannl import (  # noqa: E402
    Context,
    Failure,
    checkpoint,
    mixed_prec,
    nn_blocks,
    optim,
    schedules,
    train,
)
from ocannl.clipping import ClipNorm  # noqa: E402
from ocannl.loader import Loader  # noqa: E402
from ocannl.model import Evaluation, Model, compile_eval  # noqa: E402

# The vocabulary: 0 stands for any character not listed, then the newline and printable ASCII.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB = 1 + len(CHARS)
UNKNOWN = "\N{REPLACEMENT CHARACTER}"
_CODE = {c: k + 1 for k, c in enumerate(CHARS)}

PROGRAM = "tiny_gpt.py"
# The settings a checkpoint was trained under (flag names): a resume must use the same.
CONFIG_KEYS = ("prec", "context", "d-model", "heads", "layers", "d-ff", "batch", "lr",
               "warmup-steps", "cosine-steps", "clip-norm", "seed", "check-interval",
               "init-scale", "corpus-chars", "corpus-sha256")
# A warm-up starts from this fraction of the learning rate.
WARMUP_FROM = 0.01


def build_parser() -> ExampleParser:
    ap = ExampleParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prec", choices=["f16", "bf16", "f32"], default="f16",
                    help="precision of the weights' cast twins (f32: no twins)")
    ap.add_argument("--steps", type=integer(1, 10**9), default=2000, help="training steps")
    ap.add_argument("--batch", type=integer(1, 4096), default=16,
                    help="sequences per batch")
    ap.add_argument("--context", type=integer(2, 1024), default=32,
                    help="characters per sequence")
    ap.add_argument("--d-model", type=integer(1, 4096), default=32, help="embedding width")
    ap.add_argument("--heads", type=integer(1, 64), default=4, help="attention heads")
    ap.add_argument("--layers", type=integer(1, 64), default=2, help="decoder blocks")
    ap.add_argument("--d-ff", type=integer(1, 16384), default=None,
                    help="hidden width of each block's MLP (none: 4 * --d-model)")
    ap.add_argument("--lr", type=real(0, F32_MAX, lo_open=True, f32=True), default=3e-3,
                    help="Adam's learning rate")
    ap.add_argument("--warmup-steps", type=integer(0, 2**24), default=0,
                    help="linear warm-up of the learning rate from 1%% of --lr over this many "
                         "steps (0: none)")
    ap.add_argument("--cosine-steps", type=integer(0, 2**24), default=0,
                    help="cosine decay of the learning rate to 0 over this many steps, after "
                         "the warm-up (0: a constant rate)")
    ap.add_argument("--clip-norm", type=real(0, F32_MAX, f32=True), default=0.0,
                    help="clip the gradients' global 2-norm to this (0: no clipping)")
    ap.add_argument("--check-interval", type=integer(1, 2**24), default=16,
                    help="steps between two host reads of the skipped-step count")
    ap.add_argument("--init-scale", type=real(0, F32_MAX, lo_open=True, f32=True),
                    default=1024.0, help="initial loss scale")
    ap.add_argument("--seed", type=integer(0, 2**63 - 1), default=0,
                    help="initial weights, data order and sampling seed")
    ap.add_argument("--corpus-chars", type=integer(10_000, 10**9), default=400_000,
                    help="characters of standard-library source to read")
    ap.add_argument("--eval-every", type=integer(1), default=500,
                    help="steps between two evaluations of the train and validation loss (they "
                         "read the parameters: the training is the same at any value)")
    ap.add_argument("--eval-batches", type=integer(1, 10**6), default=8,
                    help="batches of fixed windows each loss is averaged over")
    ap.add_argument("--prompt", default="def ", help="the text sampling starts from")
    ap.add_argument("--sample-chars", type=integer(0, 10**6), default=240,
                    help="characters to sample at the end")
    ap.add_argument("--temperature", type=real(0, 100), default=0.8,
                    help="sampling temperature (0: greedy)")
    ap.add_argument("--compare-torch", action="store_true",
                    help="also train the same model in PyTorch (f32) and compare the losses")
    ap.add_argument("--checkpoint", type=Path, help="save the training state to this file")
    ap.add_argument("--checkpoint-every", type=integer(1), default=250,
                    help="steps between checkpoints (the training is the same at any value)")
    ap.add_argument("--resume", action="store_true", help=RESUME_HELP)
    ap.add_argument("--backend", choices=list(BACKENDS), default="auto",
                    help="auto: the GPU when CuPy sees one, else the CPU")
    ap.add_argument("--blas-threads", type=integer(1, 1024), default=1,
                    help="threads of the CPU's BLAS (OpenBLAS, through threadpoolctl): this "
                         "model's matrix products are too small to gain from more, and on a "
                         "busy machine spinning BLAS threads slowed training up to 7-fold "
                         "(measured)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.d_ff is None:
        args.d_ff = 4 * args.d_model
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.resume and args.checkpoint is None:
        ap.error("--resume needs --checkpoint PATH")
    problem = output_path(args.checkpoint, "--checkpoint")
    if problem is not None:
        ap.error(problem)
    return args


# --- the corpus ---------------------------------------------------------------------------------


def read_corpus(max_chars: int) -> str:
    """The ``.py`` files at the top of the standard library's folder, sorted by name,
    concatenated (each ending in a newline) up to ``max_chars`` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py"), key=lambda p: p.name):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not text.endswith("\n"):
            text += "\n"
        parts.append(text[:max_chars - total])
        total += len(parts[-1])
        if total >= max_chars:
            break
    return "".join(parts)


def encode(text: str) -> np.ndarray:
    return np.array([_CODE.get(c, 0) for c in text], dtype=np.int64)


def decode(codes: np.ndarray) -> str:
    return "".join(CHARS[c - 1] if c > 0 else UNKNOWN for c in codes)


def windows(codes: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """The non-overlapping windows of ``codes``: inputs ``(n, context)`` and their targets,
    the same shifted by one character."""
    n = (len(codes) - 1) // context
    x = codes[:n * context].reshape(n, context)
    y = codes[1:n * context + 1].reshape(n, context)
    return x, y


def eval_sets(x: np.ndarray, y: np.ndarray, batches: int, batch: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """At most ``batches`` whole batches of windows drawn (without replacement, in order) by
    ``rng``, as ``(k, batch, context)``."""
    k = min(batches, len(x) // batch)
    pick = np.sort(rng.choice(len(x), size=k * batch, replace=False))
    return x[pick].reshape(k, batch, -1), y[pick].reshape(k, batch, -1)


# --- the run ------------------------------------------------------------------------------------


def run_config(args: argparse.Namespace, corpus: str) -> dict[str, str]:
    config = canonical({k: getattr(args, k.replace("-", "_")) for k in CONFIG_KEYS[:-1]})
    config["corpus-sha256"] = hashlib.sha256(corpus.encode()).hexdigest()[:16]
    return config


def gpt_model(args: argparse.Namespace) -> Model:
    """``gpt`` reading ``--prec`` twins of f32 masters, as a :class:`~ocannl.model.Model`:
    built over any batch of ids, every build shares the first one's parameters. A build
    returns the f32 logits and the masters by name."""
    def build(ids: T.ClassIds, *, train: bool):  # noqa: ANN202
        def net():  # noqa: ANN202
            return nn_blocks.gpt(ids, vocab=VOCAB, context=args.context, d_model=args.d_model,
                                 heads=args.heads, layers=args.layers, d_ff=args.d_ff,
                                 train=train, label="gpt")

        if args.prec == "f32":
            logits, params = net()
        else:
            logits, params = mixed_prec.with_master_weights(prec=args.prec, f=net)
            logits = T.cast(logits, "f32")
        return logits, {name: mixed_prec.master_of(p) for name, p in params.items()}

    return Model(build, name="tiny gpt")


def learning_rate(args: argparse.Namespace) -> float | schedules.Schedule:
    """``--lr``, warmed up over ``--warmup-steps`` and decayed over ``--cosine-steps``, as
    torch's ``LinearLR`` then ``CosineAnnealingLR`` in a ``SequentialLR`` (computed on the
    device, counted by iterations: ``ocannl.schedules``)."""
    warm, cosine = args.warmup_steps, args.cosine_steps
    if warm and cosine:
        return schedules.warmup_cosine(args.lr, warmup_iters=warm, T_max=cosine,
                                       start_factor=WARMUP_FROM)
    if warm:
        return schedules.LinearLR(args.lr, start_factor=WARMUP_FROM, total_iters=warm)
    if cosine:
        return schedules.CosineAnnealingLR(args.lr, T_max=cosine)
    return args.lr


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_mpi_launch(PROGRAM)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # scikit-learn's dependency (the examples extra): without it, the default
        return run(args)
    with threadpool_limits(limits=args.blas_threads, user_api="blas"):
        return run(args)


def run(args: argparse.Namespace) -> int:
    corpus = read_corpus(args.corpus_chars)
    codes = encode(corpus)
    cut = int(0.9 * len(codes))
    x_train, y_train = windows(codes[:cut], args.context)
    x_val, y_val = windows(codes[cut:], args.context)
    for what, xs in (("training", x_train), ("validation", x_val)):
        if len(xs) < args.batch:
            sys.exit(f"error: --batch {args.batch} is larger than the {len(xs)} {what} windows "
                     f"of --context {args.context} in {len(corpus)} characters of corpus "
                     f"(raise --corpus-chars or lower --batch)")
    rng = np.random.default_rng([args.seed, 1])
    train_eval = eval_sets(x_train, y_train, args.eval_batches, args.batch, rng)
    val_eval = eval_sets(x_val, y_val, args.eval_batches, args.batch, rng)
    config = run_config(args, corpus)
    resume = resuming(args)
    if resume:
        problem = resume_problem(args.checkpoint, PROGRAM, config, CONFIG_KEYS, args.steps,
                                 {"corpus-sha256": "the corpus text (its sha256)"})
        if problem is not None:
            sys.exit(f"error: cannot resume from {args.checkpoint}: {problem}")
    ctx = make_context(args.backend)
    print(f"corpus: {len(corpus)} characters of {sysconfig.get_paths()['stdlib']}/*.py "
          f"({len(x_train)} training, {len(x_val)} validation windows of {args.context})",
          flush=True)

    T.set_seed(args.seed)
    ids = T.class_ids(batch_dims=(args.batch, args.context), num_classes=VOCAB, label="ids")
    targets = T.class_ids(batch_dims=(args.batch, args.context), num_classes=VOCAB,
                          label="targets")
    model = gpt_model(args)
    logits, masters = model(ids, train=True)
    loader = Loader([x_train, y_train], [ids, targets], batch=args.batch, seed=args.seed)
    loss = nn_blocks.cross_entropy(logits, targets)
    adam = optim.Adam(learning_rate(args))
    scaler = mixed_prec.Loss_scaler.create(init_scale=args.init_scale)
    clip = ClipNorm(args.clip_norm) if args.clip_norm else None
    recipe = mixed_prec.gated_step(scaler, loss, adam, check_interval=args.check_interval,
                                   clip=clip)
    ctx = train.init_params(ctx, loss)
    initial = {name: ctx.get_values(p) for name, p in masters.items()}  # for --compare-torch
    t0 = time.perf_counter()
    ctx = recipe.compile(ctx)
    sizes = [xs.shape[0] * xs.shape[1] for xs, _ in (train_eval, val_eval)]  # windows
    ctx, evals = Evaluations.compile(args, model, ctx, sizes)
    compile_s = time.perf_counter() - t0
    state = checkpoint.training_state(loss, adam) + recipe.state_nodes()

    start = 0
    if resume:
        try:
            ctx, progress = checkpoint.load(args.checkpoint, ctx, state)
            ctx = restore_recipe(ctx, progress, scaler, recipe)
            loader.restore_state(saved(progress, "loader"))
        except (Failure, KeyError) as err:
            sys.exit(f"error: cannot resume from {args.checkpoint}: "
                     f"{type(err).__name__ + ' ' if isinstance(err, KeyError) else ''}{err}")
        start = progress.step
        print(f"resumed from {args.checkpoint} at step {start}", flush=True)
    skips = SkipReport(recipe)

    def save(step: int) -> None:
        extra = {**recipe_extra(PROGRAM, config, scaler, recipe), "loader": loader.save_state()}
        checkpoint.save(args.checkpoint, ctx, state,
                        checkpoint.Progress(step=step, epoch=loader.epoch, extra=extra))

    def mean_loss(sets: tuple[np.ndarray, np.ndarray]) -> float:
        nonlocal ctx
        ctx, value = evals.mean_loss(ctx, *sets)
        return value

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    say = print if bar is None else bar.write
    t1 = time.perf_counter()
    for step in range(start, args.steps):
        ctx = recipe.step(loader.next(ctx))
        skips.say(step, say)
        if bar is not None:
            if recipe.pending == 0:  # sampled at this window's end: no extra sync
                bar.set_postfix(loss=f"{ctx.get_value(loss):.4f}",
                                scale=f"{scaler.scale_value():g}")
            bar.update(1)
        # Saving and evaluating read the parameters and leave the gate's window open: the
        # scale changes at the same steps whatever --checkpoint-every and --eval-every are (a
        # checkpoint holds the window's position and its skip count: a resume closes it where
        # this run would).
        if args.checkpoint is not None and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            say(f"step {step + 1}: train loss {mean_loss(train_eval):.4f}, "
                f"validation loss {mean_loss(val_eval):.4f}")
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t1
    if args.checkpoint is not None and start < args.steps:
        save(args.steps)  # before the last window is sampled: a longer resume continues it
    ctx = recipe.flush(ctx)
    skips.say(args.steps - 1, say)
    train_loss, val_loss = mean_loss(train_eval), mean_loss(val_eval)

    precision = twins_said(args.prec)
    print(f"backend {ctx.backend_name()}, {precision}, compile {compile_s:.1f} s, "
          f"{args.steps - start} steps in {train_s:.1f} s")
    ran = recipe.applied_steps + recipe.skipped_steps
    print(f"loss scale {scaler.scale_value():g}, skipped steps {recipe.skipped_steps} of {ran}")
    print(f"final train loss {train_loss:.4f}, validation loss {val_loss:.4f} "
          f"(after {args.steps} steps)", flush=True)
    if args.compare_torch:
        torch_val = torch_validation_loss(args, initial, x_train, y_train, val_eval)
        rel = abs(val_loss - torch_val) / torch_val
        print(f"validation loss: ocannl {val_loss:.4f} ({precision}), PyTorch "
              f"{torch_val:.4f} (f32), relative difference {100 * rel:.2f}%", flush=True)
    if args.sample_chars:
        ctx, text = evals.sample(ctx, args.prompt, args.sample_chars, args.temperature,
                               np.random.default_rng([args.seed, 2]))
        print(f"sample (temperature {args.temperature:g}):\n{text}", flush=True)
    return 0


class Evaluations:
    """The model built again (``ocannl.model``: the training graph's parameters, no copy) over
    the evaluation sets, each evaluated in one call, and over one sequence, for sampling. The
    losses are computed on the host in f64 from the logits, as the PyTorch twin's are."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.by_rows: dict[int, tuple[T.ClassIds, Evaluation]] = {}

    @classmethod
    def compile(cls, args: argparse.Namespace, model: Model, ctx: Context,
                sizes: list[int]) -> tuple[Context, Evaluations]:
        ev = cls(args.context)
        for rows in dict.fromkeys([*sizes, 1]):
            ids = T.class_ids(batch_dims=(rows, args.context), num_classes=VOCAB,
                              label=f"eval_ids_{rows}")
            logits, _ = model(ids, train=False)
            ctx, routine = compile_eval(ctx, logits, label=f"evaluate_{rows}")
            ev.by_rows[rows] = (ids, routine)
        return ctx, ev

    def logits(self, ctx: Context, xs: np.ndarray) -> tuple[Context, np.ndarray]:
        """The logits ``(n, context, VOCAB)`` (f64) of ``n`` sequences, in one call."""
        xs = xs.reshape(-1, self.context)
        ids, routine = self.by_rows[len(xs)]
        ctx, (z,) = routine.run(ctx, {ids: xs})
        return ctx, z.reshape(len(xs), self.context, VOCAB).astype(np.float64)

    def mean_loss(self, ctx: Context, xs: np.ndarray, ys: np.ndarray) -> tuple[Context, float]:
        """The cross-entropy of the targets ``ys`` given the inputs ``xs``, averaged over every
        position of every window."""
        ctx, z = self.logits(ctx, xs)
        ys = ys.reshape(-1, self.context)
        z = z - z.max(axis=2, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=2, keepdims=True))
        picked = np.take_along_axis(log_p, ys[:, :, None], axis=2)
        return ctx, float(-picked.sum() / ys.size)

    def sample(self, ctx: Context, prompt: str, n: int, temperature: float,
               rng: np.random.Generator) -> tuple[Context, str]:
        """``prompt`` and ``n`` characters drawn after it one at a time: the last ``context``
        characters fill the positions from the first, and the logits at the last of them give
        the next (later positions, hidden from it by the causal mask, hold the unknown token).
        Greedy at temperature 0."""
        codes = list(encode(prompt)) or [_CODE["\n"]]
        for _ in range(n):
            window = codes[-self.context:]
            row = np.zeros(self.context, np.int64)
            row[:len(window)] = window
            ctx, z = self.logits(ctx, row)
            z = z[0, len(window) - 1]
            if temperature == 0:
                codes.append(int(np.argmax(z)))
            else:
                p = np.exp((z - z.max()) / temperature)
                codes.append(int(rng.choice(VOCAB, p=p / p.sum())))
        return ctx, decode(np.array(codes))


# --- the PyTorch twin (--compare-torch) ---------------------------------------------------------


def torch_validation_loss(args: argparse.Namespace, initial: dict[str, np.ndarray],
                          x_train: np.ndarray, y_train: np.ndarray,
                          val_eval: tuple[np.ndarray, np.ndarray]) -> float:
    """Train the same architecture in PyTorch at f32 (``torch_gpt.TorchGPT``) from ``initial``
    on the same batches (Adam, ``--lr``) for ``--steps`` steps; its mean loss over the
    validation windows."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        sys.exit("error: --compare-torch needs PyTorch (pip install torch)")
    # One thread: a model this small gains nothing from more, and on a busy machine torch's
    # spinning worker threads slow it down 50-fold (measured: 1.7 s a step against 23 ms).
    torch.set_num_threads(1)
    from torch_gpt import TorchGPT  # the twin shared with tests/test_gpt.py and the benchmarks

    model = TorchGPT(vocab=VOCAB, context=args.context, d_model=args.d_model, heads=args.heads,
                     layers=args.layers, d_ff=args.d_ff).load(initial)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch_schedule(args, opt)
    for step in range(args.steps):
        idx = batch_indices(step, len(x_train), args.batch, args.seed)
        opt.zero_grad()
        out = model(torch.tensor(x_train[idx]))
        F.cross_entropy(out.reshape(-1, VOCAB), torch.tensor(y_train[idx]).reshape(-1)).backward()
        if args.clip_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        opt.step()
        if sched is not None:
            sched.step()
    with torch.no_grad():
        xs, ys = val_eval
        out = model(torch.tensor(xs.reshape(-1, args.context))).double()
        return float(F.cross_entropy(out.reshape(-1, VOCAB), torch.tensor(ys).reshape(-1)))


def torch_schedule(args: argparse.Namespace, opt: object) -> object | None:
    """torch's twin of :func:`learning_rate` over ``opt``, or None for a constant rate."""
    from torch.optim import lr_scheduler as ls

    parts = []
    if args.warmup_steps:
        parts.append(ls.LinearLR(opt, start_factor=WARMUP_FROM, total_iters=args.warmup_steps))
    if args.cosine_steps:
        parts.append(ls.CosineAnnealingLR(opt, T_max=args.cosine_steps))
    if len(parts) == 2:
        return ls.SequentialLR(opt, parts, milestones=[args.warmup_steps])
    return parts[0] if parts else None


if __name__ == "__main__":
    sys.exit(main())
