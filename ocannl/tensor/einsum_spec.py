"""A pure parser for upstream OCANNL's einsum / shape-spec grammar.

It builds only the syntax: which axes each row names, where its row variable sits, and which
convolution or concatenation an axis spells. Shape inference reads these structures; keeping the
grammar here (no tensors, no NumPy) lets it be tested and reused on its own.

Grammar (upstream ``tensor/shape.mli``; see the project's ``shared/ocannl-shapes/README.md`` §2)::

    einsum_spec := labels_spec (';' labels_spec)* '=>' labels_spec
    labels_spec := row | row '|' row | row '->' row | row '|' row '->' row
    row         := axes | axes ellipsis axes              -- at most one row variable
    ellipsis    := '...' | '..' ident '..'
    axis        := ident | '_' | int | conv | strided | ident '^' ident ('^' ident)*
    conv        := [int '*'] ident ['=' | '<'] ['+' int] '+' [int '*'] ident
    strided     := int '*' ident ['+' int]

A spec is *multichar* iff it holds any of ``, * + ^ & <`` or an ``=`` not followed by ``>``.
Then axes are comma-separated identifiers; otherwise every letter is one axis and a run of
digits one fixed index.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Label:
    """A named axis (``i``, ``oh``): axes sharing a name in one spec share a dimension."""

    name: str


@dataclass(frozen=True)
class FixedIndex:
    """A number in a slot: the axis is read (or written) at that one index only."""

    index: int


@dataclass(frozen=True)
class Placeholder:
    """``_``: an axis that takes part in no equation, only keeps the others aligned."""


@dataclass(frozen=True)
class Conv:
    """An affine axis ``stride*over [=|<] [+offset] + dilation*kernel``, or ``stride*over
    [+offset]`` when ``kernel`` is None (a strided axis).

    ``use_padding`` is True for ``=``, False for ``<`` and None for a bare ``+``: upstream
    accepts the bare form only where its ppx supplies a default, so the caller decides.
    """

    over: str
    stride: int = 1
    kernel: str | None = None
    dilation: int = 1
    use_padding: bool | None = None
    offset: int = 0


@dataclass(frozen=True)
class Concat:
    """``a^b^c``: one axis that runs over ``a``, then ``b``, then ``c``."""

    parts: tuple[str, ...]


Axis = Label | FixedIndex | Placeholder | Conv | Concat

ROW_KINDS = ("batch", "input", "output")


@dataclass(frozen=True)
class RowSpec:
    """One row: ``beg`` is anchored on the left, ``dims`` on the right, and the row variable
    ``var`` (if any) absorbs the axes in between. Without a variable the row has exactly
    ``dims``; ``...`` is named ``'...batch'`` / ``'...input'`` / ``'...output'`` by its row."""

    beg: tuple[Axis, ...] = ()
    var: str | None = None
    dims: tuple[Axis, ...] = ()

    @property
    def axes(self) -> tuple[Axis, ...]:
        """The written axes in order, with the row variable's place left out."""
        return self.beg + self.dims


@dataclass(frozen=True)
class OperandSpec:
    """``batch|input->output``; a row not written is empty (no axes, no row variable)."""

    batch: RowSpec = RowSpec()
    input: RowSpec = RowSpec()
    output: RowSpec = RowSpec()

    @property
    def rows(self) -> tuple[RowSpec, RowSpec, RowSpec]:
        """The rows in the order batch, input, output (the order of ``ROW_KINDS``)."""
        return (self.batch, self.input, self.output)

    def labels(self) -> tuple[str, ...]:
        """Every dimension label named here (conv and concat parts too), first use first."""
        return _unique(name for row in self.rows for axis in row.axes for name in _names(axis))

    def row_vars(self) -> tuple[str, ...]:
        """Every row variable named here, first use first."""
        return _unique(row.var for row in self.rows if row.var is not None)


@dataclass(frozen=True)
class EinsumSpec:
    """A parsed ``"rhs1;rhs2;...=>lhs"``: the operands are read, the result is written."""

    text: str
    operands: tuple[OperandSpec, ...]
    result: OperandSpec
    multichar: bool

    @property
    def specs(self) -> tuple[OperandSpec, ...]:
        """The operands followed by the result."""
        return (*self.operands, self.result)

    def labels(self) -> tuple[str, ...]:
        """Every dimension label of the spec, first use first."""
        return _unique(name for spec in self.specs for name in spec.labels())

    def row_vars(self) -> tuple[str, ...]:
        """Every row variable of the spec, first use first."""
        return _unique(var for spec in self.specs for var in spec.row_vars())


def _names(axis: Axis) -> tuple[str, ...]:
    """The dimension labels an axis mentions."""
    if isinstance(axis, Label):
        return (axis.name,)
    if isinstance(axis, Conv):
        return (axis.over,) if axis.kernel is None else (axis.over, axis.kernel)
    if isinstance(axis, Concat):
        return axis.parts
    return ()


def _unique(names: Iterable[str]) -> tuple[str, ...]:
    """Drop repeats, keep first-use order (names are few, so the order is the useful part)."""
    return tuple(dict.fromkeys(names))


def is_multichar(spec: str) -> bool:
    """Upstream's mode switch: any of ``, * + ^ & <``, or an ``=`` that does not start ``=>``."""
    if any(c in spec for c in ",*+^&<"):
        return True
    return any(c == "=" and spec[i + 1 : i + 2] != ">" for i, c in enumerate(spec))


# ---------------------------------------------------------------------------------------------
# Tokens

_COMMON = r"(?P<ws>[ \t\r\n]+)|(?P<ellipsis>\.\.\.)|(?P<dotdot>\.\.)|(?P<arrow>->)|(?P<darrow>=>)"
_TOKEN_RE = {
    True: re.compile(
        _COMMON + r"|(?P<int>[0-9]+)|(?P<ident>[A-Za-z][A-Za-z0-9_]*)|(?P<punct>[,|;+*^=<_])"
    ),
    False: re.compile(_COMMON + r"|(?P<int>[0-9]+)|(?P<ident>[A-Za-z])|(?P<punct>[|;_])"),
}
_KIND = {"ellipsis": "...", "dotdot": "..", "arrow": "->", "darrow": "=>"}


class _Tok(NamedTuple):
    kind: str  # 'int', 'ident', 'end', or the token's own text for punctuation
    text: str
    pos: int


def _tokenize(spec: str, multichar: bool) -> list[_Tok]:
    pattern, toks, pos = _TOKEN_RE[multichar], [], 0
    while pos < len(spec):
        m = pattern.match(spec, pos)
        if m is None:
            c = spec[pos]
            why = "'&' is reserved" if c == "&" else f"unexpected character {c!r}"
            mode = "multichar" if multichar else "single-char"
            raise ValueError(f"{why} ({mode} mode) at offset {pos} in spec: {spec}")
        group = m.lastgroup
        if group != "ws":
            kind = _KIND.get(group, m.group() if group == "punct" else group)
            toks.append(_Tok(kind, m.group(), pos))
        pos = m.end()
    toks.append(_Tok("end", "", len(spec)))
    return toks


# ---------------------------------------------------------------------------------------------
# Recursive descent

_ROW_END = frozenset({"|", "->", ";", "=>", "end"})
# Which rows a labels spec wrote, by its separators: no '|' and no '->' means all output.
_ROW_LAYOUT = {(): ("output",), ("|",): ("batch", "output"), ("->",): ("input", "output")}


def _row_spec(kind: str, beg: tuple[Axis, ...], var: str | None, dims: tuple[Axis, ...]) -> RowSpec:
    """Name a bare ``...`` by its row, so ``...`` in two batch rows is one variable."""
    return RowSpec(beg, "..." + kind if var == "..." else var, dims)


class _Parser:
    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.multichar = is_multichar(spec)
        self.toks = _tokenize(spec, self.multichar)
        self.i = 0

    # -- helpers
    def peek(self, ahead: int = 0) -> _Tok:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def next(self) -> _Tok:
        tok = self.peek()
        self.i += 1
        return tok

    def fail(self, why: str, tok: _Tok | None = None) -> ValueError:
        tok = tok or self.peek()
        return ValueError(f"{why} at offset {tok.pos} in spec: {self.spec}")

    def expect(self, kind: str, what: str) -> _Tok:
        if self.peek().kind != kind:
            tok = self.peek()
            found = "the end" if tok.kind == "end" else repr(tok.text)
            raise self.fail(f"expected {what}, found {found}")
        return self.next()

    # -- grammar
    def einsum(self) -> EinsumSpec:
        operands = [self.operand()]
        while self.peek().kind == ";":
            self.next()
            operands.append(self.operand())
        if self.peek().kind != "=>":
            raise self.fail("missing '=>' (an einsum spec is 'rhs1;rhs2=>lhs')")
        self.next()
        result = self.operand()
        tok = self.peek()
        if tok.kind == "=>":
            raise self.fail("more than one '=>'")
        if tok.kind == ";":
            raise self.fail("';' after '=>' (the result is one operand)")
        return EinsumSpec(self.spec, tuple(operands), result, self.multichar)

    def lone_operand(self) -> OperandSpec:
        spec = self.operand()
        if self.peek().kind != "end":
            raise self.fail(f"unexpected {self.peek().text!r} in a single labels spec")
        return spec

    def operand(self) -> OperandSpec:
        rows, seps = [self.row()], []
        while self.peek().kind in ("|", "->"):
            sep = self.next()
            if sep.kind in seps:
                raise self.fail(f"more than one {sep.text!r}", sep)
            if sep.kind == "|" and seps:
                raise self.fail("'|' after '->' (write batch|input->output)", sep)
            seps.append(sep.kind)
            rows.append(self.row())
        layout = _ROW_LAYOUT.get(tuple(seps), ROW_KINDS)
        named = zip(layout, rows, strict=True)
        return OperandSpec(**{kind: _row_spec(kind, *row) for kind, row in named})

    def row(self) -> tuple[tuple[Axis, ...], str | None, tuple[Axis, ...]]:
        """Axes with at most one row variable; ``'...'`` is named by the caller."""
        before: list[Axis] = []
        after: list[Axis] = []
        var = None
        while self.peek().kind not in _ROW_END:
            tok = self.peek()
            if tok.kind in ("...", ".."):
                if var is not None:
                    raise self.fail("two row variables in one row", tok)
                var = self.row_var()
                if self.peek().kind == ",":
                    self.next()
                continue
            if tok.kind == ",":
                raise self.fail("an empty axis (a comma with no axis before it)", tok)
            (before if var is None else after).append(self.axis())
            if self.multichar:
                nxt = self.peek().kind
                if nxt == ",":
                    self.next()
                elif nxt not in _ROW_END and nxt not in ("...", ".."):
                    raise self.fail(f"expected ',' between axes, found {self.peek().text!r}")
        if var is None:
            return (), None, tuple(before)
        return tuple(before), var, tuple(after)

    def row_var(self) -> str:
        if self.next().kind == "...":
            return "..."
        name = self.expect("ident", "a row variable's name after '..'").text
        if self.peek().kind == ",":
            self.next()  # upstream accepts '..v,..'
        if self.peek().kind == "ident" and not self.multichar:
            raise self.fail("'..v..' takes a single letter in single-char mode")
        self.expect("..", f"'..' to close '..{name}'")
        return name

    def axis(self) -> Axis:
        tok = self.next()
        nxt = self.peek().kind
        if tok.kind == "_":
            return Placeholder()
        if tok.kind == "int":
            if nxt == "^":
                raise self.fail(f"a concatenation takes labels only, not {tok.text!r}", tok)
            if nxt != "*":
                return FixedIndex(int(tok.text))
            self.next()
            over = self.expect("ident", "a label after '*'").text
            return self.affine(over, int(tok.text), tok)
        if tok.kind == "ident":
            if nxt == "*":
                raise self.fail(f"the coefficient {tok.text!r} must be an integer literal", tok)
            if nxt == "^":
                parts = [tok.text]
                while self.peek().kind == "^":
                    self.next()
                    parts.append(self.expect("ident", "a label after '^'").text)
                return Concat(tuple(parts))
            if nxt in ("=", "<", "+"):
                return self.affine(tok.text, None, tok)
            return Label(tok.text)
        found = "the end" if tok.kind == "end" else repr(tok.text)
        raise self.fail(f"expected an axis, found {found}", tok)

    def affine(self, over: str, stride: int | None, start: _Tok) -> Conv:
        """After ``[stride*]over``; ``stride`` is None when no coefficient was written."""
        padding, marker = None, ""
        if self.peek().kind in ("=", "<"):
            marker = self.next().kind
            padding = marker == "="
        offset, dilation, kernel = 0, 1, None
        if self.peek().kind == "+":
            self.next()
            if self.peek().kind == "int" and self.peek(1).kind != "*":
                offset = int(self.next().text)
                if self.peek().kind == "+":
                    self.next()
                    dilation, kernel = self.term()
            else:
                dilation, kernel = self.term()
        if kernel is None and (padding is not None or stride is None):
            why = f"'{over}{marker}+{offset}'" if offset else f"'{over}{marker}'"
            raise self.fail(f"{why} needs '+ kernel' (a strided axis is 'stride*{over}')", start)
        stride = 1 if stride is None else stride
        if stride < 1 or dilation < 1:
            raise self.fail("a stride or dilation must be at least 1", start)
        if not 0 <= offset < stride:
            raise self.fail(f"the offset {offset} is not below its stride {stride}", start)
        return Conv(over, stride, kernel, dilation, padding, offset)

    def term(self) -> tuple[int, str]:
        """``[int '*'] ident``: a kernel with its dilation."""
        coeff = 1
        if self.peek().kind == "int":
            coeff = int(self.next().text)
            self.expect("*", "'*' after a dilation")
        elif self.peek().kind == "ident" and self.peek(1).kind == "*":
            raise self.fail(f"the coefficient {self.peek().text!r} must be an integer literal")
        return coeff, self.expect("ident", "a kernel label").text


def _check_names(spec: str, specs: tuple[OperandSpec, ...]) -> None:
    """Upstream refuses one name for both a dimension and a row variable in a spec."""
    row_vars = {var for s in specs for var in s.row_vars()}
    for name in (name for s in specs for name in s.labels()):
        if name in row_vars:
            raise ValueError(
                f"Name '{name}' is used as both a dimension variable and a row variable "
                f"in spec: {spec}"
            )


def parse(spec: str) -> EinsumSpec:
    """Parse ``"rhs1;rhs2;...=>lhs"``; raises ValueError naming the spec and the problem."""
    parsed = _Parser(spec).einsum()
    _check_names(spec, parsed.specs)
    return parsed


def parse_operand(text: str) -> OperandSpec:
    """Parse a lone ``batch|input->output`` labels spec (no ``=>``), e.g. a shape's spec."""
    parsed = _Parser(text).lone_operand()
    _check_names(text, (parsed,))
    return parsed
