"""C's spelling of the renderer core: loop-nest bodies as lines of C.

:class:`CSpelling` gives the renderer core (``ocannl.backends.core``: offsets, padded reads,
expressions, accumulations, a nest's cases) its words in C, the op table's rows as
:data:`C_TEMPLATES`; a C-family language (CUDA C, ``ocannl.backends.cuda.plan``) adds its
conversions and literals and wraps the bodies in threads. The CPU's spelling is LLVM IR
(``ocannl.backends.cpu.codegen``, its ops in ``ocannl.backends.cpu.op_builders``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ocannl.backends import core
from ocannl.ir.lowered import LoopNest
from ocannl.ir.ops import HASH_BITS, HASH_G, Precision
from ocannl.ir.tnode import Tnode

# --- the C spelling of every op, by the op table's row name ------------------------------------
#
# A template is one C expression: ``{0}``, ``{1}``, ``{2}`` stand for the already-rendered
# operands, ``{zero}`` and ``{one}`` for literals of the computation's precision, so f32 code
# stays f32. Written so that NaN and infinities propagate the way PyTorch's ops do (``relu(nan)``
# is ``nan``). The CPU renderer's spelling is ``ocannl.backends.cpu.op_builders.BUILDERS``;
# ``tests/backends/test_op_spellings.py`` checks both have exactly the op table's rows.

_M = f"{(1 << HASH_BITS) - 1:#x}"


def _u_c(k: int) -> str:
    """Operand ``k`` truncated to an unsigned integer; 0 for a negative, non-finite or >= 2**53
    one (no operand is undefined behaviour). See ``ocannl.ir.ops.HASH_BITS``."""
    x = "{" + str(k) + "}"
    return f"(({x} >= 0 && {x} < 9007199254740992.0f) ? (unsigned long long)({x}) : 0ULL)"


C_TEMPLATES: dict[str, str] = {
    # binary
    "add": "({0} + {1})",
    "sub": "({0} - {1})",
    "mul": "({0} * {1})",
    "div": "({0} / {1})",
    "pow": "pow({0}, {1})",
    "max": "(({0} >= {1} || {0} != {0}) ? {0} : {1})",
    "eq": "(({0} == {1}) ? {one} : {zero})",
    "gt": "(({0} > {1}) ? {one} : {zero})",
    # unary
    "neg": "(-{0})",
    "relu": "(({0} < {zero}) ? {zero} : {0})",
    "exp": "exp({0})",
    "log": "log({0})",
    "tanh": "tanh({0})",
    "sigmoid": "({one} / ({one} + exp(-{0})))",
    "sqrt": "sqrt({0})",
    "isfinite": "(isfinite({0}) ? {one} : {zero})",
    # ternary: where(cond != 0, a, b); a select, never a multiply (inf * 0 is nan)
    "where": "(({0} != {zero}) ? {1} : {2})",
    # comparisons beyond eq / gt: 0 or 1 (false against NaN, but ne)
    "lt": "(({0} < {1}) ? {one} : {zero})",
    "le": "(({0} <= {1}) ? {one} : {zero})",
    "ge": "(({0} >= {1}) ? {one} : {zero})",
    "ne": "(({0} != {1}) ? {one} : {zero})",
    # minimum mirrors max: a NaN on either side propagates (torch.minimum)
    "min": "(({0} <= {1} || {0} != {0}) ? {0} : {1})",
    "abs": "fabs({0})",
    "erf": "erf({0})",
    # CUDA's
    "cos": "cos({0})",
    "sin": "sin({0})",
    "floor": "floor({0})",
    # integer hashing for counter-based random draws; a template is a single expression and
    # a CUDA C kernel may hold no lambda (NVRTC treats one as host code), so the emitter binds
    # an operand used several times to a local
    "hash_add": f"({{one}} * (({_u_c(0)} + ({_u_c(1)} + 1ULL) * {HASH_G:#x}ULL) & {_M}ULL))",
    "hash_xsm": (f"({{one}} * ((({_u_c(0)} ^ ({_u_c(0)} >> ({_u_c(1)} & 63ULL))) * {_u_c(2)}) "
                 f"& {_M}ULL))"),
    "hash_unit": f"(({{one}} * ({_u_c(0)} >> {HASH_BITS - 24})) / 16777216)",
}


class CSpelling:
    """C's words for the renderer core (``ocannl.backends.core.Spelling``): values are C
    expressions, statements lines of text. A language of the C family (CUDA C) gives the
    16-bit conversions (``widen``, ``narrow``), literals and declarations; buffers are named
    by position (``b0``, ``b1``...), so the same code over other nodes is the same source.

    One nest's body is rendered into three lists of lines (:class:`NestBody`): those before
    its reduction loops (``init``), inside them (``inner``) and after (``final``); a nest with
    no reduction loops puts every line in ``inner``. ``registers``: the nodes handed over in
    locals (``LoopGroup.registers``), by id: the local's name, holding the value a load would
    give (a 16-bit node's rounded, then widened)."""

    templates: dict[str, str] = C_TEMPLATES
    widen: dict[Precision, str]
    narrow: dict[Precision, str]
    cell = None  # no ``flat`` groups: a GPU's threads take cells as they come

    def __init__(self, nodes: list[Tnode], registers: dict[int, str] | None = None) -> None:
        self.names = {n.id: f"b{k}" for k, n in enumerate(nodes)}
        self.registers = registers or {}
        self.lines: list[str] = []
        self.init: list[str] | None = None  # set once the reduction loops are rendered
        self.inner: list[str] = []
        self._n = 0

    def buffer(self, node: Tnode) -> str:
        return self.names[node.id]

    # Per language: literals, declarations, the 16-bit conversions.
    def literal(self, value: float, compute: Precision) -> str:
        raise NotImplementedError

    def declare(self, name: str, value: str, compute: Precision) -> str:
        raise NotImplementedError

    def convert(self, ref: str, node: Tnode, compute: Precision) -> str:
        """A loaded value in ``compute`` (a language may need a cast)."""
        return ref

    # -- integers --

    def index(self, n: int) -> str:
        return str(n)

    def index_add(self, a: str, b: str) -> str:
        return b if a == "0" else a if b == "0" else f"{a} + {b}"

    def index_scale(self, a: str, c: int) -> str:
        if c == 1:
            return a
        return f"{c} * {a}" if _is_name(a) else f"{c} * ({a})"

    def dynamic(self, node: Tnode) -> str:
        return f"((long long)({self.buffer(node)}[0]))"

    def at_least_zero(self, a: str) -> str:
        return f"{a} >= 0"

    def below(self, a: str, n: int) -> str:
        return f"{a} < {n}"

    def both(self, a: str, b: str) -> str:
        return f"{a} && {b}"

    # -- values --

    def held(self, node: Tnode) -> str | None:
        return self.registers.get(node.id)

    def read(self, node: Tnode, off: str, compute: Precision) -> str:
        ref = f"{self.buffer(node)}[{off}]"
        ref = f"{self.widen[node.prec]}({ref})" if node.prec.is_narrow else ref
        return self.convert(ref, node, compute)

    def rounded(self, value: str, source: Tnode, prec: Precision) -> str:
        """``value`` rounded to a 16-bit precision as a store would round it, widened back as
        a load would (a read of a virtual node through its source: ``Get.rounded``)."""
        return f"{self.widen[prec]}({self.narrow[prec]}({value}))"

    def pad(self, cond: str, value: str, compute: Precision) -> str:
        """Only the chosen branch of C's conditional runs: the read outside is never made."""
        return f"(({cond}) ? {value} : {self.literal(0.0, compute)})"

    def guard_offset(self, cond: str, off: str) -> str:
        return off

    def op(self, name: str, compute: Precision, args: list[str]) -> str:
        """The op's template over its operands; an operand it uses twice is bound to a local
        first (evaluated once: a template is one expression)."""
        template = self.templates[name]
        for k, a in enumerate(args):
            if template.count("{" + str(k) + "}") > 1 and not _is_name(a):
                args[k] = self.to_local(a, compute)
        lit = self.literal
        return template.format(*args, zero=lit(0.0, compute), one=lit(1.0, compute))

    def any_order_add(self, acc: str, value: str, compute: Precision) -> str:
        return self.op("add", compute, [acc, value])

    def to_local(self, value: str, compute: Precision) -> str:
        name = f"t{self._n}"
        self._n += 1
        self.lines.append(self.declare(name, value, compute))
        return name

    # -- statements --

    def store_text(self, node: Tnode, off: str, value: str, exact: bool = False) -> str:
        """``node[off] = value``: rounded once into a 16-bit node (an ``exact`` store,
        ``LoopNest.exact_store``, has rounding's bits: C's rounding conversion serves it);
        into a register, the value a load would give (an exact value: itself)."""
        if node.id in self.registers:
            held = self.rounded(value, node, node.prec) \
                if node.prec.is_narrow and not exact else value
            return f"{self.registers[node.id]} = {held};"
        if node.prec.is_narrow:
            value = f"{self.narrow[node.prec]}({value})"
        return f"{self.buffer(node)}[{off}] = {value};"

    def store(self, node: Tnode, off: str, value: str, exact: bool) -> None:
        self.lines.append(self.store_text(node, off, value, exact))

    def accumulator(self, value: str, compute: Precision) -> str:
        self.lines.append(self.declare("acc", value, compute))
        return "acc"

    def get(self, acc: str) -> str:
        return acc

    def set(self, acc: str, value: str) -> None:
        self.lines.append(f"{acc} = {value};")

    def over(self, nest: LoopNest, iters: dict[int, str], body: Callable[[], None]) -> None:
        """The body's lines go inside the reduction loops (the kernel writes the loops)."""
        self.init, self.lines = self.lines, []
        body()
        self.inner, self.lines = self.lines, []

    def when(self, cond: str, body: Callable[[], None]) -> None:
        outer, self.lines = self.lines, []
        body()
        inside, self.lines = self.lines, outer
        self.lines.append(f"if ({cond}) {{ {' '.join(inside)} }}")

    def body(self) -> NestBody:
        """The lines rendered so far, by where they go."""
        if self.init is None:
            return NestBody([], self.lines, [])
        return NestBody(self.init, self.inner, self.lines)


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


def nest_body(nest: LoopNest, spelling: CSpelling, iters: dict[int, str]) -> NestBody:
    """``lhs (accum)= expr`` at the point named by ``iters``, by the renderer core
    (``core.nest``), as lines of C."""
    core.nest(spelling, nest, iters)
    return spelling.body()


def float_literal(value: float) -> str:
    """A float literal both Python and C read back exactly (17 significant digits)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(float(value))
