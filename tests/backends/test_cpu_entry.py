"""Bound routines as builtin functions (``ocannl.backends.cpu.entry``): they run the routine
on their own buffers, keep those alive, and let other Python threads run meanwhile."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ocannl import Context
from ocannl.backends.cpu import jit
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode


def test_a_bound_routine_is_a_builtin_that_runs_on_its_buffers() -> None:
    a, b, c = (Tnode(name, (8, 8), Precision.f64) for name in "abc")
    comp = Comp((Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))),
                       (8, 8, 8), reset=True),))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 8)), rng.standard_normal((8, 8))
    ctx = Context.cpu().set_values(a, x).set_values(b, y)
    ctx, routine = ctx.compile(comp)
    assert type(routine.call).__name__ == "builtin_function_or_method"
    assert routine.call() is None
    ctx = ctx.run(routine)  # what the context knows as written: c (a bare call is not counted)
    np.testing.assert_allclose(ctx.get_values(c), x @ y, rtol=1e-12)
    # The buffers live as long as the builtin, whoever else lets go of them.
    call = routine.call
    del ctx, routine
    gc.collect()
    call()
    call()


# A core of its own for the stamping thread: another test beside it would take that core and
# leave gaps in the stamps that are the scheduler's, not the GIL's.
@pytest.mark.whole_machine
def test_other_python_threads_run_while_a_routine_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GIL is released around the compiled code, as ctypes released it: a thread stamping
    the time in Python keeps stamping during one long call. A builtin holding the GIL would
    leave a gap in its stamps as long as the call. (The routine runs on one thread, leaving
    a core to the stamping one.)"""
    monkeypatch.setattr(jit, "threads", lambda: 1)
    n = 640  # sum_k (a[i, k] + b[k, j]): loops, not BLAS; about 0.1 s
    a, b, c = (Tnode(name, (n, n), Precision.f64) for name in "abc")
    comp = Comp((Accum(c, (0, 1), "+", apply("add", Get(a, (0, 2)), Get(b, (2, 1))),
                       (n, n, n), reset=True),))
    ctx = Context.cpu().set_values(a, np.ones((n, n))).set_values(b, np.ones((n, n)))
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    stamper = threading.Thread(target=stamp)
    stamper.start()
    try:
        time.sleep(0.02)
        t0 = time.perf_counter()
        routine.call()
        t1 = time.perf_counter()
        time.sleep(0.02)
    finally:
        stop.set()
        stamper.join()
    np.testing.assert_array_equal(ctx.get_values(c), np.full((n, n), 2.0 * n))
    inside = [t for t in stamps if t0 <= t <= t1]
    gaps = np.diff([t0, *inside, t1])
    assert gaps.max() < 0.5 * (t1 - t0), (
        f"no stamp for {gaps.max():.3f} s of a {t1 - t0:.3f} s call ({len(inside)} stamps)")


# A fresh interpreter: the program, in the order interpreter exit runs it. A routine and its
# context refer to each other, so a program's routines are freed by the last garbage
# collection, after every module's dict was cleared (the entry module's ``_methods`` among
# them). Here the dict is cleared first; the freed blocks are reused by floats whose payload,
# where a method record keeps its flags, has the METH_METHOD bit set; then the builtin goes.
_EXIT_ORDER = """
import gc, struct, sys
import numpy as np
from ocannl import Context
from ocannl.backends.cpu import entry
from ocannl.ir.assignments import Accum, Comp, Get
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

a, b = Tnode("a", (4,), Precision.f32), Tnode("b", (4,), Precision.f32)
ctx = Context.cpu().set_values(a, np.ones(4, np.float32))
ctx, routine = ctx.compile(Comp((Accum(b, (0,), "=", Get(a, (0,)), (4,)),)))
ctx = ctx.run(routine)
call = routine.call
del ctx, routine
gc.collect()
entry._methods.clear()
flags = struct.unpack("d", struct.pack("Q", 0x3FE000000000FFFF))[0]
reused = [flags * 1.0 + 0.0 * i for i in range(100_000)]
del call
print("exited cleanly")
"""


def test_a_builtin_outliving_the_entry_module_dict_is_freed_cleanly() -> None:
    """The method record every bound routine reads when it is freed is never freed itself:
    a program holding a routine to its last line must not crash at exit after its output
    (the README's mixed-precision snippet once did, exit -11, in CI)."""
    done = subprocess.run([sys.executable, "-c", _EXIT_ORDER], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.strip() == "exited cleanly"
