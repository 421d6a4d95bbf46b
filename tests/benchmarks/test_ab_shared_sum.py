"""``benchmarks/ab_shared_sum.py`` under ``mpiexec -n 2``: both sums run and agree bit for bit
(its timings are the benchmark's, never asserted)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from test_parallel import mpirun, needs_mpi, ok  # noqa: E402


@needs_mpi
def test_both_sums_run_on_two_ranks_and_agree() -> None:
    job = ok(mpirun(2, "--sizes", "1000", "4097", "--rounds", "1",
                    script=ROOT / "benchmarks" / "ab_shared_sum.py", timeout=120))
    rows = re.findall(r"^(\d+) f32 on 2 ranks: MPI Iallreduce [\d.]+ us, shared memory "
                      r"[\d.]+ us \(same bits: (\w+)\)$", job.out, re.M)
    assert rows == [("1000", "True"), ("4097", "True")], job.out
