"""scripts/gpu_check.sh's arguments and its verdict without a GPU, run as bash runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PARTS = ["env", "tests", "sanitizer", "timing", "moons"]


def _check(*args: str, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_list_names_every_part_with_its_limit_within_six_minutes(tmp_path: Path) -> None:
    res = _check("--list", out=tmp_path / "out")
    assert res.returncode == 0, res.stderr
    limits = dict(re.findall(r"^(\w+)\s+(\d+)\s", res.stdout, flags=re.M))
    assert list(limits) == PARTS, res.stdout
    assert sum(map(int, limits.values())) <= 360
    assert "all parts within 360 s" in res.stdout
    assert not (tmp_path / "out").exists()  # listing runs nothing


@pytest.mark.parametrize("only", ["bogus", "env,bogus", ",", ""])
def test_an_unknown_part_is_refused_naming_the_parts(tmp_path: Path, only: str) -> None:
    res = _check("--only", only, out=tmp_path / "out")
    assert res.returncode == 2
    assert "the parts are: " + " ".join(PARTS) in res.stderr or \
        "a comma-separated list of parts: " + " ".join(PARTS) in res.stderr, res.stderr
    if "bogus" in only:
        assert "unknown part 'bogus'" in res.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_an_unknown_argument_is_refused(tmp_path: Path) -> None:
    res = _check("--frobnicate", out=tmp_path / "out")
    assert res.returncode == 2 and "unknown argument '--frobnicate'" in res.stderr


def _no_gpu() -> str | None:
    from ocannl.backends.cuda.runtime import cuda_unavailable_reason

    return cuda_unavailable_reason()


@pytest.mark.skipif(_no_gpu() is None, reason="a GPU is usable here: the check would run")
def test_without_a_gpu_the_verdict_is_not_a_pass(tmp_path: Path) -> None:
    """``--only env,tests``: the env part writes its log and finds no GPU, the tests part is
    not run, the last line is the verdict, the exit status 1."""
    out = tmp_path / "out"
    res = _check("--only", "env,tests", out=out)
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[-1].startswith("gpu_check: NOT A PASS: no GPU ("), lines[-1]
    summary = (out / "summary.log").read_text()
    assert re.search(r"^env +NO GPU", summary, flags=re.M), summary
    assert re.search(r"^tests +NO GPU", summary, flags=re.M), summary
    assert "sanitizer" not in summary and "timing " not in summary
    env_log = (out / "env.log").read_text()
    assert "numpy " in env_log and "GPU: " in env_log and "smoke: no GPU" in env_log
    assert "not run: no GPU" in (out / "tests.log").read_text()
    assert summary.strip().splitlines()[-1] == lines[-1]


def test_the_per_test_limit_fails_a_slow_test_and_runs_the_next(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text(
        "import time\n\n"
        "def test_sleeps():\n    time.sleep(30)\n\n"
        "def test_quick():\n    assert True\n")
    env = {**os.environ, "GPU_CHECK_TEST_LIMIT": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "scripts"), os.environ.get("PYTHONPATH",
                                                                                 "")])}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "gpu_check_time_limit", str(tmp_path / "test_slow.py")],
                         capture_output=True, text=True, timeout=25, env=env, cwd=tmp_path)
    assert res.returncode == 1, res.stdout
    assert "test_sleeps ran over its limit of 1 s" in res.stdout
    assert "1 failed, 1 passed" in res.stdout
    env["GPU_CHECK_TEST_LIMIT"] = "soon"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "gpu_check_time_limit", str(tmp_path / "test_slow.py"),
                          "-k", "quick"], capture_output=True, text=True, timeout=25, env=env,
                         cwd=tmp_path)
    assert res.returncode != 0 and "GPU_CHECK_TEST_LIMIT must be whole seconds, got 'soon'" in (
        res.stdout + res.stderr)
