"""Smoke test of the benchmark suite's plumbing (fixtures, parity gate, report), with tiny
step counts, for an MLP, the convnet and the transformer (``gpt_mini`` shrunk); of the
chain-compile script; of issue 12's targets (on made-up rows: every row of the issue's table)
and their rendering; and of ``run.py`` end to end (chain, profile, targets, report). It asserts
no timing: timings live in benchmarks/REPORT.md."""

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

from benchmarks import compile_chain, fixtures, models, report, run, targets  # noqa: E402
from benchmarks import measure as measure_mod  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.results import Row  # noqa: E402
from benchmarks.runners import Unavailable, make_runner  # noqa: E402
from benchmarks.runners.base import trained_losses  # noqa: E402
from benchmarks.sgemm import SgemmInRounds  # noqa: E402
from benchmarks.specs import WORKLOADS, Product, scaled  # noqa: E402

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



def test_a_fixture_write_is_whole_or_nothing(tmp_path: Path, monkeypatch) -> None:
    """The suite's workers may generate one fixture at once: each writes a file of its own
    and renames it, so a reader never sees half a file, and a write that fails leaves the
    fixture there before as it was, with no temporary."""
    path = fixtures.write(TINY, tmp_path)
    before = path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]

    def half_written(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(before[:100])
        raise OSError("disk full")

    monkeypatch.setattr(fixtures, "save_file", half_written)
    with pytest.raises(OSError, match="disk full"):
        fixtures.write(TINY, tmp_path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]

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
    # mlp_small has no step target against PyTorch in issue 12; its mixed-precision ones are
    # listed but not measured (no such rows here), as are the probes' (not run).
    assert not any(t.key.endswith("_eager") for t in found)
    half = [t for t in found if t.key == "half"]
    assert [t.name for t in half] == ["mlp_small bf16 step / f32 step",
                                      "mlp_small f16 step / f32 step"]
    assert all(t.measured is None and t.met is None for t in half)
    # and issue 29's rows that speak to every workload: memory, and the CPU without bf16 units
    # and issue 42's: each f32 step's floor (not timed here), 16-bit steps without 16-bit units
    assert {t.key for t in found} == {"half", "gate", "gated16", "warm", "rss", "bf16_mem",
                                      "bf16_no_units", "floor", "half_no_units"}
    info = {"command": "test", "date": "today", "runtime_s": 0.0, "cpu": "cpu", "cores": 2,
            "memory": "1 GiB", "platform": "p", "commit": "c", "versions": {"numpy": "x"},
            "sgemm": 1e11, "load_start": "0", "load_end": "0"}
    text = report.render(rows, found, info, None, {TINY.name: TINY})
    assert "| ocannl f32 (cpu) |" in text and "**FAIL**" in text
    assert "no such device here" in text and "not measured" in text
    assert "| mlp_wide f32 / PyTorch eager | 1.00x | — | ≤ 0.80x | not measured in this run |" \
        in text


def test_sgemm_yardstick_runs_first_in_every_round(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy's sgemm timed inside the rounds: its calls open every round, before the steps,
    with the pause another framework's rows get; its rate comes from those samples, and the
    report names it as the GEMM column's yardstick beside the rates measured alone."""
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    w = replace(TINY, timed_steps=6, rounds=3)
    fx = fixtures.load(w, tmp_path)
    events: list[str] = []
    slept: list[str] = []
    monkeypatch.setattr(measure_mod.time, "sleep", lambda s: slept.append(events[-1:]))

    class Yard(SgemmInRounds):
        def step(self) -> None:
            events.append("sgemm")
            super().step()

    yard = Yard(n=32, calls=2, products=[Product(3, 5, 4), Product(4, 3, 6, a_transposed=True)])
    ocannl = make_runner(fx, "ocannl", "f32", "cpu")
    ocannl_step = ocannl.step
    ocannl.step = lambda i: (events.append("ocannl"), ocannl_step(i))[1]
    ref = make_runner(fx, "torch", "eager", "cpu")
    rows = measure(fx, [ref, ocannl], ref, log=lambda _: None, yardstick=yard)
    assert [r.status for r in rows] == ["ok", "ok"]
    timed = events[-(3 * 2 + 3 * 2):]  # the rounds: 2 sgemm calls, then 2 ocannl steps
    assert timed == ["sgemm", "sgemm", "ocannl", "ocannl"] * 3
    assert len(yard.samples) == 3 * 2 and all(t > 0 for t in yard.samples)
    assert yard.rate() == pytest.approx(2 * 32**3 / float(np.median(yard.samples)))
    # and one pass over the step's products a round, after the sgemm calls
    assert len(yard.product_samples) == 3
    assert yard.products_time() == float(np.median(yard.product_samples)) > 0
    # a pause before the sgemm calls, before PyTorch's row after them and before ocannl's row
    # after PyTorch's, in every round
    assert len(slept) == 3 * 3 and slept[:3] == [["ocannl"], ["sgemm"], ["sgemm"]]
    info = {"command": "test", "date": "today", "runtime_s": 0.0, "cpu": "cpu", "cores": 2,
            "memory": "1 GiB", "platform": "p", "commit": "c", "versions": {"numpy": "x"},
            "sgemm": 2e11, "sgemm_alone": [3e11, 1e11], "sgemm_rounds": 2e11,
            "load_start": "0", "load_end": "0"}
    text = report.render(rows, targets.evaluate(rows, 2e11), info, None, {w.name: w})
    assert "300 then 100 GFLOP/s alone" in text and "200 GFLOP/s in mlp_wide's rounds" in text


def test_the_wide_steps_products_are_those_its_ocannl_step_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``gemm_products`` (the floor's yardstick, and the GEMM column's FLOPs) lists the
    products an MLP step of this project lowers to GEMMs, shape for shape (the step may
    compute one the other way round: its transpose), and NumPy's pass over them computes
    each product of its operands."""
    from ocannl import Context
    from ocannl.ir.lowering import Gemm

    w = replace(scaled(WORKLOADS["mlp_wide"], 0.01), sizes=(16, 32, 32, 8), batch=16,
                n_batches=2, parity_steps=2)
    fx = fixtures.load(w, tmp_path)
    comps: list = []
    compile_ = Context.compile
    monkeypatch.setattr(Context, "compile", lambda self, comp, bindings=None: (
        comps.append(comp), compile_(self, comp, bindings))[1])
    runner = make_runner(fx, "ocannl", "f32", "cpu")
    runner.build()
    lowered = [g for comp in comps for g in runner.ctx.lower(comp) if isinstance(g, Gemm)]
    assert len(lowered) == 8
    ran = sorted((g.inner, *sorted((g.rows, g.cols))) for g in lowered)
    listed = sorted((p.inner, *sorted((p.rows, p.cols))) for p in w.gemm_products())
    assert ran == listed
    assert w.gemm_flops() == sum(2 * g.rows * g.inner * g.cols for g in lowered)

    yard = SgemmInRounds(n=8, calls=1, products=w.gemm_products())
    yard.time()
    for (a, b, out), p in zip(yard.products, w.gemm_products(), strict=True):
        assert a.shape == (p.rows, p.inner) and b.shape == (p.inner, p.cols)
        assert (a.flags.f_contiguous, b.flags.f_contiguous) == (p.a_transposed, p.b_transposed)
        np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    assert len(yard.product_samples) == 1


def test_paired_ratio_compares_rows_round_by_round() -> None:
    """Rows whose rounds meet a machine of two speeds in different proportions: the ratio of
    their p50s mixes the speeds, the paired ratio (each round's medians, then their median)
    is the per-round factor; the gate targets carry it in their note."""
    from benchmarks.results import paired_ratio

    speeds = [1.0, 1.0, 1.6, 1.0, 1.6, 1.6, 1.6]  # the machine's state in each round
    static = Row("mlp_small", "ocannl", "cpu", "f16-static", status="ok", rounds=7)
    gated = Row("mlp_small", "ocannl", "cpu", "f16-gated16", status="ok", rounds=7)
    for k, speed in enumerate(speeds):
        static.samples += [speed * 10e-6 * (1 + 0.01 * i) for i in range(5)]
        # the gated rows' rounds came a little later: in the slow state one round earlier
        gated.samples += [(speeds[k + 1] if k + 1 < 7 else speed) * 10.2e-6 * (1 + 0.01 * i)
                          for i in range(5)]
    for r in (static, gated):
        r.finish_timing()
    assert paired_ratio(gated, static) == pytest.approx(1.02)
    assert gated.p50 / static.p50 != pytest.approx(1.02, abs=0.01)
    assert paired_ratio(gated, replace(static, rounds=5)) is None  # not the same rounds
    found = {t.name: t for t in targets.evaluate([static, gated], sgemm_flops=None)}
    assert found["mlp_small f16-gated16 / f16-static"].note == "paired by round: 1.020x"


def test_rows_of_a_framework_take_turns_from_round_to_round(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run of one framework's rows turns by one each round, the runs staying in place (so
    the pauses between frameworks stay as few): every row takes every place of its run alike.
    Through ``measure``, with the A/A control's runner among this project's."""
    class Fake:
        def __init__(self, framework: str) -> None:
            self.framework = framework

    live = [(Fake("torch"), 0), (Fake("torch"), 1), (Fake("ocannl"), 2), (Fake("ocannl"), 3),
            (Fake("ocannl"), 4)]
    orders = [[row for _, row in measure_mod.round_order(live, k)] for k in range(6)]
    assert orders[:4] == [[0, 1, 2, 3, 4], [1, 0, 3, 4, 2], [0, 1, 4, 2, 3], [1, 0, 2, 3, 4]]
    assert all(sorted(o[k] for o in orders) == [2, 2, 3, 3, 4, 4] for k in (2, 3, 4))

    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    w = replace(TINY, timed_steps=6, rounds=3)
    fx = fixtures.load(w, tmp_path)
    ran: list[str] = []
    runners = [make_runner(fx, "torch", "eager", "cpu"), make_runner(fx, "ocannl", "f32", "cpu"),
               make_runner(fx, "ocannl", "f16-static", "cpu", control=True)]
    for r in runners[1:]:
        inner = r.step
        r.step = lambda i, r=r, inner=inner: (ran.append("aa" if r.control else r.variant),
                                              inner(i))[1]
    rows = measure(fx, runners, runners[0], log=lambda _: None)
    assert [r.status for r in rows] == ["ok"] * 3
    assert [r.control for r in rows] == [False, False, True]
    assert rows[2].name == "ocannl cpu f16-static (A/A control)"
    f32, aa = "f32", "aa"
    assert ran[-12:] == [f32, f32, aa, aa, aa, aa, f32, f32, f32, f32, aa, aa]
    with pytest.raises(ValueError, match="A/A control is a second ocannl runner"):
        make_runner(fx, "torch", "eager", "cpu", control=True)


def test_aa_control_measures_the_noise_of_ratios_between_own_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The A/A control (a second f16-static runner) is nobody's denominator: the gate targets
    read its twin. How far it stood from its twin is the run's noise on ratios between this
    project's rows; a ratio closer to its goal than that says so in its verdict. The control
    is not probed (its twin is)."""
    def row(variant: str, p50: float, control: bool = False) -> Row:
        r = Row("mlp_small", "ocannl", "cpu", variant, status="ok", rounds=1, control=control)
        r.samples = [p50]
        r.finish_timing()
        return r

    rows = [row("f32", 10e-6), row("f16-static", 10e-6), row("f16-gated16", 10.25e-6),
            row("f16", 11.5e-6), row("bf16", 11e-6), row("f16-static", 10.3e-6, control=True)]
    found = {t.name: t for t in targets.evaluate(rows, sgemm_flops=None)}
    gated = found["mlp_small f16-gated16 / f16-static"]
    assert gated.measured == pytest.approx(1.025)  # over the twin, not over the control
    assert gated.noise == pytest.approx(0.03) and gated.within_noise and gated.met
    assert gated.verdict() == "met, 0.5% under; within this run's A/A noise (3.0%)"
    gate = found["mlp_small f16 (host gate) / f16-static"]  # 1.15 against 1.10: 4.5% over
    assert gate.met is False and not gate.within_noise
    assert gate.verdict() == "**not met**, 1.045x the goal (4.5% over)"
    text = report.render(rows, list(found.values()), INFO, None, {TINY.name: TINY})
    assert "| ocannl f16-static (cpu), A/A control | " in text
    assert ("- A/A control: a second f16-static runner, timed in the same rounds, ran at "
            "1.030x its twin's p50, paired by round 1.030x") in text
    over = replace(gated, name="other", measured=1.04)  # 1.0% over the goal, within 3%
    (row,) = [x for x in targets.summarize([gated, over, gate]) if x.goal.key == "gated16"]
    assert report._summary_verdict(row) == ("**not met** (1 of 2, 1 of them within this run's "
                                            "A/A noise); worst other: 1.010x the goal (1.0% over)")
    alone = {t.name: t for t in targets.evaluate(rows[:-1], sgemm_flops=None)}
    assert alone["mlp_small f16-gated16 / f16-static"].noise is None
    assert "A/A" not in alone["mlp_small f16-gated16 / f16-static"].verdict()
    probed: list[str] = []
    monkeypatch.setattr(run, "run_probe", lambda *a: (probed.append(a[2]), {"status": "ok"})[1])
    run.probe_rows(rows)
    assert sorted(probed) == sorted(["f32", "f16-static", "f16-gated16", "f16", "bf16"] * 2)


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




def test_convnet_is_the_same_model(tmp_path: Path) -> None:
    """Same weights, layout and data: the first loss (no update yet) agrees to f32 rounding,
    and so do the next, trained with Adam (the digits' blank borders tie the max pool's
    maxima: both frameworks route the gradient to the first)."""
    pytest.importorskip("sklearn")
    fx = fixtures.load(CONV, tmp_path)
    ref = trained_losses(make_runner(fx, "torch", "eager", "cpu"), 3)
    ours = trained_losses(make_runner(fx, "ocannl", "f32", "cpu"), 3)
    assert ours[0] == pytest.approx(ref[0], rel=1e-6)
    assert ours == pytest.approx(ref, rel=1e-5)
    assert ref[-1] < ref[0]  # Adam moves it: not a comparison between constants


def _eager_f32_gated16_rows(fx: fixtures.Fixture) -> list:
    """The fixture measured by PyTorch eager (the reference), ocannl f32 and f16-gated16."""
    ref = make_runner(fx, "torch", "eager", "cpu")
    runners = [ref, make_runner(fx, "ocannl", "f32", "cpu"),
               make_runner(fx, "ocannl", "f16-gated16", "cpu")]
    return measure(fx, runners, ref, log=lambda _: None)


def test_convnet_rows_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("sklearn")
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    fx = fixtures.load(CONV, tmp_path)
    rows = _eager_f32_gated16_rows(fx)
    assert rows[0].status == "ok" and rows[0].parity_err == 0.0
    for r in rows[1:]:  # the mixed runner takes the convnet and Adam too
        assert r.status == "ok", (r.name, r.status, r.note, r.parity_err)
        assert r.tolerance == {"f32": 1e-5, "f16-gated16": 2e-3}[r.variant]
        assert r.p50 is not None and r.steps_timed == CONV.timed_steps
        # the device bytes by what holds them: all of them, the parameters among them
        assert sum(r.mem_parts.values()) == r.mem_bytes and r.mem_parts["parameters"] > 0
    f32 = rows[1].mem_parts
    assert f32["their gradients"] == f32["parameters"]  # f32 parameters, f32 gradients
    text = report.render(rows, targets.evaluate(rows, None), INFO, None, {CONV.name: CONV})
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
    rows = _eager_f32_gated16_rows(fx)
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


def _suite_rows() -> list[Row]:
    """Made-up rows for every workload: PyTorch eager at ``base`` and the ocannl variants at
    0.7, 0.9, 1.1, 1.3 and 1.5 times it, with probe figures."""
    rows = []
    for wl, base in (("mlp_small", 1e-4), ("mlp_wide", 1e-2), ("convnet", 2e-3),
                     ("gpt_mini", 5e-2)):
        rows.append(Row(wl, "torch", "cpu", "eager", status="ok", p10=base, p50=base,
                        p90=base, peak_rss_mib=10.0))
        rows.append(Row(wl, "torch", "cuda", "eager", status="skipped", note="no GPU"))
        for i, v in enumerate(("f32", "bf16", "f16", "f16-static", "f16-gated16")):
            rows.append(Row(wl, "ocannl", "cpu", v, status="ok", p10=base, p90=base,
                            p50=(0.7 + 0.2 * i) * base, compile_cold_s=2.0 + i,
                            setup_cold_s=0.5, compile_warm_s=0.1 * (i + 1), setup_warm_s=0.1,
                            peak_rss_mib=8.0 + i))
    return rows


CHAIN = {"source": "this run", "max_seconds": 60.0, "results": [
    {"n": 100, "status": "ok", "compile_s": 0.5, "build_s": 0.01, "setup_s": 0.2},
    {"n": 400, "status": "ok", "compile_s": 2.5, "build_s": 0.03, "setup_s": 0.2},
    {"n": 1000, "status": "ok", "compile_s": 7.0, "build_s": 0.05, "setup_s": 0.2},
    {"n": 3000, "status": "timeout", "note": "not done in 60 s", "floor_s": 45.0}],
    "growth": []}


def test_issue_12_targets_and_report() -> None:
    """Every row of issue 12's table gets its instances (every workload that ran, the chain),
    with the goals as the issue states them; the report renders the issue's table."""
    rows = _suite_rows()
    found = targets.evaluate(rows, sgemm_flops=1e11, chain=CHAIN, products_s=8e-3)
    by = {t.name: t for t in found}
    goals = {g.key: g.goal for g in targets.ISSUE_TABLE}
    assert goals == {"wide_eager": 0.8, "wide_gemm": 0.7, "conv_eager": 1.0, "gpt_eager": 1.0,
                     "half": 1.25, "gate": 1.10, "gated16": 1.03, "cold_wide": 3.0,
                     "cold_big": 5.0, "warm": 0.5, "chain_3000": 10.0, "chain_linear": 2.0,
                     "rss": 1.0}
    later = {g.key for g in targets.ISSUE_29_TABLE + targets.ISSUE_42_TABLE}
    assert {t.key for t in found} - later == set(goals)
    counts = {k: sum(t.key == k for t in found) for k in goals}
    assert counts == {"wide_eager": 1, "wide_gemm": 1, "conv_eager": 1, "gpt_eager": 1,
                      "half": 8, "gate": 4, "gated16": 4, "cold_wide": 1, "cold_big": 2,
                      "warm": 4, "chain_3000": 1, "chain_linear": 1, "rss": 4}
    floor = WORKLOADS["mlp_wide"].gemm_flops() / 1e11  # its GEMMs at the sgemm rate: 18.9 ms
    assert by["mlp_wide f32 step / PyTorch eager"].note == (
        f"floor: its GEMMs alone at NumPy's sgemm rate take {floor * 1e3:.2f} ms, "
        f"{floor / 1e-2:.3f}x PyTorch eager's p50; its 8 products as NumPy computes them, in "
        f"the same rounds: 8.00 ms, 0.800x")
    assert by["convnet f32 step / PyTorch eager"].measured == pytest.approx(0.7)
    assert by["convnet f32 step / PyTorch eager"].met is True
    wide = WORKLOADS["mlp_wide"].gemm_flops() / (0.7e-2 * 1e11)
    assert by["mlp_wide f32 GEMM FLOP/s / NumPy sgemm"].measured == pytest.approx(wide)
    assert by["mlp_small f16 step / f32 step"].measured == pytest.approx(1.1 / 0.7)
    assert by["gpt_mini f16-gated16 / f16-static"].measured == pytest.approx(1.5 / 1.3)
    cold = by["convnet f16-gated16 compile + set-up, cold process"]
    assert (cold.measured, cold.goal, cold.met) == (pytest.approx(6.5), 5.0, False)
    warm = by["gpt_mini compile + set-up, warm on-disk cache"]  # the slowest variant's
    assert warm.measured == pytest.approx(0.6) and "f16-gated16" in warm.note
    rss = by["mlp_wide peak RSS growth / PyTorch eager's"]
    assert rss.measured == pytest.approx(1.2) and rss.met is False
    big = by["chain of 3,000 ops, cold compile"]  # timed out: a lower bound, over the goal
    assert big.lower_bound and big.measured == 45.0 and big.met is False
    linear = by["chain compile, seconds per op: largest N / smallest N"]
    assert linear.measured == pytest.approx((45.0 / 3000) / (0.5 / 100)) and not linear.met
    assert "ms/op at N = 100" in linear.note

    text = report.render(rows, found, INFO, None, chain=CHAIN, profiles=[
        {"workload": "gpt_mini", "variant": "f16-gated16", "runs": 2, "p50": 7.5e-2,
         "items": [(0.01, "gemm a 4x4 @ 4x4 (f32/f32/f32)"), (0.002, "fill b (3)")],
         "total_s": 0.012},
        {"workload": "convnet", "variant": "f16", "error": "timed out after 300 s"}])
    assert "| Target | At filing | Measured | Goal | Met / by how much |" in text
    for g in targets.ISSUE_TABLE:
        assert f"| {g.text} | {g.at_filing} |" in text
    assert ("| bf16 and f16 step / own f32 step, every workload | 1.22-2.10x | 1.29x – 1.57x "
            "(8 measured) | ≤ 1.25x | **not met** (8 of 8); worst ") in text
    assert "| convnet f32 / PyTorch eager | - | 0.70x | ≤ 1.00x | met, 30% under |" in text
    assert "| > 45.00 s | ≤ 10 s | **not met**, at least 4.50x the goal |" in text
    assert "## Compile time of a chain of N pointwise ops" in text
    assert "| 3,000 | > 45.0 s | > 15.00 ms | — | — | timeout: not done in 60 s |" in text
    assert "## Where the time goes" in text and "`gemm a 4x4 @ 4x4 (f32/f32/f32)`" in text
    assert "83.3%" in text and "1.50x PyTorch eager" in text
    assert "**convnet f16**: not profiled (timed out after 300 s)" in text


def test_chain_results_stop_after_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_chain`` skips the chains longer than one that timed out, each with its floor; the
    per-op growth then runs to the largest N as a lower bound. A killed child's floor is how
    long it had been compiling (from the start time it printed)."""
    times = {100: 1.0, 400: 4.4}

    def child(n: int, max_seconds: float) -> dict:
        if n in times:
            return {"n": n, "status": "ok", "compile_s": times[n], "build_s": 0.0,
                    "setup_s": 0.0}
        return {"n": n, "status": "timeout", "note": f"not done in {max_seconds:g} s",
                "floor_s": 50.0}

    monkeypatch.setattr(compile_chain, "run_child", child)
    logged: list[str] = []
    done = compile_chain.run_chain([100, 400, 1000, 3000], 60.0, logged.append,
                                   stop_after_timeout=True)
    status = [(r["n"], r["status"], r.get("floor_s")) for r in done["results"]]
    assert status == [(100, "ok", None), (400, "ok", None), (1000, "timeout", 50.0),
                      (3000, "skipped", 50.0)]
    g = done["per_op_growth"]
    assert (g["from"], g["to"], g["lower_bound"]) == (100, 3000, True)
    assert g["ratio"] == pytest.approx((50.0 / 3000) / (1.0 / 100))
    assert any("timeout" in m for m in logged)
    both = targets.chain_targets(done)
    assert [t.key for t in both] == ["chain_3000", "chain_linear"]
    assert both[0].met is False and "N = 1000 already took over 60 s" in both[0].note
    ok_only = compile_chain.per_op_growth(done["results"][:2])
    assert ok_only["ratio"] == pytest.approx(1.1) and not ok_only["lower_bound"]

    def late(*args: object, **kwargs: object) -> None:
        import time

        started = json.dumps({"compile_started": time.time() - 5.0})
        raise compile_chain.subprocess.TimeoutExpired(args[0], 1.0, output=(
            started + "\n").encode())

    monkeypatch.undo()
    monkeypatch.setattr(compile_chain.subprocess, "run", late)
    r = compile_chain.run_child(7, max_seconds=1.0)
    assert r["status"] == "timeout" and r["floor_s"] == pytest.approx(5.0, abs=1.0)


def test_run_wires_chain_profiles_and_targets(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``run.py`` end to end at toy sizes: one workload, no probes, a chain of 2 and 3 ops
    measured in fresh processes, the slowest ocannl row profiled; the JSON and the report
    carry the targets, the chain and the profile. Then the chain taken from a JSON file."""
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)
    monkeypatch.setattr(run, "sgemm_rate", lambda: 1e11)
    out = tmp_path / "out"
    base = ["--workloads", "mlp_small", "--scale", "0.01", "--no-probes", "--no-torch-compile",
            "--cpu-only", "--out", str(out), "--fixtures", str(tmp_path)]
    assert run.main([*base, "--chain-n", "2", "3", "--chain-max-seconds", "120",
                     "--profile-rows", "1", "--profile-runs", "1", "--no-peers",
                     "--profile-variants", "bf16"]) == 0
    done = json.loads((out / "REPORT.json").read_text())
    ran = {(r["framework"], r["variant"]) for r in done["rows"]}
    assert ("torch", "autocast") in ran and not {"jax", "tinygrad"} & {f for f, _ in ran}
    assert [r["n"] for r in done["chain"]["results"]] == [2, 3]
    assert all(r["status"] == "ok" for r in done["chain"]["results"]), done["chain"]
    keys = {t["key"] for t in done["targets"]}
    assert {"half", "gate", "gated16", "warm", "rss", "chain_3000", "chain_linear", "bf16_mem",
            "bf16_no_units", "floor", "half_no_units"} == keys
    (floor,) = [t for t in done["targets"] if t["key"] == "floor"]
    f = done["info"]["floors"]["mlp_small"]
    assert floor["measured"] > 0 and f["floor_s"] == f["products_s"] + f["copy_s"] > 0
    assert "## Issue 42's targets" in (out / "REPORT.md").read_text()
    linear = next(t for t in done["targets"] if t["key"] == "chain_linear")
    assert linear["measured"] is not None and "N = 3" in linear["note"]
    # The slowest row, then the bf16 row if it was not that (it may be, on some CPUs).
    prof, bf16 = done["profiles"][0], done["profiles"][-1]
    assert len(done["profiles"]) == (1 if prof["variant"] == "bf16" else 2)
    assert bf16["variant"] == "bf16" and "error" not in bf16, bf16
    assert prof["workload"] == "mlp_small" and "error" not in prof, prof
    assert prof["items"] and prof["total_s"] > 0
    text = (out / "REPORT.md").read_text()
    assert "## Issue 12's targets" in text and "| 2 | " in text
    assert f"**mlp_small {prof['variant']}**" in text

    (tmp_path / "COMPILE_CHAIN.json").write_text(json.dumps(
        {"info": {"command": "chain"}, "max_seconds": 60.0, "results": CHAIN["results"]}))
    assert run.main([*base, "--chain-from", str(tmp_path / "COMPILE_CHAIN.json"),
                     "--profile-rows", "0", "--profile-variants", ""]) == 0
    done = json.loads((out / "REPORT.json").read_text())
    assert done["chain"]["per_op_growth"]["to"] == 3000 and done["profiles"] == []
    # the peers' rows, run where installed, else saying why
    peers = {(r["framework"], r["variant"]): r for r in done["rows"]
             if r["framework"] in ("jax", "tinygrad")}
    assert set(peers) == {("jax", "f32"), ("jax", "bf16"), ("tinygrad", "f32")}
    assert all(r["status"] == "ok" or (r["status"] == "skipped" and r["note"])
               for r in peers.values()), peers
    assert "COMPILE_CHAIN.json` (`chain`)" in (out / "REPORT.md").read_text()


def test_slowest_rows_one_per_workload() -> None:
    rows = _suite_rows()
    pick = {(r.workload, r.variant): r for r in rows if r.framework == "ocannl"}
    pick["mlp_small", "f32"].p50 = 9.0  # far behind its eager row (1e-4 s)
    pick["mlp_wide", "bf16"].p50 = 0.1  # 10x eager
    pick["convnet", "f16"].p50 = 2e-2  # 10x eager, but mlp_wide's came first
    picked = run.slowest_rows(rows, 2)
    assert [(r.workload, r.variant) for r in picked] == [("mlp_small", "f32"),
                                                         ("mlp_wide", "bf16")]
    assert run.slowest_rows(rows, 0) == []


def test_floor_targets_hold_each_step_to_its_floor_and_16_bits_without_units_to_f32() -> None:
    """Each workload's f32 step over its floor (a missing floor: not measured); the 16-bit
    steps over their own f32 step only on a CPU whose flags say it has no product units of
    their precision."""
    rows = _suite_rows()
    floors = {"mlp_small": {"floor_s": 1e-4, "note": "floor 0.1 ms: parts"}}
    found = targets.floor_targets(rows, floors, {"avx512_bf16": False, "amx_bf16": False})
    floor = [t for t in found if t.key == "floor"]
    f32 = next(r for r in rows if r.workload == "mlp_small" and r.framework == "ocannl"
               and r.variant == "f32")
    by = {t.name: t for t in floor}
    assert by["mlp_small f32 step / its floor"].measured == pytest.approx(f32.p50 / 1e-4)
    assert by["mlp_small f32 step / its floor"].note == "floor 0.1 ms: parts"
    assert all(t.measured is None for n, t in by.items() if not n.startswith("mlp_small"))
    half = [t for t in found if t.key == "half_no_units"]
    assert half and all(t.goal == 1.05 for t in half)
    assert any(t.measured is not None for t in half)
    # An AVX512-BF16 CPU has bf16 units and no f16 ones: its f16 steps are held to the goal.
    with_units = targets.floor_targets(rows, floors, {"avx512_bf16": True, "amx_bf16": False,
                                                      "amx_fp16": False})
    half = [t for t in with_units if t.key == "half_no_units"]
    assert all(t.measured is None and "avx512_bf16" in t.note
               for t in half if " bf16 step" in t.name)
    assert any(t.measured is not None for t in half if " f16 step" in t.name)
    assert all("no f16 product units" in t.name for t in half if " f16 step" in t.name)


def test_a_steps_floor_is_made_of_its_own_products_and_bytes(tmp_path: Path) -> None:
    """``floor.step_shape``: the products of the f32 step as lowered (an MLP's eight, its
    first layer's input gradient not computed), the parameters' and gradients' bytes, and a
    yardstick whose floor is its two parts."""
    from benchmarks import floor as floor_mod

    w = replace(scaled(WORKLOADS["mlp_wide"], 0.01), sizes=(16, 32, 32, 8), batch=16,
                n_batches=2)
    shape = floor_mod.step_shape(fixtures.from_tensors(w, fixtures.generate(w)))
    # the same products, some computed the other way round (``out^T = b^T @ a^T``)
    assert sorted(p.flops for p in shape.products) == sorted(p.flops for p in w.gemm_products())
    params = sum(i * o + o for i, o in zip(w.sizes[:-1], w.sizes[1:], strict=True)) * 4
    assert shape.touched["parameters"] == shape.touched["gradients"] == params
    yard = floor_mod.FloorInRounds(shape)
    yard.time()
    rec = yard.record()
    assert rec["floor_s"] == rec["products_s"] + rec["copy_s"] and "products" in rec["note"]
