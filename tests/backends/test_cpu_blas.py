"""Which BLAS the CPU routines call (``ocannl/backends/cpu/blas.py``): each library computes the
products, the default follows the CPU, and a BLAS asked for that is not there is refused."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from ocannl.backends.cpu import blas

# Where the ``mkl`` extra installs the wheel (``pyproject.toml``).
MKL_WHEEL = platform.machine() == "x86_64" and sys.platform == "linux"

PRODUCTS = """
import json, numpy as np
from ocannl import Context
from ocannl.backends.cpu import blas, jit
from ocannl.ir.assignments import Accum, Comp, Get, apply
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode
out = {"name": blas.chosen().name, "bits": jit.target().blas_int}
for prec in (Precision.f32, Precision.f64):
    a, w = Tnode("a", (400, 300), prec), Tnode("w", (200, 300), prec)
    c, d = Tnode("c", (400, 200), prec), Tnode("d", (300, 200), prec)
    comp = Comp((Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(w, (1, 2))),
                       (400, 200, 300)),
                 Accum(d, (0, 1), "+", apply("mul", Get(a, (2, 0)), Get(c, (2, 1))),
                       (300, 200, 400), True)))
    rng = np.random.default_rng(0)
    av, wv = rng.normal(size=(400, 300)), rng.normal(size=(200, 300))
    c0 = rng.normal(size=(400, 200))
    ctx = Context.cpu()
    ctx.set_values(a, av); ctx.set_values(w, wv); ctx.set_values(c, c0)
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    dt = prec.numpy_dtype
    want_c = c0.astype(dt) + av.astype(dt) @ wv.astype(dt).T
    want_d = av.astype(dt).T @ want_c
    out[prec.value] = [float(np.abs(ctx.get_values(c) - want_c).max() / np.abs(want_c).max()),
                       float(np.abs(ctx.get_values(d) - want_d).max() / np.abs(want_d).max())]
print(json.dumps(out))
"""


@pytest.mark.parametrize(("choice", "bits"), [
    pytest.param("mkl", 32, marks=pytest.mark.skipif(
        not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")),
    ("numpy", 64),
    ("scipy", 32),
])
def test_each_blas_computes_the_products(tmp_path, choice, bits):
    """``OCANNL_BLAS=choice``: a plain product and a transposed one accumulated into, f32 and
    f64, large enough to be shared over two threads, go through that library (with its
    integer width) and match NumPy's."""
    env = {**os.environ, "OCANNL_BLAS": choice, "OCANNL_CACHE_DIR": str(tmp_path),
           "OCANNL_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", PRODUCTS], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["name"], got["bits"]) == (choice, bits)
    assert max(got["f32"]) < 1e-5 and max(got["f64"]) < 1e-13, got


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_the_default_is_mkl_on_intel_cpus_and_openblas_elsewhere(monkeypatch):
    monkeypatch.setattr(blas, "intel_cpu", lambda: True)
    chosen = blas._choose("")
    assert chosen.name == "mkl" and chosen.int_bits == 32
    monkeypatch.setattr(blas, "intel_cpu", lambda: False)
    assert blas._choose("").name == "numpy"


ISOLATION = """
import ctypes, json, sys
from ocannl.backends.cpu import blas
libc = ctypes.CDLL(None)
libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
names = ("sgemm_", "mkl_blas_sgemm", "mkl_serv_get_max_threads", "MKL_Set_Num_Threads")
if sys.argv[1] == "another":  # an MKL loaded as libmkl_rt loads it: its parts global
    import glob
    path = sorted(glob.glob(sys.prefix + "/lib/libmkl_rt.so*"))[-1]
    other = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    other.MKL_Get_Max_Threads()
try:
    chosen = blas._choose("mkl").name
except ValueError as err:
    chosen = str(err)
print(json.dumps({"chosen": chosen, "global": [n for n in names if libc.dlsym(None, n.encode())],
                  "default": blas._choose("").name}))
"""


def _isolation(case: str) -> dict:
    done = subprocess.run([sys.executable, "-c", ISOLATION, case], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_mkl_stays_out_of_the_process_global_scope():
    """MKL is loaded as a group of its own: none of its symbols becomes global, so PyTorch's
    MKL (linked into libtorch_cpu, every symbol exported) keeps binding to its own code.
    Through ``libmkl_rt`` they all were, and torch's products ran on our sequential layer."""
    got = _isolation("alone")
    assert got["chosen"] == "mkl" and got["global"] == []


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_mkl_is_refused_where_another_mkl_is_global():
    """Ours would bind to the other's internals (another version, another threading layer):
    asked for, it is refused with a message; by default, NumPy's OpenBLAS serves."""
    got = _isolation("another")
    assert "another MKL's symbols are global in this process" in got["chosen"]
    assert got["default"] in ("numpy", "scipy")


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_mkl_runs_one_thread_a_call():
    """MKL is loaded on its sequential layer: the pool's threads share a product, and MKL's
    own threads (OpenMP's, which spin after each call) never start."""
    import ctypes

    found = blas.mkl()
    assert found is not None and found.threads is not None
    get = ctypes.CFUNCTYPE(ctypes.c_int)(found.threads[0])
    set_ = ctypes.CFUNCTYPE(None, ctypes.c_int)(found.threads[1])
    set_(4)
    assert get() == 1


def test_a_blas_asked_for_that_is_not_there_is_refused(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="OCANNL_BLAS='openblas': expected 'mkl'"):
        blas._choose("openblas")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # an environment without the wheel
    with pytest.raises(ValueError, match=f"OCANNL_BLAS='mkl': no usable libmkl_intel_lp64, "
                                         f"libmkl_sequential and libmkl_core under "
                                         f"{tmp_path / 'lib'}"):
        blas._choose("mkl")
    monkeypatch.setattr(blas, "intel_cpu", lambda: True)  # the default falls back
    assert blas._choose("").name == "numpy"
