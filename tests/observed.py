"""A context and a loss scaler that record what a recipe asks of them: the routines it runs
(by label) and the scaler updates it makes, through their public API only."""

from __future__ import annotations

from ocannl import Context
from ocannl.mixed_prec import Loss_scaler


def observed() -> tuple[type[Context], type[Loss_scaler], list[str], list[tuple]]:
    """Fresh subclasses of ``Context`` and ``Loss_scaler`` and the two lists they append to:
    each run routine's label; ``("update", finite)`` / ``("update_n", finite, steps)``."""
    runs: list[str] = []
    updates: list[tuple] = []

    class SeenContext(Context):
        def run(self, routine):  # noqa: ANN001, ANN202
            runs.append(routine.label)
            return super().run(routine)

    class SeenScaler(Loss_scaler):
        def update(self, ctx, *, grads_finite):  # noqa: ANN001, ANN202
            updates.append(("update", grads_finite))
            return super().update(ctx, grads_finite=grads_finite)

        def update_n(self, ctx, *, grads_finite, steps):  # noqa: ANN001, ANN202
            updates.append(("update_n", grads_finite, steps))
            return super().update_n(ctx, grads_finite=grads_finite, steps=steps)

    return SeenContext, SeenScaler, runs, updates
