"""``benchmarks/data_parallel.py`` refuses a row whose ranks ran another thread count than
its label (issue 41 item 6): every library's count must be the label, and the cores a rank
kept busy in the timed loop (CPU time over wall time) may exceed it by ``CORES_SLACK`` only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import data_parallel as D
from benchmarks.specs import WORKLOADS

ROOT = Path(__file__).resolve().parents[2]


def _rank(threads: dict[str, int], cpu_s: float = 1.0, seconds: float = 1.0) -> dict:
    return {"threads": threads, "cpu_s": cpu_s, "seconds": seconds}


def test_a_rank_with_another_thread_count_is_named() -> None:
    good = _rank({"ocannl": 1, "blas:libopenblas.so": 1}, cpu_s=1.1)
    assert D.check_threads(1, [good, good]) == []
    wrong = _rank({"ocannl": 2, "blas:libopenblas.so": 1})
    assert D.check_threads(1, [good, wrong]) == ["rank 1: ocannl ran 2 thread(s), not 1"]
    busy = _rank({"ocannl": 1}, cpu_s=1.9)
    assert D.check_threads(1, [busy]) == [
        "rank 0: kept 1.90 cores busy (CPU time / wall time), more than its 1 thread(s)"]


def _runs(threads_seen: dict) -> dict:
    out = {}
    for fw in D.FRAMEWORKS:
        for n in (1, 2):
            ranks = [threads_seen.get((fw, n), _rank({"x": 1}))] * n
            out[(fw, n)] = [{"steps": 10, "seconds": 1.0 / n, "losses": [1.0], "ranks": ranks,
                            "build_s": 0.0}]
    return out


def _info(shards: int) -> dict:
    """A report's header facts, for rendering mlp_wide's rows."""
    return {"cpu": "cpu", "cores": 2, "commit": "c", "load_avg": (0, 0, 0), "rounds": 1,
            "steps": 10, "command": "cmd",
            "workloads": {"mlp_wide": {"describe": "d", "dataset": "ds", "global_batch": 256,
                                       "shards": shards}}}


def test_a_refused_row_shows_no_timing_and_says_why() -> None:
    w = WORKLOADS["mlp_wide"]
    runs = _runs({("ocannl", 2): _rank({"ocannl": 2})})
    rows = D.workload_rows(w, runs, [1.0], [1, 2], lambda n: 1)
    bad = [r for r in rows if r["threads_refused"]]
    assert [(r["framework"], r["ranks"]) for r in bad] == [("ocannl", 2)]
    assert not bad[0]["timed"] and not bad[0]["efficiency_ok"]
    text = D.render(rows, _info(shards=8))
    assert "(refused: threads)" in text
    assert "- mlp_wide, ocannl, 2 rank(s): rank 0: ocannl ran 2 thread(s), not 1" in text
    assert "Cost of the fixed shard order" in text and "1 rank(s) 1.000x" in text


def test_every_rank_gets_each_thread_variable() -> None:
    assert "OCANNL_THREADS" in D.THREAD_VARS and "OMP_NUM_THREADS" in D.THREAD_VARS
    code = ("import sys; sys.path.insert(0, '.'); from benchmarks.data_parallel import "
            "threads_in_use; print(threads_in_use('ocannl')['ocannl'])")
    env = {**os.environ, **dict.fromkeys(D.THREAD_VARS, "1")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "1"


def test_the_ranks_alone_are_the_ceiling_with_no_parity_of_their_own() -> None:
    """Each rank training its own block (no exchange) is timed without the parity gate at
    more than one rank (its losses are its block's) and gives the scaling's ceiling."""
    w = WORKLOADS["mlp_wide"]
    runs = _runs({})
    for n in (1, 2):
        runs[("ocannl-alone", n)][0]["losses"] = [1.0 if n == 1 else 5.0]
    runs[("ocannl", 2)][0]["seconds"] = 0.6  # the tree at 2 ranks: 0.83 of 2x
    rows = D.workload_rows(w, runs, [1.0], [1, 2], lambda n: 1)
    alone = {r["ranks"]: r for r in rows if r["framework"] == "ocannl-alone"}
    assert alone[2]["parity_na"] and alone[2]["timed"] and not alone[1]["parity_na"]
    assert D.scaling_ceiling(rows) == [(2, 1.0, (10 / 0.6) / 20)]
    text = D.render(rows, _info(shards=2))
    assert "| n/a (no exchange) |" in text
    assert "2 ranks 1.00, the fixed shard tree 0.83 (0.83 of it)" in text
