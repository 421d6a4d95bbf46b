"""Resumable checkpoints: the training state and the loop's progress in one safetensors file.

The *training state* is what the routines update and a resumed run must start from: the
parameters and their optimizer buffers (momentum). Inputs the host sets (data, learning rates,
the loss-scale tensors) are not in it; the loop records whatever host state it needs (a
``Loss_scaler.save_state`` string, a data position) in :class:`Progress`'s ``extra``, which
travels in the file's metadata. Saving is atomic, so a crash mid-save leaves the previous
checkpoint intact; loading checks every name, shape and precision before it changes anything.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import safetensors

from ocannl.context import Context
from ocannl.errors import Failure
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.tensor.tensor import Tensor

__all__ = ["Progress", "load", "node_names", "save", "training_state"]

_FORMAT = "ocannl.checkpoint/1"
# safetensors dtype names; f16 and bf16 are stored as themselves, exactly.
_DTYPES = {Precision.f64: "F64", Precision.f32: "F32", Precision.f16: "F16",
           Precision.bf16: "BF16"}
_SPEC_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_NUMPY = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32),
          "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}


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
        try:
            d = json.loads(text)
            p = cls(d["step"], d["epoch"], d["extra"])
            p.check()
        except (ValueError, KeyError, TypeError) as err:
            raise Failure(f"checkpoint progress {text!r:.200} is not valid: {err}") from None
        return p


def training_state(loss: Tensor) -> list[Tnode]:
    """The nodes a resumed run must restore: every parameter of ``loss`` (the f32 masters under
    mixed precision) and each one's optimizer buffers, parameters first.

    Build the optimizer computation (``train.sgd_update``) first: it creates the buffers.
    """
    params = loss.params
    nodes = [p.value for p in params]
    for p in params:
        state = p.__dict__.get("optimizer_state", {})
        nodes.extend(state[k] for k in sorted(state))
    return nodes


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


def node_names(nodes: Sequence[Tnode]) -> list[str]:
    """The name each node has in a checkpoint: its label, with ``#2``, ``#3``... appended to
    repeated labels in list order. Labels, not ids: ids depend on how many nodes a process
    created before, labels only on the program."""
    seen: dict[str, int] = {}
    names = []
    for n in nodes:
        k = seen.get(n.label, 0) + 1
        seen[n.label] = k
        names.append(n.label if k == 1 else f"{n.label}#{k}")
    return names


def _spec(arr: np.ndarray, dtype: str) -> object:
    """A safetensors tensor description over ``arr``'s memory (the caller keeps ``arr`` alive)."""
    if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8
        return safetensors.TensorSpec(dtype=_SPEC_DTYPES[dtype], shape=list(arr.shape),
                                      data_ptr=arr.ctypes.data, data_len=arr.nbytes)
    return {"dtype": _SPEC_DTYPES[dtype], "shape": list(arr.shape), "data": arr.tobytes()}


def save(path: str | os.PathLike, ctx: Context, nodes: Iterable[Tnode | Tensor],
         progress: Progress) -> None:
    """Write ``nodes``' values (read from ``ctx``) and ``progress`` to ``path``, atomically:
    the bytes go to a temporary file in the same folder, are flushed to disk, then renamed over
    ``path``, so a crash at any point leaves either the old or the new checkpoint."""
    nodes = _as_nodes(nodes)
    if not isinstance(progress, Progress):
        raise TypeError(f"progress must be a checkpoint.Progress, got {type(progress).__name__}")
    meta = {"format": _FORMAT, "progress": progress.to_json()}
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, node in zip(node_names(nodes), nodes, strict=True):
        arr = np.ascontiguousarray(ctx.get_values(node), dtype=node.prec.numpy_dtype)
        arrays[name] = arr.reshape(node.dims)
        dtypes[name] = _DTYPES[node.prec]
        meta[f"label:{name}"] = node.label
    specs = {k: _spec(a, dtypes[k]) for k, a in arrays.items()}
    data = bytes(safetensors.serialize(specs, metadata=meta))
    del specs  # the arrays it points into were alive until here
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
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
    """Tensors and metadata of a safetensors file; ``Failure`` when it is not one."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise Failure(f"cannot read checkpoint {str(path)!r}: {err}") from None
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        meta = header.get("__metadata__") or {}
        tensors = safetensors.deserialize(data)
    except Exception as err:  # noqa: BLE001 - any decoding error means "not a checkpoint"
        raise Failure(f"{str(path)!r} is not a safetensors checkpoint: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise Failure(f"{str(path)!r} is not an ocannl checkpoint (format "
                      f"{meta.get('format') if isinstance(meta, dict) else None!r}, expected "
                      f"{_FORMAT!r})")
    out = {}
    for name, t in tensors:
        dt = _NUMPY.get(t["dtype"])
        if dt is None:
            raise Failure(f"checkpoint {str(path)!r}: tensor {name!r} has dtype {t['dtype']}, "
                          f"expected one of {sorted(_NUMPY)}")
        out[name] = np.frombuffer(bytes(t["data"]), dtype=dt).reshape(t["shape"])
    return out, meta


def load(path: str | os.PathLike, ctx: Context,
         nodes: Iterable[Tnode | Tensor]) -> tuple[Context, Progress]:
    """Write the values saved in ``path`` into ``nodes`` on ``ctx``; returns the context and
    the saved progress.

    The file must hold exactly these nodes' names (see :func:`node_names`), each with the
    node's dims and precision; otherwise ``ocannl.Failure`` lists every mismatch and the context
    is left as it was.
    """
    nodes = _as_nodes(nodes)
    path = Path(path)
    arrays, meta = _read(path)
    progress = Progress.from_json(meta.get("progress", ""))
    names = node_names(nodes)
    problems = []
    missing = [n for n in names if n not in arrays]
    extra = sorted(set(arrays) - set(names))
    if missing:
        problems.append(f"missing {missing}")
    if extra:
        problems.append(f"not in this model {extra}")
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
    if problems:
        raise Failure(f"checkpoint {str(path)!r} does not match the model: " + "; ".join(problems))
    for name, node in zip(names, nodes, strict=True):
        ctx = ctx.set_values(node, arrays[name])
    return ctx, progress
