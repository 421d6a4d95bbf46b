"""examples/digits_convnet.py end to end: it trains, a killed run resumes to the same result,
and a resume under other settings is refused naming them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "digits_convnet.py"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "cpu", "--no-progress",
                           *args], capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _summary(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("last sampled", "accuracy"))]


def test_a_resumed_run_ends_as_the_uninterrupted_one(tmp_path):
    whole = _run("--steps", "40", "--check-interval", "8")
    ckpt = tmp_path / "d.safetensors"
    _run("--steps", "24", "--check-interval", "8", "--checkpoint", str(ckpt),
         "--checkpoint-every", "8")
    resumed = _run("--steps", "40", "--check-interval", "8", "--checkpoint", str(ckpt),
                   "--checkpoint-every", "8", "--resume")
    assert "resumed from" in resumed.stdout
    assert _summary(resumed.stdout) == _summary(whole.stdout) and _summary(whole.stdout)
    refused = _run("--steps", "40", "--check-interval", "8", "--checkpoint", str(ckpt),
                   "--resume", "--lr", "0.01", check=False)
    assert refused.returncode != 0
    assert "--lr 0.003 (now 0.01)" in refused.stderr
