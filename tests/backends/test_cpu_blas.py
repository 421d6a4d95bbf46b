"""Which BLAS the CPU routines call (``ocannl/backends/cpu/blas.py``): each library computes the
products, the default follows the CPU, and a BLAS asked for that is not there is refused."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from cpus import SAPPHIRE_RAPIDS as INTEL_CPU
from cpus import ZEN3 as AMD_CPU

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
def test_the_default_is_mkl_on_intel_cpus_and_openblas_elsewhere():
    chosen = blas.choose("", INTEL_CPU)
    assert chosen.name == "mkl" and chosen.int_bits == 32
    assert blas.choose("", AMD_CPU).name == "numpy"


ISOLATION = """
import ctypes, json, sys
from ocannl.backends.cpu import blas
from ocannl.backends.cpu.host import CpuFacts
INTEL = CpuFacts("x86_64", "GenuineIntel", frozenset())  # the default would take MKL
libc = ctypes.CDLL(None)
libc.dlsym.restype, libc.dlsym.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
names = ("sgemm_", "mkl_blas_sgemm", "mkl_serv_get_max_threads", "MKL_Set_Num_Threads")
if sys.argv[1] == "another":  # an MKL loaded as libmkl_rt loads it: its parts global
    import glob
    path = sorted(glob.glob(sys.prefix + "/lib/libmkl_rt.so*"))[-1]
    other = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    other.MKL_Get_Max_Threads()
try:
    chosen = blas.choose("mkl", INTEL).name
except ValueError as err:
    chosen = str(err)
print(json.dumps({"chosen": chosen, "global": [n for n in names if libc.dlsym(None, n.encode())],
                  "default": blas.choose("", INTEL).name}))
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
    assert got["default"] == "numpy"


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
        blas.choose("openblas", AMD_CPU)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # an environment without the wheel
    with pytest.raises(ValueError, match=f"OCANNL_BLAS='mkl': no usable libmkl_intel_lp64, "
                                         f"libmkl_sequential and libmkl_core under "
                                         f"{tmp_path / 'lib'}"):
        blas.choose("mkl", AMD_CPU)
    # the default falls back, and says so
    monkeypatch.setattr(blas, "_warned", set())
    with pytest.warns(RuntimeWarning) as said:
        assert blas.choose("", INTEL_CPU).name == "numpy"
    assert len(said) == 1
    assert str(said[0].message) == (
        f"ocannl: MKL refused on this Intel CPU (no usable libmkl_intel_lp64, "
        f"libmkl_sequential and libmkl_core under {tmp_path / 'lib'} (pip install mkl)); the "
        f"products call NumPy's OpenBLAS ({blas.numpy_openblas().path}) instead")


def test_the_default_says_nothing_where_it_does_not_fall_back(monkeypatch):
    """Not an Intel CPU: NumPy's OpenBLAS is the choice itself, not a fallback."""
    import warnings

    monkeypatch.setattr(blas, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blas.choose("", AMD_CPU).name == "numpy"


def test_a_fallback_is_said_once_per_process(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(blas, "_warned", set())
    with pytest.warns(RuntimeWarning, match="MKL refused"):
        blas.choose("", INTEL_CPU)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert blas.choose("", INTEL_CPU).name == "numpy"


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_mkl_refused_by_the_loader_is_said_and_named(monkeypatch):
    """The loader refusing the group (as it does a ``memfd`` that may not be mapped
    executable): the real loader, given a stub that is not a shared object, refuses it; the
    default says why and serves NumPy's OpenBLAS, and ``OCANNL_BLAS=mkl`` raises with it."""
    from ocannl.backends.cpu import link_group

    monkeypatch.setattr(link_group, "needing", lambda needed, soname: b"not an ELF object")
    monkeypatch.setattr(blas, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"MKL refused on this Intel CPU \(the loader "
                                            r"refused .*'s MKL libraries as a group: .*\); "
                                            r"the products call NumPy's OpenBLAS"):
        assert blas.choose("", INTEL_CPU).name == "numpy"
    with pytest.raises(ValueError, match="OCANNL_BLAS='mkl': the loader refused"):
        blas.choose("mkl", INTEL_CPU)


def test_mkl_where_no_private_group_can_be_loaded_is_said(monkeypatch):
    from ocannl.backends.cpu import link_group

    monkeypatch.setattr(link_group, "supported", lambda: False)
    monkeypatch.setattr(blas, "_warned", set())
    with pytest.warns(RuntimeWarning, match="loading MKL as a private group needs Linux on "
                                            "x86-64 with memfd_create"):
        assert blas.choose("", INTEL_CPU).name == "numpy"


@pytest.mark.skipif(not MKL_WHEEL, reason="the mkl wheel is built for x86-64 Linux only")
def test_mkl_refused_where_another_mkl_is_global_is_said():
    """In a process where another MKL is global (loaded as ``libmkl_rt`` loads it), the
    default on an Intel CPU warns once, naming the reason and NumPy's OpenBLAS."""
    code = ISOLATION.replace('"default": blas.choose("", INTEL).name', '"default": default') \
        .replace("try:\n    chosen", "import warnings\n"
                 "with warnings.catch_warnings(record=True) as said:\n"
                 "    warnings.simplefilter('always')\n    default = blas.choose('', INTEL).name\n"
                 "print(json.dumps([str(w.message) for w in said]))\ntry:\n    chosen")
    done = subprocess.run([sys.executable, "-c", code, "another"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    said, got = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert got["default"] == "numpy"
    assert len(said) == 1 and said[0].startswith(
        "ocannl: MKL refused on this Intel CPU (another MKL's symbols are global in this "
        "process); the products call NumPy's OpenBLAS (")


def test_openblas_names_and_integer_width_are_read_from_the_library():
    """The process's OpenBLAS builds as ``threadpoolctl`` lists them: NumPy's (ILP64,
    ``scipy_sgemm_64_``) and SciPy's own (LP64, ``scipy_sgemm_``), each found under its
    build's names, its width from its configuration, and each computing a product through
    the addresses found, with integers of that width."""
    import ctypes

    import numpy as np
    import scipy.linalg  # noqa: F401 - loads SciPy's own OpenBLAS
    from threadpoolctl import threadpool_info

    paths = [i["filepath"] for i in threadpool_info() if i["internal_api"] == "openblas"]
    widths = {}
    for path in paths:
        found = blas.openblas(path)
        assert isinstance(found, blas.Blas), found
        widths[Path(path).name] = found.int_bits
        n = ctypes.c_int64 if found.int_bits == 64 else ctypes.c_int32
        a = np.arange(6, dtype=np.float32).reshape(2, 3)
        b = np.arange(12, dtype=np.float32).reshape(3, 4)
        c = np.zeros((2, 4), np.float32)
        sgemm = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 13)(found.sgemm)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        trans = ctypes.c_char(b"N")
        m, k, cols = n(4), n(3), n(2)  # column-major: C^T = B^T A^T
        ref = ctypes.byref
        sgemm(ref(trans), ref(trans), ref(m), ref(cols), ref(k), ref(one),
              b.ctypes.data, ref(m), a.ctypes.data, ref(k), ref(zero), c.ctypes.data, ref(m))
        np.testing.assert_array_equal(c, a @ b)
    assert blas.numpy_openblas().int_bits == 64
    assert sorted(widths.values()) == sorted(
        64 if "openblas64" in name else 32 for name in widths), widths
    assert 32 in widths.values() and 64 in widths.values(), widths


def test_no_openblas_in_numpy_falls_back_to_scipy_and_says_so(monkeypatch):
    """NumPy linked to no OpenBLAS (the wheel's absence, through the module's own seam): the
    default warns once, naming why and SciPy's BLAS; asked for, NumPy's is refused, named."""
    why = "NumPy loaded no OpenBLAS (threadpoolctl lists no OpenBLAS in this process)"
    monkeypatch.setattr(blas, "numpy_openblas", lambda: why)
    monkeypatch.setattr(blas, "_warned", set())
    with pytest.warns(RuntimeWarning) as said:
        assert blas.choose("", AMD_CPU).name == "scipy"
    assert [str(w.message) for w in said] == [
        f"ocannl: {why}; the products call SciPy's BLAS instead, whose thread count cannot be "
        "set (its own threads share each product)"]
    with pytest.raises(ValueError, match=r"OCANNL_BLAS='numpy': NumPy loaded no OpenBLAS"):
        blas.choose("numpy", AMD_CPU)


def test_a_library_that_is_no_openblas_is_refused_with_its_name():
    import ctypes.util

    libm = ctypes.util.find_library("m")
    found = blas.openblas(libm)
    assert isinstance(found, str) and found.startswith(f"the OpenBLAS at {libm} has no sgemm_")
