"""``benchmarks/ab_routines.py``: every product routine it finds computes the product (within
f32 rounding of the f64 product of its rounded operands), oneDNN's through the routines' shim
among them where the onednn wheel runs here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ocannl.backends.cpu import onednn

ROOT = Path(__file__).resolve().parents[2]


def test_each_routine_computes_the_product_it_is_timed_on():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_routines.py"),
                           "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^ +(.+?): +([\d.]+) GFLOP/s +rel\. err (\S+)$", done.stdout, re.M)
    assert len(rows) >= 5, done.stdout  # NumPy's sgemm at least, on each of five shapes
    for name, rate, err in rows:
        assert float(rate) > 0 and float(err) < 1e-5, (name, rate, err)
    names = {name for name, _, _ in rows}
    assert "numpy sgemm" in names
    here = onednn.bf16_product(32)
    if isinstance(here, onednn.OneDnn):
        assert f"oneDNN {here.version} bf16 (shim)" in names, names
    else:
        assert f"oneDNN: {here}" in done.stdout
