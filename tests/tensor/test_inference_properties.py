"""Shape inference with row variables, as properties: random einsum specs (upstream's notation,
``...`` and named ``..r..`` row variables) against ``numpy.einsum``; pointwise broadcasting
against upstream's rule (README §1.2: right-aligned per row, equal sizes or a missing axis);
parameters with no dims taking their rows from their uses (§1.3, §1.4); and the gradients of
row-variable einsums against central finite differences in f64.

Every spec here is built from a random structure (which labels and row variables each slot
writes, in which row and on which side of the row variable), so the expected shapes and the
NumPy subscripts come from that structure, never from the port's parser.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ocannl.tensor as T
from ocannl import Context, train
from ocannl.tensor import Shape

KINDS = ("batch", "input", "output")  # the order of a spec's rows: batch|input->output
LAYOUT = ("batch", "output", "input")  # the order of a buffer's axes
F64 = "f64"

few = settings(max_examples=20, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _values(t: T.Tensor, ctx: Context | None = None) -> np.ndarray:
    ctx, r = (ctx or Context.cpu()).compile(train.forward(t))
    return ctx.run(r).get_values(t)


def _rows(t: T.Tensor) -> dict[str, tuple[int, ...]]:
    s = t.shape
    return {k: tuple(int(d) for d in getattr(s, k)) for k in KINDS}


def _term(label: str, rows: dict[str, tuple[int, ...]], values: np.ndarray) -> T.Tensor:
    return T.term(values, label=label, batch_dims=rows["batch"], input_dims=rows["input"],
                  output_dims=rows["output"], prec=F64)


def _dims(rows: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(d for k in LAYOUT for d in rows[k])


# =============================================================================================
# 1. Random einsum specs with row variables, against numpy.einsum


@dataclass(frozen=True)
class RowPat:
    """One row of one slot: labels left of the row variable, the variable, labels right."""

    beg: tuple[str, ...] = ()
    var: str | None = None
    dims: tuple[str, ...] = ()


Slot = dict[str, RowPat]  # by row kind


@dataclass
class EinsumCase:
    multichar: bool
    sizes: dict[str, int]                   # label -> its size
    row_vars: dict[str, tuple[int, ...]]    # row variable -> the axes it stands for
    operands: list[Slot]
    result: Slot
    full_form: bool                         # write every slot as batch|input->output

    # -- the spec, in upstream's notation
    def _row_text(self, p: RowPat) -> str:
        if self.multichar:
            items = [*p.beg, *([f"..{p.var}.."] if p.var else []), *p.dims]
            # a lone item gets a trailing comma ("abc," is one axis), so that every spec with
            # a label is in multichar mode
            return ", ".join(items) + ("," if len(items) == 1 else "")
        return "".join(p.beg) + ("..." if p.var else "") + "".join(p.dims)

    def _slot_text(self, slot: Slot) -> str:
        b, i, o = (self._row_text(slot[k]) for k in KINDS)
        if self.full_form or (b and i):
            return f"{b}|{i}->{o}"
        if b:
            return f"{b}|{o}"
        if i:
            return f"{i}->{o}"
        return o

    @property
    def spec(self) -> str:
        sep, arrow = ("; ", " => ") if self.multichar else (";", "=>")
        return sep.join(self._slot_text(s) for s in self.operands) + arrow + \
            self._slot_text(self.result)

    # -- what it means
    def row_dims(self, p: RowPat) -> tuple[int, ...]:
        var = self.row_vars[p.var] if p.var else ()
        return tuple(self.sizes[x] for x in p.beg) + var + tuple(self.sizes[x] for x in p.dims)

    def rows(self, slot: Slot) -> dict[str, tuple[int, ...]]:
        return {k: self.row_dims(slot[k]) for k in KINDS}

    def numpy_subscripts(self) -> str:
        letters = iter(string.ascii_letters)
        lab = {name: next(letters) for name in self.sizes}
        var = {v: "".join(next(letters) for _ in axes) for v, axes in self.row_vars.items()}

        def subs(slot: Slot) -> str:
            out = ""
            for k in LAYOUT:
                p = slot[k]
                out += "".join(lab[x] for x in p.beg) + (var[p.var] if p.var else "")
                out += "".join(lab[x] for x in p.dims)
            return out

        return ",".join(subs(s) for s in self.operands) + "->" + subs(self.result)

    def labels_of(self, slot: Slot) -> set[str]:
        return {x for k in KINDS for x in (*slot[k].beg, *slot[k].dims)}

    def vars_of(self, slot: Slot) -> set[str]:
        return {slot[k].var for k in KINDS if slot[k].var}


@st.composite
def einsum_cases(draw, n_ops: int | None = None, max_size: int = 4, max_labels: int = 3,
                 var_budget: int = 3, batch_var_axes: tuple[int, int] | None = None,
                 ) -> EinsumCase:
    """A random spec over 1 or 2 operands: row variables (``...`` per row in single-char
    mode, named ``..r..`` / ``..s..`` placed in any row in multichar mode) standing for up to
    ``var_budget`` axes in all, up to ``max_labels`` label axes per operand (a label may repeat:
    a diagonal), and a result that keeps some labels and row variables (in any row) and sums
    the others. ``batch_var_axes``: force the batch ``...`` of every slot, with that many
    axes (the gradient property's ``...|i->o; ...|j->i => ...|j->o`` style)."""
    multichar = draw(st.booleans())
    if batch_var_axes is not None:
        multichar = False
    n = n_ops or draw(st.integers(1, 2))
    names = [f"d{k}" for k in range(5)] if multichar else list("abcde")
    sizes = {x: draw(st.integers(1, max_size), label=f"size {x}") for x in names}
    var_names = ["r", "s"] if multichar else ["..." + k for k in KINDS]
    row_vars: dict[str, tuple[int, ...]] = {}
    budget = var_budget
    for v in var_names:
        if batch_var_axes is not None and v == "...batch":
            k = draw(st.integers(*batch_var_axes))
        else:
            k = draw(st.integers(0, max(0, min(2, budget))))
        budget -= k
        row_vars[v] = tuple(draw(st.lists(st.integers(1, max_size), min_size=k, max_size=k)))

    def slot_with(vars_by_kind: dict[str, str | None], n_labels: int,
                  pool: list[str], unique: bool) -> Slot:
        beg: dict[str, list[str]] = {k: [] for k in KINDS}
        end: dict[str, list[str]] = {k: [] for k in KINDS}
        chosen = (draw(st.lists(st.sampled_from(pool), unique=True, max_size=n_labels))
                  if unique else [draw(st.sampled_from(pool)) for _ in range(n_labels)])
        for x in chosen:
            k = draw(st.sampled_from(KINDS))
            left = vars_by_kind[k] is not None and draw(st.booleans())
            (beg if left else end)[k].append(x)
        return {k: RowPat(tuple(beg[k]), vars_by_kind[k], tuple(end[k])) for k in KINDS}

    operands = []
    for j in range(n):
        if multichar:
            free = list(var_names)
            vbk: dict[str, str | None] = {}
            for k in KINDS:
                v = draw(st.sampled_from([None, *free]))
                vbk[k] = v
                if v is not None:
                    free.remove(v)
        else:
            vbk = {k: ("..." + k if (batch_var_axes is not None and k == "batch")
                       or draw(st.booleans()) else None) for k in KINDS}
        n_labels = draw(st.integers(1 if j == 0 else 0, max_labels))
        operands.append(slot_with(vbk, n_labels, names, unique=False))

    used_vars = [v for v in var_names if any(v in {s[k].var for k in KINDS} for s in operands)]
    kept = [v for v in used_vars
            if (batch_var_axes is not None and v == "...batch") or draw(st.booleans())]
    if multichar:
        places = draw(st.permutations(KINDS))
        res_vars = {k: None for k in KINDS} | dict(zip(places, kept, strict=False))
    else:
        res_vars = {k: ("..." + k if "..." + k in kept else None) for k in KINDS}
    present = [x for x in names if any(x in (*s[k].beg, *s[k].dims)
                                       for s in operands for k in KINDS)]
    result = (slot_with(res_vars, len(present), present, unique=True) if present
              else {k: RowPat((), res_vars[k], ()) for k in KINDS})
    return EinsumCase(multichar, sizes, row_vars, operands, result, draw(st.booleans()))


def _arrays(case: EinsumCase, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1.0, 1.0, _dims(case.rows(s))) for s in case.operands]


def _check_einsum(case: EinsumCase, seed: int, inferred_last: bool = False) -> None:
    arrays = _arrays(case, seed)
    ts = [_term(f"x{j}", case.rows(s), a) for j, (s, a) in enumerate(
        zip(case.operands, arrays, strict=True))]
    if inferred_last:
        ts[-1] = T.param("w", prec=F64)
    out = T.einsum(case.spec, *ts)
    want_rows = case.rows(case.result)
    assert _rows(out) == want_rows, (case.spec, _rows(out), want_rows)
    ctx = Context.cpu()
    if inferred_last:
        w_rows = case.rows(case.operands[-1])
        assert _rows(ts[-1]) == w_rows, (case.spec, _rows(ts[-1]), w_rows)
        ctx = train.init_params(ctx, out)
        arrays[-1] = ctx.get_values(ts[-1])
    got = _values(out, ctx)
    want = np.einsum(case.numpy_subscripts(), *arrays)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12,
                               err_msg=f"{case.spec} ({case.numpy_subscripts()})")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=einsum_cases(), seed=st.integers(0, 2**31 - 1))
def test_random_row_variable_einsums_match_numpy(case: EinsumCase, seed: int) -> None:
    """The result's rows are the result slot's (labels' sizes, row variables' axes where
    written) and its values numpy.einsum's over the same arrays (laid out batch, output,
    input), for 1 or 2 operands, single-char and multichar specs."""
    _check_einsum(case, seed)


def _inferable_last(case: EinsumCase) -> bool:
    """Whether the last operand's rows are all fixed by the first operand through the spec
    (every label and row variable it writes is the first's), and its batch row is empty (a
    parameter made without dims has an empty batch row)."""
    if len(case.operands) < 2:
        return False
    last, first = case.operands[-1], case.operands[0]
    b = last["batch"]
    return (not b.beg and not b.dims and not (b.var and case.row_vars[b.var])
            and case.labels_of(last) <= case.labels_of(first)
            and case.vars_of(last) <= case.vars_of(first))


@few
@given(data=st.data(), seed=st.integers(0, 2**31 - 1))
def test_a_parameter_without_dims_takes_its_einsum_slot(data, seed: int) -> None:
    """``T.param("w")`` as an einsum's second operand: its rows are its slot's, every label and
    row variable of the slot being fixed by the first operand (the equations run both ways),
    and the values are numpy.einsum's over its initial values."""
    case = data.draw(einsum_cases(n_ops=2).filter(_inferable_last), label="case")
    _check_einsum(case, seed, inferred_last=True)


@pytest.mark.parametrize("spec,rows,want", [
    # the README's multichar example with named row variables
    ("a, ..r.., b; ..r.., c => a, ..r.., c",
     [{"batch": (), "input": (), "output": (2, 3, 4)},
      {"batch": (), "input": (), "output": (3, 5)}],
     "arb,rc->arc"),
    # a named row variable that changes rows: batch axes of x become output axes of the result
    ("..v..|i; i->j => |->..v.., j",
     [{"batch": (2, 3), "input": (), "output": (4,)},
      {"batch": (), "input": (4,), "output": (5,)}],
     "xyi,ji->xyj"),
    # the batch row variable summed away, the output one kept
    ("...|...=>...",
     [{"batch": (2, 3), "input": (), "output": (4, 2)}], "xyab->ab"),
])
def test_row_variable_examples(spec, rows, want):
    rng = np.random.default_rng(7)
    arrays = [rng.uniform(-1, 1, _dims(r)) for r in rows]
    out = T.einsum(spec, *[_term(f"x{j}", r, a) for j, (r, a) in enumerate(
        zip(rows, arrays, strict=True))])
    np.testing.assert_allclose(_values(out), np.einsum(want, *arrays), rtol=1e-12)


# =============================================================================================
# 2. Pointwise broadcasting against upstream's rule (README §1.2)

DIM = st.sampled_from([2, 3, 4])
ROW = st.lists(DIM, max_size=3).map(tuple)
Rows = dict[str, tuple[int, ...]]


def reference_row(ra: tuple[int, ...], rb: tuple[int, ...]) -> tuple[int, ...] | None:
    """``res ⊑ a`` and ``res ⊑ b`` for ground rows with no stretching 1: aligned from the
    right, each pair equal or one side missing (rank broadening); None if refused."""
    out = []
    for k in range(1, max(len(ra), len(rb)) + 1):
        da = ra[-k] if k <= len(ra) else None
        db = rb[-k] if k <= len(rb) else None
        if da is not None and db is not None and da != db:
            return None
        out.append(da if da is not None else db)
    return tuple(reversed(out))


def reference(a: Rows, b: Rows) -> Rows | None:
    rows = {k: reference_row(a[k], b[k]) for k in KINDS}
    return None if any(r is None for r in rows.values()) else rows  # type: ignore[return-value]


@st.composite
def broadcast_pairs(draw) -> tuple[Rows, Rows]:
    """Two shapes: independent rows, or one made from the other by dropping leading axes of
    each row (rank broadening), sometimes with one size changed (a refusal)."""
    a = {k: draw(ROW) for k in KINDS}
    mode = draw(st.sampled_from(["independent", "suffix", "suffix-changed"]))
    b = {}
    for k in KINDS:
        if mode == "independent":
            b[k] = draw(ROW)
            continue
        r = a[k][draw(st.integers(0, len(a[k]))):]
        if mode == "suffix-changed" and r and draw(st.booleans()):
            j = draw(st.integers(0, len(r) - 1))
            r = r[:j] + (draw(DIM),) + r[j + 1:]
        b[k] = r
    return (b, a) if draw(st.booleans()) else (a, b)


def numpy_view(x: np.ndarray, rows: Rows, res: Rows) -> np.ndarray:
    """``x`` with size-1 axes put in front of each row so that NumPy broadcasts it as the
    rows broadcast."""
    return x.reshape(tuple(d for k in LAYOUT for d in
                           (1,) * (len(res[k]) - len(rows[k])) + rows[k]))


@few
@given(ab=broadcast_pairs(), seed=st.integers(0, 2**31 - 1))
def test_pointwise_broadcasting_follows_upstreams_rule(ab: tuple[Rows, Rows], seed: int):
    """``a + b`` over two terms: its rows are the reference rule's, its values NumPy's
    broadcast sum after reordering; where the rule refuses, building it raises ValueError."""
    ra, rb = ab
    rng = np.random.default_rng(seed)
    av, bv = rng.uniform(-1, 1, _dims(ra)), rng.uniform(-1, 1, _dims(rb))
    a, b = _term("a", ra, av), _term("b", rb, bv)
    want = reference(ra, rb)
    if want is None:
        with pytest.raises(ValueError):
            a + b  # noqa: B018
        return
    out = a + b
    assert _rows(out) == want
    np.testing.assert_allclose(_values(out),
                               numpy_view(av, ra, want) + numpy_view(bv, rb, want), rtol=1e-14)


def _refines(res: tuple[int, ...], opnd: tuple[int, ...]) -> bool:
    """``res ⊑ opnd`` for ground rows: res has at least opnd's axes, equal from the right."""
    return len(res) >= len(opnd) and reference_row(res, opnd) == res


@few
@given(ab=broadcast_pairs().filter(lambda ab: bool(ab[1]["output"] and ab[1]["input"])),
       seed=st.integers(0, 2**31 - 1))
def test_broadcasting_through_an_inferred_parameter(ab: tuple[Rows, Rows], seed: int):
    """``a + (b + w)`` with ``w = T.param("w")``: the same result rows (and refusals) as
    ``a + b``; w refines b and the result refines w (upstream's GLB closing gives w the whole
    result's rows; "close down when known" would give it b's: both pass), and the values are
    NumPy's over w's initial values. b's output and input rows are non-empty, so w meets
    axes in each of its open rows."""
    ra, rb = ab
    rng = np.random.default_rng(seed)
    av, bv = rng.uniform(-1, 1, _dims(ra)), rng.uniform(-1, 1, _dims(rb))
    a, b, w = _term("a", ra, av), _term("b", rb, bv), T.param("w", prec=F64)
    want = reference(ra, rb)
    if want is None:
        with pytest.raises(ValueError):
            out = a + (b + w)
            _ = out.shape
        return
    out = a + (b + w)
    assert _rows(out) == want
    rw = _rows(w)
    assert rw["batch"] == (), rw
    for k in ("input", "output"):
        assert _refines(rw[k], rb[k]) and _refines(want[k], rw[k]), (k, rw, rb, want)
    ctx = train.init_params(Context.cpu(), out)
    wv = ctx.get_values(w)
    np.testing.assert_allclose(
        _values(out, ctx),
        numpy_view(av, ra, want) + (numpy_view(bv, rb, want) + numpy_view(wv, rw, want)),
        rtol=1e-14)


NONEMPTY_ROW = st.lists(DIM, min_size=1, max_size=3).map(tuple)


@few
@given(rx=st.fixed_dictionaries({"batch": ROW, "input": NONEMPTY_ROW, "output": NONEMPTY_ROW}),
       seed=st.integers(0, 2**31 - 1))
def test_a_parameter_without_dims_takes_the_rows_it_is_added_to(rx: Rows, seed: int):
    """``x + w``, ``w = T.param("w")``: w gets x's output and input rows; its batch row stays
    empty (a parameter's batch row is empty unless given: upstream's #544, README §5), so it
    broadcasts over x's batch axes; the sum has x's rows."""
    xv = np.random.default_rng(seed).uniform(-1, 1, _dims(rx))
    x, w = _term("x", rx, xv), T.param("w", prec=F64)
    out = x + w
    assert w.shape == Shape((), rx["output"], rx["input"])
    assert _rows(out) == rx
    ctx = train.init_params(Context.cpu(), out)
    wv = ctx.get_values(w)
    np.testing.assert_allclose(_values(out, ctx), xv + wv, rtol=1e-14)


@few
@given(rx=st.fixed_dictionaries({"batch": ROW, "input": ROW, "output": NONEMPTY_ROW}),
       k=st.lists(DIM, min_size=1, max_size=2).map(tuple), seed=st.integers(0, 2**31 - 1))
def test_a_parameters_input_row_is_inferred_by_compose(rx: Rows, k, seed: int):
    """``w @ x`` (upstream's ``*``, Compose: ``w.input ⊑ x.output``; the result's batch from
    x, its input x's, its output w's), ``w = T.param("w", output_dims=k)``: w's input row is
    x's output row, the product contracts it."""
    xv = np.random.default_rng(seed).uniform(-1, 1, _dims(rx))
    x, w = _term("x", rx, xv), T.param("w", output_dims=k, prec=F64)
    out = w @ x
    assert w.shape == Shape((), k, rx["output"])
    assert _rows(out) == {"batch": rx["batch"], "input": rx["input"], "output": k}
    ctx = train.init_params(Context.cpu(), out)
    wv = ctx.get_values(w)
    nb, no, ni = (int(np.prod(rx[r], dtype=int)) for r in LAYOUT)
    want = np.einsum("ko,boi->bki", wv.reshape(-1, no), xv.reshape(nb, no, ni))
    np.testing.assert_allclose(_values(out, ctx), want.reshape(_dims(_rows(out))), rtol=1e-12)


# --- regressions: parameters silently closed ------------------------------------------------
# README §1.4: "Parameters are never silently closed": a parameter's row that nothing it meets
# fixes is refused ("You forgot to specify the hidden dimension(s)"), as ``T.sum(T.param("w"))``
# is. Upstream's own case (cases.json, test_param_shape_error.ml L65/L76): ``{ x } + { y }``
# raises. At 5016524 the port closed these to empty rows instead (an open op result's row,
# bounded by nothing, counted as an empty lower bound of the parameter's row).


def test_two_parameters_without_dims_added_are_refused():
    x, y = T.param("x", prec=F64), T.param("y", prec=F64)
    with pytest.raises(ValueError, match="forgot to specify"):
        _ = (x + y).shape


def test_a_parameters_output_row_fixed_by_nothing_is_refused():
    """``w @ x`` with ``w = T.param("w")``: x fixes w's input row, nothing fixes its output."""
    x = T.term(np.ones((2, 3)), label="x", batch_dims=(2,), output_dims=(3,), prec=F64)
    w = T.param("w", prec=F64)
    with pytest.raises(ValueError, match="forgot to specify"):
        _ = (w @ x).shape


# =============================================================================================
# 3. Gradients of row-variable einsums against central finite differences (f64)


def _check_gradients(case: EinsumCase, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ps = [T.param(f"p{j}", batch_dims=r["batch"], input_dims=r["input"],
                  output_dims=r["output"], prec=F64)
          for j, r in enumerate(case.rows(s) for s in case.operands)]
    vals = [rng.uniform(-1, 1, p.dims) for p in ps]
    out = T.einsum(case.spec, *ps)
    assert _rows(out) == case.rows(case.result)
    r = _term("r", _rows(out), rng.uniform(-1, 1, out.dims))
    loss = T.sum(out * r)
    ctx = Context.cpu()
    for p, v in zip(ps, vals, strict=True):
        ctx.set_values(p, v)
    ctx, routine = ctx.compile(train.grad_update(loss))
    ctx.run(routine)
    grads = [ctx.get_values(p.grad).copy() for p in ps]
    out_np = np.einsum(case.numpy_subscripts(), *vals)
    scale = max(1.0, float(np.sum(np.abs(out_np * ctx.get_values(r)))))
    # the loss is linear in each parameter (each is one operand, read once per cell), so a
    # central difference is its derivative at any step: a large one keeps rounding small
    eps = 0.5
    for p, v, g in zip(ps, vals, grads, strict=True):
        fd = np.zeros_like(v)
        for idx in np.ndindex(v.shape):
            losses = []
            for sign in (1.0, -1.0):
                moved = v.copy()
                moved[idx] += sign * eps
                ctx.set_values(p, moved)
                ctx.run(routine)
                losses.append(ctx.get_value(loss))
            fd[idx] = (losses[0] - losses[1]) / (2 * eps)
        ctx.set_values(p, v)
        np.testing.assert_allclose(g, fd, rtol=1e-9, atol=1e-9 * scale,
                                   err_msg=f"gradient of {p.label} in {case.spec}")
    # and the backprop gradient is the analytic one: d(sum(out * r))/dp_j as an einsum
    rv = ctx.get_values(r)
    subs = case.numpy_subscripts()
    ins, res = subs.split("->")
    ins_l = ins.split(",")
    for j, g in enumerate(grads):
        if len(set(ins_l[j])) != len(ins_l[j]):
            continue  # a diagonal read: the gradient is an einsum that writes a diagonal
        others = [k for k in range(len(ps)) if k != j]
        spec = ",".join([res, *(ins_l[k] for k in others)]) + "->" + ins_l[j]
        lone = set(ins_l[j]) - set(res) - {c for k in others for c in ins_l[k]}
        if lone:  # summed within p_j alone: broadcast back over it
            continue
        np.testing.assert_allclose(g, np.einsum(spec, rv, *(vals[k] for k in others)),
                                   rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=einsum_cases(n_ops=2, max_size=3, var_budget=3, batch_var_axes=(1, 2)),
       seed=st.integers(0, 2**31 - 1))
def test_row_variable_einsum_gradients_match_finite_differences(case: EinsumCase, seed: int):
    """Two parameters (f64) under a random single-char spec whose batch ``...`` stands for 1
    or 2 axes in every slot (and other rows' ``...`` maybe), loss ``sum(einsum * r)``: every
    backprop gradient equals its central finite difference, cell by cell."""
    _check_gradients(case, seed)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=einsum_cases(max_size=3, var_budget=3), seed=st.integers(0, 2**31 - 1))
def test_any_einsum_gradients_match_finite_differences(case: EinsumCase, seed: int):
    """As above over the unrestricted specs (1 or 2 operands, multichar named row variables
    in any row, summed row variables, diagonals)."""
    _check_gradients(case, seed)


@pytest.mark.parametrize("batch", [(2,), (2, 3)])
def test_batched_matmul_spec_gradients(batch):
    """The brief's example: ``...|i->o; ...|j->i => ...|j->o`` with ``...`` of 1 and 2 axes."""
    case = EinsumCase(
        multichar=False, sizes={"i": 3, "o": 2, "j": 4},
        row_vars={"...batch": batch, "...input": (), "...output": ()},
        operands=[{"batch": RowPat((), "...batch", ()), "input": RowPat(dims=("i",)),
                   "output": RowPat(dims=("o",))},
                  {"batch": RowPat((), "...batch", ()), "input": RowPat(dims=("j",)),
                   "output": RowPat(dims=("i",))}],
        result={"batch": RowPat((), "...batch", ()), "input": RowPat(dims=("j",)),
                "output": RowPat(dims=("o",))},
        full_form=True)
    assert case.spec == "...|i->o;...|j->i=>...|j->o"
    _check_gradients(case, seed=11)
