"""examples/moons_mixed_precision.py: flags checked up front, resumes that refuse another
configuration, and a resumed run that reports what the uninterrupted one reports."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "moons_mixed_precision.py"
TIMEOUT_S = 300


def _load():
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("moons_mixed_precision_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ex = _load()


def parse_exit(argv: list[str]) -> tuple[int | str | None, str]:
    """Parse ``argv`` with the example's parser, expecting an exit; (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        with pytest.raises(SystemExit) as info:
            ex.parse_args(argv)
    return info.value.code, err.getvalue()


def assert_clean_usage_error(argv: list[str], *mentions: str) -> str:
    code, err = parse_exit(argv)
    assert code == 2, (argv, code, err)
    assert err.endswith("\n") and err.count("\n") == 1, (argv, err)
    assert "error:" in err and "Traceback" not in err, err
    for m in mentions:
        assert m in err, (argv, m, err)
    return err


def run(*args: str, cwd: Path = ROOT, progress: bool = False) -> subprocess.CompletedProcess:
    flags = ["--backend", "cpu", "--no-plot"] + ([] if progress else ["--no-progress"])
    return subprocess.run([sys.executable, str(EXAMPLE), *flags, *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=cwd)


# --- flags ----------------------------------------------------------------------------------

BAD = [
    (["--batch", "1000"], "--batch"),  # more than the 512 training points
    (["--batch", "0"], "--batch"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "-0.1"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "1e-60"], "--lr"),  # rounds to 0 in f32
    (["--lr", "abc"], "--lr"),
    (["--momentum", "1.5"], "--momentum"),
    (["--momentum", "1"], "--momentum"),
    (["--momentum", "-0.5"], "--momentum"),
    (["--momentum", "nan"], "--momentum"),
    (["--init-scale", "0"], "--init-scale"),
    (["--init-scale", "-1"], "--init-scale"),
    (["--init-scale", "1e39"], "--init-scale"),  # past f32
    (["--init-scale", "inf"], "--init-scale"),
    (["--growth-interval", "0"], "--growth-interval"),
    (["--growth-interval", str(10**19)], "--growth-interval"),
    (["--check-interval", "0"], "--check-interval"),
    (["--check-interval", str(2**24 + 1)], "--check-interval"),
    (["--steps", "0"], "--steps"),
    (["--steps", "1.5"], "--steps"),
    (["--checkpoint-every", "-3"], "--checkpoint-every"),
    (["--seed", "-1"], "--seed"),
    (["--inject-nonfinite", "5,x"], "--inject-nonfinite"),
    (["--inject-nonfinite", "1_0"], "--inject-nonfinite"),
    (["--inject-nonfinite", "-3"], "--inject-nonfinite"),
    (["--inject-nonfinite", "600"], "--inject-nonfinite"),  # past the last step (599)
    (["--plot", "/nonexistent-folder/x.png"], "--plot"),
    (["--plot", "curves.bogus"], "--plot"),
    (["--checkpoint", "/"], "--checkpoint"),
    (["--checkpoint", "/nonexistent-folder/c.safetensors"], "--checkpoint"),
    (["--resume"], "--resume"),
    (["--override-config", "lr"], "--override-config"),  # without --resume
    (["--checkpoint", "c.st", "--resume", "--override-config", "bogus"], "bogus"),
    (["--checkpoint", "c.st", "--resume", "--override-config", "batch"], "batch"),
    (["--checkpoint", "c.st", "--resume", "--override-config", "gate"], "gate"),
    (["--checkpoint", "c.st", "--resume", "--override-config", "steps"], "steps"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_is_a_one_line_usage_error(argv: list[str], flag: str) -> None:
    assert_clean_usage_error(argv, flag)


def test_check_interval_with_the_host_gate_is_refused() -> None:
    """The interval belongs to the fused gate; the host gate samples every step and would
    ignore it without a word."""
    err = assert_clean_usage_error(["--gate", "host", "--check-interval", "4"])
    assert "--check-interval 4 applies to --gate fused only" in err, err
    assert ex.parse_args(["--gate", "host"]).check_interval is None
    assert ex.parse_args([]).check_interval == 16


@pytest.mark.parametrize("flag", [["--shards", "4"], ["--shard-optimizer"], ["--overlap"]])
def test_data_parallel_settings_without_data_parallel_are_refused(flag: list[str]) -> None:
    """Ignored without a word, they would leave a user believing the run was sharded."""
    err = assert_clean_usage_error(flag)
    assert f"{flag[0]} applies to --data-parallel only" in err, err


def test_batch_past_the_training_set_fails_before_any_work() -> None:
    done = run("--batch", "1000")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "ZeroDivisionError" not in done.stderr
    assert done.stderr.count("\n") == 1 and "--batch" in done.stderr and "512" in done.stderr
    assert done.stdout == ""


def test_good_flags_parse() -> None:
    args = ex.parse_args(["--batch", "512", "--lr", "1e-3", "--momentum", "0", "--steps", "3",
                          "--inject-nonfinite", "0, 2", "--init-scale", "1"])
    assert args.batch == 512 and args.inject == {0, 2} and args.momentum == 0.0


def test_help_shows_every_default() -> None:
    parser = ex.build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest == "help":
            continue
        d = action.default
        if isinstance(d, (int, float, str, Path)) and not isinstance(d, bool) and d != "":
            assert f"(default: {d})" in text, (action.option_strings, text)
    n = sum(1 for a in parser._actions if a.dest != "help")
    assert text.count("(default:") == n


# --- the fuzz: nothing but a clean usage error, and no file written ---------------------------

INT_FLAGS = ["--steps", "--batch", "--check-interval", "--growth-interval", "--checkpoint-every",
             "--seed"]
FLOAT_FLAGS = ["--lr", "--momentum", "--init-scale"]

junk = st.one_of(
    st.sampled_from(["", " ", "nan", "-nan", "inf", "-inf", "1e999", "-1e999", "0x10", "1_0",
                     "١", "½", "--", "-1", "0", "1e-400", "NaN", "+inf", "1,2", "None"]),
    st.text(max_size=12),
)


def bad_value(flag: str) -> st.SearchStrategy[str]:
    if flag == "--batch":
        bad_int = st.one_of(st.integers(max_value=0), st.integers(min_value=513))
    elif flag == "--seed":
        bad_int = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63))
    elif flag == "--check-interval":
        bad_int = st.one_of(st.integers(max_value=0), st.integers(min_value=2**24 + 1))
    else:
        bad_int = st.integers(max_value=0)
    if flag in INT_FLAGS:  # a float's repr always has a '.', an 'e', 'inf' or 'nan'
        return st.one_of(bad_int.map(str), st.floats().map(repr),
                         junk.filter(lambda s: not _is_int(s)))
    if flag == "--lr":
        bad = st.one_of(st.floats(max_value=0.0), st.floats(min_value=3.5e38),
                        st.floats(min_value=0.0, max_value=1e-46, exclude_min=True))
    elif flag == "--momentum":
        bad = st.one_of(st.floats(max_value=-1e-300), st.floats(min_value=1.0))
    else:  # --init-scale
        bad = st.one_of(st.floats(max_value=0.0), st.floats(min_value=3.5e38))
    nonfinite = st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity"])
    return st.one_of(bad.map(repr), nonfinite, junk.filter(lambda s: not _is_float(s)))


def _is_int(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return False
    return True


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


good_flags = st.lists(st.sampled_from([
    ["--gate", "host"], ["--gate", "fused"], ["--optimizer", "adam"], ["--steps", "50"],
    ["--batch", "32"], ["--lr", "0.05"], ["--no-progress"], ["--no-plot"], ["--seed", "7"],
    ["--backend", "cpu"], ["--check-interval", "4"], ["--checkpoint-every", "10"],
]), max_size=3).map(lambda xs: [a for x in xs for a in x])

bad_argv = st.one_of(
    st.sampled_from(INT_FLAGS + FLOAT_FLAGS).flatmap(
        lambda f: bad_value(f).map(lambda v: [f"{f}={v}"])),
    st.sampled_from(["--gate", "--optimizer", "--backend"]).flatmap(
        lambda f: junk.filter(lambda v: v not in ("host", "fused", "sgd", "adam", "adamw",
                                                  "auto", "cpu", "cuda")).map(
            lambda v: [f"{f}={v}"])),
    st.integers(min_value=50).map(lambda s: ["--steps", "50", "--inject-nonfinite", str(s)]),
    junk.filter(lambda s: not all(re.fullmatch("[0-9]*", k.strip()) for k in s.split(","))).map(
        lambda v: [f"--inject-nonfinite={v}"]),
    st.sampled_from(["batch", "gate", "seed", "optimizer", "init-scale", "growth-interval",
                     "steps", "nope", " , "]).map(
        lambda k: ["--checkpoint", "c.st", "--resume", "--override-config", k]),
    st.text(min_size=1, max_size=10).map(lambda s: [f"--no-such-{s}"]),
)


def _files(where: Path) -> list[str]:
    return sorted(str(p.relative_to(where)) for p in where.rglob("*"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=bad_argv, before=good_flags, after=good_flags)
def test_fuzz_bad_flags_give_only_a_usage_error(bad: list[str], before: list[str],
                                                after: list[str]) -> None:
    argv = before + bad + after
    here = os.getcwd()
    with _scratch_dir() as scratch:
        try:
            os.chdir(scratch)
            code, err = parse_exit(argv)
        finally:
            os.chdir(here)
        assert code == 2, (argv, code, err)
        assert err.count("\n") == 1 and err.endswith("\n") and "error:" in err, (argv, err)
        assert _files(scratch) == [], argv


@settings(max_examples=60, deadline=None)
@given(argv=st.lists(st.one_of(st.sampled_from(
    [*INT_FLAGS, *FLOAT_FLAGS, "--gate", "--resume", "--checkpoint", "--override-config",
     "--inject-nonfinite", "--plot", "--no-plot", "1", "0", "-1", "nan", "fused", "lr"]),
    st.text(max_size=8)), max_size=6))
def test_fuzz_any_argv_parses_or_exits_cleanly(argv: list[str]) -> None:
    here = os.getcwd()
    with _scratch_dir() as scratch:
        out = io.StringIO()
        err = io.StringIO()
        try:
            os.chdir(scratch)
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                ex.parse_args(argv)
        except SystemExit as e:
            if e.code == 0:  # -h / --help
                assert out.getvalue().startswith("usage:")
            else:
                assert e.code == 2 and err.getvalue().count("\n") == 1, (argv, err.getvalue())
        finally:
            os.chdir(here)
        assert _files(scratch) == [], argv


@contextlib.contextmanager
def _scratch_dir():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


# --- the progress bar -----------------------------------------------------------------------


def test_progress_bar_shows_no_nan_before_the_first_sample() -> None:
    done = run("--steps", "24", "--check-interval", "16", progress=True)
    assert done.returncode == 0, done.stderr
    posts = re.findall(r"loss=([^,\]\s]+)", done.stderr)
    assert posts, done.stderr
    assert "nan" not in done.stderr.lower(), done.stderr
    assert posts[0] == "-", posts  # steps 0 and 10: nothing sampled yet
    assert re.fullmatch(r"\d+\.\d+", posts[-1]), posts  # step 20: the window of step 15


# --- resume: the configuration --------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fused-gate SGD checkpoint at step 20 (default settings otherwise)."""
    path = tmp_path_factory.mktemp("resume") / "run.safetensors"
    done = run("--steps", "20", "--checkpoint-every", "10", "--checkpoint", str(path))
    assert done.returncode == 0, done.stderr
    return path


def resume(path: Path, *args: str) -> subprocess.CompletedProcess:
    return run("--steps", "40", "--checkpoint", str(path), "--resume", *args)


CHANGED = [
    (["--lr", "0.05"], {"lr": ("0.1", "0.05")}),
    (["--batch", "32"], {"batch": ("64", "32")}),
    (["--seed", "3"], {"seed": ("0", "3")}),
    (["--momentum", "0.5"], {"momentum": ("0.9", "0.5")}),
    (["--optimizer", "adam"], {"optimizer": ("sgd", "adam")}),
    (["--gate", "host"], {"gate": ("fused", "host")}),
    (["--check-interval", "8"], {"check-interval": ("16", "8")}),
    (["--init-scale", "1024"], {"init-scale": ("65536.0", "1024.0")}),
    (["--growth-interval", "20"], {"growth-interval": ("50", "20")}),
    (["--inject-nonfinite", "30"], {"inject-nonfinite": ("", "30")}),
    (["--lr", "0.2", "--seed", "1", "--batch", "16"],
     {"lr": ("0.1", "0.2"), "seed": ("0", "1"), "batch": ("64", "16")}),
]


@pytest.mark.parametrize(("args", "diffs"), CHANGED, ids=[" ".join(a) for a, _ in CHANGED])
def test_resume_with_other_settings_stops_naming_each(saved: Path, args: list[str],
                                                      diffs: dict[str, tuple[str, str]]) -> None:
    before = saved.read_bytes()
    done = resume(saved, *args)
    assert done.returncode == 1, (done.stdout, done.stderr)
    err = done.stderr
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and "does not match the model" not in err, err
    for name, (old, new) in diffs.items():
        assert re.search(rf"--{name} {re.escape(old) or '(none)'} .*{re.escape(new) or '(none)'}",
                         err) or (f"--{name} {old or '(none)'}" in err
                                  and f"{new or '(none)'}" in err), (name, err)
    fixed = {"gate", "optimizer", "batch", "seed", "growth-interval", "init-scale"}
    if set(diffs) - fixed:  # the way to continue anyway is said
        assert f"--override-config {','.join(k for k in diffs if k not in fixed)} " in err, err
    for k in set(diffs) & fixed:
        assert f"--{k} can never change" in err, err
    assert saved.read_bytes() == before  # nothing was trained nor saved
    assert "resumed" not in done.stdout


def test_resume_with_overridden_lr_continues_and_records_it(saved: Path,
                                                            tmp_path: Path) -> None:
    path = tmp_path / "run.safetensors"
    path.write_bytes(saved.read_bytes())
    done = resume(path, "--lr", "0.05", "--override-config", "lr")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "at step 20" in done.stdout
    assert "--lr" in done.stdout and "0.05" in done.stdout  # the override is said
    again = run("--steps", "50", "--checkpoint", str(path), "--resume", "--lr", "0.05")
    assert again.returncode == 0, again.stderr  # the checkpoint now records lr 0.05
    back = run("--steps", "60", "--checkpoint", str(path), "--resume")
    assert back.returncode == 1 and "--lr 0.05" in back.stderr, back.stderr


def test_override_cannot_switch_momentum_on_or_off(saved: Path) -> None:
    done = resume(saved, "--momentum", "0", "--override-config", "momentum")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "--momentum" in done.stderr and "Traceback" not in done.stderr


def test_resume_past_the_step_budget_refuses(saved: Path) -> None:
    done = run("--steps", "10", "--checkpoint", str(saved), "--resume")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "step 20" in done.stderr and "--steps 10" in done.stderr


def test_resume_from_a_checkpoint_without_settings_refuses(tmp_path: Path) -> None:
    import numpy as np

    import ocannl.tensor as T
    from ocannl import Context, checkpoint

    path = tmp_path / "old.safetensors"
    t = T.term(np.zeros(3, np.float32), label="w")
    ctx = Context.cpu().set_values(t, np.zeros(3))
    checkpoint.save(path, ctx, [t.value], checkpoint.Progress(step=10, extra={"gate": "fused"}))
    done = resume(path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "does not record the settings" in done.stderr and "Traceback" not in done.stderr


def test_checkpoint_records_the_configuration(saved: Path) -> None:
    data = saved.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    extra = json.loads(header["__metadata__"]["progress"])["extra"]
    config = json.loads(extra["config"])
    assert config == {"gate": "fused", "optimizer": "sgd", "batch": "64", "seed": "0",
                      "lr": "0.1", "momentum": "0.9", "check-interval": "16",
                      "init-scale": "65536.0", "growth-interval": "50",
                      "inject-nonfinite": ""}


# --- resume: the report ---------------------------------------------------------------------


def summary(stdout: str) -> list[str]:
    """The lines after the ``backend ..., compile ... s`` line (the report)."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("backend "))
    return lines[at + 1:]


@pytest.mark.parametrize("gate", ["fused", "host"])
def test_killed_and_resumed_run_reports_what_the_uninterrupted_one_does(tmp_path: Path,
                                                                       gate: str) -> None:
    # 300 steps: the fused gate's last window (288..299) is partial; steps 40, 41 and 250 get
    # an infinity, so both segments skip steps.
    common = ["--gate", gate, "--steps", "300", "--checkpoint-every", "100",
              "--inject-nonfinite", "40,41,250", "--growth-interval", "20",
              *(["--check-interval", "16"] if gate == "fused" else [])]
    whole = run(*common, "--checkpoint", str(tmp_path / "whole.safetensors"))
    assert whole.returncode == 0, whole.stderr
    want = summary(whole.stdout)
    assert want[0].startswith("final loss ") and want[-1].startswith("accuracy: "), want
    # every step counted, the last partial window of the fused gate included
    assert "skipped steps: " in want[0] and " of 300" in want[0], want
    if gate == "fused":
        assert want[0].endswith(" of 19)"), want  # 18 full windows of 16, then 12 steps

    path = tmp_path / "killed.safetensors"
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--backend", "cpu", "--no-plot",
                             "--no-progress", *common, "--checkpoint", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("checkpoint: step 100 "):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    resumed = run(*common, "--checkpoint", str(path), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"resumed from .* at step \d+", resumed.stdout), resumed.stdout
    assert summary(resumed.stdout) == want

    # killed after its last save: nothing left to train, the same report
    again = run(*common, "--checkpoint", str(path), "--resume")
    assert again.returncode == 0, again.stderr
    assert "at step 300" in again.stdout
    assert summary(again.stdout) == want


# --- another program's checkpoint, and MPI launchers (issue 28) -------------------------------


def test_resume_from_another_programs_checkpoint_names_that_program(tmp_path: Path) -> None:
    """Not "written by an older version": the digits example wrote it."""
    import numpy as np

    import ocannl.tensor as T
    from ocannl import Context, checkpoint

    path = tmp_path / "digits.safetensors"
    t = T.term(np.zeros(3, np.float32), label="w")
    ctx = Context.cpu().set_values(t, np.zeros(3))
    config = json.dumps({"prec": "f16", "batch": "64", "lr": "0.003", "seed": "0"})
    checkpoint.save(path, ctx, [t.value], checkpoint.Progress(
        step=10, extra={"program": "digits_convnet.py", "config": config}))
    done = resume(path)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "written by digits_convnet.py, not by moons_mixed_precision.py" in done.stderr
    assert "older version" not in done.stderr
    untagged = tmp_path / "untagged.safetensors"
    checkpoint.save(untagged, ctx, [t.value],
                    checkpoint.Progress(step=10, extra={"config": config}))
    done = resume(untagged)
    assert done.returncode == 1, done.stderr
    assert "settings this program does not have (prec)" in done.stderr


def test_several_mpi_processes_without_data_parallel_are_refused(tmp_path: Path) -> None:
    """Under mpiexec -n 2 without --data-parallel, two identical runs wrote the same files."""
    ckpt = tmp_path / "run.safetensors"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--backend", "cpu", "--no-plot",
                           "--no-progress", "--checkpoint", str(ckpt)], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          env={**os.environ, "PMI_SIZE": "2", "PMI_RANK": "0"})
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "one of 2 MPI processes (PMI_SIZE=2)" in done.stderr
    assert "add --data-parallel" in done.stderr and not ckpt.exists()


def test_checkpoint_records_the_program(saved: Path) -> None:
    from ocannl import checkpoint

    assert checkpoint.read_progress(saved).extra["program"] == "moons_mixed_precision.py"


def test_under_a_real_mpiexec_without_data_parallel_every_rank_refuses(tmp_path: Path) -> None:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec in this environment (pip install mpich)")
    ckpt = tmp_path / "run.safetensors"
    done = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(EXAMPLE), "--backend",
                           "cpu", "--no-plot", "--no-progress", "--checkpoint", str(ckpt)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          start_new_session=True)
    assert done.returncode != 0, done.stdout
    assert done.stderr.count("was started as one of 2 MPI processes (PMI_SIZE=2)") == 2, \
        done.stderr
    assert "accuracy" not in done.stdout and not ckpt.exists()


@pytest.mark.parametrize("gate", ["fused", "host"])
def test_a_skip_is_reported_with_the_names_of_the_overflowing_parameters(gate: str) -> None:
    """An infinity in the batch at steps 40 and 41 poisons every gradient: the host learns of
    it at the window's end (fused: the window of 16 ending at step 48, both steps) or at once
    (host: a line per step), and the example names the parameters (``Recipe.last_overflow``)."""
    out = run("--gate", gate, "--steps", "60", "--inject-nonfinite", "40,41")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "skipped since the last check" in line]
    names = "non-finite gradients in mlp_w0, mlp_b0, mlp_w1, mlp_b1, mlp_w2, mlp_b2"
    if gate == "fused":
        assert lines == [f"step 48: 2 steps skipped since the last check ({names}); loss "
                         f"scale now 32768"], out.stdout
    else:
        assert [line.split(":")[0] for line in lines] == ["step 41", "step 42"], out.stdout
        assert all(names in line for line in lines), lines
