"""The issue's targets, checked against one run's rows: met or not, and by how much."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.results import Row
from benchmarks.specs import WORKLOADS


@dataclass(frozen=True)
class Target:
    name: str
    measured: float | None  # None: not measured (row skipped or failed parity)
    goal: float
    unit: str  # "x" for ratios, "s" for seconds, "%" for fractions (shown as percentages)
    at_least: bool = False  # the goal is a lower bound

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured >= self.goal if self.at_least else self.measured <= self.goal

    def margin(self) -> str:
        """How far from the goal, in words."""
        m = self.measured
        if m is None:
            return "not measured"
        if self.at_least:
            gap = (f"{100 * abs(self.goal - m):.0f} points" if self.unit == "%"
                   else f"{abs(self.goal - m):.3g}{self.unit}")
            return (f"above by {gap} ({m / self.goal:.2f}x the floor)" if self.met
                    else f"short by {gap} ({m / self.goal:.2f}x the floor)")
        if self.met:
            return f"{100 * (1 - m / self.goal):.0f}% under"
        return f"{m / self.goal:.2f}x the goal ({100 * (m / self.goal - 1):.0f}% over)"


def _find(rows: list[Row], workload: str, framework: str, variant: str) -> Row | None:
    for r in rows:
        if (r.workload, r.framework, r.device, r.variant) == (workload, framework, "cpu",
                                                                 variant):
            return r
    return None


def _p50(rows: list[Row], workload: str, framework: str, variant: str) -> float | None:
    r = _find(rows, workload, framework, variant)
    return r.p50 if r is not None and r.status == "ok" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def evaluate(rows: list[Row], sgemm_flops: float | None) -> list[Target]:
    """Every target of the issue that this run's rows can speak to."""
    out = []

    def vs_torch(wl: str, goal: float) -> None:
        out.append(Target(f"{wl} f32 step / PyTorch eager", _ratio(
            _p50(rows, wl, "ocannl", "f32"), _p50(rows, wl, "torch", "eager")), goal, "x"))

    vs_torch("mlp_small", 1 / 3)
    vs_torch("mlp_wide", 1.0)
    wide = _p50(rows, "mlp_wide", "ocannl", "f32")
    frac = None
    if wide is not None and sgemm_flops:
        frac = WORKLOADS["mlp_wide"].gemm_flops() / wide / sgemm_flops
    out.append(Target("mlp_wide f32 GEMM FLOP/s / NumPy sgemm", frac, 0.5, "%", at_least=True))
    for wl in ("mlp_small", "mlp_wide"):
        f32 = _p50(rows, wl, "ocannl", "f32")
        for v in ("bf16", "f16"):
            out.append(Target(f"{wl} {v} step / f32 step",
                              _ratio(_p50(rows, wl, "ocannl", v), f32), 1.5, "x"))
        static = _p50(rows, wl, "ocannl", "f16-static")
        out.append(Target(f"{wl} f16 (host gate) / f16-static",
                          _ratio(_p50(rows, wl, "ocannl", "f16"), static), 1.10, "x"))
        out.append(Target(f"{wl} f16-gated16 / f16-static",
                          _ratio(_p50(rows, wl, "ocannl", "f16-gated16"), static), 1.05, "x"))
    gated = _find(rows, "mlp_wide", "ocannl", "f16-gated16")
    cold = (None, None) if gated is None else (gated.compile_cold_s, gated.setup_cold_s)
    warm = (None, None) if gated is None else (gated.compile_warm_s, gated.setup_warm_s)
    out.append(Target("mlp_wide f16-gated16 compile + set-up, cold process", _sum(*cold), 3.0,
                      "s"))
    out.append(Target("mlp_wide f16-gated16 compile + set-up, warm on-disk cache",
                      _sum(*warm), 0.5, "s"))
    return out


def _sum(compile_s: float | None, setup_s: float | None) -> float | None:
    """What a fresh process waits for: the step's compile plus the libraries' set-up."""
    return None if compile_s is None else compile_s + (setup_s or 0.0)
