"""Differential runs: every routine a context compiles, run again by the reference interpreter
(``ocannl.ir.interpret``) on the inputs the backend's run saw, every node it wrote compared.

Two things have no defined bits, and a test may borrow them from the CPU backend (``Lender``):
a BLAS product's summation order, and the last bits of the math functions (``interpret.ULP``:
exp, log, tanh, sigmoid, erf, pow). Each borrowed piece is run alone, as a routine of one item or
one op, on the interpreter's own values; everything else (the order of the items, projections,
padding, reductions' order, roundings, groups, registers) is the interpreter's, so a lowering or
rendering bug still shows. The borrowed pieces are checked apart: products against an f64 product
with a bound scaled by the magnitude of their terms, ops by their ulp sweep.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from ocannl import Context
from ocannl.ir import interpret
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.lowering import Gemm, Lowered, batch_offsets, nodes_of
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import MemoryMode, Tnode

INEXACT = tuple(op for op, ulp in interpret.ULP.items() if ulp)
# A borrowed product is checked on this many of its rows, at this many of its batch points.
SAMPLE_ROWS, SAMPLE_BATCH = 16, 8


@dataclass
class Tally:
    """What a differential run compared: nodes (``compared``, ``exact``), borrowed products and
    ops, and the worst product error against its bound."""

    compared: int = 0
    exact: int = 0  # passed the check
    bitwise: int = 0  # of those, the same bits (any NaN equal to any NaN)
    routines: int = 0
    gemms: int = 0
    op_calls: dict[str, int] = field(default_factory=dict)
    worst_gemm: float = 0.0  # max |blas - f64| / bound over the borrowed products
    mismatches: list[str] = field(default_factory=list)


class Lender:
    """A CPU context of its own that runs single lowered items and single ops on given values."""

    def __init__(self, tally: Tally) -> None:
        self.ctx = Context.cpu()
        self.tally = tally
        self._items: dict[int, tuple] = {}  # id(item) -> its routine, buffers, nodes
        self._ops: dict[tuple, tuple] = {}  # (op, dtypes, size) -> its code and nodes
        self._op_routines: dict[tuple, tuple] = {}  # the same key -> as ``_items``

    def _run(self, code: list[Lowered], key: object, table: dict, inputs: dict[int, np.ndarray],
             outputs: list[Tnode]) -> list[np.ndarray]:
        if key not in table:
            _, routine = self.ctx.compile_lowered("borrowed", code, local_check=False)
            nodes = [n for n in nodes_of(code) if n.memory_mode is not MemoryMode.virtual]
            table[key] = (routine, dict(zip((n.id for n in nodes), routine.buffers,
                                            strict=True)), {n.id: n for n in nodes})
        routine, bufs, nodes = table[key]
        backend = self.ctx._backend
        for nid, v in inputs.items():
            backend.write(nodes[nid], bufs[nid], np.asarray(v).reshape(-1))
        routine.call()
        return [backend.read(n, bufs[n.id]).reshape(n.dims) for n in outputs]

    def gemm(self, item: Gemm, values: interpret.Values) -> None:
        """The product as the CPU backend computes it alone (its BLAS, its blocks), on the
        interpreter's values; checked against the f64 product."""
        lhs = item.assign.lhs
        inputs = {v.node.id: values[v.node.id] for v in (item.a, item.b)}
        if not item.assign.reset:
            inputs[lhs.id] = values[lhs.id]
        old = values[lhs.id].astype(np.float64)
        [out] = self._run([item], id(item), self._items, inputs, [lhs])
        values[lhs.id][...] = out
        self.tally.gemms += 1
        _check_product(item, values, old, out, self.tally)

    def op(self, name: str) -> Callable[..., np.ndarray]:
        def run(*args: np.ndarray) -> np.ndarray:
            dt = np.result_type(*args)
            common = np.broadcast_shapes(*(np.shape(x) for x in args))
            arrays = [np.array(np.broadcast_to(a, common)) for a in args]
            shape = arrays[0].shape
            size = max(1, math.prod(shape))
            n = 1 << max(10, (size - 1).bit_length())
            key = (name, tuple(a.dtype.str for a in arrays), n)
            if key not in self._ops:
                ins = [Tnode(f"borrow_in{k}", (n,), _prec(a.dtype)) for k, a in enumerate(arrays)]
                out = Tnode("borrow_out", (n,), _prec(dt))
                code = self.ctx.lower(Comp((Accum(out, (0,), "=", apply(
                    name, *(Get(t, (0,)) for t in ins)), (n,)),)))
                self._ops[key] = (code, ins, out)
            code, ins, out = self._ops[key]
            flat = {t.id: np.resize(a.reshape(-1), n).astype(a.dtype)
                    for t, a in zip(ins, arrays, strict=True)}
            [got] = self._run(code, key, self._op_routines, flat, [out])
            self.tally.op_calls[name] = self.tally.op_calls.get(name, 0) + 1
            return got[:size].reshape(shape)

        return run

    def ops(self) -> dict[str, Callable[..., np.ndarray]]:
        return {op: self.op(op) for op in INEXACT}


def _prec(dt: np.dtype) -> Precision:
    return {np.dtype(np.float32): Precision.f32, np.dtype(np.float64): Precision.f64}[np.dtype(dt)]


def _check_product(item: Gemm, values: interpret.Values, old: np.ndarray, got: np.ndarray,
                   tally: Tally) -> None:
    """``got`` within ``2 n u sum |a||b| + u |old|`` of the f64 product (``n`` the inner size,
    ``u`` the compute precision's unit roundoff: any summation order is), plus one ulp of a
    16-bit target's rounding."""
    lhs = item.assign.lhs
    a = values[item.a.node.id].reshape(-1).astype(np.float64)
    b = values[item.b.node.id].reshape(-1).astype(np.float64)
    want = np.zeros(lhs.size) if item.assign.reset else old.reshape(-1).copy()
    size = np.abs(want)
    offsets = batch_offsets(item.batch)
    rows = np.unique(np.linspace(0, item.rows - 1, min(item.rows, SAMPLE_ROWS)).astype(int))
    checked = np.zeros(lhs.size, bool)
    for o_out, o_a, o_b in offsets[::max(1, len(offsets) // SAMPLE_BATCH)]:
        ma, mb = interpret.gemm_matrix(a, item.a, o_a)[rows], interpret.gemm_matrix(b, item.b, o_b)
        cells = o_out + rows[:, None] * item.out_ld + np.arange(item.cols)
        # einsum's own loops: NumPy's BLAS threads crawl on a machine whose cores are busy
        want[cells] += np.einsum("ik,kj->ij", ma, mb)
        size[cells] += np.einsum("ik,kj->ij", np.abs(ma), np.abs(mb))
        checked[cells] = True
    u = 2.0 ** -53 if lhs.prec.compute is Precision.f64 else 2.0 ** -24
    out_ulp = {Precision.f16: 2.0 ** -10, Precision.bf16: 2.0 ** -7}.get(lhs.prec, u)
    floor = {Precision.f16: 2.0 ** -24, Precision.bf16: 2.0 ** -133}.get(lhs.prec, 1e-300)
    bound = 2 * item.inner * u * size + out_ulp * np.abs(want) + floor
    got = got.reshape(-1).astype(np.float64)
    err = np.abs(got - want)
    top = float(np.finfo(lhs.prec.numpy_dtype).max) * (1 - out_ulp)
    err[np.isinf(got) & (np.abs(want) >= top) & (np.sign(got) == np.sign(want))] = 0.0
    ratio = float(np.nanmax((err / bound)[checked])) if checked.any() else 0.0
    tally.worst_gemm = max(tally.worst_gemm, ratio)
    if not ratio <= 1.0:
        tally.mismatches.append(f"gemm into {lhs.name}: error {ratio:.3g} x its bound")


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit, but that any NaN equals any NaN (a sum of the checksum's zero-or-NaN terms
    runs in any order, and NaN payloads follow the order)."""
    return bool(np.all(interpret.ulp_distance(got, want) == 0))


class Shadow:
    """Installed on ``Context.compile_lowered``: each routine it returns runs, when called, the
    backend's code and then the interpreter's on the values it started from, and ``check`` gets
    every node the routine holds (not its local ones) from both."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, lend: bool,
                 check: Callable[[str, Tnode, np.ndarray, np.ndarray], bool] | None = None
                 ) -> None:
        self.tally = Tally()
        self.lender = Lender(self.tally) if lend else None
        self.check = check or (lambda label, node, got, want: same(got, want))
        original = Context.compile_lowered
        shadow = self

        def compile_lowered(ctx: Context, label: str, code: list[Lowered], *,
                            local_check: bool = True):  # noqa: ANN202 - as the original
            ctx, routine = original(ctx, label, code, local_check=local_check)
            if local_check:  # a lender's single items run as they are
                routine.call = shadow._wrap(ctx, label, code, routine)
            return ctx, routine

        monkeypatch.setattr(Context, "compile_lowered", compile_lowered)

    def _wrap(self, ctx: Context, label: str, code: list[Lowered], routine) -> Callable[[], None]:  # noqa: ANN001
        real = routine.call
        held = list(routine.nodes)

        def raw(n: Tnode) -> np.ndarray:
            """The buffer's values, initialized or not (the context marks what a run wrote
            only once the call returns)."""
            return ctx._backend.read(n, ctx.device_buffer(n)).reshape(n.dims)

        def call() -> None:
            before = {n.id: raw(n).copy() for n in held if ctx.is_allocated(n)}
            real()
            mine = {k: v.copy() for k, v in before.items()}
            if self.lender is None:
                interpret.run(code, mine)
            else:
                interpret.run(code, mine, gemm=self.lender.gemm, ops=self.lender.ops())
            self.tally.routines += 1
            for n in held:
                got = raw(n)
                self.tally.compared += 1
                if self.check(label, n, got, mine[n.id]):
                    self.tally.exact += 1
                    self.tally.bitwise += same(got, mine[n.id])
                else:
                    d = interpret.ulp_distance(got, mine[n.id])
                    self.tally.mismatches.append(
                        f"{label}: {n.name} ({n.prec.value}) {int((d > 0).sum())} of "
                        f"{d.size} cells differ, at most {int(d.max())} ulp")

        return call
