"""Context: a backend, the buffers it holds for tensor nodes, and the routines bound to them.

Functional in style, as OCANNL's: every call returns the context to use next (this port
returns the same object, updated). Both ``Context.run(ctx, r)`` and ``ctx.run(r)`` work.
A routine is bound to its buffers when compiled; ``set_values`` writes into those same
buffers, so a host-side change reaches every routine without recompiling.

Allocation and initialization are apart, as in OCANNL: ``compile`` allocates the buffers a
routine needs; a node is *initialized* once something gives it values (``set_values``,
``from_host``, ``train.init_params``, a routine writing it), or when allocated if it has host
data or its defined start is zeros (``Tnode.zero_start``: optimizer state). A routine that
would read a node whose values must come from outside (``Tnode.needs_init``: parameters, data)
before anything initialized it refuses to run.

A cast twin that scheduling keeps between steps (``ocannl.ir.kept``) is state the context keeps
current: the routines that write its master write it too, and after anything else writes the
master (``set_values``, a checkpoint's load, a buffer handed out by ``device_buffer``) the
context recasts it before the next routine reads it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ocannl.backends.arena import views
from ocannl.backends.base import Backend, Buffer
from ocannl.ir.assignments import Comp, reads
from ocannl.ir.kept import recast
from ocannl.ir.lowered import Fill, assignments
from ocannl.ir.lowering import (
    AccessIndex,
    Effects,
    Lowered,
    effects,
    lower,
    stored_nodes,
)
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import MemoryMode, Tnode


def flat_layout(sizes: Sequence[int], align: int = 64) -> tuple[list[int], int]:
    """Where :meth:`Context.share_flat` puts nodes of ``sizes`` elements: each at the next
    multiple of ``align``; returns the offsets and the elements they span."""
    offsets, total = [], 0
    for size in sizes:
        total = -(-total // align) * align
        offsets.append(total)
        total += size
    return offsets, total


class Routine:
    """A compiled computation bound to one context's buffers; run it with ``Context.run``.

    ``compiled`` is the backend's code, shared by every routine of the same source;
    ``buffers`` are this routine's, in the order of ``nodes``. ``inputs`` are the nodes it
    reads before writing them whole: those a parameter's init or the host must provide are
    checked before its first run. ``written``: what running it initializes. ``checked``: its
    inputs were found initialized (they stay so), so :meth:`Context.run` just calls it.
    """

    def __init__(self, label: str, context: Context, nodes: tuple[Tnode, ...], compiled: Any,
                 buffers: tuple[Buffer, ...], effects: Effects, call: Callable[[], None]) -> None:
        self.label = label
        self.context = context
        self.nodes = nodes
        self.compiled = compiled
        self.buffers = buffers
        self.inputs = effects.inputs
        self.written = effects.written
        self.call = call  # runs the code on the bound buffers
        self.checked = False  # inputs found initialized once: they stay so
        # Kept twins (``ocannl.ir.kept``) it reads before writing.
        self.kept_reads = tuple(n for n in effects.inputs if n.keeps is not None)
        # ``context`` once checked, else None: Context.run's steady state is one comparison.
        self._ready_in: Context | None = None
        # Its local nodes' memory by node id (shared by the routines of one split compile)
        # and its lowered items: what the host saves to hold a run between two of them, and
        # what tells it when (a data-parallel rank's shards, ``parallel/synced.py``).
        self.local_views: dict[int, Buffer] = {}
        self.lowered: tuple[Lowered, ...] = ()

    def __repr__(self) -> str:
        return f"Routine({self.label!r}, {len(self.nodes)} buffers)"


class Checked:
    """Host values a :class:`Staged` has checked (:meth:`Staged.check`), for its
    :meth:`Staged.write`: a data-parallel rank's shards, every input's, are checked when the
    batch is given, before anything is written, so a bad value in a later shard or input
    leaves every buffer as it was. ``blocks``: how many of the node's values it holds,
    stacked."""

    __slots__ = ("blocks", "host", "node_id")

    def __init__(self, node_id: int, host: np.ndarray, blocks: int) -> None:
        self.node_id, self.host, self.blocks = node_id, host, blocks


def check_blocks(node: Tnode, values: Any, blocks: int) -> Checked:
    """``values`` checked in full as ``blocks`` of ``node``'s values (:meth:`Staged.check`
    without its glance), for a :class:`Staged` of that many blocks yet to be made."""
    return Checked(node.id, Context._checked(node, values, blocks), blocks)


class Staged:
    """A rank's ``blocks`` of a node's values (its shards of a batch, stacked on the first
    axis), checked and written at once with the lookups done when it is made: the first block
    into the node's own buffer as :meth:`Context.set_values` writes it, the later ones into a
    buffer of their own, rounded to the node's precision as ``set_values`` rounds.
    ``views[b]`` is block ``b``'s buffer (``views[0]`` the node's own): a routine reads a
    later block through :meth:`Context.rebound` (``reads``), or :meth:`put` copies one into
    the node. Made by :meth:`Context.staged`; it holds only a weak reference to its
    context."""

    __slots__ = ("__weakref__", "_context", "_later", "_shapes", "_writes", "blocks", "node",
                 "views")

    def __init__(self, context: Context, node: Tnode, blocks: int) -> None:
        self.node, self.blocks = node, blocks
        own = context._ensure(node)
        size, dims = node.size, node.dims
        self._later = context._alloc_apart(Tnode(f"{node.name}_staged", ((blocks - 1) * size,),
                                                 node.prec)) if blocks > 1 else None
        # each block a buffer like the node's own: what a rebound routine reads
        self.views = [own] + [self._later[b * size:(b + 1) * size] for b in range(blocks - 1)]
        # the shapes check() takes at a glance: the dims stacked, or flat (a node with no
        # axis: none, each value checked in full)
        self._shapes = ((dims[0] * blocks, *dims[1:]), (size * blocks,)) if dims else ()
        self._context = weakref.ref(context)
        # The backend's write into the node's buffer and into the later blocks', each with
        # the part of the values it takes (made once: a batch is written every step).
        writer = context._backend.writer
        self._writes = [(writer(node, own), slice(0, size))] + (
            [(writer(node, self._later), slice(size, None))] if self._later is not None else [])

    def __repr__(self) -> str:
        return f"Staged({self.node.name}, {self.blocks} blocks)"

    @property
    def context(self) -> Context | None:
        """The context whose buffers these are (None once it is gone)."""
        return self._context()

    def check(self, values: Any) -> Checked:
        """``values`` checked as :meth:`Context.set_values` checks them, as ``blocks`` of the
        node's values stacked on the first axis (or flat): ``ValueError`` / ``TypeError``
        naming what is wrong, nothing written. The host array is kept as given until
        :meth:`write`: copy it first if it may change before then."""
        node = self.node
        if type(values) is np.ndarray and values.shape in self._shapes \
                and values.dtype.kind in "fiub" and node.check_values is None:
            return Checked(node.id, values.reshape(-1), self.blocks)  # a batch, every step
        return check_blocks(node, values, self.blocks)

    def write(self, values: Checked) -> None:
        """Write every block: ``values`` from this Staged's :meth:`check` (else
        ``ValueError``, nothing written); the node is then written as by
        :meth:`Context.set_values`."""
        node = self.node
        if type(values) is not Checked or values.node_id != node.id \
                or values.blocks != self.blocks:
            got = (f"values checked for node id {values.node_id}, {values.blocks} block(s)"
                   if type(values) is Checked else f"{type(values).__name__} {values!r:.60}")
            raise ValueError(f"{self!r} takes values it checked (Staged.check), got {got}")
        context = self._context()
        if context is None:
            raise ValueError(f"{self!r}: its context is gone")
        host = values.host
        for write, part in self._writes:
            write(host[part])
        context._written(node)

    def put(self, block: int) -> None:
        """Copy later block ``block`` into the node's own buffer (a device copy: the values
        were rounded when written), the node then written as by :meth:`Context.set_values`."""
        context = self._context()
        if context is None:
            raise ValueError(f"{self!r}: its context is gone")
        if not 1 <= block < self.blocks:
            raise ValueError(f"{self!r}.put: block {block!r}: expected a later block, 1 to "
                             f"{self.blocks - 1}")
        self.views[0][...] = self.views[block]
        context._written(self.node)


# An Enum member read through its class is a slow attribute lookup next to a module global
# (benchmarks/OBSTACLES.md, "A small step's fixed costs"): the host's every-step paths
# (set_values, get_value) read this one instead.
_LOCAL = MemoryMode.local


def _buffer_address(buf: Buffer) -> int:
    """Where a buffer's memory starts: a NumPy array's (CPU) or a CuPy array's (CUDA)."""
    data = getattr(buf, "ctypes", None)
    return int(data.data) if data is not None else int(buf.data.ptr)


def _like(buf: Any, other: Buffer) -> bool:
    """Whether ``buf`` can stand for ``other`` in a routine's binding: the same kind of array,
    dtype and shape."""
    return (type(buf) is type(other) and buf.dtype == other.dtype
            and buf.shape == other.shape)


def _require_blocks(what: str, node: Tnode, blocks: Any) -> None:
    if type(blocks) is not int or blocks < 1:
        raise ValueError(f"{what} on {node.name}: blocks must be an int >= 1, got {blocks!r}")


def _buffer_kind(buf: Any) -> str:
    return (f"{type(buf).__name__} {getattr(buf, 'dtype', '')} "
            f"{getattr(buf, 'shape', '')}").rstrip()


def offset_in(buf: Buffer, whole: Buffer) -> int | None:
    """The element of ``whole`` at which ``buf`` starts when it is a view inside it (a flat
    buffer's member), else None."""
    at = _buffer_address(buf) - _buffer_address(whole)
    return at // whole.itemsize if 0 <= at < whole.nbytes else None


def _as_node(x: Any) -> Tnode:
    node = getattr(x, "value", x)
    if not isinstance(node, Tnode):
        raise TypeError(f"expected a Tensor or a Tnode, got {type(x).__name__}: {x!r}")
    return node


class Context:
    """Device buffers for tensor nodes, and the compile/run/transfer operations on them."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._buffers: dict[int, tuple[Tnode, Buffer]] = {}
        self._initialized: set[int] = set()
        self._views: set[int] = set()  # nodes whose buffer is a view of a shared flat buffer
        self._local_bytes = 0  # the arenas of compiled routines' local nodes
        self._apart_bytes = 0  # buffers of no node's own (new_buffer, Staged)
        self.compile_count = 0  # routines whose code was compiled anew by this context
        # Kept twins allocated here, by their master's id; those whose master was written since
        # their last cast; the routines recasting them; every routine (to leave its steady state
        # when a kept twin goes stale); the nodes viewing each flat buffer.
        self._kept: dict[int, list[Tnode]] = {}
        self._stale: set[int] = set()
        self._recasts: dict[int, Routine] = {}
        self._routines: weakref.WeakSet[Routine] = weakref.WeakSet()
        self._flat_members: dict[int, list[Tnode]] = {}

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def cpu(cls) -> Context:
        from ocannl.backends.cpu.backend import CpuBackend

        return cls(CpuBackend())

    @classmethod
    def cuda(cls, device_id: int = 0) -> Context:
        from ocannl.backends.cuda.runtime import CupyCudaBackend

        return cls(CupyCudaBackend(device_id))

    _fallback_said = False

    @classmethod
    def auto(cls) -> Context:
        """The GPU when CuPy sees one, else the CPU (saying once why the GPU was not used)."""
        try:
            return cls.cuda()
        except Exception as err:  # noqa: BLE001 - any reason the GPU is unusable means the CPU
            if not Context._fallback_said:
                Context._fallback_said = True
                # One plain line: the gist of the reason, not the driver's error text
                # (Context.cuda() raises with all of it).
                gist = str(err).split(": no GPU is usable: ", 1)[-1].strip()
                gist = gist.splitlines()[0].split(" (", 1)[0].split("; ", 1)[0] if gist else ""
                warnings.warn(f"ocannl: no usable GPU ({gist or type(err).__name__}), using the "
                              f"CPU backend",
                              RuntimeWarning, stacklevel=2)
            return cls.cpu()

    def backend_name(self) -> str:
        return self._backend.name

    @property
    def stream(self) -> Any:
        """The device stream its routines run on (a CuPy stream on CUDA; None on the CPU): a
        communicator orders its collectives after the work submitted there
        (``NcclCommunicator.follow``)."""
        return getattr(self._backend, "stream", None)

    def describe(self) -> str:
        """The backend in one line: on the CPU its threads, its BLAS and which 16-bit products
        run native (``backends/cpu/native_products.py``)."""
        return self._backend.describe()

    # --- compile and run ----------------------------------------------------------------------

    def compile(self, comp: Comp, bindings: Mapping | None = None) -> tuple[Context, Routine]:
        """Compile a computation into a routine bound to this context's buffers.

        ``bindings`` are OCANNL's static index bindings; this port's routines have none, so
        only an empty mapping (or None) is accepted.
        """
        if bindings:
            raise ValueError(f"static index bindings are not supported, got {dict(bindings)!r}")
        if not isinstance(comp, Comp):
            raise TypeError(f"compile expects a Comp, got {type(comp).__name__}")
        return self.compile_lowered(comp.label, self.lower(comp))

    def lower(self, comp: Comp) -> list[Lowered]:
        """The lowered items (fills, loop groups, GEMMs) this context's backend runs for
        ``comp``, in order: what :meth:`compile` compiles."""
        return lower(comp, self._backend.target)

    def compile_split(self, comp: Comp, after: Sequence[Sequence[Any]], *,
                      replaced: bool | Sequence[bool] = False
                      ) -> tuple[Context, list[Routine], list[int]]:
        """Compile ``comp`` as :meth:`compile` does, cut into consecutive routines: one ends
        right after the last item writing a node of each group of ``after`` (nodes or
        tensors). Running the routines in order runs the very items of the whole routine on
        the same memory (its local nodes included), so the same bits; between two of them
        the host may start work on what the first ones finished (a data-parallel step starts
        a bucket's exchange while the backward code goes on). Returns the routines and, per
        group, the index of the routine after which its nodes are written.

        ``replaced=True`` (or one bool per group): the host replaces the group's values between
        the routines (a data-parallel step puts in their sums over every shard), so no
        assignment up to the cut may read them except in writing them; ``ValueError`` names
        the node otherwise (the cut could not hand the replaced values to every reader)."""
        if not isinstance(comp, Comp):
            raise TypeError(f"compile_split expects a Comp, got {type(comp).__name__}")
        code = self.lower(comp)
        groups = [{_as_node(n).id for n in g} for g in after]
        last = [0] * len(groups)  # per group: the end of the item writing it last
        for k, item in enumerate(code):
            wrote = {n.id for n in effects([item]).written}
            for g, ids in enumerate(groups):
                if wrote & ids:
                    last[g] = k + 1
        which = [replaced] * len(groups) if isinstance(replaced, bool) else list(replaced)
        if len(which) != len(groups):
            raise ValueError(f"compile_split: replaced names {len(which)} groups, after has "
                             f"{len(groups)}")
        self._refuse_early_reads(comp.label, code,
                                 [(g, e) for g, e, r in zip(groups, last, which, strict=True) if r])
        ends = sorted({max(e, 1) for e in last} | {len(code)}) if code else [0]
        segments = [code[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        ctx, routines = self._compile_segments(comp.label, segments)
        return ctx, routines, [ends.index(max(e, 1)) if code else 0 for e in last]

    @staticmethod
    def _refuse_early_reads(label: str, code: list[Lowered],
                            groups: list[tuple[set[int], int]]) -> None:
        for ids, end in groups:
            for a in assignments(code[:end]):
                if isinstance(a, Fill):
                    continue
                early = {g.node.id: g.node for g in reads(a.expr) if g.node.id in ids}
                early.pop(a.lhs.id, None)
                if early:
                    name = next(iter(early.values())).name
                    raise ValueError(f"{label}: {a.lhs.name} reads {name} before the cut after "
                                     f"which its values are replaced (lowering placed the read "
                                     f"with the writes): it cannot be split there")

    def compile_lowered(self, label: str, code: list[Lowered], *,
                        local_check: bool = True) -> tuple[Context, Routine]:
        """Compile lowered items (from :meth:`lower`) into a routine bound to this context's
        buffers. Its local nodes (``MemoryMode.local``) live in arenas of the routine's own,
        sharing memory where their uses do not overlap; a routine that reads one before
        writing it whole is refused, naming it. ``local_check=False`` gives each local node
        memory of its own with no check, for timing a part of a routine alone
        (``benchmarks/profile_items.py``)."""
        ctx, (routine,) = self._compile_segments(label, [code], local_check=local_check)
        return ctx, routine

    def _compile_segments(self, label: str, segments: list[list[Lowered]], *,
                          local_check: bool = True) -> tuple[Context, list[Routine]]:
        """One routine per segment of lowered code, run in order; their local nodes share
        one placement over the whole code (a node may be written by one and read by a
        later one)."""
        code = [item for seg in segments for item in seg]
        nodes = stored_nodes(code)
        fx = effects(code)
        local = {n.id: n for n in nodes if n.memory_mode is MemoryMode.local}
        if local_check:
            unwritten = [n.name for n in fx.inputs if n.id in local]
            if unwritten:
                raise ValueError(
                    f"{label}: reads {', '.join(unwritten)} before writing it whole, but it is "
                    f"local to the routine that computes it (a block's internal tensor, a cast "
                    f"twin placed 'auto', an intermediate tensor's gradient, or lowering's own): "
                    f"compile it in the same routine as its computation, or call retain_grad() "
                    f"on the tensor to keep its gradient materialized")
        views = self._local_buffers(label, code, list(local.values()), shared=local_check)
        routines = []
        for k, seg in enumerate(segments):
            name = label if len(segments) == 1 else f"{label}_part{k}"
            whole = len(segments) == 1  # the common case: nothing to compute again
            seg_nodes = nodes if whole else stored_nodes(seg)
            compiled, compiled_anew = self._backend.compile(name, seg, seg_nodes)
            for n in seg_nodes:
                if n.id not in local:
                    self._ensure(n)
            if compiled_anew:
                self.compile_count += 1
            bufs = tuple(views[n.id] if n.id in local else self._buffers[n.id][1]
                         for n in seg_nodes)
            call = self._backend.bind(compiled, bufs)
            kept = tuple(n for n in seg_nodes if n.id not in local)
            seg_fx = fx if whole else effects(seg)
            seg_fx = Effects(tuple(n for n in seg_fx.inputs if n.id not in local),
                             tuple(n for n in seg_fx.written if n.id not in local))
            routine = Routine(name, self, kept, compiled, bufs, seg_fx, call)
            routine.local_views = views
            routine.lowered = tuple(seg)
            self._routines.add(routine)
            routines.append(routine)
        return self, routines

    def rebound(self, routine: Routine, flat: Any, storage: Buffer,
                reads: Mapping[Any, Buffer] | None = None) -> Routine:
        """``routine``'s machine code bound again, with its views of ``flat`` (a node from
        :meth:`share_flat`) moved to the same elements of ``storage``, a buffer of ``flat``'s
        kind (:meth:`new_buffer`); ``reads``: nodes the routine only reads, each moved to a
        buffer like its own (a :class:`Staged` block); every other buffer is the routine's own.
        No compile: a data-parallel rank computes each shard's gradients straight into a buffer
        of their own (``parallel.DataParallel``), where copying them out would cost a pass over
        them, from its inputs where the batch put them. ``ValueError`` names what does not
        fit."""
        f = _as_node(flat)
        if not isinstance(routine, Routine) or routine.context is not self:
            raise ValueError(f"rebound: {routine!r} is not a routine of this context")
        if f.id not in self._flat_members:
            raise ValueError(f"rebound: {f.name} is not a flat buffer from share_flat")
        whole = self._buffer(f)
        if not _like(storage, whole):
            raise ValueError(f"rebound: storage must be a buffer like {f.name}'s "
                             f"({_buffer_kind(whole)}), got {_buffer_kind(storage)}")
        moved_reads = {}
        for t, buf in (reads or {}).items():
            node = _as_node(t)
            own = self._buffers.get(node.id)  # the routine's buffers: its nodes' and local views
            where = [i for i, b in enumerate(routine.buffers) if own is not None and b is own[1]]
            if not where or any(n.id == node.id for n in routine.written):
                raise ValueError(f"rebound: {routine!r} " + (
                    "writes" if where else "does not read") + f" {node.name}: reads= moves a "
                    f"node the routine only reads")
            if node.twins or offset_in(routine.buffers[where[0]], whole) is not None:
                raise ValueError(f"rebound: {node.name} " + (
                    "has kept cast twins, which routines read in its place" if node.twins
                    else f"lies in {f.name}, which storage moves") + ": its reads cannot move")
            if not _like(buf, routine.buffers[where[0]]):
                raise ValueError(f"rebound: {node.name}'s reads must move to a buffer like its "
                                 f"own ({_buffer_kind(routine.buffers[where[0]])}), got "
                                 f"{_buffer_kind(buf)}")
            moved_reads[where[0]] = buf
        bufs = []
        for i, b in enumerate(routine.buffers):  # a view inside the flat buffer moves with it
            off = offset_in(b, whole)
            if off is not None:
                b = storage[off:off + b.size].reshape(b.shape)
            bufs.append(moved_reads.get(i, b))
        moved = Routine(f"{routine.label}@{f.name}'", self, routine.nodes, routine.compiled,
                        tuple(bufs), Effects(routine.inputs, routine.written),
                        self._backend.bind(routine.compiled, tuple(bufs)))
        moved.local_views, moved.lowered = routine.local_views, routine.lowered
        self._routines.add(moved)
        return moved

    def new_buffer(self, t: Any) -> Buffer:
        """A zero-filled buffer of the backend's kind for ``t``'s dims and precision, bound to
        nothing (:meth:`rebound` binds routines to one); :meth:`mem` counts it."""
        return self._alloc_apart(_as_node(t))

    def _alloc_apart(self, node: Tnode) -> Buffer:
        """A buffer for ``node``'s values that is not the node's own (:meth:`new_buffer`, a
        :class:`Staged`), counted by :meth:`mem`."""
        buf = self._alloc(node)
        self._apart_bytes += node.size * node.prec.itemsize
        return buf

    def _local_buffers(self, label: str, code: list[Lowered], local: list[Tnode],
                       shared: bool) -> dict[int, Buffer]:
        """Buffers for a routine's local nodes: views of one arena per precision, each node
        placed apart from those in use at the same items (``arena.pack``), or (``shared``
        False) one arena each."""
        index = AccessIndex(code)
        out: dict[int, Buffer] = {}
        for prec in dict.fromkeys(n.prec for n in local):
            group = [n for n in local if n.prec is prec]

            def arena(size: int, prec: Precision = prec) -> Buffer:
                node = Tnode(f"{label}_local_{prec.value}", (max(size, 1),), prec)
                self._local_bytes += node.size * prec.itemsize
                buf = self._backend.alloc(node)
                if not shared:
                    # Unchecked memory is read before anything writes it: written now, so
                    # its pages are the process's own. Reading the zero page a fresh
                    # allocation maps, through many addresses, ran a convolution's kernel
                    # gradient 3.5x slower on an AMD Zen 5 (5.2 us against 18.5 us).
                    buf[...] = 0
                return buf

            placed = views([(n.size, *index.span(n.id)) for n in group], arena, prec.itemsize,
                           shared)
            out.update((n.id, v) for n, v in zip(group, placed, strict=True))
        return out

    def run(self, routine: Routine) -> Context:
        """Run a routine compiled by this context. Its first run checks that every parameter
        and data node it reads has been initialized, naming those that are not.

        Every later run is one comparison and the call: a training step's host code (the
        recipes' too) runs its routines through here, not around it."""
        try:
            if routine._ready_in is self:  # the steady state, checked once below
                routine.call()
                return self
        except AttributeError:  # not a Routine: refused below
            pass
        return self._run_checked(routine)

    def _run_checked(self, routine: Routine) -> Context:
        if not isinstance(routine, Routine):
            raise TypeError(f"run expects a Routine, got {type(routine).__name__}: {routine!r}")
        if routine.context is not self:
            raise ValueError(f"{routine!r} was compiled by another context ({routine.context!r}),"
                             f" not this one ({self!r})")
        if not routine.checked:
            missing = [n for n in routine.inputs
                       if n.needs_init and n.id not in self._initialized]
            if missing:
                names = ", ".join(n.name for n in missing)
                raise ValueError(
                    f"{routine!r} reads {names}, which nothing has initialized in this context: "
                    f"call train.init_params(ctx, loss) for parameters, ctx.set_values for data")
            self._recast_stale(routine)
            routine.call()
            self._initialized.update(n.id for n in routine.written)
            routine.checked = True
        else:
            self._recast_stale(routine)
            routine.call()
        if self._kept_after(routine):
            routine._ready_in = self
        return self

    # --- kept twins -----------------------------------------------------------------------------

    def _recast_stale(self, routine: Routine) -> None:
        """Recast the kept twins ``routine`` reads whose master was written since their cast;
        ``ValueError`` naming a master that nothing has initialized (nothing is run then)."""
        stale = [k for k in routine.kept_reads if k.id in self._stale]
        for k in stale:
            master = k.keeps[0]  # type: ignore[index]
            if master.id not in self._initialized:
                raise ValueError(
                    f"{routine!r} reads the cast twin of {master.name}, which nothing has "
                    f"initialized in this context: call train.init_params(ctx, loss) for "
                    f"parameters, ctx.set_values for data")
        for k in stale:
            r = self._recasts.get(k.id)
            if r is None:
                _, r = self.compile_lowered(f"recast_{k.name}", self.lower(
                    Comp((recast(k),), f"recast_{k.name}")))
                self._recasts[k.id] = r
            r.call()
            self._stale.discard(k.id)
            self._initialized.add(k.id)

    def _kept_after(self, routine: Routine) -> bool:
        """After ``routine`` ran: its kept twins are current, and those of the masters it wrote
        without writing them (it was compiled before they were kept) are stale. True when it
        left none stale, so its later runs may skip the checks."""
        if not self._kept:
            return True
        written = {n.id for n in routine.written}
        self._stale -= written
        spoiled = [k.id for i in written for k in self._kept.get(i, ()) if k.id not in written]
        if spoiled:
            self._stale.update(spoiled)
            self._unready()
        return not spoiled

    def _unready(self) -> None:
        """Every routine's next run goes through the checks (a kept twin went stale)."""
        for r in self._routines:
            r._ready_in = None

    def _master_written(self, node: Tnode) -> None:
        """``node`` was written outside the routines: its kept twins are stale."""
        kept = self._kept.get(node.id)
        if kept:
            self._stale.update(k.id for k in kept)
            self._unready()

    def mark_written(self, t: Any) -> Context:
        """Tell the context that ``t``'s buffer (from :meth:`device_buffer`) was written outside
        its routines, as a communicator does: what it keeps derived from the node (a master's
        kept cast twins) is recomputed before a routine next reads it. ``device_buffer`` marks
        the node already when it hands the buffer out; call this after a later write."""
        node = _as_node(t)
        self._buffer(node)
        if self._kept:  # else no node has a twin to spoil
            for n in self._flat_members.get(node.id, [node]):
                self._master_written(n)
        return self

    # --- buffers ------------------------------------------------------------------------------

    def _ensure(self, node: Tnode) -> Buffer:
        self._refuse_local(node)
        entry = self._buffers.get(node.id)
        if entry is None:
            buf = self._alloc(node)
            if node.host_data is not None:
                self._backend.write(node, buf, self._checked(node, node.host_data))
            self._buffers[node.id] = (node, buf)
            if node.host_data is not None or node.zero_start:
                self._initialized.add(node.id)
            if node.keeps is not None:  # cast from its master before its first read
                self._kept.setdefault(node.keeps[0].id, []).append(node)
                self._stale.add(node.id)
                self._unready()
            return buf
        return entry[1]

    def _alloc(self, node: Tnode) -> Buffer:
        """The backend's buffer for ``node``; ``MemoryError`` naming the node, its dims and
        bytes when there is no memory for it (the backend's own error names only a size)."""
        try:
            return self._backend.alloc(node)
        except Exception as err:  # CuPy's OutOfMemoryError is no MemoryError
            if not isinstance(err, MemoryError) and "OutOfMemory" not in type(err).__name__:
                raise
            raise MemoryError(f"cannot allocate {node.size * node.prec.itemsize} bytes for node "
                              f"{node.name} (dims {node.dims}, {node.prec.value}) on the "
                              f"{self.backend_name()} backend: {err}") from None

    def share_flat(self, nodes: Sequence[Any], *, label: str = "flat", align: int = 64,
                   length: int | None = None, storage: np.ndarray | None = None) -> Tnode:
        """Allocate one flat, zero-filled buffer holding ``nodes`` back to back, and make each
        node's buffer a view of its part of it; returns a 1-D node standing for the whole
        buffer (``get_values`` / ``set_values`` / :meth:`device_buffer` work on it).

        Call it before compiling any routine over these nodes: routines bind the views, so one
        operation on the flat buffer (a data-parallel allreduce of every gradient) reaches them
        all. Each part starts at a multiple of ``align`` elements (:func:`flat_layout`); the
        padding between parts stays zero, and a node whose values come from no one outside (a
        gradient) counts as initialized at those zeros. ``length``: the buffer's length when
        it must be longer than the nodes need (zero padding at the end: an allgather's blocks
        of equal size). Every node must be materialized, of known dims, not yet allocated in
        this context, and of one precision; ``ValueError`` names the first that is not.

        ``storage``: on the CPU, zero-filled memory to hold the flat buffer instead of a new
        allocation (a data-parallel rank's block of memory every rank maps): a contiguous
        NumPy array of the buffer's dtype and length.
        """
        ns = [_as_node(n) for n in nodes]
        if not ns:
            raise ValueError("share_flat: no nodes given")
        if not isinstance(align, int) or isinstance(align, bool) or align < 1:
            raise ValueError(f"share_flat: align must be an integer >= 1, got {align!r}")
        if len({n.id for n in ns}) != len(ns):
            raise ValueError(f"share_flat: a node is listed twice in {[n.name for n in ns]}")
        prec = ns[0].prec
        for n in ns:
            self._check_viewable(n, prec, "share_flat")
        offsets, total = flat_layout([n.size for n in ns], align)
        if length is not None:
            if not isinstance(length, int) or isinstance(length, bool) or length < total:
                raise ValueError(f"share_flat: length must be an integer >= {total} (the "
                                 f"nodes' elements with their alignment), got {length!r}")
            total = length
        flat = Tnode(label, (total,), prec, zero_start=True)
        if storage is None:
            self._ensure(flat)
        else:
            want = prec.numpy_dtype
            if self.backend_name() != "cpu" or not isinstance(storage, np.ndarray) \
                    or storage.dtype != want or storage.shape != (total,) \
                    or not storage.flags.c_contiguous:
                got = (f"{type(storage).__name__} {getattr(storage, 'dtype', '')} "
                       f"{getattr(storage, 'shape', '')}")
                raise ValueError(f"share_flat: storage must be a contiguous NumPy array of "
                                 f"{want} and shape ({total},) on the cpu backend, got {got} "
                                 f"on {self.backend_name()}")
            self._buffers[flat.id] = (flat, storage)
            self._initialized.add(flat.id)
        self._flat_members[flat.id] = ns
        for n, off in zip(ns, offsets, strict=True):
            self._view(n, flat, off)
        return flat

    def share_slice(self, node: Any, flat: Any, start: int) -> Context:
        """Make ``node``'s buffer the elements ``[start, start + node.size)`` of ``flat``'s (a
        node from :meth:`share_flat`): a 1-D part of the flat layout that crosses no node's
        boundary, for a routine over one rank's slice (ZeRO-1's sharded optimizer update).
        The same rules as :meth:`share_flat`; ``ValueError`` names what breaks them, or the
        range when it does not lie inside ``flat``."""
        n, f = _as_node(node), _as_node(flat)
        self._check_viewable(n, f.prec, "share_slice")
        self._buffer(f)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 \
                or start + n.size > f.size:
            raise ValueError(f"share_slice: {n.name} ({n.size} elements) from {start!r} does "
                             f"not lie inside {f.name} ({f.size} elements)")
        self._view(n, f, start)
        return self

    def _check_viewable(self, n: Tnode, prec: Precision, what: str) -> None:
        if n.memory_mode is not MemoryMode.materialized:
            raise ValueError(f"{what}: {n.name} is {n.memory_mode.value}, not materialized")
        if not n.dims_known:
            raise ValueError(f"{what}: {n.name} has dims not yet inferred")
        if n.prec is not prec:
            raise ValueError(f"{what}: {n.name} is {n.prec.value}, the flat buffer "
                             f"{prec.value}: one flat buffer holds one precision")
        if n.id in self._buffers:
            raise ValueError(f"{what}: {n.name} already has a buffer in this context "
                             f"(routines compiled before are bound to it): share it before "
                             f"compiling")

    def _view(self, n: Tnode, flat: Tnode, off: int) -> None:
        view = self._buffer(flat)[off:off + n.size]
        if n.host_data is not None:
            self._backend.write(n, view, self._checked(n, n.host_data))
        self._buffers[n.id] = (n, view)
        self._views.add(n.id)
        # The flat buffer is zero-filled: a view of a node whose values come from no one
        # outside (a gradient) starts at those zeros, as optimizer state does.
        if n.host_data is not None or n.zero_start or not n.needs_init:
            self._initialized.add(n.id)

    def device_buffer(self, t: Any) -> Buffer:
        """The backend's own buffer of a node: a flat NumPy array (CPU) or CuPy array (CUDA) in
        the storage dtype. For communicators, which operate on device memory in place; user
        code reads and writes values with ``get_values`` / ``set_values``. The node counts as
        written (:meth:`mark_written`): a master's kept cast twins are recast before a routine
        next reads them."""
        buf = self._buffer(_as_node(t))
        self.mark_written(t)
        return buf

    @staticmethod
    def _refuse_local(node: Tnode) -> None:
        if node.memory_mode is MemoryMode.virtual:
            raise ValueError(
                f"node {node.name} is virtual (a cast twin placed 'virtual', recomputed at "
                f"every read, or a constant folded into the code): it has no buffer, and the "
                f"host cannot read or write it; read its master, or build twins with "
                f"placement='materialized' to read them")
        if node.memory_mode is _LOCAL:
            raise ValueError(
                f"node {node.name} is local to the routines that compute it (a block's "
                f"internal tensor, a cast twin placed 'auto', an intermediate tensor's "
                f"gradient, or lowering's own): the host cannot read or write it; call "
                f"retain_grad() on the tensor before compiling to keep its gradient, or build "
                f"twins with placement='materialized' to read them")

    def _buffer(self, node: Tnode) -> Buffer:
        entry = self._buffers.get(node.id)
        if entry is None or node.memory_mode is not MemoryMode.materialized:
            self._refuse_local(node)
            raise ValueError(
                f"node {node.name} has no buffer in this {self.backend_name()} context")
        return entry[1]

    @staticmethod
    def _checked(node: Tnode, values: Any, blocks: int = 1) -> np.ndarray:
        """``values`` as a flat host array for ``node`` (``blocks`` of them stacked on the first
        axis), or ``ValueError`` naming the node, what was given and what was expected.
        Accepted: an array-like of real numbers (or booleans) shaped exactly as the node's dims
        (the first one ``blocks`` times as long), or flat with the node's size (times
        ``blocks``), or a scalar for a one-element node. Any other shape is refused, even one
        with the right element count: a transposed batch would otherwise scramble the data."""
        if type(values) is np.ndarray:  # the every-step case, a batch: no np.asarray
            arr = values
        else:
            try:
                arr = np.asarray(values)
            except (ValueError, TypeError) as err:
                kind = TypeError if isinstance(err, TypeError) else ValueError
                raise kind(f"set_values on {node.name}: the values are not an array of numbers "
                           f"({err})") from None
        dtype = arr.dtype
        if dtype.kind not in "biuf" and dtype.name != "bfloat16":
            raise ValueError(f"set_values on {node.name}: values must be numbers (real), got dtype "
                             f"{dtype}" + (" (non-numeric values, or integers too large "
                                           "for int64)" if dtype.kind == "O" else ""))
        dims, size = node.dims, node.size
        if blocks == 1:
            if arr.shape != dims and arr.shape != (size,) and not (size == 1 and arr.ndim == 0):
                raise ValueError(
                    f"set_values on {node.name}: got {arr.size} values of shape {arr.shape}, "
                    f"expected {size} values shaped as the node's dims {dims} or flat ({size},)"
                )
        elif not dims or (arr.shape != (dims[0] * blocks, *dims[1:])
                          and arr.shape != (size * blocks,)):
            stacked = (dims[0] * blocks, *dims[1:]) if dims else "(none: the node has no axis)"
            raise ValueError(
                f"set_values on {node.name}: got {arr.size} values of shape {arr.shape}, "
                f"expected {blocks} blocks of the node's dims {dims} stacked on the first axis "
                f"{stacked} or flat ({size * blocks},)")
        if node.check_values is not None:  # e.g. class ids: integers in range
            if blocks == 1:
                node.check_values(arr.reshape(dims))
            else:
                whole = arr.reshape(-1)
                for b in range(blocks):
                    node.check_values(whole[b * size:(b + 1) * size].reshape(dims))
        return arr.ravel()  # the backend rounds to the node's precision as it writes

    def set_values(self, t: Any, values: Any) -> Context:
        """Write host values into the node's buffer in place, allocating it if absent.

        ``values``: real numbers shaped exactly as the node's dims, or a flat array of the
        node's size (a scalar for a one-element node). Any other shape raises ``ValueError``
        naming both shapes, even with the right number of values (a transposed batch would be
        scrambled), and so do non-numeric values; nothing is written or allocated then. Values
        are rounded once, to nearest (ties to even), to the node's precision."""
        node = _as_node(t)
        host = self._checked(node, values)
        self._backend.write(node, self._ensure(node), host)
        self._written(node)
        return self

    def _written(self, node: Tnode) -> None:
        """``node``'s buffer was written from the host: it is initialized, and its kept cast
        twins are stale."""
        self._initialized.add(node.id)
        if node.twins:
            self._master_written(node)

    def staged(self, t: Any, blocks: int) -> Staged:
        """A :class:`Staged` for ``t``: ``blocks`` of its values, the first in the node's buffer
        (allocated now if it has none), the others in a buffer of their own, zero at first."""
        node = _as_node(t)
        _require_blocks("staged", node, blocks)
        return Staged(self, node, blocks)

    def get_values(self, t: Any) -> np.ndarray:
        """The node's values as a host array shaped by its dims. ``ValueError`` when nothing
        has written them (a parameter before ``train.init_params``, a result before the first
        run of a routine computing it): the buffer would only hold its allocation's zeros."""
        node = _as_node(t)
        buf = self._buffer(node)
        if node.id not in self._initialized:
            raise ValueError(self._unwritten(node, "get_values"))
        return self._backend.read(node, buf).reshape(node.dims)

    @staticmethod
    def _unwritten(node: Tnode, what: str) -> str:
        """The refusal of a read of ``node`` that nothing initialized, in ``run``'s words."""
        return (f"{what} reads {node.name}, which nothing has initialized in this context: call "
                f"train.init_params(ctx, loss) for parameters, ctx.set_values for data, or run "
                f"a routine that computes it first")

    def set_value(self, t: Any, value: float, idx: tuple[int, ...] | None = None) -> Context:
        """Write one element; ``idx`` may be omitted for a one-element node."""
        node = _as_node(t)
        pos = self._flat_index(node, idx)
        host = self.get_values(node).reshape(-1) if self.is_initialized(node) else np.zeros(
            node.size, node.prec.numpy_dtype)
        host[pos] = value
        return self.set_values(node, host)

    def get_value(self, t: Any, idx: tuple[int, ...] | None = None) -> float:
        """One element (``idx`` may be omitted for a one-element node), read alone."""
        return self.reader(t, idx)()

    def reader(self, t: Any, idx: tuple[int, ...] | None = None) -> Callable[[], float]:
        """A callable returning one element's current value, as :meth:`get_value` would: the
        checks and the lookups done once, for a read every step (the host gate's).

        A read of a value nothing has written yet is refused as :meth:`get_values` refuses it.
        A node initialized already gets the backend's reader itself (no check left per call);
        one that is not (a routine's result, before its first run) gets a reader that checks
        one set membership per call and raises until something has written the node."""
        node = _as_node(t)
        read = self._backend.reader(node, self._buffer(node), self._flat_index(node, idx))
        if node.id in self._initialized:
            return read
        initialized, nid = self._initialized, node.id  # the same set for the context's life

        def read_once_written() -> float:
            if nid in initialized:
                return read()
            raise ValueError(self._unwritten(node, "get_value"))

        return read_once_written

    def _gated(self, first: Routine, second: Routine, t: Any) -> Callable[[], bool] | None:
        """The host gate's every step as one call, where the backend makes one (the CPU's
        ``gated``): ``first``, then ``second`` only when ``t``'s one f32 value is then finite,
        returning whether it was; ``None`` elsewhere. It runs the routines' code as bound,
        without :meth:`run`'s checks: call it only while both are ready here
        (``Routine._ready_in``), and :meth:`run` them otherwise."""
        gated = getattr(self._backend, "gated", None)
        node = _as_node(t)
        if gated is None or node.prec is not Precision.f32 or node.size != 1:
            return None
        for r in (first, second):
            if r.context is not self:
                raise ValueError(f"{r!r} was compiled by another context ({r.context!r}), "
                                 f"not this one ({self!r})")
        return gated((first.compiled, first.buffers), (second.compiled, second.buffers),
                     self._buffer(node), 0)

    @staticmethod
    def _flat_index(node: Tnode, idx: tuple[int, ...] | None) -> int:
        if idx is None:
            if node.size != 1:
                raise ValueError(f"node {node.name} has dims {node.dims}: give an index")
            return 0
        idx = tuple(idx)
        in_range = all(0 <= i < d for i, d in zip(idx, node.dims, strict=False))
        if len(idx) != len(node.dims) or not in_range:
            raise ValueError(f"index {idx} out of range for {node.name} with dims {node.dims}")
        return int(np.ravel_multi_index(idx, node.dims))

    def from_host(self, t: Any) -> Context:
        """Copy the node's host array (``Tnode.host_data``) to the device."""
        node = _as_node(t)
        if node.host_data is None:
            raise ValueError(f"node {node.name} has no host array to copy from")
        return self.set_values(node, node.host_data)

    def to_host(self, t: Any) -> Context:
        """Copy the device buffer into the node's host array."""
        node = _as_node(t)
        node.host_data = self.get_values(node)
        return self

    def is_initialized(self, t: Any) -> bool:
        """Whether the node has values in this context (not merely a buffer: see the module
        docstring)."""
        return _as_node(t).id in self._initialized

    def is_allocated(self, t: Any) -> bool:
        """Whether the node has a buffer in this context."""
        return _as_node(t).id in self._buffers

    def mem(self, t: Any = None) -> int:
        """Bytes held on the device: by one node, or (no argument) by the whole context (its
        nodes' buffers, its routines' local arenas, and the buffers it made apart from the
        nodes: a data-parallel rank's later shards' gradients and staged inputs)."""
        if t is not None:
            node = _as_node(t)
            self._buffer(node)
            return node.size * node.prec.itemsize
        return sum(n.size * n.prec.itemsize for n, _ in self._buffers.values()
                   if n.id not in self._views) + self._local_bytes + self._apart_bytes

    def nodes(self) -> list[Tnode]:
        return [n for n, _ in self._buffers.values()]

    def __repr__(self) -> str:
        return f"Context({self.backend_name()}, {len(self._buffers)} buffers, {self.mem()} bytes)"
