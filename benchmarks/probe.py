"""Compile time and peak memory of one row, measured in a fresh process.

``python -m benchmarks.probe WORKLOAD FRAMEWORK VARIANT DEVICE STEPS`` builds the row's step
(the compile time: graph construction, lowering and compilation, or torch.compile's first
call), trains STEPS steps, and prints one JSON line. A one-unit model runs first, so the
libraries' per-process set-up is timed apart from the step's compile (``setup_s``). The
caller chooses the on-disk caches (``OCANNL_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``): a
fresh folder for a cold compile, the same folder again for a warm one.

Peak memory is the process's peak resident set while training, over what it held before
building (after its imports, the fixture's loading and the one-unit warm-up): buffers,
activations and what the compiler left resident, not the compiler's transient peak.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak() -> float:
    """Reset the peak resident set to the current one (Linux: ``clear_refs`` 5); the current
    resident set in MiB. Elsewhere, the peak so far."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        rss = _status_kib("VmRSS")
        if rss is not None:
            return rss / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_rss_mib() -> float:
    hwm = _status_kib("VmHWM")
    return hwm / 1024.0 if hwm is not None else (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


def warm_libraries(framework: str) -> None:
    """Run a one-unit model once, so the libraries' lazy set-up (LLVM's target and JIT,
    torch's autograd and optimizer) is not counted as the workload's compile time or memory."""
    if framework == "torch":
        import torch

        lin = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        lin(torch.ones(1, 1)).sum().backward()
        opt.step()
        return
    if framework in ("jax", "tinygrad"):  # their import, not their compile (done in build)
        __import__(framework)
        return
    import ocannl.tensor as T
    from ocannl import Context, train

    x = T.term(np.ones((1, 1), np.float32), label="warm_x")
    w = T.param("warm_w", output_dims=[1])
    loss = T.sum(w @ x)
    ctx = train.init_params(Context.cpu(), loss)
    ctx, routine = ctx.compile(train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.1))
    ctx.run(routine)


def probe(workload: str, framework: str, variant: str, device: str, steps: int) -> dict:
    """Build and train one row in this process; the measurements as a dict."""
    if framework == "torch":
        import torch  # noqa: F401
    from benchmarks.fixtures import load
    from benchmarks.runners import Unavailable, make_runner
    from benchmarks.specs import WORKLOADS

    fx = load(WORKLOADS[workload])
    t0 = time.perf_counter()
    warm_libraries(framework)
    setup_s = time.perf_counter() - t0
    runner = make_runner(fx, framework, variant, device)
    base = reset_peak()
    t0 = time.perf_counter()
    try:
        runner.build()
    except Unavailable as err:
        return {"status": "skipped", "note": str(err)}
    compile_s = time.perf_counter() - t0
    reset_peak()  # the compiler's transient peak is not the training's
    for i in range(steps):
        runner.step(i)
    runner.sync()
    return {"status": "ok", "compile_s": compile_s, "setup_s": setup_s,
            "peak_rss_mib": peak_rss_mib() - base, "mem_bytes": runner.mem_bytes()}


def run_probe(workload: str, framework: str, variant: str, device: str, steps: int,
              cache: Path, timeout: float = 300.0) -> dict:
    """Run ``probe`` in a fresh Python process with its caches under ``cache``."""
    env = dict(os.environ)
    env["OCANNL_CACHE_DIR"] = str(cache / "ocannl")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    cmd = [sys.executable, "-m", "benchmarks.probe", workload, framework, variant, device,
           str(steps)]
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"probe timed out after {timeout:.0f} s"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"status": "error", "note": f"probe exit {done.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def main(argv: list[str]) -> None:
    workload, framework, variant, device, steps = argv
    print(json.dumps(probe(workload, framework, variant, device, int(steps))))


if __name__ == "__main__":
    main(sys.argv[1:])
