"""The generated toy datasets: seeded, shaped, balanced, and the shape its name promises."""

from __future__ import annotations

import numpy as np
import pytest

from ocannl import datasets


@pytest.mark.parametrize("make", [datasets.half_moons, datasets.circles])
def test_seeded_shapes_and_labels(make):
    x, y = make(101, seed=3)
    assert x.shape == (101, 2) and x.dtype == np.float32
    assert y.shape == (101,) and set(np.unique(y)) == {0, 1}
    assert abs(int(y.sum()) - 50.5) <= 0.5  # balanced: 50 and 51
    x2, y2 = make(101, seed=3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x3, _ = make(101, seed=4)
    assert not np.array_equal(x, x3)
    assert np.isfinite(x).all()


def test_half_moons_geometry():
    x, y = datasets.half_moons(2000, noise=0.0, seed=0)
    upper, lower = x[y == 0], x[y == 1]
    np.testing.assert_allclose(np.hypot(upper[:, 0], upper[:, 1]), 1.0, atol=1e-6)
    np.testing.assert_allclose(np.hypot(lower[:, 0] - 1, lower[:, 1] - 0.5), 1.0, atol=1e-6)
    assert (upper[:, 1] >= -1e-6).all() and (lower[:, 1] <= 0.5 + 1e-6).all()


def test_circles_geometry():
    x, y = datasets.circles(1000, noise=0.0, factor=0.3, seed=0)
    r = np.hypot(x[:, 0], x[:, 1])
    np.testing.assert_allclose(r[y == 0], 1.0, atol=1e-6)
    np.testing.assert_allclose(r[y == 1], 0.3, atol=1e-6)


def test_argument_errors():
    with pytest.raises(ValueError, match="n >= 2"):
        datasets.half_moons(1)
    with pytest.raises(ValueError, match="factor=1.5"):
        datasets.circles(10, factor=1.5)


def test_one_hot_and_gaussian_classes():
    oh = datasets.one_hot(np.array([2, 0, 1]), 3)
    np.testing.assert_array_equal(oh, [[0, 0, 1], [1, 0, 0], [0, 1, 0]])
    assert oh.dtype == np.float32
    x, y = datasets.gaussian_classes(500, 6, 4, seed=1)
    assert x.shape == (500, 6) and x.dtype == np.float32 and set(np.unique(y)) == {0, 1, 2, 3}
    x2, y2 = datasets.gaussian_classes(500, 6, 4, seed=1)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


@pytest.mark.parametrize("labels,shown", [([0, -1], "label -1 at (1,)"),
                                          ([2, 0], "label 2 at (0,)"),
                                          ([[0], [5]], "label 5 at (1, 0)")])
def test_one_hot_refuses_labels_that_are_not_classes(labels, shown):
    """NumPy's indexing would make -1 the last class (and 2 an IndexError naming nothing)."""
    with pytest.raises(ValueError, match=r"expected an integer in \[0, 2\)") as err:
        datasets.one_hot(labels, 2)
    assert shown in str(err.value)


def test_one_hot_refuses_non_integer_labels_and_class_counts():
    with pytest.raises(ValueError, match="labels must be integers, got dtype float64"):
        datasets.one_hot(np.array([0.0, 1.5]), 2)
    with pytest.raises(ValueError, match="classes must be an integer >= 1, got 2.0"):
        datasets.one_hot([0, 1], 2.0)
    assert datasets.one_hot(np.array([[1], [0]], np.uint8), 2).tolist() == [[[0, 1]], [[1, 0]]]
