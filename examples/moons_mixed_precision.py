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
an uninterrupted run would, reporting the same counts, scale and loss. The checkpoint records
the settings that change the training; a resume with other values stops, naming each, unless
``--override-config lr,momentum`` (say) lets those continue with their new values (--gate,
--optimizer, --batch, --seed, --init-scale and --growth-interval can never change). The step
budget may always grow. A PNG of the loss and the scale is written when matplotlib is there.
Batches come from ``ocannl.loader.Loader`` (its position travels in the checkpoint); the
held-out points are classified in one call of an evaluation routine (``ocannl.model``).
Every flag is checked before any work: a mistake is one line on stderr and exit status 2.

``--data-parallel`` trains on every process of an MPI job: the global ``--batch`` is cut into
``--shards`` shards (default: 8 of at least 8 rows, fewer for a small batch), each rank
computes its block of consecutive shards, and the shard gradients are summed in one fixed tree
order (``ocannl.parallel``; NCCL between GPUs)::

    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py examples/moons_mixed_precision.py \
        --data-parallel                                             # make demo-dp

The run is then the same bits on any number of ranks dividing ``--shards`` (1 included):
every rank skips the same steps and keeps the same loss scale, and a run resumed from the
checkpoint (rank 0 writes it) on another number of ranks, same --batch and --shards, continues
exactly. ``--shard-optimizer`` (ZeRO-1) and ``--overlap`` change how the ranks share the work,
not the bits.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import safetensors
from common import (
    BACKENDS,
    F32_MAX,
    ExampleParser,
    SkipReport,
    foreign_problem,
    integer,
    make_context,
    no_checkpoint_yet,
    output_path,
    real,
    recipe_extra,
    refuse_mpi_launch,
    restore_recipe,
    saved,
    saved_config,
    steps_problem,
)

import ocannl.tensor as T
from ocannl import (
    Context,
    Failure,
    checkpoint,
    datasets,
    mixed_prec,
    nn_blocks,
    optim,
    parallel,
    train,
)
from ocannl.loader import Loader
from ocannl.model import Model, compile_eval

PROGRAM = "moons_mixed_precision.py"
TRAIN_POINTS, TEST_POINTS = 512, 512


# Settings that change the training, recorded in every checkpoint (``extra["config"]``) and
# compared on --resume. The step budget is not one: no schedule here depends on it, so a
# resume may always run further. Those below can never be overridden, with the reason.
FIXED = {
    "gate": "the checkpoint holds the other gate's state",
    "optimizer": "the checkpoint holds the other optimizer's buffers",
    "batch": "every epoch's data order is drawn for the batch size",
    "seed": "the training points and their order are drawn from it",
    "growth-interval": "the saved loss-scale schedule belongs to it",
    "init-scale": "the loss scale continues from the checkpoint (--init-scale sets step 0's)",
}
OVERRIDABLE = ("lr", "momentum", "check-interval", "inject-nonfinite")
CHECK_INTERVAL = 16  # the fused gate's, when --check-interval is not given


def build_parser() -> ExampleParser:
    ap = ExampleParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gate", choices=["host", "fused"], default="fused",
                    help="skip overflowing steps on the host after each step, or on the device "
                         "in one fused routine")
    ap.add_argument("--check-interval", type=integer(1, 2**24), default=None,
                    help=f"--gate fused only (the host gate reads every step): steps between two "
                         f"host reads of the skipped-step count (default: {CHECK_INTERVAL})")
    ap.add_argument("--steps", type=integer(1, 10**18), default=600, help="training steps")
    ap.add_argument("--batch", type=integer(1, TRAIN_POINTS), default=64,
                    help=f"batch size (at most the {TRAIN_POINTS} training points)")
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd",
                    help="the optimizer updating the f32 masters")
    ap.add_argument("--lr", type=real(0, F32_MAX, lo_open=True, f32=True), default=0.1,
                    help="learning rate")
    ap.add_argument("--momentum", type=real(0, 1, hi_open=True), default=0.9,
                    help="SGD momentum, in [0, 1)")
    ap.add_argument("--init-scale", type=real(0, F32_MAX, lo_open=True, f32=True),
                    default=65536.0, help="initial loss scale")
    ap.add_argument("--growth-interval", type=integer(1, 10**19 - 1), default=50,
                    help="good steps before the scale grows (torch's default is 2000)")
    ap.add_argument("--seed", type=integer(0, 2**63 - 1), default=0,
                    help="data and initialisation seed")
    ap.add_argument("--checkpoint", type=Path, help="save the training state to this file")
    ap.add_argument("--checkpoint-every", type=integer(1), default=100,
                    help="steps between checkpoints")
    ap.add_argument("--resume", action="store_true",
                    help="continue from --checkpoint when it exists; it must have been written "
                         "with the same settings (" + ", ".join(f"--{k}" for k in CONFIG_KEYS)
                         + "), or the run stops naming each that differs")
    ap.add_argument("--override-config", default="", metavar="NAMES",
                    help="with --resume: comma-separated settings that may differ from the "
                         "checkpoint's, the new values then applying from the resumed step on ("
                         + ", ".join(OVERRIDABLE) + "; --momentum not between 0 and non-zero); "
                         + ", ".join(FIXED) + " can never change")
    ap.add_argument("--backend", choices=list(BACKENDS), default="auto",
                    help="auto: the GPU when CuPy sees one, else the CPU")
    ap.add_argument("--data-parallel", action="store_true",
                    help="train on every process of the MPI job (mpiexec -n N python -m mpi4py "
                         "...), each on an equal shard of --batch; alone, a world of one")
    ap.add_argument("--shards", type=integer(1, TRAIN_POINTS), default=None,
                    help="with --data-parallel: the shards of --batch, summed in one fixed "
                         "order (a multiple of the number of ranks; default: the most of 1, 2, "
                         "4, 8 keeping 8 rows a shard)")
    ap.add_argument("--shard-optimizer", action="store_true",
                    help="with --data-parallel: each rank keeps and updates the optimizer state "
                         "of 1/N of the parameters' elements (ZeRO-1); the same bits")
    ap.add_argument("--overlap", action="store_true",
                    help="with --data-parallel: exchange the gradients in buckets, each started "
                         "while the backward code goes on; the same bits")
    ap.add_argument("--inject-nonfinite", default="", metavar="STEPS",
                    help="comma-separated steps (from 0) whose input batch gets an infinity")
    ap.add_argument("--plot", type=Path, default=Path("moons_mixed_precision.png"),
                    help="where to write the loss and scale plot (.png, .svg or .pdf)")
    ap.add_argument("--no-plot", action="store_true", help="do not write the plot")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


CONFIG_KEYS = ("gate", "optimizer", "batch", "seed", "lr", "momentum", "check-interval",
               "init-scale", "growth-interval", "inject-nonfinite")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every one checked: a mistake exits with status 2 and one line on stderr,
    before anything is computed or written."""
    ap = build_parser()
    args = ap.parse_args(argv)
    items = [s.strip() for s in args.inject_nonfinite.split(",") if s.strip()]
    if not all(re.fullmatch("[0-9]{1,19}", s) for s in items):
        ap.error(f"--inject-nonfinite expects comma-separated step numbers, got "
                 f"{args.inject_nonfinite!r:.80}")
    args.inject = {int(s) for s in items}
    bad = sorted(s for s in args.inject if not 0 <= s < args.steps)
    if bad:
        ap.error(f"--inject-nonfinite {bad[0]}: steps run from 0 to {args.steps - 1} "
                 f"(--steps {args.steps})")
    if args.check_interval is not None and args.gate == "host":
        ap.error(f"--check-interval {args.check_interval} applies to --gate fused only: the "
                 f"host gate reads the skip count after every step")
    if args.check_interval is None and args.gate == "fused":
        args.check_interval = CHECK_INTERVAL
    if args.resume and args.checkpoint is None:
        ap.error("--resume needs --checkpoint PATH")
    if not args.data_parallel:
        given = [f for f, on in (("--shards", args.shards is not None),
                                 ("--shard-optimizer", args.shard_optimizer),
                                 ("--overlap", args.overlap)) if on]
        if given:
            ap.error(f"{given[0]} applies to --data-parallel only")
    problem = output_path(args.checkpoint, "--checkpoint")
    if problem is None and not args.no_plot:
        problem = output_path(args.plot, "--plot")
        if problem is None and args.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            problem = f"--plot {str(args.plot)!r:.80}: the name must end in .png, .svg or .pdf"
    if problem is not None:
        ap.error(problem)
    args.override = [k.strip() for k in args.override_config.split(",") if k.strip()]
    if args.override_config and not args.resume:
        ap.error("--override-config applies to --resume only")
    if args.override_config and not args.override:
        ap.error(f"--override-config expects comma-separated setting names, got "
                 f"{args.override_config!r:.80}")
    for k in args.override:
        if k in FIXED:
            ap.error(f"--override-config {k}: --{k} can never differ from the checkpoint's: "
                     f"{FIXED[k]}")
        if k == "steps":
            ap.error("--override-config steps: the step budget is not checked (a resume may "
                     "run to any --steps past its checkpoint): nothing to override")
        if k not in OVERRIDABLE:
            ap.error(f"--override-config {k!r:.40}: not a setting; the ones that may differ: "
                     f"{', '.join(OVERRIDABLE)}")
    return args


def run_config(args: argparse.Namespace) -> dict[str, str]:
    """Every setting that changes the training, as the flag names and their canonical values:
    --momentum only for SGD, --check-interval only for the fused gate."""
    config = {"gate": args.gate, "optimizer": args.optimizer, "batch": str(args.batch),
              "seed": str(args.seed), "lr": repr(args.lr),
              "init-scale": repr(args.init_scale), "growth-interval": str(args.growth_interval),
              "inject-nonfinite": ",".join(str(s) for s in sorted(args.inject))}
    if args.optimizer == "sgd":
        config["momentum"] = repr(args.momentum)
    if args.gate == "fused":
        config["check-interval"] = str(args.check_interval)
    return config


def config_problem(saved: dict[str, str], mine: dict[str, str],
                   override: list[str]) -> tuple[str | None, list[str]]:
    """Compare the checkpoint's settings with this run's: (why the resume must stop, or None;
    a note per overridden setting that differs). ``saved`` is this program's (see
    ``common.foreign_problem``)."""

    def shown(v: str | None) -> str:
        return "(none)" if v in (None, "") else v

    def is_zero(v: str | None) -> bool:
        try:
            return float(v or 0) == 0
        except ValueError:
            return False

    # A setting only one side has (--momentum, --check-interval) follows from --optimizer or
    # --gate: named only when those agree.
    same_kind = all(saved.get(k) == mine.get(k) for k in ("gate", "optimizer"))
    diffs = [k for k in sorted(set(saved) | set(mine), key=_config_order)
             if saved.get(k) != mine.get(k) and (same_kind or (k in saved and k in mine))]
    stop = [k for k in diffs if k not in override]
    if "momentum" in diffs and "momentum" in override and \
            is_zero(saved.get("momentum")) != is_zero(mine.get("momentum")):
        return (f"--momentum {shown(saved.get('momentum'))} in the checkpoint, "
                f"{shown(mine.get('momentum'))} now: cannot be overridden between 0 and non-zero "
                f"(SGD without momentum has no momentum buffers)", [])
    if stop:
        said = "; ".join(f"--{k} {shown(saved.get(k))} in the checkpoint, {shown(mine.get(k))} "
                         f"now" for k in stop)
        may = [k for k in stop if k in OVERRIDABLE]
        fixed = [k for k in stop if k in FIXED]
        hint = []
        if may:
            hint.append(f"--override-config {','.join(may)} continues with the new "
                        f"value{'s' if len(may) > 1 else ''}")
        hint += [f"--{k} can never change: {FIXED[k]}" for k in fixed]
        return said + (f" ({'; '.join(hint)})" if hint else ""), []
    notes = [f"note: --override-config: --{k} {shown(saved.get(k))} in the checkpoint, "
             f"{shown(mine.get(k))} from here on" for k in diffs]
    return None, notes


def resume_problem(args: argparse.Namespace, progress: checkpoint.Progress,
                   config: dict[str, str]) -> tuple[str | None, list[str]]:
    """Why this run cannot resume from ``progress`` (None: it can), and the notes to print."""
    problem = foreign_problem(progress, PROGRAM, CONFIG_KEYS)
    if problem is not None:
        return problem, []
    problem, notes = config_problem(saved_config(progress) or {}, config, args.override)
    if problem is None:
        problem = steps_problem(progress.step, args.steps)
    return problem, notes


def _config_order(k: str) -> int:
    return CONFIG_KEYS.index(k) if k in CONFIG_KEYS else len(CONFIG_KEYS)


def peek_progress(path: Path) -> checkpoint.Progress | None:
    """The progress a checkpoint records, read from its header alone (before any tensor is
    loaded, so a mismatch is reported as one, not as a node that does not fit); None when the
    header cannot be read (``checkpoint.load`` then says why)."""
    try:
        with safetensors.safe_open(str(path), framework="numpy") as fh:
            meta = fh.metadata() or {}
        return checkpoint.Progress.from_json(meta["progress"])
    except Exception:  # noqa: BLE001 - any unreadable header: checkpoint.load reports it
        return None


def data_parallel_world(ctx: Context) -> tuple[parallel.Communicator, Context]:
    """The ranks of this job (MPI under mpiexec, else a world of one) and the context to train
    in: on GPUs with several ranks, NCCL and a context on this rank's device."""
    comm = parallel.world()
    if ctx.backend_name() == "cuda" and isinstance(comm, parallel.MpiCommunicator) \
            and comm.size > 1:
        comm = parallel.NcclCommunicator(comm)
        ctx = Context.cuda(comm.device_id)
    return comm, ctx


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.data_parallel:
        refuse_mpi_launch(PROGRAM, data_parallel=True)
    config = run_config(args)
    resuming = args.resume and os.path.exists(args.checkpoint)
    if resuming:  # the settings first: a checkpoint of another run refuses before any work
        peeked = peek_progress(args.checkpoint)
        if peeked is not None:
            problem, _ = resume_problem(args, peeked, config)
            if problem is not None:
                sys.exit(f"error: cannot resume from {args.checkpoint}: {problem}")
    ctx = make_context(args.backend)
    comm: parallel.Communicator = parallel.SingleProcess()
    if args.data_parallel:
        comm, ctx = data_parallel_world(ctx)
        if args.batch % comm.size:
            sys.exit(f"error: --batch {args.batch} (the global batch) does not split into "
                     f"{comm.size} equal shards: give a multiple of {comm.size}")
    shards = comm.size
    if args.data_parallel:
        shards = args.shards or parallel.default_shards(args.batch, min_rows=8)
        if args.batch % shards or shards % comm.size:
            sys.exit(f"error: --shards {shards}: must divide --batch {args.batch} and be a "
                     f"multiple of the {comm.size} rank(s)")
    lead = comm.rank == 0  # the rank that prints, plots and writes the checkpoint
    if not lead:
        sys.stdout = open(os.devnull, "w")  # for the life of the process
    local = args.batch // shards  # the rows of a shard: what the model is built over
    points, labels = datasets.half_moons(TRAIN_POINTS, seed=args.seed)
    test_points, test_labels = datasets.half_moons(TEST_POINTS, seed=args.seed + 1)
    targets = datasets.one_hot(labels, 2)

    # The model: f16 input, f16 twins of f32 masters, f32 loss.
    T.set_seed(args.seed)
    x = T.term(np.zeros((local, 2)), label="x", prec="f16")
    y = T.term(np.zeros((local, 2)), label="y")

    def build(inputs: T.Tensor, *, train: bool) -> T.Tensor:
        return mixed_prec.with_master_weights(
            prec="f16", f=lambda: nn_blocks.mlp(inputs, [16, 16]))[0]

    model = Model(build, name="moons mlp")
    logits = model(x, train=True)
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    dp = None
    if args.data_parallel:  # the gradients become views of one flat buffer, before compiling
        dp = parallel.DataParallel(comm, loss, inputs=[x, y], shards=shards,
                                   shard_optimizer=args.shard_optimizer, overlap=args.overlap)
        ctx = dp.setup(ctx)
        print(f"data-parallel: {comm.size} rank(s) ({comm.name}), global batch {args.batch} = "
              f"{comm.size} x {args.batch // comm.size} ({shards} shards of {local} rows, "
              f"summed in one fixed order)", flush=True)
    # Each rank reads its block of every global batch of one seeded permutation per epoch.
    loader = Loader([points, targets], [x, y], batch=args.batch, seed=args.seed, parallel=dp)

    def global_loss() -> float:  # the global batch's loss (with dp, a collective)
        return ctx.get_value(loss) if dp is None else dp.global_loss()

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
        recipe = mixed_prec.gated_step(scaler, loss, opt, check_interval=args.check_interval,
                                       reducer=dp)
    else:
        recipe = mixed_prec.scaled_step(scaler, loss, opt, reducer=dp)
    ctx = recipe.compile(ctx) if dp is None else dp.compile(ctx, recipe)
    state = checkpoint.training_state(loss, opt) + recipe.state_nodes()
    if dp is not None:
        ctx = dp.broadcast(ctx, state)  # every rank starts from rank 0's parameters
    # The held-out points in one call: the model built again over all of them (its parameters
    # shared with the training graph's).
    x_test = T.term(np.zeros((TEST_POINTS, 2)), label="x_test", prec="f16")
    ctx, evaluation = compile_eval(ctx, model(x_test, train=False))
    compile_s = time.perf_counter() - t0

    start = 0
    saved_loss = math.nan  # the loss of the step before a checkpoint, as it recorded it
    if resuming:
        try:
            load = checkpoint.load if dp is None else dp.load  # every rank loads
            ctx, progress = load(args.checkpoint, ctx, state)
            problem, notes = resume_problem(args, progress, config)
            if problem is not None:
                raise Failure(problem)
            ctx = restore_recipe(ctx, progress, scaler, recipe)
            loader.restore_state(saved(progress, "loader"))
            saved_loss = float.fromhex(saved(progress, "loss"))
        except (Failure, KeyError, ValueError) as err:
            sys.exit(f"error: cannot resume from {args.checkpoint}: "
                     f"{type(err).__name__ + ' ' if isinstance(err, KeyError) else ''}{err}")
        start = progress.step
        print(f"resumed from {args.checkpoint} at step {start}", flush=True)
        for note in notes:
            print(note, flush=True)
    elif args.resume:
        print(no_checkpoint_yet(args.checkpoint), flush=True)

    def save(step: int) -> None:
        # Before the window is flushed: the resumed run samples it where this one would.
        extra = {**recipe_extra(PROGRAM, config, scaler, recipe), "loss": global_loss().hex(),
                 "loader": loader.save_state()}
        progress = checkpoint.Progress(step=step, epoch=loader.epoch, extra=extra)
        if dp is None:
            checkpoint.save(args.checkpoint, ctx, state, progress)
        else:  # rank 0 writes, the others wait for it
            dp.save(args.checkpoint, ctx, state, progress)
        print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)

    bar = None
    if not args.no_progress and lead:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    # (step, loss, scale) samples. The fused recipe's point is not to wait for the device every
    # step, so it reads the loss only where it reads the overflow flag anyway: at window ends.
    history: list[tuple[int, float, float]] = []
    skips = SkipReport(recipe)
    say = print if bar is None else bar.write
    for step in range(start, args.steps):
        ctx = loader.next(ctx)
        if step in args.inject and lead:  # the global batch's first row
            ctx = ctx.set_value(x, np.inf, (0, 0))
        scale = scaler.scale_value()
        ctx = recipe.step(ctx)
        if lead:
            skips.say(step, say)
        if recipe.pending == 0:  # the host sampled this step: reading the loss costs no sync
            history.append((step, global_loss(), scale))
        if args.checkpoint is not None and (step + 1) % args.checkpoint_every == 0:
            save(step + 1)
        if bar is not None:
            bar.update(1)
            if step % 10 == 0:
                # nothing sampled yet in the fused gate's first window: no loss to show
                last = f"{history[-1][1]:.4f}" if history else "-"
                bar.set_postfix(loss=last, scale=f"{scale:g}")
    if bar is not None:
        bar.close()
    ran = start < args.steps
    if args.checkpoint is not None and ran and args.steps % args.checkpoint_every != 0:
        save(args.steps)
    # Sample the last, partial window (the fused gate), so the scale and counts reported are
    # those of every step; a run resumed from its last checkpoint reports the same.
    pending = recipe.pending
    ctx = recipe.flush(ctx)
    if lead:
        skips.say(args.steps - 1)
    final_loss = global_loss() if ran else saved_loss
    if ran and pending:
        history.append((args.steps - 1, final_loss, scaler.scale_value()))

    ctx, (test_logits,) = evaluation.run(ctx, {x_test: test_points})
    correct = int(np.sum(np.argmax(test_logits.astype(np.float32), axis=-1) == test_labels))
    evaluated = TEST_POINTS
    print(f"backend {ctx.backend_name()}, gate {args.gate}, compile {compile_s:.1f} s")
    # Counts of the whole run (the recipe's counters travel in the checkpoint); the host gate's
    # windows are single steps.
    skipped = (f"skipped steps: {recipe.skipped_steps} of "
               f"{recipe.applied_steps + recipe.skipped_steps}")
    if args.gate == "fused":
        skipped += f" (windows: {recipe.skipped_windows} of {recipe.windows})"
    print(f"final loss {final_loss:.4g}, loss scale {scaler.scale_value():g} "
          f"(good steps {scaler.good_steps}), {skipped}")
    print(f"accuracy: {100.0 * correct / evaluated:.2f}% on {evaluated} held-out points",
          flush=True)
    if not args.no_plot and history and lead:
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
