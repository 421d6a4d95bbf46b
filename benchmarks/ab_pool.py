"""The thread pool that shares a routine's large loops (``ocannl/backends/cpu/pool.py``, LLVM IR)
against libgomp's ``GOMP_parallel`` with a dynamic schedule, on the same routines in one process.

    .venv/bin/python benchmarks/ab_pool.py [--rounds 30] [--steps 10] [--threads 2]

Before the JIT starts, the pool's module is replaced by one holding both: the pool as it is
(its functions renamed ``*_home``), a ``GOMP_parallel`` variant, and an ``ocannl_pool_run``
that calls one or the other as a global flag says. The variant claims the same chunks the
pool does (``per_thread`` a thread, chunk ``c`` covering ``[extent*c/n, extent*(c+1)/n)``)
through ``GOMP_loop_dynamic_start``/``_next`` with a chunk of one, so both compute the same
cells in the same order: the losses are compared bit for bit. Every workload's step
(``--variants``, f32 by default) is built once; then per round each side runs ``--steps``
steps, timed one by one after one untimed step, the side going first alternating by round.
Printed per workload and variant: each side's p50 step, the p50 of the rounds' ratios (gomp /
pool: under 1 means libgomp wins) and its spread (p10-p90). ``--gomp-spincount`` sets
libgomp's ``GOMP_SPINCOUNT`` (how long its idle threads spin before sleeping; the pool spins
about 40 us).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKLOADS = ("mlp_small", "mlp_wide", "convnet", "gpt_mini")
FLAG = "ocannl_pool_use_gomp"

# ``void ocannl_pool_run_gomp(job, frame, extent, per_thread)``: the same chunks as the pool,
# claimed through libgomp's dynamic schedule by a team of ``gomp_size + 1`` threads.
_GOMP_IR = """
@{flag} = global i32 0
@gomp_size = internal global i32 0
declare void @GOMP_parallel(void (i8*)*, i8*, i32, i32)
declare i8 @GOMP_loop_dynamic_start(i64, i64, i64, i64, i64*, i64*)
declare i8 @GOMP_loop_dynamic_next(i64*, i64*)
declare void @GOMP_loop_end_nowait()

define internal void @gomp_body(i8* %d) {{
entry:
  %f = bitcast i8* %d to i64*
  %job_w = load i64, i64* %f
  %p1 = getelementptr i64, i64* %f, i64 1
  %frame_w = load i64, i64* %p1
  %p2 = getelementptr i64, i64* %f, i64 2
  %extent = load i64, i64* %p2
  %p3 = getelementptr i64, i64* %f, i64 3
  %chunks = load i64, i64* %p3
  %job = inttoptr i64 %job_w to void (i8*, i64, i64)*
  %frame = inttoptr i64 %frame_w to i8*
  %s = alloca i64
  %e = alloca i64
  %ok0 = call i8 @GOMP_loop_dynamic_start(i64 0, i64 %chunks, i64 1, i64 1, i64* %s, i64* %e)
  br label %test
test:
  %ok = phi i8 [%ok0, %entry], [%ok1, %next]
  %has = icmp ne i8 %ok, 0
  br i1 %has, label %range, label %out
range:
  %first = load i64, i64* %s
  %last = load i64, i64* %e
  br label %loop
loop:
  %c = phi i64 [%first, %range], [%c1, %loop]
  %a = mul i64 %extent, %c
  %lo = udiv i64 %a, %chunks
  %c1 = add i64 %c, 1
  %b = mul i64 %extent, %c1
  %hi = udiv i64 %b, %chunks
  call void %job(i8* %frame, i64 %lo, i64 %hi)
  %more = icmp ult i64 %c1, %last
  br i1 %more, label %loop, label %next
next:
  %ok1 = call i8 @GOMP_loop_dynamic_next(i64* %s, i64* %e)
  br label %test
out:
  call void @GOMP_loop_end_nowait()
  ret void
}}

define void @ocannl_pool_run_gomp(void (i8*, i64, i64)* %job, i8* %frame, i64 %extent,
                                  i64 %per_thread) {{
  %n = load i32, i32* @gomp_size
  %t = add i32 %n, 1
  %t64 = zext i32 %t to i64
  %want = mul i64 %t64, %per_thread
  %fewer = icmp ult i64 %extent, %want
  %chunks = select i1 %fewer, i64 %extent, i64 %want
  %d = alloca [4 x i64]
  %f = bitcast [4 x i64]* %d to i64*
  %job_w = ptrtoint void (i8*, i64, i64)* %job to i64
  store i64 %job_w, i64* %f
  %p1 = getelementptr i64, i64* %f, i64 1
  %frame_w = ptrtoint i8* %frame to i64
  store i64 %frame_w, i64* %p1
  %p2 = getelementptr i64, i64* %f, i64 2
  store i64 %extent, i64* %p2
  %p3 = getelementptr i64, i64* %f, i64 3
  store i64 %chunks, i64* %p3
  %dp = bitcast i64* %f to i8*
  call void @GOMP_parallel(void (i8*)* @gomp_body, i8* %dp, i32 %t, i32 0)
  ret void
}}

define void @ocannl_pool_run(void (i8*, i64, i64)* %job, i8* %frame, i64 %extent,
                             i64 %per_thread) {{
  %use = load volatile i32, i32* @{flag}
  %gomp = icmp ne i32 %use, 0
  br i1 %gomp, label %g, label %h
g:
  call void @ocannl_pool_run_gomp(void (i8*, i64, i64)* %job, i8* %frame, i64 %extent,
                                  i64 %per_thread)
  ret void
h:
  call void @ocannl_pool_run_home(void (i8*, i64, i64)* %job, i8* %frame, i64 %extent,
                                  i64 %per_thread)
  ret void
}}

define void @ocannl_pool_size(i32 %workers) {{
  store i32 %workers, i32* @gomp_size
  call void @ocannl_pool_size_home(i32 %workers)
  ret void
}}
"""


def install_both() -> ctypes.c_int32:
    """Replace the pool's module by both implementations and a switch; the switch's flag
    (0: the pool, 1: libgomp), valid once the JIT has started."""
    import llvmlite.binding as llvm

    from ocannl.backends.cpu import jit, pool

    name = ctypes.util.find_library("gomp")
    if name is None:
        raise SystemExit("no libgomp here (ctypes.util.find_library('gomp')): nothing to compare")
    gomp = ctypes.CDLL(name)
    for symbol in ("GOMP_parallel", "GOMP_loop_dynamic_start", "GOMP_loop_dynamic_next",
                   "GOMP_loop_end_nowait"):
        llvm.add_symbol(symbol, ctypes.cast(getattr(gomp, symbol), ctypes.c_void_p).value)
    home = pool.module_ir()

    def both() -> str:
        text = home.replace(f'"{pool.RUN_SYMBOL}"', f'"{pool.RUN_SYMBOL}_home"')
        text = text.replace(f'"{pool.SIZE_SYMBOL}"', f'"{pool.SIZE_SYMBOL}_home"')
        return text + _GOMP_IR.format(flag=FLAG)

    pool.module_ir = both
    jit.target()  # starts the JIT with both
    engine, _ = jit._setup()
    address = engine.get_global_value_address(FLAG)
    return ctypes.c_int32.from_address(address)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=["f32"])
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--gomp-spincount", help="GOMP_SPINCOUNT for libgomp's idle threads "
                    "(default: libgomp's own)")
    args = ap.parse_args(argv)
    os.environ["OCANNL_THREADS"] = str(args.threads)
    if args.gomp_spincount is not None:  # read by libgomp when it is loaded
        os.environ["GOMP_SPINCOUNT"] = args.gomp_spincount
    flag = install_both()

    from benchmarks.fixtures import load
    from benchmarks.runners import make_runner
    from benchmarks.specs import WORKLOADS as SPECS
    from ocannl.backends.cpu import jit

    print(f"threads {jit.target().threads}, libgomp {ctypes.util.find_library('gomp')} "
          f"(GOMP_SPINCOUNT {os.environ.get('GOMP_SPINCOUNT', 'unset')}), "
          f"{args.rounds} rounds x {args.steps} steps a side", flush=True)
    for workload in args.workloads:
        for variant in args.variants:
            runner = make_runner(load(SPECS[workload]), "ocannl", variant, "cpu")
            losses = {}
            for side in (0, 1):  # the same steps from the same weights would differ in bits
                flag.value = side  # only if the chunks computed differently
                runner.build()
                for i in range(3):
                    runner.step(i)
                losses[side] = runner.loss()
            same = losses[0] == losses[1] or (losses[0] != losses[0] and losses[1] != losses[1])
            times: dict[int, list[float]] = {0: [], 1: []}
            ratios = []
            step = 0
            for r in range(args.rounds):
                median = {}
                for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                    flag.value = side
                    runner.step(step)  # untimed: the other side's threads settle
                    step += 1
                    spent = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        runner.step(step)
                        spent.append(time.perf_counter() - t0)
                        step += 1
                    times[side] += spent
                    median[side] = statistics.median(spent)
                ratios.append(median[1] / median[0])
            flag.value = 0
            ratios.sort()
            p10, p90 = ratios[len(ratios) // 10], ratios[(len(ratios) * 9) // 10]
            pool_p50, gomp_p50 = (statistics.median(times[s]) * 1e3 for s in (0, 1))
            print(f"{workload} {variant}: pool p50 {pool_p50:.3f} ms, gomp p50 {gomp_p50:.3f} ms;"
                  f" gomp/pool by round p50 {statistics.median(ratios):.3f} "
                  f"(p10 {p10:.3f}, p90 {p90:.3f}); losses after 3 steps "
                  f"{'bit-identical' if same else 'DIFFER'} ({losses[0]!r} vs {losses[1]!r})",
                  flush=True)


if __name__ == "__main__":
    main()
