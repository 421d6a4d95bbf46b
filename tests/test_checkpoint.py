"""Checkpoints: exact round trips at every precision, validation that leaves the context alone,
atomic saves, and a SIGKILL'd training run resumed in a fresh process ending bit-identical."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors

import ocannl.tensor as T
from ocannl import Context, Failure, checkpoint, mixed_prec, nn_blocks, optim
from ocannl.checkpoint import Progress
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moons_mixed_precision.py"


def all_bit_patterns(prec: Precision, n: int) -> np.ndarray:
    """``n`` values of ``prec`` covering zeros, subnormals, infinities and NaNs with payloads."""
    if prec.is_narrow:
        bits = np.linspace(0, 65535, n).astype(np.uint16)
        bits[:4] = [0x0000, 0x8000, 0x0001, 0x7C00 if prec is Precision.f16 else 0x7F80]
        return bits.view(prec.numpy_dtype)
    rng = np.random.default_rng(0)
    vals = rng.normal(size=n).astype(prec.numpy_dtype)
    vals[:4] = [0.0, -0.0, np.inf, np.nan]
    vals[4] = np.finfo(prec.numpy_dtype).smallest_subnormal
    return vals


def make_nodes(ctx: Context) -> tuple[Context, list[Tnode]]:
    nodes = []
    for k, prec in enumerate(Precision):
        node = Tnode(f"n_{prec.value}", (3, 4 + k), prec)
        ctx = ctx.set_values(node, all_bit_patterns(prec, node.size))
        nodes.append(node)
    return ctx, nodes


def values(ctx: Context, nodes: list[Tnode]) -> list[bytes]:
    return [ctx.get_values(n).tobytes() for n in nodes]


def test_round_trip_every_precision_bit_exact(tmp_path: Path) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    progress = Progress(step=1234, epoch=7, extra={"loss_scaler": "s=1", "note": "é\n\"x\""})
    path = tmp_path / "ck.safetensors"
    checkpoint.save(path, ctx, nodes, progress)
    other, fresh = Context.cpu(), []
    for n in nodes:
        twin = Tnode(n.label, n.dims, n.prec)  # the same program, run again: new ids
        other = other.set_values(twin, np.zeros(n.size))
        fresh.append(twin)
    other, got = checkpoint.load(path, other, fresh)
    assert got == progress
    assert values(other, fresh) == values(ctx, nodes)
    # f16 and bf16 are stored as themselves, readable by any safetensors reader
    dtypes = {name: t["dtype"] for name, t in safetensors.deserialize(path.read_bytes())}
    assert dtypes == {"n_f64": "F64", "n_f32": "F32", "n_f16": "F16", "n_bf16": "BF16"}
    bf = ctx.get_values(nodes[3])
    assert bf.dtype == ml_dtypes.bfloat16


def test_load_validates_and_leaves_context_unchanged(tmp_path: Path) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    path = tmp_path / "ck.safetensors"
    checkpoint.save(path, ctx, nodes, Progress(step=3))
    target, mine = Context.cpu(), []
    for n in nodes:
        m = Tnode(n.label, n.dims, n.prec)
        target = target.set_values(m, np.full(n.size, 0.5))
        mine.append(m)
    before = values(target, mine)
    wrong_shape = Tnode("n_f32", (4, 3), Precision.f32)
    wrong_prec = Tnode("n_f16", (3, 6), Precision.bf16)
    extra = Tnode("n_extra", (2,), Precision.f32)
    cases = [
        (mine[:2] + [wrong_prec, mine[3]], r"n_f16: precision F16, this model has BF16"),
        ([mine[0], wrong_shape, mine[2], mine[3]], r"n_f32: shape \(3, 5\), this model has "
                                                   r"\(4, 3\)"),
        (mine[:3], r"not in this model \['n_bf16'\]"),
        ([*mine, extra], r"missing \['n_extra'\]"),
    ]
    for case_nodes, message in cases:
        for n in case_nodes:
            if not target.is_initialized(n):
                target = target.set_values(n, np.zeros(n.size))
        with pytest.raises(Failure, match=message):
            checkpoint.load(path, target, case_nodes)
        assert values(target, mine) == before


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", b"\xff" * 64])
def test_load_rejects_files_that_are_not_checkpoints(tmp_path: Path, content: bytes) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    before = values(ctx, nodes)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(Failure, match="not a safetensors checkpoint"):
        checkpoint.load(path, ctx, nodes)
    with pytest.raises(Failure, match="cannot read"):
        checkpoint.load(tmp_path / "absent", ctx, nodes)
    plain = tmp_path / "plain.safetensors"
    import safetensors.numpy as stn

    stn.save_file({"n_f32": np.zeros((3, 5), np.float32)}, plain)
    with pytest.raises(Failure, match="not an ocannl checkpoint"):
        checkpoint.load(plain, ctx, nodes)
    assert values(ctx, nodes) == before


def test_save_validates_progress_and_nodes(tmp_path: Path) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    path = tmp_path / "ck.safetensors"
    for bad in (Progress(step=-1), Progress(epoch=1.5), Progress(extra={"k": 3}),  # type: ignore
                Progress(extra={1: "v"})):  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="Progress"):
            checkpoint.save(path, ctx, nodes, bad)
    with pytest.raises(ValueError, match="more than once"):
        checkpoint.save(path, ctx, [nodes[0], nodes[0]], Progress())
    with pytest.raises(ValueError, match="no buffer"):
        checkpoint.save(path, ctx, [Tnode("nowhere", (2,), Precision.f32)], Progress())
    assert not path.exists() and os.listdir(tmp_path) == []


def test_repeated_labels_are_refused_at_save_and_load_naming_them(tmp_path: Path) -> None:
    """Numbered in list order (``w``, ``w#2``), a program building them the other way round
    would load them swapped without a word (issue 28)."""
    ctx = Context.cpu()
    a, b = Tnode("w", (2,), Precision.f32), Tnode("w", (2,), Precision.f32)
    ctx = ctx.set_values(a, [1, 2]).set_values(b, [3, 4])
    for call in (lambda: checkpoint.save(tmp_path / "c", ctx, [a, b], Progress()),
                 lambda: checkpoint.load(tmp_path / "c", ctx, [a, b]),
                 lambda: checkpoint.node_names([a, b])):
        with pytest.raises(ValueError, match="name more than one node") as err:
            call()
        assert f"'w': {a.name} (2,), {b.name} (2,)" in str(err.value)
        assert "label=" in str(err.value)
    assert os.listdir(tmp_path) == []  # nothing written
    assert ctx.get_values(a).tolist() == [1, 2] and ctx.get_values(b).tolist() == [3, 4]


def test_two_blocks_of_the_default_label_cannot_be_saved(tmp_path: Path) -> None:
    x = T.term(np.ones((4, 3)), label="x")
    h, _ = nn_blocks.mlp(x, [4], 3)
    out, _ = nn_blocks.mlp(h, [4], 2)  # the same default label "mlp"
    y = T.term(np.eye(2)[[0, 1, 0, 1]], label="y")
    loss = nn_blocks.softmax_cross_entropy(out, y)
    from ocannl import train

    ctx = train.init_params(Context.cpu(), loss)
    state = checkpoint.training_state(loss, optim.Adam(0.01))
    with pytest.raises(ValueError, match="'mlp_w0'") as err:
        checkpoint.save(tmp_path / "c", ctx, state, Progress())
    assert "'mlp_b1'" in str(err.value) and not (tmp_path / "c").exists()


def test_save_into_a_missing_folder_names_the_path_given(tmp_path: Path) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    path = tmp_path / "no_such_folder" / "ck.safetensors"
    with pytest.raises(FileNotFoundError) as err:
        checkpoint.save(path, ctx, nodes, Progress())
    text = str(err.value)
    assert str(path) in text and "does not exist" in text and ".tmp" not in text
    file_as_folder = tmp_path / "plain"
    file_as_folder.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="it is a file") as err:
        checkpoint.save(file_as_folder / "ck", ctx, nodes, Progress())
    assert ".tmp" not in str(err.value)
    assert os.listdir(tmp_path) == ["plain"]


def test_save_onto_a_folder_names_the_path_given(tmp_path: Path) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    folder = tmp_path / "runs"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as err:
        checkpoint.save(folder, ctx, nodes, Progress())
    text = str(err.value)
    assert f"checkpoint.save {str(folder)!r} is a folder: give a file name" in text, text
    assert ".tmp" not in text
    assert os.listdir(tmp_path) == ["runs"] and os.listdir(folder) == []


def saved_with_optimizer_state(tmp_path: Path) -> tuple[Path, list[Tnode], list[Tnode]]:
    """A checkpoint of two "parameters" and an "optimizer buffer"; (its path, the parameters,
    everything saved)."""
    ctx = Context.cpu()
    w = Tnode("w", (2, 3), Precision.f32)
    b = Tnode("b", (3,), Precision.bf16)
    m = Tnode("adam_m_w", (2, 3), Precision.f32)
    for k, node in enumerate((w, b, m)):
        ctx = ctx.set_values(node, np.arange(node.size) * 0.5 + k)
    path = tmp_path / "ck.safetensors"
    checkpoint.save(path, ctx, [w, b, m], Progress(step=9, extra={"note": "x"}))
    return path, [w, b], [w, b, m]


def test_load_weights_takes_the_parameters_of_a_checkpoint_holding_more(tmp_path: Path) -> None:
    """For evaluation or fine-tuning: the parameters alone, the optimizer state left in the
    file (``load``, which resumes, needs exactly the saved set)."""
    path, params, everything = saved_with_optimizer_state(tmp_path)
    w, b = Tnode("w", (2, 3), Precision.f32), Tnode("b", (3,), Precision.bf16)
    ctx, progress = checkpoint.load_weights(path, Context.cpu(), [w, b])
    assert progress.step == 9 and progress.extra == {"note": "x"}
    assert values(ctx, [w, b]) == [(np.arange(6) * 0.5).astype(np.float32).tobytes(),
                                   (np.arange(3) * 0.5 + 1).astype(ml_dtypes.bfloat16).tobytes()]
    with pytest.raises(Failure, match=r"not in this model \['adam_m_w'\]"):
        checkpoint.load(path, Context.cpu(), [w, b])


@pytest.mark.parametrize(("node", "said"), [
    (Tnode("v", (2, 3), Precision.f32), "missing ['v']"),
    (Tnode("w", (3, 2), Precision.f32), "w: shape (2, 3), this model has (3, 2)"),
    (Tnode("w", (2, 3), Precision.f16), "w: precision F32, this model has F16"),
])
def test_load_weights_refuses_a_parameter_not_saved_as_asked_naming_it(
        tmp_path: Path, node: Tnode, said: str) -> None:
    path, _, _ = saved_with_optimizer_state(tmp_path)
    b = Tnode("b", (3,), Precision.bf16)
    ctx = Context.cpu().set_values(b, np.full(3, 7.0)).set_values(node, np.full(6, 5.0))
    with pytest.raises(Failure) as err:
        checkpoint.load_weights(path, ctx, [b, node])
    assert said in str(err.value) and str(path) in str(err.value), str(err.value)
    assert values(ctx, [b, node]) == [np.full(3, 7.0, ml_dtypes.bfloat16).tobytes(),
                                      np.full(6, 5.0, node.prec.numpy_dtype).tobytes()]


@pytest.mark.parametrize("fail_at", ["fsync", "replace", "write"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, fail_at: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, nodes = make_nodes(Context.cpu())
    path = tmp_path / "ck.safetensors"
    checkpoint.save(path, ctx, nodes, Progress(step=1))
    old_bytes = path.read_bytes()
    ctx = ctx.set_values(nodes[1], np.ones(nodes[1].size))

    def crash(*_args: object, **_kwargs: object) -> None:
        raise OSError(f"simulated crash in {fail_at}")

    if fail_at == "write":
        real_fdopen = os.fdopen

        class Broken:
            def __init__(self, fh: object) -> None:
                self.fh = fh

            def __enter__(self) -> Broken:
                return self

            def __exit__(self, *exc: object) -> None:
                self.fh.close()  # type: ignore[attr-defined]

            def write(self, data: bytes) -> None:
                self.fh.write(data[: len(data) // 2])  # type: ignore[attr-defined]
                raise OSError("simulated crash in write")

        monkeypatch.setattr(os, "fdopen", lambda fd, mode: Broken(real_fdopen(fd, mode)))
    else:
        monkeypatch.setattr(os, fail_at, crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save(path, ctx, nodes, Progress(step=2))
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors"]  # no temporary file left
    fresh = Context.cpu()
    fresh, progress = checkpoint.load(path, fresh, nodes)
    assert progress.step == 1


def test_training_state_is_masters_and_optimizer_buffers() -> None:
    x = T.term(np.zeros((8, 2)), label="x", prec="f16")
    y = T.term(np.zeros((8, 2)), label="y")
    logits, _ = mixed_prec.with_master_weights(prec="f16",
                                               f=lambda: nn_blocks.mlp(x, [4], 2))
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32"), y)
    sc = mixed_prec.Loss_scaler.create()
    opt = optim.SGD(0.1, momentum=0.9)
    early = checkpoint.training_state(loss, opt)  # before the update is built: the same list
    recipe = mixed_prec.scaled_step(sc, loss, opt)
    nodes = checkpoint.training_state(loss, opt)
    assert nodes == early and recipe.state_nodes() == []
    params = loss.params
    assert nodes[:len(params)] == [p.value for p in params]
    assert nodes[len(params):] == [opt.state_of(p)["momentum"] for p in params]
    assert all(n.prec is Precision.f32 and n.zero_start for n in nodes[len(params):])
    assert all(n.prec is Precision.f32 for n in nodes)
    ids = {n.id for n in nodes}
    assert not ids & {sc.scale.value.id, sc.unscale.value.id, x.value.id, y.value.id}
    with pytest.raises(TypeError, match="optimizer"):
        checkpoint.training_state(loss, None)  # type: ignore[arg-type]
    plain = optim.SGD(0.1)  # no momentum: parameters only
    assert checkpoint.training_state(loss, plain) == [p.value for p in params]


# --- resume after SIGKILL ---------------------------------------------------------------------


def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), "--backend", "cpu", "--no-progress",
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def read_checkpoint(path: Path) -> tuple[dict[str, bytes], dict]:
    data = path.read_bytes()
    tensors = {name: bytes(t["data"]) for name, t in safetensors.deserialize(data)}
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return tensors, json.loads(header["__metadata__"]["progress"])


def sigkill_then_resume(tmp_path: Path, common: list[str], steps: int
                        ) -> tuple[subprocess.CompletedProcess, dict[str, bytes], dict]:
    """Run the example with ``common`` flags for ``steps`` steps uninterrupted; run it again,
    SIGKILL it after a checkpoint at step 200 or later, resume it; assert both runs end with
    the same checkpoint bytes and progress. Returns the uninterrupted run and its checkpoint."""
    common = [*common, "--steps", str(steps), "--checkpoint-every", "100", "--no-plot"]
    whole = tmp_path / "whole.safetensors"
    done = run_example(*common, "--checkpoint", str(whole))
    assert done.returncode == 0, done.stderr

    killed = tmp_path / "killed.safetensors"
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--backend", "cpu", "--no-progress",
                             *common, "--checkpoint", str(killed)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            m = re.match(r"checkpoint: step (\d+)", line)
            if m and int(m[1]) >= 200:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    _, at_kill = read_checkpoint(killed)
    assert 200 <= at_kill["step"] < steps

    resumed = run_example(*common, "--checkpoint", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {killed} at step {at_kill['step']}" in resumed.stdout

    want_tensors, want_progress = read_checkpoint(whole)
    got_tensors, got_progress = read_checkpoint(killed)
    assert got_progress == want_progress  # step, scale, good steps, recipe counters (in extra)
    assert got_tensors == want_tensors  # masters, optimizer state (and the fused gate's count)
    assert "loss_scaler" in want_progress["extra"]
    assert want_progress["step"] == steps
    return done, want_tensors, want_progress


@pytest.mark.parametrize("gate", ["host", "fused"])
def test_sigkill_then_resume_ends_bit_identical(tmp_path: Path, gate: str) -> None:
    common = ["--gate", gate, "--inject-nonfinite", "195,1234,2500,2501"]
    done, _, _ = sigkill_then_resume(tmp_path, common, 4000)
    windows = re.search(r"skipped (?:windows|steps): (\d+)", done.stdout)
    assert windows is not None and int(windows[1]) >= 4  # the injected steps were skipped


def test_example_default_run_reaches_accuracy_and_plots(tmp_path: Path) -> None:
    plot = tmp_path / "curves.png"
    done = run_example("--plot", str(plot))
    assert done.returncode == 0, done.stderr
    m = re.search(r"accuracy: ([0-9.]+)%", done.stdout)
    assert m is not None and float(m[1]) >= 97.0, done.stdout
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_cuda_without_gpu_fails_clearly() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--backend", "cuda", "--steps", "2",
                           "--no-plot", "--no-progress"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    if done.returncode == 0:  # a GPU is usable here: then it simply ran
        assert "backend cuda" in done.stdout
        return
    assert "--backend cuda needs an NVIDIA GPU" in done.stderr
    assert "Traceback" not in done.stderr
