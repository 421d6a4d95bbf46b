"""The training step the model-zoo parity tests share (``test_convnet``, ``test_gpt``): Adam,
under the fused-gate recipe with dynamic loss scaling for f16 twins, else as one routine."""

from __future__ import annotations

from collections.abc import Callable

from ocannl import Context, mixed_prec, optim, train
from ocannl.tensor import Tensor


def compile_adam_step(ctx: Context, loss: Tensor, adam: optim.Adam, variant: str
                      ) -> tuple[Context, Callable[[Context], Context]]:
    """The compiled step and the context holding it. f16: ``gated_step`` from a loss scale of
    1024, its host check every 4 steps; f32 and bf16: gradients and the update in one
    routine."""
    if variant == "f16":
        scaler = mixed_prec.Loss_scaler.create(init_scale=1024.0)
        recipe = mixed_prec.gated_step(scaler, loss, adam, check_interval=4)
        return recipe.compile(ctx), recipe.step
    ctx, r = ctx.compile(train.grad_update(loss) + adam.update(loss))
    return ctx, lambda c: c.run(r)
