"""A CPU emulation of CUDA modules, the engine of the stand-in ``cupy`` (:mod:`fake_cupy`).

A module's CUDA source (as the backend hands it to ``cupy.RawModule``) is compiled by g++ as
C++17 against a small prelude that stands in for the CUDA built-ins its kernels use:
``threadIdx`` / ``blockIdx`` / ``blockDim`` / ``gridDim``, ``__syncthreads`` (a barrier over
the block's threads, which run as fibers), ``__shfl_down_sync`` (an exchange through a
per-warp slot array between two warp barriers), ``__shared__`` (function statics: blocks run
one after another), ``__half`` (via ``_Float16``) and ``__nv_bfloat16`` (bit patterns, round
to nearest even). Kernels with no barrier run their threads one after another without
switching. Arithmetic is the host's: no flush to zero, no FMA contraction.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>

struct ocemu_dim3 { unsigned int x = 0, y = 1, z = 1; };
static ocemu_dim3 threadIdx, blockIdx, blockDim, gridDim;
static double ocemu_slots[32][32];

// Threads of a block that synchronise are fibers (ucontext) of one OS thread, switched
// round-robin at each barrier: every thread of the barrier's scope (the block, or one warp)
// reaches the same barriers in the same order, so when the last one switches back to the
// first, all have arrived.
static ucontext_t ocemu_main_ctx;
static std::vector<ucontext_t> ocemu_fibers;
static std::vector<unsigned int> ocemu_fiber_block;
static std::vector<char> ocemu_stacks;
static int ocemu_nthreads = 0, ocemu_done = 0, ocemu_grid = 0;
static const std::function<void()>* ocemu_body = nullptr;
static const size_t ocemu_stack = 1 << 16;

static void ocemu_switch(int me, int next) {
  swapcontext(&ocemu_fibers[me], &ocemu_fibers[next]);
  threadIdx.x = me;
  blockIdx.x = ocemu_fiber_block[me];
}

#define __global__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static

inline void __syncthreads() {
  const int me = threadIdx.x;
  ocemu_switch(me, (me + 1) % ocemu_nthreads);
}

static void ocemu_warp_sync() {
  const int me = threadIdx.x, base = me & ~31;
  ocemu_switch(me, base + (me - base + 1) % 32);
}

template <class T> T __shfl_down_sync(unsigned, T v, int delta) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  ocemu_slots[w][lane] = (double)v;
  ocemu_warp_sync();
  T r = lane + delta < 32 ? (T)ocemu_slots[w][lane + delta] : v;
  ocemu_warp_sync();
  return r;
}

struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float v) {
  _Float16 f = (_Float16)v; __half h; std::memcpy(&h.x, &f, 2); return h;
}
inline float __bfloat162float(__nv_bfloat16 h) {
  uint32_t u = (uint32_t)h.x << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t u; std::memcpy(&u, &v, 4); __nv_bfloat16 h;
  if (std::isnan(v)) { h.x = 0x7fff; return h; }
  u += 0x7fffu + ((u >> 16) & 1u); h.x = (uint16_t)(u >> 16); return h;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
using std::exp; using std::isfinite; using std::log; using std::max; using std::min;
using std::pow; using std::sqrt; using std::tanh; using std::cos; using std::sin;
using std::floor;

static void ocemu_entry(int t) {
  threadIdx.x = t;
  for (int b = 0; b < ocemu_grid; ++b) {
    ocemu_fiber_block[t] = b;
    blockIdx.x = b;
    (*ocemu_body)();
    __syncthreads();
  }
  ++ocemu_done;
  swapcontext(&ocemu_fibers[t], ocemu_done == ocemu_nthreads
              ? &ocemu_main_ctx : &ocemu_fibers[(t + 1) % ocemu_nthreads]);
}

static void ocemu_run(int grid, int block, bool fibers, const std::function<void()>& body) {
  gridDim.x = grid; blockDim.x = block;
  if (!fibers) {
    for (int b = 0; b < grid; ++b)
      for (int t = 0; t < block; ++t) { blockIdx.x = b; threadIdx.x = t; body(); }
    return;
  }
  ocemu_body = &body; ocemu_grid = grid; ocemu_nthreads = block; ocemu_done = 0;
  ocemu_fibers.assign(block, ucontext_t{});
  ocemu_fiber_block.assign(block, 0);
  ocemu_stacks.resize(block * ocemu_stack);
  for (int t = 0; t < block; ++t) {
    getcontext(&ocemu_fibers[t]);
    ocemu_fibers[t].uc_stack.ss_sp = ocemu_stacks.data() + t * ocemu_stack;
    ocemu_fibers[t].uc_stack.ss_size = ocemu_stack;
    ocemu_fibers[t].uc_link = nullptr;
    makecontext(&ocemu_fibers[t], (void (*)())ocemu_entry, 1, t);
  }
  swapcontext(&ocemu_main_ctx, &ocemu_fibers[0]);
}
"""

@functools.cache
def emulator_unavailable() -> str | None:
    """None when g++ can build the emulator here (it needs ``_Float16``: GCC 12 or later on
    x86-64), else why not."""
    if shutil.which("g++") is None:
        return "g++ is not installed"
    probe = PRELUDE + ('extern "C" float probe(float x) '
                       '{ return __half2float(__float2half_rn(x)); }\n')
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.cpp"
        src.write_text(probe)
        res = subprocess.run(["g++", "-std=c++17", "-shared", "-fPIC", "-w", str(src), "-o",
                              str(Path(d) / "probe.so")], capture_output=True, text=True)
    if res.returncode != 0:
        return f"g++ cannot build the emulator prelude: {res.stderr.strip()[-300:]}"
    return None


def _cache() -> Path:
    d = Path(tempfile.gettempdir()) / f"ocannl_cuda_emu_{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


_SIG = re.compile(r"__global__ void __launch_bounds__\(\d+\) (\w+)\((.*)\) \{")

Launcher = Callable[[int, int, tuple[np.ndarray, ...]], None]


def build_module(code: str) -> dict[str, Launcher]:
    """Compile a CUDA module's source for the CPU; returns a launcher ``fn(grid, block,
    arrays)`` per kernel, by name. Parameter types are read back from each kernel's signature;
    a kernel that synchronises (``__syncthreads``, ``__shfl_*``) runs its threads as fibers."""
    body = re.sub(r"^#include .*$", "", code, flags=re.M).replace('extern "C" ', "")
    sigs = list(_SIG.finditer(body))
    assert sigs, f"no kernel signature in:\n{code}"
    parts = [PRELUDE, f"namespace ockm {{\n{body}\n}}\n"]
    kernels = []
    for k, m in enumerate(sigs):
        name = m.group(1)
        params = [p.split("*")[0].strip() for p in m.group(2).split(",")]
        text = body[m.start():sigs[k + 1].start() if k + 1 < len(sigs) else len(body)]
        fibers = "__syncthreads" in text or "__shfl" in text
        call = ", ".join(f"({t}*)a[{j}]" for j, t in enumerate(params))
        parts.append(f"extern \"C\" void ocemu_launch_{name}(int grid, int block, void** a) {{\n"
                     f"  ocemu_run(grid, block, {str(fibers).lower()}, "
                     f"[&] {{ ockm::{name}({call}); }});\n}}\n")
        kernels.append((name, len(params)))
    lib = _compile("\n".join(parts))
    return {name: _launcher(lib, name, n) for name, n in kernels}


def _compile(text: str) -> ctypes.CDLL:
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    lib_path = _cache() / f"emu_{key}.so"
    if not lib_path.exists():
        src = _cache() / f"emu_{key}.cpp"
        src.write_text(text)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-w", str(src), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"emulator build failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    return ctypes.CDLL(str(lib_path))


def _launcher(lib: ctypes.CDLL, name: str, nparams: int) -> Launcher:
    fn = getattr(lib, f"ocemu_launch_{name}")
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
    fn.restype = None

    def run(grid: int, block: int, args: tuple[np.ndarray, ...]) -> None:
        assert len(args) == nparams, f"{name}: {len(args)} arguments for {nparams} parameters"
        for a in args:
            assert isinstance(a, np.ndarray) and a.flags.c_contiguous
        ptrs = (ctypes.c_void_p * len(args))(*(a.ctypes.data for a in args))
        fn(grid, block, ptrs)

    return run
