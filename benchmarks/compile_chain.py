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

The child prints the wall-clock time at which the compile starts, so a killed child still
gives a lower bound of its compile time (``floor_s``). With ``--stop-after-timeout`` (what
``run.py`` does), once an N times out the longer chains are not run: each is reported as
skipped with the timed-out N's floor as its own (a longer chain of the same additions is
assumed to compile no faster).

Prints N, seconds and seconds per op; between two completed Ns, the growth exponent (1.0:
linear; 2.0: quadratic), and from the smallest N to the largest the growth of seconds per op
(issue 12 calls the compile linear while that stays within 2x). Writes ``COMPILE_CHAIN.json``
into ``--out`` (default: this folder, next to ``REPORT.json``); ``run.py --chain-from`` reads
it, and ``run.py`` runs the same measurement itself unless told ``--no-chain``.
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
from collections.abc import Callable
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
    comp = train.forward(h)
    print(json.dumps({"compile_started": time.time()}), flush=True)
    t0 = time.perf_counter()
    ctx, routine = ctx.compile(comp)
    compile_s = time.perf_counter() - t0
    got = ctx.run(routine).get_values(h)
    if not np.array_equal(got, x + n):
        raise AssertionError(f"chain of {n}: computed {got}, expected {x + n}")
    return {"n": n, "status": "ok", "compile_s": compile_s, "build_s": build_s,
            "setup_s": setup_s}


def run_child(n: int, max_seconds: float) -> dict:
    """``chain(n)`` in a fresh process with an empty on-disk cache; killed after
    ``max_seconds`` (then status "timeout", and ``floor_s``: how long it had been compiling)."""
    with tempfile.TemporaryDirectory(prefix="ocannl-chain-") as cache:
        env = dict(os.environ, OCANNL_CACHE_DIR=cache)
        cmd = [sys.executable, "-m", "benchmarks.compile_chain", "--child", str(n)]
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=max_seconds, check=False)
        except subprocess.TimeoutExpired as err:
            killed = time.time()
            out = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else (
                err.stdout or "")
            started = [json.loads(ln)["compile_started"] for ln in out.splitlines()
                       if ln.startswith('{"compile_started"')]
            return {"n": n, "status": "timeout", "note": f"not done in {max_seconds:g} s",
                    "wall_s": time.perf_counter() - t0,
                    "floor_s": max(0.0, killed - started[-1]) if started else None}
        wall_s = time.perf_counter() - t0
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"n"')]
    if done.returncode != 0 or not lines:
        return {"n": n, "status": "error",
                "note": f"exit {done.returncode}: {_why(done.stderr or done.stdout)[:300]}"}
    return {**json.loads(lines[-1]), "wall_s": wall_s}


def run_chain(ns: list[int], max_seconds: float, log: Callable[[str], None] = print,
              stop_after_timeout: bool = False) -> dict:
    """Every N in a fresh process (``run_child``), logged as it completes; the results, the
    growth exponents and the per-op growth. ``stop_after_timeout``: once an N times out, the
    longer ones are skipped, each with that N's ``floor_s``."""
    log(f"{'N':>6} {'compile':>10} {'per op':>10}  (fresh process, empty cache)")
    results: list[dict] = []
    stopped: dict | None = None
    for n in ns:
        if stopped is not None and n > stopped["n"]:
            r = {"n": n, "status": "skipped", "floor_s": stopped.get("floor_s"),
                 "note": f"N = {stopped['n']} already took over {max_seconds:g} s"}
        else:
            r = run_child(n, max_seconds)
            if r["status"] == "timeout" and stop_after_timeout and stopped is None:
                stopped = r
        results.append(r)
        if r["status"] == "ok":
            log(f"{n:>6} {r['compile_s']:>9.2f}s {1e3 * r['compile_s'] / n:>8.2f}ms"
                f"  (graph {r['build_s']:.2f} s, set-up {r['setup_s']:.2f} s)")
        else:
            floor = "" if r.get("floor_s") is None else f" (compiling > {r['floor_s']:.1f} s)"
            log(f"{n:>6} {r['status']}: {r['note']}{floor}")
    slopes = growth(results)
    for g in slopes:
        log(f"N {g['from']} -> {g['to']}: compile time ~ N^{g['exponent']:.2f}")
    per_op = per_op_growth(results)
    if per_op is not None:
        log(f"seconds per op, N {per_op['from']} -> {per_op['to']}: "
            f"{'> ' if per_op['lower_bound'] else ''}{per_op['ratio']:.2f}x "
            f"(linear: within 2x)")
    return {"max_seconds": max_seconds, "results": results, "growth": slopes,
            "per_op_growth": per_op}


def per_op_growth(results: list[dict]) -> dict | None:
    """Seconds per op at the largest N over the smallest completed N's (a timed-out largest N
    counts with its floor: then the ratio is a lower bound); None under two lengths."""
    ok = [r for r in results if r["status"] == "ok" and r["compile_s"] > 0]
    tried = ok + [r for r in results if r["status"] != "ok" and r.get("floor_s") is not None]
    if not ok or not tried:
        return None
    lo, hi = min(ok, key=lambda r: r["n"]), max(tried, key=lambda r: r["n"])
    if hi["n"] == lo["n"]:
        return None
    bound = hi["status"] != "ok"
    secs = hi["floor_s"] if bound else hi["compile_s"]
    return {"from": lo["n"], "to": hi["n"], "per_op_from_s": lo["compile_s"] / lo["n"],
            "per_op_to_s": secs / hi["n"],
            "ratio": (secs / hi["n"]) / (lo["compile_s"] / lo["n"]), "lower_bound": bound}


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
    ap.add_argument("--stop-after-timeout", action="store_true",
                    help="once an N times out, skip the longer chains")
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
    done = run_chain(args.n, args.max_seconds, lambda m: print(m, flush=True),
                     args.stop_after_timeout)
    info["load_end"] = machine.load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "COMPILE_CHAIN.json"
    out.write_text(json.dumps({"info": info, **done}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
