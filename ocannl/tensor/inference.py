"""Shape inference: rows with row variables, constraints solved as ops are built, and closed
by upstream OCANNL's rules when the dims are first needed.

A shape whose every dim is known is a plain :class:`~ocannl.tensor.shape.Shape`, and an op
over such shapes never comes here. A parameter made without some dims has *open* rows: a
:class:`Row` is leading axes, an optional row variable, trailing axes, each axis a size or a
:class:`DimVar`. An op over open shapes adds constraints instead of computing its result:

- pointwise ops and ``@`` (OCANNL's ``*``): inequalities ``res ⊑ opnd``, broadcasting from
  the outer edges (a missing axis or a 1 that stretches broadcasts);
- einsum: equations.

Each constraint is solved as far as it can be at once (a conflict is a ``ValueError`` there,
naming the op); what is left waits in its *group* (the constraints and variables that meet)
until a dim of the group is needed: :func:`close` then fixes every variable as upstream's
closing stages do: a parameter's rows take what they meet (their greatest lower bound), a
row left open is empty, a dim left open is its lower bound (or 1), and a parameter's dim or
row that nothing fixes is refused, naming it. A failed solve or close is undone whole.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ocannl.tensor.shape import BCAST_ONE, Shape, basis_of, same_dim, stretches

if TYPE_CHECKING:
    from ocannl.tensor.tensor import Tensor

ROW_NAMES = ("batch", "input", "output")
_ids = itertools.count(1)

# --- undo: every change a solve makes is logged, so a failed one is rolled back ----------------

_trail: list[tuple[Any, str, Any] | Callable[[], object]] | None = None


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same stretch marks and bases (``BCAST_ONE == 1``, yet they differ)."""
    if a is b:
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return (type(a) is type(b) and not isinstance(a, (Row, DimVar, RowVar)) and a == b
            and basis_of(a) == basis_of(b))


def _set(obj: Any, attr: str, value: Any) -> None:
    if _same(getattr(obj, attr), value):
        return
    if _trail is not None:
        _trail.append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, value)


@contextmanager
def _transaction() -> Iterator[None]:
    """Changes made inside are undone if it raises (nested: the outermost one undoes)."""
    global _trail
    if _trail is not None:
        yield
        return
    _trail = []
    try:
        yield
    except BaseException:
        for entry in reversed(_trail):
            if callable(entry):
                entry()
            else:
                obj, attr, old = entry
                setattr(obj, attr, old)
        raise
    finally:
        _trail = None


# --- variables, rows and groups -----------------------------------------------------------------


class Group:
    """Variables and constraints that meet, closed together (union-find)."""

    __slots__ = ("parent", "cons", "tensors")

    def __init__(self) -> None:
        self.parent: Group | None = None
        self.cons: list[Constraint] = []
        self.tensors: list[Tensor] = []

    def root(self) -> Group:
        g = self
        while g.parent is not None:
            g = g.parent
        return g


def _union(a: Group, b: Group) -> Group:
    a, b = a.root(), b.root()
    if a is b:
        return a
    if len(a.cons) + len(a.tensors) < len(b.cons) + len(b.tensors):
        a, b = b, a
    _set(b, "parent", a)
    _set(a, "cons", a.cons + b.cons)
    _set(a, "tensors", a.tensors + b.tensors)
    return a


@dataclass(eq=False)
class Owner:
    """Where a variable comes from, for messages and for the closing rules: the tensor's
    label, its row, and whether it is a parameter's (a *terminal*: it takes what it meets)."""

    label: str
    row: str
    terminal: bool


class DimVar:
    """One axis of unknown size."""

    __slots__ = ("id", "value", "glb", "at_least", "discardable", "owner", "group", "name")

    def __init__(self, owner: Owner, group: Group | None = None, name: str = "") -> None:
        self.id = next(_ids)
        self.value: int | DimVar | None = None
        self.glb: int | None = None  # the meet of the sizes bounding it from below
        self.at_least = 0
        # A concatenation's component that may be empty (``a^b => a``'s ``b``): closed to 0
        # when nothing bounds it, after the dims that have a bound (upstream's stage 5).
        self.discardable = False
        self.owner = owner
        self.group = group or Group()
        self.name = name

    def __repr__(self) -> str:
        return f"'{self.name}" if self.name else f"'d{self.id}"


class RowVar:
    """The middle of a row, of unknown length (upstream's ``Row_var``)."""

    __slots__ = ("id", "value", "glb", "total", "owner", "group", "name")

    def __init__(self, owner: Owner, group: Group | None = None, name: str = "") -> None:
        self.id = next(_ids)
        self.value: Row | None = None
        self.glb: tuple[int, ...] | None = None
        # The cells its axes must hold (``set_dim`` on a row variable): closing makes it one
        # axis of that many, before any bound is taken (upstream protects such numerators).
        self.total: int | None = None
        self.owner = owner
        self.group = group or Group()
        self.name = name

    def __repr__(self) -> str:
        """``..v..`` (a spec's name), ``..w.input..`` (a parameter's row), else ``..r7..``."""
        if self.name:
            return f"..{self.name}.."
        if self.owner.terminal and self.owner.label:
            return f"..{self.owner.label}.{self.owner.row}.."
        return f"..r{self.id}.."


Dim = int | DimVar


@dataclass(frozen=True)
class Row:
    """``beg``, then the row variable's axes (none if ``var`` is None), then ``dims``."""

    beg: tuple[Dim, ...] = ()
    var: RowVar | None = None
    dims: tuple[Dim, ...] = ()

    def __str__(self) -> str:
        parts = [_dim_text(d) for d in self.beg]
        if self.var is not None:
            parts.append(repr(self.var))
        parts += [_dim_text(d) for d in self.dims]
        return ",".join(parts)


def _dim_text(d: Dim) -> str:
    d = find(d)
    if isinstance(d, DimVar):
        return repr(d)
    return f"{int(d)}*" if stretches(d) else repr(d) if basis_of(d) else f"{int(d)}"


def find(d: Dim) -> Dim:
    while isinstance(d, DimVar) and d.value is not None:
        d = d.value
    return d


def norm(r: Row, *, solve_dims: bool = True) -> Row:
    """``r`` with its solved variables substituted (a row without a variable keeps its axes in
    ``dims``, right-anchored); ``solve_dims=False`` keeps solved dim variables (their labels
    name the axis in a message)."""
    beg, var, dims = r.beg, r.var, r.dims
    while var is not None and var.value is not None:
        sub = var.value
        beg, var, dims = beg + sub.beg, sub.var, sub.dims + dims
    if solve_dims:
        beg, dims = tuple(find(d) for d in beg), tuple(find(d) for d in dims)
    if var is None:
        return Row((), None, beg + dims)
    return Row(beg, var, dims)


def ground(r: Row) -> tuple[int, ...] | None:
    r = norm(r)
    if r.var is not None or any(isinstance(d, DimVar) for d in r.dims):
        return None
    return r.dims  # type: ignore[return-value]


def vars_of(r: Row) -> Iterator[DimVar | RowVar]:
    r = norm(r)
    if r.var is not None:
        yield r.var
    for d in r.beg + r.dims:
        if isinstance(d, DimVar):
            yield d


@dataclass(eq=False)
class SymShape:
    """The three rows of an open shape."""

    batch: Row
    input: Row
    output: Row

    def row(self, name: str) -> Row:
        return getattr(self, name)

    def rows(self) -> Iterator[Row]:
        yield self.batch
        yield self.input
        yield self.output

    def concrete(self) -> Shape | None:
        rows = {name: ground(self.row(name)) for name in ROW_NAMES}
        if any(r is None for r in rows.values()):
            return None
        return Shape(rows["batch"], rows["output"], rows["input"])  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{norm(self.batch)}|{norm(self.input)}->{norm(self.output)}"

    @staticmethod
    def of(shape: Shape) -> SymShape:
        return SymShape(Row((), None, shape.batch), Row((), None, shape.row("input")),
                        Row((), None, shape.output))


def open_row(owner: Owner, dims: tuple[int, ...] | None) -> Row:
    """A row of ``dims``, or (None) a bare row variable of ``owner``."""
    if dims is not None:
        return Row((), None, dims)
    return Row((), RowVar(owner), ())


# --- constraints --------------------------------------------------------------------------------


class ShapeError(ValueError):
    """A shape conflict, naming what met."""


@dataclass(eq=False)
class Origin:
    """The op a constraint comes from: its name (an op or an einsum spec) and operands."""

    what: str
    operands: tuple[Tensor, ...] = ()

    def describe(self) -> str:
        ops = "; ".join(f"{t.label} {t.shape_text()}" for t in self.operands)
        return f"{self.what}" + (f" over {ops}" if ops else "")


def _fail(origin: Origin, msg: str) -> ShapeError:
    return ShapeError(f"{origin.describe()}: {msg}")


class Constraint:
    """A relation among rows or dims; ``done`` once it holds whatever the variables become."""

    origin: Origin
    done: bool = False

    @property
    def watched(self) -> set[int]:
        w = self.__dict__.get("_watched")
        if w is None:
            w = self.__dict__["_watched"] = set()
        return w

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        raise NotImplementedError

    def step(self) -> tuple[bool, list[Constraint]]:
        """Solve what can be solved now: (discharged?, constraints it reduces to)."""
        raise NotImplementedError


def _vars_in(items: Iterable[Row | Dim]) -> Iterator[DimVar | RowVar]:
    for x in items:
        if isinstance(x, Row):
            yield from vars_of(x)
        else:
            x = find(x)
            if isinstance(x, DimVar):
                yield x


def _bind_dim(v: DimVar, value: Dim, origin: Origin) -> None:
    value = find(value)
    if value is v:
        return
    if isinstance(value, DimVar):
        _set(value, "at_least", max(value.at_least, v.at_least))
        _set(value, "glb", _meet_dim(value.glb, v.glb))
        _union(v.group, value.group)
    elif value < v.at_least:
        raise _fail(origin, f"dimension {int(value)} for {_where(v)} is below {v.at_least}, "
                            f"the least a fixed index there needs")
    _set(v, "value", value)
    _wake(v)


def _bind_row(v: RowVar, value: Row, origin: Origin) -> None:
    value = norm(value)
    if value.var is v:
        if value.beg or value.dims:
            raise _fail(origin, f"Infinite number of axes by self-reference: {v!r} = {value}")
        return
    for u in vars_of(value):
        if isinstance(u, DimVar) and u.owner.label == "" and v.owner.label:
            _set(u, "owner", v.owner)
        if isinstance(u, RowVar) and u.owner.label == "" and v.owner.label:
            _set(u, "owner", v.owner)
        _union(v.group, u.group)
    _set(v, "value", value)
    _wake(v)


def _where(v: DimVar | RowVar) -> str:
    o = v.owner
    kind = "the row variable" if isinstance(v, RowVar) else "an axis"
    return f"{kind} {v!r} of {o.label}'s {o.row} row" if o.label else f"{kind} {v!r}"


def _fresh_like(v: RowVar) -> RowVar:
    return RowVar(v.owner, v.group)


def _fresh_dims(v: RowVar, n: int) -> tuple[DimVar, ...]:
    return tuple(DimVar(v.owner, v.group) for _ in range(n))


def _in_row(row: str) -> str:
    return f" in the {row} row" if row else ""


def _named(*ds: Dim) -> str:
    """`` 'i'``: the first label a chain of these dims passes through (for messages)."""
    for d in ds:
        while isinstance(d, DimVar):
            if d.name:
                return f" {d.name!r}"
            d = d.value  # type: ignore[assignment]
    return ""


def _same_dim(a: int, b: int) -> bool:
    return same_dim(a, b)


def _meet_dim(a: int | None, b: int | None) -> int | None:
    """The greatest lower bound of two sizes under broadcasting (a 1 that stretches is the
    top; two that clash demote to it, as upstream's solver does)."""
    if a is None:
        return b
    if b is None or stretches(b):
        return a
    if stretches(a):
        return b
    return a if same_dim(a, b) else BCAST_ONE


def _meet_row(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if a is None:
        return b
    if b is None:
        return a
    long, short = (a, b) if len(a) >= len(b) else (b, a)
    out = list(long)
    for k in range(1, len(short) + 1):
        out[-k] = _meet_dim(long[-k], short[-k])  # type: ignore[assignment]
    return tuple(out)


@dataclass(eq=False)
class DimEq(Constraint):
    a: Dim
    b: Dim
    origin: Origin

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return (self.a, self.b)

    def step(self) -> tuple[bool, list[Constraint]]:
        a, b = find(self.a), find(self.b)
        if isinstance(a, DimVar):
            _bind_dim(a, b, self.origin)
        elif isinstance(b, DimVar):
            _bind_dim(b, a, self.origin)
        elif not _same_dim(a, b):
            if _named(self.b) and not _named(self.a):  # the label's size first
                a, b = b, a
            what = "different bases" if int(a) == int(b) else "mismatch"
            raise _fail(self.origin, f"solved dimensions for axis{_named(self.a, self.b)}: "
                                     f"{what}: {a!r} and {b!r} must be equal")
        return True, []


@dataclass(eq=False)
class DimIneq(Constraint):
    """``res ⊑ opnd``: equal, or ``opnd`` a 1 that stretches."""

    res: Dim
    opnd: Dim
    origin: Origin
    where: str = ""  # which axis (for messages)

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return (self.res, self.opnd)

    def step(self) -> tuple[bool, list[Constraint]]:
        res, opnd = find(self.res), find(self.opnd)
        if isinstance(opnd, DimVar):
            if isinstance(res, int):
                _set(opnd, "glb", _meet_dim(opnd.glb, res))
            return False, []
        if stretches(opnd):
            return True, []
        if isinstance(res, DimVar):
            _bind_dim(res, opnd, self.origin)
            return True, []
        if not _same_dim(res, opnd):
            hint = (" (a 1 given by the user does not stretch: make it a number, or give the "
                    "matching size)" if int(opnd) == 1 else "")
            where = f" ({self.where})" if self.where else ""
            if int(res) == int(opnd):
                raise _fail(self.origin, f"solved dimensions for axis{where}: different bases: "
                                         f"{opnd!r} and {res!r}")
            raise _fail(self.origin, f"dimension comparison for axis{where}: mismatch: "
                                     f"{int(opnd)} does not broadcast to {int(res)}{hint}")
        return True, []


@dataclass(eq=False)
class AtLeast(Constraint):
    d: Dim
    n: int
    origin: Origin

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return (self.d,)

    def step(self) -> tuple[bool, list[Constraint]]:
        d = find(self.d)
        if isinstance(d, DimVar):
            _set(d, "at_least", max(d.at_least, self.n))
            return True, []
        if int(d) < self.n:
            raise _fail(self.origin, f"a fixed index needs an axis of at least {self.n}, the "
                                     f"axis has {int(d)}")
        return True, []


@dataclass(eq=False)
class DimRule(Constraint):
    """A relation among dims solved once enough of them are known (a convolution's output
    from its input, a concatenation's total): ``solve(known)`` gives the dims it fixes."""

    dims: tuple[Dim, ...]
    solve: Callable[[list[int | None]], list[int | None]]
    origin: Origin

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return self.dims

    def step(self) -> tuple[bool, list[Constraint]]:
        known = [None if isinstance(d, DimVar) else d for d in map(find, self.dims)]
        out = self.solve(known)  # raises ShapeError on a conflict
        new: list[Constraint] = []
        for d, v in zip(self.dims, out, strict=True):
            if v is not None:
                new.append(DimEq(d, v, self.origin))
        return all(v is not None for v in out) and all(k is not None for k in known), new


@dataclass(eq=False)
class RowTotal(Constraint):
    """The rows' totals (products of their sizes) related: ``want(totals)`` gives the total
    each row must have (``None``: no claim yet), from the totals known (``None`` where a row
    is open). A row with one open dim left and its total claimed gets that dim."""

    rows: tuple[Row, ...]
    want: Callable[[list[int | None]], list[int | None]]
    origin: Origin

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return self.rows

    def step(self) -> tuple[bool, list[Constraint]]:
        totals = [None if (g := ground(r)) is None else math.prod(int(d) for d in g)
                  for r in self.rows]
        wanted = self.want(totals)
        new: list[Constraint] = []
        for r, have, want in zip(self.rows, totals, wanted, strict=True):
            if want is None:
                continue
            if have is not None:
                if have != want:
                    raise _fail(self.origin, f"Total_elems constraint: [{norm(r)}] has {have} "
                                             f"cells, not {want}")
                continue
            n = norm(r)
            open_dims = [d for d in n.beg + n.dims if isinstance(d, DimVar)]
            known = math.prod(int(d) for d in n.beg + n.dims if not isinstance(d, DimVar))
            if n.var is None and len(open_dims) == 1:
                if want % known:
                    raise _fail(self.origin, f"Total_elems constraint: {want} not divisible by "
                                             f"{known}")
                new.append(DimEq(open_dims[0], want // known, self.origin))
            elif n.var is not None and not open_dims and want == known:
                _bind_row(n.var, Row(), self.origin)
            elif n.var is not None and not open_dims and want % known == 0:
                _set(n.var, "total", want // known)
        return all(t is not None for t in totals), new


@dataclass(eq=False)
class RowEq(Constraint):
    a: Row
    b: Row
    origin: Origin
    row: str = ""  # which row (for messages)

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return (self.a, self.b)

    def step(self) -> tuple[bool, list[Constraint]]:
        a, b = norm(self.a, solve_dims=False), norm(self.b, solve_dims=False)
        out: list[Constraint] = []
        # the right-anchored axes, from the right; then the left-anchored, from the left
        n = min(len(a.dims), len(b.dims))
        out += [DimEq(a.dims[len(a.dims) - k], b.dims[len(b.dims) - k], self.origin)
                for k in range(1, n + 1)]
        a = Row(a.beg, a.var, a.dims[:len(a.dims) - n])
        b = Row(b.beg, b.var, b.dims[:len(b.dims) - n])
        if a.var is not None and b.var is not None:
            m = min(len(a.beg), len(b.beg))
            out += [DimEq(x, y, self.origin) for x, y in zip(a.beg[:m], b.beg[:m], strict=True)]
            a, b = Row(a.beg[m:], a.var, a.dims), Row(b.beg[m:], b.var, b.dims)
            if a.var is b.var:
                if a.beg or a.dims or b.beg or b.dims:
                    raise _fail(self.origin, "Infinite number of axes by self-reference: "
                                             f"{a} = {b}")
                return True, out
            # one of the rows has axes left over on one side only: the other's variable takes them
            if not a.beg and not a.dims:
                _bind_row(a.var, b, self.origin)
            elif not b.beg and not b.dims:
                _bind_row(b.var, a, self.origin)
            else:  # a = [x] v [], b = [] w [y]: v = w' [y], w = [x] w'
                fresh = _fresh_like(a.var)
                _bind_row(a.var, Row((), fresh, b.dims), self.origin)
                _bind_row(b.var, Row(a.beg, fresh, ()), self.origin)
            return True, out
        if a.var is None and b.var is None:
            if a.dims or b.dims:
                raise _fail(self.origin, f"Number of axes mismatch{_in_row(self.row)}: "
                                         f"[{norm(self.a)}] and [{norm(self.b)}]")
            return True, out
        if a.var is None:
            a, b = b, a
        # a has the variable, b is all right-anchored axes: a.beg from b's left, var the rest
        if len(b.dims) < len(a.beg) + len(a.dims):
            raise _fail(self.origin, f"Number of axes mismatch{_in_row(self.row)}: "
                                     f"[{norm(self.a)}] has more axes than [{norm(self.b)}]")
        out += [DimEq(x, y, self.origin) for x, y in zip(a.beg, b.dims, strict=False)]
        assert a.var is not None
        _bind_row(a.var, Row((), None, b.dims[len(a.beg):]), self.origin)
        return True, out


@dataclass(eq=False)
class RowIneq(Constraint):
    """``res ⊑ opnd``: ``res`` has at least ``opnd``'s axes; aligned from the outer edges
    (``dims`` from the right, ``beg`` from the left), each pair ``res ⊑ opnd``; the axes
    ``opnd`` lacks broadcast."""

    res: Row
    opnd: Row
    origin: Origin
    row: str = ""  # which row (for messages)

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return (self.res, self.opnd)

    def step(self) -> tuple[bool, list[Constraint]]:
        res, opnd = norm(self.res), norm(self.opnd)
        out: list[Constraint] = []
        # res must have at least opnd's right-anchored axes: its variable grows to give them
        if len(res.dims) < len(opnd.dims):
            if res.var is None:
                raise _fail(self.origin, f"Too many axes in an operand{_in_row(self.row)}: "
                                         f"[{opnd}] has more axes than [{res}]"
                                         f"{_matmul_hint(self.origin)}")
            if res.beg:  # its variable or its leading axes may hold them: wait until known
                return False, []
            fresh = _fresh_like(res.var)
            extra = _fresh_dims(res.var, len(opnd.dims) - len(res.dims))
            _bind_row(res.var, Row((), fresh, extra), self.origin)
            res = norm(res)
        n = len(opnd.dims)
        out += [DimIneq(res.dims[len(res.dims) - k], opnd.dims[n - k], self.origin,
                        f"the {self.row} row's axis {-k} from the right")
                for k in range(1, n + 1)]
        rest = res.dims[:len(res.dims) - n]
        if opnd.var is None:
            return True, out
        # opnd's left-anchored axes: from res's left (its beg, then what lies right of it)
        if res.var is not None and len(res.beg) < len(opnd.beg):
            if rest:  # its variable or its trailing axes may hold them: wait until known
                return False, out
            fresh = _fresh_like(res.var)
            extra = _fresh_dims(res.var, len(opnd.beg) - len(res.beg))
            _bind_row(res.var, Row(extra, fresh, ()), self.origin)
            res = norm(Row(res.beg, res.var, rest))
            rest = res.dims
        left = res.beg + rest if res.var is None else res.beg
        if len(left) < len(opnd.beg):
            raise _fail(self.origin, f"Too many axes in an operand{_in_row(self.row)}: [{opnd}] "
                                     f"has more axes than [{norm(self.res)}]")
        out += [DimIneq(x, y, self.origin, f"the {self.row} row's axis {k} from the left")
                for k, (x, y) in enumerate(zip(left, opnd.beg, strict=False))]
        middle = (Row((), None, left[len(opnd.beg):]) if res.var is None
                  else Row(res.beg[len(opnd.beg):], res.var, rest))
        out.append(_VarIneq(middle, opnd.var, self.origin))
        return True, out


@dataclass(eq=False)
class _VarIneq(Constraint):
    """``res ⊑ v`` for a bare row variable ``v`` (what a row inequality reduces to): ``v``'s
    greatest lower bound meets ``res``; checked again once ``v`` is solved."""

    res: Row
    var: RowVar
    origin: Origin

    def rows_and_dims(self) -> Iterable[Row | Dim]:
        return (self.res, Row((), self.var, ()))

    def step(self) -> tuple[bool, list[Constraint]]:
        if self.var.value is not None:
            return True, [RowIneq(self.res, Row((), self.var, ()), self.origin)]
        g = ground(self.res)
        if g is not None:
            _set(self.var, "glb", _meet_row(self.var.glb, g))
        return False, []


def _matmul_hint(origin: Origin) -> str:
    if origin.what in ("matmul", "@"):
        return ""
    return ("; maybe using * instead of @? (`*` is pointwise here, OCANNL's `*.`; OCANNL's `*` "
            "is `@`)" if origin.what == "mul" else "")


# --- solving ----------------------------------------------------------------------------------


def _group_of(items: Iterable[Row | Dim]) -> Group | None:
    g = None
    for v in _vars_in(items):
        g = v.group.root() if g is None else _union(g, v.group)
    return g


# A pending constraint is stepped again only when a variable it mentions is bound: each
# variable's watchers, and the constraints woken since the last step.
_watchers: dict[int, list[Constraint]] = {}
_woken: list[Constraint] = []


def _wake(v: DimVar | RowVar) -> None:
    _woken.extend(_watchers.get(v.id, ()))


def _watch(c: Constraint) -> None:
    for v in _vars_in(c.rows_and_dims()):
        if v.id not in c.watched:
            c.watched.add(v.id)
            _watchers.setdefault(v.id, []).append(c)


def _run(cons: Iterable[Constraint]) -> list[Constraint]:
    """Step the constraints, and those their bindings wake, until none is left to step; the
    ones left pending (each watching its variables)."""
    queue = deque(cons)
    queue.extend(_woken)
    _woken.clear()
    pending: dict[int, Constraint] = {}
    while queue:
        c = queue.popleft()
        if c.done:
            continue
        done, new = c.step()
        queue.extend(new)
        if done:
            _set(c, "done", True)
            pending.pop(id(c), None)
        else:
            _watch(c)
            pending[id(c)] = c
        if _woken:
            queue.extend(_woken)
            _woken.clear()
    return [c for c in pending.values() if not c.done]


def add(cons: list[Constraint], tensors: Iterable[Tensor] = ()) -> None:
    """Solve ``cons`` as far as they can be now (with the pending constraints their bindings
    wake); keep what is left pending in its group, with ``tensors`` (open results to fix
    when the group is closed). Undone whole if it raises."""
    with _transaction():
        left = _run(cons)
        for c in left:
            _attach(c)
        for t in tensors:
            if t.sym is not None:
                register(t)


def _attach(c: Constraint) -> None:
    """Keep pending ``c`` in its group (appended; the undo pops it)."""
    g = _group_of(c.rows_and_dims())
    if g is not None:
        g.cons.append(c)
        if _trail is not None:
            _trail.append(g.cons.pop)


def register(t: Tensor) -> None:
    """Keep an open tensor with its groups, to be given its shape when they are closed."""
    assert t.sym is not None
    for r in t.sym.rows():
        for v in vars_of(r):
            g = v.group.root()
            if t not in g.tensors:
                g.tensors.append(t)


def close(t: Tensor) -> None:
    """Fix every variable of ``t``'s groups (upstream's ``finish_inference``), then give every
    tensor of those groups its concrete shape and dims. Undone whole if it raises."""
    if t.sym is None:
        return
    close_vars([v for r in t.sym.rows() for v in vars_of(r)])
    t.shape_inferred()


def close_vars(vs: Iterable[DimVar | RowVar]) -> None:
    """Close the groups of ``vs`` (see :func:`close`)."""
    groups = {id(g): g for g in (v.group.root() for v in vs)}
    seen = [v.id for g in groups.values() for v in _open_vars(g)]
    with _transaction():
        for g in groups.values():
            _close_group(g.root())
    for vid in seen:
        _watchers.pop(vid, None)
    for g in groups.values():
        g = g.root()
        for u in list(g.tensors):
            u.shape_inferred()
        g.tensors = [u for u in g.tensors if u.sym is not None]
        for c in g.cons:  # every variable is bound: nothing is left to wake
            for vid in c.watched:
                _watchers.pop(vid, None)
        g.cons = [c for c in g.cons if not c.done]


def _open_vars(g: Group) -> list[DimVar | RowVar]:
    """The variables of ``g`` (a tensor of ``g`` may have others, in other groups)."""
    seen: dict[int, DimVar | RowVar] = {}
    for c in g.root().cons:
        if not c.done:
            for v in _vars_in(c.rows_and_dims()):
                seen.setdefault(v.id, v)
    for t in g.root().tensors:
        if t.sym is not None:
            for r in t.sym.rows():
                for v in vars_of(r):
                    seen.setdefault(v.id, v)
    root = g.root()
    return sorted((v for v in seen.values() if v.group.root() is root), key=lambda v: v.id)


def _close_group(g: Group) -> None:
    """Upstream's closing stages, in short: (1) a parameter's variables take their greatest
    lower bound, what they meet; (2) a parameter's output row or dim that nothing fixes is
    refused (its batch and input rows, and a row variable beside known axes, are empty: a
    bias's input row); (3) every other row variable is its bound or empty, every other dim
    its bound, its least size, or 1."""
    _run([c for c in g.cons if not c.done])
    for v in _open_vars(g):  # a row variable of a known total: one axis of that total
        if isinstance(v, RowVar) and v.value is None and v.total is not None:
            _bind_row(v, Row((), None, (v.total,)), Origin(f"closing {v!r}"))
            _run(())
    for _ in range(2):
        _propagate_glbs(g)
        for v in _open_vars(g):
            if v.owner.terminal and v.value is None and v.glb is not None:
                _close_var(v, g)
                _run(())
    for v in _open_vars(g):  # dims with a bound first, then discardable components to 0
        if isinstance(v, DimVar) and v.value is None and not v.owner.terminal \
                and v.glb is not None:
            _close_var(v, g)
            _run(())
    for v in _open_vars(g):
        if isinstance(v, DimVar) and v.value is None and v.discardable:
            _bind_dim(v, 0, Origin(f"closing {v!r}"))
            _run(())
    for terminal in (True, False):
        for _ in range(64):
            left = [v for v in _open_vars(g) if v.value is None and v.owner.terminal == terminal]
            if not left:
                break
            if not terminal:
                _propagate_glbs(g)
            for v in left:
                if v.value is None:
                    _close_var(v, g)
                    _run(())
    pending = [c for c in g.root().cons if not c.done]
    if pending:
        raise _fail(pending[0].origin, f"shapes left unsolved: {pending}")


def _close_var(v: DimVar | RowVar, g: Group) -> None:
    origin = Origin(f"closing {v.owner.label or 'the shapes'}")
    if isinstance(v, RowVar):
        if v.glb is not None:
            _bind_row(v, Row((), None, v.glb), origin)
            return
        if v.owner.terminal and v.owner.row == "output" and _bare(v, g):
            raise ShapeError(f"specify the {v.owner.row} dims of {v.owner.label}: nothing it "
                             f"meets fixes them (You forgot to specify the hidden dimension(s) "
                             f"of parameter {v.owner.label})")
        _bind_row(v, Row(), origin)
        return
    if v.glb is not None and int(v.glb) >= v.at_least:
        _bind_dim(v, v.glb, origin)
        return
    if v.at_least:
        _bind_dim(v, v.at_least, origin)
        return
    if v.owner.terminal:
        raise ShapeError(f"specify the {v.owner.row} dims of {v.owner.label}: nothing it meets "
                         f"fixes axis {v!r} (You forgot to specify the hidden dimension(s) "
                         f"of parameter {v.owner.label})")
    _bind_dim(v, BCAST_ONE, origin)


def _bare(v: RowVar, g: Group) -> bool:
    """Whether ``v`` is a whole row of a tensor of ``g`` (not the middle of a row with axes)."""
    for t in g.root().tensors:
        if t.sym is None:
            continue
        for r in t.sym.rows():
            n = norm(r)
            if n.var is v and not n.beg and not n.dims:
                return True
    return False


def _propagate_glbs(g: Group) -> None:
    """Each variable's greatest lower bound meets those of the variables below it (a row
    with no axes and no bound yet claims nothing)."""
    cons = [c for c in g.root().cons if not c.done]
    for _ in range(64):
        changed = False
        for c in cons:
            if isinstance(c, _VarIneq) and c.var.value is None:
                r = norm(c.res)
                if r.var is not None and r.var.glb is None and not r.beg and not r.dims:
                    continue
                mid = () if r.var is None or r.var.glb is None else r.var.glb
                lo = tuple(_glb_dim(d) for d in r.beg) + mid + tuple(_glb_dim(d) for d in r.dims)
                new = _meet_row(c.var.glb, lo)
                if not _same(new, c.var.glb):
                    _set(c.var, "glb", new)
                    changed = True
            elif isinstance(c, DimIneq):
                res, opnd = find(c.res), find(c.opnd)
                if isinstance(opnd, DimVar) and isinstance(res, DimVar) and res.glb is not None:
                    new = _meet_dim(opnd.glb, res.glb)
                    if not _same(new, opnd.glb):
                        _set(opnd, "glb", new)
                        changed = True
        if not changed:
            return


def _glb_dim(d: Dim) -> int:
    d = find(d)
    if isinstance(d, DimVar):
        return d.glb if d.glb is not None else BCAST_ONE
    return d
