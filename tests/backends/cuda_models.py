"""The models the CUDA tests generate kernels from and run: a small relu MLP with softmax
cross-entropy, f32 or through 16-bit cast twins of f32 master parameters, with every routine
the training layer builds (forward, backprop, SGD with momentum, checksum, fused gated step)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import ocannl.tensor as T
from ocannl import datasets, train
from ocannl.ir.assignments import Comp, Get, apply
from ocannl.ir.ops import Precision, precision_of
from ocannl.ir.tnode import Tnode
from ocannl.nn_blocks import softmax_cross_entropy
from ocannl.tensor.tensor import Tensor


@dataclass
class Problem:
    """One model and the computations the tests compile."""

    prec: Precision
    x: Tensor
    y: Tensor
    lr: Tensor
    loss: Tensor
    params: list[Tensor]
    flag: Tensor
    comps: dict[str, Comp]


def build(prec: Precision | str = "f32", *, dims: tuple[int, ...] = (2, 16, 16, 2),
          batch: int = 32, seed: int = 0) -> Problem:
    """An MLP ``dims[0] -> ... -> dims[-1]`` over ``batch`` points (half moons when 2-D in,
    Gaussian classes otherwise); 16-bit models read f32 master weights through ``cast``."""
    prec = precision_of(prec)
    T.set_seed(seed)
    if dims[0] == 2:
        xs, labels = datasets.half_moons(batch, seed=seed)
    else:
        xs, labels = datasets.gaussian_classes(batch, dims[0], dims[-1], seed=seed)
    onehot = np.eye(dims[-1], dtype=np.float32)[labels % dims[-1]]
    x = T.term(xs, label="x", prec=prec)
    y = T.term(onehot, label="y", prec=prec)
    lr = T.term(np.array(0.1), label="lr")
    h: Tensor = x
    for k in range(1, len(dims)):
        w = T.param(f"w{k}", output_dims=[dims[k]], input_dims=[dims[k - 1]])
        b = T.param(f"b{k}", output_dims=[dims[k]], input_dims=(), init="zeros")
        if prec is not Precision.f32:
            w, b = T.cast(w, prec), T.cast(b, prec)
        h = w @ h + b
        if k < len(dims) - 1:
            h = T.relu(h)
    loss = softmax_cross_entropy(h, y)
    flag, checksum = train.grad_checksum(loss)
    gate = apply("isfinite", Get(flag.value, ()))
    comps = {
        "forward": train.forward(loss),
        "grad": train.grad_update(loss),
        "sgd": train.sgd_update(loss, learning_rate=lr, momentum=0.9),
        "checksum": checksum,
        "step": train.grad_update(loss) + train.sgd_update(loss, learning_rate=lr, momentum=0.9),
        "gated": train.grad_update(loss) + checksum
        + train.sgd_update(loss, learning_rate=lr, momentum=0.9, gate=gate),
    }
    return Problem(prec, x, y, lr, loss, loss.params, flag, comps)


def run_steps(ctx: Any, problem: Problem, steps: int, comp: str = "step"
              ) -> tuple[list[float], dict[str, np.ndarray]]:
    """Initialise the parameters, compile ``comp`` and run it ``steps`` times; returns the
    loss seen by each step and the final parameters (as f64 arrays)."""
    ctx = train.init_params(ctx, problem.loss)
    ctx, routine = ctx.compile(problem.comps[comp])
    losses = []
    for _ in range(steps):
        ctx = ctx.run(routine)
        losses.append(ctx.get_value(problem.loss))
    params = {p.label: ctx.get_values(p).astype(np.float64) for p in problem.params}
    return losses, params


def rel_err(a: Sequence[float], b: Sequence[float]) -> float:
    """Largest relative difference between two loss curves."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def momenta(problem: Problem) -> list[Tnode]:
    """The SGD momentum buffers of the problem's parameters."""
    return [train.optimizer_state(p, "momentum") for p in problem.params]
