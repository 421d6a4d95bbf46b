"""What the suite records per row, and the few statistics it reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Row:
    """One (workload, framework, device, variant) row of the report. Times in seconds."""

    workload: str
    framework: str
    device: str
    variant: str
    status: str = "pending"  # "ok", "parity-fail", "skipped", "error"
    note: str = ""
    tolerance: float | None = None
    parity_err: float | None = None
    p10: float | None = None
    p50: float | None = None
    p90: float | None = None
    steps_timed: int = 0
    rounds: int = 0  # the interleaved rounds the samples were taken in, in order
    build_s: float | None = None  # in the benchmark process (cache state as found)
    compile_cold_s: float | None = None  # fresh process, empty on-disk cache
    compile_warm_s: float | None = None  # fresh process, cache filled by the cold one
    setup_cold_s: float | None = None  # the libraries' per-process set-up, cold and warm
    setup_warm_s: float | None = None
    peak_rss_mib: float | None = None  # fresh process: peak resident growth over imports
    # device buffers + scratch (an ocannl context's ``mem()``: its buffers and the arena of its
    # local nodes) after the step's first run, where the runner knows
    mem_bytes: int | None = None
    # the same bytes by what holds them (``OcannlRunner.mem_parts``): what stands in the way of
    # a smaller step
    mem_parts: dict[str, int] = field(default_factory=dict)
    # The A/A control: a second runner of a row already in the run (``specs.CONTROL_VARIANT``),
    # timed in the same rounds; no target reads it, its ratio to the first is the run's noise.
    control: bool = False
    samples: list[float] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return f"{self.framework} {self.device} {self.variant}" + (
            " (A/A control)" if self.control else "")

    def finish_timing(self) -> None:
        """Fill p10 / p50 / p90 from the collected per-step samples."""
        if self.samples:
            self.p10, self.p50, self.p90 = (float(v) for v in
                                            np.percentile(self.samples, [10, 50, 90]))
            self.steps_timed = len(self.samples)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("samples")
        return d


def paired_ratio(a: Row, b: Row) -> float | None:
    """The median, over the timing rounds, of ``a``'s median step over ``b``'s in the same
    round (None without samples). This project's rows of one round run within milliseconds of
    each other, so each round's ratio compares steps that met one state of a noisy machine
    (this one ran about 1.6x slower for some 70 ms in every 200), where the ratio of the p50s
    compares two mixtures of both."""
    n, rounds = len(a.samples), a.rounds
    if rounds < 1 or n == 0 or b.rounds != rounds or len(b.samples) != n or n % rounds:
        return None
    per = n // rounds
    pa = np.median(np.reshape(a.samples, (rounds, per)), axis=1)
    pb = np.median(np.reshape(b.samples, (rounds, per)), axis=1)
    return float(np.median(pa / pb))


def relative_error(got: list[float], ref: list[float]) -> float:
    """Largest ``|got - ref| / |ref|`` over the steps (inf when a loss is not finite)."""
    g, r = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if g.shape != r.shape or not np.all(np.isfinite(g)):
        return float("inf")
    return float(np.max(np.abs(g - r) / np.maximum(np.abs(r), 1e-30)))
