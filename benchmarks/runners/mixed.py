"""The mixed-precision variants of this project's runner, built on ``ocannl.mixed_prec``.

Any model: ``build_mixed`` takes a model builder (the input tensor -> the logits and the
parameters, as ``benchmarks.models.ocannl_model``), the optimizer and the loss. The model reads
bf16 / f16 cast twins of f32 master weights (``with_master_weights``) and its f32 input cast
to the same precision inside the step (token ids stay f32); the softmax cross-entropy runs in
f32 (as under torch's autocast). The optimizer updates the f32 masters.

- ``bf16``: no loss scaling; grad_update and the optimizer's update fused into one routine.
- ``f16``: dynamic loss scaling, per-step host gate (the ``scaled_step`` recipe: gradient
  routine, host read of the checksum, optimizer routine, scaler update).
- ``f16-static``: a fixed loss scale, no checksum, no gate: one fused routine.
- ``f16-gated16``: the ``gated_step`` recipe: one fused routine gated on the device, the host
  sampling its skipped-step counter every 16 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from benchmarks.specs import VARIANTS

if TYPE_CHECKING:
    from benchmarks.runners.ocannl_runner import OcannlRunner

# The input tensor -> the logits and the parameters: (weight, bias) pairs, first layer first,
# or tensors by name.
ModelBuilder = Callable[[Any], tuple[Any, list[tuple[Any, Any]] | dict[str, Any]]]
# The f32 logits and the target tensor -> the loss.
LossBuilder = Callable[[Any, Any], Any]


def build_mixed(r: OcannlRunner, variant: str, model: ModelBuilder, opt: Any,
                loss_of: LossBuilder | None = None) -> tuple[Callable[[], None], object]:
    """Build ``variant``'s step of ``model`` over ``r.x`` (the f32 input, cast to the variant's
    precision in the step; a gpt's token ids as they are) on ``r``'s context, its loss
    ``loss_of(f32 logits, r.y)`` (default: softmax cross-entropy), trained by the optimizer
    ``opt`` (an ``ocannl.optim`` object); the step callable and the loss tensor. Sets
    ``r.layers`` (the f32 masters)."""
    import ocannl.tensor as T
    from ocannl import mixed_prec, train
    from ocannl.nn_blocks import softmax_cross_entropy

    w = r.fx.workload
    prec = VARIANTS[variant][0]
    x = r.x if w.model == "gpt" else T.cast(r.x, prec)
    logits, twins = mixed_prec.with_master_weights(prec=prec, f=lambda: model(x))
    loss = (loss_of or softmax_cross_entropy)(T.cast(logits, "f32"), r.y)
    if isinstance(twins, dict):
        r.layers = {name: mixed_prec.master_of(p) for name, p in twins.items()}
    else:
        r.layers = [(mixed_prec.master_of(a), mixed_prec.master_of(b)) for a, b in twins]
    r._set_weights(r.layers)
    ctx = r.ctx
    if variant == "bf16":
        comp = train.grad_update(loss) + opt.update(loss)
        ctx, routine = ctx.compile(comp)
        r.ctx = ctx
        return (lambda: ctx.run(routine)), loss
    scaler = mixed_prec.Loss_scaler.create(init_scale=w.init_loss_scale,
                                           growth_interval=w.growth_interval)
    r.scaler = scaler
    if variant == "f16-static":
        comp = (train.grad_update(loss, loss_scale=scaler.scale)
                + opt.update(loss, grad_unscale=scaler.unscale))
        ctx, routine = ctx.compile(comp)
        r.ctx = ctx
        return (lambda: ctx.run(routine)), loss
    recipe: mixed_prec.Recipe
    if variant == "f16":
        recipe = mixed_prec.scaled_step(scaler, loss, opt)
    elif variant == "f16-gated16":
        recipe = mixed_prec.gated_step(scaler, loss, opt, check_interval=16)
    else:
        raise ValueError(f"unknown mixed-precision variant {variant!r}")
    ctx = recipe.compile(ctx)
    r.ctx = ctx
    r.recipe = recipe
    return (lambda: recipe.step(ctx)), loss
