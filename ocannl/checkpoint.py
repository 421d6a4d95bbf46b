"""Resumable checkpoints: the training state and the loop's progress in one safetensors file.

The *training state* is what the routines update and a resumed run must start from: the
parameters and their optimizer buffers (momentum). Inputs the host sets (data, learning rates,
the loss-scale tensors) are not in it; the loop records whatever host state it needs (a
``Loss_scaler.save_state`` string, a data position) in :class:`Progress`'s ``extra``, which
travels in the file's metadata. Saving is atomic, so a crash mid-save leaves the previous
checkpoint intact; loading checks every name, shape and precision before it changes anything.
A host state in ``extra`` may name nodes it cannot be resumed without (a recipe's between two
micro-batches: its gradient sums); saving and loading refuse a checkpoint without them.
:func:`load` resumes (exactly the saved nodes); :func:`load_weights` takes some of them (the
parameters, for evaluation or fine-tuning) from a checkpoint that holds more.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors

try:
    import fcntl
except ImportError:  # not POSIX: saves take no lock and leave stale temporaries alone
    fcntl = None  # type: ignore[assignment]

from ocannl.context import Context
from ocannl.errors import Failure
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.optim import Optimizer
from ocannl.tensor.tensor import Tensor

__all__ = ["Progress", "load", "load_weights", "node_names", "read_progress", "save",
           "training_state"]

_FORMAT = "ocannl.checkpoint/2"  # /2: SHA-256 of every tensor's bytes and of the header
_FORMAT_1 = "ocannl.checkpoint/1"  # no digests: refused, its bytes cannot be verified
_ANY_FORMAT = re.compile(r"ocannl\.checkpoint/[0-9]{1,6}", re.ASCII)  # any version, to name it
_PROGRESS_KEYS = ("epoch", "extra", "step")
_DIGEST_PREFIX = "sha256:"
_HEADER_KEY = "header_sha256"
# safetensors dtype names; f16 and bf16 are stored as themselves, exactly.
_DTYPES = {Precision.f64: "F64", Precision.f32: "F32", Precision.f16: "F16",
           Precision.bf16: "BF16"}
_SPEC_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_NUMPY = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
# A host state line of ocannl's in ``Progress.extra`` ("ocannl.NAME/VERSION ...") may end with
# " needs=NAMES": the checkpoint names (percent-encoded, comma-separated) of the nodes it cannot
# be resumed without (``mixed_prec.Recipe.save_state`` between two micro-batches or inside a
# window).
_NEEDS = re.compile(r"ocannl\.[A-Za-z_][A-Za-z0-9_]*/[0-9]{1,6} .* needs=([A-Za-z0-9_.~%-]+"
                    r"(?:,[A-Za-z0-9_.~%-]+)*)", re.ASCII | re.DOTALL)
_NEEDS_HINT = ("a recipe between two micro-batches needs its gradient sums, and the fused gate "
               "inside a window its skip count and flags: a checkpoint holds "
               "checkpoint.training_state(loss, opt) + recipe.state_nodes()")


@dataclass
class Progress:
    """Where the training loop is: ``step`` and ``epoch`` counters, and ``extra``, a string map
    the loop fills with any host state it needs to resume (e.g. the loss scaler's
    ``save_state``)."""

    step: int = 0
    epoch: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        for name in ("step", "epoch"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Progress.{name} must be an integer >= 0, got {v!r}")
        if not isinstance(self.extra, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.extra.items()):
            raise ValueError(f"Progress.extra must map strings to strings, got {self.extra!r:.200}")

    def to_json(self) -> str:
        self.check()
        return json.dumps({"step": int(self.step), "epoch": int(self.epoch),
                           "extra": dict(self.extra)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Progress:
        """The progress :meth:`to_json` wrote: exactly the keys step, epoch and extra;
        ``ocannl.Failure`` naming what differs otherwise (nothing else is read)."""
        try:
            d = json.loads(text)
            if isinstance(d, dict) and sorted(d) != list(_PROGRESS_KEYS):
                raise ValueError(f"its keys are {sorted(d)!r:.120}, expected exactly "
                                 f"{list(_PROGRESS_KEYS)}")
            p = cls(d["step"], d["epoch"], d["extra"])
            p.check()
        except RecursionError:
            raise Failure(f"checkpoint progress {text!r:.200} is not valid: its JSON is nested "
                          f"too deeply (expected {{\"step\": int, \"epoch\": int, \"extra\": "
                          f"{{str: str}}}})") from None
        except (ValueError, KeyError, TypeError) as err:
            raise Failure(f"checkpoint progress {text!r:.200} is not valid: {err}") from None
        return p


def training_state(loss: Tensor, optimizer: Optimizer) -> list[Tnode]:
    """The nodes a resumed run must restore: every parameter of ``loss`` (the f32 masters under
    mixed precision), then ``optimizer.state_nodes()`` (its buffers per parameter, and its own
    counters such as Adam's step). A mixed-precision recipe adds its ``state_nodes()``.

    The optimizer's buffers for ``loss``'s parameters are created here if its update was not
    built yet, so the list is the same either way.
    """
    if not isinstance(loss, Tensor):
        raise TypeError(f"training_state expects the loss Tensor, got {type(loss).__name__}")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"training_state expects an ocannl.optim optimizer (SGD, Adam, AdamW, "
                        f"...), got {type(optimizer).__name__}: {optimizer!r:.80}")
    params = loss.params
    for p in params:
        optimizer.state_of(p)
    return [p.value for p in params] + optimizer.state_nodes()


def _as_nodes(nodes: Iterable[Tnode | Tensor]) -> list[Tnode]:
    out = []
    for n in nodes:
        node = n.value if isinstance(n, Tensor) else n
        if not isinstance(node, Tnode):
            raise TypeError(f"checkpoint nodes must be Tnodes or Tensors, got {type(n).__name__}")
        out.append(node)
    ids = [n.id for n in out]
    if len(set(ids)) != len(ids):
        dup = sorted({n.name for n in out if ids.count(n.id) > 1})
        raise ValueError(f"checkpoint nodes list {dup} more than once")
    return out


def _unmet_needs(extra: dict[str, str], names: Collection[str]) -> list[str]:
    """For each host state in ``extra`` that names nodes it needs (`` needs=``) and ``names``
    lacks some of: ``extra[KEY] needs [...]``."""
    unmet = []
    for key in sorted(extra):
        m = _NEEDS.fullmatch(extra[key])
        if m is None:
            continue
        needed = [urllib.parse.unquote(n) for n in m[1].split(",")]
        if any(n not in names for n in needed):
            unmet.append(f"extra[{key!r}] needs {needed}")
    return unmet


def node_names(nodes: Sequence[Tnode]) -> list[str]:
    """The name each node has in a checkpoint: its label. Labels, not ids: ids depend on how
    many nodes a process created before, labels only on the program. Two nodes of one label
    are refused (``ValueError`` naming the label and the nodes): numbered in list order, a
    program that builds its blocks in another order would load their tensors swapped, silently.
    Give each block its own ``label=`` (``nn_blocks.mlp(x, ..., label="encoder")``)."""
    names = [n.label for n in nodes]
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    repeated = [name for name, k in counts.items() if k > 1]
    if repeated:
        listed = "; ".join(
            f"{name!r}: " + ", ".join(f"{n.name} {n.dims}" for n in nodes if n.label == name)
            for name in repeated[:5])
        raise ValueError(
            f"checkpoint: {len(repeated)} label(s) name more than one node ({listed}): a load "
            f"could not tell them apart and a program building them in another order would get "
            f"them swapped; give each block its own label= (e.g. nn_blocks.mlp(x, ..., "
            f"label='encoder'))")
    return names


def _spec(arr: np.ndarray, dtype: str) -> object:
    """A safetensors tensor description over ``arr``'s memory (the caller keeps ``arr`` alive)."""
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8
        return safetensors.TensorSpec(dtype=_SPEC_DTYPES[dtype], shape=list(arr.shape),
                                      data_ptr=arr.ctypes.data, data_len=arr.nbytes)
    return {"dtype": _SPEC_DTYPES[dtype], "shape": list(arr.shape), "data": arr.tobytes()}


def _lock_file(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


def _temporaries(path: Path) -> re.Pattern[str]:
    """The names :func:`save` gives its temporary files for ``path`` (and those of the first
    format, made by ``tempfile.mkstemp``): ``.NAME.<random>.tmp``, where the random part has
    no dot, so another checkpoint's temporaries (``.NAME.x.<random>.tmp``) never match."""
    return re.compile(rf"\.{re.escape(path.name)}\.(?:[0-9a-f]{{16}}|[a-z0-9_]{{8}})\.tmp")


def _acquire(path: Path, *, wait: bool) -> int | None:
    """An exclusive ``flock`` on ``.NAME.lock`` beside ``path``: a descriptor to pass to
    :func:`_release`, or None when there is no lock to be had (no ``fcntl``, a folder we cannot
    write, or -- without ``wait`` -- another live process holding it).

    Every save holds the lock while its temporary file exists, so whoever holds it knows that
    every temporary of ``path`` it finds was left by a save that died. The holder removes the
    lock file as it releases it; a process that locked the file meanwhile finds it is no longer
    the one at that name and starts over.
    """
    if fcntl is None:
        return None
    lock = _lock_file(path)
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # busy (without wait), or no locks on this file system
            os.close(fd)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except OSError:
            same = False  # its last holder removed it as it released it
        if same:
            return fd
        os.close(fd)


def _release(path: Path, fd: int | None) -> None:
    if fd is None:
        return
    try:
        os.unlink(_lock_file(path))
    except OSError:
        pass
    os.close(fd)


def _remove_stale_temporaries(path: Path) -> None:
    """Remove what saves of ``path`` that were killed left behind (call holding the lock)."""
    pattern = _temporaries(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def _digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)).hexdigest()


def _header_digest(meta: dict[str, str], shapes: dict[str, tuple[str, list[int]]]) -> str:
    """The digest of everything the header says: the metadata (but this digest) and each
    tensor's dtype and shape."""
    text = json.dumps({"metadata": {k: v for k, v in meta.items() if k != _HEADER_KEY},
                       "tensors": {k: list(v) for k, v in shapes.items()}},
                      sort_keys=True, ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def save(path: str | os.PathLike, ctx: Context, nodes: Iterable[Tnode | Tensor],
         progress: Progress, *, values: Mapping[int, np.ndarray] | None = None) -> None:
    """Write ``nodes``' values (read from ``ctx``) and ``progress`` to ``path``, atomically:
    the bytes go to a temporary file ``.NAME.<random>.tmp`` in the same folder, are flushed to
    disk, then renamed over ``path``, so a crash at any point leaves either the old or the new
    checkpoint.

    The file records the SHA-256 of every tensor's bytes and of the header (format
    ``ocannl.checkpoint/2``), which :func:`load` verifies. A save holds an exclusive lock on
    ``.NAME.lock`` beside ``path`` (waiting for another save of the same path to finish) and
    first removes the temporaries of saves of ``path`` that were killed; the lock file is
    removed when the save ends.

    ``values``: for some nodes (by node id), the values to write instead of reading them from
    ``ctx``: a state that no one context holds whole (``DataParallel.save`` gathers a sharded
    optimizer's slices into them). Each must have the node's number of elements.
    """
    nodes = _as_nodes(nodes)
    if not isinstance(progress, Progress):
        raise TypeError(f"progress must be a checkpoint.Progress, got {type(progress).__name__}")
    meta = {"format": _FORMAT, "progress": progress.to_json()}
    names = node_names(nodes)
    unmet = _unmet_needs(progress.extra, names)
    if unmet:
        raise Failure(f"checkpoint.save {os.fspath(path)!r}: " + "; ".join(unmet)
                      + f", which this save does not hold ({_NEEDS_HINT}); nothing was written")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"checkpoint.save {str(path)!r} is a folder: give "
                                              f"a file name; nothing was written")
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    given = {} if values is None else values
    for name, node in zip(names, nodes, strict=True):
        got = given[node.id] if node.id in given else ctx.get_values(node)
        arr = np.ascontiguousarray(got, dtype=node.prec.numpy_dtype)
        if arr.size != node.size:
            raise ValueError(f"checkpoint.save: values for {node.name} hold {arr.size} elements, "
                             f"the node {node.size} (dims {node.dims}); nothing was written")
        arrays[name] = arr.reshape(node.dims)
        dtypes[name] = _DTYPES[node.prec]
        meta[f"label:{name}"] = node.label
        meta[f"{_DIGEST_PREFIX}{name}"] = _digest(arr)
    meta[_HEADER_KEY] = _header_digest(
        meta, {k: (dtypes[k], list(a.shape)) for k, a in arrays.items()})
    specs = {k: _spec(a, dtypes[k]) for k, a in arrays.items()}
    data = bytes(safetensors.serialize(specs, metadata=meta))
    del specs  # the arrays it points into were alive until here
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint.save {str(path)!r}: the folder {str(folder)!r} "
                                f"does not exist{' (it is a file)' if folder.exists() else ''}")
    lock = _acquire(path, wait=True)
    try:
        if lock is not None:
            _remove_stale_temporaries(path)
        _write_atomically(path, folder, data)
    finally:
        _release(path, lock)


def _write_atomically(path: Path, folder: Path, data: bytes) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = folder / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o666)  # the umask applies, as to any new file
            break
        except FileExistsError:
            continue
        except OSError as err:  # named by the path given, not by the temporary's
            raise type(err)(err.errno, f"checkpoint.save {str(path)!r}: cannot create a file "
                                       f"in {str(folder)!r}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.replace(tmp, path)
        except OSError as err:  # named by the path given, not by the temporary's
            raise type(err)(err.errno, f"checkpoint.save {str(path)!r}: cannot write it: "
                                       f"{err.strerror or err}") from None
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and metadata of an ocannl checkpoint whose digests all match; ``Failure`` when
    it is not one, or any byte of it differs from what was saved."""
    where = f"checkpoint {str(path)!r}"
    try:
        data = path.read_bytes()
    except OSError as err:
        raise Failure(f"cannot read {where}: {err}") from None
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        meta = header.get("__metadata__") or {}
        tensors = safetensors.deserialize(data)
    except Exception as err:  # noqa: BLE001 - any decoding error means "not a checkpoint"
        kind = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise Failure(f"{str(path)!r} is not a safetensors checkpoint: {kind:.300}") from None
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt == _FORMAT_1:
        raise Failure(f"{where} has format {_FORMAT_1!r}, written by an older ocannl without "
                      f"integrity digests, so its bytes cannot be verified: this version loads "
                      f"{_FORMAT!r} only (resume with the ocannl that wrote it, or restart)")
    if isinstance(fmt, str) and fmt != _FORMAT and _ANY_FORMAT.fullmatch(fmt):
        raise Failure(f"{where} has format {fmt!r}, which this version does not read: it loads "
                      f"{_FORMAT!r} only (resume with the ocannl that wrote it, or restart)")
    if fmt != _FORMAT:
        raise Failure(f"{str(path)!r} is not an ocannl checkpoint (format {fmt!r:.80}, expected "
                      f"{_FORMAT!r})")
    out: dict[str, np.ndarray] = {}
    shapes: dict[str, tuple[str, list[int]]] = {}
    problems = []
    for name, t in tensors:
        dt = _NUMPY.get(t["dtype"])
        if dt is None:
            raise Failure(f"{where}: tensor {name!r} has dtype {t['dtype']}, expected one of "
                          f"{sorted(_NUMPY)}")
        raw = bytes(t["data"])
        want = meta.get(f"{_DIGEST_PREFIX}{name}")
        got = hashlib.sha256(raw).hexdigest()
        if want is None:
            problems.append(f"tensor {name!r} has no digest")
        elif got != want:
            problems.append(f"tensor {name!r} is corrupted (its bytes have SHA-256 {got:.16}..., "
                            f"saved {want!r:.20}...)")
        try:
            out[name] = np.frombuffer(raw, dtype=dt).reshape(t["shape"])
        except ValueError as err:
            raise Failure(f"{where}: tensor {name!r} of shape {t['shape']!r:.80} does not fit "
                          f"its {len(raw)} bytes: {err}") from None
        shapes[name] = (t["dtype"], list(t["shape"]))
    stray = sorted(k[len(_DIGEST_PREFIX):] for k in meta
                   if k.startswith(_DIGEST_PREFIX) and k[len(_DIGEST_PREFIX):] not in out)
    if stray:
        problems.append(f"digests of tensors that are not in the file: {stray}")
    if not problems and meta.get(_HEADER_KEY) != _header_digest(meta, shapes):
        problems.append("its header (progress, labels, dtypes, shapes) differs from what was "
                        "saved")
    if problems:
        raise Failure(f"{where} is corrupted or altered: " + "; ".join(problems))
    return out, meta


def read_progress(path: str | os.PathLike) -> Progress:
    """The progress saved in ``path``, after the same checks as :func:`load` (digests,
    format), without touching any context: a resume checks the run's settings recorded in
    ``extra`` before it loads tensors into a model that may not fit them."""
    _, meta = _read(Path(path))
    return Progress.from_json(meta.get("progress", ""))


def load(path: str | os.PathLike, ctx: Context, nodes: Iterable[Tnode | Tensor], *,
         writers: Mapping[int, Callable[[Context, np.ndarray], Context]] | None = None
         ) -> tuple[Context, Progress]:
    """Write the values saved in ``path`` into ``nodes`` on ``ctx``, to resume training;
    returns the context and the saved progress.

    Every tensor's bytes and the header are checked against the SHA-256 digests :func:`save`
    recorded: a flipped bit anywhere raises ``ocannl.Failure`` naming the tensor (or the
    header). A file of another format version (``ocannl.checkpoint/1``, without digests, or a
    later one) is refused with ``Failure`` naming it. The file must hold exactly these nodes'
    names (see :func:`node_names`: nodes of a repeated label are refused, ``ValueError``), each
    with the node's dims and precision, and every node a host state of its progress needs
    (``needs=``, e.g. a recipe's gradient sums between two micro-batches); otherwise
    ``ocannl.Failure`` lists every mismatch. On any failure the context is left as it was.
    :func:`load_weights` takes some of the nodes (parameters) from a file that holds more.

    When no save of ``path`` is running (its lock is free), temporaries left by killed saves of
    ``path`` are removed first.

    ``writers``: for some nodes (by node id), what writes the checked array instead of
    ``ctx.set_values`` (``DataParallel.load`` writes a sharded optimizer's slice of it).
    """
    path, nodes, names, arrays, progress = _open(path, nodes)
    problems = _mismatches(arrays, names, nodes)
    extra = sorted(set(arrays) - set(names))
    if extra:
        problems.insert(1 if problems and problems[0].startswith("missing") else 0,
                        f"not in this model {extra}")
    unmet = _unmet_needs(progress.extra, names)
    if unmet:
        problems.append("; ".join(unmet) + f", which this load does not hold ({_NEEDS_HINT})")
    if problems:
        raise Failure(f"checkpoint {str(path)!r} does not match the model: " + "; ".join(problems))
    return _put(ctx, arrays, names, nodes, writers), progress


def load_weights(path: str | os.PathLike, ctx: Context,
                 nodes: Iterable[Tnode | Tensor]) -> tuple[Context, Progress]:
    """Write the values saved in ``path`` into ``nodes`` on ``ctx`` and leave the rest of the
    file alone: the parameters alone (``[p.value for p in loss.params]``), for evaluation or
    fine-tuning, from a checkpoint that also holds optimizer state or a recipe's. Returns the
    context and the saved progress.

    The file is verified as by :func:`load`. Each node must be in the file under its name
    (:func:`node_names`) with its dims and precision; otherwise ``ocannl.Failure`` names every
    one that is not, and the context is left as it was. Nothing is resumed: a host state's
    ``needs=`` is not checked, and the optimizer starts from its own state.
    """
    path, nodes, names, arrays, progress = _open(path, nodes)
    problems = _mismatches(arrays, names, nodes)
    if problems:
        raise Failure(f"checkpoint {str(path)!r} does not hold these weights as asked: "
                      + "; ".join(problems))
    return _put(ctx, arrays, names, nodes), progress


def _open(path: str | os.PathLike, nodes: Iterable[Tnode | Tensor]
          ) -> tuple[Path, list[Tnode], list[str], dict[str, np.ndarray], Progress]:
    """The checked nodes and their names, then the verified file's tensors and progress
    (temporaries of killed saves removed first, when no save is running)."""
    nodes = _as_nodes(nodes)
    names = node_names(nodes)  # a repeated label is refused before the file is looked at
    path = Path(path)
    lock = _acquire(path, wait=False)
    if lock is not None:
        try:
            _remove_stale_temporaries(path)
        finally:
            _release(path, lock)
    arrays, meta = _read(path)
    return path, nodes, names, arrays, Progress.from_json(meta.get("progress", ""))


def _mismatches(arrays: dict[str, np.ndarray], names: list[str],
                nodes: list[Tnode]) -> list[str]:
    """The nodes the file lacks (one entry), then each one saved with other dims or
    precision."""
    problems = []
    missing = [n for n in names if n not in arrays]
    if missing:
        problems.append(f"missing {missing}")
    for name, node in zip(names, nodes, strict=True):
        arr = arrays.get(name)
        if arr is None:
            continue
        want = _DTYPES[node.prec]
        if arr.dtype != node.prec.numpy_dtype:
            got = next(k for k, v in _NUMPY.items() if v == arr.dtype)
            problems.append(f"{name}: precision {got}, this model has {want}")
        if tuple(arr.shape) != tuple(node.dims):
            problems.append(f"{name}: shape {tuple(arr.shape)}, this model has {node.dims}")
    return problems


def _put(ctx: Context, arrays: dict[str, np.ndarray], names: list[str],
         nodes: list[Tnode],
         writers: Mapping[int, Callable[[Context, np.ndarray], Context]] | None = None
         ) -> Context:
    for name, node in zip(names, nodes, strict=True):
        write = None if writers is None else writers.get(node.id)
        ctx = ctx.set_values(node, arrays[name]) if write is None else write(ctx, arrays[name])
    return ctx
