"""Mixed-precision training: master weights, dynamic loss scaling, scaled and fused-gated steps.

Three pieces, as in OCANNL's ``Mixed_prec``, one module each:

- **Master weights** (:mod:`.twins`: :func:`cast_param`, :func:`with_master_weights`): every
  parameter stays an f32 *master*, the tensor the optimizer updates and checkpoints save. The
  model reads a reduced-precision *cast twin* of it, recomputed from the master by each forward
  pass; the twin's gradient accumulates back into the master's f32 gradient.
- **Loss scaling** (:mod:`.scaler`: :class:`Loss_scaler`; its f32 arithmetic in :mod:`.scale`):
  f16's exponent range loses small gradients, so the backprop is seeded with a scale and the
  optimizer multiplies gradients by its reciprocal. The scale lives in one-element device
  buffers the host overwrites, so a new scale never recompiles anything. The schedule is
  torch-AMP's, to the bit.
- **Recipes** (:mod:`.recipes`) over any :mod:`ocannl.optim` optimizer, one interface
  (:class:`Recipe`): :func:`scaled_step` (the host reads the gradient checksum after every
  gradient routine and runs or skips the optimizer routine) and :func:`gated_step` (one fused
  routine whose optimizer step is gated on the device; the host samples a skipped-step counter
  every ``check_interval`` steps). Both clip the unscaled gradients (``clip=``, see
  :mod:`ocannl.clipping`), accumulate micro-batches under one scale (``accumulate=k``), and
  name the parameters whose gradients overflowed when a step is skipped (``last_overflow``).

The scaler's and the recipes' one-line states share one parser (:mod:`.state`).

bf16 has f32's exponent range and needs no loss scaling; f16 does.
"""

from ocannl.mixed_prec.recipes import (
    GatedStep,
    GradReducer,
    Recipe,
    ScaledStep,
    gated_step,
    scaled_grad_update,
    scaled_step,
)
from ocannl.mixed_prec.scale import _reciprocal_f32  # noqa: F401 - ocannl.parallel reads it here
from ocannl.mixed_prec.scaler import Loss_scaler
from ocannl.mixed_prec.twins import TWIN_PLACEMENTS, cast_param, master_of, with_master_weights

__all__ = [
    "TWIN_PLACEMENTS", "GatedStep", "GradReducer", "Loss_scaler", "Recipe", "ScaledStep",
    "cast_param", "gated_step", "master_of", "scaled_grad_update", "scaled_step",
    "with_master_weights",
]
