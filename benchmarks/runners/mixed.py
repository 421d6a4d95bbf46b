"""The mixed-precision variants of this project's runner, built on ``ocannl.mixed_prec``.

The model reads bf16 / f16 cast twins of f32 master weights (``with_master_weights``) and an
input stored at the same precision; the softmax cross-entropy runs in f32 (as under torch's
autocast). The optimizer updates the f32 masters.

- ``bf16``: no loss scaling; grad_update and sgd_update fused into one routine.
- ``f16``: dynamic loss scaling, per-step host gate (the ``scaled_step`` recipe: gradient
  routine, host read of the checksum, optimizer routine, scaler update).
- ``f16-static``: a fixed loss scale, no checksum, no gate: one fused routine.
- ``f16-gated16``: the ``gated_step`` recipe: one fused routine gated on the device, the host
  sampling its skipped-step counter every 16 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from benchmarks.specs import VARIANTS

if TYPE_CHECKING:
    from benchmarks.runners.ocannl_runner import OcannlRunner


def build_mixed(r: OcannlRunner, variant: str) -> tuple[Callable[[], None], object]:
    """Build ``variant``'s model on ``r``'s context; the step callable and the loss tensor."""
    import ocannl.tensor as T
    from ocannl import mixed_prec, optim, train
    from ocannl.nn_blocks import mlp, softmax_cross_entropy

    w = r.fx.workload
    prec = VARIANTS[variant][0]
    x0, _ = r.fx.batch(0)
    r.x = T.term(x0, label="x", prec=prec)
    logits, twins = mixed_prec.with_master_weights(
        prec=prec, f=lambda: mlp(r.x, w.sizes[1:-1], w.classes, label="mlp"))
    loss = softmax_cross_entropy(T.cast(logits, "f32"), r.y)
    r.layers = [(mixed_prec.master_of(a), mixed_prec.master_of(b)) for a, b in twins]
    r._set_weights(r.layers)
    sgd = optim.SGD(w.learning_rate)  # plain SGD, as every runner of the suite
    ctx = r.ctx
    if variant == "bf16":
        comp = train.grad_update(loss) + sgd.update(loss)
        ctx, routine = ctx.compile(comp)
        r.ctx = ctx
        return (lambda: ctx.run(routine)), loss
    scaler = mixed_prec.Loss_scaler.create(init_scale=w.init_loss_scale,
                                           growth_interval=w.growth_interval)
    r.scaler = scaler
    if variant == "f16-static":
        comp = (train.grad_update(loss, loss_scale=scaler.scale)
                + sgd.update(loss, grad_unscale=scaler.unscale))
        ctx, routine = ctx.compile(comp)
        r.ctx = ctx
        return (lambda: ctx.run(routine)), loss
    recipe: mixed_prec.Recipe
    if variant == "f16":
        recipe = mixed_prec.scaled_step(scaler, loss, sgd)
    elif variant == "f16-gated16":
        recipe = mixed_prec.gated_step(scaler, loss, sgd, check_interval=16)
    else:
        raise ValueError(f"unknown mixed-precision variant {variant!r}")
    ctx = recipe.compile(ctx)
    r.ctx = ctx
    r.recipe = recipe
    return (lambda: recipe.step(ctx)), loss
