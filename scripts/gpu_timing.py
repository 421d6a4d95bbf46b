"""The GPU check's timing part: this project's training step against PyTorch CUDA's.

    python scripts/gpu_timing.py [--budget-s 85] [--workloads mlp_wide convnet gpt_mini]
    python scripts/gpu_timing.py --dry-run --workloads mlp_small   # on the CPU, no GPU needed

Rows, per workload (``benchmarks.specs``: the same fixture weights and data for every row):
this project's step at ``f32``, ``bf16`` and ``f16-gated16`` (the benchmark's runners on
``Context.cuda()``), and PyTorch's: ``eager`` (f32), ``autocast-bf16`` (eager under
``torch.autocast(dtype=bfloat16)``) and ``compile-ro`` (``torch.compile(mode=
"reduce-overhead")``, f32: CUDA graphs). Columns:

- ``wall ms``: host wall time per step, the median over chunks of steps, each chunk ended by a
  device synchronization;
- ``gpu ms``: the device's time per step, from CUDA events recorded before and after each timed
  step on the default stream (legacy: it orders after every blocking stream), the median; it
  includes the gaps in which the device waits for the host, so a host-bound step shows
  ``gpu ms`` close to ``wall ms``;
- ``launches``: kernel and graph launch calls in one step (``torch.profiler``: CUDA runtime and
  driver launch calls, a graph launch counting one), and ``kernels``: the kernels the device ran
  in that step;
- ``MiB``: device memory, PyTorch's peak allocated since the row began, this project's CuPy
  pool in use after the steps (its routines allocate nothing per step);
- ``loss@1``: the first step's loss, the same model from the same weights on every row.

Rows are run cheapest first (f32 and eager on every workload, then bf16, then f16-gated16, the
torch.compile rows last); a row that would start after ``--budget-s`` is listed as not run, so
the part ends with its table rather than a timeout. ``--dry-run`` runs the same code on the CPU
(this project's LLVM backend, PyTorch's CPU eager and autocast; no events, no profiler, no
compile row), for checking the script without a GPU: its figures are not GPU timings.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.specs import WORKLOADS  # noqa: E402

DEFAULT_WORKLOADS = ("mlp_wide", "convnet", "gpt_mini")
OCANNL_VARIANTS = ("f32", "bf16", "f16-gated16")
TORCH_MODES = ("eager", "autocast-bf16", "compile-ro")
# The comparisons the issue's targets name: this project's row / PyTorch's row.
PAIRS = (("f32", "eager"), ("bf16", "autocast-bf16"), ("f32", "compile-ro"))
LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                          "cuLaunchKernelEx", "cudaLaunchCooperativeKernel", "cudaGraphLaunch",
                          "cuGraphLaunch"})


@dataclass
class Row:
    workload: str
    framework: str  # "ocannl" or "torch"
    variant: str  # an OCANNL_VARIANTS or TORCH_MODES entry
    wall_ms: float | None = None
    gpu_ms: float | None = None
    launches: int | None = None
    kernels: int | None = None
    mib: float | None = None
    loss1: float | None = None
    note: str = ""  # why a row has no figures
    chunks: list[float] = field(default_factory=list)


def row_order(workloads: Sequence[str], dry_run: bool = False) -> list[Row]:
    """Every row to run, cheapest first (see the module docstring)."""
    stages = [(("ocannl", "f32"), ("torch", "eager")), (("ocannl", "bf16"),
              ("torch", "autocast-bf16")), (("ocannl", "f16-gated16"),), (("torch", "compile-ro"),)]
    rows = []
    for stage in stages:
        for w in workloads:
            for fw, v in stage:
                rows.append(Row(w, fw, v, note="CUDA only" if dry_run and v == "compile-ro"
                                else ""))
    return rows


def median_ms(seconds: Sequence[float]) -> float:
    """The median of per-step times given in seconds, in milliseconds."""
    if not seconds:
        raise ValueError("median_ms: no times given")
    return statistics.median(seconds) * 1e3


def per_step(chunk_seconds: Sequence[float], steps_per_chunk: int) -> list[float]:
    """Per-step seconds of each chunk of ``steps_per_chunk`` steps."""
    if steps_per_chunk < 1:
        raise ValueError(f"steps_per_chunk must be >= 1, got {steps_per_chunk}")
    return [t / steps_per_chunk for t in chunk_seconds]


def ratio(rows: Sequence[Row], workload: str, ours: str, theirs: str,
          column: str = "wall_ms") -> float | None:
    """This project's ``ours`` row over PyTorch's ``theirs`` row of ``workload`` in ``column``
    (None where either has no figure)."""
    def value(fw: str, v: str) -> float | None:
        for r in rows:
            if (r.workload, r.framework, r.variant) == (workload, fw, v):
                return getattr(r, column)
        return None

    a, b = value("ocannl", ours), value("torch", theirs)
    return None if a is None or b is None or b == 0 else a / b


def _fmt(v: float | int | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, then the ratios of the pairs in ``PAIRS``."""
    lines = ["| workload | framework | variant | wall ms | gpu ms | launches | kernels | MiB "
             "| loss@1 | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.workload} | {r.framework} | {r.variant} | {_fmt(r.wall_ms, '.3f')} "
                     f"| {_fmt(r.gpu_ms, '.3f')} | {_fmt(r.launches, 'd')} "
                     f"| {_fmt(r.kernels, 'd')} | {_fmt(r.mib, '.1f')} "
                     f"| {_fmt(r.loss1, '.6f')} | {r.note} |")
    lines.append("")
    for w in dict.fromkeys(r.workload for r in rows):
        for ours, theirs in PAIRS:
            for col in ("wall_ms", "gpu_ms"):
                q = ratio(rows, w, ours, theirs, col)
                if q is not None:
                    lines.append(f"{w}: ocannl {ours} / torch {theirs} ({col[:-3]}): {q:.2f}x")
    return "\n".join(lines)


# --- the device: events, profiler, memory --------------------------------------------------------


class Device:
    """What a row needs from the device: synchronization, step events, launch counts, memory;
    on the CPU (``--dry-run``) only the wall clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.torch: Any = None
        try:
            import torch

            self.torch = torch
        except ImportError:
            pass

    def sync(self) -> None:
        if self.cuda:
            import cupy

            cupy.cuda.Device().synchronize()
            if self.torch is not None:
                self.torch.cuda.synchronize()

    def span_ms(self, step: Callable[[], None]) -> float | None:
        """The device time of one step between two CUDA events (None on the CPU)."""
        if not self.cuda:
            step()
            return None
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(cupy.cuda.Stream.null)
        step()
        end.record(cupy.cuda.Stream.null)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end)

    def count_launches(self, step: Callable[[], None]) -> tuple[int | None, int | None]:
        """(launch calls, kernels run) in one step, by ``torch.profiler`` (None: unknown)."""
        if not self.cuda or self.torch is None:
            return None, None
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            self.sync()
        calls = kernels = 0
        for e in prof.events():
            if e.name in LAUNCH_CALLS:
                calls += 1
            elif str(getattr(e, "device_type", "")).endswith("CUDA"):
                kernels += 1
        return calls, kernels

    def reset_memory(self) -> None:
        gc.collect()
        if self.cuda:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
            if self.torch is not None:
                self.torch.cuda.empty_cache()
                self.torch.cuda.reset_peak_memory_stats()

    def mib(self, framework: str) -> float | None:
        if not self.cuda:
            return None
        if framework == "torch":
            return self.torch.cuda.max_memory_allocated() / 2**20
        import cupy

        return cupy.get_default_memory_pool().used_bytes() / 2**20


# --- the runners ---------------------------------------------------------------------------------


class TorchRow:
    """PyTorch's step of the workload's model (``benchmarks.models``), as ``mode`` says."""

    def __init__(self, fx: Any, mode: str, device: str) -> None:
        import torch

        from benchmarks.models import torch_loss, torch_model, torch_optimizer

        if mode not in TORCH_MODES:
            raise ValueError(f"unknown PyTorch mode {mode!r}: expected one of {TORCH_MODES}")
        w = fx.workload
        dev = torch.device(device)
        self.torch, self.fx, self.device = torch, fx, device
        self.model = torch_model(w, fx.weights).to(dev)
        self.opt = torch_optimizer(w, self.model.parameters())
        self.xs = torch.from_numpy(fx.x).to(dev)
        self.ys = torch.from_numpy(fx.labels).to(dev)

        def loss_fn(x: Any, y: Any) -> Any:
            return torch_loss(w, self.model(x), y)

        self.autocast = mode == "autocast-bf16"
        self.loss_fn = (torch.compile(loss_fn, mode="reduce-overhead") if mode == "compile-ro"
                        else loss_fn)
        self._loss: Any = None

    def step(self, i: int) -> None:
        k = i % self.fx.workload.n_batches
        self.opt.zero_grad(set_to_none=True)
        if self.autocast:
            with self.torch.autocast(self.device, dtype=self.torch.bfloat16):
                loss = self.loss_fn(self.xs[k], self.ys[k])
        else:
            loss = self.loss_fn(self.xs[k], self.ys[k])
        loss.backward()
        self.opt.step()
        self._loss = loss

    def loss(self) -> float:
        return float(self._loss.float().item())


def _runner(fx: Any, r: Row, device: str) -> Any:
    if r.framework == "torch":
        return TorchRow(fx, r.variant, device)
    from benchmarks.runners import make_runner

    runner = make_runner(fx, "ocannl", r.variant, device)
    runner.build()
    return runner


def run_row(fx: Any, r: Row, dev: Device, *, warmup: int, chunks: int,
            chunk_s: float = 0.25) -> None:
    """Fill ``r``'s figures: warm-up steps, then ``chunks`` chunks of steps."""
    dev.reset_memory()
    runner = _runner(fx, r, "cuda" if dev.cuda else "cpu")
    runner.step(0)
    dev.sync()
    r.loss1 = runner.loss()
    i = 1
    for _ in range(warmup):
        runner.step(i)
        i += 1
    dev.sync()
    t = time.perf_counter()
    runner.step(i)
    i += 1
    dev.sync()
    one = time.perf_counter() - t
    n = max(1, min(20, int(chunk_s / max(one, 1e-6))))
    walls = []
    for _ in range(chunks):
        t = time.perf_counter()
        for _ in range(n):
            runner.step(i)
            i += 1
        dev.sync()
        walls.append(time.perf_counter() - t)
    r.chunks = per_step(walls, n)
    r.wall_ms = median_ms(r.chunks)
    if dev.cuda:
        spans = []
        for _ in range(5):
            spans.append(dev.span_ms(partial(runner.step, i)))
            i += 1
        r.gpu_ms = statistics.median(spans)
        r.launches, r.kernels = dev.count_launches(partial(runner.step, i))
        i += 1
    r.mib = dev.mib(r.framework)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                    default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--budget-s", type=float, default=85.0,
                    help="no row starts after this many seconds")
    ap.add_argument("--chunks", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fixtures", type=Path, default=None,
                    help="the fixtures' folder (default: benchmarks/fixtures)")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU: checks the script, times nothing of the GPU")
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.warmup < 0 or args.budget_s <= 0:
        ap.error(f"--chunks must be >= 1, --warmup >= 0, --budget-s > 0; got {args.chunks}, "
                 f"{args.warmup}, {args.budget_s}")
    if not args.dry_run:
        from ocannl.backends.cuda.runtime import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            print(f"error: no GPU is usable, nothing to time: {reason} (--dry-run runs the "
                  f"script on the CPU)", file=sys.stderr)
            return 2
    from benchmarks.fixtures import FIXTURE_DIR, load

    t0 = time.perf_counter()
    dev = Device(cuda=not args.dry_run)
    # benchmarks/fixtures/ when it is there (carried to a machine without scikit-learn, which
    # the convnet's digits come from), else generated from the specs and written there
    fixtures = {}
    for w in args.workloads:
        try:
            fixtures[w] = load(WORKLOADS[w], args.fixtures or FIXTURE_DIR)
        except Exception as err:  # noqa: BLE001 - its rows say why; the others run
            print(f"{w}: no fixture: {type(err).__name__}: {err}", flush=True)
    rows = row_order(args.workloads, args.dry_run)
    failed = 0
    for r in rows:
        if r.note:
            continue
        if r.framework == "torch" and dev.torch is None:
            r.note = "PyTorch is not installed"
            failed = 1
            continue
        if r.workload not in fixtures:
            r.note = "failed: no fixture (see above)"
            failed = 1
            continue
        if time.perf_counter() - t0 > args.budget_s:
            r.note = f"not run: the {args.budget_s:.0f} s budget is spent"
            continue
        t = time.perf_counter()
        try:
            run_row(fixtures[r.workload], r, dev, warmup=args.warmup + (
                2 if r.variant == "compile-ro" else 0), chunks=args.chunks)
        except Exception as err:  # noqa: BLE001 - a row that fails says why; the others run
            r.note = f"failed: {type(err).__name__}: {str(err)[:160]}"
            failed = 1
        print(f"{r.workload} {r.framework} {r.variant}: wall {_fmt(r.wall_ms, '.3f')} ms, gpu "
              f"{_fmt(r.gpu_ms, '.3f')} ms ({time.perf_counter() - t:.1f} s) {r.note}",
              flush=True)
    print()
    if args.dry_run:
        print("DRY RUN on the CPU: these are not GPU timings")
    print(table(rows))
    skipped = [r for r in rows if r.note.startswith("not run")]
    print(f"\n{len(rows) - len(skipped)} of {len(rows)} rows run in "
          f"{time.perf_counter() - t0:.0f} s" + (f"; {len(skipped)} not run (budget)"
                                                 if skipped else ""))
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
