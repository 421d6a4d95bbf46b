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
    """--checkpoint-every below --check-interval: each save flushes the window before it ends,
    so no window ever ended on its own (the summary line was lost)."""
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
