"""Checkpoints refuse what is not exactly what was saved: a flipped bit in any tensor or in the
header, an older file without digests, crafted progress nested too deeply; killed saves leave
no temporary behind for long (the next save or load of that checkpoint removes them, never a
live writer's); and a fuzz of mutated files and wrong nodes only ever raises ``Failure``,
leaving the context and the files as they were."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ocannl import Context, Failure, checkpoint
from ocannl.checkpoint import Progress
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def model(ctx: Context, fill: float | None = None) -> tuple[Context, list[Tnode]]:
    """One node per precision, with distinct values (or ``fill``)."""
    nodes = []
    for k, prec in enumerate(Precision):
        node = Tnode(f"n_{prec.value}", (2, 3 + k), prec)
        vals = np.arange(node.size) * 0.25 - 1 + k if fill is None else np.full(node.size, fill)
        ctx = ctx.set_values(node, vals)
        nodes.append(node)
    return ctx, nodes


def snapshot(ctx: Context, nodes: list[Tnode]) -> list[bytes]:
    return [ctx.get_values(n).tobytes() for n in nodes]


def by_label(ctx: Context, nodes: list[Tnode]) -> dict[str, bytes]:
    return {n.label: ctx.get_values(n).tobytes() for n in nodes}


def saved(tmp: Path, name: str = "ck.safetensors") -> tuple[Path, list[bytes], Progress]:
    ctx, nodes = model(Context.cpu())
    progress = Progress(step=41, epoch=2, extra={"loss_scaler": "s", "note": "x"})
    path = tmp / name
    checkpoint.save(path, ctx, nodes, progress)
    return path, snapshot(ctx, nodes), progress


def data_ranges(blob: bytes) -> dict[str, tuple[int, int]]:
    """Where each tensor's bytes lie in the file."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def reserialize(blob: bytes, *, meta_edit=None, tensor_edit=None) -> bytes:  # noqa: ANN001
    """The file rebuilt from its tensors and metadata, after the edits."""
    n = int.from_bytes(blob[:8], "little")
    meta = dict(json.loads(blob[8:8 + n])["__metadata__"])
    tensors = {name: {"dtype": SPEC[t["dtype"]], "shape": list(t["shape"]),
                      "data": bytes(t["data"])}
               for name, t in safetensors.deserialize(blob)}
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors)
    arrays = {}
    for name, t in tensors.items():
        arrays[name] = np.frombuffer(t["data"], np.uint8).copy()
    specs = {name: safetensors.TensorSpec(dtype=t["dtype"], shape=t["shape"],
                                          data_ptr=arrays[name].ctypes.data,
                                          data_len=len(t["data"]))
             if hasattr(safetensors, "TensorSpec") else t for name, t in tensors.items()}
    return bytes(safetensors.serialize(specs, metadata=meta))


def fresh_target() -> tuple[Context, list[Tnode], list[bytes]]:
    ctx, nodes = model(Context.cpu(), fill=7.0)
    return ctx, nodes, snapshot(ctx, nodes)


# --- digests ----------------------------------------------------------------------------------


def test_the_file_records_a_digest_per_tensor_and_one_of_the_header(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8:8 + n])["__metadata__"]
    assert meta["format"] == "ocannl.checkpoint/2"
    import hashlib

    for name, t in safetensors.deserialize(blob):
        assert meta[f"sha256:{name}"] == hashlib.sha256(bytes(t["data"])).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", meta["header_sha256"])


def test_a_flipped_bit_in_any_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    blob = path.read_bytes()
    ctx, nodes, before = fresh_target()
    bad = tmp_path / "bad.safetensors"
    for name, (lo, hi) in data_ranges(blob).items():
        for pos in range(lo, hi):  # every byte; a different bit in each
            mutated = bytearray(blob)
            mutated[pos] ^= 1 << (pos % 8)
            bad.write_bytes(bytes(mutated))
            with pytest.raises(Failure, match=rf"tensor '{re.escape(name)}' is corrupted"):
                checkpoint.load(bad, ctx, nodes)
    assert snapshot(ctx, nodes) == before


def test_every_single_bit_flip_is_refused_or_harmless(tmp_path: Path) -> None:
    """A flip anywhere (length prefix, header, data) raises ``Failure``; if a flip were ever
    accepted, what loads must be exactly what was saved."""
    path, values, progress = saved(tmp_path)
    blob = path.read_bytes()
    ctx, nodes, before = fresh_target()
    bad = tmp_path / "bad.safetensors"
    accepted = 0
    for bit in range(0, len(blob) * 8, 3):  # a third of all bits, every byte covered
        mutated = bytearray(blob)
        mutated[bit // 8] ^= 1 << (bit % 8)
        bad.write_bytes(bytes(mutated))
        try:
            got_ctx, got = checkpoint.load(bad, ctx, nodes)
        except Failure:
            assert snapshot(ctx, nodes) == before
            continue
        accepted += 1
        assert got == progress and snapshot(got_ctx, nodes) == values
        for n in nodes:
            ctx = ctx.set_values(n, np.full(n.size, 7.0))
    assert accepted <= len(blob) // 50  # at most trailing header padding


def test_an_edited_header_is_refused(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    blob = path.read_bytes()
    ctx, nodes, before = fresh_target()
    bad = tmp_path / "bad.safetensors"

    def more_steps(meta: dict) -> None:
        meta["progress"] = meta["progress"].replace('"step": 41', '"step": 42')

    def relabel(meta: dict) -> None:
        meta["label:n_f32"] = "other"

    def retype(tensors: dict) -> None:  # the same bytes, read as another 16-bit format
        tensors["n_f16"]["dtype"] = "bfloat16"

    def reshape(tensors: dict) -> None:  # the same bytes, in another shape
        tensors["n_f32"]["shape"] = [4, 2]

    for edit in (dict(meta_edit=more_steps), dict(meta_edit=relabel),
                 dict(tensor_edit=retype), dict(tensor_edit=reshape)):
        bad.write_bytes(reserialize(blob, **edit))
        with pytest.raises(Failure, match=r"corrupted or altered: its header"):
            checkpoint.load(bad, ctx, nodes)
    assert snapshot(ctx, nodes) == before


def test_missing_or_stray_digests_are_refused(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    blob = path.read_bytes()
    ctx, nodes, before = fresh_target()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(reserialize(blob, meta_edit=lambda m: m.pop("sha256:n_f16")))
    with pytest.raises(Failure, match="tensor 'n_f16' has no digest"):
        checkpoint.load(bad, ctx, nodes)
    bad.write_bytes(reserialize(blob, meta_edit=lambda m: m.update({"sha256:ghost": "0" * 64})))
    with pytest.raises(Failure, match=r"not in the file: \['ghost'\]"):
        checkpoint.load(bad, ctx, nodes)
    assert snapshot(ctx, nodes) == before


def test_a_checkpoint_of_the_first_format_is_refused_clearly(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    old = tmp_path / "old.safetensors"

    def first_format(meta: dict) -> None:
        for k in [k for k in meta if k.startswith("sha256:") or k == "header_sha256"]:
            del meta[k]
        meta["format"] = "ocannl.checkpoint/1"

    old.write_bytes(reserialize(path.read_bytes(), meta_edit=first_format))
    ctx, nodes, before = fresh_target()
    with pytest.raises(Failure, match=r"ocannl\.checkpoint/1.*without integrity digests"):
        checkpoint.load(old, ctx, nodes)
    assert snapshot(ctx, nodes) == before


@pytest.mark.parametrize("version", ["0", "3", "10"])
def test_a_checkpoint_of_another_format_version_is_refused_naming_it(tmp_path: Path,
                                                                     version: str) -> None:
    path, _, _ = saved(tmp_path)
    other = tmp_path / "other.safetensors"
    other.write_bytes(reserialize(path.read_bytes(),
                                  meta_edit=lambda m: m.update(
                                      format=f"ocannl.checkpoint/{version}")))
    ctx, nodes, before = fresh_target()
    message = (rf"has format 'ocannl\.checkpoint/{version}', which this version does not read: "
               rf"it loads 'ocannl\.checkpoint/2' only")
    with pytest.raises(Failure, match=message):
        checkpoint.load(other, ctx, nodes)
    with pytest.raises(Failure, match=message):
        checkpoint.read_progress(other)
    assert snapshot(ctx, nodes) == before


# --- crafted progress -------------------------------------------------------------------------


def crafted(tmp: Path, progress_text: str) -> Path:
    """A checkpoint whose digests are right but whose progress is ``progress_text``."""
    path, _, _ = saved(tmp)

    def put(meta: dict) -> None:
        meta["progress"] = progress_text
        shapes = {name: (t["dtype"], list(t["shape"]))
                  for name, t in safetensors.deserialize(path.read_bytes())}
        meta["header_sha256"] = checkpoint._header_digest(meta, shapes)

    out = tmp / "crafted.safetensors"
    out.write_bytes(reserialize(path.read_bytes(), meta_edit=put))
    return out


@pytest.mark.parametrize("depth", [10_000, 200_000])
def test_deeply_nested_progress_is_a_failure_not_a_recursion_error(tmp_path: Path,
                                                                   depth: int) -> None:
    text = "[" * depth + "]" * depth
    with pytest.raises(Failure, match="nested too deeply"):
        Progress.from_json(text)
    nested = '{"step": 1, "epoch": 0, "extra": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
    path = crafted(tmp_path, nested)
    ctx, nodes, before = fresh_target()
    with pytest.raises(Failure, match="nested too deeply"):
        checkpoint.load(path, ctx, nodes)
    assert snapshot(ctx, nodes) == before


def test_a_deeply_nested_header_is_a_failure(tmp_path: Path) -> None:
    depth = 100_000
    header = ("[" * depth + "]" * depth).encode()
    bad = tmp_path / "deep.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header)
    ctx, nodes, before = fresh_target()
    with pytest.raises(Failure, match="not a safetensors checkpoint"):
        checkpoint.load(bad, ctx, nodes)
    assert snapshot(ctx, nodes) == before


@pytest.mark.parametrize("text", ['{"step": 1e400, "epoch": 0, "extra": {}}',
                                  '{"step": ' + "9" * 5000 + ', "epoch": 0, "extra": {}}',
                                  '{"step": true, "epoch": 0, "extra": {}}', "[1, 2]", '"s"',
                                  '{"step": 1, "epoch": 0, "extra": {"k": []}}', ""])
def test_malformed_progress_is_a_failure(tmp_path: Path, text: str) -> None:
    with pytest.raises(Failure, match="progress"):
        Progress.from_json(text)


@pytest.mark.parametrize("text", ['{"step": 1, "epoch": 0, "extra": {}, "version": 1}',
                                  '{"step": 1, "extra": {}}',
                                  '{"step": 1, "epoch": 0, "extra": {}, "loss_scale": 8.0}'])
def test_progress_of_another_layout_is_refused_naming_its_keys(tmp_path: Path,
                                                               text: str) -> None:
    keys = sorted(json.loads(text))
    with pytest.raises(Failure, match=re.escape(f"its keys are {keys!r}, expected exactly "
                                                f"['epoch', 'extra', 'step']")):
        Progress.from_json(text)
    ctx, nodes, before = fresh_target()
    with pytest.raises(Failure, match="expected exactly"):
        checkpoint.load(crafted(tmp_path, text), ctx, nodes)
    assert snapshot(ctx, nodes) == before


# --- temporaries of killed saves --------------------------------------------------------------

_CHILD = r"""
import os, sys, time
import numpy as np
from ocannl import Context, checkpoint
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

path, k = sys.argv[1], int(sys.argv[2])
node = Tnode("w", (1 << 18,), Precision.f32)
ctx = Context.cpu().set_values(node, np.full(node.size, float(k)))

def stall(src, dst):  # the temporary is complete and synced: die before the rename
    print("READY", flush=True)
    time.sleep(600)

os.replace = stall
checkpoint.save(path, ctx, [node], checkpoint.Progress(step=k))
"""

STALE = re.compile(r"\.ck\.safetensors\.[0-9a-f]{16}\.tmp")


def start_stalled_save(path: Path, k: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(k)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "READY":
        proc.kill()
        _, err = proc.communicate(timeout=30)
        pytest.fail(f"the stalled save did not start: {line!r} {err[-2000:]}")
    return proc


def kill(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


def lock_is_held(path: Path) -> bool:
    lock = path.with_name(f".{path.name}.lock")
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def decoys(folder: Path) -> set[str]:
    """Files that look like temporaries but are not this checkpoint's (or not temporaries)."""
    names = {".ck.safetensors.backup", ".ck.safetensors2.0123456789abcdef.tmp",
             ".ck.safetensors.x.0123456789abcdef.tmp", ".other.abcdefgh.tmp",
             "ck.safetensors.0123456789abcdef.tmp", ".ck.safetensors.0123456789ABCDEF.tmp"}
    for name in names:
        (folder / name).write_bytes(b"not mine")
    return names


def test_killed_saves_leave_temporaries_only_until_the_next_save_or_load(tmp_path: Path) -> None:
    path = tmp_path / "ck.safetensors"
    node = Tnode("w", (1 << 18,), Precision.f32)
    ctx = Context.cpu().set_values(node, np.zeros(node.size))
    checkpoint.save(path, ctx, [node], Progress(step=0))
    others = decoys(tmp_path)

    def stale() -> list[str]:
        return sorted(n for n in os.listdir(tmp_path) if STALE.fullmatch(n))

    left: list[str] = []
    for k in range(1, 4):
        proc = start_stalled_save(path, k)
        try:
            # the save removed what the previous killed one left; its own is there
            now = stale()
            assert len(now) == 1 and now != left and lock_is_held(path)
            # a live writer's temporary survives a load (which still reads the old checkpoint)
            _, progress = checkpoint.load(path, Context.cpu(), [node])
            assert progress.step == 0 and stale() == now
        finally:
            kill(proc)
        left = stale()
        assert left == now and not lock_is_held(path)  # a full-size temporary, nobody's
        assert (tmp_path / left[0]).stat().st_size > 4 << 18
    _, progress = checkpoint.load(path, Context.cpu(), [node])  # nobody writes: clean up
    assert progress.step == 0 and stale() == []
    proc = start_stalled_save(path, 9)
    kill(proc)
    assert len(stale()) == 1
    checkpoint.save(path, ctx, [node], Progress(step=10))  # a save cleans up too
    assert sorted(os.listdir(tmp_path)) == sorted(others | {"ck.safetensors"})
    assert checkpoint.load(path, Context.cpu(), [node])[1].step == 10


def test_a_live_lock_holder_keeps_its_temporaries(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    ctx, nodes, _ = fresh_target()
    temps = {".ck.safetensors.00112233445566aa.tmp", ".ck.safetensors.abcdefgh.tmp"}
    for t in temps:
        (tmp_path / t).write_bytes(b"x" * 100)
    lock = tmp_path / ".ck.safetensors.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another writer, alive
    try:
        checkpoint.load(path, ctx, nodes)
        assert temps <= set(os.listdir(tmp_path))
    finally:
        os.unlink(lock)
        os.close(fd)
    checkpoint.load(path, ctx, nodes)
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors"]


def test_a_save_waits_for_the_save_in_progress(tmp_path: Path) -> None:
    path = tmp_path / "ck.safetensors"
    node = Tnode("w", (1 << 18,), Precision.f32)
    ctx = Context.cpu().set_values(node, np.zeros(node.size))
    proc = start_stalled_save(path, 5)
    import threading

    done = threading.Event()

    def save() -> None:
        checkpoint.save(path, ctx, [node], Progress(step=6))
        done.set()

    thread = threading.Thread(target=save, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert not done.is_set()  # blocked on the live writer's lock; its temporary intact
    assert len([n for n in os.listdir(tmp_path) if STALE.fullmatch(n)]) == 1
    kill(proc)
    thread.join(timeout=60)
    assert done.is_set()
    assert sorted(os.listdir(tmp_path)) == ["ck.safetensors"]
    assert checkpoint.load(path, Context.cpu(), [node])[1].step == 6


# --- fuzz -------------------------------------------------------------------------------------

_BASE = tempfile.mkdtemp(prefix="ocannl-ck-fuzz-")
_GOOD_PATH, _GOOD_VALUES, _GOOD_PROGRESS = saved(Path(_BASE), "good.safetensors")
_GOOD = _GOOD_PATH.read_bytes()
_GOOD_BY_LABEL = by_label(*model(Context.cpu()))
shutil.rmtree(_BASE)


@st.composite
def mutated_files(draw: st.DrawFn) -> bytes:
    blob = bytearray(_GOOD)
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete", "prefix",
                                 "random"]))
    if kind == "truncate":
        return bytes(blob[:draw(st.integers(0, len(blob) - 1))])
    if kind == "flip":
        for pos in draw(st.lists(st.integers(0, len(blob) * 8 - 1), min_size=1, max_size=8)):
            blob[pos // 8] ^= 1 << (pos % 8)
    elif kind == "overwrite":
        at = draw(st.integers(0, len(blob) - 1))
        new = draw(st.binary(min_size=1, max_size=32))
        blob[at:at + len(new)] = new
    elif kind == "insert":
        at = draw(st.integers(0, len(blob)))
        blob[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
        at = draw(st.integers(0, len(blob) - 1))
        del blob[at:at + draw(st.integers(1, 16))]
    elif kind == "prefix":
        blob[:8] = draw(st.integers(0, 2 ** 64 - 1)).to_bytes(8, "little")
    else:
        return draw(st.binary(max_size=256))
    return bytes(blob)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@st.composite
def crafted_headers(draw: st.DrawFn) -> bytes:
    """A length prefix and a JSON header (sometimes with our metadata keys), then bytes."""
    header = draw(st.dictionaries(st.text(max_size=8), _JSON, max_size=4))
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.fixed_dictionaries(
            {"format": st.sampled_from(["ocannl.checkpoint/2", "ocannl.checkpoint/1", "x"]),
             "progress": st.one_of(_JSON.map(json.dumps), st.text(max_size=20))},
            optional={"header_sha256": st.text(max_size=64)}))
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + draw(st.binary(max_size=64))


def _wrong_nodes() -> st.SearchStrategy:
    precs = st.sampled_from(list(Precision))
    dims = st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple)
    labels = st.sampled_from(["n_f64", "n_f32", "n_f16", "n_bf16", "other"])
    return st.lists(st.tuples(labels, dims, precs), min_size=0, max_size=5)


def _check_load(blob: bytes, node_specs: list | None = None) -> None:
    """Load ``blob``: ``Failure`` with everything unchanged, or exactly the saved state."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ck.safetensors"
        path.write_bytes(blob)
        ctx, nodes = model(Context.cpu(), fill=7.0)
        if node_specs is not None:
            nodes = []
            for label, dims, prec in node_specs:
                n = Tnode(label, dims, prec)
                ctx = ctx.set_values(n, np.full(n.size, 7.0))
                nodes.append(n)
        before = snapshot(ctx, nodes)
        listing = sorted(os.listdir(tmp))
        try:
            got_ctx, progress = checkpoint.load(path, ctx, nodes)
        except Failure:
            assert snapshot(ctx, nodes) == before
        else:
            assert progress == _GOOD_PROGRESS and by_label(got_ctx, nodes) == _GOOD_BY_LABEL
        assert path.read_bytes() == blob and sorted(os.listdir(tmp)) == listing


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=mutated_files())
def test_fuzz_mutated_files_raise_failure_and_change_nothing(blob: bytes) -> None:
    _check_load(blob)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=crafted_headers())
def test_fuzz_crafted_headers_raise_failure_and_change_nothing(blob: bytes) -> None:
    _check_load(blob)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=_wrong_nodes())
def test_fuzz_nodes_that_do_not_match_raise_failure(specs: list) -> None:
    labels = [s[0] for s in specs]
    if len(set(labels)) != len(labels):
        specs = list({s[0]: s for s in specs}.values())  # node_names would number repeats
    _check_load(_GOOD, specs)
