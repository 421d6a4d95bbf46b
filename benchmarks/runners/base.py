"""The runner protocol and the row identity every runner reports under."""

from __future__ import annotations

from typing import Protocol


class Unavailable(Exception):
    """The runner cannot run on this machine (no GPU, no compiler, no module): skip its row."""


class Runner(Protocol):
    """Trains one workload from its fixture's initial weights.

    ``build`` constructs and compiles the step (its wall time is the compile time);
    ``step(i)`` feeds batch ``i`` and trains one step; ``loss()`` reads the loss the last
    step computed (before its update); ``mem_bytes`` is the device bytes held, when known.
    """

    framework: str  # "ocannl" or "torch"
    variant: str  # e.g. "f32", "f16-gated16", "eager", "compile"
    device: str  # "cpu" or "cuda"
    # (optional) True on the A/A control's runner: a second one of an ocannl row

    def build(self) -> None: ...

    def step(self, i: int) -> None: ...

    def loss(self) -> float: ...

    def sync(self) -> None: ...

    def mem_bytes(self) -> int | None: ...


def row_name(r: Runner) -> str:
    return f"{r.framework} {r.device} {r.variant}"


def trained_losses(r: Runner, steps: int) -> list[float]:
    """Build ``r`` and train ``steps`` steps from its fixture: each step's loss."""
    r.build()
    out = []
    for i in range(steps):
        r.step(i)
        out.append(r.loss())
    return out
