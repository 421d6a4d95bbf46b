"""``benchmarks/ab_shard_order.py`` times both steps and the floor's terms and reports them (its
figures are the benchmark's, never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ab_shard_order  # noqa: E402


def test_both_steps_and_the_floor_are_reported(capsys):
    rows = ab_shard_order.main(["--workloads", "mlp_small", "--rounds", "2", "--steps", "2"])
    assert [r["workload"] for r in rows] == ["mlp_small"] and rows[0]["shards"] > 1
    assert min(rows[0][k] for k in ("off", "on", "off_routine", "shard_routine", "add")) > 0
    out = capsys.readouterr().out
    assert "mlp_small:" in out and "order cost (on / off)" in out and "on / floor" in out
