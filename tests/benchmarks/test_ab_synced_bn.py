"""``benchmarks/ab_synced_bn.py`` runs both sides on a shard count and reports each (its
figures are the benchmark's, never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ab_synced_bn  # noqa: E402


def test_both_sides_run_and_are_reported(capsys):
    rows = ab_synced_bn.main(["--rounds", "2", "--steps", "2", "--shards", "2"])
    assert [r["shards"] for r in rows] == [2]
    assert rows[0]["per_shard_s"] > 0 and rows[0]["synced_s"] > 0
    assert "2 shard(s) on one rank: per-shard" in capsys.readouterr().out
