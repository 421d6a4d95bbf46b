"""Precisions and the op table: the scalar meaning of every op, once, for every backend.

Each op carries one template per code flavour ("py" for the Numba emitter, "c" for CUDA C);
``{0}``, ``{1}``, ``{2}`` stand for the already-rendered operands, ``{zero}`` and ``{one}`` for
literals of the computation's precision (so f32 code stays f32 in Numba). Templates are written
so that NaN and infinities propagate the way PyTorch's ops do (``relu(nan)`` is ``nan``), which
the non-finite gradient checks rely on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np


class Precision(enum.Enum):
    """Storage precision of a buffer. Arithmetic on f16 / bf16 data runs in f32."""

    f64 = "f64"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"

    @property
    def is_narrow(self) -> bool:
        """Stored as 16-bit patterns on the CPU backend."""
        return self in (Precision.f16, Precision.bf16)

    @property
    def compute(self) -> Precision:
        """The precision arithmetic on values of this precision runs in."""
        return Precision.f64 if self is Precision.f64 else Precision.f32

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of host arrays (what ``get_values`` returns)."""
        return np.dtype(_HOST_DTYPES[self])

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of CPU buffers: narrow floats as their bit patterns."""
        return np.dtype(np.uint16) if self.is_narrow else self.numpy_dtype

    @property
    def rank(self) -> int:
        """Order used to promote mixed operands (f16 with bf16 promotes to f32)."""
        return _RANKS[self]

    @property
    def itemsize(self) -> int:
        return self.storage_dtype.itemsize


_HOST_DTYPES = {
    Precision.f64: np.float64,
    Precision.f32: np.float32,
    Precision.f16: np.float16,
    Precision.bf16: ml_dtypes.bfloat16,
}
_RANKS = {Precision.f16: 1, Precision.bf16: 1, Precision.f32: 2, Precision.f64: 3}


def precision_of(value: Precision | str) -> Precision:
    """Parse a precision given as an enum member or a name such as ``"f16"``."""
    if isinstance(value, Precision):
        return value
    try:
        return Precision(str(value))
    except ValueError:
        names = ", ".join(p.value for p in Precision)
        raise ValueError(f"unsupported precision {value!r}: expected one of {names}") from None


def promote(*precs: Precision) -> Precision:
    """The precision of an op's result: the widest operand; two different 16-bit kinds give f32."""
    top = max(precs, key=lambda p: p.rank)
    if top.is_narrow and any(p is not top for p in precs):
        return Precision.f32
    return top


@dataclass(frozen=True)
class Op:
    """A scalar operation: its arity and how each code flavour spells it."""

    name: str
    arity: int
    py: str
    c: str


def _op(name: str, arity: int, py: str, c: str) -> Op:
    return Op(name, arity, py, c)


OPS: dict[str, Op] = {
    op.name: op
    for op in [
        # binary
        _op("add", 2, "({0} + {1})", "({0} + {1})"),
        _op("sub", 2, "({0} - {1})", "({0} - {1})"),
        _op("mul", 2, "({0} * {1})", "({0} * {1})"),
        _op("div", 2, "({0} / {1})", "({0} / {1})"),
        _op("pow", 2, "({0} ** {1})", "pow({0}, {1})"),
        _op("max", 2, "({0} if {0} >= {1} or {0} != {0} else {1})",
            "(({0} >= {1} || {0} != {0}) ? {0} : {1})"),
        _op("eq", 2, "({one} if {0} == {1} else {zero})", "(({0} == {1}) ? {one} : {zero})"),
        _op("gt", 2, "({one} if {0} > {1} else {zero})", "(({0} > {1}) ? {one} : {zero})"),
        # unary
        _op("neg", 1, "(-{0})", "(-{0})"),
        _op("relu", 1, "({0} if not {0} < {zero} else {zero})", "(({0} < {zero}) ? {zero} : {0})"),
        _op("exp", 1, "math.exp({0})", "exp({0})"),
        _op("log", 1, "math.log({0})", "log({0})"),
        _op("tanh", 1, "math.tanh({0})", "tanh({0})"),
        _op("sigmoid", 1, "({one} / ({one} + math.exp(-{0})))", "({one} / ({one} + exp(-{0})))"),
        _op("sqrt", 1, "math.sqrt({0})", "sqrt({0})"),
        _op("isfinite", 1, "({one} if math.isfinite({0}) else {zero})",
            "(isfinite({0}) ? {one} : {zero})"),
        # ternary: where(cond != 0, a, b); a select, never a multiply (inf * 0 is nan)
        _op("where", 3, "({1} if {0} != {zero} else {2})", "(({0} != {zero}) ? {1} : {2})"),
    ]
}

# Accumulation operators: how a store combines with what the cell holds, and the neutral
# element a reset writes first.
ACCUMS: dict[str, float | None] = {"=": None, "+": 0.0, "max": -np.inf}


def reference(op: str, *args: np.ndarray) -> np.ndarray:
    """NumPy semantics of an op, for tests of the generated code."""
    a = args
    with np.errstate(all="ignore"):
        table = {
            "add": lambda: a[0] + a[1],
            "sub": lambda: a[0] - a[1],
            "mul": lambda: a[0] * a[1],
            "div": lambda: a[0] / a[1],
            "pow": lambda: a[0] ** a[1],
            "max": lambda: np.maximum(a[0], a[1]),
            "eq": lambda: (a[0] == a[1]).astype(a[0].dtype),
            "gt": lambda: (a[0] > a[1]).astype(a[0].dtype),
            "neg": lambda: -a[0],
            "relu": lambda: np.where(a[0] < 0, np.zeros_like(a[0]), a[0]),
            "exp": lambda: np.exp(a[0]),
            "log": lambda: np.log(a[0]),
            "tanh": lambda: np.tanh(a[0]),
            "sigmoid": lambda: 1 / (1 + np.exp(-a[0])),
            "sqrt": lambda: np.sqrt(a[0]),
            "isfinite": lambda: np.isfinite(a[0]).astype(a[0].dtype),
            "where": lambda: np.where(a[0] != 0, a[1], a[2]),
        }
        return table[op]()
