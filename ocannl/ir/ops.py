"""Precisions and the op table: the scalar meaning of every op, once, for every backend.

Each op carries its arity and its C template (``c``, for the CUDA kernels): ``{0}``, ``{1}``,
``{2}`` stand for the already-rendered operands, ``{zero}`` and ``{one}`` for literals of the
computation's precision (so f32 code stays f32). The CPU backend builds the same meaning as
LLVM IR (``backends/cpu/scalar.py``, one entry per op, checked against :func:`reference`).
Both are written so that NaN and infinities propagate the way PyTorch's ops do (``relu(nan)``
is ``nan``), which the non-finite gradient checks rely on.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

# Host dtypes and promotion ranks, by precision name.
_HOST_DTYPES = {"f64": np.float64, "f32": np.float32, "f16": np.float16,
                "bf16": ml_dtypes.bfloat16}
_RANKS = {"f16": 1, "bf16": 1, "f32": 2, "f64": 3}


class Precision(enum.Enum):
    """Storage precision of a buffer. Arithmetic on f16 / bf16 data runs in f32."""

    f64 = "f64"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"

    def __init__(self, name: str) -> None:
        # Every buffer access asks these: computed once per member, as an Enum's own hash
        # and its class attributes cost a few hundred nanoseconds each in Python 3.11.
        self._narrow = name in ("f16", "bf16")
        self._dtype = np.dtype(_HOST_DTYPES[name])
        self._rank = _RANKS[name]

    @property
    def is_narrow(self) -> bool:
        """A 16-bit float (f16, bf16): arithmetic on it runs in f32."""
        return self._narrow

    @property
    def compute(self) -> Precision:
        """The precision arithmetic on values of this precision runs in."""
        return _COMPUTE[self._value_]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype of host arrays (what ``get_values`` returns)."""
        return self._dtype

    @property
    def rank(self) -> int:
        """Order used to promote mixed operands (f16 with bf16 promotes to f32)."""
        return self._rank

    @property
    def itemsize(self) -> int:
        """Bytes per element, on every backend."""
        return self._dtype.itemsize


_COMPUTE = {p.value: Precision.f64 if p is Precision.f64 else Precision.f32 for p in Precision}


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
    """A scalar operation: its arity and how C spells it."""

    name: str
    arity: int
    c: str


def _op(name: str, arity: int, c: str) -> Op:
    return Op(name, arity, c)


# --- counter-based random numbers: integer hashing as op-table rows --------------------------
#
# A uniform draw is a pure function of integers (a seed, a step counter, an element index), so
# CPU and GPU draw identical numbers. Templates are single expressions and CUDA C kernels may
# hold no lambda (NVRTC treats one as host code), so a hash is a chain of small ops whose
# operands the emitter binds to locals: each op reads its operands as integers, works modulo
# 2**52, and returns the result as a float of the computation's precision, exact at f64.
#
#   u(x)                      x truncated to an unsigned integer; 0 for a negative, non-finite
#                             or >= 2**53 operand (so no operand is undefined behaviour)
#   hash_add(s, v)            (u(s) + (u(v) + 1) * G) mod 2**52
#   hash_xsm(x, shift, mult)  ((u(x) xor (u(x) >> shift)) * u(mult)) mod 2**52
#   hash_unit(x)              the top 24 bits of u(x) (52-bit) over 2**24: in [0, 1), exact in f32
#
# A chain is exact only at f64 (the random tensors compute at f64): at f32 an intermediate
# above 2**24 would round. The mixing constants are splitmix64's, cut to 52 bits (odd).

HASH_BITS = 52
HASH_G = 0x9E3779B97F4A7C15 & ((1 << HASH_BITS) - 1)
HASH_MIX = ((26, 0xBF58476D1CE4E5B9 & ((1 << HASH_BITS) - 1)),
            (23, 0x94D049BB133111EB & ((1 << HASH_BITS) - 1)),
            (26, 1))
_M = f"{(1 << HASH_BITS) - 1:#x}"


def _u_c(k: int) -> str:
    x = "{" + str(k) + "}"
    return f"(({x} >= 0 && {x} < 9007199254740992.0f) ? (unsigned long long)({x}) : 0ULL)"


_HASH_ROWS = {
    "hash_add": f"({{one}} * (({_u_c(0)} + ({_u_c(1)} + 1ULL) * {HASH_G:#x}ULL) & {_M}ULL))",
    "hash_xsm": (f"({{one}} * ((({_u_c(0)} ^ ({_u_c(0)} >> ({_u_c(1)} & 63ULL))) * {_u_c(2)}) "
                 f"& {_M}ULL))"),
    "hash_unit": f"(({{one}} * ({_u_c(0)} >> {HASH_BITS - 24})) / 16777216)",
}


def _u_np(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        ok = (x >= 0) & (x < 2.0**53)
    return np.where(ok, x, 0.0).astype(np.uint64)


def _hash_np(op: str, *args: np.ndarray) -> np.ndarray:
    """NumPy semantics of the hash rows, as exact f64."""
    m = np.uint64((1 << HASH_BITS) - 1)
    a = np.broadcast_arrays(*(_u_np(x) for x in args))
    with np.errstate(over="ignore"):
        if op == "hash_add":
            r = (a[0] + (a[1] + np.uint64(1)) * np.uint64(HASH_G)) & m
        elif op == "hash_xsm":
            r = ((a[0] ^ (a[0] >> (a[1] & np.uint64(63)))) * a[2]) & m
        else:
            return (a[0] >> np.uint64(HASH_BITS - 24)).astype(np.float64) / 16777216.0
    return r.astype(np.float64)


def uniform_reference(seed: np.ndarray | float, counter: np.ndarray | float,
                      index: np.ndarray | float) -> np.ndarray:
    """The draws of the random tensors (``ocannl.tensor.uniform``) in NumPy: f64, each exact
    at f32. ``mix`` is three ``hash_xsm``; the draw is
    ``hash_unit(mix(hash_add(mix(hash_add(mix(hash_add(0, seed)), counter)), index)))``."""
    def mix(z: np.ndarray) -> np.ndarray:
        for shift, mult in HASH_MIX:
            z = _hash_np("hash_xsm", z, np.float64(shift), np.float64(mult))
        return z

    h = mix(_hash_np("hash_add", np.float64(0.0), seed))
    h = mix(_hash_np("hash_add", h, counter))
    h = mix(_hash_np("hash_add", h, index))
    return _hash_np("hash_unit", h)


OPS: dict[str, Op] = {
    op.name: op
    for op in [
        # binary
        _op("add", 2, "({0} + {1})"),
        _op("sub", 2, "({0} - {1})"),
        _op("mul", 2, "({0} * {1})"),
        _op("div", 2, "({0} / {1})"),
        _op("pow", 2, "pow({0}, {1})"),
        _op("max", 2, "(({0} >= {1} || {0} != {0}) ? {0} : {1})"),
        _op("eq", 2, "(({0} == {1}) ? {one} : {zero})"),
        _op("gt", 2, "(({0} > {1}) ? {one} : {zero})"),
        # unary
        _op("neg", 1, "(-{0})"),
        _op("relu", 1, "(({0} < {zero}) ? {zero} : {0})"),
        _op("exp", 1, "exp({0})"),
        _op("log", 1, "log({0})"),
        _op("tanh", 1, "tanh({0})"),
        _op("sigmoid", 1, "({one} / ({one} + exp(-{0})))"),
        _op("sqrt", 1, "sqrt({0})"),
        _op("isfinite", 1, "(isfinite({0}) ? {one} : {zero})"),
        # ternary: where(cond != 0, a, b); a select, never a multiply (inf * 0 is nan)
        _op("where", 3, "(({0} != {zero}) ? {1} : {2})"),
        # comparisons beyond eq / gt: 0 or 1 (false against NaN, but ne)
        _op("lt", 2, "(({0} < {1}) ? {one} : {zero})"),
        _op("le", 2, "(({0} <= {1}) ? {one} : {zero})"),
        _op("ge", 2, "(({0} >= {1}) ? {one} : {zero})"),
        _op("ne", 2, "(({0} != {1}) ? {one} : {zero})"),
        # minimum mirrors max: a NaN on either side propagates (torch.minimum)
        _op("min", 2, "(({0} <= {1} || {0} != {0}) ? {0} : {1})"),
        _op("abs", 1, "fabs({0})"),
        _op("erf", 1, "erf({0})"),
        # integer hashing for counter-based random draws: see the comment above ``HASH_BITS``
        _op("hash_add", 2, _HASH_ROWS["hash_add"]),
        _op("hash_xsm", 3, _HASH_ROWS["hash_xsm"]),
        _op("hash_unit", 1, _HASH_ROWS["hash_unit"]),
    ]
}

# Accumulation operators: how a store combines with what the cell holds, and the neutral
# element a reset writes first.
ACCUMS: dict[str, float | None] = {"=": None, "+": 0.0, "max": -np.inf}


# Ops whose result is one of their operands up to sign (``where``: its second or third), so
# a result of operands representable in a precision is representable too, and a 0 / 1 flag
# always is. Storing such a result in a 16-bit node needs no rounding (``representable``).
_SELECTING = {"max": (0, 1), "min": (0, 1), "neg": (0,), "abs": (0,), "relu": (0,),
              "where": (1, 2)}
_FLAGS = frozenset({"eq", "gt", "lt", "le", "ge", "ne", "isfinite"})


def flag(op: str) -> bool:
    """Whether ``op``'s result is always 0 or 1 (a comparison, ``isfinite``)."""
    return op in _FLAGS


def representable(op: str, args: list[bool], units: list[bool]) -> bool:
    """Whether ``op``'s result is exactly representable in a precision, given which of its
    operands are (``args``) and which are always 0 or +-1 (``units``: a flag, or such a
    constant). A product with such a unit is +-0, NaN or +-the other operand."""
    if op in _FLAGS:
        return True
    if op in _SELECTING:
        return all(args[k] for k in _SELECTING[op])
    if op == "mul":
        return any(units[k] and args[1 - k] for k in (0, 1))
    return False


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
            "lt": lambda: (a[0] < a[1]).astype(a[0].dtype),
            "le": lambda: (a[0] <= a[1]).astype(a[0].dtype),
            "ge": lambda: (a[0] >= a[1]).astype(a[0].dtype),
            "ne": lambda: (a[0] != a[1]).astype(a[0].dtype),
            "min": lambda: np.minimum(a[0], a[1]),
            "abs": lambda: np.abs(a[0]),
            "erf": lambda: _erf(a[0]),
            "hash_add": lambda: _hash_np("hash_add", *a).astype(a[0].dtype),
            "hash_xsm": lambda: _hash_np("hash_xsm", *a).astype(a[0].dtype),
            "hash_unit": lambda: _hash_np("hash_unit", *a).astype(a[0].dtype),
        }
        return table[op]()


def _erf(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(x.dtype)
