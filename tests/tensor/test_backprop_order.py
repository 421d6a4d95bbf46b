"""The order backprop code runs in (``Tensor.backprop_comp``): each tensor's once every tensor
writing its gradient has run, and a cast twin's right after its gradient is complete."""

from __future__ import annotations

import numpy as np

import ocannl.tensor as T
from ocannl import mixed_prec, nn_blocks


def _writers(loss: T.Tensor) -> dict[int, set[int]]:
    """Tensor -> the tensors whose backprop code writes its gradient (by id)."""
    order = [t for t in loss.topo() if t.grad is not None]
    by_grad = {t.grad.id: t for t in order}
    out: dict[int, set[int]] = {id(t): set() for t in order}
    for t in order:
        for a in t.backprop_code:
            c = by_grad.get(a.lhs.id)
            if c is not None and c is not t:
                out[id(c)].add(id(t))
    return out


def _runs(loss: T.Tensor) -> list[T.Tensor]:
    """The tensors in the order their backprop code appears in ``backprop_comp``."""
    owner = {id(a): t for t in loss.topo() for a in t.backprop_code}
    seen: dict[int, T.Tensor] = {}
    for a in loss.backprop_comp().assignments:
        seen.setdefault(id(owner[id(a)]), owner[id(a)])
    return list(seen.values())


def _gpt_loss() -> T.Tensor:
    seqs = np.random.default_rng(1).integers(0, 9, size=(2, 6))
    ids = T.class_ids(seqs[:, :-1], num_classes=9, label="ids")
    targets = T.class_ids(seqs[:, 1:], num_classes=9, label="targets")
    logits, _ = mixed_prec.with_master_weights(prec="bf16", f=lambda: nn_blocks.gpt(
        ids, vocab=9, context=5, d_model=8, heads=2, layers=2))
    return nn_blocks.cross_entropy(T.cast(logits, "f32"), targets)


def test_each_tensor_runs_after_every_writer_of_its_gradient():
    loss = _gpt_loss()
    runs = _runs(loss)
    at = {id(t): k for k, t in enumerate(runs)}
    writers = _writers(loss)
    assert runs[0] is loss
    for t in runs:
        assert all(at[w] < at[id(t)] for w in writers[id(t)]), t.label
    # every tensor with backprop code runs exactly once
    assert len(runs) == len({id(t) for t in loss.topo() if t.backprop_code})


def test_a_cast_twin_flows_into_its_master_right_after_its_gradient_is_complete():
    """The twin's gradient is local: consumed at once, it holds memory only briefly (it used
    to wait for the whole backward pass)."""
    loss = _gpt_loss()
    runs = _runs(loss)
    at = {id(t): k for k, t in enumerate(runs)}
    writers = _writers(loss)
    twins = [t for t in runs if t.master is not None]
    assert len(twins) > 10
    for twin in twins:
        assert at[id(twin)] == max(at[w] for w in writers[id(twin)]) + 1, twin.label
