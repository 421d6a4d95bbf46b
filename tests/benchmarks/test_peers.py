"""The benchmarks' peer rows (PyTorch autocast bf16, JAX, tinygrad), issue 29's targets, the
memory column and the CPU's bf16 units.

JAX and tinygrad are not the test suite's (the ``bench-peers`` extra): their rows are run for
real where installed (``pytest.importorskip`` prints why it skips), and the row that says
"not installed" is checked either way, with the package hidden.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from benchmarks import fixtures, machine, report, targets  # noqa: E402
from benchmarks import measure as measure_mod  # noqa: E402
from benchmarks.measure import measure  # noqa: E402
from benchmarks.results import Row  # noqa: E402
from benchmarks.runners import make_runner, row_specs  # noqa: E402
from benchmarks.specs import TOLERANCE, WORKLOADS, precision_of, scaled  # noqa: E402
from ocannl.backends.cpu import host, native_products  # noqa: E402

TINY = replace(scaled(WORKLOADS["mlp_small"], 0.01), parity_steps=4, n_batches=2,
               timed_steps=2, rounds=1, warmup_steps=1)
CONV = replace(scaled(WORKLOADS["convnet"], 0.01), batch=8, n_batches=2, parity_steps=3,
               timed_steps=2, rounds=1, warmup_steps=1)
GPT = replace(scaled(WORKLOADS["gpt_mini"], 0.01), batch=2, n_batches=2, parity_steps=3,
              timed_steps=2, rounds=1, warmup_steps=1, vocab=16, context=8, d_model=16,
              heads=2, layers=1)
INFO = {"command": "test", "date": "today", "runtime_s": 0.0, "cpu": "cpu", "cores": 2,
        "memory": "1 GiB", "platform": "p", "commit": "c", "versions": {"numpy": "x"},
        "sgemm": 1e11, "load_start": "0", "load_end": "0"}


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure_mod, "SETTLE_S", 0.0)


def _gate(tmp_path: Path, w: object, specs: list[tuple[str, str, str]]) -> list[Row]:
    """The rows of ``specs`` measured on ``w``'s fixture against PyTorch eager (the first)."""
    fx = fixtures.load(w, tmp_path)
    runners = [make_runner(fx, "torch", "eager", "cpu")] + [make_runner(fx, *s) for s in specs]
    return measure(fx, runners, runners[0], log=lambda _: None)


def test_row_precisions_pick_the_tolerances() -> None:
    assert precision_of("torch", "autocast") == precision_of("jax", "bf16") == "bf16"
    assert precision_of("tinygrad", "f32") == precision_of("torch", "eager") == "f32"
    assert precision_of("ocannl", "f16-static") == "f16"
    with pytest.raises(ValueError, match="unknown row jax 'f16'"):
        precision_of("jax", "f16")
    with pytest.raises(ValueError, match="unknown ocannl variant 'bf8'"):
        precision_of("ocannl", "bf8")
    specs = row_specs(devices=("cpu",), torch_compile=False)
    assert specs[:5] == [("torch", "eager", "cpu"), ("torch", "autocast", "cpu"),
                         ("jax", "f32", "cpu"), ("jax", "bf16", "cpu"),
                         ("tinygrad", "f32", "cpu")]
    assert specs[5][0] == "ocannl"  # this project's rows last, the A/A control after them
    assert ("jax", "f32", "cpu") not in row_specs(devices=("cpu",), peers=False)
    with pytest.raises(ValueError, match="expected one of"):
        make_runner(fixtures.Fixture(TINY, [], None, None), "mxnet", "f32", "cpu")


def test_autocast_row_runs_bf16_behind_the_bf16_gate(tmp_path: Path) -> None:
    """PyTorch eager under CPU autocast: its losses differ from f32's (its products run in bf16)
    but within the bf16 tolerance, which its row is gated at; it is timed."""
    (ref, auto) = _gate(tmp_path, TINY, [("torch", "autocast", "cpu")])
    assert ref.parity_err == 0.0
    assert auto.status == "ok" and auto.tolerance == TOLERANCE["bf16"]
    assert 0.0 < auto.parity_err <= TOLERANCE["bf16"]
    assert auto.p50 is not None and auto.steps_timed == TINY.timed_steps
    text = report.render([ref, auto], targets.evaluate([ref, auto], 1e11), INFO, None,
                         {TINY.name: TINY})
    assert "| PyTorch autocast bf16 (cpu) | " in text


@pytest.mark.parametrize("hidden", ["jax", "tinygrad"])
def test_a_peer_not_installed_gets_a_row_saying_why(tmp_path: Path, hidden: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, hidden, None)  # import raises ImportError
    (_, row) = _gate(tmp_path, TINY, [(hidden, "f32", "cpu")])
    assert row.status == "skipped" and row.p50 is None
    assert f"{hidden} is not installed" in row.note and "bench-peers" in row.note
    text = report.render([row], [], INFO, None, {TINY.name: TINY})
    assert f"Not run: {hidden} cpu f32 — skipped: {hidden} is not installed" in text


def test_peer_runners_refuse_unknown_variants_and_devices() -> None:
    from benchmarks.runners.jax_runner import JaxRunner
    from benchmarks.runners.tinygrad_runner import TinygradRunner

    fx = fixtures.Fixture(TINY, [], None, None)
    with pytest.raises(ValueError, match="jax variant must be one of .* got 'f16'"):
        JaxRunner(fx, variant="f16")
    with pytest.raises(ValueError, match="CPU only, got device 'cuda'"):
        TinygradRunner(fx, device="cuda")
    with pytest.raises(ValueError, match="torch variant must be one of"):
        make_runner(fx, "torch", "amp", "cpu")


@pytest.mark.parametrize("w", [TINY, CONV, GPT], ids=["mlp", "lenet", "gpt"])
def test_jax_rows_train_the_same_models(tmp_path: Path, w: object) -> None:
    pytest.importorskip("jax", reason="jax not installed (the bench-peers extra): its rows "
                                      "are checked only as 'not installed'")
    (_, f32, bf16) = _gate(tmp_path, w, [("jax", "f32", "cpu"), ("jax", "bf16", "cpu")])
    assert f32.status == "ok" and f32.parity_err <= TOLERANCE["f32"], f32
    assert bf16.status == "ok" and bf16.tolerance == TOLERANCE["bf16"], bf16
    assert bf16.parity_err > f32.parity_err  # bf16 compute, not f32 relabelled
    assert f32.p50 is not None and bf16.p50 is not None


@pytest.mark.parametrize("w", [TINY, CONV, GPT], ids=["mlp", "lenet", "gpt"])
def test_tinygrad_rows_train_the_same_models(tmp_path: Path, w: object) -> None:
    pytest.importorskip("tinygrad", reason="tinygrad not installed (the bench-peers extra): "
                                           "its row is checked only as 'not installed'")
    from benchmarks.runners.tinygrad_runner import import_tinygrad

    try:
        import_tinygrad()
    except Exception as err:  # noqa: BLE001 - e.g. no clang: the row says so, checked here
        (_, row) = _gate(tmp_path, w, [("tinygrad", "f32", "cpu")])
        assert row.status == "skipped" and "CPU device is unusable" in row.note
        pytest.skip(f"tinygrad's CPU device unusable here: {err}")
    (_, row) = _gate(tmp_path, w, [("tinygrad", "f32", "cpu")])
    assert row.status == "ok" and row.parity_err <= TOLERANCE["f32"], row
    assert row.p50 is not None


class _OffByAPercent:
    """An ocannl runner whose losses read 1% high: its row fails the gate, is not timed."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.framework, self.variant, self.device = inner.framework, inner.variant, inner.device

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def loss(self) -> float:
        return self.inner.loss() * 1.01


def test_device_memory_is_read_after_the_first_step(tmp_path: Path) -> None:
    """An ocannl row's device buffers + scratch are its context's ``mem()`` once the step has
    run, read in the gate (so a row that fails it has them too); other frameworks' rows have
    none."""
    fx = fixtures.load(TINY, tmp_path)
    runners = [make_runner(fx, "torch", "eager", "cpu"), make_runner(fx, "ocannl", "f32", "cpu"),
               make_runner(fx, "ocannl", "bf16", "cpu"),
               _OffByAPercent(make_runner(fx, "ocannl", "f32", "cpu"))]
    rows = measure(fx, runners, runners[0], log=lambda _: None)
    assert rows[0].mem_bytes is None
    assert rows[3].status == "parity-fail" and rows[3].p50 is None
    for r, row in zip(runners[1:], rows[1:], strict=True):
        assert row.mem_bytes == r.ctx.mem() > 0
    found = {t.name: t for t in targets.evaluate(rows, 1e11)}
    mem = found["mlp_small bf16 device buffers + scratch / f32's"]
    assert mem.measured == pytest.approx(rows[2].mem_bytes / rows[1].mem_bytes)
    kib = f"bf16 {rows[2].mem_bytes / 1024:.2f} KiB (parameters "  # a small model: in KiB
    assert mem.note.startswith(kib) and "their gradients" in mem.note, mem.note


def _bf16_rows() -> list[Row]:
    """Made-up rows: per workload PyTorch eager and autocast, ocannl f32 and bf16 (bf16 at 0.5x
    f32 on mlp_wide, 0.9x elsewhere; autocast at 2x ocannl bf16), with device memory."""
    rows = []
    for wl, base in (("mlp_small", 1e-4), ("mlp_wide", 1e-2), ("convnet", 2e-3),
                     ("gpt_mini", 5e-2)):
        half = 0.5 if wl == "mlp_wide" else 0.9
        rows += [Row(wl, "torch", "cpu", "eager", status="ok", p50=base),
                 Row(wl, "torch", "cpu", "autocast", status="ok", p50=2 * half * base),
                 Row(wl, "ocannl", "cpu", "f32", status="ok", p50=base, mem_bytes=4 << 20),
                 Row(wl, "ocannl", "cpu", "bf16", status="ok", p50=half * base,
                     mem_bytes=3 << 20)]
    return rows


def test_issue_29_targets_and_report() -> None:
    rows = _bf16_rows()
    none = {f: False for f in machine.BF16_FLAGS}
    found = targets.evaluate(rows, sgemm_flops=1e11, bf16_units=none)
    keys29 = [g.key for g in targets.ISSUE_29_TABLE]
    assert {g.key: g.goal for g in targets.ISSUE_29_TABLE} == {
        "bf16_wide_own": 0.45, "bf16_wide_autocast": 0.65, "bf16_gpt_own": 0.75,
        "bf16_gpt_autocast": 0.80, "bf16_conv_own": 1.00, "bf16_conv_autocast": 0.20,
        "bf16_gemm": 2.5, "bf16_mem": 0.8, "bf16_no_units": 1.21}
    by = {t.name: t for t in found if t.key in keys29}
    counts = {k: sum(t.key == k for t in found) for k in keys29}
    assert counts == {"bf16_wide_own": 1, "bf16_wide_autocast": 1, "bf16_gpt_own": 1,
                      "bf16_gpt_autocast": 1, "bf16_conv_own": 1, "bf16_conv_autocast": 1,
                      "bf16_gemm": 1, "bf16_mem": 4, "bf16_no_units": 4}
    wide = by["mlp_wide bf16 step / own f32 step"]
    assert wide.measured == pytest.approx(0.5) and wide.met is False  # goal 0.45
    conv = by["convnet bf16 step / PyTorch autocast bf16 step"]
    assert conv.measured == pytest.approx(0.5) and conv.met is False  # goal 0.20
    assert by["gpt_mini bf16 step / own f32 step"].measured == pytest.approx(0.9)
    gemm = by["mlp_wide bf16 GEMM FLOP/s / f32 GEMM FLOP/s"]
    assert gemm.measured == pytest.approx(2.0) and gemm.at_least and gemm.met is False
    flops = WORKLOADS["mlp_wide"].gemm_flops()
    assert f"bf16 {flops / 5e-3 / 1e9:.1f} GFLOP/s" in gemm.note and "% of NumPy sgemm" in gemm.note
    mem = by["convnet bf16 device buffers + scratch / f32's"]
    assert mem.measured == pytest.approx(0.75) and mem.met is True
    assert by["mlp_small bf16 step / own f32 step, no bf16 units"].measured == pytest.approx(0.9)

    # a CPU with AMX-BF16: the last row is not measured, and says why
    amx = dict(none, amx_bf16=True)
    other = [t for t in targets.evaluate(rows, 1e11, bf16_units=amx) if t.key == "bf16_no_units"]
    assert len(other) == 4 and all(t.measured is None for t in other)
    assert "this CPU has bf16 units (amx_bf16)" in other[0].note
    # no autocast row: its targets are not measured
    bare = [r for r in rows if r.variant != "autocast"]
    (auto,) = [t for t in targets.evaluate(bare, 1e11) if t.key == "bf16_wide_autocast"]
    assert auto.measured is None and auto.met is None

    info = dict(INFO, bf16_units=none, bf16_path="widened to f32 (test)")
    text = report.render(rows, found, info, None)
    assert "- bf16 units: amx_bf16 no, avx512_bf16 no, amx_fp16 no (none of them" in text
    assert "- bf16 product path: widened to f32 (test)" in text
    assert "## Issue 29's targets" in text
    section = text[text.index("## Issue 29's targets"):]
    for g in targets.ISSUE_29_TABLE:
        assert f"| {g.text} | {g.at_filing} |" in section
    assert ("| mlp_wide bf16 step / own f32 step | 1.11x-1.16x | 0.50x | ≤ 0.45x | **not met**, "
            "1.11x the goal (11% over) |") in section
    assert "| ≥ 2.50x | **not met**, short by 0.5x (0.80x the floor) |" in section
    # issue 12's instances stay in its own section
    issue12 = text[text.index("## Issue 12's targets"):text.index("## Issue 29's targets")]
    assert "device buffers + scratch" not in issue12
    assert "Device buffers + scratch" in text and "| 3.00 MiB |" in text


def test_cpu_flags_name_the_bf16_units() -> None:
    info = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512_bf16 amx_tile\nprocessor\t: 1\n"
    flags = host.parse_cpuinfo(info)[2]
    assert {"avx2", "avx512_bf16", "amx_tile"} <= flags
    assert machine.bf16_units(flags) == {"amx_bf16": False, "avx512_bf16": True,
                                         "amx_fp16": False}
    assert host.parse_cpuinfo("model name : x\n")[2] == frozenset()
    units = machine.describe()["bf16_units"]
    assert set(units) == set(machine.BF16_FLAGS)


def test_the_header_names_the_bf16_product_path_this_process_runs() -> None:
    """The report's header line is ``native_products.describe()``: which path each 16-bit
    precision's products take here, and why."""
    line = machine.describe()["bf16_path"]
    assert line == native_products.describe() and line.startswith("bf16 products: ")
