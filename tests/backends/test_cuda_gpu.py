"""What only a GPU can answer, through ``Context.cuda()`` on a real device.

Marked ``gpu``: skipped where CuPy sees no usable device; ``scripts/gpu_check.sh`` runs this
file alone (nothing else needs collecting there). Kernel results are compared with an f64
reference over the stored inputs, with a tolerance scaled by the magnitude of the summed terms
(:mod:`f64_reference`); training runs with the CPU backend at the benchmark's parity
tolerances (losses 1e-5 relative at f32, 2e-3 at f16, 4e-3 at bf16), since cuBLAS and the
block reductions sum in another order than the CPU's loops.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cuda_cases
import cuda_checks as C
import numpy as np
import pytest

from ocannl import Context
from ocannl.backends.cuda import plan as cc
from ocannl.backends.cuda.runtime import CupyCudaBackend, cuda_unavailable_reason
from ocannl.ir import schedule

_reason = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(_reason is not None, reason=f"no GPU: {_reason}")]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _device_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


# --- parity with the CPU backend -----------------------------------------------------------------


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_training_matches_the_cpu_backend(prec: str) -> None:
    C.training_parity(Context.cuda, prec, steps=8)


@pytest.mark.parametrize("prec", ["f32", "f16"])
def test_large_batch_gated_step_matches(prec: str) -> None:
    C.training_parity(Context.cuda, prec, dims=(2, 64, 64, 2), batch=1024, steps=5,
                      comp="gated")


def test_wide_mlp_matches() -> None:
    """256 -> 1024 -> 1024 -> 10 at batch 256: the cuBLAS GEMMs and split checksums."""
    C.training_parity(Context.cuda, "f32", dims=(256, 1024, 1024, 10), batch=256, steps=3,
                      comp="gated")


@pytest.mark.parametrize("prec", ["f32", "f16", "bf16"])
def test_non_finite_input_skips_the_gated_step(prec: str) -> None:
    C.gated_injection(Context.cuda, prec)


def test_set_values_reaches_the_kernels_without_recompiling() -> None:
    C.set_values_reach_kernels(Context.cuda)


def test_buffers_keep_their_device_pointer() -> None:
    """set_values copies in place: the routine's bound pointer never changes."""
    import cuda_models as M

    p = M.build("f32")
    ctx = Context.cuda()
    M.run_steps(ctx, p, 1)
    ptr = ctx._buffer(p.lr.value).data.ptr
    ctx.set_values(p.lr, 0.25)
    assert ctx._buffer(p.lr.value).data.ptr == ptr and ctx.get_value(p.lr) == 0.25


# --- against the f64 reference ----------------------------------------------------------------


@pytest.mark.parametrize("fmad", [True, False])
def test_every_op_matches_the_f64_reference(fmad: bool) -> None:
    """libdevice against NumPy in f64, with FMA contraction on (the default) and off."""
    C.ops(lambda: Context(CupyCudaBackend(fmad=fmad)))


def test_reductions_match_the_f64_reference() -> None:
    C.reductions(Context.cuda)


def test_gemms_match_the_f64_reference() -> None:
    C.gemms(Context.cuda)


def test_f64_gemms() -> None:
    ctx = C.f64_gemms(Context.cuda)
    assert ctx._backend.target.gemm, "cuBLAS is not loadable: the GEMMs ran as kernels"


def test_gemms_with_one_row_or_one_column() -> None:
    C.thin_gemms(Context.cuda)


def test_a_reduction_over_more_than_65535_cells() -> None:
    """70,000 cells: the block reduction's blocks each take several cells in turn."""
    comp, outs = cuda_cases.wide_reduction_cases()
    ctx, routine = C.check_comp(Context.cuda, comp, outs)
    assert any(k.grid == schedule.MAX_GRID for k in routine.compiled.plan.kernels)


def test_a_map_over_more_than_16_7m_elements() -> None:
    """17M elements: the grid-stride loop of 65,535 blocks of 256 threads goes round twice; the
    f16 copy is exact (one rounding of each f32 value)."""
    comp, outs = cuda_cases.long_map_cases()
    ctx, routine = C.check_comp(Context.cuda, comp, outs)
    assert any(k.grid == schedule.MAX_GRID and k.block == cc.BLOCK
               for k in routine.compiled.plan.kernels)
    x = comp.assignments[1].expr.node.host_data
    assert ctx.get_values(outs[1]).tobytes() == x.astype(np.float16).tobytes()


# --- determinism, devices -----------------------------------------------------------------------


@pytest.mark.parametrize("prec,dims,batch", [("f32", (256, 1024, 1024, 10), 256),
                                             ("f16", (2, 64, 64, 2), 1024)])
def test_two_runs_of_the_same_step_are_bit_identical(prec: str, dims: tuple[int, ...],
                                                      batch: int) -> None:
    C.bit_identical_runs(Context.cuda, prec, dims=dims, batch=batch)


def test_a_context_on_device_1() -> None:
    if _device_count() < 2:
        pytest.skip(f"one CUDA device only ({_device_count()})")
    C.training_parity(lambda: Context.cuda(1), "f16", steps=4, comp="gated")
    C.reductions(lambda: Context.cuda(1))
    C.gemms(lambda: Context.cuda(1))


# --- compute-sanitizer ----------------------------------------------------------------------------


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    for d in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if found is None and d and (Path(d) / "bin" / "compute-sanitizer").is_file():
            found = str(Path(d) / "bin" / "compute-sanitizer")
    return found


_PROBE = ("import cupy; x = cupy.arange(256, dtype=cupy.float32); "
          "print('sanitizer probe: ok', float((x * 2).sum()))")


def _sanitize(exe: str, args: list[str], timeout: float) -> tuple[int | None, str]:
    """compute-sanitizer's memcheck over ``python args``: (rc, output); rc None on a timeout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [exe, "--tool", "memcheck", "--error-exitcode", "86", "--print-limit", "20",
           sys.executable, *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        raw = err.stdout or b""  # bytes, whatever ``text`` says (the docs)
        out = raw if isinstance(raw, str) else raw.decode(errors="replace")
        return None, out
    return res.returncode, res.stdout + res.stderr


def test_compute_sanitizer_memcheck_on_a_fused_gated_step() -> None:
    """One fused gated f16 step (block and split reductions in shared memory, cuBLAS, 16-bit
    conversions) under compute-sanitizer's memcheck: no error. Every buffer is its own
    allocation (no memory pool), so memcheck sees each one's bounds.

    A probe first runs a one-kernel CuPy program under the sanitizer: where that does not end
    cleanly (a device or driver the sanitizer refuses, whatever it prints), the test skips
    with the sanitizer's own words; a memcheck error in the probe fails. Both runs fit in the
    60 s the GPU check gives this part (25 s + 35 s)."""
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found (PATH, $CUDA_PATH/bin, /usr/local/cuda/bin)")
    rc, out = _sanitize(exe, ["-c", _PROBE], timeout=25)
    if rc == 86:
        pytest.fail(f"memcheck found an error in a one-kernel CuPy program:\n{out[-3000:]}")
    if rc != 0 or "sanitizer probe: ok" not in out:
        why = "timed out after 25 s" if rc is None else f"rc {rc}"
        pytest.skip(f"compute-sanitizer cannot run a CuPy program here ({why}): "
                    f"{' '.join(out.split())[-300:]}")
    rc, out = _sanitize(exe, [str(HERE / "sanitizer_target.py")], timeout=35)
    assert rc is not None, f"memcheck of the gated step ran over 35 s:\n{out[-3000:]}"
    assert rc == 0 and "sanitizer target: ok" in out, (
        f"compute-sanitizer --tool memcheck: rc {rc}\n{out[-6000:]}")


# --- the mixed-precision example, with a checkpoint and a resume ---------------------------------


def _example(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "moons_mixed_precision.py"),
                          "--no-progress", "--no-plot", *args], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, f"{args}: rc {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "U8": np.uint8}


def _checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The tensors of a checkpoint (bf16 as ml_dtypes' bfloat16) and its progress record."""
    import ml_dtypes
    import safetensors

    data = path.read_bytes()
    tensors = {}
    for name, t in safetensors.deserialize(data):
        dtype = ml_dtypes.bfloat16 if t["dtype"].upper() == "BF16" else _DTYPES[t["dtype"].upper()]
        tensors[name] = np.frombuffer(bytes(t["data"]), dtype=dtype).reshape(t["shape"])
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    return tensors, json.loads(header["__metadata__"]["progress"])


def test_moons_example_on_cuda_resumes_exactly_and_tracks_the_cpu(tmp_path: Path) -> None:
    """``--backend cuda``: the uninterrupted run reaches 97% held-out accuracy; a run stopped at
    step 160 and resumed to 240 ends bit-identical to it; its state stays close to the CPU
    backend's (a trajectory of f16 training: compared relative to each tensor's largest
    value)."""
    common = ["--checkpoint-every", "80", "--inject-nonfinite", "50,51"]
    whole, part, cpu = tmp_path / "whole.st", tmp_path / "part.st", tmp_path / "cpu.st"
    done = _example("--backend", "cuda", "--steps", "240", *common, "--checkpoint", str(whole))
    assert "backend cuda" in done.stdout
    accuracy = re.search(r"^accuracy: ([\d.]+)% on \d+ held-out points$", done.stdout, re.M)
    assert accuracy is not None, done.stdout
    assert float(accuracy.group(1)) >= 97.0, done.stdout  # the target on the GPU
    _example("--backend", "cuda", "--steps", "160", *common, "--checkpoint", str(part))
    resumed = _example("--backend", "cuda", "--steps", "240", *common, "--checkpoint", str(part),
                       "--resume")
    assert f"resumed from {part} at step 160" in resumed.stdout
    want, want_progress = _checkpoint(whole)
    got, got_progress = _checkpoint(part)
    assert got_progress == want_progress
    assert set(got) == set(want)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name
    _example("--backend", "cpu", "--steps", "240", *common, "--checkpoint", str(cpu))
    ref, _ = _checkpoint(cpu)
    assert set(ref) == set(want)
    for name, r in ref.items():
        r64, g64 = r.astype(np.float64), want[name].astype(np.float64)
        scale = float(np.max(np.abs(r64[np.isfinite(r64)]), initial=1.0))
        np.testing.assert_allclose(g64, r64, rtol=0, atol=5e-2 * scale, equal_nan=True,
                                   err_msg=name)


# --- one graph launch per routine call, products through gemmEx --------------------------------



def test_a_data_parallel_rank_of_several_shards() -> None:
    C.data_parallel_shards()


@pytest.mark.parametrize("prec", ["f32", "bf16", "f16"])
def test_routines_capture_and_replay_as_eager_launches(
        monkeypatch: pytest.MonkeyPatch, prec: str) -> None:
    """On the device: the gated step captures (its kernels and gemmEx calls, cuBLAS on its own
    workspace) with no fallback warning, and its replays, with a learning rate written between
    them, give the bits of eager launches."""
    import warnings

    from test_cuda_graphs import _gated_run

    schedule = [None, 0.3, None]
    monkeypatch.delenv("OCANNL_CUDA_GRAPHS", raising=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*graph capture failed")
        _, routine, replayed = _gated_run(prec, 3, lr=schedule)
    assert routine.call.graph is not None
    monkeypatch.setenv("OCANNL_CUDA_GRAPHS", "0")
    _, eager, launched = _gated_run(prec, 3, lr=schedule)
    assert eager.call.graph is None
    assert replayed == launched
