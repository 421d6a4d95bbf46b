"""Run the whole suite and regenerate ``benchmarks/REPORT.md`` and ``benchmarks/REPORT.png``.

    .venv/bin/python benchmarks/run.py            # the full suite (under 15 minutes, 2 cores)
    .venv/bin/python benchmarks/run.py --scale 0.1 --no-probes --out /tmp/bench   # a quick look

Steps: generate or load the fixtures; measure NumPy's sgemm rate; per workload, build every
runner in this process, gate on parity, time interleaved rounds; then, per row, measure compile
time (cold and warm on-disk cache) and peak memory in fresh processes; write the report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import machine, report, targets  # noqa: E402
from benchmarks.fixtures import FIXTURE_DIR, load  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.probe import run_probe  # noqa: E402
from benchmarks.results import Row  # noqa: E402
from benchmarks.runners import make_runner, row_specs  # noqa: E402
from benchmarks.sgemm import sgemm_rate  # noqa: E402
from benchmarks.specs import WORKLOADS, scaled  # noqa: E402

HERE = Path(__file__).resolve().parent
PROBE_STEPS = 3


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
    ap.add_argument("--out", type=Path, default=HERE, help="where REPORT.md/.png/.json go")
    ap.add_argument("--fixtures", type=Path, default=FIXTURE_DIR, help="fixture folder")
    return ap.parse_args(argv)


def probe_rows(rows: list[Row]) -> None:
    """Fill compile times (cold, warm) and peak memory from fresh processes."""
    for r in rows:
        if r.status not in ("ok", "parity-fail"):
            continue
        compiles = r.framework == "ocannl" or r.variant == "compile"
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
                      torch_compile=not args.no_torch_compile)
    rows: list[Row] = []
    used = {name: scaled(WORKLOADS[name], args.scale) for name in args.workloads}
    for name, w in used.items():
        fx = load(w, args.fixtures)
        log(f"{name}:")
        runners = [make_runner(fx, *s) for s in specs]
        rows += measure(fx, runners, runners[0], log)
        del runners
    sgemm.append(sgemm_rate())
    info["sgemm"] = max(sgemm)
    log(f"NumPy sgemm (again): {sgemm[1] / 1e9:.0f} GFLOP/s")
    if not args.no_probes:
        log("fresh-process probes (compile time, peak memory):")
        probe_rows(rows)
    info["load_end"] = machine.load_average()
    info["runtime_s"] = time.perf_counter() - t_start
    found = targets.evaluate(rows, info["sgemm"])
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "REPORT.png"
    has_chart = report.chart(rows, png)
    (args.out / "REPORT.md").write_text(
        report.render(rows, found, info, png.name if has_chart else None, used))
    (args.out / "REPORT.json").write_text(json.dumps(
        {"info": info, "rows": [r.to_json() for r in rows],
         "targets": [{"name": t.name, "measured": t.measured, "goal": t.goal, "met": t.met}
                     for t in found]}, indent=1, default=str))
    log(f"wrote {args.out / 'REPORT.md'} in {info['runtime_s']:.0f} s")
    for t in found:
        log(f"  {t.name}: {report.fmt(t.measured, '.3f')} (goal {t.goal:g}) -> "
            f"{ {True: 'met', False: 'NOT MET', None: 'not measured'}[t.met]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
