"""``nn_blocks.gpt``'s architecture in PyTorch, holding the same weights: the one twin that
``tiny_gpt.py --compare-torch``, ``tests/test_gpt.py`` and the ``gpt_mini`` benchmark train
against this project's model.

The same computation: token and learned position embeddings; per block a pre-norm layer norm
(eps 1e-5), causal multi-head attention (scores scaled by 1/sqrt(d_k), later keys set to -1e9
before the softmax), a residual; a layer norm, an exact-erf gelu MLP, a residual; a final layer
norm and a linear head. Every linear map has a bias.

Weights go in and out by ``gpt``'s parameter names (``tok_emb``, ``block0.wq``, ...), each in
torch's layout: ``gpt``'s attention projections are torch's ``(heads * d_k, d_model)`` reshaped,
so loading only reshapes, never transposes.

Like ``common.py``, it is imported with this folder on ``sys.path`` (``from torch_gpt import
TorchGPT``); it needs PyTorch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["TorchGPT", "gpt_names"]

# A block's torch parameter names -> ``decoder_block``'s.
_BLOCK_NAMES = {"ln1.weight": "ln1_gamma", "ln1.bias": "ln1_beta",
                "ln2.weight": "ln2_gamma", "ln2.bias": "ln2_beta",
                "fc1.weight": "w1", "fc1.bias": "b1", "fc2.weight": "w2", "fc2.bias": "b2",
                **{f"{m}.{kind}": f"{kind[0]}{m}" for m in "qkvo" for kind in ("weight", "bias")}}


def gpt_names(layers: int) -> dict[str, str]:
    """Torch parameter name -> ``nn_blocks.gpt``'s, for a model of ``layers`` blocks."""
    names = {"tok.weight": "tok_emb", "pos.weight": "pos_emb", "ln_f.weight": "ln_f_gamma",
             "ln_f.bias": "ln_f_beta", "head.weight": "head_w", "head.bias": "head_b"}
    for k in range(layers):
        names.update({f"blocks.{k}.{t}": f"block{k}.{o}" for t, o in _BLOCK_NAMES.items()})
    return names


class _Block(torch.nn.Module):
    def __init__(self, d_model: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.heads, self.d_k = heads, d_model // heads
        self.ln1 = torch.nn.LayerNorm(d_model, eps=1e-5)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d_model, d_model) for _ in range(4))
        self.ln2 = torch.nn.LayerNorm(d_model, eps=1e-5)
        self.fc1 = torch.nn.Linear(d_model, d_ff)
        self.fc2 = torch.nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        z = self.ln1(x)
        q, k, v = (lin(z).view(b, s, self.heads, self.d_k).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_k)
        later = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        a = (scores.masked_fill(later, -1e9).softmax(-1) @ v).transpose(1, 2)
        h = x + self.o(a.reshape(b, s, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="none"))


class TorchGPT(torch.nn.Module):
    """The twin of ``nn_blocks.gpt(ids, vocab=..., context=..., d_model=..., heads=...,
    layers=..., d_ff=...)``; ``forward`` maps ids ``(batch, seq)`` to logits
    ``(batch, seq, vocab)``."""

    def __init__(self, *, vocab: int, context: int, d_model: int, heads: int, layers: int,
                 d_ff: int | None = None) -> None:
        super().__init__()
        self.layers = layers
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        self.blocks = torch.nn.ModuleList(_Block(d_model, heads, d_ff or 4 * d_model)
                                          for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d_model, eps=1e-5)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))

    def load(self, weights: dict[str, np.ndarray]) -> TorchGPT:
        """Copy ``weights`` (by ``gpt``'s names, every one of them) into the parameters; a
        name missing or extra raises ``ValueError`` naming it. Returns the model."""
        names = gpt_names(self.layers)
        tensors = dict(self.named_parameters())
        missing = sorted(set(names.values()) - set(weights))
        extra = sorted(set(weights) - set(names.values()))
        if missing or extra or set(names) != set(tensors):
            raise ValueError(f"TorchGPT.load: weights missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for tname, oname in names.items():
                tp = tensors[tname]
                tp.copy_(torch.as_tensor(np.asarray(weights[oname], np.float32)).reshape(
                    tp.shape))
        return self
