"""The CPU backend's on-disk cache (``ocannl/backends/cpu/jit.py``, ``version.py``): keyed by the
code of every module that reaches an object, so a changed module never loads an old object;
bounded in size, the least recently used files removed first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ocannl
from ocannl import Context
from ocannl.backends.cpu import jit, version
from ocannl.backends.cpu.backend import CpuBackend
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

PACKAGE = Path(ocannl.__file__).resolve().parent

# A routine whose machine code holds both modules' output: a product shared over the pool's
# two threads (``pool.py``'s calling convention) inside the single-threaded-BLAS wrapper
# ``jit.py`` emits, and a pointwise loop split into ``pool.CHUNKS_PER_THREAD`` chunks a thread.
COMPILE = """
import json, numpy as np, ocannl
from ocannl import Context
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
m = 256
a, w, c, e = (Tnode(n, (m, m), Precision.f32) for n in ("ka", "kw", "kc", "ke"))
comp = Comp((Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(w, (2, 1))), (m, m, m),
                   True),
             Accum(e, (0, 1), "=", apply("exp", Get(c, (0, 1))), (m, m))))
ctx = Context.cpu()
ctx.set_values(a, np.ones((m, m)))
ctx.set_values(w, np.full((m, m), 1 / 256))
ctx, r = ctx.compile(comp)
ctx.run(r)
print(json.dumps({"package": ocannl.__file__, "from_disk": r.compiled.loaded_from_disk,
                  "e": float(ctx.get_values(e).mean())}))
"""


def _copy(root: Path, edit: tuple[str, str, str] | None = None) -> Path:
    """A copy of the ``ocannl`` package under ``root``, with ``edit`` (file, old, new: one
    replacement) made in it."""
    shutil.copytree(PACKAGE, root / "ocannl", ignore=shutil.ignore_patterns("__pycache__"))
    if edit is not None:
        name, old, new = edit
        path = root / "ocannl" / name
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} is not once in {name}"
        path.write_text(text.replace(old, new))
    return root


def _compile(package_root: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package_root), "OCANNL_CACHE_DIR": str(cache),
           "OCANNL_THREADS": "2"}
    env.pop("OCANNL_BLAS", None)
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=package_root, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(got["package"]).resolve().is_relative_to(package_root.resolve()), got
    assert got["e"] == pytest.approx(np.e, rel=1e-6)
    return got


def test_a_byte_changed_in_the_pool_or_the_jit_never_loads_an_old_object(tmp_path):
    """One byte of the code ``pool.py`` emits into a routine (its chunks per thread) or
    ``jit.py`` does (the BLAS thread count its wrapper sets), changed in a copy of the
    package: the routine cached by the unchanged copy is not loaded (compiled anew, a new
    cache file beside the old), while the unchanged copy loads its own."""
    cache = tmp_path / "cache"
    objects = cache / "llvm"
    same = _copy(tmp_path / "same")
    first = _compile(same, cache)
    assert not first["from_disk"]
    (old,) = objects.glob("*.objects")
    assert _compile(same, cache)["from_disk"]  # the unchanged copy loads its own
    seen = {old}
    for name, edit in (
            ("pool", ("backends/cpu/pool.py", "CHUNKS_PER_THREAD = 4", "CHUNKS_PER_THREAD = 5")),
            ("jit", ("backends/cpu/jit.py", "call void @ocannl_blas_set_threads(i32 1)",
                     "call void @ocannl_blas_set_threads(i32 2)"))):
        changed = _copy(tmp_path / name, edit)
        got = _compile(changed, cache)
        assert not got["from_disk"], f"a copy with {name}.py changed loaded the old object"
        now = set(objects.glob("*.objects"))
        assert seen < now and len(now - seen) == 1, (name, now, seen)
        seen = now
    assert _compile(same, cache)["from_disk"]  # the old entry is still there, and still its


def test_the_version_covers_every_module_of_the_ir_and_the_backends(tmp_path):
    """Every ``.py`` under ``ocannl/ir`` and ``ocannl/backends`` is hashed, a new one too,
    and a byte changed in any of them changes the version."""
    names = {p.relative_to(PACKAGE).as_posix() for p in version.sources(PACKAGE)}
    for module in ("backends/cpu/pool.py", "backends/cpu/jit.py", "backends/cpu/entry.py",
                   "backends/cpu/codegen.py", "backends/cpu/scalar.py", "ir/lowering.py",
                   "ir/ops.py"):
        assert module in names
    root = _copy(tmp_path / "copy")
    base = version.digest(root / "ocannl")
    assert base == version.VERSION
    (root / "ocannl" / "backends" / "cpu" / "later.py").write_text("X = 1\n")
    added = version.digest(root / "ocannl")
    assert added != base
    entry = root / "ocannl" / "backends" / "cpu" / "entry.py"
    entry.write_bytes(entry.read_bytes().replace(b"i64 1", b"i64 2", 1))
    assert version.digest(root / "ocannl") not in (base, added)


def _files(folder: Path, sizes_and_ages: list[tuple[int, int]]) -> list[Path]:
    """Files ``f0.objects``, ... of the given sizes, each modified ``age`` seconds ago."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    now = 1_700_000_000
    for k, (size, age) in enumerate(sizes_and_ages):
        path = folder / f"f{k}.objects"
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age, now - age))
        out.append(path)
    return out


def test_trimming_removes_the_least_recently_used_files_first(tmp_path):
    files = _files(tmp_path, [(400, 50), (300, 10), (200, 40), (100, 30)])
    os.utime(files[3], ns=(1_700_000_000 * 10**9, os.stat(files[3]).st_mtime_ns))  # used last
    other = tmp_path / "notes.txt"  # not a cache file: never counted nor removed
    other.write_bytes(b"y" * 5000)
    removed = jit.trim_cache(tmp_path, 450, keep=files[0])
    # oldest use first: f0 (kept: the file just written), then f2, f1 (500 bytes left), f3
    # (used last, although written before f1)
    assert removed == [files[2], files[1], files[3]]
    assert sorted(tmp_path.iterdir()) == sorted([files[0], other])
    files = _files(tmp_path / "b", [(100, 5), (100, 4), (100, 3)])
    assert jit.trim_cache(tmp_path / "b", 300, keep=files[2]) == []
    assert jit.trim_cache(tmp_path / "b", 150, keep=files[2]) == files[:2]


def _routine(n: int) -> Comp:
    x, y = Tnode(f"cx{n}", (n,), Precision.f32), Tnode(f"cy{n}", (n,), Precision.f32)
    return Comp((Accum(y, (0,), "=", apply("mul", Get(x, (0,)), Get(x, (0,))), (n,)),))


def _fresh_process(monkeypatch) -> None:
    monkeypatch.setattr(jit, "_state", {**jit._state, "loaded": {}})
    monkeypatch.setattr(CpuBackend, "_compiled", {})


def test_the_cache_is_bounded_by_its_environment_variable(monkeypatch, tmp_path):
    """Real routines' files and old files beside them: a compile over the bound removes the
    least recently used (a file loaded from disk counts as used: its access time is set, its
    modification time kept), and keeps the one it wrote."""
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OCANNL_CACHE_MAX_MB", "1")
    folder = tmp_path / "llvm"
    _fresh_process(monkeypatch)
    Context.cpu().compile(_routine(7))
    (first,) = folder.glob("*.objects")
    old, older = _files(folder, [(500_000, 100), (500_000, 200)])
    _fresh_process(monkeypatch)
    written = first.stat().st_mtime_ns
    _, r = Context.cpu().compile(_routine(7))  # loaded: its file is now the last used
    assert r.compiled.loaded_from_disk and first.stat().st_mtime_ns == written  # not rewritten
    assert first.stat().st_atime_ns > old.stat().st_atime_ns
    os.utime(first, ns=(first.stat().st_atime_ns, 1))  # written long ago, used just now
    _fresh_process(monkeypatch)
    Context.cpu().compile(_routine(9))  # written: 1 MB exceeded, the oldest file goes
    left = set(folder.glob("*.objects"))
    assert older not in left and {old, first} <= left and len(left) == 3
    assert sum(p.stat().st_size for p in left) <= 10**6


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "lots"])
def test_a_bad_cache_bound_is_refused_and_nothing_is_written(monkeypatch, tmp_path, value):
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("OCANNL_CACHE_MAX_MB", value)
    _fresh_process(monkeypatch)
    with pytest.raises(ValueError, match=f"OCANNL_CACHE_MAX_MB={value!r}: expected a whole "
                                         "number of at least 1"):
        Context.cpu().compile(_routine(11))
    assert not (tmp_path / "llvm").exists() or not list((tmp_path / "llvm").iterdir())


def test_the_default_bound_is_documented(monkeypatch):
    monkeypatch.delenv("OCANNL_CACHE_MAX_MB", raising=False)
    assert jit.cache_max_bytes() == jit.CACHE_MAX_MB * 10**6
    assert f"default ``CACHE_MAX_MB``, {jit.CACHE_MAX_MB})" in jit.__doc__


def test_a_cache_file_of_the_former_layout_is_compiled_again(monkeypatch, tmp_path):
    """A file written before routines lost their scratch arrays (its header lists them, and
    has no format) is never loaded: it is compiled again and replaced by the current layout."""
    import hashlib
    import json

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "llvm"
    folder.mkdir(parents=True)
    body = b"\x7fELF not really"
    old = json.dumps({"scratch": [[4, "f32", 0, 1]], "tables": [0], "sizes": [len(body)],
                      "sha256": hashlib.sha256(body).hexdigest()}).encode() + b"\n" + body
    (folder / "k.objects").write_bytes(old)
    assert jit.load("k") is None
    with pytest.raises(KeyError):
        jit._unpack(old)
    packed = jit._pack([body])
    assert jit._unpack(packed) == [body]
    assert json.loads(packed.partition(b"\n")[0])["format"] == jit.CACHE_FORMAT


# Two writers of one key, made to meet: each compiles, writes its temporary file whole, then
# waits at the rename (``os.replace``) until the other has written its own too.
MEETING = """
import os, sys, time
from pathlib import Path
mine, theirs = Path(sys.argv[1]), Path(sys.argv[2])
rename = os.replace
def meet(src, dst):
    if str(dst).endswith(".objects"):
        mine.touch()
        deadline = time.monotonic() + 240
        while not theirs.exists():
            if time.monotonic() > deadline:
                raise SystemExit("the other writer never reached its rename")
            time.sleep(0.01)
    rename(src, dst)
os.replace = meet
""" + COMPILE


def test_two_processes_writing_one_routine_at_once_leave_one_valid_object(tmp_path):
    """The cache is shared by the test suite's workers: two processes compiling the same
    routine into one cache, both with their objects written before either renames, leave one
    whole file under the key (no temporaries), which a third process loads and runs."""
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent), "OCANNL_CACHE_DIR": str(cache),
           "OCANNL_THREADS": "2"}
    env.pop("OCANNL_BLAS", None)
    flags = [tmp_path / "a.ready", tmp_path / "b.ready"]
    writers = [subprocess.Popen([sys.executable, "-c", MEETING, str(me), str(other)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
               for me, other in (flags, flags[::-1])]
    results = []
    for proc in writers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(flag.exists() for flag in flags)  # both reached the rename
    assert [r["from_disk"] for r in results] == [False, False]  # both compiled and wrote
    files = sorted((cache / "llvm").iterdir())
    assert [f.suffix for f in files] == [".objects"], files  # one file, no temporaries
    assert len(jit._unpack(files[0].read_bytes())) >= 1  # whole: its digest matches
    third = _compile(PACKAGE.parent, cache)
    assert third["from_disk"] is True
