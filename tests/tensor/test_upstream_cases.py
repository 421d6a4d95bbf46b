"""Upstream OCANNL's own shape-inference and einsum cases, checked against this port.

``upstream_cases.json`` (a copy of the project's ``shared/ocannl-shapes/cases.json``, kept
in the repository so that a clean clone tests it) holds 35 cases taken from upstream's tests:
an expression, its inputs, and the expected shape, values or error. Each is written here by
hand in this port's API (:data:`CASES`, by the case's index), and checked as the
case says: ``expected_shape`` gives the result's batch, input and output rows; ``values`` the
forward pass's result (CPU), in the result's buffer order (batch, output, input); ``error`` a
``ValueError`` naming the spec, op or parameter; other facts in ``expected`` (a parameter's
inferred rows, captured dims) are asserted in the case's own function.

Spelling: OCANNL's ``*`` (tensor product) is ``@`` here, its ``*.`` (pointwise) is ``*``;
``++`` / ``+*`` / ``@^+`` / ``where ~spec`` are ``T.einsum`` (with ``accum`` / ``combine``);
a string list after a spec is ``capture=Dims()``. A ``range`` input holds 0..N-1 in buffer order.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, train
from ocannl.tensor.einsum import Dims

CASES_PATH = Path(__file__).with_name("upstream_cases.json")
ROWS = ("batch", "input", "output")


@functools.cache
def _cases() -> list[dict]:
    assert CASES_PATH.is_file(), f"upstream's cases are missing: {CASES_PATH}"
    return json.loads(CASES_PATH.read_text())


def _values(t):
    ctx, r = Context.cpu().compile(train.forward(t))
    return ctx.run(r).get_values(t)


def _rows(t: T.Tensor) -> dict[str, tuple[int, ...]]:
    """The tensor's batch, input and output rows (closing its shape inference)."""
    return {r: tuple(int(d) for d in getattr(t.shape, r)) for r in ROWS}


def _shape(batch=(), input=(), output=()) -> dict[str, tuple[int, ...]]:  # noqa: A002
    return {"batch": tuple(batch), "input": tuple(input), "output": tuple(output)}


def _input(case: dict, name: str) -> T.Tensor:
    """The case's input ``name`` as a term: a ``range`` holds 0..N-1 in buffer order (batch,
    output, input); an ``ndarray`` its ``values``, or 1..N when it has none."""
    spec = case["inputs"][name]
    batch, inp, out = (tuple(spec.get(r, ())) for r in ROWS)
    dims = batch + out + inp
    n = math.prod(dims)
    if spec["kind"] == "range":
        values = np.arange(n, dtype=float)
    elif "values" in spec:
        values = np.asarray(spec["values"], dtype=float)
    else:
        values = np.arange(1, n + 1, dtype=float)
    return T.term(values.reshape(dims), label=name, batch_dims=batch, input_dims=inp,
                  output_dims=out)


# --- the cases, by index ------------------------------------------------------------------------


def case_0(c):  # hey ++ "b|i->o => o|b->i"
    return T.einsum("b|i->o => o|b->i", _input(c, "hey"))


def case_1(c):  # hey ++ "b|i->o => b|i"  (o summed)
    return T.einsum("b|i->o => b|i", _input(c, "hey"))


def case_2(c):  # (a + 1) +* "i; j => i->j" b
    return T.einsum("i; j => i->j", _input(c, "a") + 1.0, _input(c, "b"))


def case_3(c):  # a +* "b|i->o; b|i->o => b|i->o" a
    a = _input(c, "a")
    return T.einsum("b|i->o; b|i->o => b|i->o", a, a)


def case_4(c):  # a +* "a|i->h; b|h->o => ab|i->o" b
    return T.einsum("a|i->h; b|h->o => ab|i->o", _input(c, "a"), _input(c, "b"))


def case_5(c):  # a +* "a|i->h; b|h->o => i->o" b
    return T.einsum("a|i->h; b|h->o => i->o", _input(c, "a"), _input(c, "b"))


def case_6(c):  # hey ++ "b|...->o => o|...->b"
    return T.einsum("b|...->o => o|...->b", _input(c, "hey"))


def case_7(c):  # hey2 ++ "...b|...i->...o => i|o->b"
    return T.einsum("...b|...i->...o => i|o->b", _input(c, "hey2"))


def case_8(c):  # hey3 ++ "...|...->...o => o"
    return T.einsum("...|...->...o => o", _input(c, "hey3"))


def case_9(c):  # a +* "...|i->...; ...|...->i => ...|i" b
    return T.einsum("...|i->...; ...|...->i => ...|i", _input(c, "a"), _input(c, "b"))


def case_10(c):  # hey ++ "...|1->... => ...|..."
    return T.einsum("...|1->... => ...|...", _input(c, "hey"))


def case_11(c):  # hey2 ++ "...|...->... => 0"
    return T.einsum("...|...->... => 0", _input(c, "hey2"))


def case_12(c):  # a +* "...|i->1; ...|...->i => ...|i" b
    return T.einsum("...|i->1; ...|...->i => ...|i", _input(c, "a"), _input(c, "b"))


def case_13(c):  # a +* "...|i->1; ...|j...->i => ...|ij" b
    return T.einsum("...|i->1; ...|j...->i => ...|ij", _input(c, "a"), _input(c, "b"))


def case_14(c):  # range 5 ++ "i=>ii"
    return T.einsum("i=>ii", _input(c, "input"))


def case_15(c):  # range_of_shape ~output_dims:[3;4] () ++ "ij=>i1j"
    return T.einsum("ij=>i1j", _input(c, "input"))


def case_16(c):  # range 4 ++ "i => 0"
    return T.einsum("i => 0", _input(c, "r4"))


def case_17(c):  # x +* "ab;bc=>ac" ["a";"b";"c"] y
    x = T.param("x", output_dims=[2, 3])
    y = T.param("y", output_dims=[3, 4])
    d = Dims()
    z = T.einsum("ab;bc=>ac", x, y, capture=d)
    assert (d["a"], d["b"], d["c"]) == (2, 3, 4)
    return z


def case_18(c):  # m1 +* "ij;jk=>ik" [i;j;k] m2, i=3, j=4, k=5 set on the captured labels
    m1, m2 = T.param("m1"), T.param("m2")  # no declared shape
    d = Dims()
    z = T.einsum("ij;jk=>ik", m1, m2, capture=d)
    d.set_dim("i", 3)
    d.set_dim("j", 4)
    d.set_dim("k", 5)
    assert _rows(m1) == _shape(output=(3, 4))
    assert _rows(m2) == _shape(output=(4, 5))
    return z


def case_19(c):  # r1 +* "a, ..row1.., b; ..row2.., c => a, ..row1.., c" r2; set_equal row1 row2
    r1 = T.param("r1", output_dims=[2, 3, 4])
    r2 = T.param("r2", output_dims=[3, 5])
    d = Dims()
    z = T.einsum("a, ..row1.., b; ..row2.., c => a, ..row1.., c", r1, r2, capture=d)
    d.set_equal("row1", "row2")
    assert d["row1"] == (3,)
    assert d["row2"] == (3,)
    return z


def case_20(c):  # x1 +* "..d.., d; d, e => ..d.., e" y1
    x1 = T.param("x1", output_dims=[2, 3])
    y1 = T.param("y1", output_dims=[3, 4])
    return T.einsum("..d.., d; d, e => ..d.., e", x1, y1)


def case_21(c):  # [ 1; 2 ] + ({ w = uniform1 () } * [ 3; 4; 5 ])
    w = T.param("w")  # every row inferred from its uses
    t = T.term(np.array([1.0, 2.0])) + (w @ T.term(np.array([3.0, 4.0, 5.0])))
    assert _rows(w) == _shape(input=(3,), output=(2,))
    assert _rows(t) == _shape(output=(2,))
    return t


def case_22(c):  # { x } + { y }: nothing fixes either parameter's dims
    return T.param("x") + T.param("y")


def case_23(c):  # x + (x ++ "a,b,..r.. => ..r..,b,a" ["a";"b";"r"]), x = { x; o = [3;5;3] }
    x = T.param("x", output_dims=[3, 5, 3])
    d = Dims()
    t = x + T.einsum("a,b,..r.. => ..r..,b,a", x, capture=d)
    assert (d["a"], d["b"], d["r"]) == (3, 5, (3,))
    return t


def _conv2d(c, stride):
    """nn_blocks' conv2d ~kernel_size:3 ~use_padding:true ~out_channels:4: the kernel's dims
    come from the spec and the captured kh, kw and oc (oc a row variable: its total)."""
    x = _input(c, "input")
    kernel = T.param("kernel")
    d = Dims()
    y = T.einsum(f"... | {stride}*oh=+kh, {stride}*ow=+kw, ..ic..; kh, kw, ..ic.. -> ..oc.. "
                 f"=> ... | oh, ow, ..oc..", x, kernel, capture=d)
    d.set_dim("kh", 3)
    d.set_dim("kw", 3)
    d.set_dim("oc", 4)
    out = y + T.param("bias", init="zeros")
    assert _rows(kernel) == _shape(input=(3, 3, 1), output=(4,))
    return out


def case_24(c):  # conv2d, stride 1, padded
    return _conv2d(c, 1)


def case_25(c):  # conv2d, stride 2, padded
    return _conv2d(c, 2)


def _max_pool2d(c, stride, window):
    """nn_blocks' max_pool2d: ``x @^+ spec [wh;ww] (0.0 + 0.0)``, a max of sums. Upstream's
    kernel ``0.0 + 0.0`` takes the window's shape from the spec; a number here has no axes
    (and a fixed shape), so the kernel is a term of zeros with the window's shape."""
    x = _input(c, "x")
    zeros = T.term(np.zeros((window, window)), label="window", output_dims=(window, window))
    d = Dims()
    y = T.einsum(f"... | {stride}*oh< + wh, {stride}*ow< + ww, ..c..; wh, ww => ... | oh, ow, "
                 f"..c..", x, zeros, accum="max", combine="add", capture=d)
    d.set_dim("wh", window)
    d.set_dim("ww", window)
    return y


def case_26(c):  # max_pool2d () x: stride 2, window 2
    return _max_pool2d(c, 2, 2)


def case_27(c):  # max_pool2d ~stride:2 ~window_size:3 () x
    return _max_pool2d(c, 2, 3)


def case_28(c):  # sin ((x1, x2, x3) ++^ "a; b; c => a^b^c"), x2 of size 1
    # upstream's test: x1 = [1; 2], x2 = [3], x3 = [4; 5]
    x1 = T.term(np.array([1.0, 2.0]), label="x1")
    x2 = T.term(np.array([3.0]), label="x2")
    x3 = T.term(np.array([4.0, 5.0]), label="x3")
    assert [x.shape.output for x in (x1, x2, x3)] == [
        tuple(c["inputs"][n]["output"]) for n in ("x1", "x2", "x3")]
    t = T.sin(T.concat("a; b; c => a^b^c", x1, x2, x3))
    np.testing.assert_allclose(_values(t), np.sin([1.0, 2.0, 3.0, 4.0, 5.0]), rtol=1e-6)
    return t


def case_29(c):  # [ x1; x2 ] / [| x3; x4 |] / (x1, x2): stack on a new output / batch / input axis
    x1, x2, x3, x4 = (_input(c, n) for n in ("x1", "x2", "x3", "x4"))
    out = T.block([x1, x2], axis="output")
    assert _rows(out) == _shape(output=(2, 3))
    np.testing.assert_allclose(_values(out), [[1, 2, 3], [4, 5, 6]])
    bat = T.block([x3, x4], axis="batch")
    assert _rows(bat) == _shape(batch=(2,), output=(2,))
    np.testing.assert_allclose(_values(bat), [[10, 20], [30, 40]])
    inp = T.block([x1, x2], axis="input")
    assert _rows(inp) == _shape(input=(2,), output=(3,))
    np.testing.assert_allclose(_values(inp), [[1, 4], [2, 5], [3, 6]])
    return None


def case_30(c):  # Operation.where ~spec:"ij;ij;ij=>i" pred a b
    return T.einsum("ij;ij;ij=>i", _input(c, "pred"), _input(c, "a"), _input(c, "b"),
                    combine="where")


def case_31(c):  # %cd { c } =:+ a * b ~logic:"@": T.assign, c's shape inferred from it
    a, b = _input(c, "a"), _input(c, "b")
    t = a @ b  # the same product as an op
    assert _rows(t) == _shape(input=(1,), output=(2,))
    out = T.param("c", init="zeros")
    ctx, routine = Context.cpu().compile(T.assign(out, "+", a, b, logic="@"))
    np.testing.assert_allclose(ctx.run(routine).get_values(out).ravel(), [4.0, 10.0])
    assert _rows(out) == _shape(input=(1,), output=(2,))
    return t


def case_32(c):  # one + five: one output [1] unannotated, five output_axes [("rgb", 5)]
    one = T.term(np.ones(1), label="one", output_dims=(1,))
    five = T.term(np.ones(5), label="five", output_axes=[("rgb", 5)])
    return one + five


def case_33(c):  # Shape.set_scale ~factor:2 hidden input (upstream: free variable refs)
    # The port's set_dim / set_scale act on a spec's captured labels: the two are the labels of
    # an outer product of two parameters with no declared shape.
    def labels():
        d = Dims()
        z = T.einsum("input_dim; hidden_dim => input_dim, hidden_dim", T.param("a"),
                     T.param("b"), capture=d)
        return d, z

    d, z = labels()
    d.set_dim("input_dim", 8)
    d.set_scale("hidden_dim", "input_dim", 2)
    assert d["hidden_dim"] == 16
    assert _rows(z) == _shape(output=(8, 16))
    d, _ = labels()
    d.set_dim("input_dim", 8)
    d.set_dim("hidden_dim", 17)
    with pytest.raises(ValueError, match=re.escape(
            "Shape.set_scale: dimensions do not satisfy d_large = factor * d_small")):
        d.set_scale("hidden_dim", "input_dim", 2)
    d, _ = labels()
    d.set_dim("hidden_dim", 17)
    with pytest.raises(ValueError, match=re.escape(
            "Shape.set_scale: solved dimension 17 for hidden_dim is not divisible by factor 2")):
        d.set_scale("hidden_dim", "input_dim", 2)
    return None


def case_34(c):  # 2 * hey (issue #380)
    # On purpose: upstream's `2 * hey` is the tensor product, `2 @ hey` here (`2 * hey` is
    # pointwise, and valid). The number 2 has no input axes to contract hey's output axis with.
    hey = _input(c, "hey")
    return 2 @ hey


@dataclass(frozen=True)
class Case:
    slug: str
    build: Callable[[dict], T.Tensor | None]
    expr: str  # a piece of the case's ``expr``: guards against a reordered cases.json
    raises: str | None = None  # the ValueError's message, a regex


_TOO_MANY_AXES = "Too many axes in an operand"

CASES: dict[int, Case] = {
    0: Case("permute-rows", case_0, '"b|i->o => o|b->i"'),
    1: Case("sum-output", case_1, '"b|i->o => b|i"'),
    2: Case("outer-product", case_2, '"i; j => i->j"'),
    3: Case("pointwise-square", case_3, '"b|i->o; b|i->o => b|i->o"'),
    4: Case("batch-outer-product", case_4, '"a|i->h; b|h->o => ab|i->o"'),
    5: Case("batches-summed", case_5, '"a|i->h; b|h->o => i->o"'),
    6: Case("input-row-var", case_6, '"b|...->o => o|...->b"'),
    7: Case("row-vars-summed", case_7, '"...b|...i->...o => i|o->b"'),
    8: Case("sum-leading-output", case_8, '"...|...->...o => o"'),
    9: Case("row-vars-contracted", case_9, '"...|i->...; ...|...->i => ...|i"'),
    10: Case("fixed-index-input", case_10, '"...|1->... => ...|..."'),
    11: Case("sum-all-to-0", case_11, '"...|...->... => 0"'),
    12: Case("fixed-index-output", case_12, '"...|i->1; ...|...->i => ...|i"'),
    13: Case("beg-dims", case_13, '"...|i->1; ...|j...->i => ...|ij"'),
    14: Case("diagonal-write", case_14, '"i=>ii"'),
    15: Case("fixed-index-creates-axis", case_15, '"ij=>i1j"'),
    16: Case("range-sum", case_16, '"i => 0"'),
    17: Case("capture-dims", case_17, '"ab;bc=>ac"'),
    18: Case("set-dim-shapeless-params", case_18, '"ij;jk=>ik"'),
    19: Case("set-equal-row-vars", case_19, '"a, ..row1.., b; ..row2.., c => a, ..row1.., c"'),
    20: Case("name-both-dim-and-row", case_20, '"..d.., d; d, e => ..d.., e"',
              raises=re.escape("Name 'd' is used as both a dimension variable and a row "
                               "variable in spec: ..d.., d; d, e => ..d.., e")),
    21: Case("param-inferred-both-sides", case_21, "{ w = uniform1 () } * [ 3; 4; 5 ]"),
    # Upstream's message ends with the closing site ("... dimension(s) 1"); the port's names
    # the parameter instead.
    22: Case("params-never-closed-to-1", case_22, "{ x } + { y }",
              raises=r"You forgot to specify the hidden dimension\(s\) of parameter [xy]\b"),
    23: Case("param-cyclic-permute", case_23, '"a,b,..r.. => ..r..,b,a"'),
    24: Case("conv2d-stride1", case_24, "conv2d ~kernel_size:3"),
    25: Case("conv2d-stride2", case_25, "conv2d ~kernel_size:3"),
    26: Case("max-pool2d", case_26, "max_pool2d () x"),
    27: Case("max-pool2d-window3", case_27, "max_pool2d ~stride:2 ~window_size:3 () x"),
    28: Case("concat-unit-component", case_28, '(x1, x2, x3) ++^ "a; b; c => a^b^c"'),
    29: Case("block-literals", case_29, "[ x1; x2 ]"),
    30: Case("where-spec", case_30, 'Operation.where ~spec:"ij;ij;ij=>i"'),
    31: Case("compose-logic", case_31, '~logic:"@"'),
    # Upstream (HEAD): "solved dimensions for axis: different bases". The port may word a user
    # 1 that does not stretch its own way ("does not stretch"); either names the op, add.
    32: Case("user-one-vs-based-five", case_32, "one + five",
              raises=r"add: .*(different bases|does not stretch)"),
    33: Case("set-scale", case_33, "Shape.set_scale ~factor:2 hidden input"),
    34: Case("number-tensor-product", case_34, "2 * hey", raises=re.escape(_TOO_MANY_AXES)),
}


def _param(index: int) -> object:
    return pytest.param(index, id=f"{index}-{CASES[index].slug}")


def test_cases_json_holds_the_35_cases_all_written_here():
    cases = _cases()
    assert len(cases) == 35
    assert sorted(CASES) == list(range(len(cases)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", [_param(i) for i in sorted(CASES)])
def test_upstream_case(index: int):
    case, entry = _cases()[index], CASES[index]
    assert entry.expr in case["expr"], (entry.expr, case["expr"])
    assert ("error" in case) == (entry.raises is not None)
    if entry.raises is not None:
        with pytest.raises(ValueError, match=entry.raises):
            t = entry.build(case)
            _ = t.shape  # where upstream would finish the inference, if building did not fail
        return
    t = entry.build(case)
    if "expected_shape" in case:
        want = {r: tuple(int(d) for d in case["expected_shape"][r]) for r in ROWS}
        assert _rows(t) == want
    if "values" in case:
        got, want = _values(t), np.asarray(case["values"], dtype=float)
        if "expected_shape" not in case:  # given as a flat list (case 31: c values [4, 10])
            got = np.ravel(got)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_case_32_a_user_one_does_not_stretch_even_without_bases():
    """What case 32 checks that the port can say today: an explicit user [1] (here with no
    basis on either side) does not broadcast against [5], as at upstream's HEAD."""
    one = T.term(np.ones(1), label="one", output_dims=(1,))
    five = T.term(np.ones(5), label="five", output_dims=(5,))
    with pytest.raises(ValueError, match=r"add: .*does not stretch"):
        _ = (one + five).shape
