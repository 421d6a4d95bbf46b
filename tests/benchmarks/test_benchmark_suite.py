"""Smoke test of the benchmark suite's plumbing (fixtures, parity gate, report), with tiny
step counts, for an MLP and the convnet. It asserts no timing: timings live in
benchmarks/REPORT.md."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from benchmarks import fixtures, report, targets  # noqa: E402
from benchmarks import measure as measure_mod  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.runners import Unavailable, make_runner  # noqa: E402
from benchmarks.specs import WORKLOADS, scaled  # noqa: E402

TINY = replace(scaled(WORKLOADS["mlp_small"], 0.01), parity_steps=4, n_batches=2)
# The convnet at batch 8, 3 parity steps, 2 distinct batches, a handful of timed steps.
CONV = replace(scaled(WORKLOADS["convnet"], 0.01), batch=8, n_batches=2, parity_steps=3,
               timed_steps=4, rounds=2)


def test_fixture_is_seeded_and_round_trips(tmp_path: Path) -> None:
    a, b = fixtures.generate(TINY), fixtures.generate(TINY)
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    fx = fixtures.load(TINY, tmp_path)
    assert fixtures.path_of(TINY, tmp_path).exists()
    assert [w.shape for w, _ in fx.weights] == [(32, 2), (32, 32), (2, 32)]
    assert fx.x.shape == (2, 32, 2) and fx.labels.shape == (2, 32)
    np.testing.assert_array_equal(fx.weights[1][0], a["w1"])
    np.testing.assert_array_equal(fx.onehot()[0].argmax(-1), fx.labels[0])
    other = replace(TINY, seed=TINY.seed + 1)  # another spec regenerates the stale file
    assert not np.array_equal(fixtures.load(other, tmp_path).x, fx.x)


class _Off:
    """A runner whose losses are PyTorch's times (1 + 1e-3): must fail the f32 gate."""

    framework, variant, device = "ocannl", "f32", "cpu"

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def build(self) -> None:
        self.inner.build()

    def step(self, i: int) -> None:
        self.inner.step(i)

    def loss(self) -> float:
        return self.inner.loss() * (1 + 1e-3)

    def sync(self) -> None:
        pass

    def mem_bytes(self) -> None:
        return None


class _Absent(_Off):
    device = "cuda"

    def build(self) -> None:
        raise Unavailable("no such device here")


def test_parity_gate_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    fx = fixtures.load(TINY, tmp_path)
    ref = make_runner(fx, "torch", "eager", "cpu")
    runners = [ref, make_runner(fx, "ocannl", "f32", "cpu"),
               _Off(make_runner(fx, "torch", "eager", "cpu")), _Absent(None)]
    rows = measure(fx, runners, ref, log=lambda _: None)
    assert [r.status for r in rows] == ["ok", "ok", "parity-fail", "skipped"]
    assert rows[1].parity_err <= 1e-5 and rows[2].parity_err > 1e-5
    assert rows[1].p50 is not None and rows[2].p50 is None  # failing rows are not timed
    assert rows[1].steps_timed == TINY.timed_steps
    found = targets.evaluate(rows, sgemm_flops=1e11)
    small = next(t for t in found if t.name.startswith("mlp_small f32"))
    assert small.measured == pytest.approx(rows[1].p50 / rows[0].p50)
    info = {"command": "test", "date": "today", "runtime_s": 0.0, "cpu": "cpu", "cores": 2,
            "memory": "1 GiB", "platform": "p", "commit": "c", "versions": {"numpy": "x"},
            "sgemm": 1e11, "load_start": "0", "load_end": "0"}
    text = report.render(rows, found, info, None, {TINY.name: TINY})
    assert "| ocannl f32 (cpu) |" in text and "**FAIL**" in text
    assert "no such device here" in text and "not measured" in text


def test_convnet_fixture(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    fx = fixtures.load(CONV, tmp_path)
    assert [w.shape for w, _ in fx.weights] == [(8, 3, 3, 1), (16, 3, 3, 8), (64, 64), (10, 64)]
    assert [b.shape for _, b in fx.weights] == [(8,), (16,), (64,), (10,)]
    assert fx.x.shape == (2, 8, 8, 8, 1) and fx.labels.shape == (2, 8)
    assert 0.0 <= fx.x.min() and fx.x.max() <= 1.0 and fx.x.max() > 0.5  # digits / 16
    assert set(np.unique(fx.labels)) <= set(range(10))
    bound = 1 / np.sqrt(3 * 3 * 8)  # kaiming-uniform over the kernel's fan-in
    assert np.abs(fx.weights[1][0]).max() <= bound


def _losses(runner: object, steps: int) -> list[float]:
    runner.build()
    out = []
    for i in range(steps):
        runner.step(i)
        out.append(runner.loss())
    return out


def test_convnet_is_the_same_model(tmp_path: Path) -> None:
    """Same weights, layout and data: the first loss (no update yet) agrees to f32 rounding,
    and so do the next, trained with Adam (the digits' blank borders tie the max pool's
    maxima: both frameworks route the gradient to the first)."""
    pytest.importorskip("sklearn")
    fx = fixtures.load(CONV, tmp_path)
    ref = _losses(make_runner(fx, "torch", "eager", "cpu"), 3)
    ours = _losses(make_runner(fx, "ocannl", "f32", "cpu"), 3)
    assert ours[0] == pytest.approx(ref[0], rel=1e-6)
    assert ours == pytest.approx(ref, rel=1e-5)
    assert ref[-1] < ref[0]  # Adam moves it: not a comparison between constants


def test_convnet_rows_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sklearn")
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    fx = fixtures.load(CONV, tmp_path)
    ref = make_runner(fx, "torch", "eager", "cpu")
    runners = [ref, make_runner(fx, "ocannl", "f32", "cpu"),
               make_runner(fx, "ocannl", "f16-gated16", "cpu")]
    rows = measure(fx, runners, ref, log=lambda _: None)
    assert rows[0].status == "ok" and rows[0].parity_err == 0.0
    for r in rows[1:]:  # the mixed runner takes the convnet and Adam too
        assert r.status == "ok", (r.name, r.status, r.note, r.parity_err)
        assert r.tolerance == {"f32": 1e-5, "f16-gated16": 2e-3}[r.variant]
        assert r.p50 is not None and r.steps_timed == CONV.timed_steps
    info = {"command": "test", "date": "today", "runtime_s": 0.0, "cpu": "cpu", "cores": 2,
            "memory": "1 GiB", "platform": "p", "commit": "c", "versions": {"numpy": "x"},
            "sgemm": None, "load_start": "0", "load_end": "0"}
    text = report.render(rows, targets.evaluate(rows, None), info, None, {CONV.name: CONV})
    assert "## convnet" in text and "lenet 8x8x1" in text and "Adam" in text
    assert "| ocannl f16-gated16 (cpu) |" in text
