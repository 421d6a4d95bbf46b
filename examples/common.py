"""What several examples share: the backend choice and the per-epoch batch order.

An example run as a script (``python examples/NAME.py``) has this folder on ``sys.path``, so
``from common import make_context, batch_indices`` works there; tests load the examples the
same way.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from ocannl import Context

__all__ = ["BACKENDS", "batch_indices", "make_context"]

BACKENDS = ("auto", "cpu", "cuda")


def make_context(backend: str) -> Context:
    """The context of a ``--backend`` choice. ``cpu``: the CPU. ``auto``: the GPU when CuPy
    sees a usable one, else the CPU, the reason printed as one ``note:`` line on stderr.
    ``cuda``: the GPU, or an exit (status 1) with the reason -- never a silent CPU run."""
    if backend not in BACKENDS:
        raise ValueError(f"make_context: backend must be one of {', '.join(BACKENDS)}, got "
                         f"{backend!r}")
    if backend == "cpu":
        return Context.cpu()
    if backend == "auto":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ctx = Context.auto()
        for w in caught:
            print(f"note: {w.message}", file=sys.stderr)
        return ctx
    try:
        return Context.cuda()
    except Exception as err:  # noqa: BLE001 - every reason means: no usable GPU here
        sys.exit(f"error: --backend cuda needs an NVIDIA GPU usable through CuPy, and none is "
                 f"usable here ({type(err).__name__}: {err}). Use --backend cpu or auto.")


def batch_indices(step: int, n: int, batch: int, seed: int) -> np.ndarray:
    """The indices (into ``n`` training points) of the minibatch of ``step``: each epoch of
    ``n // batch`` steps walks a fresh permutation drawn from ``(seed, epoch)``, leaving out the
    ``n % batch`` points that do not fill a batch. A function of the step alone, so a resumed run
    sees the batches the uninterrupted one would have. ``ValueError`` unless
    ``1 <= batch <= n`` and ``step >= 0``."""
    for name, v in (("step", step), ("n", n), ("batch", batch), ("seed", seed)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            raise ValueError(f"batch_indices: {name} must be an integer, got {v!r}")
    if not 1 <= batch <= n:
        raise ValueError(f"batch_indices: batch must be between 1 and n={n}, got {batch}")
    if step < 0:
        raise ValueError(f"batch_indices: step must be >= 0, got {step}")
    if seed < 0:
        raise ValueError(f"batch_indices: seed must be >= 0, got {seed}")
    epoch, k = divmod(int(step), n // batch)
    perm = np.random.default_rng([int(seed), epoch]).permutation(n)
    return perm[k * batch:(k + 1) * batch]
