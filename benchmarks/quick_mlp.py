"""One MLP training step, this project against PyTorch eager on the CPU, in the same process.

    .venv/bin/python benchmarks/quick_mlp.py [--steps N]

Two MLPs (relu, softmax cross-entropy, plain SGD, same initial weights and data for both):
2 -> 64 -> 64 -> 2 at batch 32, and 256 -> 1024 -> 1024 -> 10 at batch 256. Each step is timed
on its own, the two frameworks alternating in rounds; printed: the p50s and their ratio.
Targets on the 2-core development machine: the small MLP at least 3x faster than PyTorch
eager, the wide one at least as fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.fixtures import from_tensors, generate  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.report import fmt_time  # noqa: E402
from benchmarks.runners import make_runner  # noqa: E402
from benchmarks.specs import Workload, scaled  # noqa: E402

# (workload, the speed-up over PyTorch eager it should reach)
CASES = [
    (Workload(name="quick_small", dataset="half_moons", sizes=(2, 64, 64, 2), batch=32,
              n_batches=16, learning_rate=0.1, seed=11, parity_steps=5, warmup_steps=50,
              timed_steps=2000, rounds=5), 3.0),
    (Workload(name="quick_wide", dataset="gaussian_classes", sizes=(256, 1024, 1024, 10),
              batch=256, n_batches=4, learning_rate=0.01, seed=12, parity_steps=3,
              warmup_steps=5, timed_steps=100, rounds=5), 1.0),
]


def run_case(w: Workload, speedup: float, quiet: bool) -> bool:
    fx = from_tensors(w, generate(w))
    torch_r = make_runner(fx, "torch", "eager", "cpu")
    ocannl_r = make_runner(fx, "ocannl", "f32", "cpu")
    rows = measure(fx, [torch_r, ocannl_r], torch_r, log=(lambda _: None) if quiet else print)
    ref, ours = rows
    title = f"{' -> '.join(map(str, w.sizes))}, batch {w.batch}"
    if ours.status != "ok" or ref.status != "ok":
        print(f"{title}: not timed ({ours.status}: {ours.note or ours.parity_err})")
        return False
    ratio = ours.p50 / ref.p50
    met = 1 / ratio >= speedup
    print(f"{title}: ocannl p50 {fmt_time(ours.p50)}, PyTorch eager p50 {fmt_time(ref.p50)}; "
          f"ratio {ratio:.3f} ({1 / ratio:.2f}x faster; target >= {speedup:g}x: "
          f"{'met' if met else 'NOT met'}); {ours.steps_timed} steps each")
    return met


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the step counts")
    ap.add_argument("--verbose", action="store_true", help="log build, parity and timing")
    args = ap.parse_args(argv)

    for w, speedup in CASES:
        run_case(scaled(w, args.scale), speedup, quiet=not args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
