"""``einsum``: generalised contractions written as OCANNL-style axis specs.

A spec is ``"A;B=>R"`` (the product of two operands, summed over the labels R lacks) or
``"A=>R"`` (one operand: a copy, or a sum). Each of A, B, R is ``"batch|input->output"``; a
missing ``|`` means no batch axes, a missing ``->`` no input axes. Two spellings of a row:

- one-letter labels, when the spec has no comma: ``"b|i->h;h->o=>b|i->o"``;
- comma-separated labels of any length, when it has a comma anywhere (a trailing comma makes a
  one-axis row multi-letter: ``"rows|d_in,;d_in->d_out=>rows|d_out"``). In this form an
  operand's axis may be affine in the labels, ``"2*oh+kh"`` or ``"oh+kh-1"``: a read outside
  the operand gives 0 (zero padding), so a convolution is
  ``einsum("b|2*oh+kh-1,2*ow+kw-1,c;kh,kw,c->o=>b|oh,ow,o", image, kernel)``.

``...`` at the start of an operand's batch row stands for its remaining (leading) batch axes;
in the result, for the operands' ones. A label's extent comes from the axes it names plainly;
one that appears only inside affine axes takes the largest extent whose positions stay inside
the operand, allowing on the far side as much padding as the offset gives on the near side (the
output size of a convolution with symmetric padding).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ocannl.ir.assignments import Affine, Index
from ocannl.tensor.reductions import _contract, _reduce_with
from ocannl.tensor.shape import Shape
from ocannl.tensor.tensor import Tensor

ROW_NAMES = ("batch", "input", "output")
_TERM = re.compile(r"([+-]?)(?:(\d+)\*)?([A-Za-z_][A-Za-z0-9_]*)|([+-]?)(\d+)")


@dataclass(frozen=True)
class _Axis:
    """One axis of an operand spec: ``sum(coef * label) + offset``."""

    terms: tuple[tuple[int, str], ...]
    offset: int = 0

    @property
    def label(self) -> str | None:
        """The label of a plain axis (one label, coefficient 1, no offset), else None."""
        if len(self.terms) == 1 and self.terms[0][0] == 1 and self.offset == 0:
            return self.terms[0][1]
        return None


def _text(ax: _Axis) -> str:
    out = "+".join(lab if c == 1 else f"{c}*{lab}" for c, lab in ax.terms)
    return (out + (f"{ax.offset:+d}" if ax.offset else "")).replace("+-", "-")


def _parse_axis(token: str, spec: str) -> _Axis:
    text = token.replace(" ", "")
    terms: list[tuple[int, str]] = []
    offset, pos = 0, 0
    while pos < len(text):
        m = _TERM.match(text, pos)
        if m is None or (pos > 0 and not (m[1] or m[4])):
            raise ValueError(f"einsum spec {spec!r}: axis {token!r} is not a label or an affine "
                             f"combination such as '2*oh+kh-1'")
        sign = -1 if "-" in (m[1] or m[4] or "") else 1
        if m[3]:
            terms.append((sign * int(m[2] or 1), m[3]))
        else:
            offset += sign * int(m[5])
        pos = m.end()
    if not terms:
        raise ValueError(f"einsum spec {spec!r}: axis {token!r} names no label")
    return _Axis(tuple(terms), offset)


def _parse_row(text: str, multi: bool, spec: str, row: str) -> tuple[bool, list[_Axis]]:
    """Whether the row starts with ``...``, and its axes."""
    text = text.strip()
    ellipsis = text.startswith("...")
    if ellipsis:
        if row != "batch":
            raise ValueError(f"einsum spec {spec!r}: '...' may only open a batch row")
        text = text[3:].lstrip(",").strip()
    if multi:
        tokens = [t.strip() for t in text.split(",")] if text else []
        if tokens and not tokens[-1]:
            tokens.pop()  # a trailing comma: "d_in," is one multi-letter axis
        if any(not t for t in tokens):
            raise ValueError(f"einsum spec {spec!r}: an empty axis in {text!r}")
    else:
        tokens = [c for c in text if not c.isspace()]
    return ellipsis, [_parse_axis(t, spec) for t in tokens]


def _parse_operand(part: str, multi: bool, spec: str) -> dict[str, tuple[bool, list[_Axis]]]:
    batch, rest = part.split("|", 1) if "|" in part else ("", part)
    inp, out = rest.split("->", 1) if "->" in rest else ("", rest)
    return {name: _parse_row(text, multi, spec, name)
            for name, text in (("batch", batch), ("input", inp), ("output", out))}


def einsum(spec: str, a: Tensor, b: Tensor | None = None) -> Tensor:
    """The contraction (or, with one operand, the copy or sum) ``spec`` describes; see the
    module docstring. Shape errors name the spec, the operand and its shape."""
    if not isinstance(spec, str) or spec.count("=>") != 1:
        raise ValueError(f"einsum spec {spec!r}: expected 'A;B=>R' or 'A=>R'")
    lhs, res = spec.split("=>")
    parts = lhs.split(";")
    ts = [a] if b is None else [a, b]
    if len(parts) != len(ts):
        raise ValueError(f"einsum spec {spec!r} names {len(parts)} operands, got {len(ts)}")
    multi = "," in spec
    ops = [_parse_operand(p, multi, spec) for p in parts]
    result = _parse_operand(res, multi, spec)

    extent: dict[str, int] = {}
    owner: dict[str, Tensor] = {}
    rows_of: list[dict[str, list[_Axis]]] = []
    ellipsis = 0
    for t, op in zip(ts, ops, strict=True):
        t.shape.require_inferred(t.label, f"einsum {spec!r}")
        rows: dict[str, list[_Axis]] = {}
        for row in ROW_NAMES:
            has_ell, axes = op[row]
            dims = t.shape.row(row)
            if has_ell:
                n = len(dims) - len(axes)
                if n < 0:
                    raise ValueError(f"einsum {spec!r}: batch row names {len(axes)} axes but "
                                     f"{t.label} has shape {t.shape}")
                ellipsis = max(ellipsis, n)
                axes = [_Axis(((1, f"...{n - 1 - k}"),)) for k in range(n)] + axes
            if len(axes) != len(dims):
                written = ("," if multi else "").join(_text(ax) for ax in op[row][1])
                raise ValueError(f"einsum {spec!r}: {row} row {written!r} has {len(axes)} axes "
                                 f"but {t.label} has shape {t.shape}")
            for ax, d in zip(axes, dims, strict=True):
                lab = ax.label
                if lab is None:
                    continue
                first = owner.setdefault(lab, t)
                if extent.setdefault(lab, d) != d:
                    raise ValueError(f"einsum {spec!r}: axis {lab!r} is {extent[lab]} in "
                                     f"{first.label} {first.shape} and {d} in {t.label} "
                                     f"{t.shape}")
            rows[row] = axes
        rows_of.append(rows)
    _infer_affine_extents(spec, ts, rows_of, extent)

    res_rows: dict[str, list[str]] = {}
    for row in ROW_NAMES:
        has_ell, axes = result[row]
        labels = [ax.label for ax in axes]
        if any(lab is None for lab in labels):
            raise ValueError(f"einsum {spec!r}: the result's axes must be plain labels")
        if has_ell:
            labels = [f"...{ellipsis - 1 - k}" for k in range(ellipsis)] + labels
        for lab in labels:
            if lab not in extent:
                raise ValueError(f"einsum {spec!r}: result axis {lab!r} appears in no operand")
        res_rows[row] = labels  # type: ignore[assignment]
    res_labels = res_rows["batch"] + res_rows["output"] + res_rows["input"]
    repeated = sorted({lab for lab in res_labels if res_labels.count(lab) > 1})
    if repeated:
        raise ValueError(f"einsum {spec!r}: result label {repeated[0]!r} appears more than once "
                         f"in the result {res!r}: each result axis needs its own label (a "
                         f"repeated output label has no meaning here, as in NumPy and PyTorch)")
    order = list(dict.fromkeys(res_labels))
    for rows in rows_of:
        for row in ("batch", "output", "input"):
            for ax in rows[row]:
                order += [lab for _, lab in ax.terms if lab not in order]
    it = {lab: k for k, lab in enumerate(order)}
    space = tuple(extent[lab] for lab in order)
    shape = Shape(*(tuple(extent[lab] for lab in res_rows[r]) for r in ("batch", "output",
                                                                           "input")))

    def index(ax: _Axis) -> Index:
        if ax.label is not None:
            return it[ax.label]
        return Affine(tuple((c, it[lab]) for c, lab in ax.terms), ax.offset)

    projs = [tuple(index(ax) for row in ("batch", "output", "input") for ax in rows[row])
             for rows in rows_of]
    if b is not None:
        return _contract("einsum", a, b, projs[0], projs[1], shape, space)
    return _reduce_with("einsum", a, projs[0], tuple(it[lab] for lab in res_labels), shape,
                        space, "+")


def _infer_affine_extents(spec: str, ts: list[Tensor], rows_of: list[dict[str, list[_Axis]]],
                          extent: dict[str, int]) -> None:
    """Give each label seen only inside affine axes the largest extent that keeps its axis
    inside the operand (with as much padding on the far side as the offset gives)."""
    for t, rows in zip(ts, rows_of, strict=True):
        for row in ROW_NAMES:
            for ax, d in zip(rows[row], t.shape.row(row), strict=True):
                if ax.label is not None:
                    continue
                unknown = [(c, lab) for c, lab in ax.terms if lab not in extent]
                if not unknown:
                    continue
                if len(unknown) > 1 or unknown[0][0] <= 0:
                    raise ValueError(f"einsum {spec!r}: cannot tell the extent of "
                                     f"{[lab for _, lab in unknown]} from an affine axis of "
                                     f"{t.label} {t.shape}: name them plainly elsewhere")
                c, lab = unknown[0]
                known_max = sum(max(0, k * (extent[x] - 1)) for k, x in ax.terms if x != lab)
                n = (d - 1 + max(0, -ax.offset) - known_max - ax.offset) // c + 1
                if n < 1:
                    raise ValueError(f"einsum {spec!r}: axis {lab!r} would be empty: the window "
                                     f"does not fit {t.label} {t.shape}")
                extent[lab] = n
