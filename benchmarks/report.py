"""Render one run's rows as ``REPORT.md`` (machine, tables, issue 12's targets, the chain
compile, where the time goes) and a PNG chart."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from benchmarks.results import Row
from benchmarks.specs import CONTROL_VARIANT, VARIANTS, WORKLOADS, Workload
from benchmarks.targets import (
    ISSUE_29_TABLE,
    ISSUE_42_TABLE,
    ISSUE_TABLE,
    Goal,
    Summary,
    Target,
    aa_control,
    summarize,
)

OBSTACLES = Path(__file__).resolve().parent / "OBSTACLES.md"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def _parity(r: Row) -> str:
    if r.parity_err is None:
        return "—"
    mark = "pass" if r.status == "ok" else "**FAIL**"
    return f"{r.parity_err:.1e} ≤ {r.tolerance:.0e}: {mark}"


def _compile(s: float | None, setup: float | None) -> str:
    if s is None:
        return "—"
    return f"{s:.2f} s" + (f" (+{setup:.2f} s set-up)" if setup is not None else "")


# How the report names the other frameworks' rows.
PEER_LABELS = {("torch", "eager"): "PyTorch eager", ("torch", "compile"): "torch.compile",
               ("torch", "autocast"): "PyTorch autocast bf16", ("jax", "f32"): "JAX jit f32",
               ("jax", "bf16"): "JAX jit bf16", ("tinygrad", "f32"): "tinygrad f32"}


def _label(r: Row) -> str:
    if r.framework == "ocannl":
        return f"ocannl {r.variant} ({r.device})" + (", A/A control" if r.control else "")
    name = PEER_LABELS.get((r.framework, r.variant), f"{r.framework} {r.variant}")
    return f"{name} ({r.device})"


def sgemm_line(info: dict) -> str:
    """The machine's sgemm rates: alone before and after the workloads, and in mlp_wide's
    rounds (the GEMM row's yardstick when measured)."""
    alone = info.get("sgemm_alone") or []
    rounds = info.get("sgemm_rounds")
    text = "- NumPy sgemm (1024³ f32, median): "
    if alone:
        text += " then ".join(f"{x / 1e9:.0f}" for x in alone) + " GFLOP/s alone (before and " \
            "after the workloads)"
    if rounds:
        text += f"{'; ' if alone else ''}{rounds / 1e9:.0f} GFLOP/s in mlp_wide's rounds, " \
            "beside its steps: the yardstick of its GEMM column and target"
    elif not alone:
        text += f"{fmt(info['sgemm'] and info['sgemm'] / 1e9, '.0f')} GFLOP/s, measured in " \
            "this run"
    return text


def bf16_lines(info: dict) -> list[str]:
    """The CPU's bf16 units (issue 29's targets are meant for AMX-BF16) and, where recorded,
    the bf16 product path this project's CPU routines run."""
    units = info.get("bf16_units")
    if units is None:
        return []
    have = [f for f, on in units.items() if on]
    text = ("- bf16 units: " + ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in
                                         units.items()) +
            ("" if have else " (none of them: no bf16 units; issue 29's goals are for AMX-BF16)"))
    path = info.get("bf16_path")
    return [text] + ([f"- bf16 product path: {path}"] if path else [])


def aa_line(rows: list[Row]) -> list[str]:
    """The workload's A/A control against its twin, when both were timed."""
    aa = aa_control(rows, rows[0].workload)
    if aa is None:
        return []
    paired = "" if aa[1] is None else f", paired by round {aa[1]:.3f}x"
    return [f"- A/A control: a second {CONTROL_VARIANT} runner, timed in the same rounds, ran "
            f"at {aa[0]:.3f}x its twin's p50{paired}: no code differs between them.", ""]


def table(rows: list[Row], sgemm: float | None) -> list[str]:
    """One workload's markdown table; skipped and failed rows listed below it."""
    wl = WORKLOADS[rows[0].workload]
    ref = next((r.p50 for r in rows if (r.framework, r.variant, r.device) ==
                ("torch", "eager", "cpu") and r.status == "ok"), None)
    gemm = wl.name == "mlp_wide"
    head = ["Runner", "Parity (max rel. err.)", "p10", "p50", "p90", "p50 / PyTorch eager",
            "Compile, cold", "Compile, warm", "Peak RSS growth", "Device buffers + scratch"]
    if gemm:
        head.append("GEMM GFLOP/s (of sgemm)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown = [r for r in rows if r.status in ("ok", "parity-fail")]
    for r in shown:
        timed = r.status == "ok"
        cells = [
            _label(r), _parity(r),
            fmt_time(r.p10 if timed else None), fmt_time(r.p50 if timed else None),
            fmt_time(r.p90 if timed else None),
            fmt(r.p50 / ref if timed and ref else None, ".3f", "x"),
            _compile(r.compile_cold_s, r.setup_cold_s), _compile(r.compile_warm_s, r.setup_warm_s),
            fmt(r.peak_rss_mib, ".0f", " MiB"),
            fmt(r.mem_bytes / 2**20 if r.mem_bytes else None, ".2f", " MiB"),
        ]
        if gemm:
            rate = wl.gemm_flops() / r.p50 if timed and r.p50 else None
            cells.append("—" if rate is None else
                         f"{rate / 1e9:.0f} ({100 * rate / sgemm:.0f}%)" if sgemm else
                         f"{rate / 1e9:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    by_note: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        if r.status not in ("ok", "parity-fail"):
            by_note[f"{r.status}: {r.note}"].append(f"{r.framework} {r.device} {r.variant}")
    if by_note:
        lines.append("")
        for note, names in by_note.items():
            lines.append(f"- Not run: {', '.join(names)} — {note}")
    return lines


def _value(v: float | None, t: Target, digits: int = 3) -> str:
    if v is None:
        return "—"
    if t.unit == "s":
        return f"{v:.2f} s"
    if t.unit == "%":
        return f"{v:.0%}"
    return f"{v:.{digits}f}x"


def fmt_target(t: Target, digits: int = 3) -> str:
    """The measured figure with its unit; "> " before a lower bound (a timeout)."""
    return ("> " if t.lower_bound and t.measured is not None else "") + _value(
        t.measured, t, digits)


def fmt_goal(t: Target | Summary) -> str:
    g = t.goal if isinstance(t, Summary) else t
    sign = "≥" if g.at_least else "≤"
    if g.unit == "s":
        return f"{sign} {g.goal:g} s"
    if g.unit == "%":
        return f"{sign} {g.goal:.0%}"
    return f"{sign} {g.goal:.2f}x"


def _summary_measured(s: Summary) -> str:
    m = s.measured
    if not m:
        return "—"
    if len(m) == 1:
        return fmt_target(m[0], 2)
    lo, hi = min(m, key=lambda t: t.measured), max(m, key=lambda t: t.measured)
    low, high = ("> " if lo.lower_bound else "") + _value(lo.measured, lo, 2), fmt_target(hi, 2)
    return f"{low if low == high else f'{low} – {high}'} ({len(m)} measured)"


def _summary_verdict(s: Summary) -> str:
    n = len(s.targets)
    if n == 0:
        return "not measured in this run"
    if n == 1:
        t = s.targets[0]
        return t.verdict() + (f" ({t.note})" if t.met is None and t.note else "")
    worst = s.worst
    failed = sum(t.met is False for t in s.targets)
    missing = sum(t.measured is None for t in s.targets)
    open_ = sum(t.met is None and t.measured is not None for t in s.targets)
    rest = "".join(f"; {k} {what}" for k, what in ((missing, "not measured"),
                                                    (open_, "undecided")) if k)
    if failed:
        inside = sum(t.met is False and t.within_noise for t in s.targets)
        within = f", {inside} of them within this run's A/A noise" if inside else ""
        return (f"**not met** ({failed} of {n}{within}){rest}; worst {worst.name}: "
                f"{worst.margin()}")
    if worst is None:
        return f"not measured ({n} instances)"
    met = n - missing - open_
    word = "met" if met == n else "met where decided"
    return f"{word} ({met} of {n}){rest}; closest {worst.name}: {worst.margin()}"


def summary_table(found: list[Target], table: tuple[Goal, ...] = ISSUE_TABLE) -> list[str]:
    """An issue's targets table (``table``: issue 12's or 29's), its rows in its order: at
    filing, this run, the goal."""
    lines = ["| Target | At filing | Measured | Goal | Met / by how much |",
             "|---|---|---|---|---|"]
    for s in summarize(found, table):
        lines.append(f"| {s.goal.text} | {s.goal.at_filing} | {_summary_measured(s)} | "
                     f"{fmt_goal(s)} | {_summary_verdict(s)} |")
    return lines


def targets_table(found: list[Target]) -> list[str]:
    """Every instance (per workload, per chain length), with what its figure is made of."""
    lines = ["| Target | Measured | Goal | Met / by how much | Detail |", "|---|---|---|---|---|"]
    for t in found:
        lines.append(f"| {t.name} | {fmt_target(t)} | {fmt_goal(t)} | {t.verdict()} | "
                     f"{t.note or ''} |")
    return lines


def chain_section(chain: dict) -> list[str]:
    """The chain-compile table: per N, the cold compile of ``train.forward`` over N additions."""
    source = chain.get("source", "")
    cmd = (chain.get("info") or {}).get("command")
    where = ("measured in this run" if source == "this run" else
             f"from `{source}`" + (f" (`{cmd}`)" if cmd else ""))
    out = [f"Cold compile of `train.forward(h)` over a chain of N `h = h + 1.0` on a 3-element "
           f"`term`, each N in a fresh process with an empty `OCANNL_CACHE_DIR`, "
           f"{chain.get('max_seconds', 0):g} s at most per N (`benchmarks/compile_chain.py`; "
           f"{where}). Building the graph and the libraries' set-up are timed apart.", "",
           "| N | Compile | Per op | Graph built | Set-up | Status |", "|---|---|---|---|---|---|"]
    for r in chain.get("results", []):
        if r["status"] == "ok":
            build, setup = fmt(r.get("build_s"), ".2f", " s"), fmt(r.get("setup_s"), ".2f", " s")
            out.append(f"| {r['n']:,} | {r['compile_s']:.2f} s | "
                       f"{1e3 * r['compile_s'] / r['n']:.2f} ms | {build} | {setup} | ok |")
        else:
            floor = r.get("floor_s")
            comp = "—" if floor is None else f"> {floor:.1f} s"
            per = "—" if floor is None else f"> {1e3 * floor / r['n']:.2f} ms"
            out.append(f"| {r['n']:,} | {comp} | {per} | — | — | {r['status']}: "
                       f"{r.get('note', '')} |")
    out.append("")
    notes = [f"N {g['from']:,} → {g['to']:,}: compile time ~ N^{g['exponent']:.2f}"
             for g in chain.get("growth", [])]
    g = chain.get("per_op_growth")
    if g:
        notes.append(f"seconds per op, N {g['from']:,} → {g['to']:,}: "
                     f"{'> ' if g['lower_bound'] else ''}{g['ratio']:.2f}x "
                     "(linear: within 2x)")
    if notes:
        out += ["; ".join(notes) + ".", ""]
    return out


def profile_section(rows: list[Row], profiles: list[dict], top: int = 5) -> list[str]:
    """Where the time of the profiled ocannl rows' steps goes: their slowest lowered items."""
    out = ["Each lowered item (a fill, a fused loop group, a GEMM) of the ocannl rows furthest "
           "behind PyTorch eager and of every workload's f32, bf16 and f16 rows "
           "(`run.py --profile-variants`), compiled as a routine of its own on the step's "
           "buffers and timed alone, the median of its runs (`benchmarks/profile_items.py`); "
           "the sum is close to the "
           "step's compute, the rest of the p50 is the call and the host's work between "
           "steps.", ""]
    eager = {r.workload: r.p50 for r in rows
             if (r.framework, r.variant, r.device, r.status) == ("torch", "eager", "cpu", "ok")}
    for p in profiles:
        name = f"{p['workload']} {p['variant']}"
        if "error" in p:
            out += [f"- **{name}**: not profiled ({p['error']})", ""]
            continue
        p50, ref = p.get("p50"), eager.get(p["workload"])
        vs = f", {p50 / ref:.2f}x PyTorch eager" if p50 and ref else ""
        total = p["total_s"]
        kinds: dict[str, float] = defaultdict(float)
        for t, what in p["items"]:
            kinds[what.split(" ", 1)[0]] += t
        split = ", ".join(f"{k} {100 * t / total:.0f}%" for k, t in
                          sorted(kinds.items(), key=lambda kv: -kv[1])) if total else ""
        out += [f"**{name}** (p50 {fmt_time(p50)}{vs}): {len(p['items'])} items, "
                f"{fmt_time(total)} in all" + (f" ({split})" if split else "") +
                f"; the {min(top, len(p['items']))} slowest:", "",
                "| Time | Share | Item |", "|---|---|---|"]
        for t, what in p["items"][:top]:
            share = f"{100 * t / total:.1f}%" if total else "—"
            out.append(f"| {fmt_time(t)} | {share} | `{what}` |")
        out.append("")
    return out


def _issue_section(targets: list[Target], table: tuple[Goal, ...], title: str,
                   intro: str) -> list[str]:
    """A later issue's targets: its table row for row, then every instance."""
    keys = {g.key for g in table}
    return ([f"## {title}", "", intro, ""] + summary_table(targets, table) + [""]
            + ["Every instance:", ""] + targets_table([t for t in targets if t.key in keys])
            + [""])


def render(rows: list[Row], targets: list[Target], info: dict, chart: str | None,
           workloads: dict[str, Workload] | None = None, chain: dict | None = None,
           profiles: list[dict] | None = None) -> str:
    """The whole report as markdown; ``workloads``: the specs as run (step counts scaled);
    ``chain``: ``compile_chain.run_chain``'s results; ``profiles``: ``run.profile_rows``'."""
    workloads = workloads or WORKLOADS
    v = info["versions"]
    out = [
        "# Benchmark report", "",
        f"Generated by `{info['command']}` on {info['date']} in {info['runtime_s']:.0f} s. "
        "Regenerate it with that command; numbers from another run are not comparable.", "",
        "## Machine", "",
        f"- CPU: {info['cpu']}, {info['cores']} cores, {info['memory']} RAM; "
        f"{info['platform']}",
        f"- Commit: `{info['commit']}`",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
        f"- ocannl's products call {info.get('blas', 'a BLAS not recorded')}; the sgemm yardstick "
        "is NumPy's own (OpenBLAS)",
        sgemm_line(info),
        *bf16_lines(info),
        f"- Load average (1/5/15 min) at start: {info['load_start']}; at end: {info['load_end']}"
        " (a busy machine makes every number noisy; ratios from the same run are the robust "
        "figures)",
        "",
        "## Method", "",
        "Per workload, every runner trains the same model (`benchmarks/models.py`: a relu MLP "
        "with plain SGD, the LeNet-style convnet `nn_blocks.lenet` with Adam, or the "
        "decoder-only transformer `nn_blocks.gpt` with Adam, its PyTorch twin "
        "`examples/torch_gpt.py`; softmax cross-entropy, a transformer's over every "
        "position's next token) from the same fixture (`benchmarks/fixtures/*.safetensors`: "
        "initial weights, data, hyperparameters, generated from the seeded specs in "
        "`benchmarks/specs.py`). A step feeds the next batch and trains once. The parity "
        "gate compares the first `parity_steps` losses with PyTorch "
        "CPU f32 (max relative error; f32 1e-5, f16 2e-3, bf16 4e-3); step times are reported "
        "only where it passes. Step times are p10 / p50 / p90 of per-step wall times after "
        "warm-up, the runners interleaved in rounds so background load falls on all alike "
        "(a pause of 0.1 s before a framework's rows, for the other's spinning threads; "
        "this project's rows back to back, their order turned by one each round so that "
        "each takes every place alike). An A/A control, a second "
        f"{CONTROL_VARIANT} runner timed in the same rounds, measures the run's own noise on "
        "ratios between this project's rows: a ratio closer to its goal than the control to "
        "its twin is marked as within that noise. "
        "Compile time is measured in a fresh process: *cold* with empty on-disk caches "
        "(`OCANNL_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR`), *warm* with the caches the cold run "
        "filled; it covers building the graph, lowering and compiling (torch.compile: its first "
        "forward and backward). The libraries' one-time per-process set-up (LLVM's target "
        "and JIT, loading the BLAS: MKL's first call loads its kernels for this CPU; torch's "
        "autograd and optimizer) is timed "
        "apart by first running a one-unit model, and shown in parentheses. Peak RSS growth "
        "is the warm-cache process's peak resident memory while training, over what it held "
        "before building (after that set-up): buffers, activations, and what the compiler "
        "left resident. Device buffers + scratch: the bytes an ocannl context holds after "
        "the step's first run (`Context.mem()`: its buffers and the arena of its local "
        "nodes). Besides PyTorch, the rows of JAX (`jax.jit` of the whole step, f32 and "
        "bf16 compute) and tinygrad (its CPU device, `TinyJit`, f32) train the same models "
        "from the same fixtures behind the same gate, where those packages are installed "
        "(the `bench-peers` extra).", "",
        "Variants of this project: " + "; ".join(f"**{k}**: {d}" for k, (_, d) in
                                                 VARIANTS.items()) + ".",
        "",
    ]
    for name, w in workloads.items():
        wrows = [r for r in rows if r.workload == name]
        if not wrows:
            continue
        out += [f"## {name}", "",
                f"{w.dataset}, {w.describe()}, batch {w.batch}, "
                f"f16 initial loss scale {w.init_loss_scale:g} (growth "
                f"interval {w.growth_interval}); {w.parity_steps} parity steps, "
                f"{w.warmup_steps} warm-up "
                f"steps, {w.timed_steps} timed steps per runner in {w.rounds} rounds.", ""]
        if name == "mlp_wide":
            out += [f"GEMM FLOPs per step: {w.gemm_flops() / 1e9:.3f} G (forward, weight "
                    "gradients, input gradients but the first layer's).", ""]
        out += table(wrows, info["sgemm"]) + [""] + aa_line(wrows)
    out += ["## Issue 12's targets (CPU, medians, ratios from this run)", "",
            "The issue's table, row for row: *at filing* is the issue's \"now\", *measured* "
            "this run's figure (a range where the row covers several workloads), *met / by how "
            "much* the verdict with the instance furthest from the goal. Step ratios are of "
            "p50s; compile + set-up is a fresh process's (cold: empty on-disk cache; warm: the "
            "cache the cold one filled; per workload the slowest probed ocannl row), and so is "
            "peak RSS growth (per workload the largest of the ocannl rows, over PyTorch "
            "eager's). \"f16\" is the host-gated f16 variant.", ""]
    later = {g.key for g in ISSUE_29_TABLE + ISSUE_42_TABLE}
    out += summary_table(targets) + [""]
    out += ["Every instance:", ""] + targets_table(
        [t for t in targets if t.key not in later]) + [""]
    out += _issue_section(targets, ISSUE_29_TABLE,
                          "Issue 29's targets (CPU, bf16, medians, ratios from this run)",
            "This project's bf16 step against its own f32 step and against PyTorch eager "
            "under `torch.autocast(device_type=\"cpu\", dtype=torch.bfloat16)` (the step a "
            "PyTorch user would pick), in the same rounds; the wide step's GEMM FLOPs over "
            "each step's p50, bf16's over f32's; the device buffers + scratch each step holds "
            "after its first run (`Context.mem()`: buffers and the arena of local nodes), "
            "bf16's over f32's. The goals are meant for a CPU with AMX-BF16 (the machine's "
            "bf16 units are listed above); the last row holds a CPU without any to the top "
            "of the range at filing, and is not measured on one that has them.")
    out += _issue_section(targets, ISSUE_42_TABLE,
                          "Issue 42's targets (CPU, medians, ratios from this run)",
            "Each f32 step over its floor (`benchmarks/floor.py`): the step's own products "
            "(the shapes its lowered code runs, operands stored as it stores them) as NumPy "
            "computes them, plus one pass over the bytes it must touch (parameters, gradients, "
            "optimizer state, inputs, the activations backprop reads) at the bandwidth of a "
            "NumPy copy, both timed in the step's rounds; the note gives the parts and the "
            "step's transcendental evaluations, which the floor leaves out. Each 16-bit step "
            "over its own f32 step where the CPU has no product units of its precision (an "
            "AVX512-BF16 CPU has none for f16).")
    if chart:
        out += [f"![step times]({chart})", ""]
    if chain is not None:
        out += ["## Compile time of a chain of N pointwise ops", ""] + chain_section(chain)
    if profiles:
        out += ["## Where the time goes", ""] + profile_section(rows, profiles)
    if OBSTACLES.exists():
        out += ["## What stands in the way", "", OBSTACLES.read_text().strip(), ""]
    return "\n".join(out)


def chart(rows: list[Row], path: Path) -> bool:
    """p50 step time per row (p10-p90 whiskers), one panel per workload; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n in WORKLOADS if any(r.workload == n and r.status == "ok" for r in rows)]
    if not names:
        return False
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.2 + 0.45 * len(rows) / len(names)),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        ok = [r for r in rows if r.workload == name and r.status == "ok"]
        ref = next((r.p50 for r in ok if (r.framework, r.variant) == ("torch", "eager")), None)
        y = range(len(ok))
        p50 = [r.p50 * 1e3 for r in ok]
        err = [[(r.p50 - r.p10) * 1e3 for r in ok], [(r.p90 - r.p50) * 1e3 for r in ok]]
        colors = ["tab:blue" if r.framework == "ocannl" else "tab:gray" for r in ok]
        ax.barh(list(y), p50, xerr=err, color=colors, capsize=3)
        ax.set_yticks(list(y), [_label(r) for r in ok])
        ax.invert_yaxis()
        top = 1.6 * max(p50)
        if max(p50) / min(p50) > 20:  # overhead-bound rows next to slow ones: log scale
            ax.set_xscale("log")
            ax.set_xlim(min(p50) / 2, top)
        else:
            ax.set_xlim(0, top)
        ax.set_xlabel("step time, ms (p50; whiskers p10-p90, clipped; ratio to PyTorch eager)")
        ax.set_title(name)
        if ref:
            for i, r in enumerate(ok):
                x = min(r.p90 * 1e3, top)
                ax.annotate(f" {r.p50 / ref:.2f}x", (x, i), va="center", fontsize=8,
                            clip_on=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
