"""A short CPU-vs-GPU timing of the benchmark MLPs, for ``scripts/gpu_check.sh``.

Trains each model (relu MLP, softmax cross-entropy, SGD) for a few steps on the CPU
backend and on ``Context.cuda()``, from the same initial weights, and prints per-step wall
times (p10 / p50 / p90 over repeated chunks of steps, each chunk ended by a device sync),
compile times and the loss agreement. Not the benchmark suite: a smoke-level comparison that
says whether the GPU path is sane and worth it. ``--f16`` adds the fused gated f16 step
(cast twins of f32 master weights, on-device checksum), whose cost relative to f32 shows
whether the checksum reduction is parallel.

Backends (``--backends``, default ``cpu,cuda,cuda-nofma``): ``cuda-nofma`` is the CUDA backend
compiled with ``--fmad=false`` (no multiply-add contraction), so the run also measures what
that option costs. A CUDA backend asked for and not usable is an error (exit status 2, with the
reason): the script never times the CPU alone in place of the GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ocannl.tensor as T  # noqa: E402
from ocannl import Context, datasets, train  # noqa: E402
from ocannl.backends.cuda.runtime import CupyCudaBackend  # noqa: E402
from ocannl.ir.assignments import Comp, Get, apply  # noqa: E402
from ocannl.nn_blocks import softmax_cross_entropy  # noqa: E402
from ocannl.tensor.tensor import Tensor  # noqa: E402

MODELS = [("mlp 2-64-64-2 b32", (2, 64, 64, 2), 32),
          ("mlp 256-1024-1024-10 b256", (256, 1024, 1024, 10), 256)]


@dataclass
class Model:
    loss: Tensor
    step: Comp


def build(dims: tuple[int, ...], batch: int, prec: str) -> Model:
    """The benchmark MLP; ``prec`` other than f32 reads f32 master weights through casts and
    gates the step on the gradient checksum."""
    T.set_seed(0)
    if dims[0] == 2:
        xs, labels = datasets.half_moons(batch, seed=0)
    else:
        xs, labels = datasets.gaussian_classes(batch, dims[0], dims[-1], seed=0)
    x = T.term(xs, label="x", prec=prec)
    y = T.term(np.eye(dims[-1])[labels % dims[-1]], label="y", prec=prec)
    h: Tensor = x
    for k in range(1, len(dims)):
        w = T.param(f"w{k}", output_dims=[dims[k]], input_dims=[dims[k - 1]])
        b = T.param(f"b{k}", output_dims=[dims[k]], input_dims=(), init="zeros")
        if prec != "f32":
            w, b = T.cast(w, prec), T.cast(b, prec)
        h = w @ h + b
        if k < len(dims) - 1:
            h = T.relu(h)
    loss = softmax_cross_entropy(h, y)
    if prec == "f32":
        step = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.01)
    else:
        flag, checksum = train.grad_checksum(loss)
        gate = apply("isfinite", Get(flag.value, ()))
        step = train.grad_update(loss) + checksum + train.sgd_update(
            loss, learning_rate=0.01, gate=gate)
    return Model(loss, step)


def time_backend(ctx: Context, m: Model, chunks: int, per_chunk: int) -> dict[str, object]:
    ctx = train.init_params(ctx, m.loss)
    t0 = time.perf_counter()
    ctx, routine = ctx.compile(m.step)
    ctx.run(routine)
    first_loss = ctx.get_value(m.loss)  # the first run includes any lazy loading
    compile_s = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(3):
        ctx.run(routine)
    ctx.get_value(m.loss)
    # Chunks of about a quarter second at most, so slow CPU runs stay short.
    per_chunk = max(1, min(per_chunk, int(0.25 / ((time.perf_counter() - t) / 3))))
    per_step = []
    for _ in range(chunks):
        t = time.perf_counter()
        for _ in range(per_chunk):
            ctx.run(routine)
        ctx.get_value(m.loss)  # a read waits for the device
        per_step.append((time.perf_counter() - t) / per_chunk)
    p10, p50, p90 = np.percentile(per_step, [10, 50, 90]) * 1e3
    return {"compile_s": compile_s, "p10": p10, "p50": p50, "p90": p90, "loss0": first_loss}


BACKENDS = {"cpu": Context.cpu, "cuda": Context.cuda,
            "cuda-nofma": lambda: Context(CupyCudaBackend(fmad=False))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=7)
    ap.add_argument("--per-chunk", type=int, default=20)
    ap.add_argument("--f16", action="store_true", help="also time the fused gated f16 step")
    ap.add_argument("--backends", default="cpu,cuda,cuda-nofma",
                    help="comma-separated, of: " + ", ".join(BACKENDS))
    args = ap.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        ap.error(f"--backends: unknown {unknown}, expected some of {list(BACKENDS)}")
    if any(b.startswith("cuda") for b in backends):
        try:
            Context.cuda()
        except Exception as err:  # noqa: BLE001 - any reason: no timing without the GPU
            print(f"error: CUDA was asked for (--backends {args.backends}) and no GPU is "
                  f"usable: {err}", file=sys.stderr)
            return 2
    precs = ["f32", "f16"] if args.f16 else ["f32"]
    print(f"{'model':28} {'prec':5} {'backend':10} {'compile s':>9} {'p10 ms':>8} "
          f"{'p50 ms':>8} {'p90 ms':>8} {'first loss':>11}")
    for name, dims, batch in MODELS:
        for prec in precs:
            rows = {}
            for b in backends:
                r = time_backend(BACKENDS[b](), build(dims, batch, prec), args.chunks,
                                 args.per_chunk)
                rows[b] = r
                print(f"{name:28} {prec:5} {b:10} {r['compile_s']:9.2f} {r['p10']:8.3f} "
                      f"{r['p50']:8.3f} {r['p90']:8.3f} {r['loss0']:11.6f}", flush=True)
            if "cpu" in rows and "cuda" in rows:
                speed = rows["cpu"]["p50"] / rows["cuda"]["p50"]
                rel = abs(rows["cpu"]["loss0"] - rows["cuda"]["loss0"]) / abs(rows["cpu"]["loss0"])
                print(f"  -> GPU speed-up (p50) {speed:.2f}x; first-loss relative difference "
                      f"{rel:.2e}", flush=True)
            if "cuda" in rows and "cuda-nofma" in rows:
                cost = rows["cuda-nofma"]["p50"] / rows["cuda"]["p50"] - 1
                print(f"  -> --fmad=false costs {100 * cost:+.1f}% per step (p50)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
