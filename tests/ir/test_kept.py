"""Kept twins (``ocannl.ir.kept``): a cast twin placed ``"auto"`` is held between steps, written
in the pass that writes its master, and recast by the context after anything else writes the
master. The bits are those of casting it at every step; a stale twin is never read."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, checkpoint, mixed_prec, nn_blocks, optim, train
from ocannl.ir.lowered import Gemm, LoopGroup, copy_source
from ocannl.ir.lowering import lower
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.mixed_prec import cast_param, master_of, with_master_weights


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path / "cache"))


def mlp_loss(prec: str = "bf16", placement: str = "auto", seed: int = 5):
    """A two-layer MLP of ``prec`` twins over fixed inputs; its scalar loss and its layers."""
    T.set_seed(seed)
    x = T.term(np.random.default_rng(seed).normal(size=(16, 24)), label="kx",
               batch_dims=(16,), output_dims=(24,))
    y, layers = with_master_weights(prec=prec, placement=placement, f=lambda: nn_blocks.mlp(
        T.cast(x, prec), (40,), 3, label="kt"))
    return T.sum(T.cast(y, "f32") * T.cast(y, "f32")), layers


def bits(ctx: Context, t) -> bytes:  # noqa: ANN001 - a tensor
    return ctx.get_values(t).tobytes()


# --- what lowering does ------------------------------------------------------------------


@pytest.mark.parametrize("native", [False, True])
def test_the_update_writes_the_kept_twin_in_its_own_pass_and_readers_read_it(native):
    """No cast of a twin is left in the step; the nest updating a master has a neighbour in its
    loop group storing the new value rounded into the kept node, which is bf16 where the
    target multiplies bf16 as stored, else f32 (the products' precision); the products read
    the kept nodes."""
    loss, layers = mlp_loss()
    comp = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.1)
    target = Target(native_products=frozenset({Precision.bf16}) if native else frozenset())
    code = lower(comp, target)
    masters = {p.value.id: p.value for p in loss.params}
    twins = {t.value.id for pair in layers for t in pair}
    groups = [g for g in code if isinstance(g, LoopGroup)]
    assert not any(n.assign.lhs.id in twins for g in groups for n in g.nests)
    kept_prec = Precision.bf16 if native else Precision.f32
    updated = set()
    for g in groups:
        for j, n in enumerate(g.nests):
            if n.assign.lhs.id in masters and not n.red:
                nxt = g.nests[j + 1]
                k = nxt.assign.lhs
                assert k.keeps == (n.assign.lhs, Precision.bf16) and k.prec is kept_prec
                assert nxt.assign.expr.node is n.assign.lhs and nxt.assign.expr.rounded is \
                    Precision.bf16
                updated.add(n.assign.lhs.id)
    assert updated == set(masters)
    operands = [v.node for g in code if isinstance(g, Gemm) for v in (g.a, g.b)]
    assert layers[0][0].value.cast_of in [n.keeps[0] for n in operands if n.keeps is not None]
    assert not any(n.id in twins for n in operands)
    assert not any(copy_source(n) is not None and copy_source(n).id in masters
                   for g in groups for n in g.nests)


# --- the bits --------------------------------------------------------------------------------


def _train(placement: str, recipe: str, prec: str) -> tuple[list[bytes], list[float]]:
    loss, _ = mlp_loss(prec, placement)
    opt = optim.Adam(0.01)
    ctx = train.init_params(Context.cpu(), loss)
    losses = []
    if recipe == "fused":
        ctx, r = ctx.compile(train.grad_update(loss) + opt.update(loss))
        for _ in range(4):
            ctx = ctx.run(r)
            losses.append(ctx.get_value(loss))
    else:
        scaler = mixed_prec.Loss_scaler.create(init_scale=2.0**10, growth_interval=2)
        rec = mixed_prec.scaled_step(scaler, loss, opt)
        ctx = rec.compile(ctx)
        for _ in range(4):
            ctx = rec.step(ctx)
            losses.append(ctx.get_value(loss))
    return [bits(ctx, p) for p in loss.params], losses


@pytest.mark.parametrize(("recipe", "prec"), [("fused", "bf16"), ("scaled", "f16")])
def test_kept_twins_train_to_the_bits_of_twins_cast_at_every_read(recipe, prec):
    """Adam, in one fused routine and in the host-gated recipe (its update a routine of its own,
    skipped on an overflow): the same parameters and losses, bit for bit, as twins placed
    ``"virtual"`` (every read rounding the master)."""
    kept = _train("auto", recipe, prec)
    virtual = _train("virtual", recipe, prec)
    assert kept[0] == virtual[0]
    assert np.array_equal(np.array(kept[1]), np.array(virtual[1]))
    assert kept[1][0] != kept[1][-1]  # it trained


# --- whoever else writes a master ------------------------------------------------------------


def _forward_of_fresh_context(loss, values: dict[int, np.ndarray]) -> float:  # noqa: ANN001
    ref = Context.cpu()
    for p in loss.params:
        ref = ref.set_values(p, values[p.value.id])
    ref, f = ref.compile(train.forward(loss))
    return ref.run(f).get_value(loss)


WRITERS = ("set_values", "staged", "init_params", "load", "load_weights", "device_buffer")


@pytest.mark.parametrize("writer", WRITERS)
def test_a_master_written_outside_the_routines_has_its_twin_recast(writer, tmp_path):
    """After two steps, the first weight's master is written by ``writer``; the forward routine
    then gives the loss of a fresh context holding the same masters, bit for bit, and not the
    loss of the twin as the steps left it. ``init_params`` writes only parameters a context has
    not initialized: it is timed after compiling, before any run, in a context whose twins the
    steps of another context's routines were not (a second context over the same graph)."""
    loss, _ = mlp_loss()
    w = loss.params[0]
    ctx = train.init_params(Context.cpu(), loss)
    saved = tmp_path / "w.ckpt"
    checkpoint.save(saved, ctx, [p.value for p in loss.params], checkpoint.Progress(step=0))
    ctx, step = ctx.compile(train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.05))
    ctx, fwd = ctx.compile(train.forward(loss))
    for _ in range(2):
        ctx = ctx.run(step)
    before = ctx.run(fwd).get_value(loss)
    if writer == "set_values":
        ctx = ctx.set_values(w, ctx.get_values(w) * -1.5 + 0.25)
    elif writer == "staged":
        staged = ctx.staged(w, 1)
        staged.write(staged.check(ctx.get_values(w) * -1.5 + 0.25))
    elif writer == "init_params":
        ctx, fwd = Context.cpu().compile(train.forward(loss))  # kept twins allocated, unwritten
        ctx, step = ctx.compile(train.grad_update(loss)
                                + train.sgd_update(loss, learning_rate=0.05))
        T.set_seed(77)
        ctx = train.init_params(ctx, loss)
    elif writer == "load":
        ctx, _ = checkpoint.load(saved, ctx, [p.value for p in loss.params])
    elif writer == "load_weights":
        ctx, _ = checkpoint.load_weights(saved, ctx, [w.value])
    else:
        buf = ctx.device_buffer(w)
        buf[:] = -buf
    got = ctx.run(fwd).get_value(loss)
    values = {p.value.id: ctx.get_values(p) for p in loss.params}
    fresh = _forward_of_fresh_context(loss, values)
    assert np.float32(got).tobytes() == np.float32(fresh).tobytes()
    assert got != before


def test_a_buffer_written_after_it_was_handed_out_is_marked_by_mark_written():
    """``device_buffer`` marks the node when it hands the buffer out; a write after a run needs
    ``mark_written``, which also takes the flat buffer a master shares."""
    loss, _ = mlp_loss()
    w = loss.params[0]
    ctx = train.init_params(Context.cpu(), loss)
    buf = ctx.device_buffer(w)
    ctx, fwd = ctx.compile(train.forward(loss))
    first = ctx.run(fwd).get_value(loss)
    buf *= 2
    ctx = ctx.mark_written(w)
    got = ctx.run(fwd).get_value(loss)
    values = {p.value.id: ctx.get_values(p) for p in loss.params}
    assert got == _forward_of_fresh_context(loss, values) != first
    with pytest.raises(TypeError, match="expected a Tensor or a Tnode"):
        ctx.mark_written("w")


def test_a_routine_compiled_before_the_twin_existed_leaves_it_stale_not_wrong():
    """An update compiled before the master had a twin does not write the kept node; running it
    marks the kept node stale, so the next reader recasts it."""
    T.set_seed(3)
    p = T.param("early", output_dims=[8], input_dims=[8], init="uniform")
    x = T.term(np.random.default_rng(3).normal(size=(4, 8)), label="ex", batch_dims=(4,),
               output_dims=(8,))
    plain = T.sum(p * p)
    ctx = train.init_params(Context.cpu(), plain)
    ctx, upd = ctx.compile(train.grad_update(plain) + train.sgd_update(plain, learning_rate=0.1))
    twin = cast_param(p, prec="bf16")
    assert master_of(twin) is p
    loss = T.sum(T.cast(twin @ T.cast(x, "bf16"), "f32"))
    ctx, fwd = ctx.compile(train.forward(loss))
    first = ctx.run(fwd).get_value(loss)
    ctx = ctx.run(upd)
    got = ctx.run(fwd).get_value(loss)
    assert got == _forward_of_fresh_context(loss, {p.value.id: ctx.get_values(p)}) != first


def test_reading_a_twin_whose_master_nothing_initialized_is_refused_by_name():
    loss, _ = mlp_loss()
    ctx, fwd = Context.cpu().compile(train.forward(loss))
    with pytest.raises(ValueError, match=r"cast twin of kt_w0.*nothing has initialized"):
        ctx.run(fwd)
    ctx = train.init_params(ctx, loss)  # the refusal left the context usable
    assert np.isfinite(ctx.run(fwd).get_value(loss))


def test_the_cuda_plan_writes_the_kept_twin_in_the_updates_kernel():
    """On the CUDA target (bf16 products as stored) every kept twin is bf16, each is written by
    the kernel updating its master (one kernel per master: no cast kernel of its own), and no
    kernel touches a twin: the forward pass reads the kept node."""
    from ocannl.backends.cuda.plan import Kernel, cuda_target, plan_routine

    loss, _ = mlp_loss()
    comp = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.1)
    code = lower(comp, cuda_target())
    kernels = [k for k in plan_routine(code).steps if isinstance(k, Kernel)]
    masters = {p.value.id for p in loss.params}
    kept = {n.id: n for k in kernels for n in k.nodes if n.keeps is not None}
    assert sorted(n.keeps[0].id for n in kept.values()) == sorted(masters)
    assert {n.prec for n in kept.values()} == {Precision.bf16}
    updates = [k for k in kernels if masters & {n.id for n in k.nodes}]
    assert len(updates) == len(masters)  # one kernel per master: its update and its twin
    for k in updates:
        ids = {n.id for n in k.nodes}
        assert [n for n in kept.values() if n.keeps[0].id in ids and n.id in ids]
    twins = {t.id for p in loss.params for t in p.value.twins}
    assert not any(n.id in twins for k in kernels for n in k.nodes)


def test_masters_viewing_one_flat_buffer_are_marked_through_it():
    """Masters sharing one flat buffer (``Context.share_flat``), written through the flat
    buffer's handle (a data-parallel gather of parameter slices would): their kept twins are
    recast."""
    loss, _ = mlp_loss()
    comp = train.forward(loss)  # infers the parameters' dims
    ctx = Context.cpu()
    flat = ctx.share_flat([p.value for p in loss.params], label="masters")
    ctx = train.init_params(ctx, loss)
    ctx, fwd = ctx.compile(comp)
    first = ctx.run(fwd).get_value(loss)
    buf = ctx.device_buffer(flat)
    ctx = ctx.run(fwd)  # a run between the hand-out and the write: mark_written is needed
    buf *= 0.5
    ctx = ctx.mark_written(flat)
    got = ctx.run(fwd).get_value(loss)
    values = {p.value.id: ctx.get_values(p) for p in loss.params}
    assert got == _forward_of_fresh_context(loss, values) != first
