"""examples/tiny_gpt.py end to end on a tiny model: it trains (and --compare-torch runs), a
killed run resumes to the same final summary (losses, loss scale, skipped steps, sampled text)
as the uninterrupted one, and a resume under other settings is refused naming them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "tiny_gpt.py"
TINY = ("--context", "8", "--d-model", "16", "--heads", "2", "--layers", "1", "--batch", "4",
        "--corpus-chars", "20000", "--eval-batches", "2", "--eval-every", "4",
        "--check-interval", "4", "--sample-chars", "24")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "cpu", "--no-progress",
                           *TINY, *args], capture_output=True, text=True, timeout=1800)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _summary(out: str) -> str:
    """Everything from the loss-scale line on, but the --compare-torch line."""
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("loss scale"))
    return "\n".join(line for line in lines[start:] if not line.startswith("validation loss:"))


def test_tiny_gpt_runs_resumes_and_refuses_other_settings(tmp_path):
    whole = _run("--steps", "12", "--compare-torch")
    assert "step 4: train loss" in whole.stdout and "step 8: train loss" in whole.stdout
    assert "relative difference" in whole.stdout
    assert "final train loss" in _summary(whole.stdout) and "sample (" in whole.stdout
    ckpt = tmp_path / "gpt.safetensors"
    _run("--steps", "8", "--checkpoint", str(ckpt), "--checkpoint-every", "4")
    resumed = _run("--steps", "12", "--checkpoint", str(ckpt), "--checkpoint-every", "4",
                   "--resume")
    assert "resumed from" in resumed.stdout
    assert _summary(resumed.stdout) == _summary(whole.stdout)
    refused = _run("--steps", "12", "--checkpoint", str(ckpt), "--resume", "--lr", "0.01",
                   "--d-model", "24", check=False)
    assert refused.returncode != 0
    assert "--lr 0.003 in the checkpoint, 0.01 now" in refused.stderr
    assert "--d-model 16 in the checkpoint, 24 now" in refused.stderr
    assert "--heads" not in refused.stderr


def test_several_processes_of_an_mpi_launcher_are_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "cpu", "--no-progress"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PMI_SIZE": "2"})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "one of 2 MPI processes (PMI_SIZE=2)" in proc.stderr
    assert "run it without the launcher" in proc.stderr and "corpus" not in proc.stdout
