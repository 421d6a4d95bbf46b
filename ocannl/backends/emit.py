"""C-like code emission: expressions, offsets, accumulation, literals of loop-nest bodies.

A :class:`Flavour` says how the target language spells a literal, a buffer load and a buffer
store, and which op templates it uses; this module renders the lowered loop-nest bodies with
it. The CUDA backend wraps those bodies in threads; the CPU backend builds LLVM IR instead
(:mod:`ocannl.backends.cpu.codegen`), with the same cases. (A flavour is a language's
spelling: C for CUDA; the CPU's own is LLVM IR, built elsewhere.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ocannl.ir.assignments import Affine, Apply, Const, Dynamic, Expr, Fixed, Get, Projection
from ocannl.ir.lowered import LoopNest
from ocannl.ir.ops import ACCUMS, OPS, Precision
from ocannl.ir.tnode import Tnode

_ACCUM_OPS = {"+": "add", "max": "max"}


class Flavour:
    """How one target language spells the pieces of a loop body."""

    name: str  # key of the op templates: "py" or "c"

    def __init__(self, nodes: list[Tnode], registers: dict[int, str] | None = None) -> None:
        # Buffers are named by position, so the same code over other nodes is the same source.
        self.names = {n.id: f"b{k}" for k, n in enumerate(nodes)}
        # Nodes handed over in locals (``LoopGroup.registers``), by id: the local's name. It
        # holds the value a load would give (a 16-bit node's rounded, then widened).
        self.registers = registers or {}

    def buffer(self, node: Tnode) -> str:
        return self.names[node.id]

    # Per language: the functions converting 16-bit storage to f32 and back, the statement end.
    widen: dict[Precision, str]
    narrow: dict[Precision, str]
    end: str = ""

    def literal(self, value: float, compute: Precision) -> str:
        raise NotImplementedError

    def load(self, node: Tnode, offset: str) -> str:
        if node.id in self.registers:
            return self.registers[node.id]
        ref = f"{self.buffer(node)}[{offset}]"
        return f"{self.widen[node.prec]}({ref})" if node.prec.is_narrow else ref

    def rounded(self, value: str, prec: Precision) -> str:
        """``value`` rounded to a 16-bit precision as a store would round it, widened back as
        a load would (a read of a virtual node through its source: ``Get.rounded``)."""
        return f"{self.widen[prec]}({self.narrow[prec]}({value}))"

    def store(self, node: Tnode, offset: str, value: str) -> str:
        if node.id in self.registers:
            held = self.rounded(value, node.prec) if node.prec.is_narrow else value
            return f"{self.registers[node.id]} = {held}{self.end}"
        if node.prec.is_narrow:
            value = f"{self.narrow[node.prec]}({value})"
        return f"{self.buffer(node)}[{offset}] = {value}{self.end}"

    def declare(self, name: str, value: str, compute: Precision) -> str:
        """A statement binding a fresh local to a value."""
        raise NotImplementedError

    def assign(self, name: str, value: str) -> str:
        return f"{name} = {value}{self.end}"

    # Per language: a conditional expression (only the chosen branch is evaluated), a
    # conjunction, and a statement run only when a condition holds.
    def select(self, cond: str, then: str, other: str) -> str:
        raise NotImplementedError

    conj: str

    def guarded(self, cond: str, statement: str) -> str:
        raise NotImplementedError


def _affine(a: Affine, iters: dict[int, str]) -> str:
    terms = [iters[i] if c == 1 else f"{c} * {iters[i]}" for c, i in a.terms if c]
    if a.offset or not terms:
        terms.append(str(a.offset))
    return "(" + " + ".join(terms).replace("+ -", "- ") + ")"


def offset(node: Tnode, idx: Projection, iters: dict[int, str],
           buffer: Callable[[Tnode], str] | None = None) -> str:
    """The flat row-major offset of ``node[idx]`` as an expression over loop variables
    (``buffer`` names a dynamic index's node, whose value is read when the code runs)."""
    terms: list[str] = []
    const = 0
    for i, stride, dim in zip(idx, node.strides, node.dims, strict=True):
        if isinstance(i, Dynamic):
            if buffer is None:
                raise ValueError(f"a dynamic index into {node.name} needs its node's buffer")
            at = f"((long long)({buffer(i.node)}[0]))"
            terms.append(at if stride == 1 else f"{at} * {stride}")
        elif isinstance(i, Fixed):
            const += i.pos * stride
        elif dim == 1:
            continue  # in bounds, the position is 0 (out of bounds, nothing is accessed)
        else:
            at = _affine(i, iters) if isinstance(i, Affine) else iters[i]
            terms.append(at if stride == 1 else f"{at} * {stride}")
    if const or not terms:
        terms.append(str(const))
    return " + ".join(terms)


def in_bounds(node: Tnode, idx: Projection, space: tuple[int, ...],
              iters: dict[int, str]) -> list[str]:
    """Conditions under which every affine index of ``node[idx]`` is inside its axis, leaving
    out those that hold over the whole product space (no padding there)."""
    conds = []
    for i, dim in zip(idx, node.dims, strict=True):
        if isinstance(i, Affine):
            lo, hi = i.bounds(space)
            at = _affine(i, iters)
            if lo < 0:
                conds.append(f"{at} >= 0")
            if hi >= dim:
                conds.append(f"{at} < {dim}")
    return conds


@dataclass
class BodyWriter:
    """Renders expressions of one loop nest into statements and a final value expression."""

    flavour: Flavour
    compute: Precision
    iters: dict[int, str]
    space: tuple[int, ...]
    lines: list[str] = field(default_factory=list)
    _n: int = 0

    def to_local(self, value: str) -> str:
        """Bind ``value`` to a new local and return its name (for an operand used twice)."""
        name = f"t{self._n}"
        self._n += 1
        self.lines.append(self.flavour.declare(name, value, self.compute))
        return name

    def expr(self, e: Expr) -> str:
        if isinstance(e, Const):
            return self.flavour.literal(e.value, self.compute)
        if isinstance(e, Get):
            value = self.load(e.node, e.idx)
            return value if e.rounded is None else self.flavour.rounded(value, e.rounded)
        assert isinstance(e, Apply)
        template = getattr(OPS[e.op], self.flavour.name)
        args = []
        for k, a in enumerate(e.args):
            s = self.expr(a)
            if template.count("{" + str(k) + "}") > 1 and not _is_name(s):
                s = self.to_local(s)
            args.append(s)
        return self.fill(template, args)

    def load(self, node: Tnode, idx: Projection) -> str:
        """``node[idx]``, or 0 where an affine index falls outside the node (padding)."""
        value = self.flavour.load(node, offset(node, idx, self.iters, self.flavour.buffer))
        conds = in_bounds(node, idx, self.space, self.iters)
        if not conds:
            return value
        return self.flavour.select(self.flavour.conj.join(conds), value,
                                   self.flavour.literal(0.0, self.compute))

    def fill(self, template: str, args: list[str]) -> str:
        lit = self.flavour.literal
        return template.format(*args, zero=lit(0.0, self.compute), one=lit(1.0, self.compute))

    def combine(self, accum: str, old: str, new: str) -> str:
        """``old (accum) new``: the accumulation as an op-table application."""
        template = getattr(OPS[_ACCUM_OPS[accum]], self.flavour.name)
        if template.count("{0}") > 1 and not _is_name(old):
            old = self.to_local(old)
        if template.count("{1}") > 1 and not _is_name(new):
            new = self.to_local(new)
        return self.fill(template, [old, new])

    def neutral(self, accum: str) -> str:
        v = ACCUMS[accum]
        return self.flavour.literal(0.0 if v is None else v, self.compute)


def _is_name(s: str) -> bool:
    """Whether a rendered operand is a plain name or number, cheap and safe to repeat."""
    return s.replace("_", "").isalnum()


@dataclass
class NestBody:
    """The statements of one loop nest, by where they go: ``init`` inside the parallel loops
    before the reduction loops, ``inner`` inside all loops, ``final`` after the reduction loops."""

    init: list[str]
    inner: list[str]
    final: list[str]


def nest_body(nest: LoopNest, flavour: Flavour, iters: dict[int, str]) -> NestBody:
    """Render ``lhs (accum)= expr``: a reduction accumulates in a local, stored once; a
    scatter combines into its (moving) cell at every point, skipping cells outside the node."""
    a, has_reduction = nest.assign, bool(nest.red)
    compute = a.lhs.prec.compute
    w = BodyWriter(flavour, compute, iters, a.space)
    off = offset(a.lhs, a.lhs_idx, iters)
    value = w.expr(a.expr)
    if nest.scatter:
        new = value if a.accum == "=" else w.combine(a.accum, w.load(a.lhs, a.lhs_idx), value)
        store = flavour.store(a.lhs, off, new)
        conds = in_bounds(a.lhs, a.lhs_idx, a.space, iters)
        w.lines.append(flavour.guarded(flavour.conj.join(conds), store) if conds else store)
        return NestBody([], w.lines, [])
    if a.accum == "=" or (a.reset and not has_reduction):
        w.lines.append(flavour.store(a.lhs, off, value))
        return NestBody([], w.lines, [])
    if not has_reduction:
        combined = w.combine(a.accum, flavour.load(a.lhs, off), value)
        w.lines.append(flavour.store(a.lhs, off, combined))
        return NestBody([], w.lines, [])
    w.lines.append(flavour.assign("acc", w.combine(a.accum, "acc", value)))
    inner, w.lines = w.lines, []
    init = [flavour.declare("acc", w.neutral(a.accum), compute)]
    result = "acc" if a.reset else w.combine(a.accum, flavour.load(a.lhs, off), "acc")
    w.lines.append(flavour.store(a.lhs, off, result))
    return NestBody(init, inner, w.lines)


def float_literal(value: float) -> str:
    """A float literal both Python and C read back exactly (17 significant digits)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(float(value))
