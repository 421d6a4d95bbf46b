"""Compile time of a chain of N pointwise ops, each N in a fresh process with an empty cache.

    .venv/bin/python benchmarks/compile_chain.py                  # N = 100, 400, 1000, 3000
    .venv/bin/python benchmarks/compile_chain.py --n 100 400 --max-seconds 120 --out /tmp/c

Issue 12's target: compile time linear in N, 3,000 ops in at most 10 s. Per N, a child process
with ``OCANNL_CACHE_DIR`` set to a fresh temporary folder builds a 3-element ``term`` ``h``,
then N times ``h = h + 1.0``, and compiles ``train.forward(h)`` on the CPU: that compile's wall
time is the figure (building the graph is timed apart, and so is the libraries' one-time
per-process set-up, by compiling ``probe.warm_libraries``' one-unit model first). The child
then runs the routine once and checks ``h == x + N``. A child still going after
``--max-seconds`` is killed and its N reported as timed out; the other Ns still run.

Prints N, seconds and seconds per op; between two completed Ns, the growth exponent (1.0:
linear; 2.0: quadratic). Writes ``COMPILE_CHAIN.json`` into ``--out`` (default: this folder,
next to ``REPORT.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_NS = (100, 400, 1000, 3000)


def chain(n: int) -> dict:
    """Build and compile the chain of ``n`` additions in this process; the timings."""
    import numpy as np

    import ocannl.tensor as T
    from benchmarks.probe import warm_libraries
    from ocannl import Context, train

    t0 = time.perf_counter()
    warm_libraries("ocannl")
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    x = np.array([1.0, 2.0, 3.0], np.float32)
    h = T.term(x, label="h0")
    for _ in range(n):
        h = h + 1.0
    build_s = time.perf_counter() - t0
    ctx = Context.cpu()
    t0 = time.perf_counter()
    ctx, routine = ctx.compile(train.forward(h))
    compile_s = time.perf_counter() - t0
    got = ctx.run(routine).get_values(h)
    if not np.array_equal(got, x + n):
        raise AssertionError(f"chain of {n}: computed {got}, expected {x + n}")
    return {"n": n, "status": "ok", "compile_s": compile_s, "build_s": build_s,
            "setup_s": setup_s}


def run_child(n: int, max_seconds: float) -> dict:
    """``chain(n)`` in a fresh process with an empty on-disk cache; killed after
    ``max_seconds`` (then status "timeout")."""
    with tempfile.TemporaryDirectory(prefix="ocannl-chain-") as cache:
        env = dict(os.environ, OCANNL_CACHE_DIR=cache)
        cmd = [sys.executable, "-m", "benchmarks.compile_chain", "--child", str(n)]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=max_seconds, check=False)
        except subprocess.TimeoutExpired:
            return {"n": n, "status": "timeout", "note": f"not done in {max_seconds:g} s",
                    "wall_s": time.perf_counter() - t0}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"n": n, "status": "error",
                "note": f"exit {done.returncode}: {_why(done.stderr or done.stdout)[:300]}"}
    return json.loads(lines[-1])


def _why(output: str) -> str:
    """The exception line of a child's traceback (an error's message may span lines and end
    in a caret), else its last line."""
    lines = output.strip().splitlines() or ["no output"]
    for line in reversed(lines):
        if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Failure)\b", line):
            return line
    return lines[-1]


def growth(results: list[dict]) -> list[dict]:
    """Between consecutive completed Ns, the exponent k of compile time ~ N^k."""
    ok = [r for r in results if r["status"] == "ok" and r["compile_s"] > 0]
    return [{"from": a["n"], "to": b["n"],
             "exponent": math.log(b["compile_s"] / a["compile_s"]) / math.log(b["n"] / a["n"])}
            for a, b in zip(ok, ok[1:], strict=False) if b["n"] != a["n"]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=list(DEFAULT_NS),
                    help="chain lengths (default: %(default)s)")
    ap.add_argument("--max-seconds", type=float, default=900.0,
                    help="per N: kill the child and report a timeout after this long")
    ap.add_argument("--out", type=Path, default=HERE, help="where COMPILE_CHAIN.json goes")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.n) or args.max_seconds <= 0:
        ap.error("--n takes positive lengths and --max-seconds a positive time")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(chain(args.child)), flush=True)
        return 0
    from benchmarks import machine

    info = machine.describe()
    info["load_start"] = machine.load_average()
    info["date"] = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    command = ["benchmarks/compile_chain.py", *(argv if argv is not None else sys.argv[1:])]
    info["command"] = ".venv/bin/python " + shlex.join(command)
    print(f"{'N':>6} {'compile':>10} {'per op':>10}  (fresh process, empty cache)", flush=True)
    results = []
    for n in args.n:
        r = run_child(n, args.max_seconds)
        results.append(r)
        if r["status"] == "ok":
            print(f"{n:>6} {r['compile_s']:>9.2f}s {1e3 * r['compile_s'] / n:>8.2f}ms"
                  f"  (graph {r['build_s']:.2f} s, set-up {r['setup_s']:.2f} s)", flush=True)
        else:
            print(f"{n:>6} {r['status']}: {r['note']}", flush=True)
    slopes = growth(results)
    for g in slopes:
        print(f"N {g['from']} -> {g['to']}: compile time ~ N^{g['exponent']:.2f}")
    info["load_end"] = machine.load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "COMPILE_CHAIN.json"
    out.write_text(json.dumps({"info": info, "max_seconds": args.max_seconds,
                               "results": results, "growth": slopes}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
