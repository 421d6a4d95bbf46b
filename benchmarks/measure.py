"""In-process measurement of one workload: build every runner, gate on parity against the
PyTorch CPU f32 losses, warm up, then time steps in interleaved rounds so that background
load falls on every row alike."""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.fixtures import Fixture
from benchmarks.results import Row, relative_error
from benchmarks.runners.base import Runner, Unavailable
from benchmarks.sgemm import SgemmInRounds
from benchmarks.specs import TOLERANCE, precision_of

Log = Callable[[str], None]

# Pause before a runner's block of timed steps unless it and the previous block are both
# this project's: another framework's BLAS and OpenMP worker threads spin-wait for a while
# after their last call, and would steal the cores. This project's rows follow one another
# without a pause (the pool's workers spin for about 40 us), so they run within milliseconds
# of each other and meet the same state of a noisy machine: their ratios compare like with
# like. Their order turns by one every round (``round_order``): on a machine that slows down
# for some 70 ms in every 200, identical rows in a fixed order differed by up to 23% at p50.
SETTLE_S = 0.1


def tolerance_of(r: Runner) -> float:
    return TOLERANCE[precision_of(r.framework, r.variant)]


def build_all(runners: list[Runner], rows: list[Row], log: Log) -> None:
    for r, row in zip(runners, rows, strict=True):
        t0 = time.perf_counter()
        try:
            r.build()
        except Unavailable as err:
            row.status, row.note = "skipped", str(err)
        except Exception as err:  # noqa: BLE001 - a broken row must not sink the suite
            row.status, row.note = "error", f"build: {type(err).__name__}: {err}"
        else:
            row.build_s = time.perf_counter() - t0
            row.status = "built"
        log(f"  {row.name}: {row.status} {row.note}".rstrip())


def parity(fx: Fixture, runners: list[Runner], rows: list[Row], ref: Runner, log: Log) -> None:
    """Train every built runner for ``parity_steps`` and compare losses with ``ref``'s."""
    n = fx.workload.parity_steps
    losses: dict[int, list[float]] = {}
    for r, row in zip(runners, rows, strict=True):
        if row.status != "built":
            continue
        try:
            seq = []
            for i in range(n):
                r.step(i)
                seq.append(r.loss())
                if i == 0:  # the step compiled and run once: its buffers and scratch exist
                    row.mem_bytes = r.mem_bytes()
                    row.mem_parts = getattr(r, "mem_parts", dict)()
            losses[id(r)] = seq
        except Exception as err:  # noqa: BLE001
            row.status, row.note = "error", f"step: {type(err).__name__}: {err}"
    ref_losses = losses.get(id(ref))
    for r, row in zip(runners, rows, strict=True):
        if id(r) not in losses:
            continue
        row.tolerance = tolerance_of(r)
        row.parity_err = (relative_error(losses[id(r)], ref_losses) if ref_losses is not None
                          else float("nan"))
        ok = row.parity_err <= row.tolerance
        row.status = "ok" if ok else "parity-fail"
        log(f"  parity {row.name}: max rel err {row.parity_err:.2e} "
            f"(tol {row.tolerance:.0e}) {'pass' if ok else 'FAIL'}")


def round_order(live: list, k: int) -> list:
    """The rows in round ``k``'s order: each run of one framework's rows (kept in place, so
    the pauses between frameworks stay as few) turned left by ``k``, so that every row of
    this project takes every place in its run as often as the others."""
    out: list = []
    start = 0
    for end in range(1, len(live) + 1):
        if end == len(live) or live[end][0].framework != live[start][0].framework:
            run = live[start:end]
            turn = k % len(run)
            out += run[turn:] + run[:turn]
            start = end
    return out


def time_steps(fx: Fixture, runners: list[Runner], rows: list[Row], log: Log,
               yardstick: SgemmInRounds | None = None) -> None:
    """Warm up, then time ``timed_steps`` steps per passing runner over interleaved rounds;
    ``yardstick``: NumPy's sgemm, timed first in every round too."""
    w = fx.workload
    live = [(r, row) for r, row in zip(runners, rows, strict=True) if row.status == "ok"]
    step = w.parity_steps
    for r, _ in live:
        for i in range(step, step + w.warmup_steps):
            r.step(i)
        r.sync()
    step += w.warmup_steps
    per_round = max(1, w.timed_steps // w.rounds)
    clock = time.perf_counter
    for k in range(w.rounds):
        previous = None
        if yardstick is not None:
            time.sleep(SETTLE_S)
            yardstick.time()
            previous = yardstick
        for r, row in round_order(live, k):
            if previous is None or "ocannl" != previous.framework or "ocannl" != r.framework:
                time.sleep(SETTLE_S)
            previous = r
            samples = row.samples
            for i in range(step, step + per_round):
                t0 = clock()
                r.step(i)
                r.sync()
                samples.append(clock() - t0)
        step += per_round
    for _, row in live:
        row.rounds = w.rounds
        row.finish_timing()
        log(f"  time {row.name}: p50 {row.p50 * 1e3:.3f} ms")
    if yardstick is not None and yardstick.samples:
        log(f"  NumPy sgemm in these rounds: {yardstick.rate() / 1e9:.0f} GFLOP/s (median)")


def measure(fx: Fixture, runners: list[Runner], ref: Runner, log: Log = print,
            yardstick: SgemmInRounds | None = None) -> list[Row]:
    """Build, gate and time ``runners`` on ``fx``; ``ref`` (among them) is the parity oracle;
    ``yardstick``: NumPy's sgemm, timed in the same rounds."""
    rows = [Row(fx.workload.name, r.framework, r.device, r.variant,
                control=getattr(r, "control", False)) for r in runners]
    build_all(runners, rows, log)
    parity(fx, runners, rows, ref, log)
    time_steps(fx, runners, rows, log, yardstick)
    return rows
