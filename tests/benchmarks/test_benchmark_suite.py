"""Smoke test of the benchmark suite's plumbing (fixtures, parity gate, report), with tiny
step counts, for an MLP, the convnet and the transformer (``gpt_mini`` shrunk), and of the
chain-compile script. It asserts no timing: timings live in benchmarks/REPORT.md."""

from __future__ import annotations

import json
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

from benchmarks import compile_chain, fixtures, models, report, targets  # noqa: E402
from benchmarks import measure as measure_mod  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.runners import Unavailable, make_runner  # noqa: E402
from benchmarks.specs import WORKLOADS, scaled  # noqa: E402

TINY = replace(scaled(WORKLOADS["mlp_small"], 0.01), parity_steps=4, n_batches=2)
# The convnet at batch 8, 3 parity steps, 2 distinct batches, a handful of timed steps.
CONV = replace(scaled(WORKLOADS["convnet"], 0.01), batch=8, n_batches=2, parity_steps=3,
               timed_steps=4, rounds=2)
# gpt_mini's model, data and optimizer at toy sizes: 1 block of width 16, 2 heads, 8 tokens.
GPT = replace(scaled(WORKLOADS["gpt_mini"], 0.01), batch=2, n_batches=2, parity_steps=3,
              timed_steps=4, rounds=2, vocab=16, context=8, d_model=16, heads=2, layers=1)
INFO = {"command": "test", "date": "today", "runtime_s": 0.0, "cpu": "cpu", "cores": 2,
        "memory": "1 GiB", "platform": "p", "commit": "c", "versions": {"numpy": "x"},
        "sgemm": None, "load_start": "0", "load_end": "0"}


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


def test_gpt_fixture_matches_both_models(tmp_path: Path) -> None:
    """The fixture holds every parameter of ``nn_blocks.gpt`` and of the PyTorch twin, by name,
    in sizes both accept; the labels are the inputs shifted by one token; it is seeded."""
    import ocannl.tensor as T
    from ocannl import nn_blocks

    fx = fixtures.load(GPT, tmp_path)
    a, b = fixtures.generate(GPT), fixtures.generate(GPT)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert fx.x.shape == fx.labels.shape == (2, 2, 8) and fx.x.dtype == np.int64
    np.testing.assert_array_equal(fx.x[..., 1:], fx.labels[..., :-1])
    assert 0 <= fx.x.min() and fx.labels.max() < GPT.vocab
    ids = T.class_ids(fx.x[0], num_classes=GPT.vocab)
    _, params = nn_blocks.gpt(ids, vocab=16, context=8, d_model=16, heads=2, layers=1)
    assert list(params) == list(fx.weights)  # the same names, in creation order
    assert all(int(np.prod(p.dims)) == fx.weights[n].size for n, p in params.items())
    twin = dict(models.torch_model(GPT, fx.weights).named_parameters())
    names = sys.modules[models.torch_gpt_class().__module__].gpt_names(1)
    assert {names[t]: tuple(v.shape) for t, v in twin.items()} == {
        n: v.shape for n, v in fx.weights.items()}
    assert np.array_equal(twin["blocks.0.q.weight"].detach().numpy(), fx.weights["block0.wq"])


def test_gpt_rows_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformer through the parity gate (f32 within 1e-5 of PyTorch: the same model)
    and the mixed runner (named parameters, token ids), then into the report."""
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    fx = fixtures.load(GPT, tmp_path)
    ref = make_runner(fx, "torch", "eager", "cpu")
    runners = [ref, make_runner(fx, "ocannl", "f32", "cpu"),
               make_runner(fx, "ocannl", "f16-gated16", "cpu")]
    rows = measure(fx, runners, ref, log=lambda _: None)
    for r in rows:
        assert r.status == "ok", (r.name, r.status, r.note, r.parity_err)
        assert r.p50 is not None and r.steps_timed == GPT.timed_steps
    text = report.render(rows, targets.evaluate(rows, None), INFO, None, {GPT.name: GPT})
    assert "## gpt_mini" in text and "markov_chars, gpt: vocab 16" in text
    assert "| ocannl f16-gated16 (cpu) |" in text


def test_compile_chain_reports_times_and_timeouts(tmp_path: Path) -> None:
    """A short chain compiles in a fresh process and is written to the JSON; a child past
    ``--max-seconds`` is reported as timed out, not raised."""
    assert compile_chain.main(["--n", "3", "--out", str(tmp_path)]) == 0
    done = json.loads((tmp_path / "COMPILE_CHAIN.json").read_text())
    (r,) = done["results"]
    assert r["n"] == 3 and r["status"] == "ok", r
    assert r["compile_s"] > 0 and done["info"]["command"].endswith("--out " + str(tmp_path))
    late = compile_chain.run_child(3, max_seconds=0.01)
    assert late["status"] == "timeout" and "0.01 s" in late["note"]
    trace = "Traceback (most recent call last):\nRuntimeError: LLVM IR parsing error\n<s>\n^\n"
    assert compile_chain._why(trace) == "RuntimeError: LLVM IR parsing error"
    rows = [{"n": 100, "status": "ok", "compile_s": 1.0}, late,
            {"n": 400, "status": "ok", "compile_s": 16.0}]
    (g,) = compile_chain.growth(rows)
    assert (g["from"], g["to"]) == (100, 400) and g["exponent"] == pytest.approx(2.0)
