"""A data loader: shuffled epochs over NumPy arrays, written batch by batch into a model's
input nodes.

Each epoch walks a permutation of the rows drawn from ``numpy.random.default_rng([seed,
epoch])`` (the order ``examples/common.batch_indices`` always used), a batch at a time; the
last partial batch is dropped (``last="drop"``) or filled with zeros (``last="pad"``,
``valid_rows`` says how many rows are real). The loader's position (epoch, offset into the
epoch) with its seed, batch and an identity of the data set (row count and a fingerprint) goes
in a checkpoint's progress (:meth:`Loader.save_state`); :meth:`Loader.restore_state` refuses a
position from another data set, seed, batch or policy, naming what differs, so a resumed run
sees the same batches in the same order.

A step gathers the batch's rows into staging arrays allocated once (in the inputs' storage
dtype, the data converted once at construction) and writes each with ``Context.set_values``:
one copy into the buffer the routines are bound to, no allocation of the loader's own. For f32
and f64 inputs the whole step allocates nothing (a new epoch draws its permutation);
``set_values`` itself still validates class ids, and copies 16-bit values once more as it
rounds them, in temporaries of its own.

In a data-parallel run every rank draws the same permutation; rank ``r`` of ``w`` writes rows
``[r * b / w, (r + 1) * b / w)`` of each global batch of ``b`` rows (``b`` divisible by ``w``),
so its input nodes hold ``b / w`` rows. Given ``parallel=`` (an
``ocannl.parallel.DataParallel`` of ``s`` shards), the input nodes hold a shard, ``b / s``
rows; rank ``r`` takes its block of ``s / w`` shards and hands it to the data-parallel
object's ``set_batch``. The position is the global batch's, whatever ``w`` and ``s``: a run
resumed on another number of ranks continues with the same batches.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ocannl.backends.rounding import to_precision
from ocannl.context import Context
from ocannl.errors import Failure, require_bool
from ocannl.tensor.data import ClassIds, _checked_ids
from ocannl.tensor.tensor import Tensor

__all__ = ["LAST_POLICIES", "Loader", "fingerprint"]

LAST_POLICIES = ("drop", "pad")
_FORMAT = "ocannl.Loader/1"
_FULL_HASH_BYTES = 64 << 20  # above this, the fingerprint samples rows
_SAMPLED_ROWS = 4096


def _int(name: str, v: object, lo: int) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
        raise ValueError(f"Loader: {name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def fingerprint(arrays: Sequence[np.ndarray]) -> str:
    """A cheap identity of a data set: SHA-256 (first 16 hex digits) of each array's shape,
    dtype and bytes; above 64 MiB in all, of 4096 evenly spaced rows of each instead of all
    of them (a different data set of the same shapes then differs with high probability, not
    certainly)."""
    h = hashlib.sha256()
    total = sum(a.nbytes for a in arrays)
    for a in arrays:
        h.update(f"{a.shape}|{a.dtype.str};".encode())
        if total <= _FULL_HASH_BYTES or len(a) <= _SAMPLED_ROWS:
            h.update(np.ascontiguousarray(a).tobytes())
        else:
            rows = np.linspace(0, len(a) - 1, _SAMPLED_ROWS).astype(np.int64)
            h.update(np.ascontiguousarray(a[rows]).tobytes())
    return h.hexdigest()[:16]


class Loader:
    """Shuffled epochs of ``arrays`` (row ``i`` of each is one example) written into
    ``inputs`` (one tensor per array, e.g. images and labels) by :meth:`next`.

    ``batch`` is the global batch; each input node holds ``batch / world`` rows shaped as the
    array's rows (with ``parallel=``, a data-parallel object of ``s`` shards: ``batch / s``
    rows, the rank and world its own, each batch handed to its ``set_batch``); a
    :class:`~ocannl.tensor.ClassIds` input takes integer ids. ``ValueError``,
    before anything is allocated, for arrays of unequal lengths, a row shape or node shape that
    does not match, a batch larger than the data set (or not divisible by ``world``), an
    unknown ``last`` policy, a rank outside ``[0, world)``, or an input node given twice."""

    def __init__(self, arrays: Sequence[Any], inputs: Sequence[Tensor], *, batch: int,
                 seed: int = 0, last: str = "drop", shuffle: bool = True, rank: int = 0,
                 world: int = 1, parallel: Any = None) -> None:
        self.parallel = parallel
        shards = None
        if parallel is not None:  # duck-typed: ocannl.parallel sits below this module
            if (rank, world) not in ((0, 1), (parallel.rank, parallel.size)):
                raise ValueError(f"Loader: rank={rank}, world={world} disagree with parallel= "
                                 f"(rank {parallel.rank} of {parallel.size}): give one or the "
                                 f"other")
            rank, world, shards = parallel.rank, parallel.size, parallel.shards
        arrays = [np.asarray(a) for a in arrays]
        inputs = list(inputs)
        if not arrays or len(arrays) != len(inputs):
            raise ValueError(f"Loader: give one input tensor per array, got {len(arrays)} arrays "
                             f"and {len(inputs)} inputs")
        first: dict[int, int] = {}  # node id -> its first position in inputs
        for k, t in enumerate(inputs):
            if not isinstance(t, Tensor):
                raise TypeError(f"Loader: inputs must be Tensors, got {type(t).__name__}: {t!r}")
            j = first.setdefault(t.value.id, k)
            if j != k:  # every batch would write one array, then the other, into it
                raise ValueError(f"Loader: inputs[{j}] and inputs[{k}] are the same node "
                                 f"{t.value.name}: each array needs an input node of its own")
        n = len(arrays[0]) if arrays[0].ndim else 0
        for a, t in zip(arrays, inputs, strict=True):
            if a.ndim == 0 or len(a) != n:
                raise ValueError(f"Loader: every array must have the same number of rows; the one "
                                 f"for {t.label} has shape {a.shape}, the first {n} rows")
            if a.dtype.kind not in "biuf":
                raise ValueError(f"Loader: the array for {t.label} must hold real numbers, got "
                                 f"dtype {a.dtype}")
        self.batch = _int("batch", batch, 1)
        self.seed = _int("seed", seed, 0)
        self.world = _int("world", world, 1)
        self.rank = _int("rank", rank, 0)
        if self.rank >= self.world:
            raise ValueError(f"Loader: rank {rank} is not in [0, world={world})")
        if last not in LAST_POLICIES:
            raise ValueError(f"Loader: last must be one of {LAST_POLICIES}, got {last!r}")
        shuffle = require_bool("Loader: shuffle", shuffle)
        if self.batch > n:
            raise ValueError(f"Loader: batch {batch} is larger than the data set's {n} rows")
        if self.batch % self.world:
            raise ValueError(f"Loader: a global batch of {batch} rows does not split into "
                             f"{world} equal shards: give a batch divisible by the number of "
                             f"ranks")
        self.local = self.batch // self.world
        per_rank = f" (the batch over {self.world} ranks)" if self.world > 1 else ""
        node_rows = self.local
        if shards is not None:
            if self.batch % shards:
                raise ValueError(f"Loader: a global batch of {batch} rows does not split into "
                                 f"{shards} equal shards")
            node_rows = self.batch // shards
            per_rank = f" (a shard: the batch over {shards} shards)"
        for a, t in zip(arrays, inputs, strict=True):
            want = (node_rows, *a.shape[1:])
            if t.dims != want:
                raise ValueError(
                    f"Loader: input {t.label} has dims {t.dims}, expected {want}: "
                    f"{node_rows} rows{per_rank} of the array's rows {a.shape[1:]}")
            if isinstance(t, ClassIds):
                # ids out of range are refused now, not mid-epoch
                _checked_ids(t.label, a, t.num_classes, None)
        self.last = last
        self.shuffle = shuffle
        self.n = n
        self.fingerprint = fingerprint(arrays)
        self.inputs = inputs
        # The data in each input's storage dtype, rounded once as set_values would round it,
        # and one staging array per input: a step allocates nothing of its own.
        self._data = [to_precision(a, t.prec) for a, t in zip(arrays, inputs, strict=True)]
        self._staging = [np.zeros((self.local, *t.dims[1:]), d.dtype)
                         for t, d in zip(inputs, self._data, strict=True)]
        self.epoch = 0
        self.offset = 0  # rows of this epoch's permutation already handed out
        self.valid_rows = self.local  # real rows (not padding) of this rank in the last batch
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    # --- position -------------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        return self.n // self.batch if self.last == "drop" else -(-self.n // self.batch)

    @property
    def step(self) -> int:
        """Batches handed out so far, over every epoch."""
        return self.epoch * self.steps_per_epoch + -(-self.offset // self.batch)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the rows in ``epoch``: a permutation drawn from ``(seed, epoch)``, or
        ``0 .. n-1`` without shuffling."""
        if self._perm_epoch != epoch:
            self._perm = (np.random.default_rng([self.seed, int(epoch)]).permutation(self.n)
                          if self.shuffle else np.arange(self.n))
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def indices(self) -> np.ndarray:
        """The rows (into the arrays) of this rank's part of the next batch (without padding),
        without advancing."""
        epoch, offset = self.epoch, self.offset
        if offset + (self.batch if self.last == "drop" else 1) > self.n:
            epoch, offset = epoch + 1, 0
        rows = self.permutation(epoch)[offset:offset + self.batch]
        return rows[self.rank * self.local:(self.rank + 1) * self.local]

    def next(self, ctx: Context) -> Context:
        """Write the next batch into the input nodes (``set_values``) and advance."""
        if self.offset + (self.batch if self.last == "drop" else 1) > self.n:
            self.epoch, self.offset = self.epoch + 1, 0
        rows = self.indices()
        k = len(rows)
        for data, stage, t in zip(self._data, self._staging, self.inputs, strict=True):
            # mode="clip": the rows are in range, and NumPy buffers ``out`` under "raise"
            if k == self.local:
                np.take(data, rows, axis=0, out=stage, mode="clip")
            else:  # the last batch of an epoch, padded
                np.take(data, rows, axis=0, out=stage[:k], mode="clip")
                stage[k:] = 0
            if self.parallel is None:
                ctx = ctx.set_values(t, stage)
        if self.parallel is not None:
            ctx = self.parallel.set_batch(ctx, *self._staging)
        self.valid_rows = k
        self.offset += self.batch
        return ctx

    # --- checkpoints ------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        return {"rows": self.n, "fingerprint": self.fingerprint, "seed": self.seed,
                "batch": self.batch, "last": self.last, "shuffle": self.shuffle}

    def save_state(self) -> str:
        """The position and the data set's identity, one JSON line for a checkpoint's
        ``Progress.extra`` (e.g. under ``"loader"``)."""
        return json.dumps({"format": _FORMAT, "epoch": self.epoch, "offset": self.offset,
                           **self._identity()}, sort_keys=True)

    def restore_state(self, s: str) -> None:
        """Continue from a position :meth:`save_state` wrote. ``ocannl.Failure`` naming every
        difference (rows, fingerprint, seed, batch, last, shuffle) when it was saved over
        another data set or order, or naming what is malformed; the position is unchanged
        then."""
        try:
            d = json.loads(s)
        except (TypeError, ValueError) as err:
            raise Failure(f"Loader state {s!r:.200} is not valid JSON ({err})") from None
        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            got = d.get("format") if isinstance(d, dict) else d
            raise Failure(f"Loader state {s!r:.200}: format {got!r:.60}, expected {_FORMAT!r}")
        mine = self._identity()
        missing = sorted((set(mine) | {"epoch", "offset"}) - set(d))
        if missing:
            raise Failure(f"Loader state {s!r:.200} lacks {', '.join(missing)}")
        diffs = [f"{k} {d[k]!r} in the checkpoint, {v!r} now" for k, v in mine.items()
                 if d[k] != v]
        if diffs:
            raise Failure("the loader's position was saved over another data set or order: "
                          + "; ".join(diffs))
        epoch, offset = d["epoch"], d["offset"]
        for name, v in (("epoch", epoch), ("offset", offset)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise Failure(f"Loader state: {name} must be an integer >= 0, got {v!r}")
        if offset % self.batch or offset > self.steps_per_epoch * self.batch:
            raise Failure(f"Loader state: offset {offset} is not a batch boundary of an epoch "
                          f"of {self.steps_per_epoch} batches of {self.batch}")
        self.epoch, self.offset = epoch, offset

    def __repr__(self) -> str:
        return (f"Loader({self.n} rows, batch {self.batch}"
                f"{f' (rank {self.rank} of {self.world})' if self.world > 1 else ''}, "
                f"epoch {self.epoch}, offset {self.offset})")
