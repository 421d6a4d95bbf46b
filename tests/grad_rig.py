"""A small classifier of fresh shapes and its PyTorch twin, for the clipping, accumulation and
overflow-name tests: 5 features -> relu 10 -> relu 8 -> 3 classes, micro-batches of 12 rows.

The ocannl model is an ``nn_blocks.mlp`` (f32, or f16 cast twins of f32 masters); the torch
one reads the same initial weights and the same micro-batches and runs in f32."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import ocannl.tensor as T
from ocannl import Context, checkpoint, nn_blocks, optim, train
from ocannl.mixed_prec import with_master_weights

BATCH, FEATURES, HIDDEN, CLASSES = 12, 5, (10, 8), 3


@dataclass
class Rig:
    x: T.Tensor
    y: T.Tensor
    loss: T.Tensor
    ctx: Context
    batches: list[tuple[np.ndarray, np.ndarray]]  # (points, one-hot targets) micro-batches

    def feed(self, ctx: Context, i: int) -> Context:
        xb, yb = self.batches[i % len(self.batches)]
        return ctx.set_values(self.x, xb).set_values(self.y, yb)

    @property
    def params(self) -> list[T.Tensor]:
        return self.loss.params

    def names(self) -> list[str]:
        return checkpoint.node_names([p.value for p in self.params])

    def weights(self, ctx: Context) -> list[np.ndarray]:
        return [ctx.get_values(p).astype(np.float64) for p in self.params]


def make_rig(prec: str = "f32", seed: int = 3, n_batches: int = 8, scale: float = 1.0) -> Rig:
    T.set_seed(seed)
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n_batches):
        # f16-exact points: the f16 rigs' inputs are the torch twin's, not a rounding of them
        xb = rng.standard_normal((BATCH, FEATURES)).astype(np.float16).astype(np.float32)
        xb = xb * np.float32(scale)
        labels = rng.integers(0, CLASSES, BATCH)
        batches.append((xb, np.eye(CLASSES, dtype=np.float32)[labels]))
    x = T.term(np.zeros((BATCH, FEATURES)), label="x", prec=prec)
    y = T.term(np.zeros((BATCH, CLASSES)), label="y")

    def build() -> T.Tensor:
        return nn_blocks.mlp(x, list(HIDDEN), CLASSES)[0]

    logits = build() if prec == "f32" else with_master_weights(prec=prec, f=build)
    loss = nn_blocks.softmax_cross_entropy(T.cast(logits, "f32") if prec != "f32" else logits, y)
    ctx = train.init_params(Context.cpu(), loss)
    rig = Rig(x, y, loss, ctx, batches)
    rig.ctx = rig.feed(ctx, 0)
    return rig


def torch_optimizer(kind: str, ws: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(ws, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(ws, lr=1e-2)
    if kind == "adam3":  # the f16 twins' Adam (see test_clipping's f16 test)
        return torch.optim.Adam(ws, lr=3e-3)
    if kind == "adamw":
        return torch.optim.AdamW(ws, lr=1e-2, weight_decay=0.1)
    raise ValueError(kind)


def ocannl_optimizer(kind: str) -> optim.Optimizer:
    if kind == "sgd":
        return optim.SGD(0.1, momentum=0.9)
    if kind == "adam":
        return optim.Adam(1e-2)
    if kind == "adam3":
        return optim.Adam(3e-3)
    if kind == "adamw":
        return optim.AdamW(1e-2, weight_decay=0.1)
    raise ValueError(kind)


@dataclass
class TorchRun:
    losses: list[float]      # every micro-batch's loss (unscaled, undivided)
    norms: list[float]       # clip_grad_norm_'s total norm at each optimizer step
    clamped: list[int]       # gradient cells clip_grad_value_ changed at each optimizer step
    weights: list[np.ndarray]


def torch_run(rig: Rig, w0: list[np.ndarray], *, kind: str, steps: int, accumulate: int = 1,
              clip: tuple[str, float, float] | None = None, scaler: bool = False) -> TorchRun:
    """Torch's loop: ``accumulate`` micro-batches of ``(loss / k).backward()`` (through a CPU
    ``GradScaler`` when ``scaler``), ``unscale_``, the clip, ``step``, ``update``."""
    ws = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in w0]
    opt = torch_optimizer(kind, ws)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**16) if scaler else None
    out = TorchRun([], [], [], [])
    micro = 0
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            xb, yb = rig.batches[micro % len(rig.batches)]
            micro += 1
            h = torch.tensor(xb)
            for k in range(0, len(ws), 2):
                h = h @ ws[k].T + ws[k + 1]
                if k + 2 < len(ws):
                    h = torch.relu(h)
            loss = torch.nn.functional.cross_entropy(h, torch.tensor(yb.argmax(-1)))
            out.losses.append(loss.item())
            lk = loss / accumulate if accumulate > 1 else loss
            (gs.scale(lk) if gs is not None else lk).backward()
        if gs is not None:
            gs.unscale_(opt)
        if clip is not None:
            how, limit, norm_type = clip
            if how == "norm":
                out.norms.append(float(torch.nn.utils.clip_grad_norm_(ws, limit, norm_type)))
            else:
                out.clamped.append(sum(int((w.grad.abs() > limit).sum()) for w in ws))
                torch.nn.utils.clip_grad_value_(ws, limit)
        if gs is not None:
            gs.step(opt)
            gs.update()
        else:
            opt.step()
    out.weights = [w.detach().double().numpy() for w in ws]
    return out


def run_steps(rig: Rig, ctx: Context, step: Callable[[Context], Context], micro_batches: int,
              ) -> tuple[Context, list[float]]:
    """Feed micro-batch ``i`` and run ``step`` for i in range(micro_batches); the losses."""
    losses = []
    for i in range(micro_batches):
        ctx = rig.feed(ctx, i)
        ctx = step(ctx)
        losses.append(ctx.get_value(rig.loss))
    return ctx, losses


def assert_close(got: list, want: list, rtol: float) -> None:
    """Relative agreement, cell by cell (scaled by the largest magnitude of each array, so a
    cell that is near 0 in both is not held to a relative bound it cannot have)."""
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        ref = max(float(np.max(np.abs(w))), 1e-30)
        err = float(np.max(np.abs(g - w))) / ref
        assert err <= rtol and math.isfinite(err), (err, rtol)
