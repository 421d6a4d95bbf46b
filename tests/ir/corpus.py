"""The computations the lowering tests run, as named cases: lowered code and the values it
starts from. ``tests/ir`` checks them against hand values through the interpreter; the CPU
renderer's tests (``tests/backends/test_cpu_render.py``) run each on the backend and in the
interpreter and compare every node."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import numpy as np

from ocannl import Precision
from ocannl.ir import lowering
from ocannl.ir.assignments import Accum, Affine, Comp, Const, Fixed, Get, apply
from ocannl.ir.lowering import Lowered, lower, nodes_of
from ocannl.ir.target import PRODUCTS, Target
from ocannl.ir.tnode import Tnode

F32, F64, BF16, F16 = Precision.f32, Precision.f64, Precision.bf16, Precision.f16


@dataclass
class Case:
    name: str
    code: list[Lowered]
    values: dict[int, np.ndarray]  # every node the code touches, by id


def case(name: str, comp: Comp, init: dict[Tnode, object], seed: int = 0,
         target: Target = PRODUCTS) -> Case:
    """``comp`` lowered for ``target``, every node it touches holding ``init``'s values or
    random normals of mixed magnitudes (which show any change of summation order)."""
    code = lower(comp, target)
    rng = np.random.default_rng(seed)
    values = {}
    for n in nodes_of(code):
        v = init.get(n)
        if v is None:
            v = rng.normal(size=n.dims) * 10.0 ** rng.integers(-3, 3, size=n.dims)
        values[n.id] = np.asarray(v, np.float64).astype(n.prec.numpy_dtype).reshape(n.dims)
    return Case(name, code, values)


def conv(b: int, h: int, w: int, c: int, o: int, k: int, s: int, p: int, prec: Precision
         ) -> tuple[Tnode, Tnode, Tnode, tuple, tuple[int, ...]]:
    """Nodes x, w, y of a convolution, x's windowed projection and the space
    ``(b, oh, ow, o, kh, kw, c)``."""
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    x, wt, y = Tnode("x", (b, h, w, c), prec), Tnode("w", (o, k, k, c), prec), \
        Tnode("y", (b, oh, ow, o), prec)
    xi = (0, Affine(((s, 1), (1, 4)), -p), Affine(((s, 2), (1, 5)), -p), 6)
    return x, wt, y, xi, (b, oh, ow, o, k, k, c)


def _builders() -> dict[str, Callable[[], Case]]:
    out: dict[str, Callable[[], Case]] = {}
    for prec, (accum, reset) in itertools.product(
            (F32, F64, BF16, F16), (("+", True), ("+", False), ("max", True), ("max", False))):
        def column_sum(prec=prec, accum=accum, reset=reset) -> Case:
            g, b = Tnode("g", (37, 24), prec), Tnode("b", (24,), prec)
            a = Accum(b, (1,), accum, Get(g, (0, 1)), (37, 24), reset=reset)
            return case("column", Comp((a,)), {})
        out[f"column_{accum}_{reset}_{prec.value}"] = column_sum

        def row_sum(prec=prec, accum=accum, reset=reset) -> Case:
            x, y = Tnode("x", (6, 40), prec), Tnode("y", (6,), prec)
            a = Accum(y, (0,), accum, apply("mul", Get(x, (0, 1)), Get(x, (0, 1))), (6, 40),
                      reset=reset)
            return case("row", Comp((a,)), {})
        out[f"row_{accum}_{reset}_{prec.value}"] = row_sum

    for prec, reset, (m, k, n) in itertools.product((F32, F64, BF16, F16), (True, False),
                                                    ((32, 24, 48), (96, 200, 80))):
        def matmul(prec=prec, reset=reset, m=m, k=k, n=n) -> Case:
            a, b, c = Tnode("a", (k, m), prec), Tnode("b", (k, n), F32), Tnode("c", (m, n), prec)
            acc = Accum(c, (0, 1), "+", apply("mul", Get(a, (2, 0)), Get(b, (2, 1))), (m, n, k),
                        reset=reset)
            return case("matmul", Comp((acc,)), {})
        out[f"matmul_{m}x{k}x{n}_{reset}_{prec.value}"] = matmul

    def pointwise_chain() -> Case:
        x, y, z, w = (Tnode(c, (5, 7), F32) for c in "xyzw")
        s = Tnode("s", (7,), F32)
        assigns = (Accum(y, (0, 1), "=", apply("exp", Get(x, (0, 1))), (5, 7)),
                   Accum(z, (0, 1), "=", apply("mul", Get(y, (0, 1)), Get(x, (0, 1))), (5, 7)),
                   Accum(s, (1,), "+", Get(z, (0, 1)), (5, 7), reset=True),
                   Accum(w, (0, 1), "=", apply("where", apply("gt", Get(x, (0, 1)),
                                                              Const(0.0)),
                                               apply("div", Get(z, (0, 1)), Get(s, (1,))),
                                               apply("neg", Get(y, (Fixed(2), 1)))), (5, 7)))
        return case("chain", Comp(assigns), {})
    out["pointwise_chain"] = pointwise_chain

    for prec, reset, dims in itertools.product((F32, F64, BF16, F16), (True, False),
                                               ((40, 8), (6, 5, 4, 8), (40, 10), (30, 16),
                                                (20, 64))):
        def bias_gradient(prec=prec, reset=reset, dims=dims) -> Case:
            # a ReLU's gradient, then its bias's: on a CPU one pass (LoopGroup.row_sum)
            dy, y, g = (Tnode(c, dims, prec) for c in ("dy", "y", "g"))
            b = Tnode("b", dims[-1:], prec)
            at = tuple(range(len(dims)))
            mask = apply("mul", Get(dy, at), apply("gt", Get(y, at), Const(0.0)))
            return case("bias_gradient", Comp((
                Accum(g, at, "=", mask, dims),
                Accum(b, (at[-1],), "+", Get(g, at), dims, reset=reset))), {})
        shape = "x".join(map(str, dims))
        out[f"bias_gradient_{shape}_{reset}_{prec.value}"] = bias_gradient

    def every_op() -> Case:
        x, y, c = (Tnode(n, (64,), F32) for n in "xyc")
        ops = ["add", "sub", "mul", "div", "max", "min", "eq", "gt", "lt", "le", "ge", "ne",
               "neg", "relu", "abs", "sqrt", "isfinite"]
        outs = [Tnode(f"out_{op}", (64,), BF16 if k % 2 else F16) for k, op in enumerate(ops)]
        assigns = [Accum(o, (0,), "=", apply(op, *[Get(t, (0,)) for t in (x, y)][:_arity(op)]),
                         (64,)) for op, o in zip(ops, outs, strict=True)]
        assigns.append(Accum(Tnode("out_where", (64,), F32), (0,), "=",
                             apply("where", Get(c, (0,)), Get(x, (0,)), Get(y, (0,))), (64,)))
        special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-40, 3.5, -2.25,
                            65504.0, 70000.0, 2.0 ** -24, 2.0 ** -25, 1 + 2.0 ** -8,
                            1 + 2.0 ** -11] * 4)
        return case("every_op", Comp(tuple(assigns)),
                    {x: special, y: np.roll(special, 5), c: np.roll(special, 3)})
    out["every_op"] = every_op

    def diagonal_fill() -> Case:
        x, y = Tnode("x", (3,), F32), Tnode("y", (3, 3), F32)
        return case("diag", Comp((Accum(y, (0, 0), "+", Get(x, (0,)), (3,), reset=True),
                                  Accum(y, (Fixed(1), 0), "max", Get(x, (0,)), (3,)))), {})
    out["diagonal_fill"] = diagonal_fill

    def mixed_f64() -> Case:
        x, d, y = Tnode("x", (9,), F32), Tnode("d", (9,), F64), Tnode("y", (9,), F32)
        h = Tnode("h", (9,), BF16)
        return case("f64", Comp((Accum(y, (0,), "=", apply("add", Get(x, (0,)), Get(d, (0,))),
                                       (9,)),
                                 Accum(h, (0,), "+", apply("mul", Get(d, (0,)), Const(0.1)),
                                       (9,)))), {})
    out["mixed_f64"] = mixed_f64

    def attention() -> Case:
        b, t, hh, dd = 3, 16, 4, 8
        q, k, v = (Tnode(n, (b, t, hh, dd), F32) for n in "qkv")
        scores, o = Tnode("scores", (b, hh, t, t), F32), Tnode("o", (b, t, hh, dd), F32)
        s1 = Accum(scores, (0, 1, 2, 3), "+", apply("mul", Get(q, (0, 2, 1, 4)),
                                                    Get(k, (0, 3, 1, 4))), (b, hh, t, t, dd), True)
        s2 = Accum(o, (0, 1, 2, 3), "+", apply("mul", Get(scores, (0, 2, 1, 4)),
                                               Get(v, (0, 4, 2, 3))), (b, t, hh, dd, t), True)
        return case("attention", Comp((s1, s2)), {}, target=Target(im2col=False))
    out["attention_batched"] = attention

    for (b, h, w, c, o, k, s, p), which, im2col, prec in itertools.product(
            ((2, 6, 6, 3, 4, 3, 1, 1), (3, 7, 7, 2, 5, 3, 2, 1), (2, 9, 9, 2, 4, 5, 2, 2)),
            ("forward", "kernel_grad", "input_grad"), (False, True), (F32, BF16)):
        def convolution(dims=(b, h, w, c, o, k, s, p), which=which, im2col=im2col,
                        prec=prec) -> Case:
            x, wt, y, xi, space = conv(*dims, prec)
            wi, yi = (3, 4, 5, 6), (0, 1, 2, 3)
            a = {"forward": Accum(y, yi, "+", apply("mul", Get(x, xi), Get(wt, wi)), space, True),
                 "kernel_grad": Accum(wt, wi, "+", apply("mul", Get(y, yi), Get(x, xi)), space,
                                      True),
                 "input_grad": Accum(x, xi, "+", apply("mul", Get(y, yi), Get(wt, wi)), space)
                 }[which]
            with mock.patch.object(lowering, "IM2COL_MIN_INNER", 1), \
                    mock.patch.object(lowering, "IM2COL_MIN_REUSE", 0):
                return case("conv", Comp((a,)), {},
                            target=Target(batched_gemm=False, im2col=im2col))
        out[f"conv_{b}x{h}x{w}x{c}_{o}_{k}s{s}p{p}_{which}_{'im2col' if im2col else 'direct'}"
            f"_{prec.value}"] = convolution

    def max_pool() -> Case:
        x, m = Tnode("x", (2, 6, 6, 3), F32), Tnode("m", (2, 3, 3, 3), F32)
        pool = Accum(m, (0, 1, 2, 6), "max", Get(x, (0, Affine(((2, 1), (1, 4))),
                                                     Affine(((2, 2), (1, 5))), 6)),
                     (2, 3, 3, 1, 2, 2, 3), reset=True)
        return case("pool", Comp((pool,)), {})
    out["max_pool"] = max_pool
    return out


def _arity(op: str) -> int:
    from ocannl.ir.ops import OPS

    return OPS[op].arity


BUILDERS = _builders()
