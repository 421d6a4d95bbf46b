"""The lowered code: what lowering hands every backend, and the one walker over it.

A routine's code is a list of items, run in order: :class:`Fill`, :class:`LoopGroup` (of
:class:`LoopNest`) and :class:`Gemm`. Their fields say what to compute (the assignments) and
how (what :mod:`ocannl.ir.schedule` decided from the backend's target record); a renderer reads
both and decides nothing. :func:`access` is the one answer to "what does this item read and
write", and :class:`AccessIndex` the one table of who reads and writes each node in a routine, which
every pass and backend asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ocannl.ir.assignments import Accum, Affine, Expr, Get, reads
from ocannl.ir.expr import rewrite_reads
from ocannl.ir.tnode import Tnode


@dataclass(frozen=True)
class Fill:
    """Set every cell of ``node`` to ``value``. On a GPU (``Target.gpu_block``), scheduling's
    launch: ``grid`` blocks of ``block`` threads, striding over the cells."""

    node: Tnode
    value: float
    grid: int = 0
    block: int = 0


@dataclass(frozen=True)
class LoopNest:
    """Loops over ``par`` (outer, distinct cells, in the written node's axis order so the
    innermost store is contiguous) then ``red`` (inner, accumulated locally). ``scatter``: the
    written cell moves with reduction iterators too (an affine target index: a convolution's
    input gradient), so every point reads, combines and writes its cell in turn.
    ``walk_rows``: the last parallel iterator runs innermost, inside the reduction loops, over
    a row of accumulators (a bias gradient summing ``g[i, j]`` over ``i`` reads rows of ``g``,
    not columns); each cell still accumulates its terms in the same order, so the same bits.
    ``gather``: a scatter lowered as a reduction per target cell (``lowering.gather_of``), whose
    cells a GPU spreads over enough blocks (``Target.gpu_sms``).

    How its values convert and store, as scheduling decided (the interpreter reads them too):
    ``keeps_payload``, the nest copies a value unchanged (a user's cast) that may be a
    signalling NaN (not one arithmetic just computed), so its conversions keep its bits as
    NumPy's do (elsewhere arithmetic quiets a NaN whatever the conversion did, and the plain
    instructions give the same bits); ``payload_rounds``, the ids of the nodes whose rounded
    reads (``Get.rounded``) round as a cast into a stored twin would, keeping payloads (a
    virtual twin's master, unless only products read the target or arithmetic just wrote it);
    ``exact_store``, every value stored into the 16-bit target is one of its precision's, so a
    bf16 store keeps its top half rather than rounding (the same bits, a NaN its sign's quiet
    NaN) and a target held in registers (``LoopGroup.registers``) is read as computed, neither
    narrowed nor widened again (f16's two conversions a cell; a NaN's payload is unspecified
    there);
    ``any_order``, a sum whose every term is +-0 or NaN (a checksum's), equal in any order:
    a renderer may reassociate it."""

    assign: Accum
    par: tuple[int, ...]
    red: tuple[int, ...]
    scatter: bool = False
    walk_rows: bool = False
    gather: bool = False
    keeps_payload: bool = False
    payload_rounds: frozenset[int] = frozenset()
    exact_store: bool = False
    any_order: bool = False

    @property
    def space(self) -> tuple[int, ...]:
        return self.assign.space

    @property
    def par_size(self) -> int:
        return math.prod(self.space[i] for i in self.par)

    @property
    def red_size(self) -> int:
        return math.prod(self.space[i] for i in self.red)


# A loop group holds at most this many nests: past it, LLVM's and NVRTC's per-loop analyses
# (memory dependences between every pair of accesses) grow faster than the group, and a new
# loop costs one more pass over the cells.
MAX_GROUP = 32


@dataclass(frozen=True)
class LoopGroup:
    """Nests run point by point inside one loop over the first one's parallel iterators.

    What scheduling decided (``ocannl.ir.schedule``): ``registers``, the ids of local nodes no
    item but this group touches, each written by one of its pointwise nests and read only by
    later pointwise nests at the same cell: handed over in a register, never stored, given no
    memory; ``split``, the extent of the outermost loop shared over threads (None: one
    thread), in ``chunks`` chunks per thread; ``jam``, how many cells of a lone reduction are
    computed at once (0: one); ``lanes``, those cells as one vector, the reads at positions
    ``packed`` (in :func:`~ocannl.ir.assignments.reads` order) packed into stack arrays
    first, those at positions ``transposed`` (a row sum's rows) loaded ``jam`` terms of each
    cell at a time and transposed in registers; ``conversion``, the group is a copy of
    scheduling's own between precisions (an f32 copy, a rounding back): no user cast, so a
    signalling NaN's payload need not survive it and the plain conversion instructions
    serve; ``flat``, every nest is pointwise and reads
    and writes each node at the point's own cell: one loop over the cells in row-major order
    (``split`` then counts cells), which vectorizes whatever the axes' extents;
    ``inner_vector``, a pointwise group walked point by point whose innermost loop is short:
    that loop is vectorized at this width and never unrolled (0: as the compiler sees fit);
    ``run``, a padded copy (im2col's patches) whose last ``run`` parallel iterators walk one
    run of cells contiguous in both its target and its read, the padding cutting that run at
    most into a middle read and zeros either side: each run is copied as such. On a GPU
    (``Target.gpu_block``), ``mapping``: ``"map"`` (a thread per cell, nothing to reduce),
    ``"serial"`` (a thread per cell, reducing in a loop: in order) or ``"reduce"`` (a block of
    threads per cell, each cell's terms cut into ``reduce_splits`` chunks of ``reduce_chunk``
    terms, whose partial results a second pass combines in chunk order), launched as ``grid``
    blocks of ``block`` threads; ``lane_store``: a vector of a jammed reduction's cells is
    stored as one vector (they lie side by side and nothing else stands in for the target),
    else cell by cell. ``row_sum`` (a CPU's only): the last nest is a lone row walk (one
    parallel iterator, ``walk_rows``) summing what the others, pointwise over its space in its
    points' order, write (a bias's gradient in the pass writing the activation's gradient): the
    loops are the row walk's, and each point runs the others' bodies, then adds its term into
    the row; each cell takes its terms in the row walk's order, so the same bits as the two
    passes apart."""

    nests: tuple[LoopNest, ...]
    registers: frozenset[int] = frozenset()
    split: int | None = None
    chunks: int = 0
    jam: int = 0
    lanes: bool = False
    packed: tuple[int, ...] = ()
    transposed: tuple[int, ...] = ()
    conversion: bool = False
    flat: bool = False
    inner_vector: int = 0
    run: int = 0
    mapping: str = ""
    reduce_splits: int = 0
    reduce_chunk: int = 0
    grid: int = 0
    block: int = 0
    lane_store: bool = False
    row_sum: bool = False

    @property
    def lead(self) -> LoopNest:
        return self.nests[0]


@dataclass(frozen=True)
class MatrixView:
    """A node read as a 2-D matrix ``rows x cols``; ``transposed``: stored as ``cols x rows``.
    ``ld``: the stride between consecutive stored rows (the stored row length when dense)."""

    node: Tnode
    rows: int
    cols: int
    transposed: bool
    ld: int


@dataclass(frozen=True)
class BatchAxis:
    """An iterator a batched product runs over: its size and its stride in the output and in
    each operand."""

    size: int
    out: int
    a: int
    b: int


@dataclass(frozen=True)
class Gemm:
    """``out (accum)= a @ b`` with ``out`` a ``rows x cols`` row-major view of ``assign.lhs``
    (rows ``out_ld`` apart), once per point of ``batch`` (none: one product).

    What scheduling decided: ``kernel``, ``"blas"`` (the library) or ``"inline"``
    (register-blocked loops summing each cell's terms in order, as the plain loops would);
    ``split``, how it is shared over threads (``"batch"``: by its first batch axis; ``"rows"``
    / ``"cols"``: by blocks of ``GEMM_BLOCK``) over ``split_extent`` points or blocks, or None;
    ``one_thread``, the library runs single-threaded (the routine shares products over the
    pool's threads, a part each), else with its own threads; ``strided``, on a GPU, the batch
    axes as (outer axes looped over, the one axis a strided-batched call covers: its axes
    folded into one stride where they can be), ``((), None)`` for one plain call; ``tf32``,
    an f32 product may round its operands to TF32 (tensor cores); ``swapped``, the inline
    kernel computes the transposed product ``out^T = b^T @ a^T``, its vectors along ``out``'s
    rows, each cell stored where ``out`` keeps it (columns that are no whole number of
    vectors, rows that are: a convolution's first kernel gradient, 8 output channels by 9
    window offsets); each cell the same sum in the same order; ``block``, the inline kernel's
    register block: output rows at a time by one vector of columns (of the swapped product).
    Its operands' and target's precisions are those of their nodes: a 16-bit one is taken as
    stored (the target's native products, or the inline kernel's right operand)."""

    assign: Accum
    a: MatrixView
    b: MatrixView
    rows: int
    cols: int
    inner: int
    out_ld: int
    batch: tuple[BatchAxis, ...] = ()
    kernel: str = "blas"
    split: str | None = None
    split_extent: int = 0
    one_thread: bool = False
    strided: tuple[tuple[BatchAxis, ...], BatchAxis | None] = ((), None)
    tf32: bool = False
    swapped: bool = False
    block: tuple[int, int] = (0, 0)


Lowered = Fill | LoopGroup | Gemm



def covers(a: Accum) -> bool:
    """True when the lhs projection visits every cell exactly once per reduction slice."""
    its = [i for i in a.lhs_idx if isinstance(i, int)]
    return (
        len(its) == len(a.lhs_idx)
        and len(set(its)) == len(its)
        and all(a.space[i] == d for i, d in zip(its, a.lhs.dims, strict=True))
    )



def parallel_iterators(a: Accum) -> tuple[int, ...]:
    """The iterators that pick distinct cells of ``a.lhs``, in its axis order: those indexing
    an lhs axis of more than one cell. An iterator that indexes only size-1 axes writes one cell
    from many points: it is a reduction, however the projection names it."""
    out: dict[int, None] = {}
    for i, d in zip(a.lhs_idx, a.lhs.dims, strict=True):
        if isinstance(i, int) and (d > 1 or a.space[i] == 1):
            out.setdefault(i)
    return tuple(out)


# A row of accumulators (``LoopNest.walk_rows``) holds at least and at most this many cells,
# and its reduction takes at least ROW_MIN terms.
ROW_MIN, ROW_MAX = 8, 4096


def _walks_rows(a: Accum, par: tuple[int, ...], red: tuple[int, ...], scatter: bool) -> bool:
    """Whether reading along the last parallel iterator beats reading along the reductions:
    some operand's last axis is that iterator and none's is a reduction iterator."""
    if scatter or not red or not par or a.accum not in ("+", "max"):
        return False
    last = par[-1]
    if not ROW_MIN <= a.space[last] <= ROW_MAX or math.prod(a.space[i] for i in red) < ROW_MIN:
        return False  # a short reduction (a 2x2 pooling window) gains less than the row costs
    ends = [g.idx[-1] for g in reads(a.expr) if g.idx]
    return last in ends and not any(isinstance(i, int) and i in red for i in ends)


def loop_nest(a: Accum) -> LoopNest:
    par = parallel_iterators(a)
    red = tuple(i for i in range(len(a.space)) if i not in par)
    scatter = any(isinstance(i, Affine) for i in a.lhs_idx)
    return LoopNest(a, par, red, scatter, _walks_rows(a, par, red, scatter))



@dataclass(frozen=True)
class Access:
    """What one item reads and writes: ``reads`` and ``writes``, node ids (a target that is
    accumulated into, not overwritten nor reset, is read too: a product's as a nest's);
    ``nodes``, every node it takes, each once, in order (a fill's node; a product's target then
    operands; each nest's target then its reads)."""

    reads: frozenset[int]
    writes: frozenset[int]
    nodes: tuple[Tnode, ...]

    @property
    def touched(self) -> frozenset[int]:
        return self.reads | self.writes


def access(item: Lowered) -> Access:
    """The :class:`Access` of one item: the one answer to "what does this item read and
    write", which :class:`AccessIndex` gathers for a routine and passes that rewrite the code as
    they go ask of each item."""
    if isinstance(item, Fill):
        return Access(frozenset(), frozenset((item.node.id,)), (item.node,))
    if isinstance(item, Gemm):
        a = item.assign
        found = {n.id: n for n in (a.lhs, item.a.node, item.b.node)}
        got = {item.a.node.id, item.b.node.id} | (set() if a.reset else {a.lhs.id})
        return Access(frozenset(got), frozenset((a.lhs.id,)), tuple(found.values()))
    read: set[int] = set()
    write: set[int] = set()
    taken: dict[int, Tnode] = {}
    for nest in item.nests:
        a = nest.assign
        taken.setdefault(a.lhs.id, a.lhs)
        for g in reads(a.expr):
            read.add(g.node.id)
            taken.setdefault(g.node.id, g.node)
        if not (a.accum == "=" or a.reset):
            read.add(a.lhs.id)
        write.add(a.lhs.id)
    return Access(frozenset(read), frozenset(write), tuple(taken.values()))


def stored_in(item: Lowered) -> list[Tnode]:
    """The nodes an item's code takes buffers of: those it reads or writes (in
    :attr:`Access.nodes` order), but those its group hands over in registers (they have no
    memory)."""
    held = item.registers if isinstance(item, LoopGroup) else frozenset()
    return [n for n in access(item).nodes if n.id not in held]


class AccessIndex:
    """Who reads and writes what in a routine's code, built once: per item its
    :class:`Access` (``items[k]``), and per node id the items that read it (``readers``), write
    it (``writers``) and take it (``users``), each in order. A pass that rewrites the code as it
    goes asks :func:`access` of the items it makes instead."""

    def __init__(self, code: list[Lowered]) -> None:
        self.code = code
        self.items = [access(item) for item in code]
        self.readers: dict[int, list[int]] = {}
        self.writers: dict[int, list[int]] = {}
        self.users: dict[int, list[int]] = {}
        for k, acc in enumerate(self.items):
            for i in acc.reads:
                self.readers.setdefault(i, []).append(k)
            for i in acc.writes:
                self.writers.setdefault(i, []).append(k)
            for n in acc.nodes:
                self.users.setdefault(n.id, []).append(k)

    def span(self, node_id: int) -> tuple[int, int]:
        """The first and the last item taking the node."""
        used = self.users[node_id]
        return used[0], used[-1]


def batch_offsets(batch: tuple[BatchAxis, ...]) -> list[tuple[int, int, int]]:
    """The (output, a, b) offsets of a batched product's products, one per point of its batch
    axes, the first axis outermost (``((0, 0, 0),)`` for no axis)."""
    out = [(0, 0, 0)]
    for axis in batch:
        out = [(o + k * axis.out, a + k * axis.a, b + k * axis.b)
               for o, a, b in out for k in range(axis.size)]
    return out


def stored_nodes(code: list[Lowered]) -> list[Tnode]:
    """The nodes the code keeps in memory, in first-use order: all it touches but those its
    loop groups hand over in registers (``LoopGroup.registers``), which get no memory."""
    held = {i for item in code if isinstance(item, LoopGroup) for i in item.registers}
    return [n for n in nodes_of(code) if n.id not in held]


def copy_source(nest: LoopNest) -> Tnode | None:
    """The node ``nest`` copies into its target cell for cell (``b = a``: pointwise, whole,
    the same dims and projection), or None. The precisions may differ (a cast)."""
    a = nest.assign
    if (nest.red or nest.scatter or not isinstance(a.expr, Get) or a.expr.idx != a.lhs_idx
            or a.expr.rounded is not None or not (a.accum == "=" or a.reset)
            or a.expr.node.dims != a.lhs.dims or not covers(a)):
        return None
    return a.expr.node


def nests(code: list[Lowered]) -> list[LoopNest]:
    """Every loop nest of lowered code, in order."""
    return [n for item in code if isinstance(item, LoopGroup) for n in item.nests]


def assignments(code: list[Lowered]) -> list[Fill | Accum]:
    """Every fill and assignment of ``code``, in order (a loop group's nests in turn)."""
    return [a for a, _ in _assigns_and_cells(code)]


def _assigns_and_cells(code: list[Lowered]) -> list[tuple[Fill | Accum, int]]:
    """Every fill and assignment of the code, in order, each with how many distinct cells a
    gather writes (``LoopNest.gather``: its parallel iterators' points), else 0."""
    out: list[tuple[Fill | Accum, int]] = []
    for it in code:
        if isinstance(it, LoopGroup):
            out.extend((n.assign, n.par_size if n.gather else 0) for n in it.nests)
        else:
            out.append((it if isinstance(it, Fill) else it.assign, 0))
    return out


def nodes_of(code: list[Lowered]) -> list[Tnode]:
    """Every node the lowered code touches, in first-use order (each written node before
    what its assignment reads)."""
    seen: dict[int, Tnode] = {}
    for a in assignments(code):
        if isinstance(a, Fill):
            seen.setdefault(a.node.id, a.node)
        else:
            seen.setdefault(a.lhs.id, a.lhs)
            for g in reads(a.expr):
                seen.setdefault(g.node.id, g.node)
    return list(seen.values())


@dataclass(frozen=True)
class Effects:
    """What running lowered code needs and leaves: ``inputs``, the nodes it reads before
    writing them whole (their values must come from somewhere), and ``written``, every node it
    writes."""

    inputs: tuple[Tnode, ...]
    written: tuple[Tnode, ...]


def effects(code: list[Lowered]) -> Effects:
    """The :class:`Effects` of lowered code, in first-use order."""
    whole: set[int] = set()
    inputs: dict[int, Tnode] = {}
    written: dict[int, Tnode] = {}

    def read(n: Tnode) -> None:
        if n.id not in whole:
            inputs.setdefault(n.id, n)

    gathered: dict[int, int] = {}  # node id -> the cells resetting gathers wrote so far
    for a, cells in _assigns_and_cells(code):
        if isinstance(a, Fill):
            whole.add(a.node.id)
            written.setdefault(a.node.id, a.node)
            continue
        for g in reads(a.expr):
            read(g.node)
        overwrites = a.accum == "=" or a.reset
        if not overwrites:
            read(a.lhs)
        if overwrites and covers(a):
            whole.add(a.lhs.id)
        elif overwrites and cells:  # a strided target's phases: together, every cell once
            gathered[a.lhs.id] = gathered.get(a.lhs.id, 0) + cells
            if gathered[a.lhs.id] >= a.lhs.size:
                whole.add(a.lhs.id)
        written.setdefault(a.lhs.id, a.lhs)
    return Effects(tuple(inputs.values()), tuple(written.values()))


def renamed_reads(e: Expr, nodes: dict[int, Tnode]) -> Expr:
    """``e`` reading ``nodes[i]`` wherever it read the node of id ``i``."""
    return rewrite_reads(e, lambda g: Get(nodes[g.node.id], g.idx, g.rounded)
                         if g.node.id in nodes else g)


def renamed_item(item: Lowered, nodes: dict[int, Tnode]) -> Lowered:
    """``item`` reading ``nodes[i]`` wherever it read the node of id ``i`` (its writes
    unchanged); the item itself where it reads none of them."""
    if isinstance(item, LoopGroup):
        nests = tuple(renamed_nest(n, nodes) for n in item.nests)
        return item if all(a is b for a, b in zip(nests, item.nests, strict=True)) \
            else replace(item, nests=nests)
    if isinstance(item, Gemm):
        a = replace(item.a, node=nodes.get(item.a.node.id, item.a.node))
        b = replace(item.b, node=nodes.get(item.b.node.id, item.b.node))
        return replace(item, a=a, b=b, assign=replace(item.assign, expr=renamed_reads(
            item.assign.expr, nodes)))
    return item


def renamed_nest(n: LoopNest, nodes: dict[int, Tnode]) -> LoopNest:
    """A loop nest reading ``nodes[i]`` wherever it read the node of id ``i``."""
    expr = renamed_reads(n.assign.expr, nodes)
    return n if expr is n.assign.expr else replace(n, assign=replace(n.assign, expr=expr))
