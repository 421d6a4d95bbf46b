"""Data-parallel training across processes: one replica of the model per process (a *rank*),
each on an equal shard of the global batch, the gradients summed over the ranks once per step.

**Communicators** (one protocol, :class:`Communicator`, three implementations):

- :class:`SingleProcess`: a world of one. Every collective is the identity, so every
  data-parallel code path runs, and is tested, without MPI.
- :class:`MpiCommunicator`: MPI through ``mpi4py``, imported when one is created (importing
  ``mpi4py.MPI`` starts MPI). Sums host buffers in place; device buffers go through the host.
- :class:`NcclCommunicator`: NCCL through ``cupy.cuda.nccl`` for CUDA contexts, one rank per
  device; the unique id is broadcast over MPI, and the collectives run on CuPy's current
  stream, after the kernels that produced their input, with no host synchronisation.

**Training** (:class:`DataParallel`): every parameter's (master) gradient is a view of one flat
f32 buffer per context (:meth:`Context.share_flat`), set up before compiling so the routines
bind the views; one allreduce of that buffer per step runs between the gradient routine and the
optimizer routine. Pass the ``DataParallel`` object as a mixed-precision recipe's ``reducer``::

    comm = parallel.world()                       # MPI under mpiexec, else a world of one
    dp = parallel.DataParallel(comm, loss, inputs=[x, y])
    ctx = dp.setup(ctx)                           # agree on the model and shards; flat grads
    recipe = mixed_prec.gated_step(scaler, loss, opt, reducer=dp)
    ctx = recipe.compile(ctx)
    ctx = train.init_params(ctx, loss)
    ctx = dp.broadcast(ctx, checkpoint.training_state(loss, opt))   # rank 0's values
    for step in ...:                              # each rank sets its shard of the batch
        ctx = recipe.step(ctx)

Narrow (f16 / bf16) buffers are never summed: the model reads cast twins of f32 masters
(:func:`ocannl.mixed_prec.with_master_weights`) and only the masters' f32 gradients travel.
Each rank's loss is the mean over its shard, so the sum over ranks is ``world`` times the
global batch's gradient; the ``1 / world`` is folded into the unscale factor the optimizer
already applies (``1 / (scale * world)``, rounded once to f32), not into an extra pass.

**One loss scale.** The overflow checksum is computed after the allreduce, from the summed
gradients, which are the same bits on every rank: every rank skips the same steps and moves
its scale the same way with no extra collective, and an overflow of the sum itself is caught
(a per-rank check OR-ed afterwards would miss it). The fused recipe splits around the
allreduce: its gradient routine, then the allreduce, then one routine with the checksum, the
gated optimizer step and the skipped-step counter -- the same on every rank, so the counter
needs no reduction either.

**Launch**: ``mpiexec -n N python -m mpi4py SCRIPT`` (with ``-m mpi4py``, an exception on one
rank aborts the whole job instead of leaving the others waiting in a collective).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np

from ocannl import checkpoint
from ocannl.context import Context
from ocannl.errors import Failure
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
from ocannl.tensor.tensor import Tensor

__all__ = [
    "Communicator", "DataParallel", "MpiCommunicator", "NcclCommunicator", "SingleProcess",
    "launched_by_mpi", "model_description", "shard", "world",
]


# --- communicators ------------------------------------------------------------------------------


@runtime_checkable
class Communicator(Protocol):
    """A group of ``size`` processes, this one being ``rank``. Device buffers are what
    :meth:`Context.device_buffer` returns (NumPy on the CPU, CuPy on CUDA), flat and
    contiguous; every collective must be called by every rank, in the same order."""

    name: str
    rank: int
    size: int

    def allreduce_sum(self, buf: Any) -> None:
        """Sum an f32 device buffer over the ranks, in place (every rank gets the same bits)."""

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        """Overwrite a device buffer (any dtype) with root's, in place."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Root's (picklable) host object, on every rank."""

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's host object, in rank order, on every rank."""

    def allreduce_max(self, value: int) -> int:
        """The largest of the ranks' integers."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def abort(self, code: int = 1) -> NoReturn:
        """End every rank of the job (after an error on this one)."""


def _check_f32(buf: Any, what: str) -> None:
    if getattr(buf, "dtype", None) != np.float32:
        raise ValueError(f"{what}: expected an f32 buffer, got {getattr(buf, 'dtype', type(buf))}"
                         f" (narrow buffers are never summed; f64 is not supported)")


class SingleProcess:
    """A world of one: rank 0 of 1; every collective leaves its argument as it is."""

    name = "single"
    rank = 0
    size = 1

    def allreduce_sum(self, buf: Any) -> None:
        _check_f32(buf, "allreduce_sum")

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        _check_root(root, 1)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        _check_root(root, 1)
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def allreduce_max(self, value: int) -> int:
        return int(value)

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> NoReturn:
        sys.stderr.flush()
        os._exit(code)

    def __repr__(self) -> str:
        return "SingleProcess()"


def _check_root(root: int, size: int) -> None:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}), got {root!r}")


class MpiCommunicator:
    """MPI through ``mpi4py`` (``pip install 'ocannl[dist]'``), over ``comm`` (default
    ``MPI.COMM_WORLD``). ``mpi4py.MPI`` is imported here, not when this module is: importing it
    initialises MPI.

    Host (NumPy) buffers are reduced in place; a device (CuPy) buffer is copied to the host,
    reduced and copied back (use :class:`NcclCommunicator` on GPUs).
    """

    name = "mpi"

    def __init__(self, comm: Any = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as err:
            raise ImportError(f"MpiCommunicator needs mpi4py and an MPI library: pip install "
                              f"'ocannl[dist]' (mpi4py, mpich) ({err})") from None
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self._local_rank: int | None = None

    def local_rank(self) -> int:
        """This rank's index among the ranks on its node (to pick its GPU)."""
        if self._local_rank is None:
            node = self.comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
            self._local_rank = int(node.Get_rank())
            node.Free()
        return self._local_rank

    def allreduce_sum(self, buf: Any) -> None:
        _check_f32(buf, "allreduce_sum")
        if isinstance(buf, np.ndarray):
            self.comm.Allreduce(self._mpi.IN_PLACE, buf, op=self._mpi.SUM)
            return
        host = np.ascontiguousarray(buf.get())
        self.comm.Allreduce(self._mpi.IN_PLACE, host, op=self._mpi.SUM)
        buf.set(host)

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        _check_root(root, self.size)
        if isinstance(buf, np.ndarray):
            self.comm.Bcast(buf, root=root)
            return
        host = np.ascontiguousarray(buf.get())
        self.comm.Bcast(host, root=root)
        buf.set(host)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        _check_root(root, self.size)
        return self.comm.bcast(obj, root=root)

    def allgather(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def allreduce_max(self, value: int) -> int:
        return int(self.comm.allreduce(int(value), op=self._mpi.MAX))

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, code: int = 1) -> NoReturn:
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)
        os._exit(code)  # Abort does not return; this is for the type checker

    def __repr__(self) -> str:
        return f"MpiCommunicator(rank={self.rank}, size={self.size})"


class NcclCommunicator:
    """NCCL through ``cupy.cuda.nccl``: one rank per GPU, bootstrapped over ``mpi`` (an
    :class:`MpiCommunicator`, created when not given), which also carries the host-side
    collectives (objects, barriers, integer maxima).

    ``device_id``: this rank's GPU; by default its rank among the ranks on its node, modulo the
    number of GPUs there. Build the context on it: ``Context.cuda(comm.device_id)``. Rank 0
    draws the unique id and broadcasts it over MPI; every rank then joins the NCCL
    communicator. Device buffers are reduced and broadcast on CuPy's current stream of the
    device, where the context's kernels run, so a step never waits for the GPU on the host.
    """

    name = "nccl"

    def __init__(self, mpi: MpiCommunicator | None = None, *, device_id: int | None = None
                 ) -> None:
        self.mpi = MpiCommunicator() if mpi is None else mpi
        self.rank, self.size = self.mpi.rank, self.mpi.size
        # Every rank must be able to use NCCL before any NCCL call, or the others would wait.
        problem = None
        try:
            import importlib

            import cupy

            nccl = importlib.import_module("cupy.cuda.nccl")
            ndev = int(cupy.cuda.runtime.getDeviceCount())
            if ndev < 1:
                raise RuntimeError("no CUDA device is visible")
        except Exception as err:  # noqa: BLE001 - any reason NCCL is unusable on this rank
            problem = f"{type(err).__name__}: {err}"
        problems = self.mpi.allgather(problem)
        bad = [(r, p) for r, p in enumerate(problems) if p is not None]
        if bad:
            raise Failure("NcclCommunicator: NCCL through cupy.cuda.nccl is not usable on "
                          + "; ".join(f"rank {r} ({p})" for r, p in bad)
                          + ": use MpiCommunicator (CPU contexts) or install CuPy with NCCL")
        self._cupy, self._nccl = cupy, nccl
        self.device_id = self.mpi.local_rank() % ndev if device_id is None else int(device_id)
        uid: Any = None
        if self.rank == 0:
            try:
                uid = nccl.get_unique_id()
            except Exception as err:  # noqa: BLE001 - told to every rank below
                uid = Failure(f"NcclCommunicator: rank 0 could not draw the NCCL unique id "
                              f"({type(err).__name__}: {err})")
        uid = self.mpi.bcast(uid, root=0)
        if isinstance(uid, Failure):
            raise uid
        with cupy.cuda.Device(self.device_id):
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)

    def _stream(self) -> int:
        return int(self._cupy.cuda.get_current_stream().ptr)

    def _ptr(self, buf: Any, what: str) -> int:
        data = getattr(buf, "data", None)
        ptr = getattr(data, "ptr", None)
        if ptr is None:
            raise ValueError(f"NcclCommunicator.{what}: expected a CuPy device buffer (a "
                             f"Context.cuda context), got {type(buf).__name__}")
        return int(ptr)

    def allreduce_sum(self, buf: Any) -> None:
        _check_f32(buf, "allreduce_sum")
        nccl = self._nccl
        with self._cupy.cuda.Device(self.device_id):
            ptr = self._ptr(buf, "allreduce_sum")
            self.comm.allReduce(ptr, ptr, int(buf.size), nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                self._stream())

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        _check_root(root, self.size)
        with self._cupy.cuda.Device(self.device_id):
            ptr = self._ptr(buf, "bcast_buffer")
            self.comm.bcast(ptr, int(buf.nbytes), self._nccl.NCCL_UINT8, root, self._stream())

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.mpi.bcast(obj, root)

    def allgather(self, obj: Any) -> list[Any]:
        return self.mpi.allgather(obj)

    def allreduce_max(self, value: int) -> int:
        return self.mpi.allreduce_max(value)

    def barrier(self) -> None:
        with self._cupy.cuda.Device(self.device_id):
            self._cupy.cuda.get_current_stream().synchronize()
        self.mpi.barrier()

    def abort(self, code: int = 1) -> NoReturn:
        try:
            self.comm.abort()
        finally:
            self.mpi.abort(code)

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self.rank}, size={self.size}, device={self.device_id})"


_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID",
            "HYDI_CONTROL_FD")


def launched_by_mpi() -> bool:
    """Whether this process was started by an MPI launcher (``mpiexec``), or has MPI running."""
    return any(v in os.environ for v in _MPI_ENV) or "mpi4py.MPI" in sys.modules


def world(kind: str = "auto") -> Communicator:
    """The communicator of this job: ``"single"``, ``"mpi"``, ``"nccl"``, or ``"auto"`` (MPI
    when started by ``mpiexec``, else a world of one)."""
    if kind == "single":
        return SingleProcess()
    if kind == "mpi":
        return MpiCommunicator()
    if kind == "nccl":
        return NcclCommunicator()
    if kind == "auto":
        return MpiCommunicator() if launched_by_mpi() else SingleProcess()
    raise ValueError(f"world: kind must be 'auto', 'single', 'mpi' or 'nccl', got {kind!r}")


# --- sharding and agreement ---------------------------------------------------------------------


def shard(rows: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s equal part of ``rows`` (split along the first axis): rows
    ``[rank * n, (rank + 1) * n)`` with ``n = len(rows) // size``. Unequal shards are refused:
    the mean of the ranks' means would not be the global batch's mean."""
    total = len(rows)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard: rank {rank!r} is not in [0, {size!r})")
    if total % size:
        raise ValueError(f"shard: a global batch of {total} rows does not split into {size} "
                         f"equal shards: use a global batch divisible by the number of ranks")
    n = total // size
    return rows[rank * n:(rank + 1) * n]


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


class DataParallel:
    """Data-parallel training of ``loss`` over ``comm``'s ranks: the flat gradient buffer, the
    agreement checks, the per-step allreduce, broadcasts and checkpoints.

    It is a :class:`ocannl.mixed_prec.GradReducer`: give it to ``scaled_step`` /
    ``gated_step`` as ``reducer=``. Without loss scaling, build the update with
    ``optimizer.update(loss, grad_unscale=dp.grad_unscale())`` and run the gradient routine,
    :meth:`reduce`, the update routine.

    ``inputs``: the tensors holding each rank's shard (data, targets); their dims are compared
    across ranks by :meth:`setup`, which refuses unequal shards. Every parameter gradient must
    be f32 (f16 / bf16 models read cast twins of f32 masters); ``ValueError`` otherwise.
    """

    def __init__(self, comm: Communicator, loss: Tensor, *, inputs: Sequence[Tensor] = (),
                 label: str | None = None) -> None:
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
        self.comm = comm
        self.loss = loss
        self.params = list(loss.params)
        self.inputs = tuple(inputs)
        self.label = label or f"flat_grads_{loss.label}"
        import ocannl.tensor as T

        self._unscale = T.term(np.float32(self._unscale_value(None)),
                               label="dp_grad_unscale", prec=Precision.f32)
        self.flat: Tnode | None = None
        self._synced: weakref.WeakKeyDictionary[Context, float] = weakref.WeakKeyDictionary()
        self.reductions = 0  # allreduces run by this process

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    def __repr__(self) -> str:
        return (f"DataParallel({self.comm!r}, {len(self.params)} parameters, "
                f"flat={'unset' if self.flat is None else self.flat.size})")

    # --- setup ---------------------------------------------------------------------------------

    def description(self) -> dict[str, Any]:
        """What :meth:`setup` compares across ranks: the model (parameter names, dims,
        precisions) and the shard (the inputs' labels and dims)."""
        model = model_description(self.loss)
        shards = [[t.label, list(t.value.dims)] for t in self.inputs]
        return {"model": model, "model_digest": _digest(model), "shards": shards}

    def setup(self, ctx: Context) -> Context:
        """Check that every rank has the same model and an equal shard (``ocannl.Failure`` on
        every rank, naming what differs, before any collective on device memory), then make
        the parameters' gradients views of one flat f32 buffer of ``ctx``. Call it before
        compiling anything that reads or writes the gradients."""
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
        self.flat = ctx.share_flat([p.grad for p in self.params if p.grad is not None],
                                   label=self.label)
        return ctx

    # --- the reducer ---------------------------------------------------------------------------

    def _unscale_value(self, scaler: Any) -> float:
        from ocannl.mixed_prec import _reciprocal_f32

        scale = 1.0 if scaler is None else float(scaler.scale_value())
        return _reciprocal_f32(scale * self.comm.size)

    def grad_unscale(self, scaler: Any = None) -> Tensor:
        """The tensor gradients are multiplied by before the optimizer math: ``1 / (scale *
        world)`` rounded once to f32 (``1 / world`` without a scaler). :meth:`reduce` keeps
        it in step with the scaler, in the context it is given: a context allocating the
        tensor starts from ``1 / world`` (its host array is never written)."""
        return self._unscale

    def reduce(self, ctx: Context, scaler: Any = None) -> Context:
        """Sum the flat gradient buffer over the ranks (after the gradient routine, before the
        checksum and the optimizer step), first bringing :meth:`grad_unscale` in step with
        ``scaler``'s scale when it changed."""
        if self.flat is None:
            raise ValueError(f"{self!r}: call setup(ctx) before compiling and stepping")
        want = self._unscale_value(scaler)
        if self._synced.get(ctx) != want:  # each context is brought in step on its own
            ctx = ctx.set_values(self._unscale, np.array(want, np.float32))
            self._synced[ctx] = want
        self.comm.allreduce_sum(ctx.device_buffer(self.flat))
        self.reductions += 1
        return ctx

    # --- state across ranks --------------------------------------------------------------------

    def broadcast(self, ctx: Context, nodes: Sequence[Tnode | Tensor], root: int = 0
                  ) -> Context:
        """Overwrite ``nodes``' values on every rank with ``root``'s (the start of training:
        the parameters, and whatever else every rank must share). Each node must be
        initialized on every rank (``train.init_params`` on all of them)."""
        ns = [_as_node(n) for n in nodes]
        missing = [n.name for n in ns if not ctx.is_initialized(n)]
        if missing:
            raise ValueError(f"broadcast: {missing} not initialized in this context: initialize "
                             f"them on every rank first (train.init_params)")
        for n in ns:
            self.comm.bcast_buffer(ctx.device_buffer(n), root)
        return ctx

    def check_equal(self, ctx: Context, nodes: Sequence[Tnode | Tensor]) -> None:
        """``ocannl.Failure`` on every rank unless every node holds the same bits on every rank
        (for parameters drawn from one seed instead of broadcast)."""
        ns = [_as_node(n) for n in nodes]
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
        others wait for it, then every rank returns, or raises if the save failed."""
        err: str | None = None
        caught: BaseException | None = None
        if self.rank == 0:
            try:
                checkpoint.save(path, ctx, nodes, progress)
            except Exception as e:  # noqa: BLE001 - told to every rank, then re-raised
                caught, err = e, f"{type(e).__name__}: {e}"
        err = self.comm.bcast(err, root=0)
        if caught is not None:
            raise caught
        if err is not None:
            raise Failure(f"checkpoint {str(path)!r}: the save on rank 0 failed ({err})")

    def load(self, path: str | os.PathLike, ctx: Context, nodes: Sequence[Tnode | Tensor]
             ) -> tuple[Context, checkpoint.Progress]:
        """Every rank loads the checkpoint (:func:`ocannl.checkpoint.load`); ``ocannl.Failure``
        on every rank when any rank could not, or the ranks read different files."""
        try:
            ctx, progress = checkpoint.load(path, ctx, nodes)
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
        return ctx, progress
