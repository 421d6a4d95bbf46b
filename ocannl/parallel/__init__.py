"""Data-parallel training across processes: one replica of the model per process (a *rank*),
each on an equal part of the global batch, the gradients summed once per step in one fixed
order, the same bits on any number of ranks.

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
bind the views. The global batch is cut into a fixed number of *shards* (``shards=``, one per
rank by default; :func:`default_shards` picks a power of two keeping enough rows a shard), the
model built over one shard's rows; each rank computes its block of consecutive shards, one run
of the gradient routine each, and the shard gradients are summed in the fixed order of
:class:`ShardTree`, whatever the number of ranks: the same bits on 1, 2, 4 ... ranks. The sum
runs between the gradient routine and the optimizer routine. Pass the ``DataParallel`` object as
a mixed-precision recipe's ``reducer``::

    comm = parallel.world()                       # MPI under mpiexec, else a world of one
    dp = parallel.DataParallel(comm, loss, inputs=[x, y], shards=8)  # x, y: a shard's rows
    ctx = dp.setup(ctx)                           # agree on the model and shards; flat grads
    recipe = mixed_prec.gated_step(scaler, loss, opt, reducer=dp)
    ctx = dp.compile(ctx, recipe)                 # the recipe's routines, for the other shards
    ctx = train.init_params(ctx, loss)
    ctx = dp.broadcast(ctx, checkpoint.training_state(loss, opt))   # rank 0's values
    for step in ...:
        ctx = dp.set_batch(ctx, xs, ys)           # the global batch (or this rank's block)
        ctx = recipe.step(ctx)                    # (or Loader(..., parallel=dp).next(ctx))

**The exchange** moves bytes only; every addition is the tree's. Each rank first sums its own
block (a subtree when the shard and rank counts are powers of two). On 2 ranks each then holds
one child of the root, and the communicator's allreduce of two is one addition per element
(``a + b`` and ``b + a`` are the same bits), in place on the device. On more, an all-to-all
sends each rank its ``1 / N`` slice of every partial sum, each rank sums its slice in the tree's
order and an allgather brings the slices to every rank: ``2 (N - 1) / N`` of the buffer sent
per rank, a ring allreduce's bytes, with MPI's own reduction never used (its order depends on
the implementation, the message size and the rank count).

**Overlap** (``overlap=True``, :mod:`ocannl.parallel.buckets`): the exchange runs bucket by
bucket, each started while the backward code goes on, each the tree's on its elements (the
same bits); in memory the ranks share, a bucket's sum is done as soon as every rank has written
it (:mod:`ocannl.parallel.shared_sum`). **ZeRO-1** (``shard_optimizer=True``,
:mod:`ocannl.parallel.zero`): each rank keeps and updates the optimizer state of one slice of
the parameters' elements, then the parameters are gathered (the same bits; checkpoints hold the
whole state).

Narrow (f16 / bf16) buffers are never summed: the model reads cast twins of f32 masters
(:func:`ocannl.mixed_prec.with_master_weights`) and only the masters' f32 gradients travel.
Each shard's loss is the mean over its rows, so the sum over the shards is ``shards`` times the
global batch's gradient; the ``1 / shards`` is folded into the unscale factor the optimizer
already applies (``1 / (scale * shards)``, rounded once to f32), not into an extra pass.

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

from ocannl.parallel.comm import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_ENV,
    CollectiveTimeout,
    Communicator,
    MpiCommunicator,
    NcclCommunicator,
    SingleProcess,
    collective_timeout,
    launched_by_mpi,
    world,
)
from ocannl.parallel.data_parallel import (
    DataParallel,
    code_description,
    graph_description,
    model_description,
)
from ocannl.parallel.shards import ShardTree, default_shards, shard

__all__ = [
    "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "CollectiveTimeout", "Communicator", "DataParallel",
    "MpiCommunicator", "NcclCommunicator", "ShardTree", "SingleProcess", "code_description",
    "collective_timeout", "default_shards", "graph_description", "launched_by_mpi",
    "model_description", "shard", "world",
]

# Errors print their class where it is used: ``ocannl.parallel.CollectiveTimeout``.
CollectiveTimeout.__module__ = __name__
