"""examples/common.py: the backend choice, the per-epoch batch order and the checked flag types."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import common  # noqa: E402


def test_batch_indices_walk_one_permutation_per_epoch() -> None:
    n, batch = 100, 30  # 3 steps an epoch, 10 points left out of each
    for epoch in range(3):
        steps = [common.batch_indices(epoch * 3 + k, n, batch, seed=5) for k in range(3)]
        seen = np.concatenate(steps)
        assert all(len(s) == batch for s in steps)
        assert len(set(seen.tolist())) == 90 and seen.min() >= 0 and seen.max() < n
    a = common.batch_indices(7, n, batch, seed=5)
    assert np.array_equal(a, common.batch_indices(7, n, batch, seed=5))  # a function of the step
    assert not np.array_equal(a, common.batch_indices(7, n, batch, seed=6))
    assert not np.array_equal(common.batch_indices(0, n, batch, 5),
                              common.batch_indices(3, n, batch, 5))  # a fresh order each epoch
    assert len(common.batch_indices(4, n, n, 0)) == n  # one batch: the whole set


def test_the_loader_hands_out_the_batches_of_batch_indices() -> None:
    """The examples train from ocannl.loader; their PyTorch twins (tiny_gpt --compare-torch)
    take batch_indices: the same rows, step by step, over epochs."""
    import ocannl.tensor as T
    from ocannl import Context
    from ocannl.loader import Loader

    n, batch = 50, 8
    rows = np.arange(n, dtype=np.float32)[:, None]
    x = T.term(np.zeros((batch, 1)), label="x")
    loader = Loader([rows], [x], batch=batch, seed=9)
    ctx = Context.cpu()
    for step in range(20):
        ctx = loader.next(ctx)
        got = ctx.get_values(x)[:, 0].astype(np.int64)
        assert np.array_equal(got, common.batch_indices(step, n, batch, seed=9)), step


@pytest.mark.parametrize(("step", "n", "batch", "seed"), [
    (0, 512, 1000, 0), (0, 512, 0, 0), (-1, 512, 64, 0), (0, 512, 64, -1), (0, 512, 1.5, 0),
    (True, 512, 64, 0),
])
def test_batch_indices_refuse_what_has_no_batch(step, n, batch, seed) -> None:
    with pytest.raises(ValueError, match="batch_indices"):
        common.batch_indices(step, n, batch, seed)


def test_make_context() -> None:
    assert common.make_context("cpu").backend_name() == "cpu"
    with pytest.raises(ValueError, match="'gpu'"):
        common.make_context("gpu")


def test_checked_types() -> None:
    between = common.integer(1, 10)
    assert between("10") == 10
    for bad in ("0", "11", "1.0", "x", "9" * 5000):
        with pytest.raises(argparse.ArgumentTypeError, match=r"an integer in \[1, 10\]"):
            between(bad)
    unit = common.real(0, 1, hi_open=True)
    assert unit("0") == 0.0 and unit("0.5") == 0.5
    for bad in ("1", "-1e-300", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"\[0, 1\)"):
            unit(bad)
    f32 = common.real(0, common.F32_MAX, lo_open=True, f32=True)
    assert f32("1e-45") == 1e-45 and f32("3.4e38") == 3.4e38
    for bad in ("1e-46", "3.5e38", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match="f32"):
            f32(bad)


def test_output_path(tmp_path: Path) -> None:
    assert common.output_path(None, "--x") is None
    assert common.output_path(tmp_path / "a.png", "--x") is None
    assert "does not exist" in common.output_path(tmp_path / "no" / "a.png", "--x")
    assert "is a folder" in common.output_path(tmp_path, "--x")
    assert "not a file name" in common.output_path("a\0b", "--x")
    assert "does not exist" in common.output_path("/" + "x" * 5000 + "/a", "--x")


# --- the checkpoint's record of who wrote it and under which settings ---------------------------


def _progress(step: int = 10, **extra: str):
    from ocannl import checkpoint

    return checkpoint.Progress(step=step, extra=dict(extra))


def test_canonical_settings_compare_equal_values_as_equal() -> None:
    mine = common.canonical({"batch": 64, "lr": 0.003, "prec": "f16"})
    assert mine == {"batch": "64", "lr": "0.003", "prec": "f16"}
    keys = ("batch", "lr", "prec")
    assert common.differences({"batch": "64", "lr": "0.003", "prec": "f16"}, mine, keys) == []
    assert common.differences({"batch": "64", "lr": "0.01", "prec": "f16"}, mine, keys) == [
        "--lr 0.01 in the checkpoint, 0.003 now"]
    assert common.differences({}, {"seed": ""}, ("seed",)) == []
    assert common.differences({"c": "ab"}, {"c": "cd"}, ("c",), {"c": "the corpus"}) == [
        "the corpus ab in the checkpoint, cd now"]


def test_another_programs_checkpoint_is_named_as_such() -> None:
    config = json.dumps({"gate": "fused", "batch": "64"})
    tagged = _progress(program="moons_mixed_precision.py", config=config)
    said = common.foreign_problem(tagged, "digits_convnet.py", ("batch", "lr"))
    assert "written by moons_mixed_precision.py, not by digits_convnet.py" in said
    untagged = _progress(config=config)
    said = common.foreign_problem(untagged, "digits_convnet.py", ("batch", "lr"))
    assert "settings this program does not have (gate)" in said and "batch" not in said
    assert "does not record the settings" in common.foreign_problem(
        _progress(), "digits_convnet.py", ("batch",))
    ints = _progress(config=json.dumps({"batch": 64}))  # not strings: not this format's
    assert "does not record the settings" in common.foreign_problem(ints, "x.py", ("batch",))
    mine = _progress(program="x.py", config=json.dumps({"batch": "64"}))
    assert common.foreign_problem(mine, "x.py", ("batch",)) is None


def test_steps_problem() -> None:
    assert common.steps_problem(10, 10) is None and common.steps_problem(5, 10) is None
    assert common.steps_problem(20, 10) == ("it is at step 20, past --steps 10 (give --steps 20 "
                                            "or more)")


@pytest.mark.parametrize(("env", "want"), [
    ({}, None), ({"PMI_SIZE": "1"}, None), ({"PMI_SIZE": "2"}, (2, "PMI_SIZE")),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, (4, "OMPI_COMM_WORLD_SIZE")),
    ({"MV2_COMM_WORLD_SIZE": "3"}, (3, "MV2_COMM_WORLD_SIZE")), ({"PMI_SIZE": "x"}, None),
])
def test_launched_ranks(env: dict[str, str], want) -> None:
    assert common.launched_ranks(env) == want


def test_a_progress_entry_the_checkpoint_lacks_is_named_with_what_it_holds() -> None:
    from ocannl import Failure, checkpoint

    progress = checkpoint.Progress(step=3, extra={"recipe": "r", "loss_scaler": "s"})
    assert common.saved(progress, "recipe") == "r"
    with pytest.raises(Failure, match=r"no 'loader' entry \(it holds loss_scaler, recipe\): "
                                      r"it was written by an older version"):
        common.saved(progress, "loader")
