"""Run the whole suite and regenerate ``benchmarks/REPORT.md`` and ``benchmarks/REPORT.png``.

    .venv/bin/python benchmarks/run.py            # the full suite, chain compile and profiles
    .venv/bin/python benchmarks/run.py --scale 0.1 --no-probes --no-chain --out /tmp/bench

Steps: generate or load the fixtures; measure NumPy's sgemm rate; per workload, build every
runner in this process, gate on parity, time interleaved rounds (mlp_wide's with NumPy's
sgemm in each round: the GEMM row's yardstick); measure the sgemm rate again; then, per row,
measure compile time (cold and warm on-disk cache) and peak memory in fresh processes; time
the cold compile of a chain of N pointwise ops per N in fresh processes
(``compile_chain.py``); time each lowered item of the slowest ocannl rows' steps
(``profile_items.py``); check issue 12's and issue 29's targets; write the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import compile_chain, machine, report, targets  # noqa: E402
from benchmarks.fixtures import FIXTURE_DIR, load  # noqa: E402
from benchmarks.floor import FloorInRounds, step_shape  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.probe import run_probe  # noqa: E402
from benchmarks.results import Row  # noqa: E402
from benchmarks.runners import make_runner, row_specs  # noqa: E402
from benchmarks.sgemm import sgemm_rate  # noqa: E402
from benchmarks.specs import CONTROL_VARIANT, VARIANTS, WORKLOADS, scaled  # noqa: E402

HERE = Path(__file__).resolve().parent
PROBE_STEPS = 3
PROFILE_TIMEOUT_S = 300.0


def log(msg: str) -> None:
    print(msg, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply the parity, warm-up and timed step counts (default 1)")
    ap.add_argument("--no-probes", action="store_true",
                    help="skip the fresh-process compile-time and memory probes")
    ap.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile rows")
    ap.add_argument("--cpu-only", action="store_true", help="skip the CUDA rows")
    ap.add_argument("--no-peers", action="store_true",
                    help="skip the JAX and tinygrad rows (PyTorch's autocast bf16 row stays)")
    ap.add_argument("--no-chain", action="store_true",
                    help="skip the chain-compile measurement (compile_chain.py)")
    ap.add_argument("--chain-n", type=int, nargs="+", default=list(compile_chain.DEFAULT_NS),
                    help="chain lengths (default: %(default)s)")
    ap.add_argument("--chain-max-seconds", type=float, default=60.0,
                    help="per chain length: give up after this long, and skip the longer "
                         "ones (default: %(default)s)")
    ap.add_argument("--chain-from", type=Path, metavar="JSON",
                    help="take the chain results from compile_chain.py's COMPILE_CHAIN.json "
                         "instead of measuring them")
    ap.add_argument("--profile-rows", type=int, default=2, metavar="K",
                    help="time each lowered item of the K ocannl rows furthest behind "
                         "PyTorch eager, one per workload (default: %(default)s; 0: none)")
    ap.add_argument("--profile-variants", default="f32,bf16,f16", metavar="V,...",
                    help="and each workload's rows of these variants (default: %(default)s; "
                         "'': none)")
    ap.add_argument("--profile-runs", type=int, default=20,
                    help="runs per item when profiling (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=HERE, help="where REPORT.md/.png/.json go")
    ap.add_argument("--fixtures", type=Path, default=FIXTURE_DIR, help="fixture folder")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.chain_n) or args.chain_max_seconds <= 0:
        ap.error("--chain-n takes positive lengths and --chain-max-seconds a positive time")
    unknown = [v for v in args.profile_variants.split(",") if v and v not in VARIANTS]
    if unknown:
        ap.error(f"--profile-variants: unknown variant(s) {unknown}: expected some of "
                 f"{list(VARIANTS)}")
    if args.profile_rows < 0 or args.profile_runs < 1:
        ap.error("--profile-rows takes 0 or more rows and --profile-runs 1 or more runs")
    return args


def probe_rows(rows: list[Row]) -> None:
    """Fill compile times (cold, warm) and peak memory from fresh processes."""
    for r in rows:
        if r.status not in ("ok", "parity-fail") or r.control:  # the control: as its twin
            continue
        compiles = r.framework in ("ocannl", "jax") or r.variant == "compile"  # jax: AOT in build
        with tempfile.TemporaryDirectory(prefix="ocannl-bench-") as tmp:
            args = (r.workload, r.framework, r.variant, r.device, PROBE_STEPS, Path(tmp))
            if compiles:
                cold = run_probe(*args)
                r.compile_cold_s, r.setup_cold_s = cold.get("compile_s"), cold.get("setup_s")
            warm = run_probe(*args)
            if compiles:
                r.compile_warm_s, r.setup_warm_s = warm.get("compile_s"), warm.get("setup_s")
            r.peak_rss_mib = warm.get("peak_rss_mib")
            bad = [p for p in ([cold] if compiles else []) + [warm] if p["status"] != "ok"]
            if bad:
                r.note = (r.note + " " if r.note else "") + f"probe: {bad[0].get('note')}"
        log(f"  probe {r.name}: cold {report.fmt(r.compile_cold_s, '.2f', ' s')}, "
            f"warm {report.fmt(r.compile_warm_s, '.2f', ' s')}, "
            f"peak RSS growth {report.fmt(r.peak_rss_mib, '.0f', ' MiB')}")


def slowest_rows(rows: list[Row], k: int) -> list[Row]:
    """The ``k`` timed ocannl CPU rows with the largest p50 over their workload's PyTorch eager
    p50 (at most one per workload), furthest behind first."""
    eager = {r.workload: r.p50 for r in rows
             if (r.framework, r.variant, r.device, r.status) == ("torch", "eager", "cpu", "ok")}
    ranked = sorted((r for r in rows if (r.framework, r.device, r.status, r.control) ==
                     ("ocannl", "cpu", "ok", False) and eager.get(r.workload) and r.p50),
                    key=lambda r: r.p50 / eager[r.workload], reverse=True)
    out: list[Row] = []
    for r in ranked:
        if len(out) < k and all(o.workload != r.workload for o in out):
            out.append(r)
    return out


def profile_row(workload: str, variant: str, runs: int,
                timeout: float = PROFILE_TIMEOUT_S) -> dict:
    """``profile_items.profile`` in a fresh process: each lowered item of the row's routines
    timed alone, slowest first (``items``: [seconds, what]), or ``error``."""
    code = ("import json, sys; from benchmarks.profile_items import profile; "
            "print(json.dumps(profile(sys.argv[1], sys.argv[2], int(sys.argv[3]))))")
    out: dict = {"workload": workload, "variant": variant, "runs": runs}
    try:
        done = subprocess.run([sys.executable, "-c", code, workload, variant, str(runs)],
                              cwd=HERE.parent, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {**out, "error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("[")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**out, "error": f"exit {done.returncode}: {tail[0][:300]}"}
    items = [(float(t), str(what)) for t, what in json.loads(lines[-1])]
    return {**out, "items": items, "total_s": sum(t for t, _ in items)}


def profiled_rows(rows: list[Row], k: int, variants: list[str]) -> list[Row]:
    """The ``k`` slowest ocannl rows (``slowest_rows``), then every workload's timed ocannl CPU
    rows of ``variants`` not among them."""
    out = slowest_rows(rows, k)
    for r in rows:
        if ((r.framework, r.device, r.status, r.control) == ("ocannl", "cpu", "ok", False)
                and r.variant in variants and r not in out):
            out.append(r)
    return out


def profile_rows(rows: list[Row], k: int, runs: int, variants: list[str] = ()) -> list[dict]:
    """Where the time of the ``k`` slowest ocannl rows' steps goes, and of every workload's
    rows of ``variants`` (``profiled_rows``)."""
    found = []
    for r in profiled_rows(rows, k, list(variants)):
        p = profile_row(r.workload, r.variant, runs)
        p["p50"] = r.p50
        found.append(p)
        log(f"  profile {r.name} ({r.workload}): " + (
            p["error"] if "error" in p else
            f"{len(p['items'])} items, {p['total_s'] * 1e3:.2f} ms in all"))
    return found


def load_chain(path: Path) -> dict:
    """compile_chain.py's COMPILE_CHAIN.json, with ``per_op_growth`` filled where an older
    file lacks it."""
    done = json.loads(path.read_text())
    done.setdefault("per_op_growth", compile_chain.per_op_growth(done.get("results", [])))
    done["source"] = str(path)
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    info = machine.describe()
    info["load_start"] = machine.load_average()
    info["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    command = ["benchmarks/run.py", *(argv if argv is not None else sys.argv[1:])]
    info["command"] = "python " + shlex.join(command)
    log(f"machine: {info['cpu']}, {info['cores']} cores; commit {info['commit']}")
    import torch  # noqa: F401 - imported before the sgemm measurement, as in every run

    sgemm = [sgemm_rate()]
    log(f"NumPy sgemm: {sgemm[0] / 1e9:.0f} GFLOP/s")
    specs = row_specs(devices=("cpu",) if args.cpu_only else ("cpu", "cuda"),
                      torch_compile=not args.no_torch_compile, peers=not args.no_peers)
    rows: list[Row] = []
    floors: dict[str, dict] = {}
    used = {name: scaled(WORKLOADS[name], args.scale) for name in args.workloads}
    for name, w in used.items():
        fx = load(w, args.fixtures)
        log(f"{name}:")
        runners = [make_runner(fx, *s) for s in specs]
        if ("ocannl", CONTROL_VARIANT, "cpu") in specs:  # the A/A control, timed with the rest
            runners.append(make_runner(fx, "ocannl", CONTROL_VARIANT, "cpu", control=True))
        # The yardstick, timed in the rounds: the same machine states as the steps. NumPy's
        # sgemm, and the step's floor (``benchmarks.floor``): a pass over the f32 step's own
        # products as NumPy computes them (for mlp_wide, the floor of its target against
        # PyTorch eager too) and a copy of the bytes the step must touch.
        in_rounds = FloorInRounds(step_shape(fx))
        rows += measure(fx, runners, runners[0], log, yardstick=in_rounds)
        floors[name] = in_rounds.record()
        log(f"  {floors[name]['note']}")
        if name == "mlp_wide":
            info["sgemm_rounds"] = in_rounds.rate()
            info["products_rounds_s"] = in_rounds.products_time()
        del runners
    sgemm.append(sgemm_rate())
    info["sgemm_alone"] = sgemm
    info["sgemm"] = info.get("sgemm_rounds") or max(sgemm)
    log(f"NumPy sgemm (again): {sgemm[1] / 1e9:.0f} GFLOP/s")
    if not args.no_probes:
        log("fresh-process probes (compile time, peak memory):")
        probe_rows(rows)
    chain = None
    if args.chain_from is not None:
        chain = load_chain(args.chain_from)
        log(f"chain compile: from {args.chain_from}")
    elif not args.no_chain:
        log(f"chain compile (fresh process per N, {args.chain_max_seconds:g} s each at most):")
        chain = compile_chain.run_chain(args.chain_n, args.chain_max_seconds,
                                        lambda m: log("  " + m), stop_after_timeout=True)
        chain["source"] = "this run"
    profiles = []
    variants = [v for v in args.profile_variants.split(",") if v]
    if args.profile_rows or variants:
        log("where the time goes (each lowered item timed alone):")
        profiles = profile_rows(rows, args.profile_rows, args.profile_runs, variants)
    info["load_end"] = machine.load_average()
    info["runtime_s"] = time.perf_counter() - t_start
    info["floors"] = floors
    found = targets.evaluate(rows, info["sgemm"], chain, info.get("products_rounds_s"),
                             bf16_units=info.get("bf16_units"), floors=floors)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "REPORT.png"
    has_chart = report.chart(rows, png)
    (args.out / "REPORT.md").write_text(
        report.render(rows, found, info, png.name if has_chart else None, used, chain=chain,
                      profiles=profiles))
    (args.out / "REPORT.json").write_text(json.dumps(
        {"info": info, "rows": [r.to_json() for r in rows],
         "targets": [t.to_json() for t in found], "chain": chain, "profiles": profiles},
        indent=1, default=str))
    log(f"wrote {args.out / 'REPORT.md'} in {info['runtime_s']:.0f} s")
    for t in found:
        log(f"  {t.name}: {report.fmt_target(t)} (goal {report.fmt_goal(t)}) -> "
            f"{t.verdict().replace('**', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
