"""Precisions and the op table: every op as one row, for autodiff, the tests and every backend.

A row (:class:`Op`) holds what an op is: its arity; its NumPy reference (``ref``, the oracle of
the tests); its gradient rule (``grad``, what the DSL's pointwise builder writes the backprop
from); whether vectors run it lane by lane with the scalar's bits (``lanes``); what makes its
result representable in a precision (``selects``, ``flag``, ``scales``); and how far the CPU
backend's code for it may be from its reference (``ulps``, measured by
``tests/ir/test_ops.py``). NaN and infinities propagate the way PyTorch's ops do
(``relu(nan)`` is ``nan``), which the non-finite gradient checks rely on.

How each backend spells an op lives with that backend's renderer, in a table keyed by the row's
name: the LLVM IR builders in ``ocannl.backends.cpu.op_builders.BUILDERS``, the C templates in
``ocannl.backends.emit.C_TEMPLATES`` (for the CUDA kernels). The IR imports no backend. A new
op is a new row here, a spelling in each of those tables (``tests/backends/test_op_spellings.py``
checks that every row has both, and that neither table names an op the table lacks), and its
tests.

Layering, from the bottom: ``expr.py`` (the expression classes; imports nothing of the IR at
run time) <- this module (its gradient rules build expressions; :func:`apply` checks an
application against the table) <- ``tnode.py`` and ``assignments.py`` (which re-exports the
expressions and :func:`apply`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ocannl.ir.expr import Apply, Const, Expr

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


# --- counter-based random numbers: integer hashing as op-table rows --------------------------
#
# A uniform draw is a pure function of integers (a seed, a step counter, an element index), so
# CPU and GPU draw identical numbers. C templates (``backends/emit.py``) are single expressions
# and CUDA C kernels may hold no lambda (NVRTC treats one as host code), so a hash is a chain
# of small ops whose operands the emitter binds to locals: each op reads its operands as
# integers, works modulo 2**52, and returns the result as a float of the computation's
# precision, exact at f64.
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


# The gradient of an op: ``grad(operands, result, g)``, given the operands' expressions, the
# result's and the incoming gradient's, is each operand's contribution (None: none, e.g. a
# condition or a constant exponent).
GradRule = Callable[[Sequence[Expr], Expr, Expr], tuple["Expr | None", ...]]


@dataclass(frozen=True)
class Op:
    """A scalar operation: everything about it, in one place (see the module docstring)."""

    name: str
    arity: int
    ref: Callable[..., np.ndarray]  # (*operands) -> NumPy result, of the operands' dtype
    # None: the result is not differentiable (a 0 / 1 flag, a hash)
    grad: GradRule | None = None
    lanes: bool = False  # a vector of operands gives the vector of the scalar results
    # The operands the result is one of, up to sign, or else a zero (``where``: its second or
    # third; ``relu``: its operand or 0): with those representable in a precision, so is the
    # result, and a 16-bit store of it needs no rounding.
    selects: tuple[int, ...] | None = None
    flag: bool = False  # the result is always 0 or 1
    # A product: with one operand a unit (0 or +-1) the result is +-0, NaN or +-the other.
    scales: bool = False
    # The most the CPU backend's result (its builder's) is from the reference's, in ulps of the
    # computation's precision (f32 or f64); 0: the same bits (any NaN for a NaN).
    ulps: int = 0

    def representable(self, args: Sequence[bool], units: Sequence[bool]) -> bool:
        """Whether the result is exactly representable in a precision, given which operands
        are (``args``) and which are always 0 or +-1 (``units``: a flag, or such a
        constant)."""
        if self.flag:
            return True
        if self.selects is not None:
            return all(args[k] for k in self.selects)
        if self.scales:
            return any(units[k] and args[1 - k] for k in (0, 1))
        return False


def apply(op: str, *args: Expr) -> Apply:
    """``op`` applied to sub-expressions: the one way to build an :class:`Apply`, checked
    against the table."""
    row = OPS.get(op)
    if row is None:
        raise ValueError(f"unknown op {op!r}: expected one of {sorted(OPS)}")
    if row.arity != len(args):
        raise ValueError(f"op {op} takes {row.arity} operands, got {len(args)}")
    return Apply(op, tuple(args))


# --- gradient rules: d(op)/d(operand k) * g, as expressions of the operands ``x``, the
# result ``v`` and the incoming gradient ``g`` ------------------------------------------------


def _div_grad(x: Sequence[Expr], v: Expr, g: Expr) -> tuple[Expr, Expr]:
    a, b = x
    return apply("div", g, b), apply("neg", apply("div", apply("mul", g, a), apply("mul", b, b)))


def _pow_grad(x: Sequence[Expr], v: Expr, g: Expr) -> tuple[Expr, None]:
    """A constant exponent ``c`` (what the DSL's ``pow_const`` builds): ``c * a^(c-1)``."""
    a, c = x
    if not isinstance(c, Const):
        raise ValueError(f"pow: backprop needs a constant exponent, got {c!r}")
    d = apply("mul", g, apply("mul", Const(c.value), apply("pow", a, Const(c.value - 1.0))))
    return d, None


def _extremum_grad(pick_first: str) -> GradRule:
    """Gradients of a pointwise maximum / minimum: to the operand chosen, halved on ties
    (as torch's)."""
    def grad(x: Sequence[Expr], v: Expr, g: Expr) -> tuple[Expr, Expr]:
        zero, half = Const(0.0), Const(0.5)
        a, b = x
        tie = apply("where", apply("eq", a, b), apply("mul", g, half), zero)
        return (apply("where", apply(pick_first, a, b), g, tie),
                apply("where", apply(pick_first, b, a), g, tie))
    return grad


def _abs_grad(x: Sequence[Expr], v: Expr, g: Expr) -> tuple[Expr]:
    """``sign(a)``, 0 at 0 (as torch's)."""
    sign = apply("sub", apply("gt", x[0], Const(0.0)), apply("lt", x[0], Const(0.0)))
    return (apply("mul", g, sign),)


def _erf_grad(x: Sequence[Expr], v: Expr, g: Expr) -> tuple[Expr]:
    e = apply("exp", apply("neg", apply("mul", x[0], x[0])))
    return (apply("mul", g, apply("mul", Const(2.0 / math.sqrt(math.pi)), e)),)


def _where_grad(x: Sequence[Expr], v: Expr, g: Expr) -> tuple[None, Expr, Expr]:
    """To the branch taken; the condition gets none."""
    zero = Const(0.0)
    return None, apply("where", x[0], g, zero), apply("where", x[0], zero, g)


def _erf(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)).astype(x.dtype)


def _as(x: np.ndarray, flag: np.ndarray) -> np.ndarray:
    return flag.astype(x.dtype)


# ``ulps``, measured (f32: every 97th f32 bit pattern, 44 million; f64: 8 million random
# patterns and normals): f32 exp, tanh and erf are this backend's polynomials, log and sqrt
# libm's, and the references NumPy's own f32 functions, which are not correctly rounded
# either; f64 tanh is libm's against NumPy's.
OPS: dict[str, Op] = {
    op.name: op
    for op in [
        # binary
        Op("add", 2, lambda a, b: a + b, lambda x, v, g: (g, g), lanes=True),
        Op("sub", 2, lambda a, b: a - b, lambda x, v, g: (g, apply("neg", g)), lanes=True),
        Op("mul", 2, lambda a, b: a * b,
           lambda x, v, g: (apply("mul", g, x[1]), apply("mul", g, x[0])), lanes=True,
           scales=True),
        Op("div", 2, lambda a, b: a / b, _div_grad),
        Op("pow", 2, lambda a, b: a ** b, _pow_grad),
        Op("max", 2, np.maximum, _extremum_grad("gt"), lanes=True, selects=(0, 1)),
        Op("eq", 2, lambda a, b: _as(a, a == b), flag=True),
        Op("gt", 2, lambda a, b: _as(a, a > b), flag=True),
        # unary
        Op("neg", 1, lambda a: -a, lambda x, v, g: (apply("neg", g),), selects=(0,)),
        # relu's gradient where the result is positive, as torch's: the input is then not kept
        Op("relu", 1, lambda a: np.where(a < 0, np.zeros_like(a), a),
           lambda x, v, g: (apply("mul", g, apply("gt", v, Const(0.0))),), lanes=True,
           selects=(0,)),
        Op("exp", 1, np.exp, lambda x, v, g: (apply("mul", g, v),), ulps=2),
        Op("log", 1, np.log, lambda x, v, g: (apply("div", g, x[0]),), ulps=3),
        Op("tanh", 1, np.tanh,
           lambda x, v, g: (apply("mul", g, apply("sub", Const(1.0), apply("mul", v, v))),),
           ulps=3),
        Op("sigmoid", 1, lambda a: 1 / (1 + np.exp(-a)),
           lambda x, v, g: (apply("mul", g, apply("mul", v, apply("sub", Const(1.0), v))),),
           ulps=4),
        Op("sqrt", 1, np.sqrt, lambda x, v, g: (apply("div", apply("mul", g, Const(0.5)), v),)),
        Op("isfinite", 1, lambda a: _as(a, np.isfinite(a)), flag=True),
        # ternary: where(cond != 0, a, b); a select, never a multiply (inf * 0 is nan)
        Op("where", 3, lambda c, a, b: np.where(c != 0, a, b), _where_grad, selects=(1, 2)),
        # comparisons beyond eq / gt: 0 or 1 (false against NaN, but ne)
        Op("lt", 2, lambda a, b: _as(a, a < b), flag=True),
        Op("le", 2, lambda a, b: _as(a, a <= b), flag=True),
        Op("ge", 2, lambda a, b: _as(a, a >= b), flag=True),
        Op("ne", 2, lambda a, b: _as(a, a != b), flag=True),
        # minimum mirrors max: a NaN on either side propagates (torch.minimum)
        Op("min", 2, np.minimum, _extremum_grad("lt"), lanes=True, selects=(0, 1)),
        Op("abs", 1, np.abs, _abs_grad, selects=(0,)),
        Op("erf", 1, _erf, _erf_grad, ulps=1),
        # trigonometry (a cosine learning-rate schedule) and floor (a step decay's exponent):
        # libm's on the CPU, CUDA's on the GPU; floor's gradient is zero, as torch's
        Op("cos", 1, np.cos,
           lambda x, v, g: (apply("mul", g, apply("neg", apply("sin", x[0]))),), ulps=1),
        Op("sin", 1, np.sin, lambda x, v, g: (apply("mul", g, apply("cos", x[0])),), ulps=1),
        Op("floor", 1, np.floor, lambda x, v, g: (Const(0.0),)),
        # integer hashing for counter-based random draws: see the comment above ``HASH_BITS``
        Op("hash_add", 2, lambda s, v: _hash_np("hash_add", s, v).astype(s.dtype)),
        Op("hash_xsm", 3, lambda x, s, m: _hash_np("hash_xsm", x, s, m).astype(x.dtype)),
        Op("hash_unit", 1, lambda x: _hash_np("hash_unit", x).astype(x.dtype)),
    ]
}

# Accumulation operators: how a store combines with what the cell holds, and the neutral
# element a reset writes first.
ACCUMS: dict[str, float | None] = {"=": None, "+": 0.0, "max": -np.inf}


def reference(op: str, *args: np.ndarray) -> np.ndarray:
    """NumPy semantics of an op (its row's ``ref``), for tests of the generated code."""
    with np.errstate(all="ignore"):
        return OPS[op].ref(*args)
