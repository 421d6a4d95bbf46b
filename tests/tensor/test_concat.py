"""``concat`` (upstream's ``++^``) and ``block`` (its block literals): values against NumPy,
gradients against PyTorch and against the slices they must be, upstream's cases from
``cases.json``, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch_oracle import check_parity

import ocannl.tensor as T
from ocannl import Context, train
from ocannl.tensor.concat import block, concat
from ocannl.tensor.einsum import Dims
from ocannl.tensor.inference import ShapeError

CASES_PATH = Path(__file__).with_name("upstream_cases.json")  # shared/ocannl-shapes' copy


def _values(t: T.Tensor, *given: tuple[T.Tensor, np.ndarray]) -> np.ndarray:
    """``t``'s forward value, its parameters set to the values ``given``."""
    ctx = Context.cpu()
    for p, v in given:
        ctx.set_values(p, v)
    ctx, r = ctx.compile(train.forward(t))
    return ctx.run(r).get_values(t)


def _term(values, **rows) -> T.Tensor:
    return T.term(np.asarray(values, dtype=np.float64), **rows)


def _param(label: str, values: np.ndarray, batch=(), output=(), inp=()) -> T.Tensor:
    p = T.param(label, batch_dims=batch, output_dims=output, input_dims=inp)
    assert p.dims == values.shape
    return p


def _grads(out: T.Tensor, params: list[tuple[T.Tensor, np.ndarray]], seed: int = 0
           ) -> tuple[np.ndarray, list[np.ndarray]]:
    """``loss = sum(out * r)`` for a fixed random ``r``: r and each parameter's gradient."""
    r = np.random.default_rng(seed).uniform(-1.0, 1.0, out.dims)
    r_t = T.term(r, batch_dims=out.shape.batch, output_dims=out.shape.output,
                 input_dims=out.shape.input, label="r")
    loss = T.sum(out * r_t)
    ctx = Context.cpu()
    for p, v in params:
        ctx.set_values(p, v)
    ctx, routine = ctx.compile(train.grad_update(loss))
    ctx.run(routine)
    return ctx.get_values(r_t).astype(np.float64), [ctx.get_values(p.grad) for p, _ in params]


def _case(piece: str) -> dict:
    assert CASES_PATH.is_file(), f"upstream's cases are missing: {CASES_PATH}"
    found = [c for c in json.loads(CASES_PATH.read_text()) if piece in c["expr"]]
    assert len(found) == 1, (piece, [c["expr"] for c in found])
    return found[0]


RNG = np.random.default_rng(7)


# --- concatenation: values and gradients ------------------------------------------------------


def test_three_way_concat_along_the_output_axis():
    vs = [RNG.uniform(-1, 1, n) for n in (2, 1, 3)]
    ps = [_param(f"x{i}", v, output=v.shape) for i, v in enumerate(vs)]
    out = concat("a; b; c => a^b^c", *ps)
    assert out.shape.output == (6,)
    check_parity(out, lambda *ts: torch.cat(ts, 0), list(zip(ps, vs, strict=True)))


def test_gradients_are_the_slices_of_the_incoming_gradient():
    vs = [RNG.uniform(-1, 1, (2, n)) for n in (3, 2)]
    ps = [_param(f"y{i}", v, batch=(2,), output=v.shape[1:]) for i, v in enumerate(vs)]
    out = concat("...|a; ...|b => ...|a^b", *ps)
    r, (g0, g1) = _grads(out, list(zip(ps, vs, strict=True)))
    np.testing.assert_allclose(g0, r[:, :3], rtol=1e-6)
    np.testing.assert_allclose(g1, r[:, 3:], rtol=1e-6)


def test_concat_under_a_batch_row_variable():
    a, b = RNG.uniform(-1, 1, (2, 3, 4)), RNG.uniform(-1, 1, (2, 3, 2))
    pa = _param("a", a, batch=(2, 3), output=(4,))
    pb = _param("b", b, batch=(2, 3), output=(2,))
    out = concat("...|a; ...|b => ...|a^b", pa, pb)
    assert (out.shape.batch, out.shape.output) == ((2, 3), (6,))
    np.testing.assert_allclose(_values(out, (pa, a), (pb, b)), np.concatenate([a, b], -1),
                               rtol=1e-6)
    check_parity(out, lambda x, y: torch.cat([x, y], -1), [(pa, a), (pb, b)])


def test_concat_beside_a_shared_label():
    a, b = RNG.uniform(-1, 1, (3, 2)), RNG.uniform(-1, 1, (3, 4))
    pa, pb = _param("a", a, output=(3, 2)), _param("b", b, output=(3, 4))
    out = concat("x, a; x, b => x, a^b", pa, pb)
    assert out.shape.output == (3, 6)
    check_parity(out, lambda x, y: torch.cat([x, y], 1), [(pa, a), (pb, b)])


def test_concat_along_the_batch_row():
    a, b = RNG.uniform(-1, 1, (2, 3)), RNG.uniform(-1, 1, (1, 3))
    pa, pb = _param("a", a, batch=(2,), output=(3,)), _param("b", b, batch=(1,), output=(3,))
    out = concat("a|...; b|... => a^b|...", pa, pb)
    assert (out.shape.batch, out.shape.output) == ((3,), (3,))
    check_parity(out, lambda x, y: torch.cat([x, y], 0), [(pa, a), (pb, b)])


def test_concat_along_the_input_row():
    # buffer order batch, output, input: the input axis is the last
    a, b = RNG.uniform(-1, 1, (4, 2)), RNG.uniform(-1, 1, (4, 3))
    pa, pb = _param("a", a, output=(4,), inp=(2,)), _param("b", b, output=(4,), inp=(3,))
    out = concat("a->...; b->... => a^b->...", pa, pb)
    assert (out.shape.input, out.shape.output) == ((5,), (4,))
    check_parity(out, lambda x, y: torch.cat([x, y], 1), [(pa, a), (pb, b)])


def test_concat_then_a_pointwise_op_and_a_second_concat():
    # upstream's nested concatenation: (n1, n2) ++^ "a; b => a^b", then with n3
    n1, n2, n3 = (_term(v) for v in ([1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0]))
    inner = concat("a; b => a^b", n1, n2)
    nested = T.sin(concat("a; b => a^b", inner, n3))
    np.testing.assert_allclose(_values(nested), np.sin(np.arange(1.0, 8.0)), rtol=1e-6)


# --- slices: prefix, suffix, middle, rotation ---------------------------------------------------


def test_prefix_suffix_and_middle_reads():
    v = RNG.uniform(-1, 1, 7)
    x = _term(v, label="x")
    cases = [("a^b => a", {"a": 3}, v[:3]), ("a^b => b", {"a": 3}, v[3:]),
             ("a^b => b", {"b": 2}, v[5:]), ("a^b^c => b", {"a": 1, "c": 2}, v[1:5])]
    for spec, sizes, want in cases:
        out = concat(spec, x, sizes=sizes)
        assert out.shape.output == want.shape, spec
        np.testing.assert_allclose(_values(out), want, rtol=1e-6, err_msg=spec)


def test_a_slice_gives_its_gradient_back_to_its_cells_only():
    v = RNG.uniform(-1, 1, (2, 7))
    p = _param("p", v, batch=(2,), output=(7,))
    out = concat("...|a^b^c => ...|b", p, sizes={"a": 2, "c": 1})
    r, (g,) = _grads(out, [(p, v)])
    want = np.zeros_like(v)
    want[:, 2:6] = r
    np.testing.assert_allclose(g, want, rtol=1e-6)
    check_parity(out, lambda t: t[:, 2:6], [(p, v)])


def test_a_discardable_component_nothing_fixes_is_zero():
    # b is not in the result: nothing fixes it, so it is 0 and a is the whole axis
    v = RNG.uniform(-1, 1, 5)
    x = _term(v, label="x")
    for spec in ("a^b => a", "a^b => b", "a^b^c => b"):
        out = concat(spec, x)
        assert out.shape.output == (5,), spec
        np.testing.assert_allclose(_values(out), v, rtol=1e-6, err_msg=spec)


def test_a_discardable_component_is_fixed_by_the_others():
    v = RNG.uniform(-1, 1, 6)
    dims = Dims()
    out = concat("a^b => a", _term(v), sizes={"a": 4}, capture=dims)
    assert dims["b"] == 2
    np.testing.assert_allclose(_values(out), v[:4], rtol=1e-6)


def test_rotation_moves_every_concatenated_axis_together():
    v = RNG.uniform(-1, 1, (3, 5))
    p = _param("p", v, batch=(3,), output=(5,))
    out = concat("...|a^b => ...|b^a", p, sizes={"a": 2})
    np.testing.assert_allclose(_values(out, (p, v)), np.roll(v, -2, axis=1), rtol=1e-6)
    check_parity(out, lambda t: torch.roll(t, -2, 1), [(p, v)])


def test_a_partial_write_leaves_zeros():
    # upstream's "a => a^b" (a %cd partial write): b's cells are written by no operand
    v = RNG.uniform(-1, 1, 3)
    p = _param("p", v, output=(3,))
    out = concat("a => a^b", p, sizes={"b": 2})
    np.testing.assert_allclose(_values(out, (p, v)), np.concatenate([v, [0.0, 0.0]]), rtol=1e-6)
    check_parity(out, lambda t: torch.cat([t, torch.zeros(2, dtype=t.dtype)]), [(p, v)])


# --- open operands: the shapes come from elsewhere ----------------------------------------------


def test_an_operand_of_open_shape_takes_its_dims_from_another_use():
    w = T.param("w", output_dims=None, input_dims=())
    y = _term([1.0, 2.0], label="y")
    x3 = _term([4.0, 5.0, 6.0], label="x3")
    out = concat("a; b => a^b", w, x3)
    assert not out.shape_known
    u = w + y  # w's output row is y's
    assert out.shape.output == (5,) and w.shape.output == (2,)
    ctx = train.init_params(Context.cpu(), out)
    ctx, r = ctx.compile(train.forward(out) + train.forward(u))
    ctx.run(r)
    np.testing.assert_allclose(ctx.get_values(out),
                               np.concatenate([ctx.get_values(w), [4.0, 5.0, 6.0]]), rtol=1e-6)


def test_a_discardable_component_of_an_open_operand_closes_to_zero():
    w = T.param("w", output_dims=None, input_dims=())
    out = concat("a^b => a", w)
    _ = w + _term(np.ones(4), label="four")  # w's total, 4: b, discardable, is 0
    assert out.shape.output == (4,)


# --- upstream's cases (cases.json) --------------------------------------------------------------


def test_upstream_concat_with_a_unit_component():
    case = _case('"a; b; c => a^b^c"')
    xs = [T.term(np.arange(1.0, 1.0 + case["inputs"][n]["output"][0]) + k, label=n)
          for k, n in zip((0, 2, 3), ("x1", "x2", "x3"), strict=True)]
    assert [x.shape.output for x in xs] == [(2,), (1,), (2,)]
    t = T.sin(concat("a; b; c => a^b^c", *xs))
    want = case["expected_shape"]
    assert (t.shape.batch, t.shape.input, t.shape.output) == (
        tuple(want["batch"]), tuple(want["input"]), tuple(want["output"]))
    np.testing.assert_allclose(_values(t), np.sin([1.0, 2.0, 3.0, 4.0, 5.0]), rtol=1e-6)


def test_upstream_concat_with_a_unit_component_backprop():
    # upstream's test asks for the gradients of all three (a unit component in the middle,
    # first and last): cos of the inputs
    for sizes in ((2, 1, 2), (1, 3, 2), (2, 3, 1)):
        vs = [RNG.uniform(-2, 2, n) for n in sizes]
        ps = [_param(f"u{i}", v, output=v.shape) for i, v in enumerate(vs)]
        out = T.sin(concat("a; b; c => a^b^c", *ps))
        check_parity(out, lambda *ts: torch.sin(torch.cat(ts)), list(zip(ps, vs, strict=True)))


def test_upstream_block_literals():
    case = _case("[ x1; x2 ]")
    ins = {n: T.term(np.asarray(s["values"], np.float64), label=n)
           for n, s in case["inputs"].items()}
    x1, x2, x3, x4 = (ins[n] for n in ("x1", "x2", "x3", "x4"))
    out = block([x1, x2])
    assert (out.shape.batch, out.shape.output, out.shape.input) == ((), (2, 3), ())
    np.testing.assert_allclose(_values(out), [[1, 2, 3], [4, 5, 6]])
    bat = block([x3, x4], axis="batch")
    assert (bat.shape.batch, bat.shape.output, bat.shape.input) == ((2,), (2,), ())
    np.testing.assert_allclose(_values(bat), [[10, 20], [30, 40]])
    inp = block([x1, x2], axis="input")
    assert (inp.shape.batch, inp.shape.output, inp.shape.input) == ((), (3,), (2,))
    np.testing.assert_allclose(_values(inp), [[1, 4], [2, 5], [3, 6]])


# --- block --------------------------------------------------------------------------------------


def test_block_matches_numpy_stack():
    vs = [RNG.uniform(-1, 1, (2, 3)) for _ in range(3)]
    ps = [_param(f"s{i}", v, batch=(2,), output=(3,)) for i, v in enumerate(vs)]
    out = block(ps)  # a new output axis in front of the output row
    assert (out.shape.batch, out.shape.output) == ((2,), (3, 3))
    np.testing.assert_allclose(_values(out, *zip(ps, vs, strict=True)), np.stack(vs, axis=1),
                               rtol=1e-6)
    check_parity(out, lambda *ts: torch.stack(ts, 1), list(zip(ps, vs, strict=True)))
    bat = block(ps, axis="batch")
    assert (bat.shape.batch, bat.shape.output) == ((3, 2), (3,))
    check_parity(bat, lambda *ts: torch.stack(ts, 0), list(zip(ps, vs, strict=True)))


def test_block_along_the_input_row():
    vs = [RNG.uniform(-1, 1, (2, 4)) for _ in range(2)]
    ps = [_param(f"m{i}", v, output=(2,), inp=(4,)) for i, v in enumerate(vs)]
    out = block(ps, axis="input")
    assert (out.shape.output, out.shape.input) == ((2,), (2, 4))
    check_parity(out, lambda *ts: torch.stack(ts, 1), list(zip(ps, vs, strict=True)))


def test_nested_blocks_stack_two_axes_the_outer_first():
    s = [_term(v) for v in ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0])]
    out = block([[s[0], s[1]], [s[2], s[3]]])  # upstream's [[s1; s2]; [s3; s4]]
    assert out.shape.output == (2, 2, 2)
    np.testing.assert_allclose(_values(out), [[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    mixed = block([[s[0], s[1]], [s[2], s[3]]], axis=("batch", "output"))  # [| [..]; [..] |]
    assert (mixed.shape.batch, mixed.shape.output) == ((2,), (2, 2))
    np.testing.assert_allclose(_values(mixed), [[[1, 2], [3, 4]], [[5, 6], [7, 8]]])


def test_nested_block_gradients():
    vs = [RNG.uniform(-1, 1, 3) for _ in range(6)]
    ps = [_param(f"n{i}", v, output=(3,)) for i, v in enumerate(vs)]
    out = block([ps[0:3], ps[3:6]], axis=("input", "output"))
    assert (out.shape.output, out.shape.input) == ((3, 3), (2,))
    r, gs = _grads(out, list(zip(ps, vs, strict=True)))
    for k, g in enumerate(gs):
        np.testing.assert_allclose(g, r[k % 3, :, k // 3], rtol=1e-6)


def test_block_of_numbers_and_of_one_tensor():
    np.testing.assert_allclose(_values(block([1.0, 2.0, 3.0])), [1.0, 2.0, 3.0])
    x = _term([1.0, 2.0, 3.0])
    one = block([x])  # upstream's [x1]: an unsqueeze
    assert one.shape.output == (1, 3)
    np.testing.assert_allclose(_values(one), [[1.0, 2.0, 3.0]])


def test_the_same_tensor_twice_gets_both_gradients():
    v = RNG.uniform(-1, 1, 2)
    p = _param("p", v, output=(2,))
    r, (g,) = _grads(block([p, p]), [(p, v)])
    np.testing.assert_allclose(g, r[0] + r[1], rtol=1e-6)


# --- errors -------------------------------------------------------------------------------------


def test_mismatched_other_axes_name_the_spec_and_the_shapes():
    a, b = _term(np.ones((3, 2)), label="a", output_dims=(3, 2)), _term(
        np.ones((4, 2)), label="b", output_dims=(4, 2))
    with pytest.raises(ShapeError, match=r"concat 'x, a; x, b => x, a\^b' over a .*3,2.*b .*4,2"):
        concat("x, a; x, b => x, a^b", a, b)


def test_a_slice_longer_than_its_axis_names_the_operand():
    with pytest.raises(ShapeError, match=r"concat 'a\^b => a' over x \|->5: .*exceed"):
        concat("a^b => a", _term(np.ones(5), label="x"), sizes={"a": 7})


def test_wrong_number_of_operands():
    x = _term([1.0])
    with pytest.raises(ValueError, match=r"concat 'a; b => a\^b' names 2 operand\(s\), got 3"):
        concat("a; b => a^b", x, x, x)
    with pytest.raises(ValueError, match="names 3 operand"):
        concat("a; b; c => a^b^c", x, x)


def test_a_component_nothing_fixes_is_refused():
    x = _term(np.ones(4), label="x")
    with pytest.raises(ShapeError, match=r"nothing fixes the size of component\(s\) 'a', 'b'"):
        concat("a^b => a^b", x)
    with pytest.raises(ShapeError, match=r"over x \|->4: nothing fixes .* 'b'.*sizes="):
        concat("a => a^b", x)


def test_what_is_not_a_concatenation_is_refused():
    x, y = _term(np.ones((2, 3))), _term(np.ones((2, 4)))
    with pytest.raises(ValueError, match="no '\\^' axis"):
        concat("a; b => a", x, y)
    with pytest.raises(ValueError, match="does not sum"):
        concat("...|a; ...|b => a^b", x, y)
    with pytest.raises(ValueError, match="component 'a' is read from operands 1, 2"):
        concat("a; a => a^b", x, x)
    with pytest.raises(ValueError, match="no component of the result is read from operand"):
        concat("a; b; c^d => a^b", x, y, y)
    with pytest.raises(ValueError, match="not a label of the spec"):
        concat("a^b => a", x, sizes={"z": 1})
    with pytest.raises(ValueError, match="labels, fixed indices and '\\^' axes only"):
        concat("2*o+k; a => a^o", x, y)


def test_block_errors():
    a, b = _term(np.ones(3), label="a"), _term(np.ones(4), label="b")
    with pytest.raises(ShapeError, match=r"block 2 along output over a \|->3; b \|->4"):
        block([a, b])
    with pytest.raises(ValueError, match="ragged"):
        block([[a, a], [a]])
    with pytest.raises(ValueError, match="mixes lists and tensors"):
        block([[a, a], a])
    with pytest.raises(ValueError, match="axis must be one of"):
        block([a, a], axis="rows")
    with pytest.raises(ValueError, match="one per level"):
        block([a, a], axis=("batch", "output"))
    with pytest.raises(ValueError, match="empty"):
        block([])
    with pytest.raises(TypeError, match="list of tensors"):
        block(a)  # type: ignore[arg-type]
