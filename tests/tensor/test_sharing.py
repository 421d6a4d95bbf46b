"""Inline parameters (``T.op``, upstream's ``%op``) and parameter inits: a function's
parameters are made at its first call and shared by every later call; its second instance
has its own; a label made twice in one call is refused."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, train


def _layer(x: T.Tensor) -> T.Tensor:
    return T.relu(T.param("w", output_dims=[3]) @ x + T.param("b", output_dims=[3]))


def test_an_op_makes_its_parameters_once_and_shares_them():
    layer = T.op(_layer)
    x1, x2 = T.term(np.ones((2, 4)), label="x1"), T.term(np.ones((5, 4)), label="x2")
    y1, y2 = layer(x1), layer(x2)
    assert [p.label for p in y1.params] == ["w", "b"]
    assert y1.params == y2.params == layer.params  # the same tensors: the same buffers
    assert y2.shape.batch == (5,)


def test_a_fresh_instance_has_its_own_parameters_labelled_by_it():
    layer = T.op(_layer)
    l2 = layer.fresh("l2")
    x = T.term(np.ones((2, 4)), label="x")
    y = l2(layer(x))
    assert [p.label for p in y.params] == ["w", "b", "l2_w", "l2_b"]
    assert y.params[2].shape.input == (3,)


def test_a_label_made_twice_in_one_call_is_refused():
    @T.op
    def twice(x: T.Tensor) -> T.Tensor:
        return T.param("w", output_dims=[2]) @ (T.param("w", output_dims=[2]) @ x)

    with pytest.raises(ValueError, match="two parameters are labelled 'w'"):
        twice(T.term(np.ones((2, 2)), label="x"))


def test_a_later_call_that_makes_another_parameter_is_refused():
    calls = []

    @T.op
    def grows(x: T.Tensor) -> T.Tensor:
        calls.append(1)
        extra = T.param(f"w{len(calls)}", output_dims=[2])
        return extra @ x

    x = T.term(np.ones((2, 2)), label="x")
    grows(x)
    with pytest.raises(ValueError, match="creates parameter 'w2', which the model's first build "
                                         "did not create"):
        grows(x)


@pytest.mark.parametrize("kind", ["xavier_uniform", "uniform1", "kaiming_uniform"])
def test_inits_draw_in_their_bounds(kind):
    T.set_seed(0)
    w = T.param("w", output_dims=[30], input_dims=[50], init=kind)
    ctx = train.init_params(Context.cpu(), T.sum(w))
    v = ctx.get_values(w)
    lo, hi = {"xavier_uniform": (-np.sqrt(6 / 80), np.sqrt(6 / 80)), "uniform1": (0.0, 1.0),
              "kaiming_uniform": (-1 / np.sqrt(50), 1 / np.sqrt(50))}[kind]
    assert v.shape == (30, 50) and lo <= v.min() and v.max() <= hi
    assert v.max() - v.min() > 0.8 * (hi - lo)  # spread over the range, not a constant


def test_the_default_init_is_settable_and_checked():
    T.set_default_init("uniform1")
    try:
        w = T.param("w", output_dims=[4], input_dims=[4])
        ctx = train.init_params(Context.cpu(), T.sum(w))
        assert ctx.get_values(w).min() >= 0.0
    finally:
        T.set_default_init("kaiming_uniform")
    with pytest.raises(ValueError, match="unknown init 'glorot'"):
        T.set_default_init("glorot")
