"""``benchmarks/item_cycles.py`` counts each item's ticks inside the steps of every variant
asked for (its figures are the benchmark's, never asserted)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import item_cycles  # noqa: E402


def test_every_variants_items_are_counted_and_reported(monkeypatch, tmp_path, capsys):
    from ocannl.backends.cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "_counting", False)  # restored after: counting is global
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    runs = item_cycles.counted_runs("mlp_small", ["f32", "f16"], blocks=2, steps=2)
    assert list(runs) == ["f32", "f16"]
    for items, wall in runs.values():
        assert wall > 0 and len(items) > 20
        assert any(t > 0 and what.startswith("gemm ") for t, what in items)
    assert len(runs["f16"][0]) > len(runs["f32"][0])  # the casts, the gate's checksum
    item_cycles.main(["mlp_small", "f32", "--blocks", "1", "--steps", "1", "--top", "3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mlp_small f32: ") and len(out) == 4
    assert os.environ["OCANNL_CACHE_DIR"] == str(tmp_path)  # given back


@pytest.mark.parametrize(("args", "named"), [
    (["mlp_small", "f32,f99"], "variants must be distinct"),
    (["mlp_small", "f32,f32"], "variants must be distinct"),
    (["mlp_small", "f32", "--steps", "0"], "--blocks and --steps must be >= 1"),
    (["mlp_small", "f32", "--blocks", "0"], "--blocks and --steps must be >= 1"),
    (["nope", "f32"], "invalid choice: 'nope'"),
])
def test_a_bad_argument_is_refused_by_name_before_anything_runs(args, named, monkeypatch,
                                                                 tmp_path, capsys):
    from ocannl.backends.cpu.backend import CpuBackend

    monkeypatch.setattr(CpuBackend, "_counting", False)
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        item_cycles.main(args)
    assert named in capsys.readouterr().err
    assert not CpuBackend._counting and os.environ["OCANNL_CACHE_DIR"] == str(tmp_path)
