"""Workload specs: the model, data and hyperparameters each fixture is generated from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# Parity tolerances (max relative loss error against PyTorch CPU f32) by storage precision.
TOLERANCE = {"f32": 1e-5, "f16": 2e-3, "bf16": 4e-3}

# This project's variants: name -> (compute precision, description).
VARIANTS = {
    "f32": ("f32", "f32 throughout"),
    "bf16": ("bf16", "bf16 twins of f32 master weights, no loss scaling"),
    "f16": ("f16", "f16 twins, loss scaling, per-step host gate"),
    "f16-static": ("f16", "f16 twins, fixed loss scale, no gate"),
    "f16-gated16": ("f16", "f16 twins, fused on-device gate, host check every 16 steps"),
}


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: an MLP on a generated dataset, trained with plain SGD."""

    name: str
    dataset: str  # "half_moons" or "gaussian_classes"
    sizes: tuple[int, ...]  # input, hidden..., classes
    batch: int
    n_batches: int  # distinct batches in the fixture; step i uses batch i % n_batches
    learning_rate: float
    seed: int
    parity_steps: int
    warmup_steps: int
    timed_steps: int  # per runner, split over the interleaved rounds
    rounds: int
    init_loss_scale: float = 1024.0
    growth_interval: int = 100_000  # large: no growth during a run, so no skipped steps

    @property
    def classes(self) -> int:
        return self.sizes[-1]

    def gemm_flops(self) -> int:
        """FLOPs of the step's GEMMs: forward, weight gradient, and input gradient except for
        the first layer (its input is data)."""
        b = self.batch
        pairs = list(zip(self.sizes[:-1], self.sizes[1:], strict=True))
        return sum(2 * b * i * o * (2 if k == 0 else 3) for k, (i, o) in enumerate(pairs))

    def to_meta(self) -> dict[str, str]:
        return {k: repr(v) for k, v in asdict(self).items()}

    def fixture_meta(self) -> dict[str, str]:
        """The metadata fields that determine a fixture's tensors (not the step counts)."""
        keys = ("name", "dataset", "sizes", "batch", "n_batches", "learning_rate", "seed")
        return {k: v for k, v in self.to_meta().items() if k in keys}


WORKLOADS: dict[str, Workload] = {
    "mlp_small": Workload(
        name="mlp_small", dataset="half_moons", sizes=(2, 32, 32, 2), batch=32, n_batches=16,
        learning_rate=0.1, seed=1, parity_steps=20, warmup_steps=50, timed_steps=2000,
        rounds=10,
    ),
    "mlp_wide": Workload(
        name="mlp_wide", dataset="gaussian_classes", sizes=(256, 1024, 1024, 10), batch=256,
        n_batches=8, learning_rate=0.01, seed=2, parity_steps=20, warmup_steps=5,
        timed_steps=100, rounds=20,
    ),
}


def scaled(w: Workload, factor: float) -> Workload:
    """The same workload with fewer steps (for smoke tests and quick runs)."""
    if factor == 1.0:
        return w
    return replace(
        w,
        parity_steps=max(2, int(w.parity_steps * factor)),
        warmup_steps=max(1, int(w.warmup_steps * factor)),
        timed_steps=max(w.rounds, int(w.timed_steps * factor)),
    )
