"""examples/tiny_gpt.py end to end on a tiny model: it trains (and --compare-torch runs), a
killed run resumes to the same final summary (losses, loss scale, skipped steps, sampled text)
as the uninterrupted one, also killed ten times at random moments under a warm-up-then-cosine
schedule, clipping and the loader (the final checkpoint the same bytes), and a resume under
other settings is refused naming them."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from ocannl import checkpoint

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


def test_killed_ten_times_at_random_moments_it_ends_as_the_uninterrupted_run(tmp_path):
    """Warm-up then cosine, clipping at 0.5, f16 twins, batches from the loader, a checkpoint
    every 5 steps: SIGKILL ten times during training, each at a random moment (seeded: a
    random number of steps past the last checkpoint, then a random delay of up to 50 ms, so
    between checkpoints or while one is written), each rerun resuming from the last
    checkpoint, ends with the uninterrupted run's summary and checkpoint. The last kill aims
    at most 60% of the way: on a fast CPU (the example trained at 1.4 ms a step on a Zen 5
    EPYC) a kill aimed near the end, plus its delay, came after the run had ended."""
    steps = 1200
    args = ("--steps", str(steps), "--warmup-steps", "20", "--cosine-steps", str(steps - 20),
            "--clip-norm", "0.5", "--checkpoint-every", "5", "--eval-every", "2000")
    whole = _run(*args, "--checkpoint", str(tmp_path / "whole.safetensors"))
    path = tmp_path / "killed.safetensors"
    cmd = [sys.executable, str(SCRIPT), "--backend", "cpu", "--no-progress", *TINY, *args,
           "--checkpoint", str(path), "--resume"]
    rng = random.Random(27)
    at = []
    for _ in range(10):
        start = checkpoint.read_progress(path).step if path.exists() else 0
        target = min(start + rng.randint(1, 50), steps * 6 // 10)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while not (path.exists() and checkpoint.read_progress(path).step >= target):
                assert proc.poll() is None, proc.stderr.read()[-3000:]  # killed, not ended
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.05))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        at.append(checkpoint.read_progress(path).step)
    assert at == sorted(at) and at[-1] < steps, at
    resumed = _run(*args, "--checkpoint", str(path), "--resume")
    assert "resumed from" in resumed.stdout
    assert _summary(resumed.stdout) == _summary(whole.stdout)
    assert _contents(path) == _contents(tmp_path / "whole.safetensors")


def _contents(path: Path) -> tuple[dict[str, str], dict[str, bytes]]:
    """A checkpoint's metadata and every tensor's bytes (the file's own layout, its header's
    order, varies from process to process)."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return f.metadata(), {k: f.get_tensor(k).tobytes() for k in f.keys()}  # noqa: SIM118


# --- evaluation and saving read the parameters; they do not change the training (issue 38) ----

# f16 twins from a loss scale of 1e7: about half the steps of 32 are skipped, so a window cut
# short anywhere moves the scale's back-offs to other steps.
SKIPPING = ("--steps", "32", "--init-scale", "1e7", "--check-interval", "4")


def _trained(path: Path, *args: str) -> tuple[str, tuple[dict[str, str], dict[str, bytes]]]:
    """The run's summary and its final checkpoint's contents."""
    done = _run(*SKIPPING, "--sample-chars", "0", "--checkpoint", str(path), *args)
    return _summary(done.stdout), _contents(path)


def test_evaluating_every_3_steps_trains_as_evaluating_never(tmp_path):
    rare = _trained(tmp_path / "rare.safetensors", "--eval-every", "1000")
    often = _trained(tmp_path / "often.safetensors", "--eval-every", "3")
    assert "skipped steps 0 of" not in rare[0] and "skipped steps 32 of" not in rare[0], rare[0]
    assert often == rare


def test_checkpointing_every_3_steps_trains_as_checkpointing_once(tmp_path):
    once = _trained(tmp_path / "once.safetensors", "--eval-every", "1000",
                    "--checkpoint-every", "1000")
    often = _trained(tmp_path / "often.safetensors", "--eval-every", "1000",
                     "--checkpoint-every", "3")
    assert often == once


def test_a_resume_under_another_eval_every_trains_as_the_uninterrupted_run(tmp_path):
    """Stopped at step 13 (inside a window of 4, a checkpoint every 5, evaluating every 3),
    then resumed to 32 evaluating every 7: the run that never evaluates, to the bit."""
    whole = _trained(tmp_path / "whole.safetensors", "--eval-every", "1000")
    path = tmp_path / "split.safetensors"
    _run(*SKIPPING, "--steps", "13", "--sample-chars", "0", "--checkpoint", str(path),
         "--checkpoint-every", "5", "--eval-every", "3")
    resumed = _trained(path, "--resume", "--eval-every", "7")
    assert resumed == whole


def test_resume_from_a_checkpoint_not_there_yet_says_so(tmp_path):
    path = tmp_path / "typo.safetensors"
    done = _run("--steps", "1", "--checkpoint", str(path), "--resume")
    assert done.stdout.splitlines()[0] == f"no checkpoint at {path} yet: starting from step 0"
    assert "resumed" not in done.stdout and path.exists()
