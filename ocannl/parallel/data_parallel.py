"""Data-parallel training over a communicator: the model agreed on, the shards computed, their
gradients summed in the shard tree's order, checkpoints of any rank count."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from ocannl import checkpoint
from ocannl.context import (
    Checked,
    Context,
    Routine,
    Staged,
    check_blocks,
    flat_layout,
    offset_in,
)
from ocannl.errors import Failure, require_bool
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.parallel.buckets import BucketExchange, bucket_ranges, host_values
from ocannl.parallel.comm import Communicator
from ocannl.parallel.shards import ShardTree
from ocannl.parallel.shared_sum import (
    SharedBucket,
    SharedBuckets,
    SharedSum,
    copy_to_the_others,
)
from ocannl.parallel.synced import ShardMemory, SyncedRoutine, compile_synced
from ocannl.parallel.zero import FLAT_ALIGN, OptimizerShard
from ocannl.tensor.tensor import Tensor


def model_description(loss: Tensor) -> list[list[Any]]:
    """What every rank must agree on: each parameter's checkpoint name, dims and precision, and
    its gradient's, in the order of ``loss.params``."""
    params = loss.params
    names = checkpoint.node_names([p.value for p in params])
    out: list[list[Any]] = []
    for name, p in zip(names, params, strict=True):
        assert p.grad is not None
        out.append([name, list(p.value.dims), p.value.prec.value, p.grad.prec.value])
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def graph_description(loss: Tensor) -> list[list[Any]]:
    """Every tensor ``loss`` is computed from, in its topological order: label, kind (param,
    term, op), dims and precision. Ranks with the same parameters may still differ here: in
    the precision of the cast twins they compute in (f16 vs bf16), an input's precision, an
    operation."""
    return [[t.label, t.kind, list(t.value.dims), t.value.prec.value] for t in loss.topo()]


@functools.lru_cache(maxsize=1)
def code_description() -> dict[str, str]:
    """The code a rank runs: a digest of this package's Python source (ranks on machines with
    different versions of it), and Python's and NumPy's versions."""
    root = Path(__file__).resolve().parent.parent  # the ocannl package
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return {"ocannl source": h.hexdigest()[:12], "python": platform.python_version(),
            "numpy": np.__version__}


def _refuse_differences(everyone: Sequence[dict[str, Any]]) -> None:
    """``ocannl.Failure`` naming rank 0's value and the first other rank's where the ranks'
    descriptions (:meth:`DataParallel.description`) differ in the graph or the code."""
    graphs = [d.get("graph_digest") for d in everyone]
    if any(g != graphs[0] for g in graphs):
        odd = next(r for r, g in enumerate(graphs) if g != graphs[0])
        a, b = everyone[0].get("graph") or [], everyone[odd].get("graph") or []
        k = next(k for k in range(max(len(a), len(b)))
                 if (a[k] if k < len(a) else None) != (b[k] if k < len(b) else None))

        def show(g: list[list[Any]]) -> str:
            if k >= len(g):
                return "nothing"
            label, kind, dims, prec = g[k]
            return f"{label} ({kind}) dims {tuple(dims)} {prec}"

        raise Failure(f"data-parallel: the ranks compute the loss differently: first "
                      f"difference, rank 0 vs rank {odd}: tensor #{k}: {show(a)} vs {show(b)}. "
                      f"Every rank must build the same model, in the same precisions")
    codes = [d.get("code") or {} for d in everyone]
    if any(c != codes[0] for c in codes):
        odd = next(r for r, c in enumerate(codes) if c != codes[0])
        a, b = codes[0], codes[odd]
        diff = ", ".join(f"{key} {a.get(key)} vs {b.get(key)}" for key in sorted({*a, *b})
                         if a.get(key) != b.get(key))
        raise Failure(f"data-parallel: the ranks run different code: rank 0 vs rank {odd}: "
                      f"{diff}. Install the same versions on every machine")


def _first_difference(a: list[list[Any]], b: list[list[Any]]) -> str:
    for k in range(max(len(a), len(b))):
        x = a[k] if k < len(a) else None
        y = b[k] if k < len(b) else None
        if x != y:
            def show(e: list[Any] | None) -> str:
                return "nothing" if e is None else f"{e[0]} dims {tuple(e[1])} {e[2]}"
            return f"parameter #{k}: {show(x)} vs {show(y)}"
    return "the same parameters"


def _as_node(t: Tnode | Tensor) -> Tnode:
    node = t.value if isinstance(t, Tensor) else t
    if not isinstance(node, Tnode):
        raise TypeError(f"expected a Tensor or a Tnode, got {type(t).__name__}: {t!r}")
    return node


# --- data-parallel training ---------------------------------------------------------------------

# A bucket's exchange under way: through the communicator, or in shared memory.
Exchange = BucketExchange | SharedBucket

#: The key of ``Progress.extra`` where :meth:`DataParallel.save` records the shard count.
SHARDS_KEY = "data_parallel"


class _BlockPlan:
    """A rank's later shards in the plain step (no running statistics, no draws, the last shard
    not cut at the buckets), worked out once for a context and its gradient routines: per
    shard, the buffer its gradient goes into, its routines bound to that buffer and to the
    shard's staged inputs (``first``, then ``more`` for each later micro-batch; added as a
    step first has that many), and the tree's additions that fold it in
    (:meth:`DataParallel._fold_step`'s); then the block's partial sums left, the tree's nodes
    with their buffers. ``flat`` keeps the block's leftmost node; the other buffers are the
    plan's own."""

    __slots__ = ("add", "micros", "shards", "stack")

    def __init__(self, add: Callable[..., Any]) -> None:
        self.shards: list[tuple[Any, list[Routine], list[tuple[Any, Any, Any]]]] = []
        self.stack: list[tuple[tuple[int, int], Any]] = []
        self.micros = 0  # the micro-batches each shard has its routines for
        self.add = add  # the buffers' module's addition (NumPy's, CuPy's)


class _Feeds:
    """A context's every-step host calls, made once: the inputs' :class:`Staged` (one list
    of the inputs' per micro-batch of a step, made as a step first has that many: each writes
    the block's first shard into the input, the later ones apart) and the loss's reader
    (made after the first shard has run). They hold no reference to the context."""

    __slots__ = ("flat", "read_loss", "staged", "unscale")

    def __init__(self) -> None:
        self.staged: list[list[Staged]] = []
        self.read_loss: Callable[[], Any] | None = None
        self.flat: Any = None  # the flat gradients' buffer, once reduce has asked for it
        self.unscale: float | None = None  # grad_unscale's value last written there


def _array_module(a: Any) -> Any:
    """NumPy for a NumPy array, else the array's own module (CuPy)."""
    if isinstance(a, np.ndarray):
        return np
    import cupy

    return cupy


class DataParallel:
    """Data-parallel training of ``loss`` over ``comm``'s ranks: the flat gradient buffer, the
    agreement checks, the per-step reduction, broadcasts and checkpoints.

    It is a :class:`ocannl.mixed_prec.GradReducer`: give it to ``scaled_step`` /
    ``gated_step`` as ``reducer=``. Without loss scaling, build the update with
    ``optimizer.update(loss, grad_unscale=dp.grad_unscale())`` and run the gradient routine,
    :meth:`reduce`, the update routine.

    **Shards** (``shards``, default: one per rank). The global batch is cut into ``shards``
    equal shards of consecutive rows, the model built over one shard's rows (``inputs`` hold a
    shard); rank ``r`` of ``N`` computes the ``shards / N`` consecutive shards from ``r *
    shards / N`` (``shards`` must be a multiple of ``N``), each as one run of the gradient
    routine, and the shard gradients are summed in the fixed order of :class:`ShardTree`
    (each rank sums its own block locally, the partial sums are exchanged, never summed by
    MPI or NCCL beyond an addition of two, and the rest of the tree is summed in the same
    order on every rank). The gradients, hence the losses' course, the parameters, the
    optimizer and scaler states, are then the same bits on any number of ranks dividing
    ``shards`` (1 included), on one kind of machine. Feed a step with :meth:`set_batch` (this
    rank's block, or the global batch) and compile with :meth:`compile` (or give the gradient
    routines to :meth:`use_routines`) when a rank computes more than one shard.
    ``fixed_order=False`` (one shard per rank only) leaves the sum to the communicator's
    allreduce, whose order depends on the implementation and the rank count (the bits then
    too).

    **State updated by the forward code.** Random draws with batch axes are keyed by the
    global row (each shard's ``Rng.row_offset`` is set before it runs) and every shard of a
    step starts from the same stream counters, so dropout masks are the same on any rank
    count. Batch-norm statistics are per shard by default (the model sees a shard); the
    running statistics each shard's run updates from the same starting values are then
    averaged over the shards through the same tree.

    **Synced batch norm** (``batch_norm(..., sync=True)``): the statistics, and the two sums
    their gradient needs, are over the global batch. The gradient routine (compiled by
    :meth:`compile` or :meth:`compile_gradients`, run by :meth:`run_and_reduce`) is cut right
    after each such sum a shard computes (three a layer: two in the forward code, one in the
    backward); between the parts the sums of every shard are exchanged and added in the
    tree's order, and put in place of the shard's own, so the bits are the same on any rank
    count. A rank of several shards runs each part on each of its shards in turn, saving
    and restoring what a shard's run leaves between parts (its activations, its gradients
    so far: one copy per shard). The running statistics are then the same on every shard.
    Not with gradient accumulation (refused).

    **Overlap** (``overlap=True``): the exchange in buckets of at least ``bucket_bytes``
    (whole parameters, from the flat buffer's end), each started while the rest of the block's
    last shard's backward code runs (:meth:`run_and_reduce`; the recipes call it), each the
    tree's on its elements: the same bits as without. The checksum, clipping and the update
    wait for the last bucket (they read every gradient). With synced batch norm, one shard a
    rank: each bucket's exchange starts after the part of the cut routine that completes it;
    several shards a rank: after the last part.

    **Sharded optimizer state** (``shard_optimizer=True``, ZeRO-1): the parameters and their
    gradients lie in flat buffers of one layout cut into ``N`` equal slices of elements; each
    rank's optimizer keeps and updates the state of its slice only (:attr:`optimizer_shard`,
    which the mixed-precision recipes give the optimizer's update; build a plain update with
    ``optimizer.update(loss, ..., shard=dp.optimizer_shard)``), then :meth:`after_update`
    gathers the updated parameters on every rank. The bits are the unsharded run's; the
    optimizer's state per rank is ``1 / N`` of it (within a slice's alignment padding).
    :meth:`save` gathers the whole state into the checkpoint and :meth:`load` takes each
    rank's slice, so a checkpoint of a sharded run resumes an unsharded one and back, on any
    rank count. :meth:`gather_state` reads the whole state (a collective).

    ``inputs``: the tensors holding a shard (data, targets); their dims are compared across
    ranks by :meth:`setup`, which refuses unequal shards. Every parameter gradient must be f32
    (f16 / bf16 models read cast twins of f32 masters); ``ValueError`` otherwise.
    """

    def __init__(self, comm: Communicator, loss: Tensor, *, inputs: Sequence[Tensor] = (),
                 label: str | None = None, shards: int | None = None,
                 fixed_order: bool = True, track_losses: bool = True,
                 shard_optimizer: bool = False, overlap: bool = False,
                 bucket_bytes: int = 1 << 20) -> None:
        if not isinstance(comm, Communicator):
            raise TypeError(f"DataParallel: expected a Communicator (SingleProcess, "
                            f"MpiCommunicator, NcclCommunicator), got {type(comm).__name__}")
        if not isinstance(loss, Tensor):
            raise TypeError(f"DataParallel: expected the loss Tensor, got {type(loss).__name__}")
        if loss.grad is None or not loss.params:
            raise ValueError(f"DataParallel: loss {loss.label} depends on no parameter")
        wrong = [p for p in loss.params if p.grad is None or p.grad.prec is not Precision.f32]
        if wrong:
            desc = ", ".join(f"{p.label} ({p.grad.prec.value if p.grad else 'no'} gradient)"
                             for p in wrong)
            raise ValueError(f"DataParallel: every parameter gradient must be f32, the buffer "
                             f"the ranks sum (narrow buffers are never summed): {desc}; build an "
                             f"f16/bf16 model with mixed_prec.with_master_weights so its "
                             f"gradients widen into f32 masters")
        for t in inputs:
            if not isinstance(t, Tensor):
                raise TypeError(f"DataParallel: inputs must be Tensors, got {type(t).__name__}")
        size = comm.size
        n = size if shards is None else shards
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n % size:
            raise ValueError(f"DataParallel: shards must be a positive multiple of the number "
                             f"of ranks, {size}, got {shards!r}")
        if not isinstance(fixed_order, bool):
            raise TypeError(f"DataParallel: fixed_order must be a bool, got {fixed_order!r}")
        if not fixed_order and n != size:
            raise ValueError(f"DataParallel: fixed_order=False leaves the sum to the "
                             f"communicator, one shard per rank: shards must be {size}, got {n}")
        self.comm = comm
        self._tells_step = hasattr(comm, "step")
        self.loss = loss
        self.params = list(loss.params)
        self.inputs = tuple(inputs)
        self._input_rows: list[int] | None = None  # a shard's rows of each (set_batch)
        self.label = label or f"flat_grads_{loss.label}"
        self.shards = n
        self.per_rank = n // size
        self.first_shard = comm.rank * self.per_rank
        self.fixed_order = fixed_order
        self.track_losses = require_bool("DataParallel: track_losses", track_losses)
        self.shard_optimizer = require_bool("DataParallel: shard_optimizer", shard_optimizer)
        if shard_optimizer:
            precs = sorted({p.value.prec.value for p in loss.params})
            if len(precs) > 1:
                raise ValueError(f"DataParallel: shard_optimizer=True lays the parameters out "
                                 f"in one flat buffer of one precision; loss {loss.label}'s are "
                                 f"{precs} (build f16/bf16 models with f32 masters: "
                                 f"mixed_prec.with_master_weights)")
        self.overlap = require_bool("DataParallel: overlap", overlap)
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) \
                or bucket_bytes < 1:
            raise ValueError(f"DataParallel: bucket_bytes must be an integer >= 1, got "
                             f"{bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self._buckets: list[tuple[int, int, list[int]]] = []
        # Keyed by the routine itself, held weakly (an id could be a later routine's): the
        # optimizer's update cut at the buckets, its parts and the buckets each part reads
        # the gradients of (compile_update); the gradient routine cut at the buckets.
        self._update_splits: weakref.WeakKeyDictionary[Routine, list[tuple[Routine, list[int]]]] \
            = weakref.WeakKeyDictionary()
        self._splits: weakref.WeakKeyDictionary[Routine, tuple[list[Routine], list[int]]] = \
            weakref.WeakKeyDictionary()
        self._zero: OptimizerShard | None = None
        self.flat_params: Tnode | None = None  # with shard_optimizer: the parameters' buffer
        self._gathered = True  # the parameters were gathered since the last update
        self.tree = ShardTree(n)
        self._covers = [self.tree.cover(r * self.per_rank, (r + 1) * self.per_rank)
                        for r in range(size)]
        import ocannl.tensor as T
        from ocannl.tensor.data import buffers, random_streams

        self.rngs = random_streams(loss)
        drawn = {m.id for r in self.rngs for m in r.state_nodes()}
        # Sums over the global batch (synced batch norm), and the state updated from them only.
        self.global_sums = T.global_sums(loss)
        same = {m.id for g in self.global_sums for m in g.same_on_every_shard}
        # What the forward code updates besides random streams: batch-norm running statistics
        # (averaged over the shards, but for those every shard computes alike).
        self.stats = [m for m in buffers(loss) if m.id not in drawn and m.id not in same]
        self._synced_routines: weakref.WeakKeyDictionary[Routine, SyncedRoutine] = \
            weakref.WeakKeyDictionary()  # the whole routine's cut
        self._memories: weakref.WeakKeyDictionary[SyncedRoutine, ShardMemory] = \
            weakref.WeakKeyDictionary()  # a cut routine's shards' copies
        self._counted: weakref.WeakKeyDictionary[Context, bool] = weakref.WeakKeyDictionary()
        self._unscale_for: tuple[float, float] | None = None  # the last scale and its value
        self._unscale = T.term(np.float32(self._unscale_value(None)),
                               label="dp_grad_unscale", prec=Precision.f32)
        self.flat: Tnode | None = None
        self._shared: list[np.ndarray] | None = None  # every rank's flat, mapped here
        self._summer: SharedSum | None = None  # the sum over them
        self._bucket_sums: SharedBuckets | None = None  # with overlap: bucket by bucket
        self._shared_params: list[np.ndarray] | None = None  # with ZeRO-1: their parameters
        self._offsets: weakref.WeakKeyDictionary[Context, int] = weakref.WeakKeyDictionary()
        self._feeds: weakref.WeakKeyDictionary[Context, _Feeds] = weakref.WeakKeyDictionary()
        self._last_feeds: tuple[weakref.ref[Context], _Feeds] | None = None
        self.reductions = 0  # reductions run by this process
        self.step = 0  # optimizer steps since the start (or the checkpoint loaded)
        self.shard_losses: list[float] = []  # this rank's shards' losses at the last reduce
        self._first: Any = None  # the gradient routine (zeroes, then computes) and the
        self._more: Any = None  # accumulating one (adds a micro-batch)
        self._pending: list[list[Staged]] = []  # per micro-batch: the other shards' inputs
        self._counters_at: list[list[Any]] = []  # per micro-batch: the streams' counters
        self._stats_at: list[Any] | None = None  # the running statistics before the step
        self._scatter: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}  # by range
        self._stack: list[tuple[tuple[int, int], Any]] = []  # this step's complete nodes
        self._free: list[Any] = []  # buffers of flat's size to reuse
        # Gradient routines bound to write into one of those buffers instead of flat, by the
        # buffer's and the routine's ids (Context.rebound: no compile, no copy out of flat).
        self._moved: dict[tuple[int, int], Any] = {}
        self._blocks: dict[int, _BlockPlan] = {}  # the plain step's, by its context's id
        self._parents = self.tree.parents()

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def __repr__(self) -> str:
        return (f"DataParallel({self.comm!r}, {len(self.params)} parameters, "
                f"{self.shards} shard(s), flat={'unset' if self.flat is None else self.flat.size})")

    @property
    def shared_memory(self) -> bool:
        """Whether the gradient buffer's sum is taken in memory every rank maps (ranks on
        one node, on the CPU, one partial sum a rank: :meth:`setup` decides; with overlap,
        bucket by bucket) rather than through MPI's exchange."""
        return self._shared is not None

    @property
    def optimizer_shard(self) -> OptimizerShard | None:
        """With ``shard_optimizer=True``, this rank's slice of the parameters (give it to the
        optimizer's update as ``shard=``; the recipes do); else None."""
        if not self.shard_optimizer:
            return None
        if self._zero is None:
            self._zero = OptimizerShard(self.params, self.rank, self.size, align=FLAT_ALIGN)
        return self._zero

    # --- setup ---------------------------------------------------------------------------------

    def description(self) -> dict[str, Any]:
        """What :meth:`setup` compares across ranks: the model (parameter names, dims,
        precisions), the shard (the inputs' labels and dims) and the shard count."""
        model = model_description(self.loss)
        shards = [[t.label, list(t.value.dims)] for t in self.inputs]
        graph = graph_description(self.loss)
        return {"model": model, "model_digest": _digest(model), "shards": shards,
                "shard_count": [self.shards, self.fixed_order, self.shard_optimizer],
                "graph": graph, "graph_digest": _digest(graph), "code": code_description()}

    def setup(self, ctx: Context) -> Context:
        """Check that every rank has the same model, an equal shard and the same shard count
        (``ocannl.Failure`` on every rank, naming what differs, before any collective on
        device memory), then make the parameters' gradients views of one flat f32 buffer of
        ``ctx``. Call it before compiling anything that reads or writes the gradients."""
        if self.flat is not None:
            raise ValueError(f"{self!r}: setup was already called")
        everyone = self.comm.allgather(self.description())
        digests = [d["model_digest"] for d in everyone]
        if len(set(digests)) > 1:
            odd = next(r for r, d in enumerate(digests) if d != digests[0])
            raise Failure(
                f"data-parallel: the ranks disagree on the model (digest of parameter names, "
                f"dims and precisions): rank 0 has {digests[0][:12]}, rank {odd} has "
                f"{digests[odd][:12]}; first difference, rank 0 vs rank {odd}: "
                f"{_first_difference(everyone[0]['model'], everyone[odd]['model'])}. Every rank "
                f"must build the same model")
        shards = [d["shards"] for d in everyone]
        if any(s != shards[0] for s in shards):
            desc = "; ".join(f"rank {r}: " + ", ".join(f"{lab} {tuple(dims)}" for lab, dims in s)
                             for r, s in enumerate(shards))
            raise Failure(f"data-parallel: the ranks' shards differ ({desc}); every rank must "
                          f"hold an equal shard of the global batch (a global batch divisible "
                          f"by the number of ranks, {self.size})")
        counts = [d.get("shard_count") for d in everyone]
        if any(c != counts[0] for c in counts):
            odd = next(r for r, c in enumerate(counts) if c != counts[0])
            def show(c: list[Any]) -> str:
                return f"shards={c[0]}, fixed_order={c[1]}, shard_optimizer={c[2]}"

            raise Failure(f"data-parallel: the ranks disagree on the shards: rank 0 has "
                          f"{show(counts[0])}; rank {odd} has {show(counts[odd])}")
        _refuse_differences(everyone)  # the graphs (twins' precisions, inputs') and the code
        follow = getattr(self.comm, "follow", None)  # NCCL: its stream after the context's
        if follow is not None and ctx.stream is not None:
            follow(ctx.stream)
        zero = self.optimizer_shard
        grads = [p.grad for p in self.params if p.grad is not None]
        offsets, total = flat_layout([g.size for g in grads], FLAT_ALIGN)
        length = total if zero is None else zero.length
        self._shared = self._shared_blocks(ctx, length)
        storage = None if self._shared is None else self._shared[self.rank]
        if zero is None:
            self.flat = ctx.share_flat(grads, label=self.label, align=FLAT_ALIGN,
                                       storage=storage)
            self._buckets = bucket_ranges(offsets, [g.size for g in grads], self.flat.size,
                                          self.bucket_bytes)
            return self._share_buckets(ctx)
        self.flat = ctx.share_flat(grads, label=self.label, align=FLAT_ALIGN, length=zero.length,
                                   storage=storage)
        # the parameters too, where the gradients are: each rank's updated slice is copied
        # into the others' buffers (after_update), no bytes through MPI
        self._shared_params = None if self._shared is None else \
            cast(Any, self.comm).shared_blocks(zero.length)  # an MpiCommunicator's
        self.flat_params = ctx.share_flat(
            [p.value for p in self.params], label=f"flat_params_{self.loss.label}",
            align=FLAT_ALIGN, length=zero.length,
            storage=None if self._shared_params is None else self._shared_params[self.rank])
        for q in zero.parts:
            ctx = ctx.share_slice(q.value, self.flat_params, q.offset + q.start)
            ctx = ctx.share_slice(q.grad, self.flat, q.offset + q.start)
        self._buckets = bucket_ranges(offsets, [g.size for g in grads], self.flat.size,
                                      self.bucket_bytes)
        return self._share_buckets(ctx)

    def _share_buckets(self, ctx: Context) -> Context:
        """With overlap and the flat buffers in shared memory: the buckets' sums there too
        (:class:`SharedBuckets`). Collective, as setup is."""
        if self.overlap and self._shared is not None:
            self._bucket_sums = SharedBuckets(self.comm, self.tree, self._covers, self._shared,
                                              [(a, b) for a, b, _ in self._buckets])
        return ctx

    def _shared_blocks(self, ctx: Context, length: int) -> list[np.ndarray] | None:
        """Every rank's flat gradient buffer in memory every rank maps, where the ranks are
        on one node, on the CPU, and each sends the tree one partial sum (its block one
        subtree): the whole buffer's sum is then taken from the others' buffers directly
        (:meth:`_shared_sum`), no bytes through MPI. Else None (MPI's exchange)."""
        start = getattr(self.comm, "shared_blocks", None)
        mine = (start is not None and self.size > 1 and self.fixed_order
                and ctx.backend_name() == "cpu" and all(len(c) == 1 for c in self._covers))
        if not all(self.comm.allgather(bool(mine))):  # every rank, or none
            return None
        assert start is not None
        return start(length)

    def compile(self, ctx: Context, recipe: Any) -> Context:
        """Compile a mixed-precision ``recipe`` built with ``reducer=self`` (its own
        :meth:`compile`) and take its gradient routines for this rank's other shards."""
        ctx = recipe.compile(ctx)
        routine = getattr(recipe, "_routine", None)
        if routine is None:
            raise TypeError(f"DataParallel.compile: expected a mixed_prec recipe, got "
                            f"{type(recipe).__name__}")
        first = routine(recipe.grad_comp)
        more = routine(recipe.accumulate_comp) if recipe.accumulate_comp is not None else None
        self.use_routines(first, more)
        if self.global_sums and more is not None:
            raise ValueError(f"{self!r}: synced batch norm with gradient accumulation is not "
                             f"supported: each micro-batch's statistics would be exchanged "
                             f"apart; accumulate=1, or batch_norm(sync=False)")
        for comp, whole in ((recipe.grad_comp, first), (recipe.accumulate_comp, more)):
            if whole is not None:
                ctx = self._split(ctx, comp, whole)
        # The random draws of this rank's first shard are keyed by its first global row even
        # when its data are written into the inputs directly (one shard per rank).
        return self._set_row_offset(ctx, self.first_shard)

    def compile_gradients(self, ctx: Context, comp: Any) -> tuple[Context, Routine]:
        """Compile a gradient computation (``train.grad_update``) into a routine; with
        ``overlap=True``, also cut after each bucket's last gradient, for
        :meth:`run_and_reduce` (the mixed-precision recipes' routines get theirs from
        :meth:`compile`)."""
        ctx, whole = ctx.compile(comp)
        return self._split(ctx, comp, whole), whole

    @property
    def update_order(self) -> list[Tensor]:
        """The parameters in the order their summed gradients arrive: with ``overlap=True``,
        the buckets' order (the last layers first, as the backward code writes them), else the
        model's. Give it to ``optimizer.update(..., order=)`` so that an update compiled with
        :meth:`compile_update` waits for each bucket just before it reads it."""
        if not self.overlap:
            return list(self.params)
        if self.flat is None:
            raise ValueError(f"{self!r}: call setup(ctx) before asking for update_order (the "
                             f"buckets are cut from the gradients' flat buffer)")
        return [self.params[i] for _, _, members in self._buckets for i in reversed(members)]

    def compile_update(self, ctx: Context, comp: Any) -> tuple[Context, Routine]:
        """Compile the optimizer's update (``optimizer.update(loss, ..., order=
        dp.update_order)``) into a routine for :meth:`run_and_reduce`'s ``update``; with
        ``overlap=True``, also cut after each bucket's parameters, so that each part waits
        only for the exchanges of the buckets whose gradients it reads (the same items, the
        same bits). A part that reads every gradient (a clipping norm, a checksum) waits for
        them all."""
        if self.overlap and self.flat is None:
            raise ValueError(f"{self!r}: call setup(ctx) before compiling (the update is cut "
                             f"at the gradients' buckets)")
        ctx, whole = ctx.compile(comp)
        if not self.overlap or len(self._buckets) < 2 or self.global_sums:
            return ctx, whole
        zero = self.optimizer_shard
        if zero is None:
            groups = [[self.params[i].value for i in members] for _, _, members in self._buckets]
        else:  # this rank's parts of each bucket
            groups = [[q.value for q in zero.parts
                       if a < q.offset + q.start + q.size and q.offset + q.start < b]
                      for a, b, _ in self._buckets]
        ctx, parts, _ = ctx.compile_split(comp, [g for g in groups if g])
        # What a part reads of the gradients, by memory: any of its buffers inside the flat
        # buffer (the update writes no gradient), whatever node views it.
        flat = ctx.device_buffer(self.flat)
        plan = []
        for part in parts:
            spans = [(at, at + b.size) for b in part.buffers
                     if (at := offset_in(b, flat)) is not None]
            plan.append((part, [k for k, (a, z, _) in enumerate(self._buckets)
                                if any(lo < z and a < hi for lo, hi in spans)]))
        if len(parts) > 1 and len(plan[0][1]) < len(self._buckets):
            self._update_splits[whole] = plan
        return ctx, whole

    def _split(self, ctx: Context, comp: Any, whole: Routine) -> Context:
        if self.global_sums:
            return self._split_synced(ctx, comp, whole)
        if not self.overlap:
            return ctx
        if self.flat is None:
            raise ValueError(f"{self!r}: call setup(ctx) before compiling")
        grads = [p.grad for p in self.params]
        groups = [[grads[i] for i in members] for _, _, members in self._buckets]
        ctx, parts, ready = ctx.compile_split(comp, groups)
        if min(ready) < len(parts) - 1:  # else every bucket completes at the end: no overlap
            self._splits[whole] = (parts, ready)
        return ctx

    def _split_synced(self, ctx: Context, comp: Any, whole: Routine) -> Context:
        """Cut the gradient routine at the global sums (synced batch norm), for
        :meth:`run_and_reduce`."""
        if self.flat is None:
            raise ValueError(f"{self!r}: call setup(ctx) before compiling")
        # Overlap with one shard a rank: its buckets' exchanges start between the parts. A
        # rank of several shards runs them part by part, so its last shard's gradient is
        # only complete at the end: its exchange waits for the last part.
        grads = [p.grad for p in self.params]
        buckets = [[grads[i] for i in members] for _, _, members in self._buckets] \
            if self.overlap and self.per_rank == 1 else []
        per_shard = [t.value for t in self.inputs] + [r.row_offset for r in self.rngs]
        finals = [*(p.grad for p in self.params if p.grad is not None), self.loss.value,
                  *self.stats]
        ctx, synced = compile_synced(ctx, comp, self.global_sums, per_shard, finals, buckets)
        self._synced_routines[whole] = synced
        return ctx

    def use_routines(self, first: Any, more: Any = None) -> None:
        """The routines that compute one shard's gradients: ``first`` zeroes them and computes
        (``train.grad_update``), ``more`` adds a micro-batch's (``accumulate=True``; with
        gradient accumulation only). Needed when a rank computes more than one shard."""
        self._first, self._more = first, more
        self._moved.clear()  # bound from the routines these replace
        self._blocks.clear()

    # --- feeding the shards --------------------------------------------------------------------

    @property
    def shard_rows(self) -> int:
        """Rows of a shard: the first axis of the first input."""
        if not self.inputs:
            raise ValueError(f"{self!r}: no inputs were given: set_batch needs them")
        return int(self.inputs[0].value.dims[0])

    def block(self, rows: Any) -> Any:
        """This rank's block of a global batch (its shards' rows, split along the first
        axis): rows ``[first_shard * n, (first_shard + per_rank) * n)``, ``n`` rows a shard."""
        total = len(rows)
        if total % self.shards:
            raise ValueError(f"DataParallel.block: a global batch of {total} rows does not split "
                             f"into {self.shards} equal shards")
        n = total // self.shards
        return rows[self.first_shard * n:(self.first_shard + self.per_rank) * n]

    def set_batch(self, ctx: Context, *arrays: Any) -> Context:
        """Write a step's (or micro-batch's) data: one array per input, each this rank's block
        (``per_rank`` shards of rows) or the whole global batch (``shards`` shards). The
        first shard of the block goes into the inputs (the recipe's gradient routine reads
        it); the others into buffers of their own (:class:`Staged`), in one write per input,
        for :meth:`reduce`, which runs them. Every shard's values are checked before anything
        is written (a bad value in a later shard would otherwise stop reduce halfway)."""
        if len(arrays) != len(self.inputs):
            raise ValueError(f"DataParallel.set_batch: expected {len(self.inputs)} arrays (one "
                             f"per input: {[t.label for t in self.inputs]}), got {len(arrays)}")
        k = self.per_rank
        if k > 1:
            self._refuse_another_context(ctx, "set_batch")
        feeds = self._feeds_of(ctx)
        micro = len(self._pending)
        made = feeds.staged[micro] if micro < len(feeds.staged) else None
        checked: list[Checked] = []
        every_rows = self._input_rows or self._rows_of_inputs()
        for j, a in enumerate(arrays):
            rows = every_rows[j]
            n = len(a)
            if n != rows * k:
                if n != rows * self.shards:
                    raise ValueError(
                        f"DataParallel.set_batch: {self.inputs[j].label} got {n} rows, expected "
                        f"this rank's block of {k} shard(s) of {rows} rows ({rows * k}) or the "
                        f"global batch ({rows * self.shards})")
                a = a[self.first_shard * rows:(self.first_shard + k) * rows]
            checked.append(made[j].check(a) if made is not None
                           else check_blocks(self.inputs[j].value, a, k))
        if made is None:  # the staging of this many micro-batches, once every value passed
            made = [ctx.staged(t, k) for t in self.inputs]
            feeds.staged.append(made)
        if k > 1:
            if not self._pending and self.stats:
                self._stats_at = [np.array(ctx.get_values(m), copy=True) for m in self.stats]
            if self.rngs:
                self._counters_at.append([ctx.get_values(r.counter) for r in self.rngs])
        for st, c in zip(made, checked, strict=True):
            st.write(c)
        self._pending.append(made if k > 1 else [])  # one shard: nothing staged to run
        return self._set_row_offset(ctx, self.first_shard) if self.rngs else ctx

    def _rows_of_inputs(self) -> list[int]:
        """A shard's rows of each input (its first axis), looked up once."""
        flat = [t.label for t in self.inputs if not t.value.dims]
        if flat:
            raise ValueError(f"DataParallel.set_batch: input(s) {flat} have no axis: a batch is "
                             f"split into shards along its inputs' first axis")
        self._input_rows = [int(t.value.dims[0]) for t in self.inputs]
        return self._input_rows

    def _refuse_another_context(self, ctx: Context, what: str) -> None:
        """A step's later shards are staged in the context its first micro-batch was given
        (set_batch): its other micro-batches and its reduce must use that one."""
        if self._pending and self._pending[0] and self._pending[0][0].context is not ctx:
            raise ValueError(f"{self!r}: {what} got {ctx!r}, but this step's data went to "
                             f"{self._pending[0][0].context!r} (set_batch): a step's "
                             f"micro-batches and its reduce use one context")

    def _put_shard(self, ctx: Context, j: int, staged: Sequence[Staged]) -> Context:
        """Shard ``j`` (``j >= 1``) of the block into the inputs, from its staged copy."""
        for st in staged:
            st.put(j)
        return self._set_row_offset(ctx, self.first_shard + j) if self.rngs else ctx

    def _feeds_of(self, ctx: Context) -> _Feeds:
        """``ctx``'s every-shard host calls, looked up once (the last context's without a
        dictionary lookup: a rank's shards run in one context)."""
        last = self._last_feeds
        if last is not None and last[0]() is ctx:
            return last[1]
        feeds = self._feeds.get(ctx)
        if feeds is None:
            feeds = self._feeds[ctx] = _Feeds()
        self._last_feeds = (weakref.ref(ctx), feeds)
        return feeds

    def _set_row_offset(self, ctx: Context, shard: int) -> Context:
        if not self.rngs:
            return ctx
        row = shard * self.shard_rows
        if self._offsets.get(ctx) != row:
            for r in self.rngs:
                ctx = ctx.set_values(r.row_offset, np.float64(row))
            self._offsets[ctx] = row
        return ctx

    # --- the reducer ---------------------------------------------------------------------------

    def _unscale_value(self, scaler: Any) -> float:
        """``1 / (scale * shards)`` rounded once to f32; the last one is kept (an exact
        reciprocal costs tens of microseconds, and the scale changes rarely)."""
        scale = 1.0 if scaler is None else float(scaler.scale_value())
        last = self._unscale_for
        if last is not None and last[0] == scale:
            return last[1]
        from ocannl.mixed_prec import _reciprocal_f32

        value = _reciprocal_f32(scale * self.shards)
        self._unscale_for = (scale, value)
        return value

    def grad_unscale(self, scaler: Any = None) -> Tensor:
        """The tensor gradients are multiplied by before the optimizer math: ``1 / (scale *
        shards)`` rounded once to f32 (``1 / shards`` without a scaler): each shard's loss is
        the mean over its rows, so the sum over the shards is ``shards`` times the global
        batch's gradient. :meth:`reduce` keeps it in step with the scaler, in the context it
        is given: a context allocating the tensor starts from ``1 / shards`` (its host array
        is never written)."""
        return self._unscale

    def reduce(self, ctx: Context, scaler: Any = None) -> Context:
        """Sum the shards' gradients (after the gradient routine, before the checksum and the
        optimizer step), first bringing :meth:`grad_unscale` in step with ``scaler``'s scale
        when it changed. The gradient routine has computed this rank's first shard; the
        others of its block run here (their data from :meth:`set_batch`), then the block's
        partial sums are exchanged and the tree summed; the result is in the flat buffer on
        every rank, the same bits."""
        if self.global_sums:
            raise ValueError(f"{self!r}: with synced batch norm the gradient routine runs cut "
                             f"at the statistics' exchanges: run it through "
                             f"dp.run_and_reduce(ctx, routine, scaler) (the recipes do), not "
                             f"ctx.run then reduce (its statistics were the shard's alone)")
        return self._reduce(ctx, scaler, None)

    def run_and_reduce(self, ctx: Context, routine: Routine, scaler: Any = None,
                       update: Routine | None = None) -> Context:
        """Run the gradient routine of the step's last micro-batch (this rank's first shard),
        then :meth:`reduce`. With ``overlap=True`` and a routine from :meth:`compile` or
        :meth:`compile_gradients`, the block's last shard runs cut at the buckets, and each
        bucket's exchange starts once that shard has written it, while its backward code goes
        on (its addition into the block's partial sum first, bucket by bucket): the same
        additions, the same bits. ``update``: the optimizer's update, run after the sum; one
        from :meth:`compile_update` runs part by part, each waiting only for the buckets it
        reads."""
        if update is not None and not isinstance(update, Routine):
            raise TypeError(f"{self!r}: update must be a Routine (dp.compile_update), got "
                            f"{type(update).__name__}: {update!r:.80}")
        if self.global_sums:
            synced = self._synced_routines.get(routine)
            if synced is None:
                raise ValueError(f"{self!r}: {routine!r} was not compiled by this "
                                 f"DataParallel: with synced batch norm compile the gradient "
                                 f"routine with dp.compile(ctx, recipe) or "
                                 f"dp.compile_gradients(ctx, comp), which cut it at the "
                                 f"statistics' exchanges")
            return self._reduce(ctx, scaler, synced, update)
        # one rank has nothing to exchange: its routine runs whole (the same items, the same
        # bits), and so does the update
        split = self._splits.get(routine) if self.overlap and self.size > 1 else None
        if split is None:
            return self._reduce(ctx.run(routine), scaler, None, update)
        if self.per_rank > 1:
            ctx = ctx.run(routine)  # the first shard whole; the last one cut
        return self._reduce(ctx, scaler, split, update)

    def _run_bucketed(self, ctx: Context, j: int, split: tuple[list[Routine], list[int]],
                      flat: Any) -> tuple[Context, list[Exchange]]:
        """Run shard ``j`` (the block's last) cut at the buckets: after each part, fold each
        bucket it completed into the block's partial sum (as :meth:`_fold` does the whole
        buffer) and start its exchange. Returns the exchanges, in the order started."""
        parts, ready = split
        adds, freed = self._fold_step(j, self._stack, flat, flat)  # done bucket by bucket
        partials = [buf for _, buf in self._stack]
        add = _array_module(flat).add
        started: list[Exchange] = []
        for s, part in enumerate(parts):
            ctx = ctx.run(part)
            for (a, b, _), r in zip(self._buckets, ready, strict=True):
                if r != s:
                    continue
                for out, left, right in adds:
                    add(left[a:b], right[a:b], out=out[a:b])
                started.append(self._exchange(flat, a, b, partials))
            for e in started:
                e.test()
        self._free += freed
        return ctx, started

    def _exchange(self, flat: Any, a: int, b: int, partials: list[Any]
                  ) -> Exchange:
        """Start the exchange of the bucket ``[a, b)`` of this rank's ``partials`` (the tree's
        nodes covering its block, the last in ``flat``): in shared memory where the flat
        buffers are (:class:`SharedBuckets`), else through the communicator."""
        if self._bucket_sums is not None:
            assert len(partials) == 1 and partials[0] is flat  # a rank's block is one subtree
            return self._bucket_sums.start(a, b)
        return BucketExchange(self.comm, self.tree, self._covers, flat, a, b, partials,
                              fixed_order=self.fixed_order, scratch=self._scatter)

    def _run_synced(self, ctx: Context, synced: SyncedRoutine, flat: Any,
                    pending: list[list[Staged]]
                    ) -> tuple[Context, list[Any], list[Any], list[Exchange]]:
        """Run this rank's shards through the parts of a routine cut at its global sums: each
        part on every shard of the block in turn (a shard's memory saved after a part and
        restored before its next), then each group of sums the part completed replaced, on
        every shard, by its sum over every shard in the tree's order; the block's gradients
        folded into the tree as each shard ends. One shard a rank with ``overlap=True``: each
        bucket's exchange starts after the part that completes it. Returns the shards' losses
        and statistics, and the exchanges started."""
        k = self.per_rank
        if k > 1 and len(pending) != 1:
            raise ValueError(f"{self!r}: rank {self.rank} computes {k} shards: write each step's "
                             f"data with set_batch (this rank's block), not into the inputs "
                             f"directly" if not pending else
                             f"{self!r}: synced batch norm takes one micro-batch a step")
        if not self._counted.get(ctx):  # the sums' counts: the global batch's cells
            for g in self.global_sums:
                ctx = ctx.set_values(g.count, np.array([g.rows * self.shards], np.float64))
            self._counted[ctx] = True
        memory = None
        if k > 1:
            memory = self._memories.get(synced)
            if memory is None:
                memory = self._memories[synced] = ShardMemory(ctx, synced, k)
            memory.save_start()
        losses: list[Any] = []
        stats: list[Any] = []
        sums: list[tuple[Tnode, np.ndarray]] = []  # the last exchange's, to put in
        last = len(synced.parts) - 1
        started: list[Exchange] = []
        for p, part in enumerate(synced.parts):
            leaves: list[list[np.ndarray]] = []
            for j in range(k):
                if memory is not None:
                    ctx = memory.restore(ctx, j, p)
                    if p == 0:
                        if j > 0:
                            ctx = self._put_shard(ctx, j, pending[0])
                        memory.save(j, -1)
                for n, values in sums if memory is None else ():
                    ctx = ctx.set_values(n, values)
                ctx = ctx.run(part)
                if synced.done[p]:
                    leaves.append(np.concatenate([np.asarray(ctx.get_values(n)).reshape(-1)
                                                  for g in synced.done[p] for n in g]))
                if p == last:
                    if memory is not None:
                        ctx = memory.restore(ctx, j, None)
                    if self.track_losses:
                        losses.append(self._loss_now(ctx))
                    if self.stats:
                        stats.append([np.array(ctx.get_values(m), np.float32)
                                      for m in self.stats])
                    self._fold(ctx, j, flat, flat, keep_flat_free=j < k - 1)
                elif memory is not None:
                    memory.save(j, p)
            for (a, b, _), r in zip(self._buckets, synced.buckets, strict=False):
                if r == p:  # one shard a rank (else no buckets): its flat is its partial sum
                    started.append(self._exchange(flat, a, b, [flat]))
            for e in started:
                e.test()
            sums = []
            if leaves:
                total = self._global_total(leaves)
                at = 0
                for n in (n for g in synced.done[p] for n in g):
                    sums.append((n, total[at:at + n.size].reshape(n.dims)))
                    at += n.size
                if memory is not None:  # each shard's copy: restored where a part reads it
                    memory.put(sums)
        return ctx, losses, stats, started

    def _global_total(self, leaves: list[np.ndarray]) -> np.ndarray:
        """The sum over every shard of a vector each of this rank's shards computed (its
        ``leaves``, in block order), in the tree's order (a small exchange of its own); the
        same on every rank."""
        partials = self._partials(leaves)
        everyone = self.comm.allgather(partials) if self.size > 1 else [partials]
        known = {node: p for r, ps in enumerate(everyone)
                 for node, p in zip(self._covers[r], ps, strict=True)}
        return self.tree.evaluate(known)

    @functools.cached_property
    def _fold_plans(self) -> list[tuple[int, tuple[int, int]]]:
        """What folding shard ``j`` of the block into the tree does, by ``j``: how many left
        siblings it adds (popped from the stack's top, each the sibling of the node made so
        far) and the tree node it leaves. The same every step: a block folds its shards in
        order, so the stack before shard ``j`` is always the same."""
        lo, hi = self.first_shard, self.first_shard + self.per_rank
        stack: list[tuple[int, int]] = []
        plans = []
        for j in range(self.per_rank):
            node = (lo + j, lo + j + 1)
            pops = 0
            while pops < len(stack):
                parent = self._parents.get(node)
                top = stack[len(stack) - 1 - pops]
                if parent is None or parent[0] < lo or parent[1] > hi or node[0] == parent[0] \
                        or top != (parent[0], node[0]):
                    break
                pops += 1
                node = parent
            del stack[len(stack) - pops:]
            stack.append(node)
            plans.append((pops, node))
        return plans

    def _reduce(self, ctx: Context, scaler: Any,
                split: tuple[list[Routine], list[int]] | SyncedRoutine | None,
                update: Routine | None = None) -> Context:
        # The shard sums' overflows are the checksum's to see: NumPy says nothing of them
        # (one errstate for the whole reduction: entering one costs microseconds).
        # (the update's cut is looked up only where there is one: a weak dictionary's lookup
        # costs as much as a small step's additions)
        plan = self._update_splits.get(update) if update is not None and self.overlap else None
        with np.errstate(all="ignore"):
            ctx, updated = self._reduce_quietly(ctx, scaler, split, plan)
        return ctx.run(update) if update is not None and not updated else ctx

    def _reduce_quietly(self, ctx: Context, scaler: Any,
                        split: tuple[list[Routine], list[int]] | SyncedRoutine | None,
                        plan: list[tuple[Routine, list[int]]] | None = None
                        ) -> tuple[Context, bool]:
        """The reduction; with ``plan`` (the update cut at the buckets) and the buckets'
        exchanges started during the backward code, the update runs too, each part once the
        buckets it reads are summed. Returns whether the update ran."""
        if self.flat is None:
            raise ValueError(f"{self!r}: call setup(ctx) before compiling and stepping")
        self._refuse_another_context(ctx, "reduce")
        if not self._gathered:
            raise ValueError(f"{self!r}: shard_optimizer=True: the last step's update changed "
                             f"this rank's slice of the parameters only; call "
                             f"dp.after_update(ctx, applied) after the optimizer's update "
                             f"(the recipes do) so every rank has the whole model")
        feeds = self._feeds_of(ctx)
        want = self._unscale_value(scaler)
        if feeds.unscale != want:  # each context is brought in step on its own
            ctx = ctx.set_values(self._unscale, np.array(want, np.float32))
            feeds.unscale = want
        if self._tells_step:  # the step a collective's timeout names
            self.comm.step = self.step
        flat = feeds.flat
        if flat is None:  # the gradients' buffer; the additions below write it every step,
            flat = feeds.flat = ctx.device_buffer(self.flat)  # but no twin derives from it
        pending, self._pending = self._pending, []
        counters_at, self._counters_at = self._counters_at, []
        stats_at, self._stats_at = self._stats_at, None
        k = self.per_rank
        self._stack = []
        if isinstance(split, SyncedRoutine):
            ctx, self.shard_losses, stats, started = self._run_synced(ctx, split, flat, pending)
            if self.fixed_order:
                self._sum_block(ctx, flat, started)
            else:
                for e in started:
                    e.finish()
                if not started:
                    self.comm.allreduce_sum(flat)
            return self._reduced(ctx, stats), False
        exchanges: list[Exchange] = []
        if split is not None and k == 1:  # the first shard is the last: cut at the buckets
            ctx, exchanges = self._run_bucketed(ctx, 0, split, flat)
        if not self.fixed_order:
            if self.track_losses:
                self.shard_losses = [self._loss_now(ctx)]
            ctx, updated = self._finish(ctx, exchanges, plan)
            if not exchanges:
                self.comm.allreduce_sum(flat)
            # the running statistics too: every rank's, averaged (the same on every rank)
            return self._reduced(ctx, [[np.array(ctx.get_values(m), np.float32)
                                        for m in self.stats]] if self.stats else []), updated
        losses = [self._loss_now(ctx)] if self.track_losses else []
        stats = [[np.array(ctx.get_values(m), np.float32) for m in self.stats]] \
            if self.stats else []
        # Shard 0's gradient is in flat; the later shards' go into buffers of their own (flat
        # keeps the block's leftmost node, which every addition in it goes into), but for a
        # last shard cut at the buckets, bound to flat: then shard 0's moves out first.
        bucketed = split is not None and k > 1
        if k > 1:
            if len(pending) == 0:
                raise ValueError(f"{self!r}: rank {self.rank} computes {k} shards: write each "
                                 f"step's data with set_batch (this rank's block), not into the "
                                 f"inputs directly")
            if self._first is None or (len(pending) > 1 and self._more is None):
                raise ValueError(f"{self!r}: rank {self.rank} computes {k} shards: compile the "
                                 f"recipe with dp.compile(ctx, recipe) (or give the gradient "
                                 f"routines to use_routines) so reduce can run them")
        plain = k > 1 and not bucketed and not self.stats and not self.rngs
        if plain:
            ctx = self._run_block(ctx, flat, pending, losses)
        elif not exchanges:
            self._fold(ctx, 0, flat, flat, keep_flat_free=bucketed)
        if k > 1 and not plain:
            counters_end = [ctx.get_values(r.counter) for r in self.rngs]
            for j in range(1, k):
                if stats_at is not None:
                    for m, v in zip(self.stats, stats_at, strict=True):
                        ctx = ctx.set_values(m, v)
                into = flat if bucketed and j == k - 1 else self._spare(ctx)
                for micro, staged in enumerate(pending):
                    if counters_at:
                        for r, c in zip(self.rngs, counters_at[micro], strict=True):
                            ctx = ctx.set_values(r.counter, c)
                    ctx = self._put_shard(ctx, j, staged)
                    if into is flat and micro == len(pending) - 1:
                        ctx, exchanges = self._run_bucketed(ctx, j, split, flat)
                    else:
                        ctx = ctx.run(self._moved_routine(ctx, flat, into,
                                                          self._first if micro == 0
                                                          else self._more))
                if self.track_losses:
                    losses.append(self._loss_now(ctx))
                if self.stats:
                    stats.append([np.array(ctx.get_values(m), np.float32) for m in self.stats])
                if not exchanges:
                    self._fold(ctx, j, flat, into)
            for r, c in zip(self.rngs, counters_end, strict=True):
                ctx = ctx.set_values(r.counter, c)
        self.shard_losses = losses
        ctx, updated = self._sum_block(ctx, flat, exchanges, plan, pooled=not plain)
        return self._reduced(ctx, stats), updated

    def _run_block(self, ctx: Context, flat: Any, pending: list[list[Staged]],
                   losses: list[Any]) -> Context:
        """The plain step's later shards of the block (:class:`_BlockPlan`): each shard's
        routines run into its own buffer from its staged inputs, its loss read, its additions
        done; the block's partial sums then on the stack. Shard 0's gradient is in flat."""
        block = self._block_plan(ctx, flat, pending)
        micros, add = len(pending), block.add
        read = self._loss_reader(ctx) if self.track_losses else None
        for _, runs, adds in block.shards:
            for m in range(micros):
                ctx = ctx.run(runs[m])
            if read is not None:
                losses.append(read())
            for out, left, right in adds:
                add(left, right, out=out)
        self._stack = list(block.stack)
        return ctx

    def _block_plan(self, ctx: Context, flat: Any, pending: list[list[Staged]]) -> _BlockPlan:
        """The plain step's plan for ``ctx`` and the routines in use, made once per context
        (until :meth:`use_routines` replaces the routines): the fold of :meth:`_fold` worked
        out on the tree's nodes, each shard's buffer taken from the plan's own as the fold
        frees them; each shard's routines for as many micro-batches as ``pending`` holds."""
        block = self._blocks.get(id(ctx))  # a plan's routines hold its context: no id reuse
        if block is not None and block.micros >= len(pending):
            return block
        if block is None:
            block = self._blocks[id(ctx)] = _BlockPlan(_array_module(flat).add)
            lo = self.first_shard
            assert self._fold_plans[0][0] == 0  # the block's first leaf completes no node
            block.stack = [((lo, lo + 1), flat)]
            free: list[Any] = []
            for j in range(1, self.per_rank):
                into = free.pop() if free else ctx.new_buffer(self.flat)
                adds, freed = self._fold_step(j, block.stack, flat, into)
                free += freed
                block.shards.append((into, [], adds))
            assert [node for node, _ in block.stack] == self._covers[self.rank]
        for j, (into, runs, _) in enumerate(block.shards):
            while len(runs) < len(pending):
                routine = self._first if not runs else self._more
                bound = {n.id for n in routine.nodes}
                runs.append(ctx.rebound(routine, self.flat, into, reads={
                    st.node: st.views[j + 1] for st in pending[len(runs)] if st.node.id in bound}))
        block.micros = len(pending)
        return block

    def _sum_block(self, ctx: Context, flat: Any, exchanges: list[Exchange],
                   plan: list[tuple[Routine, list[int]]] | None = None, pooled: bool = True
                   ) -> tuple[Context, bool]:
        """This rank's partial sums (the tree's nodes on the stack, its block folded) to the
        whole sum in ``flat``: the buckets' exchanges started during the backward code waited
        for (the update's parts run as their buckets arrive, :meth:`_finish`), else one
        exchange of the whole buffer now. ``pooled``: their buffers go back to the pool
        (:meth:`_spare`; not a :class:`_BlockPlan`'s own). Returns whether the update ran."""
        partials = [buf for _, buf in self._stack]
        # (a plain step's stack is its plan's, checked when the plan was made)
        assert not pooled or [node for node, _ in self._stack] == self._covers[self.rank]
        if exchanges:
            ctx, updated = self._finish(ctx, exchanges, plan)
        else:
            self._tree_sum(partials, flat)
            updated = False
        if pooled:
            self._free += [buf for buf in partials if buf is not flat]
        return ctx, updated

    def _finish(self, ctx: Context, exchanges: list[Exchange],
                plan: list[tuple[Routine, list[int]]] | None) -> tuple[Context, bool]:
        """Wait for the buckets' exchanges; with ``plan`` (the update cut at the buckets),
        run each part of the update as soon as the buckets it reads are summed, the other
        exchanges progressing meanwhile. Returns whether the update ran."""
        if plan is None or not exchanges:
            for e in exchanges:
                e.finish()
            return ctx, False
        waiting = {(e.a, e.b): e for e in exchanges}
        for part, reads in plan:
            for b in reads:
                a, z, _ = self._buckets[b]
                e = waiting.pop((a, z), None)
                if e is not None:
                    e.finish()
            for e in waiting.values():
                e.test()
            ctx = ctx.run(part)
        for e in waiting.values():
            e.finish()
        return ctx, True

    def _reduced(self, ctx: Context, stats: list[Any]) -> Context:
        """A reduction's end: the running statistics averaged, the step counted."""
        self._stack = []
        if self.stats:
            ctx = self._average_stats(ctx, stats)
        self.reductions += 1
        self.step += 1
        self._gathered = not self.shard_optimizer
        return ctx

    def after_update(self, ctx: Context, applied: bool = True) -> Context:
        """After the optimizer's update (``applied``: whether it ran; a step skipped on the
        host changed nothing): with ``shard_optimizer=True``, gather every rank's slice of the
        updated parameters into the whole model on every rank (one in-place allgather of the
        parameters' flat buffer; the masters' kept cast twins are recast before their next
        read). Nothing to do without it."""
        if not self.shard_optimizer:
            return ctx
        if self.flat_params is None:
            raise ValueError(f"{self!r}: call setup(ctx) before compiling and stepping")
        zero = self.optimizer_shard
        assert zero is not None
        if zero.optimizer is None:
            raise ValueError(f"{self!r}: shard_optimizer=True but no optimizer update was built "
                             f"over this rank's slice: build it with optimizer.update(loss, ..., "
                             f"shard=dp.optimizer_shard) (the mixed_prec recipes do)")
        if require_bool("after_update: applied", applied):
            mine = ctx.device_buffer(self.flat_params)  # marks the masters written
            if self._shared_params is None:
                self.comm.allgather_inplace(mine)
            else:
                self._shared_gather(zero.per)
        self._gathered = True
        return ctx

    def _shared_gather(self, per: int) -> None:
        """The parameters' allgather in memory every rank maps: once every rank has updated
        its slice, each copies its slice into every other rank's buffer."""
        blocks = self._shared_params
        assert blocks is not None
        self.comm.shared_sync("the parameters' gather in shared memory (slices updated)")
        copy_to_the_others(blocks, self.rank, slice(self.rank * per, (self.rank + 1) * per))
        self.comm.shared_sync("the parameters' gather in shared memory (slices copied)")

    def _fold(self, ctx: Context, j: int, flat: Any, buf: Any, *,
              keep_flat_free: bool = False) -> None:
        """Shard ``j`` of this rank's block has just written its gradient into ``buf`` (flat,
        or a buffer of its own): add it into the tree now (:meth:`_fold_step`).
        ``keep_flat_free``: a later shard of the block writes into flat, so a node left there
        is copied out first."""
        adds, freed = self._fold_step(j, self._stack, flat, buf, keep_flat_free=keep_flat_free)
        for out, left, right in adds:
            _array_module(out).add(left, right, out=out)
        self._free += freed
        if keep_flat_free and self._stack[-1][1] is flat:
            spare = self._spare(ctx)
            spare[...] = flat
            self._stack[-1] = (self._stack[-1][0], spare)

    def _fold_step(self, j: int, stack: list[tuple[tuple[int, int], Any]], flat: Any,
                   buf: Any, *, keep_flat_free: bool = False
                   ) -> tuple[list[tuple[Any, Any, Any]], list[Any]]:
        """Fold shard ``j``'s gradient, in ``buf``, into the tree on ``stack`` (the tree's
        nodes with their buffers): as far up as its block's nodes are complete, each node the
        sum of its left and right children, one addition per element, into flat where the
        right child is there (unless ``keep_flat_free``), else into the left child's buffer;
        the node it leaves pushed. Returns the additions to do, ``(out, left, right)`` for
        ``out = left + right`` in that order, and the buffers they free (never flat). The
        plain step works them out once (:class:`_BlockPlan`), the others as they go: the
        same additions."""
        pops, node = self._fold_plans[j]
        adds: list[tuple[Any, Any, Any]] = []
        freed: list[Any] = []
        for _ in range(pops):
            _, left = stack.pop()
            into_flat = buf is flat and not keep_flat_free
            out = flat if into_flat else left
            adds.append((out, left, buf))
            spent = left if into_flat else buf
            if spent is not flat:
                freed.append(spent)
            buf = out
        stack.append((node, buf))
        return adds, freed

    def _spare(self, ctx: Context) -> Any:
        """A buffer of flat's size and kind (the backend's alignment: routines are bound to
        it), zero-filled at first, to hold a tree node's partial sum."""
        return self._free.pop() if self._free else ctx.new_buffer(self.flat)

    def _moved_routine(self, ctx: Context, flat: Any, into: Any, routine: Any) -> Any:
        """``routine`` writing its gradients into ``into`` (flat itself, or a spare buffer:
        the same machine code bound there once, :meth:`Context.rebound`)."""
        if into is flat:
            return routine
        key = (id(into), id(routine))
        moved = self._moved.get(key)
        if moved is None:
            moved = self._moved[key] = ctx.rebound(routine, self.flat, into)
        return moved

    def _partials(self, leaves: Sequence[Any]) -> list[Any]:
        """This rank's partial sums: the tree's nodes covering its block, from its leaves."""
        known = {(self.first_shard + j, self.first_shard + j + 1): a
                 for j, a in enumerate(leaves)}
        return [self.tree.evaluate(known, lo, hi) for lo, hi in self._covers[self.rank]]

    def _tree_sum(self, partials: Sequence[Any], flat: Any) -> None:
        """The sum of every shard's gradient in the tree's order into ``flat``, on every rank,
        from this rank's partial sums (the nodes covering its block): the whole buffer as one
        bucket (:class:`BucketExchange`)."""
        if len(partials) == 1 and partials[0] is not flat:
            flat[...] = partials[0]
        if self.size == 1:  # the block is the whole batch: its sum is the tree's
            return
        if self._shared is not None:
            self._shared_sum()
            return
        BucketExchange(self.comm, self.tree, self._covers, flat, 0, int(flat.size), partials,
                       scratch=self._scatter).finish()

    def _shared_sum(self) -> None:
        """The tree's sum in memory every rank maps (:class:`SharedSum`, made at the first)."""
        if self._summer is None:
            assert self._shared is not None
            self._summer = SharedSum(self.comm, self.tree, self._covers, self._shared)
        self._summer()

    def _average_stats(self, ctx: Context, stats: list[list[np.ndarray]]) -> Context:
        """The running statistics: each shard's, from the same starting values, averaged over
        the shards in the tree's order (a small exchange of its own)."""
        leaves = [np.concatenate([v.reshape(-1) for v in vs]) for vs in stats]
        mean = self._global_total(leaves) * np.float32(1.0 / self.shards)
        at = 0
        for m in self.stats:
            ctx = ctx.set_values(m, mean[at:at + m.size].reshape(m.dims))
            at += m.size
        return ctx

    def _loss_now(self, ctx: Context) -> Any:
        """The loss of the shard just computed: a number on the CPU; on a GPU a copy of its
        device cell (no wait for the device: :meth:`global_loss` reads it when asked)."""
        return self._loss_reader(ctx)()

    def _loss_reader(self, ctx: Context) -> Callable[[], Any]:
        """What :meth:`_loss_now` calls, made once per context."""
        feeds = self._feeds_of(ctx)
        if feeds.read_loss is None:
            buf = ctx.device_buffer(self.loss.value)
            feeds.read_loss = ctx.reader(self.loss) if isinstance(buf, np.ndarray) else buf.copy
        return feeds.read_loss

    def global_loss(self) -> float:
        """The global batch's loss at the last :meth:`reduce`: the shards' losses summed in
        the tree's order, over the shard count (the same number on any rank count); a
        collective (every rank must call it)."""
        if not self.track_losses:
            raise ValueError(f"{self!r}: built with track_losses=False")
        mine = [v if isinstance(v, float) else float(host_values(v).reshape(-1)[0])
                for v in self.shard_losses]
        self.shard_losses = mine
        everyone = self.comm.allgather(mine) if self.size > 1 else [mine]
        known = {(r * self.per_rank + j, r * self.per_rank + j + 1): float(v)
                 for r, vs in enumerate(everyone) for j, v in enumerate(vs)}
        with np.errstate(all="ignore"):
            return float(self.tree.evaluate(known)) / self.shards

    # --- state across ranks --------------------------------------------------------------------

    def broadcast(self, ctx: Context, nodes: Sequence[Tnode | Tensor], root: int = 0
                  ) -> Context:
        """Overwrite ``nodes``' values on every rank with ``root``'s (the start of training:
        the parameters, and whatever else every rank must share). Each node must be
        initialized on every rank (``train.init_params`` on all of them)."""
        sharded = self._sharded()  # each rank's slice is its own: nothing to broadcast
        ns = [n for n in map(_as_node, nodes) if n.id not in sharded]
        missing = [n.name for n in ns if not ctx.is_initialized(n)]
        if missing:
            raise ValueError(f"broadcast: {missing} not initialized in this context: initialize "
                             f"them on every rank first (train.init_params)")
        for n in ns:
            self.comm.bcast_buffer(ctx.device_buffer(n), root)
        return ctx

    def check_equal(self, ctx: Context, nodes: Sequence[Tnode | Tensor]) -> None:
        """``ocannl.Failure`` on every rank unless every node holds the same bits on every rank
        (for parameters drawn from one seed instead of broadcast). A sharded optimizer's
        buffers are each rank's own slice: left out."""
        sharded = self._sharded()
        ns = [n for n in map(_as_node, nodes) if n.id not in sharded]
        names = checkpoint.node_names(ns)
        mine = [hashlib.sha256(np.ascontiguousarray(ctx.get_values(n)).tobytes()).hexdigest()
                for n in ns]
        everyone = self.comm.allgather(mine)
        diff = [(names[k], r) for k in range(len(ns)) for r, d in enumerate(everyone)
                if d[k] != everyone[0][k]]
        if diff:
            raise Failure("data-parallel: values differ across ranks: "
                          + ", ".join(f"{name} (rank {r} vs rank 0)" for name, r in diff[:8])
                          + (f" and {len(diff) - 8} more" if len(diff) > 8 else ""))

    def mean(self, value: float) -> float:
        """The mean over the ranks of a host number (a shard's loss: the mean over ranks is
        the global batch's), summed in rank order so every rank gets the same bits."""
        total = 0.0
        for v in self.comm.allgather(float(value)):
            total += v
        return total / self.size

    # --- checkpoints ---------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, ctx: Context, nodes: Sequence[Tnode | Tensor],
             progress: checkpoint.Progress) -> None:
        """Rank 0 writes the checkpoint (atomically, as :func:`ocannl.checkpoint.save`); the
        others wait for it, then every rank returns, or raises if the save failed. The shard
        count goes in ``progress.extra[SHARDS_KEY]`` (a copy of ``progress`` is written):
        the bits of a resumed run depend on it, not on the number of ranks."""
        import dataclasses

        progress = dataclasses.replace(progress, extra={**progress.extra,
                                                        SHARDS_KEY: self._shards_state()})
        nodes = [_as_node(n) for n in nodes]
        whole = self._whole_state(ctx, nodes)  # a collective: before rank 0 writes alone
        err: str | None = None
        caught: BaseException | None = None
        if self.rank == 0:
            try:
                checkpoint.save(path, ctx, nodes, progress, values=whole)
            except Exception as e:  # noqa: BLE001 - told to every rank, then re-raised
                caught, err = e, f"{type(e).__name__}: {e}"
        err = self.comm.bcast(err, root=0)
        if caught is not None:
            raise caught
        if err is not None:
            raise Failure(f"checkpoint {str(path)!r}: the save on rank 0 failed ({err})")

    def load(self, path: str | os.PathLike, ctx: Context, nodes: Sequence[Tnode | Tensor],
             *, exact: bool = True) -> tuple[Context, checkpoint.Progress]:
        """Every rank loads the checkpoint (:func:`ocannl.checkpoint.load`); ``ocannl.Failure``
        on every rank when any rank could not, or the ranks read different files, or the file
        was written with another shard count (or summation order) than this run's: a resume
        on any number of ranks continues the run exactly, on another shard count it could
        not (``exact=False`` loads it anyway: the run then continues the same training up to
        rounding). The step counter continues from ``progress.step``."""
        try:
            ctx, progress = checkpoint.load(path, ctx, nodes,
                                            writers=self._slice_writers(nodes))
            saved = progress.extra.get(SHARDS_KEY)
            if exact and saved is not None and saved != self._shards_state():
                raise Failure(f"it was written by a run with {saved}, this run has "
                              f"{self._shards_state()}: the shard count fixes the bits of every "
                              f"step, so a resume with another cannot continue the run exactly "
                              f"(build the model over global_batch / {saved.split()[0][7:]} rows "
                              f"with DataParallel(shards={saved.split()[0][7:]}))")
            outcome: tuple[str, str] = ("ok", _digest(progress.to_json()))
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            progress = None
            outcome = ("error", f"{type(e).__name__}: {e}")
        everyone = self.comm.allgather(outcome)
        errors = [(r, m) for r, (k, m) in enumerate(everyone) if k == "error"]
        if errors:
            raise Failure(f"checkpoint {str(path)!r}: " + "; ".join(
                f"rank {r} could not load it ({m})" for r, m in errors))
        if len({m for _, m in everyone}) > 1:
            raise Failure(f"checkpoint {str(path)!r}: the ranks loaded different progress "
                          f"(is the file the same on every node?)")
        assert progress is not None
        self.step = int(progress.step)
        return ctx, progress

    # --- the sharded optimizer state (ZeRO-1) ----------------------------------------------------

    def _sharded(self) -> dict[int, tuple[Tensor, str]]:
        """The optimizer's whole-parameter buffers of which each rank holds a slice (the names
        a checkpoint holds; never allocated), by node id: parameter and buffer name."""
        if not self.shard_optimizer:
            return {}
        zero = self.optimizer_shard
        opt = None if zero is None else zero.optimizer
        if opt is None:
            raise ValueError(f"{self!r}: shard_optimizer=True: build the optimizer's update over "
                             f"this rank's slice (the recipe, or optimizer.update(loss, ..., "
                             f"shard=dp.optimizer_shard)) before broadcasting, checking, saving "
                             f"or loading state: until then no rank holds its slice")
        return {opt.state_of(p)[name].id: (p, name)
                for p in self.params for name in opt.buffer_names()}

    def _whole_state(self, ctx: Context, nodes: Sequence[Tnode]) -> dict[int, np.ndarray]:
        """The whole values of the sharded buffers among ``nodes``, from every rank's slice (a
        collective when there are any: every rank calls it with the same nodes)."""
        sharded = self._sharded()
        wanted = [k for k, n in enumerate(nodes) if n.id in sharded]
        if not wanted:
            return {}
        zero = self._zero
        assert zero is not None and zero.optimizer is not None
        mine = []
        for k in wanted:
            p, name = sharded[nodes[k].id]
            q = zero.owned(p)
            if q is not None:
                part = zero.optimizer.part_state(q)[name]
                mine.append((k, q.start, np.asarray(ctx.get_values(part)).reshape(-1)))
        filled = {k: 0 for k in wanted}
        whole = {k: np.empty(nodes[k].size, nodes[k].prec.numpy_dtype) for k in wanted}
        for theirs in self.comm.allgather(mine):
            for k, start, values in theirs:
                whole[k][start:start + values.size] = values
                filled[k] += values.size
        assert all(filled[k] == nodes[k].size for k in wanted), filled  # every element once
        return {nodes[k].id: whole[k] for k in wanted}

    def _slice_writers(self, nodes: Sequence[Tnode | Tensor]
                       ) -> dict[int, Any]:
        """For each sharded buffer among ``nodes``, what writes this rank's slice of a whole
        array loaded for it."""
        zero = self._zero
        writers = {}
        for nid, (p, name) in self._sharded().items():
            assert zero is not None
            q = zero.owned(p)

            def write(ctx: Context, values: np.ndarray, q: Any = q, name: str = name
                      ) -> Context:
                if q is None:  # another rank owns all of it
                    return ctx
                assert zero is not None and zero.optimizer is not None
                part = zero.optimizer.part_state(q)[name]
                return ctx.set_values(part, values.reshape(-1)[q.start:q.start + q.size])

            writers[nid] = write
        return writers

    def gather_state(self, ctx: Context, nodes: Sequence[Tnode | Tensor]) -> list[np.ndarray]:
        """Each node's values as a host array of its dims; a sharded optimizer buffer's whole
        values, gathered from every rank's slice (a collective: every rank calls it with the
        same nodes)."""
        ns = [_as_node(n) for n in nodes]
        whole = self._whole_state(ctx, ns)
        return [whole[n.id].reshape(n.dims) if n.id in whole
                else np.asarray(ctx.get_values(n)) for n in ns]

    def _shards_state(self) -> str:
        return f"shards={self.shards} fixed_order={self.fixed_order}"
