"""Sizes are whole numbers: a float or an int where a list of them is expected is refused with
a TypeError naming the argument, never truncated (issue 28)."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T


@pytest.mark.parametrize("kw,name,shown", [
    (dict(output_dims=[2.7]), "output_dims", "2.7"),
    (dict(output_dims=3), "output_dims", "3"),
    (dict(output_dims=[2], input_dims=[1.0]), "input_dims", "1.0"),
    (dict(output_dims=[2], batch_dims=(np.float32(2),)), "batch_dims", "2.0"),
    (dict(output_dims="3"), "output_dims", "'3'"),
    (dict(output_dims=[True]), "output_dims", "True"),
])
def test_param_refuses_non_integer_dims(kw, name, shown):
    with pytest.raises(TypeError, match=name) as err:
        T.param("w", **kw)
    assert shown in str(err.value)


def test_term_refuses_non_integer_dims():
    with pytest.raises(TypeError, match="output_dims"):
        T.term(label="t", output_dims=[2.5])


def test_integer_kinds_are_accepted():
    from ocannl.tensor.shape import int_dims, int_value

    assert int_dims("d", [np.int64(2), 3]) == (2, 3)
    assert int_dims("d", np.array([4, 5])) == (4, 5)
    assert int_value("n", np.int32(7)) == 7
    assert T.param("w", output_dims=(np.int64(3),), input_dims=[2]).dims == (3, 2)


def test_conv_and_pool_refuse_float_strides_and_windows():
    from ocannl.tensor import spatial

    x = T.term(np.zeros((1, 6, 6, 1)), label="x", batch_dims=(1,), output_dims=(6, 6, 1))
    k = T.term(np.zeros((2, 3, 3, 1)), label="k", batch_dims=(), output_dims=(2,),
               input_dims=(3, 3, 1))
    with pytest.raises(TypeError, match="conv2d: stride must be an integer, got 1.5"):
        spatial.conv2d(x, k, stride=1.5)
    with pytest.raises(TypeError, match="conv2d: padding must be an integer, got 0.5"):
        spatial.conv2d(x, k, padding=0.5)
    with pytest.raises(TypeError, match=r"max_pool2d: window must be an integer, got 2\.0"):
        spatial.max_pool2d(x, window=2.0)
    with pytest.raises(TypeError, match=r"avg_pool2d: stride must be an integer, got 2\.0"):
        spatial.avg_pool2d(x, stride=2.0)
