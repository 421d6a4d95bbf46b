"""examples/digits_convnet.py end to end: it trains, a killed run resumes to the same result,
a resume under other settings, past --steps, or from another program's checkpoint is refused
naming why, and bad flags are one-line usage errors before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "digits_convnet.py"


def _run(*args: str, check: bool = True, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "cpu", "--no-progress",
                           *args], capture_output=True, text=True, timeout=900,
                          env=None if env is None else {**os.environ, **env})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _summary(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("final loss", "accuracy"))]


def test_a_resumed_run_ends_as_the_uninterrupted_one(tmp_path):
    whole = _run("--steps", "40", "--check-interval", "8")
    ckpt = tmp_path / "d.safetensors"
    _run("--steps", "24", "--check-interval", "8", "--checkpoint", str(ckpt),
         "--checkpoint-every", "8")
    resumed = _run("--steps", "40", "--check-interval", "8", "--checkpoint", str(ckpt),
                   "--checkpoint-every", "8", "--resume")
    assert "resumed from" in resumed.stdout
    assert _summary(resumed.stdout) == _summary(whole.stdout) and len(_summary(whole.stdout)) == 2
    before = ckpt.read_bytes()
    refused = _run("--steps", "40", "--check-interval", "8", "--checkpoint", str(ckpt),
                   "--resume", "--lr", "0.01", check=False)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "--lr 0.003 in the checkpoint, 0.01 now" in refused.stderr
    assert "--batch" not in refused.stderr  # equal values are not differences
    below = _run("--steps", "30", "--check-interval", "8", "--checkpoint", str(ckpt),
                 "--resume", check=False)
    assert below.returncode == 1, below.stderr
    assert "it is at step 40, past --steps 30" in below.stderr and "resumed" not in below.stdout
    assert ckpt.read_bytes() == before


def test_the_summary_survives_checkpoints_more_often_than_samples(tmp_path):
    """--checkpoint-every below --check-interval: the summary is there (when each save flushed
    the window before it ended, no window ever ended on its own and the line was lost)."""
    done = _run("--steps", "8", "--check-interval", "8", "--checkpoint-every", "4",
                "--checkpoint", str(tmp_path / "c.safetensors"))
    assert len(_summary(done.stdout)) == 2, done.stdout
    assert "skipped steps 0 of 8" in done.stdout


@pytest.mark.parametrize(("flag", "value"), [
    ("--lr", "1e39"), ("--init-scale", "1e39"), ("--seed", "-1"), ("--steps", "0"),
    ("--lr", "nan"), ("--checkpoint", "/no/such/folder/d.safetensors"),
])
def test_bad_flags_are_one_line_usage_errors(flag: str, value: str) -> None:
    done = _run(f"{flag}={value}", check=False)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert flag in done.stderr and done.stdout == ""


def _foreign_checkpoint(path: Path, extra: dict[str, str]) -> None:
    import ocannl.tensor as T
    from ocannl import Context, checkpoint

    t = T.term(np.zeros(3, np.float32), label="w")
    ctx = Context.cpu().set_values(t, np.zeros(3))
    checkpoint.save(path, ctx, [t.value], checkpoint.Progress(step=10, extra=extra))


def test_another_programs_checkpoint_is_refused_naming_the_program(tmp_path):
    moons = {"gate": "fused", "optimizer": "sgd", "batch": "64", "seed": "0", "lr": "0.1"}
    tagged, untagged = tmp_path / "tagged", tmp_path / "untagged"
    _foreign_checkpoint(tagged, {"program": "moons_mixed_precision.py",
                                 "config": json.dumps(moons)})
    _foreign_checkpoint(untagged, {"config": json.dumps(moons)})
    done = _run("--checkpoint", str(tagged), "--resume", check=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "written by moons_mixed_precision.py, not by digits_convnet.py" in done.stderr
    done = _run("--checkpoint", str(untagged), "--resume", check=False)
    assert done.returncode == 1, done.stderr
    assert "settings this program does not have (gate, optimizer)" in done.stderr
    assert "(now" not in done.stderr and "--batch" not in done.stderr


def test_several_processes_of_an_mpi_launcher_are_refused():
    done = _run(check=False, env={"OMPI_COMM_WORLD_SIZE": "2"})
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "one of 2 MPI processes (OMPI_COMM_WORLD_SIZE=2)" in done.stderr


def test_held_out_accuracy_in_one_call_equals_the_padded_evaluation():
    """The evaluation routine (all 360 held-out digits in one batch) classifies as the training
    graph's forward did over the same weights, in batches of 64 with the last one padded."""
    sys.path.insert(0, str(SCRIPT.parent))
    import digits_convnet

    from ocannl import train

    run = digits_convnet.Run(digits_convnet.parse_args(
        ["--backend", "cpu", "--no-progress", "--steps", "60", "--prec", "f16"]))
    ctx = run.ctx
    for _ in range(60):
        ctx = run.recipe.step(run.loader.next(ctx))
    run.ctx = run.recipe.flush(ctx)
    assert run.recipe.applied_steps > 0
    before = {n.name: run.ctx.get_values(n).tobytes() for n in run.state}
    ctx, (one_call,) = run.evaluation.run(run.ctx, {run.x_eval: run.x_test})
    accuracy = run.accuracy()
    # every bit of the training state (masters, Adam, the gate's counters) as it was
    assert {n.name: ctx.get_values(n).tobytes() for n in run.state} == before
    ctx, forward = ctx.compile(train.forward(run.logits))
    batch = run.x.dims[0]
    padded_logits = []
    for k in range(0, len(run.x_test), batch):
        chunk = run.x_test[k:k + batch]
        padded = np.zeros((batch, 8, 8, 1), np.float32)
        padded[:len(chunk)] = chunk
        ctx = ctx.set_values(run.x, padded).run(forward)
        padded_logits.append(ctx.get_values(run.logits)[:len(chunk)])
    padded_logits = np.concatenate(padded_logits)
    padded_accuracy = float(np.mean(padded_logits.argmax(-1) == run.y_test))
    assert one_call.shape == (360, 10) and run.x_eval.dims[0] == 360
    assert accuracy == padded_accuracy > 0.5, (accuracy, padded_accuracy)
    np.testing.assert_allclose(one_call, padded_logits, rtol=1e-3, atol=1e-3)


def _checkpointed(path: Path, every: str) -> tuple[list[str], dict[str, bytes]]:
    """A run of 20 steps whose loss scale backs off (f16 twins from 1e6, sampled every 8
    steps), checkpointing every ``every`` steps: its summary and its last checkpoint's
    tensors."""
    from safetensors import safe_open

    done = _run("--steps", "20", "--check-interval", "8", "--init-scale", "1e6",
                "--checkpoint", str(path), "--checkpoint-every", every)
    with safe_open(str(path), "np") as f:
        tensors = {k: f.get_tensor(k).tobytes() for k in f.keys()}  # noqa: SIM118
    return [line for line in done.stdout.splitlines() if "loss scale" in line
            or line.startswith("accuracy")], tensors


def test_checkpointing_every_3_steps_trains_as_checkpointing_once(tmp_path):
    """A save reads the parameters and leaves the gate's window open (issue 38): the scale
    backs off at the same steps whatever --checkpoint-every is."""
    once = _checkpointed(tmp_path / "once.safetensors", "1000")
    often = _checkpointed(tmp_path / "often.safetensors", "3")
    assert "skipped steps 0 of" not in once[0][0], once[0]
    assert often == once


def test_f32_says_it_has_no_twins():
    done = _run("--prec", "f32", "--steps", "2")
    assert ", f32, no twins, compile" in done.stdout and "f32 twins" not in done.stdout


def test_resume_from_a_checkpoint_not_there_yet_says_so(tmp_path):
    path = tmp_path / "typo.safetensors"
    done = _run("--steps", "2", "--checkpoint", str(path), "--resume")
    assert done.stdout.splitlines()[0] == f"no checkpoint at {path} yet: starting from step 0"
    assert "resumed" not in done.stdout and path.exists()
    refused = _run("--steps", "2", "--checkpoint", str(tmp_path / "typo" / "d.safetensors"),
                   "--resume", check=False)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"the folder '{tmp_path / 'typo'}' does not exist" in refused.stderr
    assert refused.stdout == "" and sorted(os.listdir(tmp_path)) == ["typo.safetensors"]
