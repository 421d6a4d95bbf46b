"""Lowering, the CPU backend and the interpreter give a convolution's gradients whatever Python's
hash seed (``PYTHONHASHSEED``): no set's or dict's order, nor anything ``hash()`` decides, may
change what is computed.

The case: a strided 1x1 convolution (an image batch 2 of 6x4x1, stride 2, no padding), whose
kernel gradient is one contraction over the whole product space ``(b, oh, ow, o, kh, kw, c)``
with the affine projection ``2 * oh + kh``, and a 3x3 one with padding and channels. Each seed
runs in a subprocess of its own (a fresh hash seed and a fresh compile cache, so the routine is
compiled there, not loaded), compiling ``train.grad_update`` on the CPU and running the same
lowered code in ``ocannl.ir.interpret``, both checked against NumPy in f64.

(The 1x1 case was first reported as a wrong kernel gradient under some hash seeds. It was
torch's, the oracle's: its oneDNN ("mkldnn") f32 convolution on channels-last views gives a
wrong weight gradient for this shape in about a quarter of the runs, depending on where its
buffers land in memory, hence on the hash seed and ASLR; ocannl's value was NumPy's every time.
This test keeps ocannl's side pinned with no torch involved.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2, 3, 4, 5)

CHILD = r"""
import hashlib
import json
import numpy as np
import ocannl.tensor as T
from ocannl import Context, train
from ocannl.backends.cpu import jit
from ocannl.backends.cpu.codegen import signature
from ocannl.ir import interpret
from ocannl.ir.lowering import effects, stored_nodes
from ocannl.tensor.spatial import conv2d


def reference(xv, kv, r, stride, pad):
    # y[b, i, j, o] = sum_{kh, kw, c} xp[b, s*i + kh, s*j + kw, c] * k[o, kh, kw, c]
    b, h, w, c = xv.shape
    o, k = kv.shape[0], kv.shape[1]
    xp = np.pad(xv, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    oh, ow = r.shape[1], r.shape[2]
    gk = np.zeros_like(kv)
    gxp = np.zeros_like(xp)
    for kh in range(k):
        for kw in range(k):
            win = xp[:, kh:kh + stride * oh:stride, kw:kw + stride * ow:stride, :]
            gk[:, kh, kw, :] = np.einsum("bijo,bijc->oc", r, win)
            gxp[:, kh:kh + stride * oh:stride, kw:kw + stride * ow:stride, :] += np.einsum(
                "bijo,oc->bijc", r, kv[:, kh, kw, :])
    return gk, gxp[:, pad:pad + h, pad:pad + w, :]


out = {}
for name, (b, h, w, c, o, k, stride, pad) in {
        "1x1_stride2": (2, 6, 4, 1, 1, 1, 2, 0),
        "3x3_stride2_pad1": (2, 5, 6, 2, 3, 3, 2, 1)}.items():
    rng = np.random.default_rng(0)
    xv = rng.uniform(-1, 1, (b, h, w, c)).astype(np.float32)
    kv = rng.uniform(-1, 1, (o, k, k, c)).astype(np.float32)
    x = T.param("x", batch_dims=(b,), output_dims=(h, w, c), input_dims=())
    kernel = T.param("kernel", output_dims=(o,), input_dims=(k, k, c))
    y = conv2d(x, kernel, stride=stride, padding=pad)
    rv = rng.uniform(-1, 1, y.dims).astype(np.float32)
    r = T.term(rv, batch_dims=y.shape.batch, output_dims=y.shape.output,
               input_dims=y.shape.input, label="r", prec=y.prec)
    loss = T.sum(y * r)
    ctx = Context.cpu()
    ctx.set_values(x, xv)
    ctx.set_values(kernel, kv)
    comp = train.grad_update(loss)
    ctx, routine = ctx.compile(comp)
    ctx.run(routine)
    want_k, want_x = reference(xv.astype(np.float64), kv.astype(np.float64),
                               rv.astype(np.float64), stride, pad)
    got = {"cpu": (ctx.get_values(kernel.grad), ctx.get_values(x.grad))}
    code = ctx.lower(comp)
    out[f"{name}/code"] = hashlib.sha256(
        signature(code, stored_nodes(code), jit.target()).encode()).hexdigest()
    vals = {x.value.id: xv, kernel.value.id: kv, r.value.id: rv}
    assert {n.id for n in effects(code).inputs} <= set(vals), effects(code).inputs
    interpret.run(code, vals)
    got["interpret"] = (vals[kernel.grad.id], vals[x.grad.id])
    for how, (gk, gx) in got.items():
        out[f"{name}/{how}"] = {
            "kernel": [float(np.max(np.abs(gk - want_k))), float(np.max(np.abs(want_k)))],
            "x": [float(np.max(np.abs(gx - want_x))), float(np.max(np.abs(want_x)))],
            "gk": np.asarray(gk, np.float64).ravel()[:4].tolist(),
            "want_k": want_k.ravel()[:4].tolist()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """Every seed's child, started together (each takes about two seconds)."""
    procs = {}
    for seed in SEEDS:
        env = dict(os.environ, PYTHONHASHSEED=str(seed),
                   OCANNL_CACHE_DIR=str(tmp_path_factory.mktemp(f"cache_seed{seed}")))
        procs[seed] = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for seed, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"PYTHONHASHSEED={seed}: the child failed:\n{stderr[-3000:]}"
        out[seed] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_conv_gradients_match_numpy_under_every_hash_seed(runs, seed):
    bad = []
    for case, r in runs[seed].items():
        if case.endswith("/code"):
            continue
        for what in ("kernel", "x"):
            err, scale = r[what]
            if not err <= 1e-5 * max(scale, 1.0):
                bad.append(f"{case}: grad of {what} off by {err:.3g} (scale {scale:.3g}); "
                           f"kernel grad {r['gk']} vs NumPy {r['want_k']}")
    assert not bad, f"PYTHONHASHSEED={seed}:\n" + "\n".join(bad)


def test_every_seed_lowers_to_the_same_code_and_bits(runs):
    """Not only close to NumPy: the same lowered code (its compile signature: every decision
    of every item, nodes by position) and so the same kernel gradient, under every seed."""
    first = runs[SEEDS[0]]
    for seed in SEEDS[1:]:
        for case, r in runs[seed].items():
            if case.endswith("/code"):
                assert r == first[case], f"PYTHONHASHSEED={seed} lowers {case} otherwise"
            else:
                assert r["gk"] == first[case]["gk"], (seed, case)
