"""The einsum / shape-spec parser against every example of the upstream reference (the
project's ``shared/ocannl-shapes/README.md`` §1.3, §1.6-§1.8, §2), the specs this project
already writes, and the errors upstream raises."""

from __future__ import annotations

import pytest

from ocannl.tensor.einsum_spec import (
    Concat,
    Conv,
    EinsumSpec,
    FixedIndex,
    Label,
    OperandSpec,
    Placeholder,
    RowSpec,
    is_multichar,
    parse,
    parse_operand,
)


def _axis(x):
    """Shorthand: a string is a Label, an int a FixedIndex, anything else is itself."""
    if isinstance(x, str):
        return Label(x)
    if isinstance(x, int):
        return FixedIndex(x)
    return x


def row(*dims, var=None, beg=()) -> RowSpec:
    return RowSpec(tuple(map(_axis, beg)), var, tuple(map(_axis, dims)))


E = row()


def op(b=E, i=E, o=E) -> OperandSpec:
    return OperandSpec(b, i, o)


def out(*dims, var=None, beg=()) -> OperandSpec:
    return op(o=row(*dims, var=var, beg=beg))


BV, IV, OV = "...batch", "...input", "...output"

# (spec, operands, result, multichar)
EINSUM_CASES = [
    # README §1.3
    (
        "...b|...i->...o => i|o->b",
        [op(row("b", var=BV), row("i", var=IV), row("o", var=OV))],
        op(row("i"), row("o"), row("b")),
        False,
    ),
    ("ii=>i", [out("i", "i")], out("i"), False),
    ("i=>ii", [out("i")], out("i", "i"), False),
    ("i=>i2", [out("i")], out("i", 2), False),
    ("...|...->... => 0", [op(row(var=BV), row(var=IV), row(var=OV))], out(0), False),
    ("ij;jk=>im", [out("i", "j"), out("j", "k")], out("i", "m"), False),
    # README §1.6
    (
        "... | 2*oh+kh, 2*ow+kw, ..ic..; kh, kw, ..ic.. -> ..oc.. => ... | oh, ow, ..oc..",
        [
            op(b=row(var=BV), o=row(var="ic", beg=(Conv("oh", 2, "kh"), Conv("ow", 2, "kw")))),
            op(i=row(var="ic", beg=("kh", "kw")), o=row(var="oc")),
        ],
        op(b=row(var=BV), o=row(var="oc", beg=("oh", "ow"))),
        True,
    ),
    (
        "... | 2*oh< + wh, 2*ow< + ww, ..c..; wh, ww => ... | oh, ow, ..c..",
        [
            op(
                b=row(var=BV),
                o=row(
                    var="c",
                    beg=(
                        Conv("oh", 2, "wh", use_padding=False),
                        Conv("ow", 2, "ww", use_padding=False),
                    ),
                ),
            ),
            out("wh", "ww"),
        ],
        op(b=row(var=BV), o=row(var="c", beg=("oh", "ow"))),
        True,
    ),
    ("o<+k; k => o", [out(Conv("o", kernel="k", use_padding=False)), out("k")], out("o"), True),
    # README §1.7
    ("a; b => a^b", [out("a"), out("b")], out(Concat(("a", "b"))), True),
    ("a; b; c => a^b^c", [out("a"), out("b"), out("c")], out(Concat(("a", "b", "c"))), True),
    ("a^b => a", [out(Concat(("a", "b")))], out("a"), True),
    ("a^b => b", [out(Concat(("a", "b")))], out("b"), True),
    ("a => a^b", [out("a")], out(Concat(("a", "b"))), True),
    ("a^b^c => b", [out(Concat(("a", "b", "c")))], out("b"), True),
    # README §1.8
    ("ab;bc=>ac", [out("a", "b"), out("b", "c")], out("a", "c"), False),
    # README §2
    (
        "...|... => 0",
        [op(b=row(var=BV), o=row(var=OV))],
        out(0),
        False,
    ),
    (
        "2...|...->... => ...|...->...",
        [op(row(var=BV, beg=(2,)), row(var=IV), row(var=OV))],
        op(row(var=BV), row(var=IV), row(var=OV)),
        False,
    ),
    (
        "...|... => ...|...2",
        [op(b=row(var=BV), o=row(var=OV))],
        op(b=row(var=BV), o=row(2, var=OV)),
        False,
    ),
    ("ijk => kji", [out("i", "j", "k")], out("k", "j", "i"), False),
    (
        "..v..|...ijk => ..v..kji",
        [op(b=row(var="v"), o=row("i", "j", "k", var=OV))],
        out("k", "j", "i", var="v"),
        False,
    ),
    (
        "... | ..d.. => ... | 0",
        [op(b=row(var=BV), o=row(var="d"))],
        op(b=row(var=BV), o=row(0)),
        False,
    ),
    (
        " ... s | h d; ... t | h d => ... s | t -> h",
        [op(b=row("s", var=BV), o=row("h", "d")), op(b=row("t", var=BV), o=row("h", "d"))],
        op(row("s", var=BV), row("t"), row("h")),
        False,
    ),
    # README §5: bare separators are explicitly empty rows
    ("x=>|->x", [out("x")], out("x"), False),
    # the brief's own examples
    (
        "b|i->o => o|b->i",
        [op(row("b"), row("i"), row("o"))],
        op(row("o"), row("b"), row("i")),
        False,
    ),
    (
        "...|i->1; ...|j...->i => ...|ij",
        [
            op(row(var=BV), row("i"), row(1)),
            op(row(var=BV), row(var=IV, beg=("j",)), row("i")),
        ],
        op(b=row(var=BV), o=row("i", "j")),
        False,
    ),
    ("ij=>i1j", [out("i", "j")], out("i", 1, "j"), False),
    (
        "a, ..row1.., b; ..row2.., c => a, ..row1.., c",
        [out("b", var="row1", beg=("a",)), out("c", var="row2")],
        out("c", var="row1", beg=("a",)),
        True,
    ),
    ("b|i->=>|->x", [op(b=row("b"), i=row("i"))], out("x"), False),
    ("=>", [out()], out(), False),
    ("a,b=>", [out("a", "b")], out(), True),
    ("i_j=>ij", [out("i", Placeholder(), "j")], out("i", "j"), False),
    ("i, _, jk => i, jk", [out("i", Placeholder(), "jk")], out("i", "jk"), True),
    ("12i=>i", [out(12, "i")], out("i"), False),
    # specs the project already writes
    (
        "b|i->h;h->o=>b|i->o",
        [op(row("b"), row("i"), row("h")), op(i=row("h"), o=row("o"))],
        op(row("b"), row("i"), row("o")),
        False,
    ),
    (
        "q|hd;k|hd=>hqk|",
        [op(b=row("q"), o=row("h", "d")), op(b=row("k"), o=row("h", "d"))],
        op(b=row("h", "q", "k")),
        False,
    ),
    (
        "...q|hd;...k|hd=>...hqk|",
        [op(b=row("q", var=BV), o=row("h", "d")), op(b=row("k", var=BV), o=row("h", "d"))],
        op(b=row("h", "q", "k", var=BV)),
        False,
    ),
    (
        "hqk|;k|hv=>q|hv",
        [op(b=row("h", "q", "k")), op(b=row("k"), o=row("h", "v"))],
        op(b=row("q"), o=row("h", "v")),
        False,
    ),
    (
        "rows|d_in,;d_in->d_out=>rows|d_out",
        [op(b=row("rows"), o=row("d_in")), op(i=row("d_in"), o=row("d_out"))],
        op(b=row("rows"), o=row("d_out")),
        True,
    ),
]


@pytest.mark.parametrize(("spec", "operands", "result", "multichar"), EINSUM_CASES)
def test_parse(spec, operands, result, multichar):
    assert parse(spec) == EinsumSpec(spec, tuple(operands), result, multichar)


# Single axes, parsed as a lone labels spec (one output axis each).
CONV_CASES = [
    ("2*oh+kh", Conv("oh", 2, "kh")),
    ("2*oh=+kh", Conv("oh", 2, "kh", use_padding=True)),
    ("2*oh<+kh", Conv("oh", 2, "kh", use_padding=False)),
    ("2 * oh < + wh", Conv("oh", 2, "wh", use_padding=False)),
    ("o+k", Conv("o", kernel="k")),
    ("o=+k", Conv("o", kernel="k", use_padding=True)),
    ("o<+k", Conv("o", kernel="k", use_padding=False)),
    ("a+bc", Conv("a", kernel="bc")),
    ("2*o+3*k", Conv("o", 2, "k", 3)),
    ("o<+3*k", Conv("o", kernel="k", dilation=3, use_padding=False)),
    ("3*o+2+k", Conv("o", 3, "k", offset=2)),
    ("2*o=+1+3*k", Conv("o", 2, "k", 3, use_padding=True, offset=1)),
    ("o<+0+k", Conv("o", kernel="k", use_padding=False)),
    ("2*oh", Conv("oh", 2)),
    ("1*oh", Conv("oh")),
    ("2*oh+1", Conv("oh", 2, offset=1)),
    ("a^b", Concat(("a", "b"))),
    ("a ^ b ^ c", Concat(("a", "b", "c"))),
]


@pytest.mark.parametrize(("text", "axis"), CONV_CASES)
def test_affine_and_concat_axes(text, axis):
    assert parse_operand(text) == out(axis)


OPERAND_CASES = [
    ("abc", out("a", "b", "c")),
    ("abc,", out("abc")),
    ("a, b, c", out("a", "b", "c")),
    ("a, b,", out("a", "b")),
    ("", out()),
    ("|->", out()),
    ("b|i->o", op(row("b"), row("i"), row("o"))),
    ("b|o", op(b=row("b"), o=row("o"))),
    ("i->o", op(i=row("i"), o=row("o"))),
    ("b|i->", op(b=row("b"), i=row("i"))),
    ("...|j...->i", op(row(var=BV), row(var=IV, beg=("j",)), row("i"))),
    ("j...", out(var=OV, beg=("j",))),
    ("ab...cd", out("c", "d", var=OV, beg=("a", "b"))),
    ("a...b", out("b", var=OV, beg=("a",))),
    ("a,...,b", out("b", var=OV, beg=("a",))),
    ("a, ..v.., b,", out("b", var="v", beg=("a",))),
    ("..v,..", out(var="v")),
    ("..v..", out(var="v")),
    ("i, j -> 2*i+j", op(i=row("i", "j"), o=row(Conv("i", 2, "j")))),
    ("regular, 3*strided", out("regular", Conv("strided", 3))),
    (
        "batch|input->3*output+1*kernel,",
        op(row("batch"), row("input"), row(Conv("output", 3, "kernel"))),
    ),
    ("i, o+k, j", out("i", Conv("o", kernel="k"), "j")),
    ("12, ab_3", out(12, "ab_3")),
]


@pytest.mark.parametrize(("text", "expected"), OPERAND_CASES)
def test_parse_operand(text, expected):
    assert parse_operand(text) == expected


@pytest.mark.parametrize(
    ("spec", "multichar"),
    [
        ("abc", False),
        ("a,b,c", True),
        ("2*a+b", True),
        ("a+b", True),
        ("a*b", True),
        ("a^b", True),
        ("a&b", True),
        ("o<+k", True),
        ("o=+k", True),
        ("a=", True),
        ("a|b->c", False),
        ("...a..b", False),
        ("ij;jk=>ik", False),
    ],
)
def test_is_multichar(spec, multichar):
    assert is_multichar(spec) is multichar


def test_ellipsis_is_named_by_its_row():
    spec = parse("...|...->...;...=>...|...")
    assert [r.var for r in spec.operands[0].rows] == [BV, IV, OV]
    assert [r.var for r in spec.operands[1].rows] == [None, None, OV]
    assert [r.var for r in spec.result.rows] == [BV, None, OV]
    assert spec.row_vars() == (BV, IV, OV)


def test_labels_and_row_vars_helpers():
    spec = parse("... | 2*oh+kh, ow, ..ic..; kh, a^b -> ..oc.. => ... | oh, _, 3, ..oc..")
    assert spec.labels() == ("oh", "kh", "ow", "a", "b")
    assert spec.row_vars() == (BV, "ic", "oc")
    assert spec.result.labels() == ("oh",)
    assert spec.operands[0].output.axes == (Conv("oh", 2, "kh"), Label("ow"))


def test_parse_counts_operands():
    assert len(parse("ij;jk=>ik").operands) == 2
    assert len(parse("i=>i").operands) == 1
    assert len(parse("a;b;c;d=>a^b^c^d").operands) == 4


ERROR_CASES = [
    (
        "..d.., d; d, e => ..d.., e",
        "Name 'd' is used as both a dimension variable and a row variable in spec: "
        "..d.., d; d, e => ..d.., e",
    ),
    (
        "..d..|d=>d",
        "Name 'd' is used as both a dimension variable and a row variable in spec: ..d..|d=>d",
    ),
    ("i#j=>i", "unexpected character '#' (single-char mode) at offset 1 in spec: i#j=>i"),
    ("a,b$=>a", "unexpected character '$' (multichar mode) at offset 3 in spec: a,b$=>a"),
    ("a-b=>a", "unexpected character '-' (single-char mode) at offset 1 in spec: a-b=>a"),
    ("a&b=>a", "'&' is reserved (multichar mode) at offset 1 in spec: a&b=>a"),
    ("....=>i", "unexpected character '.' (single-char mode) at offset 3 in spec: ....=>i"),
    ("...i...=>i", "two row variables in one row at offset 4 in spec: ...i...=>i"),
    ("a,..x..,..y..=>a", "two row variables in one row at offset 8 in spec: a,..x..,..y..=>a"),
    ("ij=>i=>j", "more than one '=>' at offset 5 in spec: ij=>i=>j"),
    ("i->j|k=>i", "'|' after '->' (write batch|input->output) at offset 4 in spec: i->j|k=>i"),
    ("i|j|k=>i", "more than one '|' at offset 3 in spec: i|j|k=>i"),
    ("i->j->k=>i", "more than one '->' at offset 4 in spec: i->j->k=>i"),
    ("2*oh+2=>oh", "the offset 2 is not below its stride 2 at offset 0 in spec: 2*oh+2=>oh"),
    (
        "o<+1+k; k => o",
        "the offset 1 is not below its stride 1 at offset 0 in spec: o<+1+k; k => o",
    ),
    ("a,,b=>a", "an empty axis (a comma with no axis before it) at offset 2 in spec: a,,b=>a"),
    (",a=>a", "an empty axis (a comma with no axis before it) at offset 0 in spec: ,a=>a"),
    ("a,b c=>a", "expected ',' between axes, found 'c' at offset 4 in spec: a,b c=>a"),
    ("ij", "missing '=>' (an einsum spec is 'rhs1;rhs2=>lhs') at offset 2 in spec: ij"),
    ("i;j=>i;j", "';' after '=>' (the result is one operand) at offset 6 in spec: i;j=>i;j"),
    (
        "... | stride*oh+kh, ... => ... | oh",
        "the coefficient 'stride' must be an integer literal at offset 6 in spec: "
        "... | stride*oh+kh, ... => ... | oh",
    ),
    (
        "2*o+d*k=>o",
        "the coefficient 'd' must be an integer literal at offset 4 in spec: 2*o+d*k=>o",
    ),
    (
        "oh<=>oh",
        "'oh<' needs '+ kernel' (a strided axis is 'stride*oh') at offset 0 in spec: oh<=>oh",
    ),
    (
        "oh+1=>oh",
        "'oh+1' needs '+ kernel' (a strided axis is 'stride*oh') at offset 0 in spec: oh+1=>oh",
    ),
    ("0*o=>o", "a stride or dilation must be at least 1 at offset 0 in spec: 0*o=>o"),
    (
        "3^rest => rest",
        "a concatenation takes labels only, not '3' at offset 0 in spec: 3^rest => rest",
    ),
    ("a^2=>a", "expected a label after '^', found '2' at offset 2 in spec: a^2=>a"),
    (
        "..vv..=>a",
        "'..v..' takes a single letter in single-char mode at offset 3 in spec: ..vv..=>a",
    ),
    ("..=>a", "expected a row variable's name after '..', found '=>' at offset 2 in spec: ..=>a"),
    ("..v, x=>a", "expected '..' to close '..v', found 'x' at offset 5 in spec: ..v, x=>a"),
    ("a,*b=>a", "expected an axis, found '*' at offset 2 in spec: a,*b=>a"),
]


@pytest.mark.parametrize(("spec", "message"), ERROR_CASES)
def test_errors(spec, message):
    with pytest.raises(ValueError) as err:
        parse(spec)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ij=>i", "unexpected '=>' in a single labels spec at offset 2 in spec: ij=>i"),
        ("i;j", "unexpected ';' in a single labels spec at offset 1 in spec: i;j"),
        (
            "..d.., d",
            "Name 'd' is used as both a dimension variable and a row variable in spec: ..d.., d",
        ),
    ],
)
def test_operand_errors(text, message):
    with pytest.raises(ValueError) as err:
        parse_operand(text)
    assert str(err.value) == message
