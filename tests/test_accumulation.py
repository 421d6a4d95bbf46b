"""Gradient accumulation (the recipes' ``accumulate=k``) against torch's GradScaler recipe:
micro-batch gradients add under one loss scale, one check, one optimizer step and one scaler
update per ``k`` micro-batches; the position inside an accumulation survives a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from grad_rig import assert_close, make_rig, ocannl_optimizer, run_steps, torch_run
from observed import observed

from ocannl import Context, Failure, checkpoint, optim, train
from ocannl.clipping import ClipNorm
from ocannl.mixed_prec import Loss_scaler, Recipe, gated_step, scaled_step

K, STEPS = 4, 30


def build(gate: str, sc: Loss_scaler, loss, opt: optim.Optimizer, **kw) -> Recipe:  # noqa: ANN001
    if gate == "scaled":
        return scaled_step(sc, loss, opt, **kw)
    return gated_step(sc, loss, opt, check_interval=3, **kw)


def parity(prec: str, gate: str, kind: str, clip: ClipNorm | None = None) -> None:
    rig = make_rig(prec)
    w0 = rig.weights(rig.ctx)
    sc = Loss_scaler.create()
    recipe = build(gate, sc, rig.loss, ocannl_optimizer(kind), accumulate=K, clip=clip)
    ctx = recipe.compile(rig.ctx)
    ctx, losses = run_steps(rig, ctx, recipe.step, K * STEPS)
    ctx = recipe.flush(ctx)
    assert recipe.micro == 0 and (recipe.applied_steps, recipe.skipped_steps) == (STEPS, 0)
    assert recipe.windows == (STEPS if gate == "scaled" else STEPS // 3)
    torch_clip = None if clip is None else ("norm", clip.max_norm, clip.norm_type)
    t = torch_run(rig, w0, kind=kind, steps=STEPS, accumulate=K, scaler=True, clip=torch_clip)
    if clip is not None:
        assert sum(n > clip.max_norm for n in t.norms) >= 20
    tol = 1e-5 if prec == "f32" else 2e-3
    assert_close([losses], [t.losses], tol)
    if prec == "f32":
        assert_close(rig.weights(ctx), t.weights, tol)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(t.weights, w0, strict=True))
    assert moved > 0.05  # it trained: the bounds are not vacuous


@pytest.mark.parametrize("gate", ["scaled", "gated"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_f32_accumulation_matches_torch_grad_scaler(gate: str, kind: str) -> None:
    parity("f32", gate, kind)


@pytest.mark.parametrize("kind", ["sgd", "adam3"])
@pytest.mark.parametrize(("gate", "clip"), [("scaled", None), ("gated", ClipNorm(0.15))])
def test_f16_twins_accumulation_matches_torch_f32_grad_scaler(gate: str, clip: ClipNorm | None,
                                                               kind: str) -> None:
    """Adam at 3e-3 (see test_clipping's f16 test for why not 1e-2)."""
    parity("f16", gate, kind, clip)


def test_f32_accumulation_with_clipping_and_adam_matches_torch() -> None:
    parity("f32", "scaled", "adam", ClipNorm(0.15))


def test_micro_batches_run_gradient_routines_and_one_update_per_step() -> None:
    """Each micro-batch runs a gradient routine (the first zeroes); the k-th also checks and
    steps; the scaler is updated once per optimizer step; the counters count optimizer
    steps."""
    SeenContext, SeenScaler, runs, updates = observed()

    for gate in ("scaled", "gated"):
        rig = make_rig()
        ctx = train.init_params(SeenContext.cpu(), rig.loss)
        ctx = rig.feed(ctx, 0)
        runs.clear()
        updates.clear()
        recipe = build(gate, SeenScaler.create(), rig.loss, optim.SGD(0.1), accumulate=3)
        ctx = recipe.compile(ctx)
        positions = []
        for i in range(7):
            ctx = rig.feed(ctx, i)
            ctx = recipe.step(ctx)
            positions.append(recipe.micro)
        assert positions == [1, 2, 0, 1, 2, 0, 1]
        first, more = recipe.grad_comp.label, recipe.accumulate_comp.label
        assert "grad_update" in first and "grad_accumulate" in more
        if gate == "scaled":
            one = [first, more, recipe.last_grad_comp.label, recipe.update_comp.label]
            assert updates == [("update", True)] * 2
            assert (recipe.applied_steps, recipe.windows, recipe.pending) == (2, 2, 0)
        else:
            one = [first, more, recipe.comp.label]
            assert updates == []  # check_interval=3 optimizer steps: none sampled yet
            assert (recipe.applied_steps, recipe.windows, recipe.pending) == (0, 0, 2)
            ctx = recipe.flush(ctx)  # closes the 2 optimizer steps; the 7th micro-batch stays
            assert updates == [("update_n", True, 2)] and recipe.micro == 1
            assert (recipe.applied_steps, recipe.windows, recipe.pending) == (2, 1, 0)
        assert runs == one * 2 + [first]


def test_accumulate_one_is_the_recipe_without_accumulation() -> None:
    rig = make_rig()
    recipe = scaled_step(Loss_scaler.create(), rig.loss, optim.SGD(0.1), accumulate=1)
    assert recipe.accumulate_comp is None and recipe.last_grad_comp is recipe.grad_comp
    assert recipe.state_nodes() == []


def save_run(tmp_path: Path, gate: str, stop: int, total: int) -> tuple[list[bytes], str, str]:
    """Train ``total`` micro-batches (k=3, clipping, Adam), checkpointing after ``stop`` and
    resuming a freshly built model from that file; the final state's bits and host states."""
    def fresh() -> tuple:
        rig = make_rig("f16")
        sc = Loss_scaler.create(growth_interval=2)
        opt = optim.Adam(1e-2)
        recipe = build(gate, sc, rig.loss, opt, accumulate=3, clip=ClipNorm(0.15))
        rig.ctx = recipe.compile(rig.ctx)
        nodes = checkpoint.training_state(rig.loss, opt) + recipe.state_nodes()
        return rig, sc, recipe, nodes

    rig, sc, recipe, nodes = fresh()
    assert [p.grad for p in rig.params] == nodes[-len(rig.params):]  # the partial sums
    ctx = rig.ctx
    for i in range(stop):
        ctx = recipe.step(rig.feed(ctx, i))
    if stop < total:
        path = tmp_path / f"{gate}.safetensors"
        extra = {"loss_scaler": sc.save_state(), "recipe": recipe.save_state()}
        checkpoint.save(path, ctx, nodes, checkpoint.Progress(step=stop, extra=extra))
        rig, sc, recipe, nodes = fresh()
        ctx, progress = checkpoint.load(path, rig.ctx, nodes)
        ctx = sc.restore_state(ctx, progress.extra["loss_scaler"])
        recipe.restore_state(progress.extra["recipe"])
        assert recipe.micro == stop % 3
    for i in range(stop, total):
        ctx = recipe.step(rig.feed(ctx, i))
    ctx = recipe.flush(ctx)
    return [ctx.get_values(n).tobytes() for n in nodes], sc.save_state(), recipe.save_state()


@pytest.mark.parametrize("gate", ["scaled", "gated"])
def test_resume_inside_an_accumulation_continues_exactly(tmp_path: Path, gate: str) -> None:
    whole = save_run(tmp_path, gate, 17, 17)
    assert "micro=2" in whole[2]  # 17 = 5 * 3 + 2: the run ends inside an accumulation
    for stop in (7, 11):  # one and two micro-batches into an accumulation
        assert save_run(tmp_path, gate, stop, 17) == whole


GRADS = [f"grad_mlp_{w}{k}" for k in range(3) for w in "wb"]  # the rig's gradient sums


def two_into_an_accumulation() -> tuple[Recipe, Context, list]:
    """A recipe (k=3) two micro-batches into an accumulation, its context and its training
    state without the recipe's state nodes."""
    rig = make_rig()
    opt = optim.SGD(0.1, momentum=0.9)
    recipe = scaled_step(Loss_scaler.create(), rig.loss, opt, accumulate=3)
    ctx = recipe.compile(rig.ctx)
    for i in range(5):
        ctx = recipe.step(rig.feed(ctx, i))
    assert recipe.micro == 2 and [n.label for n in recipe.state_nodes()] == GRADS
    return recipe, ctx, checkpoint.training_state(rig.loss, opt)


def test_a_save_mid_accumulation_without_the_gradient_sums_is_refused(tmp_path: Path) -> None:
    """The recipe's state says that its gradient sums must be in the checkpoint: a save
    without ``recipe.state_nodes()`` is refused, naming them, and writes nothing."""
    recipe, ctx, state = two_into_an_accumulation()
    line = recipe.save_state()
    assert line.endswith(" micro=2 overflow= needs=" + ",".join(GRADS)), line
    progress = checkpoint.Progress(step=5, extra={"recipe": line})
    with pytest.raises(Failure) as err:
        checkpoint.save(tmp_path / "c.safetensors", ctx, state, progress)
    said = str(err.value)
    assert f"extra['recipe'] needs {GRADS}, which this save does not hold" in said, said
    assert "recipe.state_nodes()" in said and "nothing was written" in said
    assert os.listdir(tmp_path) == []
    checkpoint.save(tmp_path / "c.safetensors", ctx, state + recipe.state_nodes(), progress)


def test_a_load_mid_accumulation_without_the_gradient_sums_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose writer skipped the save's check (its recipe state needs the gradient sums,
    its tensors lack them): the load refuses it, naming them, the context as it was."""
    recipe, ctx, state = two_into_an_accumulation()
    path = tmp_path / "c.safetensors"
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_unmet_needs", lambda *_: [], raising=False)  # a writer without it
        checkpoint.save(path, ctx, state, checkpoint.Progress(
            step=5, extra={"recipe": recipe.save_state()}))
    _, fresh, fresh_state = two_into_an_accumulation()
    before = [fresh.get_values(n).tobytes() for n in fresh_state]
    with pytest.raises(Failure) as err:
        checkpoint.load(path, fresh, fresh_state)
    said = str(err.value)
    assert f"extra['recipe'] needs {GRADS}, which this load does not hold" in said, said
    assert [fresh.get_values(n).tobytes() for n in fresh_state] == before


def test_restore_refuses_a_mid_accumulation_state_without_its_gradient_sums() -> None:
    """A state between two micro-batches that does not record that its gradient sums are in
    the checkpoint (as the previous version wrote it), or records other nodes, is refused
    naming them; the recipe keeps its position."""
    rig = make_rig()
    recipe = gated_step(Loss_scaler.create(), rig.loss, optim.SGD(0.1), accumulate=3)
    unsaid = recipe.save_state().replace("micro=0", "micro=2")
    with pytest.raises(Failure) as err:
        recipe.restore_state(unsaid)
    assert "micro=2 does not record that its gradient sums are in the checkpoint" in \
        str(err.value) and f"needs={','.join(GRADS)}" in str(err.value), str(err.value)
    other = unsaid + " needs=" + ",".join(GRADS[:-1])
    with pytest.raises(Failure, match=r"needs grad_mlp_w0,.*grad_mlp_w2, expected needs=.*"
                                      r"grad_mlp_b2 \(this recipe's state nodes at pending=0, "
                                      r"micro=2\)"):
        recipe.restore_state(other)
    assert recipe.micro == 0
    recipe.restore_state(unsaid + " needs=" + ",".join(GRADS))
    assert recipe.micro == 2


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None, np.float64(2.0)])
def test_bad_accumulate_refused_by_name(bad: object) -> None:
    rig = make_rig()
    for make in (scaled_step, gated_step):
        with pytest.raises(ValueError, match=r"accumulate must be an integer >= 1, got .*"
                                             + __import__("re").escape(repr(bad))):
            make(Loss_scaler.create(), rig.loss, optim.SGD(0.1), accumulate=bad)


def test_restore_refuses_a_position_past_the_accumulation() -> None:
    rig = make_rig()
    recipe = gated_step(Loss_scaler.create(), rig.loss, optim.SGD(0.1), accumulate=3)
    good = recipe.save_state().replace("micro=0", "micro=2") + " needs=" + ",".join(GRADS)
    recipe.restore_state(good)
    assert recipe.micro == 2
    with pytest.raises(Failure, match="micro=3 is not below accumulate=3"):
        recipe.restore_state(good.replace("micro=2", "micro=3"))
    assert recipe.micro == 2
    with pytest.raises(Failure, match=r"format ocannl\.GatedStep/2"):
        recipe.restore_state("ocannl.GatedStep/2 pending=0 applied=0 skipped=0 windows=0 "
                             "skipped_windows=0")
    assert recipe.micro == 2


def test_a_reduced_run_refuses_to_save_between_micro_batches() -> None:
    """With a reducer (data-parallel), gradients are reduced once per optimizer step: before
    that each process holds its own partial sums, which no single checkpoint holds."""

    class Sum:  # a world of one: the reduction is the identity
        def grad_unscale(self, scaler: Loss_scaler):  # noqa: ANN202
            return scaler.unscale

        def reduce(self, ctx: Context, scaler: Loss_scaler) -> Context:
            return ctx

    rig = make_rig()
    recipe = scaled_step(Loss_scaler.create(), rig.loss, optim.SGD(0.1), accumulate=2,
                         reducer=Sum())
    ctx = recipe.compile(rig.ctx)
    ctx = recipe.step(ctx)
    with pytest.raises(Failure, match="micro=1 of accumulate=2 with a reducer"):
        recipe.save_state()
    ctx = recipe.step(ctx)
    assert recipe.save_state().startswith("ocannl.ScaledStep/3 pending=0 applied=1 ")
