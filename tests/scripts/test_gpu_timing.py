"""scripts/gpu_timing.py without a GPU: its arithmetic, its table, and a dry run on the CPU
(the real runners, this project's LLVM backend and PyTorch's CPU eager) end to end."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_timing", ROOT / "scripts" / "gpu_timing.py")
gt = importlib.util.module_from_spec(_spec)
sys.modules["gpu_timing"] = gt  # (its dataclasses look their module up)
_spec.loader.exec_module(gt)


def test_per_step_and_median() -> None:
    assert gt.per_step([0.2, 0.4, 0.3], 4) == [0.05, 0.1, 0.075]
    assert gt.median_ms([0.05, 0.1, 0.075]) == pytest.approx(75.0)
    with pytest.raises(ValueError, match="steps_per_chunk must be >= 1, got 0"):
        gt.per_step([1.0], 0)
    with pytest.raises(ValueError, match="no times"):
        gt.median_ms([])


def test_ratios_pair_this_projects_rows_with_pytorchs() -> None:
    rows = [gt.Row("gpt_mini", "ocannl", "f32", wall_ms=4.0, gpu_ms=3.0),
            gt.Row("gpt_mini", "torch", "eager", wall_ms=5.0, gpu_ms=2.0),
            gt.Row("gpt_mini", "ocannl", "bf16", wall_ms=3.0),
            gt.Row("gpt_mini", "torch", "autocast-bf16", note="failed: x")]
    assert gt.ratio(rows, "gpt_mini", "f32", "eager") == pytest.approx(0.8)
    assert gt.ratio(rows, "gpt_mini", "f32", "eager", "gpu_ms") == pytest.approx(1.5)
    assert gt.ratio(rows, "gpt_mini", "bf16", "autocast-bf16") is None  # no figure
    assert gt.ratio(rows, "convnet", "f32", "eager") is None
    text = gt.table(rows)
    assert "gpt_mini: ocannl f32 / torch eager (wall): 0.80x" in text
    assert "gpt_mini: ocannl f32 / torch eager (gpu): 1.50x" in text
    assert "autocast-bf16 (wall)" not in text
    assert "| gpt_mini | torch | autocast-bf16 | - | - | - | - | - | - | failed: x |" in text


def test_rows_run_cheapest_first_and_cover_every_pair() -> None:
    rows = gt.row_order(gt.DEFAULT_WORKLOADS)
    keys = [(r.workload, r.framework, r.variant) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * (len(gt.OCANNL_VARIANTS) + len(gt.TORCH_MODES))
    assert keys[0] == ("mlp_wide", "ocannl", "f32") and keys[-1][2] == "compile-ro"
    assert all(r.variant != "compile-ro" for r in rows[:-3])
    assert not any(r.note for r in rows)
    dry = gt.row_order(["mlp_small"], dry_run=True)
    assert [r.note for r in dry if r.variant == "compile-ro"] == ["CUDA only"]


def test_a_dry_run_on_the_cpu_runs_every_row_end_to_end(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_timing.py"), "--dry-run",
                          "--workloads", "mlp_small", "--chunks", "1", "--warmup", "0",
                          "--fixtures", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "DRY RUN on the CPU: these are not GPU timings" in res.stdout
    rows = {tuple(c.strip() for c in line.split("|")[2:4]): line.split("|")
            for line in res.stdout.splitlines() if line.startswith("| mlp_small ")}
    assert set(rows) == {("ocannl", v) for v in gt.OCANNL_VARIANTS} | {
        ("torch", m) for m in gt.TORCH_MODES}
    for key, cells in rows.items():
        if key[1] != "compile-ro":
            assert float(cells[4]) > 0, cells  # a wall time per step
    # Same weights, same data: the first losses of f32 rows agree (benchmark parity, f32).
    ours, theirs = float(rows["ocannl", "f32"][9]), float(rows["torch", "eager"][9])
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert "mlp_small: ocannl f32 / torch eager (wall): " in res.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["mlp_small.safetensors"]


def test_without_a_gpu_and_no_dry_run_nothing_is_timed() -> None:
    from ocannl.backends.cuda.runtime import cuda_unavailable_reason

    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is usable here")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_timing.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "no GPU is usable, nothing to time" in res.stderr
