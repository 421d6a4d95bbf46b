"""Issue 12's targets ("Speed on every workload") and issue 29's ("Mixed precision that pays on
the CPU"), checked against one run: met or not, and by how much.

Each row of an issue's targets table is a ``Goal`` (``ISSUE_TABLE``, ``ISSUE_29_TABLE``);
``evaluate`` expands it into one ``Target`` per workload (or per chain length) that the run can
speak to, and ``summarize`` folds them back into the issue's rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from benchmarks.compile_chain import per_op_growth
from benchmarks.results import Row, paired_ratio
from benchmarks.specs import CONTROL_VARIANT, WORKLOADS
from ocannl.backends.cpu.native_products import UNITS
from ocannl.ir.ops import Precision

# Variants whose step is held to the f32 step's ("bf16 and f16 step / own f32 step"); "f16" is
# the host-gated one, the issue's plain f16.
HALF_VARIANTS = ("bf16", "f16")


@dataclass(frozen=True)
class Goal:
    """One row of the issue's table: what is measured, the figure when the issue was filed, and
    the goal (``at_least``: a floor, else a ceiling)."""

    key: str
    text: str
    at_filing: str
    goal: float
    unit: str  # "x" for ratios, "s" for seconds, "%" for fractions (shown as percentages)
    at_least: bool = False


ISSUE_TABLE: tuple[Goal, ...] = (
    Goal("wide_eager", "mlp_wide f32 / PyTorch eager", "1.00x", 0.80, "x"),
    Goal("wide_gemm", "mlp_wide GEMM FLOP/s / NumPy sgemm in the same run", "55%", 0.70, "%",
         at_least=True),
    Goal("conv_eager", "convnet f32 / PyTorch eager", "-", 1.0, "x"),
    Goal("gpt_eager", "gpt_mini f32 / PyTorch eager", "-", 1.0, "x"),
    Goal("half", "bf16 and f16 step / own f32 step, every workload", "1.22-2.10x", 1.25, "x"),
    Goal("gate", "f16 host gate / f16-static, every workload", "1.06-1.25x", 1.10, "x"),
    Goal("gated16", "f16-gated16 / f16-static, every workload", "1.03-1.09x", 1.03, "x"),
    Goal("cold_wide", "cold compile + set-up, mlp_wide f16-gated16", "18.4 s", 3.0, "s"),
    Goal("cold_big", "cold compile + set-up, convnet and gpt_mini f16-gated16", "-", 5.0, "s"),
    Goal("warm", "warm (on-disk cache) compile + set-up, every workload", "0.80 s", 0.5, "s"),
    Goal("chain_3000", "compile time of a chain of 3,000 pointwise ops",
         "not done in 900 s", 10.0, "s"),
    Goal("chain_linear", "compile time of a chain of N pointwise ops: linear in N (seconds per "
         "op, largest N / smallest N)", "400 ops: 36.7 s", 2.0, "x"),
    Goal("rss", "peak RSS growth / PyTorch eager's, every workload", "-", 1.0, "x"),
)
# Issue 29: this project's bf16 step against its own f32 step and against the one a PyTorch user
# would pick (eager under CPU autocast to bf16), its products' rate, its memory. Meant for a CPU
# with AMX-BF16; the last row holds a CPU without bf16 units (``machine.BF16_FLAGS``) to "unchanged
# or better": no workload's ratio over the top of the range at filing.
ISSUE_29_TABLE: tuple[Goal, ...] = (
    Goal("bf16_wide_own", "mlp_wide bf16 step / own f32 step", "1.11x-1.16x", 0.45, "x"),
    Goal("bf16_wide_autocast", "mlp_wide bf16 step / PyTorch autocast bf16 step", "1.6x-1.8x",
         0.65, "x"),
    Goal("bf16_gpt_own", "gpt_mini bf16 step / own f32 step", "1.15x-1.17x", 0.75, "x"),
    Goal("bf16_gpt_autocast", "gpt_mini bf16 step / PyTorch autocast bf16 step", "1.21x", 0.80,
         "x"),
    Goal("bf16_conv_own", "convnet bf16 step / own f32 step", "1.21x", 1.00, "x"),
    Goal("bf16_conv_autocast", "convnet bf16 step / PyTorch autocast bf16 step", "0.17x", 0.20,
         "x"),
    Goal("bf16_gemm", "bf16 products' GFLOP/s / f32 products' GFLOP/s (mlp_wide, same run)",
         "about 0.9x", 2.5, "x", at_least=True),
    Goal("bf16_mem", "bf16 step's device buffers + scratch / f32 step's, every workload", "-",
         0.8, "x"),
    Goal("bf16_no_units", "on a CPU without bf16 units: bf16 step / own f32 step, every "
         "workload (unchanged or better: at most the top of the range at filing)",
         "1.11x-1.21x", 1.21, "x"),
)
# Issue 42: every f32 step at its floor (``benchmarks.floor``), 16-bit twins at most 1.05x their
# own f32 step on a CPU without product units of their precision.
ISSUE_42_TABLE: tuple[Goal, ...] = (
    Goal("floor", "every f32 step / its floor (its products at NumPy's rate + one pass over "
         "the bytes it must touch, in the same rounds)", "mlp_wide 1.00x on Zen 1; others not "
         "measured", 1.05, "x"),
    Goal("half_no_units", "bf16 and f16 step / own f32 step on a CPU without product units "
         "of its precision, every workload", "1.03-1.21x (Zen 1)", 1.05, "x"),
)
GOALS = {g.key: g for g in ISSUE_TABLE + ISSUE_29_TABLE + ISSUE_42_TABLE}
# Issue 29's step rows: goal key -> (workload, what the bf16 step is held to: "own" or
# "autocast").
BF16_STEP_GOALS = {
    "bf16_wide_own": ("mlp_wide", "own"), "bf16_wide_autocast": ("mlp_wide", "autocast"),
    "bf16_gpt_own": ("gpt_mini", "own"), "bf16_gpt_autocast": ("gpt_mini", "autocast"),
    "bf16_conv_own": ("convnet", "own"), "bf16_conv_autocast": ("convnet", "autocast"),
}
CHAIN_TARGET_N = 3000


def _pct(f: float) -> str:
    """A fraction as a percentage, with a decimal under 10%."""
    return f"{100 * f:.{0 if abs(f) >= 0.1 else 1}f}%"


@dataclass(frozen=True)
class Target:
    """One measured instance of a goal (a workload's, a chain length's)."""

    name: str
    measured: float | None  # None: not measured (row skipped, failed parity, not probed)
    goal: float
    unit: str
    at_least: bool = False  # the goal is a lower bound
    key: str = ""  # the ``Goal`` this instance belongs to
    note: str = ""  # what the figure is made of, or why it is missing
    lower_bound: bool = False  # ``measured`` is a floor of the true figure (a timeout)
    # For a ratio of two of this project's rows: how far the workload's A/A control, timed in
    # the same rounds, stood from its twin (|p50 ratio - 1|): the run's own noise on such ratios
    noise: float | None = None

    @property
    def within_noise(self) -> bool:
        """The figure is closer to the goal than the run's A/A control to its twin: this run
        cannot tell which side of the goal the true ratio lies."""
        m = self.measured
        return (self.noise is not None and m is not None and not self.lower_bound
                and abs(m / self.goal - 1) <= self.noise)

    @property
    def met(self) -> bool | None:
        m = self.measured
        if m is None:
            return None
        if self.lower_bound:  # the true figure is at least m: decides only a ceiling passed
            return None if self.at_least or m <= self.goal else False
        return m >= self.goal if self.at_least else m <= self.goal

    def margin(self) -> str:
        """How far from the goal, in words."""
        m = self.measured
        if m is None:
            return "not measured"
        if self.lower_bound:
            if self.met is None:
                return "undecided (a lower bound under the goal)"
            return f"at least {m / self.goal:.2f}x the goal"
        if self.at_least:
            gap = (f"{100 * abs(self.goal - m):.0f} points" if self.unit == "%"
                   else f"{abs(self.goal - m):.3g}{self.unit}")
            return (f"above by {gap} ({m / self.goal:.2f}x the floor)" if self.met
                    else f"short by {gap} ({m / self.goal:.2f}x the floor)")
        if self.met:
            return f"{_pct(1 - m / self.goal)} under"
        r = m / self.goal
        return f"{r:.{2 if r >= 1.1 else 3}f}x the goal ({_pct(r - 1)} over)"

    def verdict(self) -> str:
        """"met, 12% under", "**not met**, 1.30x the goal (30% over)", "not measured"."""
        if self.met is None:
            return self.margin() if self.measured is not None else "not measured"
        noise = (f"; within this run's A/A noise ({_pct(self.noise)})"
                 if self.within_noise and self.noise is not None else "")
        return ("met, " if self.met else "**not met**, ") + self.margin() + noise

    def shortfall(self) -> float:
        """How badly the goal is missed, comparable across instances (larger: worse)."""
        m = self.measured
        if m is None or m == 0:
            return float("-inf") if m is None else (float("inf") if self.at_least else 0.0)
        return self.goal / m if self.at_least else m / self.goal

    def to_json(self) -> dict:
        return {**asdict(self), "met": self.met, "margin": self.margin()}


def _find(rows: list[Row], workload: str, framework: str, variant: str,
          control: bool = False) -> Row | None:
    for r in rows:
        if (r.workload, r.framework, r.device, r.variant, r.control) == (
                workload, framework, "cpu", variant, control):
            return r
    return None


def aa_control(rows: list[Row], wl: str) -> tuple[float, float | None] | None:
    """The workload's A/A control against its twin (``specs.CONTROL_VARIANT``): the ratio of
    their p50s and their ratio paired by round; None where either was not timed."""
    twin = _find(rows, wl, "ocannl", CONTROL_VARIANT)
    control = _find(rows, wl, "ocannl", CONTROL_VARIANT, control=True)
    if twin is None or control is None or "ok" != twin.status or "ok" != control.status:
        return None
    return control.p50 / twin.p50, paired_ratio(control, twin)  # type: ignore[operator]


def _p50(rows: list[Row], workload: str, framework: str, variant: str) -> float | None:
    r = _find(rows, workload, framework, variant)
    return r.p50 if r is not None and r.status == "ok" else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _sum(compile_s: float | None, setup_s: float | None) -> float | None:
    """What a fresh process waits for: the step's compile plus the libraries' set-up."""
    return None if compile_s is None else compile_s + (setup_s or 0.0)


def _target(key: str, name: str, measured: float | None, note: str = "",
            lower_bound: bool = False) -> Target:
    g = GOALS[key]
    return Target(name, measured, g.goal, g.unit, g.at_least, key, note, lower_bound)


def _mib_parts(r: Row) -> str:
    """``r``'s device bytes (in MiB, in KiB below one MiB), and by what holds them where the
    runner says."""
    total = r.mem_bytes or 0
    unit, size = ("MiB", 2**20) if total >= 2**20 else ("KiB", 2**10)
    parts = ", ".join(f"{what} {b / size:.2f}" for what, b in r.mem_parts.items())
    return f"{total / size:.2f} {unit}" + (f" ({parts})" if parts else "")


def _ran(rows: list[Row]) -> list[str]:
    """The workloads this run has rows for, in the suite's order."""
    names = {r.workload for r in rows}
    return [w for w in WORKLOADS if w in names] + sorted(names - set(WORKLOADS))


def _ocannl_rows(rows: list[Row], wl: str) -> list[Row]:
    return [r for r in rows if (r.workload, r.framework, r.device, r.control) ==
            (wl, "ocannl", "cpu", False)]


def _worst(values: dict[str, float], fmt: str, what: str) -> tuple[float | None, str]:
    """The largest of ``values`` (variant -> figure) and a note listing them all (``fmt``: a
    format spec and a unit, as in ".2f s")."""
    if not values:
        return None, f"no ocannl row {what}"
    worst = max(values, key=values.__getitem__)
    spec, _, unit = fmt.partition(" ")
    listed = ", ".join(f"{v} {x:{spec}}{' ' if unit == 's' else ''}{unit}"
                       for v, x in values.items())
    return values[worst], f"worst of {len(values)} ocannl rows ({worst}); {listed}"


def step_targets(rows: list[Row], sgemm_flops: float | None,
                 products_s: float | None = None) -> list[Target]:
    """The step-time targets: against PyTorch eager, NumPy sgemm, the f32 and f16-static steps."""
    out = []
    names = _ran(rows)
    for key, wl in (("wide_eager", "mlp_wide"), ("conv_eager", "convnet"),
                    ("gpt_eager", "gpt_mini")):
        if wl in names:
            eager = _p50(rows, wl, "torch", "eager")
            note = _gemm_floor(eager, sgemm_flops, products_s) if wl == "mlp_wide" else ""
            out.append(_target(key, f"{wl} f32 step / PyTorch eager",
                               _ratio(_p50(rows, wl, "ocannl", "f32"), eager), note))
    if "mlp_wide" in names:
        wide = _p50(rows, "mlp_wide", "ocannl", "f32")
        frac = None
        if wide is not None and sgemm_flops:
            frac = WORKLOADS["mlp_wide"].gemm_flops() / wide / sgemm_flops
        note = "" if sgemm_flops else "NumPy sgemm not measured"
        out.append(_target("wide_gemm", "mlp_wide f32 GEMM FLOP/s / NumPy sgemm", frac, note))
    for wl in names:
        for v in HALF_VARIANTS:
            out.append(_between(rows, wl, "half", f"{wl} {v} step / f32 step", v, "f32"))
    for wl in names:
        out.append(_between(rows, wl, "gate", f"{wl} f16 (host gate) / f16-static", "f16",
                            "f16-static"))
        out.append(_between(rows, wl, "gated16", f"{wl} f16-gated16 / f16-static",
                            "f16-gated16", "f16-static"))
    return out


def _gemm_floor(eager: float | None, sgemm_flops: float | None,
                products_s: float | None = None) -> str:
    """The wide step's floors over PyTorch eager's p50, with no other work: its GEMM FLOPs at
    NumPy's 1024^3 sgemm rate in the same run; and (``products_s``) its products of their own
    shapes as NumPy computes them, on OpenBLAS's own threads, timed in the step's rounds (a
    product with 256 or 10 rows or columns runs below the 1024^3 rate)."""
    if eager is None or not sgemm_flops:
        return ""
    floor = WORKLOADS["mlp_wide"].gemm_flops() / sgemm_flops
    text = (f"floor: its GEMMs alone at NumPy's sgemm rate take {floor * 1e3:.2f} ms, "
            f"{floor / eager:.3f}x PyTorch eager's p50")
    if products_s:
        count = len(WORKLOADS["mlp_wide"].gemm_products())
        text += (f"; its {count} products as NumPy computes them, in the same rounds: "
                 f"{products_s * 1e3:.2f} ms, {products_s / eager:.3f}x")
    return text


def _between(rows: list[Row], wl: str, key: str, name: str, a: str, b: str) -> Target:
    """The target on the ratio of two of this project's rows (p50s): with the ratio paired by
    round as a note, and the workload's A/A noise."""
    aa = aa_control(rows, wl)
    t = _target(key, name, _ratio(_p50(rows, wl, "ocannl", a), _p50(rows, wl, "ocannl", b)),
                _paired(rows, wl, a, b))
    return t if aa is None else replace(t, noise=abs(aa[0] - 1))


def _paired(rows: list[Row], wl: str, a: str, b: str) -> str:
    """A note with the ratio of two of this project's rows paired by round
    (``results.paired_ratio``), shown beside the target's ratio of p50s, which decides."""
    ra, rb = _find(rows, wl, "ocannl", a), _find(rows, wl, "ocannl", b)
    if ra is None or rb is None or ra.status != "ok" or rb.status != "ok":
        return ""
    paired = paired_ratio(ra, rb)
    return "" if paired is None else f"paired by round: {paired:.3f}x"


def probe_targets(rows: list[Row]) -> list[Target]:
    """The fresh-process targets: cold and warm compile + set-up, peak RSS growth."""
    out = []
    names = _ran(rows)
    for wl in names:
        key = {"mlp_wide": "cold_wide", "convnet": "cold_big", "gpt_mini": "cold_big"}.get(wl)
        if key is None:
            continue
        r = _find(rows, wl, "ocannl", "f16-gated16")
        cold = None if r is None else _sum(r.compile_cold_s, r.setup_cold_s)
        note = "" if cold is None or r is None else (
            f"compile {r.compile_cold_s:.2f} s + set-up {r.setup_cold_s or 0.0:.2f} s")
        out.append(_target(key, f"{wl} f16-gated16 compile + set-up, cold process", cold, note))
    for wl in names:
        warm = {r.variant: s for r in _ocannl_rows(rows, wl)
                if (s := _sum(r.compile_warm_s, r.setup_warm_s)) is not None}
        out.append(_target("warm", f"{wl} compile + set-up, warm on-disk cache",
                           *_worst(warm, ".2f s", "probed")))
    for wl in names:
        eager = _find(rows, wl, "torch", "eager")
        base = None if eager is None else eager.peak_rss_mib
        if base is not None and base <= 0:
            out.append(_target("rss", f"{wl} peak RSS growth / PyTorch eager's", None,
                               f"PyTorch eager's growth {base:.1f} MiB: no ratio"))
            continue
        growth = {r.variant: r.peak_rss_mib / base for r in _ocannl_rows(rows, wl)
                  if r.peak_rss_mib is not None and base is not None}
        measured, note = _worst(growth, ".2f x", "probed next to PyTorch eager")
        if base is not None and growth:
            note += f" (PyTorch eager: {base:.0f} MiB)"
        out.append(_target("rss", f"{wl} peak RSS growth / PyTorch eager's", measured, note))
    return out


def chain_targets(chain: dict | None) -> list[Target]:
    """The chain-compile targets from ``compile_chain.run_chain``'s (or its JSON's) results:
    N = 3,000 within 10 s, and seconds per op at the largest N within 2x of the smallest N's
    (a timed-out N counts with its lower bound)."""
    if chain is None:
        return []
    results = chain.get("results", [])
    by_n = {r["n"]: r for r in results}
    big = by_n.get(CHAIN_TARGET_N)
    name = f"chain of {CHAIN_TARGET_N:,} ops, cold compile"
    out = []
    if big is None:
        out.append(_target("chain_3000", name, None, f"N = {CHAIN_TARGET_N} not run"))
    else:
        secs, bound = chain_seconds(big)
        out.append(_target("chain_3000", name, secs, chain_note(big), bound))
    name = "chain compile, seconds per op: largest N / smallest N"
    g = per_op_growth(results)
    if g is None:
        out.append(_target("chain_linear", name, None, "fewer than two chain lengths measured"))
        return out
    note = (f"{1e3 * g['per_op_from_s']:.2f} ms/op at N = {g['from']} -> "
            f"{'> ' if g['lower_bound'] else ''}{1e3 * g['per_op_to_s']:.2f} ms/op at "
            f"N = {g['to']}")
    out.append(_target("chain_linear", name, g["ratio"], note, g["lower_bound"]))
    return out


def chain_seconds(r: dict) -> tuple[float | None, bool]:
    """One chain length's compile seconds and whether that is a lower bound (timed out, or
    skipped after a shorter chain timed out: ``floor_s``)."""
    if r["status"] == "ok":
        return r["compile_s"], False
    if r.get("floor_s") is not None:
        return r["floor_s"], True
    return None, False


def chain_note(r: dict) -> str:
    if r["status"] == "ok":
        return (f"graph built in {r.get('build_s', 0.0):.2f} s and set-up "
                f"{r.get('setup_s', 0.0):.2f} s, both apart")
    return f"{r['status']}: {r.get('note', '')}".strip()


def bf16_targets(rows: list[Row], sgemm_flops: float | None = None,
                 bf16_units: dict[str, bool] | None = None) -> list[Target]:
    """Issue 29's targets: the bf16 step against this project's f32 step and PyTorch's autocast
    step, the wide step's GEMM rate in bf16 over f32's, the bf16 step's device memory over
    f32's; on a CPU without bf16 units (``bf16_units``: ``machine.bf16_units()``, all False),
    the bf16 step over f32's on every workload."""
    out = []
    names = _ran(rows)
    for key, (wl, versus) in BF16_STEP_GOALS.items():
        if wl not in names:
            continue
        if versus == "own":
            out.append(_between(rows, wl, key, f"{wl} bf16 step / own f32 step", "bf16", "f32"))
            continue
        autocast = _find(rows, wl, "torch", "autocast")
        note = "" if autocast is None or autocast.status == "ok" else (
            f"PyTorch autocast row {autocast.status}: {autocast.note}".strip())
        out.append(_target(key, f"{wl} bf16 step / PyTorch autocast bf16 step",
                           _ratio(_p50(rows, wl, "ocannl", "bf16"),
                                  _p50(rows, wl, "torch", "autocast")), note))
    if "mlp_wide" in names:
        out.append(_gemm_ratio(rows, sgemm_flops))
    for wl in names:
        f32, bf16 = (_find(rows, wl, "ocannl", v) for v in ("f32", "bf16"))
        mem = {v: r.mem_bytes for v, r in (("f32", f32), ("bf16", bf16))
               if r is not None and r.mem_bytes}
        note = ("; ".join(f"{v} {_mib_parts(r)}" for v, r in (("bf16", bf16), ("f32", f32))
                          if r is not None) if len(mem) == 2 else "")
        out.append(_target("bf16_mem", f"{wl} bf16 device buffers + scratch / f32's",
                           _ratio(mem.get("bf16"), mem.get("f32")), note))
    for wl in names:
        out.append(_without_units(rows, wl, "bf16_no_units", "bf16", bf16_units, "bf16"))
    return out


def _without_units(rows: list[Row], wl: str, key: str, variant: str,
                   units: dict[str, bool] | None, kind: str) -> Target:
    """``variant``'s step over its own f32 step, measured only on a CPU whose ``units`` (flag
    -> present) are all absent; else not measured, saying why."""
    name = f"{wl} {variant} step / own f32 step, no {kind} units"
    if units is None or any(units.values()):
        why = (f"the CPU's {kind} units not recorded" if units is None else
               f"this CPU has {kind} units (" + ", ".join(f for f, on in units.items() if on)
               + ")")
        return _target(key, name, None, why)
    return _between(rows, wl, key, name, variant, "f32")


def _gemm_ratio(rows: list[Row], sgemm_flops: float | None) -> Target:
    """The wide step's GEMM FLOPs over each step's p50 (the f32 GEMM target's figure), bf16's
    rate over f32's; the note gives both rates and their share of NumPy's sgemm."""
    flops = WORKLOADS["mlp_wide"].gemm_flops()
    rate = {v: None if (p := _p50(rows, "mlp_wide", "ocannl", v)) is None else flops / p
            for v in ("bf16", "f32")}
    parts = []
    for v, r in rate.items():
        if r is not None:
            share = f" ({100 * r / sgemm_flops:.0f}% of NumPy sgemm)" if sgemm_flops else ""
            parts.append(f"{v} {r / 1e9:.1f} GFLOP/s{share}")
    note = ("; ".join(parts) + (": the step's GEMM FLOPs over its p50" if parts else ""))
    return _target("bf16_gemm", "mlp_wide bf16 GEMM FLOP/s / f32 GEMM FLOP/s",
                   _ratio(rate["bf16"], rate["f32"]), note)


def floor_targets(rows: list[Row], floors: dict[str, dict] | None,
                  units: dict[str, bool] | None = None) -> list[Target]:
    """Issue 42's targets: each f32 step over its floor (``floors``: workload -> what
    ``benchmarks.floor.FloorInRounds.record`` gives), and each 16-bit variant's step over its
    own f32 step on a CPU without product units of its precision (``units``: flag -> present,
    ``machine.bf16_units()``; ``native_products.UNITS`` names each precision's: an AVX512-BF16
    CPU has bf16 units and no f16 ones, so its f16 twins are held to the goal)."""
    out = []
    names = _ran(rows)
    for wl in names:
        f = (floors or {}).get(wl)
        if f is None or f.get("floor_s") is None:
            out.append(_target("floor", f"{wl} f32 step / its floor", None, "floor not timed"))
            continue
        out.append(_target("floor", f"{wl} f32 step / its floor",
                           _ratio(_p50(rows, wl, "ocannl", "f32"), f["floor_s"]), f["note"]))
    for wl in names:
        for v in HALF_VARIANTS:
            flags = UNITS[Precision(v)]
            mine = None if units is None else {f: bool(units.get(f)) for f in flags}
            out.append(_without_units(rows, wl, "half_no_units", v, mine, f"{v} product"))
    return out


def evaluate(rows: list[Row], sgemm_flops: float | None, chain: dict | None = None,
             products_s: float | None = None,
             bf16_units: dict[str, bool] | None = None,
             floors: dict[str, dict] | None = None) -> list[Target]:
    """Every target of issues 12, 29 and 42 that this run's rows (and chain results) can speak
    to; ``products_s``: NumPy's time for the wide step's products, in its rounds;
    ``bf16_units``: the CPU's (``machine.bf16_units()``); ``floors``: each workload's floor."""
    return (step_targets(rows, sgemm_flops, products_s) + probe_targets(rows)
            + chain_targets(chain) + bf16_targets(rows, sgemm_flops, bf16_units)
            + floor_targets(rows, floors, bf16_units))


@dataclass(frozen=True)
class Summary:
    """One row of the issue's table, folded from its instances."""

    goal: Goal
    targets: tuple[Target, ...]

    @property
    def measured(self) -> list[Target]:
        return [t for t in self.targets if t.measured is not None]

    @property
    def worst(self) -> Target | None:
        m = self.measured
        return max(m, key=Target.shortfall) if m else None

    @property
    def met(self) -> bool | None:
        """True when every instance is met; False when one is not; else None."""
        verdicts = [t.met for t in self.targets]
        if False in verdicts:
            return False
        return True if verdicts and all(verdicts) else None


def summarize(found: list[Target], table: tuple[Goal, ...] = ISSUE_TABLE) -> list[Summary]:
    """The issue's rows (``table``: ``ISSUE_TABLE`` or ``ISSUE_29_TABLE``) in its order, each
    with the instances this run produced (none: not measured in this run)."""
    return [Summary(g, tuple(t for t in found if t.key == g.key)) for g in table]
