"""Cold compile of the four workloads' steps: routine parts compiled in forked processes at once
(``jit.py``'s default) against one after the other in the calling process.

    .venv/bin/python benchmarks/ab_compile.py [--reps 3] [--variant f32] [--workers 2]

Per workload and repetition, two fresh processes (``probe.run_probe``: an empty
``OCANNL_CACHE_DIR`` each, the libraries' one-time set-up not counted), one with
``OCANNL_COMPILE_WORKERS=1`` (serial) and one with ``--workers``, their order alternating
by repetition. Prints each workload's median compile seconds both ways, the ratio of the
medians and the median of the repetitions' ratios (forked / serial: under 1 means forking
wins).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.probe import run_probe  # noqa: E402

WORKLOADS = ("mlp_small", "mlp_wide", "convnet", "gpt_mini")


def cold_compile(workload: str, variant: str, workers: int) -> float:
    """One fresh process's cold compile of ``workload``'s step, in seconds."""
    os.environ["OCANNL_COMPILE_WORKERS"] = str(workers)
    with tempfile.TemporaryDirectory(prefix="ocannl-ab-compile-") as cache:
        got = run_probe(workload, "ocannl", variant, "cpu", 1, Path(cache))
    if got.get("status") != "ok":
        raise RuntimeError(f"{workload} with {workers} workers: {got}")
    return float(got["compile_s"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variant", default="f32")
    ap.add_argument("--workers", type=int, default=2, help="the forked side's worker count")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = ap.parse_args(argv)
    for workload in args.workloads:
        times: dict[int, list[float]] = {1: [], args.workers: []}
        for rep in range(args.reps):
            order = (1, args.workers) if rep % 2 == 0 else (args.workers, 1)
            for workers in order:
                times[workers].append(cold_compile(workload, args.variant, workers))
        paired = [f / s for f, s in zip(times[args.workers], times[1], strict=True)]
        serial = statistics.median(times[1])
        forked = statistics.median(times[args.workers])
        print(f"{workload} {args.variant}: serial p50 {serial:.2f} s "
              f"{[round(t, 2) for t in times[1]]}, forked ({args.workers} workers) p50 "
              f"{forked:.2f} s {[round(t, 2) for t in times[args.workers]]}; "
              f"forked/serial {forked / serial:.3f}, by repetition p50 "
              f"{statistics.median(paired):.3f}", flush=True)


if __name__ == "__main__":
    main()
