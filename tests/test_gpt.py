"""The decoder-only transformer (``nn_blocks.gpt``, 2 layers) trained 20 steps with Adam from the
same weights and batches as its PyTorch twin (``examples/torch_gpt.py``): every loss within 1e-5
relative at f32, 2e-3 with f16 cast twins under dynamic loss scaling (fused gate), 1e-2 with
bf16 twins; and the torch losses fall (the comparison is not between constants).

Adam runs at 1e-3, as in tests/test_convnet.py (whose docstring says why a larger rate would
amplify the 16-bit rounding)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from adam_step import compile_adam_step  # noqa: E402 - the tests' shared step

import ocannl.tensor as T
from ocannl import Context, mixed_prec, nn_blocks, optim, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from torch_gpt import TorchGPT  # noqa: E402 - the PyTorch twin, shared with the example

VOCAB, CONTEXT, D_MODEL, HEADS, D_FF, LAYERS, B = 16, 8, 16, 2, 32, 2, 4
STEPS, LR = 20, 1e-3
TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1e-2}


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Four batches of token sequences, each target the next token of its input."""
    seqs = np.random.default_rng(seed).integers(0, VOCAB, size=(4, B, CONTEXT + 1))
    return seqs[:, :, :-1], seqs[:, :, 1:]


def _torch_losses(weights: dict[str, np.ndarray]) -> list[float]:
    xs, ys = _data()
    model = TorchGPT(vocab=VOCAB, context=CONTEXT, d_model=D_MODEL, heads=HEADS,
                     layers=LAYERS, d_ff=D_FF).load(weights)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = []
    for i in range(STEPS):
        opt.zero_grad()
        logits = model(torch.tensor(xs[i % 4]))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(ys[i % 4]).reshape(-1))
        out.append(float(loss.detach()))
        loss.backward()
        opt.step()
    return out


def _ocannl_losses(variant: str) -> tuple[list[float], dict[str, np.ndarray]]:
    xs, ys = _data()
    T.set_seed(3)
    ids = T.class_ids(xs[0], num_classes=VOCAB, label="ids")
    targets = T.class_ids(ys[0], num_classes=VOCAB, label="targets")

    def build():  # noqa: ANN202
        return nn_blocks.gpt(ids, vocab=VOCAB, context=CONTEXT, d_model=D_MODEL, heads=HEADS,
                             layers=LAYERS, d_ff=D_FF)

    if variant == "f32":
        logits, params = build()
    else:
        logits, params = mixed_prec.with_master_weights(prec=variant, f=build)
        assert {p.prec.value for p in params.values()} == {variant}
        logits = T.cast(logits, "f32")
    loss = nn_blocks.cross_entropy(logits, targets)
    masters = {name: mixed_prec.master_of(p) for name, p in params.items()}
    assert {p.prec.value for p in masters.values()} == {"f32"}
    assert sorted(p.value.id for p in masters.values()) == [p.value.id for p in loss.params]
    adam = optim.Adam(LR)
    ctx = train.init_params(Context.cpu(), loss)
    weights = {name: ctx.get_values(p).astype(np.float64) for name, p in masters.items()}
    ctx, step = compile_adam_step(ctx, loss, adam, variant)

    out = []
    for i in range(STEPS):
        ctx = ids.set(ctx, xs[i % 4])
        ctx = targets.set(ctx, ys[i % 4])
        ctx = step(ctx)
        out.append(float(ctx.get_values(loss)))  # the loss of the weights before this step
    return out, weights


def test_gpt_shapes_and_torch_layout():
    ids = T.class_ids(np.zeros((3, 5), int), num_classes=11)
    logits, params = nn_blocks.gpt(ids, vocab=11, context=7, d_model=12, heads=3, layers=2)
    assert logits.shape == T.Shape((3, 5), (11,), ())
    dims = {name: p.dims for name, p in params.items()}
    assert list(dims)[:2] == ["tok_emb", "pos_emb"] and list(dims)[-4:] == [
        "ln_f_gamma", "ln_f_beta", "head_w", "head_b"]
    assert dims["tok_emb"] == (11, 12) and dims["pos_emb"] == (7, 12)
    assert dims["block1.wq"] == (3, 4, 12) and dims["block1.wo"] == (12, 3, 4)
    assert dims["block0.w1"] == (48, 12) and dims["block0.w2"] == (12, 48)
    assert dims["head_w"] == (11, 12) and dims["head_b"] == (11,)
    assert len(params) == 4 + 2 + 2 * 16
    with pytest.raises(ValueError, match="at most context=4 long"):
        nn_blocks.gpt(ids, vocab=11, context=4, d_model=12, heads=3, layers=1)
    with pytest.raises(ValueError, match="d_model 12 is not a multiple of heads 5"):
        nn_blocks.gpt(ids, vocab=11, context=7, d_model=12, heads=5, layers=1)
    with pytest.raises(ValueError, match="layers must be an integer >= 1, got 0"):
        nn_blocks.gpt(ids, vocab=11, context=7, d_model=12, heads=3, layers=0)


@pytest.mark.parametrize("variant", ["f32", "f16", "bf16"])
def test_gpt_trains_like_torch(variant: str) -> None:
    ours, weights = _ocannl_losses(variant)
    theirs = _torch_losses(weights)
    rel = np.abs(np.array(ours) - theirs) / np.abs(theirs)
    assert rel.max() <= TOL[variant], (variant, rel.max(), ours, theirs)
    assert theirs[-1] < theirs[0] - 0.05  # it learns: the comparison is not between constants
