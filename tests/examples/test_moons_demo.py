"""examples/moons_demo.py: every flag checked before any work, one-line usage errors."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "moons_demo.py"


def _load():
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("moons_demo_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


demo = _load()


def parse_exit(argv: list[str]) -> tuple[int | str | None, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as info:
            demo.parse_args(argv)
    return info.value.code, err.getvalue()


BAD = [
    (["--batch", "2000"], "--batch"),  # more than the 1024 points: no step at all
    (["--points", "10", "--batch", "20"], "--batch"),
    (["--batch", "0"], "--batch"),
    (["--points", "1"], "--points"),
    (["--points", "10000000000"], "--points"),
    (["--epochs", "0"], "--epochs"),
    (["--epochs", "2.5"], "--epochs"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "-inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "1e39"], "--lr"),
    (["--seed", "-1"], "--seed"),
    (["--png", "/nonexistent-folder/b.png"], "--png"),
    (["--png", "b.jpg"], "--png"),
    (["--png", "/"], "--png"),
    (["--lr=--"], "--lr"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_is_a_one_line_usage_error(argv: list[str], flag: str) -> None:
    code, err = parse_exit(argv)
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "error:" in err, err
    assert flag in err and "Traceback" not in err, err


def test_batch_past_the_points_is_refused_not_an_untrained_model() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--batch", "2000"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and "--batch 2000" in done.stderr, done.stderr
    assert "accuracy" not in done.stdout


def test_help_shows_every_default() -> None:
    parser = demo.build_parser()
    text = " ".join(parser.format_help().split())
    actions = [a for a in parser._actions if a.dest != "help"]
    for a in actions:
        assert f"(default: {a.default})" in text, (a.option_strings, text)
    assert text.count("(default:") == len(actions)


def test_good_flags_parse() -> None:
    args = demo.parse_args(["--points", "64", "--batch", "64", "--epochs", "1", "--lr", "1e-3"])
    assert (args.points, args.batch, args.epochs, args.lr) == (64, 64, 1, 1e-3)


def test_small_run_trains_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "boundary.png"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--points", "256", "--batch", "32",
                           "--epochs", "8", "--png", str(png)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "training accuracy:" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


bad_value = {
    "--points": st.one_of(st.integers(max_value=1), st.integers(min_value=10**6 + 1)),
    "--batch": st.one_of(st.integers(max_value=0), st.integers(min_value=10**6 + 1)),
    "--epochs": st.integers(max_value=0),
    "--seed": st.integers(max_value=-1),
}
junk = st.one_of(st.sampled_from(["", "nan", "inf", "-", "--", "1e999", "0x1", "1.0"]),
                 st.text(max_size=10))


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


def _is_real(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


bad_argv = st.one_of(
    st.sampled_from(sorted(bad_value)).flatmap(
        lambda f: st.one_of(bad_value[f].map(str), junk.filter(lambda s: not _is_int(s))).map(
            lambda v: [f"{f}={v}"])),
    st.one_of(st.floats(max_value=0.0), st.floats(min_value=3.5e38)).map(
        lambda v: [f"--lr={v!r}"]),
    junk.filter(lambda s: not _is_real(s)).map(lambda v: [f"--lr={v}"]),
    st.integers(min_value=2, max_value=1000).flatmap(
        lambda n: st.integers(min_value=n + 1, max_value=10**6).map(
            lambda b: ["--points", str(n), "--batch", str(b)])),
    junk.filter(lambda s: not s.lower().endswith(".png")).map(lambda v: [f"--png={v}"]),
)


@settings(max_examples=60, deadline=None)
@given(bad=bad_argv, extra=st.lists(st.sampled_from(["--epochs=2", "--seed=3", "--lr=0.5"]),
                                    max_size=2))
def test_fuzz_bad_flags_give_only_a_usage_error(bad: list[str], extra: list[str]) -> None:
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        try:
            os.chdir(scratch)
            code, err = parse_exit(extra + bad)
        finally:
            os.chdir(here)
        assert code == 2, (bad, code, err)
        assert err.count("\n") == 1 and err.endswith("\n") and "error:" in err, (bad, err)
        assert os.listdir(scratch) == []
