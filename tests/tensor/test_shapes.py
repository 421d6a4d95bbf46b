"""Shapes: rows, broadcasting, inference, and the errors raised when a tensor is built (before
any code is compiled), each naming the shapes involved."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from torch_oracle import shapes

import ocannl.tensor as T
from ocannl import Precision
from ocannl.tensor import Shape
from ocannl.tensor.shape import broadcast, broadcast_projection


def _p(label: str, batch=(), output=(), inp=()):
    return T.param(label, batch_dims=batch, output_dims=output, input_dims=inp)


def test_layout_is_batch_output_input():
    s = Shape(batch=(2, 3), output=(4,), input=(5, 6))
    assert s.dims == (2, 3, 4, 5, 6)
    assert s.row_offsets() == {"batch": 0, "output": 2, "input": 3}
    assert str(s) == "2,3|5,6->4"  # as upstream OCANNL writes it: batch|input->output
    assert _p("a", (2,), (3,), (4,)).dims == (2, 3, 4)


def test_term_rows_from_the_array():
    x = T.term(np.zeros((5, 7, 3)))
    assert x.shape == Shape((5, 7), (3,), ())
    v = T.term(np.zeros(4))
    assert v.shape == Shape((), (4,), ())
    s = T.term(np.zeros((6,)), batch_dims=(2,), output_dims=(3,))
    assert s.shape == Shape((2,), (3,), ()) and s.value.host_data.shape == (2, 3)
    assert T.number(2.5).dims == () and T.number(2.5).const == 2.5


def _upstream_row(r1: tuple[int, ...], r2: tuple[int, ...]) -> tuple[int, ...] | None:
    """Upstream's rule (HEAD): right-aligned, a missing axis broadcasts, sizes must be equal
    (a 1 the user gives is a size like any other)."""
    long, short = (r1, r2) if len(r1) >= len(r2) else (r2, r1)
    if any(a != b for a, b in zip(long[len(long) - len(short):], short, strict=True)):
        return None
    return long


@settings(max_examples=60, deadline=None)
@given(shapes(), shapes())
def test_broadcast_is_rowwise_and_right_aligned(s1, s2):
    """Whenever two shapes broadcast, every row of the result is the longer row, the other one
    a suffix of it; otherwise the error names both shapes and the row. (Until issue 39 this
    asserted NumPy's rule, where a 1 stretches: upstream OCANNL's HEAD, which the port follows,
    lets only a missing axis, a number or the project's own kept axis broadcast.)"""
    rows = {r: _upstream_row(s1.row(r), s2.row(r)) for r in ("batch", "output", "input")}
    if any(v is None for v in rows.values()):
        with pytest.raises(ValueError) as err:
            broadcast([s1, s2], "add")
        assert str(s1) in str(err.value) and str(s2) in str(err.value)
        return
    res = broadcast([s1, s2], "add")
    assert res == Shape(**rows)
    for s in (s1, s2):
        proj = broadcast_projection(s, res)
        assert len(proj) == len(s.dims)


def test_a_kept_axis_stretches_and_a_users_one_does_not():
    x = T.term(np.ones((2, 3)), label="x")
    kept = T.reduce(x, "max", "output", keepdims=True)
    assert (x - kept).shape == Shape((2,), (3,), ())  # the project's own 1 broadcasts
    col = T.term(np.ones((2, 1)), label="col")
    with pytest.raises(ValueError, match=r"sub: shapes 2\|->3 and 2\|->1 do not broadcast in "
                                         r"the output row .*a 1 given by the user does not "
                                         r"stretch"):
        x - col


@pytest.mark.parametrize(
    ("make", "shapes_named"),
    [
        (lambda: _p("a", output=(3,)) + _p("b", output=(4,)), ["|->3", "|->4", "output row"]),
        (lambda: _p("a", batch=(2,), output=(3,)) * _p("b", batch=(5,), output=(3,)),
         ["2|->3", "5|->3", "batch row"]),
        (lambda: _p("a", output=(3,), inp=(2,)) - _p("b", output=(3,), inp=(4,)),
         ["|2->3", "|4->3", "input row"]),
        (lambda: _p("a", batch=(2, 3), output=(1,)) / _p("b", batch=(4, 3), output=(1,)),
         ["2,3|->1", "4,3|->1", "batch row"]),
    ],
    ids=["output", "batch", "input", "leading-batch"],
)
def test_pointwise_shape_errors_name_both_shapes(make, shapes_named):
    with pytest.raises(ValueError) as err:
        make()
    msg = str(err.value)
    for s in shapes_named:
        assert s in msg, msg
    assert "do not broadcast" in msg


def test_matmul_shape_error_names_both_shapes():
    w = _p("w", output=(3,), inp=(4,))
    x = T.term(np.zeros((2, 5)), label="x")
    with pytest.raises(ValueError) as err:
        w @ x
    msg = str(err.value)
    assert str(w.shape) in msg and str(x.shape) in msg
    assert "(4,)" in msg and "(5,)" in msg


def test_inferred_input_axes_are_fixed_by_the_first_use():
    w = T.param("w", output_dims=(3,))
    assert not w.shape_known and w.shape_text().startswith("|..")  # printing closes nothing
    x4, x5 = T.term(np.zeros((2, 4)), label="x4"), T.term(np.zeros((2, 5)), label="x5")
    y = w @ x4
    assert w.shape == Shape((), (3,), (4,)) and y.shape == Shape((2,), (3,), ())
    with pytest.raises(ValueError) as err:
        w @ x5
    assert str(w.shape) in str(err.value) and str(x5.shape) in str(err.value)
    assert w.dims == (3, 4)  # unchanged by the failed use


def test_an_open_right_operand_of_matmul_is_inferred_too():
    """Until issue 39, ``x @ u`` with ``u``'s input row open was refused; inference now takes
    ``u``'s input row from what the result meets (here nothing: empty), and a contracted row
    that cannot fit is refused naming both operands."""
    u = T.param("u", output_dims=(4,))
    a = T.term(np.zeros((2, 3, 4)), label="a", batch_dims=(2,), output_dims=(3,),
               input_dims=(4,))
    assert (a @ u).shape == Shape((2,), (3,), ()) and u.shape == Shape((), (4,), ())
    x = T.term(np.zeros((2, 4)), label="x")
    u2 = T.param("u2", output_dims=(4,))
    with pytest.raises(ValueError, match=r"matmul over x 2\|->4; u2 \|\.\..*->4: .*Too many "
                                         r"axes in an operand"):
        (x @ u2).shape  # noqa: B018


@pytest.mark.parametrize(
    ("spec", "operands", "fragments"),
    [
        ("i;j=>ij", 1, ["names 2 operands, got 1"]),
        ("ij=>i", 1, ["einsum 'ij=>i' over a |->3", "Number of axes mismatch in the output "
                               "row"]),
        ("i;i=>i", 2, ["einsum 'i;i=>i' over a |->3; b |->4", "solved dimensions for axis 'i': "
                       "mismatch"]),
        ("i", 1, ["missing '=>'", "in spec: i"]),
    ],
)
def test_einsum_spec_errors(spec, operands, fragments):
    a, b = _p("a", output=(3,)), _p("b", output=(4,))
    with pytest.raises(ValueError) as err:
        T.einsum(spec, *(a, b)[:operands])
    for f in fragments:
        assert f in str(err.value), str(err.value)


def test_reduction_axis_errors():
    a = _p("a", batch=(2,), output=(3,))
    with pytest.raises(ValueError, match=r"axis 3 out of range for a with dims \(2, 3\)"):
        T.sum(a, 3)
    with pytest.raises(ValueError, match="axis -3 out of range"):
        T.max(a, [0, -3])
    with pytest.raises(ValueError, match="unknown row 'rows'"):
        T.mean(a, "rows")


def test_reductions_drop_the_reduced_axes_from_their_rows():
    a = _p("a", batch=(2, 3), output=(4,), inp=(5,))
    assert T.sum(a).shape == Shape()
    assert T.sum(a, "batch").shape == Shape((), (4,), (5,))
    assert T.max(a, "output").shape == Shape((2, 3), (), (5,))
    assert T.mean(a, [1, -1]).shape == Shape((2,), (4,), ())
    assert T.sum(a, 0).shape == Shape((3,), (4,), (5,))


def test_leaf_errors():
    with pytest.raises(ValueError, match=r"output dims must be positive, got \(0,\)"):
        T.param("p", output_dims=(0,))
    with pytest.raises(ValueError, match="unknown init 'foo'"):
        T.param("p", output_dims=(2,), init="foo")
    with pytest.raises(ValueError, match=r"term term: values of shape \(6,\) do not have the "
                                         r"dims \(4,\)"):
        T.term(np.zeros(6), output_dims=(4,))
    with pytest.raises(ValueError, match="give values or output_dims"):
        T.term()
    with pytest.raises(TypeError, match="expected a Tensor or a number, got str"):
        _p("a", output=(2,)) + "x"


@pytest.mark.parametrize("bad", ["f8", "int8", "float16"])
def test_unsupported_precision_is_a_build_time_error(bad):
    for make in (lambda: T.param("p", output_dims=(2,), prec=bad),
                 lambda: T.term(np.zeros(2), prec=bad),
                 lambda: T.number(1.0, prec=bad),
                 lambda: T.cast(_p("a", output=(2,)), bad)):
        with pytest.raises(ValueError) as err:
            make()
        assert repr(bad) in str(err.value) and "f64, f32, f16, bf16" in str(err.value)


def test_result_precisions():
    a32 = _p("a", output=(2,))
    a64 = T.param("b", output_dims=(2,), input_dims=(), prec="f64")
    h16 = T.param("h", output_dims=(2,), input_dims=(), prec="f16")
    b16 = T.param("g", output_dims=(2,), input_dims=(), prec="bf16")
    assert (a32 + a64).prec is Precision.f64
    assert (a32 * 2.0).prec is Precision.f32  # numbers take no part in promotion
    assert (h16 * 2.0).prec is Precision.f16
    assert (h16 + b16).prec is Precision.f32
    assert (h16 + a32).prec is Precision.f32
    assert T.cast(a64, "bf16").prec is Precision.bf16
    assert T.sum(h16).prec is Precision.f16


# --- a term's rows from its array (issue 39, 6) -------------------------------------------------


@pytest.mark.parametrize(("shape", "rows", "want"), [
    ((12, 8, 8, 1), {"batch_dims": (12,)}, ((12,), (8, 8, 1), ())),
    ((5, 3, 2), {"output_dims": (2,)}, ((5, 3), (2,), ())),
    ((5, 3, 2), {"batch_dims": (5,), "input_dims": (2,)}, ((5,), (3,), (2,))),
    ((5, 3, 2), {"output_dims": (3,), "input_dims": (2,)}, ((5,), (3,), (2,))),
    ((5, 3), {}, ((5,), (3,), ())),
    ((6,), {"batch_dims": (2,), "output_dims": (3,)}, ((2,), (3,), ())),  # flat, as set_values
], ids=["batch-given", "output-given", "batch-and-input", "output-and-input", "none",
        "flat"])
def test_a_terms_other_rows_come_from_its_array(shape, rows, want):
    """The rows not given are the array's other axes, laid out batch, output, input; the
    values keep their place (no re-cut)."""
    values = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    t = T.term(values, label="x", **rows)
    assert (t.shape.batch, t.shape.output, t.shape.input) == want
    assert t.value.host_data.reshape(-1).tolist() == values.reshape(-1).tolist()


@pytest.mark.parametrize(("values", "rows", "message"), [
    (np.arange(8.).reshape(4, 2), {"batch_dims": [2], "output_dims": [4]},
     r"term x: values of shape \(4, 2\) do not have the dims \(2, 4\) of 2\|->4"),
    (np.zeros((5, 3, 2)), {"output_dims": [3]},
     r"term x: values of shape \(5, 3, 2\) do not have the dims \(5, 3, 3\)"),
    (np.zeros((4, 2)), {"batch_dims": [2]},
     r"term x: values of shape \(4, 2\) do not hold batch_dims \(2,\)"),
    (np.zeros((4, 2)), {"input_dims": [2]},
     r"term x: input_dims \(2,\) alone leave the batch and output rows of values of shape "
     r"\(4, 2\) ambiguous: give batch_dims or output_dims too"),
    (["1.5", "2"], {}, r"term x: values must be real numbers, got dtype <U3"),
    ([1, "2"], {}, r"term x: values must be real numbers, got dtype <U21"),
], ids=["re-cut", "output-not-last", "batch-not-leading", "input-alone", "strings", "mixed"])
def test_rows_that_do_not_fit_the_array_and_non_numbers_are_refused(values, rows, message):
    """``T.term(np.arange(8.).reshape(4, 2), batch_dims=[2], output_dims=[4])`` re-cut the rows
    by size, a shape ``set_values`` refuses; strings were converted to numbers."""
    with pytest.raises(ValueError, match=message):
        T.term(values, label="x", **rows)


def test_shape_errors_name_the_tensor_the_op_and_the_fix():
    """Issue 39's errors met on the way: a parameter left open is refused when its dims are
    needed, naming it and its row; OCANNL's `*` left in place hints at `@`. (Until the
    inference, an open input row was refused at its first use other than `@`, and
    ``output_dims=None`` at the parameter: both are now inferred.)"""
    w = T.param("w", output_dims=(4,))
    assert T.einsum("i=>i", w).shape == Shape((), (4,), ())
    v = T.param("v", output_dims=None)
    with pytest.raises(ValueError, match=r"specify the output dims of v: nothing it meets fixes "
                                         r"them"):
        (v + 1.0).shape  # noqa: B018
    a = T.term(np.zeros((3, 2)), label="a")
    with pytest.raises(ValueError, match=r"do not broadcast in the output row \(`\*` is "
                                         r"pointwise here, OCANNL's `\*\.`; .* is `@`\)"):
        a * T.term(np.zeros((3, 5)), label="b")


def test_dim_bases_must_agree_where_axes_meet():
    """Upstream's dim labels: ``output_axes=[("rgb", 3)]`` is a size with a basis; it meets
    only the same basis (a plain 3 is another unit), through inference too."""
    rgb = T.term(np.ones(3), label="rgb", output_axes=[("rgb", 3)])
    assert rgb.shape_text() == "|->3_rgb" and rgb.dims == (3,)
    assert (rgb * 2.0).shape_text() == "|->3_rgb"
    with pytest.raises(ValueError, match=r"different bases: 3 and 3_rgb"):
        rgb + T.term(np.ones(3), label="plain")
    w = T.param("w")
    s = w + rgb
    assert s.shape_text().endswith("3_rgb") and not w.shape_known  # open: nothing closed
    assert str(s.shape) == str(w.shape) == "|->3_rgb"
    with pytest.raises(ValueError, match=r"einsum 'i;i=>i' .*different bases"):
        T.einsum("i;i=>i", rgb, T.term(np.ones(3), label="plain3"))
    with pytest.raises(ValueError, match="give output_dims or output_axes, not both"):
        T.term(np.ones(3), output_dims=[3], output_axes=[("rgb", 3)])


def test_a_parameter_left_open_is_refused_at_compile_before_any_allocation():
    from ocannl import Context, train

    w = T.param("mlp_w0")
    y = w * 2.0
    ctx = Context.cpu()
    with pytest.raises(ValueError, match="specify the output dims of mlp_w0: nothing it meets "
                                         "fixes them"):
        ctx.compile(train.forward(y))
    assert not ctx.is_allocated(y) and not w.shape_known  # nothing allocated, nothing closed
    z = y + T.term(np.ones(3), label="three")  # still open: a later use fixes it
    assert str(z.shape) == str(w.shape) == "|->3"
