"""What the examples share, so they refuse the same things the same way: the backend choice,
the per-epoch batch order, a flag parser whose every mistake is one line (``ExampleParser``
with the checked ``integer`` / ``real`` types and ``output_path``), the checkpoint's record of
the program and settings that wrote it and the checks a resume makes of them
(``resume_problem``), and the refusal to run as several copies under an MPI launcher.

An example run as a script (``python examples/NAME.py``) has this folder on ``sys.path``, so
``from common import make_context, batch_indices`` works there; tests load the examples the
same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import numpy as np

from ocannl import Context, Failure

__all__ = ["BACKENDS", "F32_MAX", "RESUME_HELP", "DefaultsFormatter", "ExampleParser",
           "batch_indices", "canonical", "differences", "foreign_problem", "integer",
           "launched_ranks", "make_context", "no_checkpoint_yet", "output_path", "real",
           "recipe_extra", "refuse_mpi_launch", "restore_recipe", "resume_problem", "resuming",
           "saved_config", "steps_problem", "twins_said"]

BACKENDS = ("auto", "cpu", "cuda")


def make_context(backend: str) -> Context:
    """The context of a ``--backend`` choice. ``cpu``: the CPU. ``auto``: the GPU when CuPy
    sees a usable one, else the CPU, the reason printed as one ``note:`` line on stderr.
    ``cuda``: the GPU, or an exit (status 1) with the reason -- never a silent CPU run."""
    if backend not in BACKENDS:
        raise ValueError(f"make_context: backend must be one of {', '.join(BACKENDS)}, got "
                         f"{backend!r}")
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
    """The indices (into ``n`` training points) of the minibatch of ``step``: each epoch of
    ``n // batch`` steps walks a fresh permutation drawn from ``(seed, epoch)``, leaving out the
    ``n % batch`` points that do not fill a batch. A function of the step alone, so a resumed run
    sees the batches the uninterrupted one would have. The examples' own loops take their
    batches from ``ocannl.loader.Loader``, which hands out these rows; the PyTorch twins use
    this function. ``ValueError`` unless ``1 <= batch <= n`` and ``step >= 0``."""
    for name, v in (("step", step), ("n", n), ("batch", batch), ("seed", seed)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"batch_indices: {name} must be an integer, got {v!r}")
    if not 1 <= batch <= n:
        raise ValueError(f"batch_indices: batch must be between 1 and n={n}, got {batch}")
    if step < 0:
        raise ValueError(f"batch_indices: step must be >= 0, got {step}")
    if seed < 0:
        raise ValueError(f"batch_indices: seed must be >= 0, got {seed}")
    epoch, k = divmod(int(step), n // batch)
    perm = np.random.default_rng([int(seed), epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]


# --- flags ------------------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


class ExampleParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr,
    ``PROG: error: MESSAGE (see --help)``, and exit with status 2 (control characters in the
    message, e.g. from a typed value, are escaped). Defaults are shown in ``--help``
    (:class:`DefaultsFormatter`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, rest = super().parse_known_args(args, namespace)
        # ``--flag=--`` hands a one-value flag an empty list (argparse drops the '--' and
        # skips the type): refuse it like any other value that is not one.
        for action in self._actions:
            if action.nargs is None and action.option_strings \
                    and isinstance(getattr(ns, action.dest, None), list):
                self.error(f"argument {'/'.join(action.option_strings)}: expected one value, "
                           f"got '--'")
        return ns, rest

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{_printable(self.prog)}: error: {_printable(message)} (see --help)\n")


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and ends every option's help with its default:
    ``(default: 16)``; ``none`` for no value, ``off`` for a flag."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "(default: " in text or action.default is argparse.SUPPRESS \
                or not action.option_strings:  # (a help that says its default itself)
            return text
        d = action.default
        shown = ("off" if d is False else "on" if d is True else "none" if d in (None, "")
                 else "%(default)s")
        return f"{text} (default: {shown})"


def integer(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]`` (no upper bound when ``hi`` is None)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r:.60}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r:.60}")
        return v

    parse.__name__ = "integer"
    return parse


def real(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
         f32: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in the interval from ``lo`` to ``hi`` (open at
    either end as asked). ``f32``: also one that stays finite and, when non-zero, non-zero once
    rounded to f32 (the precision the device holds it in)."""
    want = (f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
            + (" (an f32)" if f32 else ""))

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r:.60}") from None
        inside = (math.isfinite(v) and (lo < v if lo_open else lo <= v)
                  and (v < hi if hi_open else v <= hi))
        if inside and f32:
            with np.errstate(over="ignore", under="ignore"):
                r = float(np.float32(v))
            inside = math.isfinite(r) and (r != 0.0 or v == 0.0)
        if not inside:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r:.60}")
        return v

    parse.__name__ = "real"
    return parse


def output_path(path: Path | str | None, flag: str) -> str | None:
    """Why ``path`` cannot be written by the program (its folder is missing, or it is a
    folder), as a message naming ``flag``; None when it can be (or is None)."""
    if path is None:
        return None
    text = os.fspath(path)
    if "\0" in text or text == "":
        return f"{flag} {text!r:.80}: not a file name"
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        return f"{flag} {text!r:.80}: the folder {folder!r:.80} does not exist"
    if os.path.isdir(text):
        return f"{flag} {text!r:.80} is a folder: give a file name"
    return None


RESUME_HELP = ("continue from --checkpoint; when that file does not exist yet, one line says so "
               "and the run starts from step 0 (a --checkpoint whose folder does not exist is "
               "refused)")


def resuming(args: argparse.Namespace) -> bool:
    """Whether ``--resume`` has a checkpoint to continue from. When ``--checkpoint`` names no
    file yet the run starts from step 0, saying so in one line, so that a mistyped name is
    seen (a name whose folder does not exist never gets here: :func:`output_path` refuses
    it)."""
    if not args.resume:
        return False
    if os.path.exists(args.checkpoint):
        return True
    print(no_checkpoint_yet(args.checkpoint), flush=True)
    return False


def no_checkpoint_yet(path: Path | str) -> str:
    """The line a ``--resume`` run prints when its ``--checkpoint`` does not exist yet."""
    return f"no checkpoint at {path} yet: starting from step 0"


def recipe_extra(program: str, config: dict[str, str], scaler: object,
                 recipe: object) -> dict[str, str]:
    """What a mixed-precision run's checkpoint records beside its tensors: the program that
    wrote it, its settings (:func:`canonical` strings), the loss scaler's state and the
    recipe's counters (``restore_recipe`` reads them back)."""
    return {"program": program, "config": json.dumps(config, sort_keys=True),
            "loss_scaler": scaler.save_state(), "recipe": recipe.save_state()}


def twins_said(prec: str) -> str:
    """How a run's summary names its ``--prec``: the cast twins' precision, or f32 without
    twins (the model reads its f32 parameters themselves)."""
    return "f32, no twins" if prec == "f32" else f"{prec} twins"


# --- checkpoints: whose they are, and the settings they were trained under ----------------------


def canonical(config: dict[str, object]) -> dict[str, str]:
    """Settings as a checkpoint records and compares them: floats by ``repr`` (exact), anything
    else by ``str``, so ``64`` and ``"64"`` are the same setting and ``0.1`` is never
    ``0.1000001``."""
    return {k: repr(float(v)) if isinstance(v, float) else str(v) for k, v in config.items()}


def saved_config(progress: object) -> dict[str, str] | None:
    """The settings a checkpoint's progress records (a JSON map of strings), or None."""
    text = progress.extra.get("config")
    if text is None:
        return None
    try:
        config = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(config, dict) and all(isinstance(v, str) for v in config.values())
    return config if ok else None


def foreign_problem(progress: object, program: str, keys: tuple[str, ...]) -> str | None:
    """Why a checkpoint is not one this program can resume (None: it may be): another
    program's (by the name it records, or, in a file that records none, by settings this
    program does not have: ``keys`` are every setting it may record), or one that records no
    settings at all."""
    writer = progress.extra.get("program")
    if writer is not None and writer != program:
        return (f"it was written by {writer}, not by {program}: give another --checkpoint, or "
                f"resume it with {writer}")
    saved = saved_config(progress)
    if saved is None:
        return ("it does not record the settings it was trained with (written by another "
                "program, or by an older version of this one), so a resume cannot check them: "
                "start afresh or give another --checkpoint")
    strange = sorted(set(saved) - set(keys))
    if writer is None and strange:
        return (f"it records settings this program does not have ({', '.join(strange)}): it "
                f"was written by another program; give another --checkpoint")
    return None


def differences(saved: dict[str, str], mine: dict[str, str], keys: tuple[str, ...],
                names: dict[str, str] | None = None) -> list[str]:
    """The settings (of ``keys``, in that order) whose recorded values differ, each as
    ``--name OLD in the checkpoint, NEW now`` (``names``: how to say a setting that is no
    flag); equal values are never listed, nor a setting absent on one side and empty on the
    other."""
    def shown(v: str | None) -> str:
        return "(none)" if v in (None, "") else v

    said = names or {}
    return [f"{said.get(k, '--' + k)} {shown(saved.get(k))} in the checkpoint, "
            f"{shown(mine.get(k))} now" for k in keys
            if shown(saved.get(k)) != shown(mine.get(k))]


def steps_problem(step: int, steps: int) -> str | None:
    """Why a checkpoint at ``step`` cannot continue to ``--steps`` (None: it can)."""
    if step > steps:
        return f"it is at step {step}, past --steps {steps} (give --steps {step} or more)"
    return None


def resume_problem(path: Path, program: str, config: dict[str, str],
                   keys: tuple[str, ...], steps: int,
                   names: dict[str, str] | None = None) -> str | None:
    """Why this run cannot resume from the checkpoint at ``path`` (None: it can), checked from
    its header before any work or any tensor is touched: unreadable, another program's,
    trained under other settings (naming each that differs), or past ``--steps``."""
    from ocannl import Failure, checkpoint

    try:
        progress = checkpoint.read_progress(path)
    except Failure as err:
        return str(err)
    problem = foreign_problem(progress, program, keys)
    if problem is not None:
        return problem
    diffs = differences(saved_config(progress) or {}, config, keys, names)
    if diffs:
        return "it was trained with other settings: " + "; ".join(diffs)
    return steps_problem(progress.step, steps)


# --- launchers ----------------------------------------------------------------------------------

# The world size each MPI launcher gives its processes: Open MPI, MPICH / Intel MPI (Hydra's
# PMI), MVAPICH.
_LAUNCHER_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_ranks(environ: dict[str, str] | None = None) -> tuple[int, str] | None:
    """The number of processes an MPI launcher started this one among, and the variable that
    says so, when more than one; None otherwise."""
    env = os.environ if environ is None else environ
    for var in _LAUNCHER_SIZES:
        try:
            n = int(env.get(var, ""))
        except ValueError:
            continue
        if n > 1:
            return n, var
    return None


def refuse_mpi_launch(program: str, *, data_parallel: bool = False) -> None:
    """Exit (status 1, one line) when an MPI launcher started this process among several:
    each would train the same run alone and write the same files. With ``data_parallel``
    (the program has the flag) the message says to use it."""
    launched = launched_ranks()
    if launched is None:
        return
    n, var = launched
    fix = ("add --data-parallel to train one run on them all" if data_parallel
           else "this program trains on one process: run it without the launcher")
    sys.exit(f"error: {program} was started as one of {n} MPI processes ({var}={n}): each "
             f"would train the same run alone and write the same files; {fix}")


class SkipReport:
    """The line an example prints when the host learns that a window of steps was skipped:
    the parameters whose gradients were not finite (``Recipe.last_overflow``), or that their
    norm overflowed when every gradient was finite."""

    def __init__(self, recipe: object) -> None:
        self.recipe = recipe
        self.seen = recipe.skipped_steps

    def say(self, step: int, say: Callable[[str], object] = print) -> None:
        """After step ``step`` (counted from 0) or a flush: report newly sampled skips."""
        r = self.recipe
        if r.skipped_steps == self.seen:
            return
        n, self.seen = r.skipped_steps - self.seen, r.skipped_steps
        why = (f"non-finite gradients in {', '.join(r.last_overflow)}" if r.last_overflow
               else "the gradients' norm overflowed")
        steps = "1 step" if n == 1 else f"{n} steps"
        say(f"step {step + 1}: {steps} skipped since the last check ({why}); loss scale now "
            f"{r.scaler.scale_value():g}")


def saved(progress: object, key: str) -> str:
    """The entry ``key`` of a checkpoint's progress; ``Failure`` naming what it lacks and
    what it holds (a checkpoint of an older version of the example)."""
    try:
        return progress.extra[key]
    except KeyError:
        held = ", ".join(sorted(progress.extra)) or "nothing"
        raise Failure(f"its progress has no {key!r} entry (it holds {held}): it was written by "
                      f"an older version of this example, which this one does not resume; "
                      f"start a new run") from None


def restore_recipe(ctx: Context, progress: object, scaler: object, recipe: object) -> Context:
    """The loss scaler's and the recipe's state from a checkpoint's progress; ``Failure``
    naming what the checkpoint lacks (:func:`saved`)."""
    ctx = scaler.restore_state(ctx, saved(progress, "loss_scaler"))
    recipe.restore_state(saved(progress, "recipe"))
    return ctx
