"""``benchmarks/ab_variants.py`` times every variant asked for in every block and reports each
against the first (its figures are the benchmark's, never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ab_variants  # noqa: E402


def test_every_variant_is_timed_in_every_block_and_reported_against_the_first(capsys):
    times = ab_variants.main(["mlp_small", "f32,f16-static", "--blocks", "3", "--steps", "2"])
    assert list(times) == ["f32", "f16-static"]
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out] == ["f32", "f16-static"]
    assert all("min / f32's" in line for line in out)


@pytest.mark.parametrize("variants", ["f32,f99", "f32,f32"])
def test_an_unknown_or_repeated_variant_is_refused(variants, capsys):
    with pytest.raises(SystemExit):
        ab_variants.main(["mlp_small", variants])
    assert "variants must be distinct" in capsys.readouterr().err
