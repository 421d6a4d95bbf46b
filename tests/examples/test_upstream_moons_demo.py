"""examples/upstream_moons_demo.py: upstream OCANNL's half-moons demo, ported line for line,
trains with every dim it leaves to inference inferred here too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "upstream_moons_demo.py"


def _load():
    sys.path.insert(0, str(EXAMPLE.parent))
    spec = importlib.util.spec_from_file_location("upstream_moons_demo_under_test", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_demo_trains_with_its_dims_inferred(capsys):
    accuracy = _load().main(epochs=4)
    out = capsys.readouterr().out
    assert accuracy > 0.9, out
    # w1's input from the points, w3's output from the classes through `*`, biases' input
    # rows empty: none of them written in the example.
    assert "w3 |16->1, b2 |->16, w2 |16->16, b1 |->16, w1 |2->16" in out
