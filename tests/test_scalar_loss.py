"""A loss is one cell: a wider tensor's gradient seeded with ones would silently optimize the
sum of its cells (issue 28; torch refuses it too)."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import mixed_prec, nn_blocks, optim, train


def _wide_loss() -> T.Tensor:
    x = T.term(np.ones((64, 3)), label="x")
    out, _ = nn_blocks.mlp(x, [4], 2, label="net")
    return out  # (64, 2): logits, not a loss


def test_grad_update_refuses_a_non_scalar_loss_naming_its_shape():
    t = _wide_loss()
    with pytest.raises(ValueError, match=r"grad_update: loss .* has 128 cells, expected one") \
            as err:
        train.grad_update(t)
    assert str(t.shape) in str(err.value)


@pytest.mark.parametrize("opt", [optim.SGD(0.1), optim.Adam(0.01), optim.AdamW(0.01)])
def test_optimizer_update_refuses_a_non_scalar_loss(opt):
    t = _wide_loss()
    with pytest.raises(ValueError, match=r"\.update: loss .* has 128 cells, expected one"):
        opt.update(t)
    with pytest.raises(ValueError, match="expected one"):
        train.sgd_update(t, learning_rate=0.1)


def test_recipes_refuse_a_non_scalar_loss():
    t = _wide_loss()
    for make in (mixed_prec.scaled_step, mixed_prec.gated_step):
        with pytest.raises(ValueError, match="expected one"):
            make(mixed_prec.Loss_scaler.create(), t, optim.SGD(0.1))


def test_a_one_cell_loss_of_any_rank_is_accepted():
    x = T.term(np.ones((4, 3)), label="x")
    out, _ = nn_blocks.mlp(x, [4], 1, label="net")
    loss = T.mean(out, [0])  # dims (1,): one cell
    assert train.grad_update(loss) is not None and optim.SGD(0.1).update(loss) is not None
