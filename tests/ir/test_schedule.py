"""Scheduling's copies between precisions (``ocannl.ir.schedule``): an f32 copy of a 16-bit node
for a product is made in the pass that writes the node (``copies_in_writers``) and, on a target
without products of that precision, read in the node's place from then on
(``widened_in_place``); the bits stay those of separate copies."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, nn_blocks, train
from ocannl.ir import schedule
from ocannl.ir.assignments import reads
from ocannl.ir.lowered import Gemm, LoopGroup, copy_source, nodes_of, stored_nodes
from ocannl.ir.lowering import lower
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import MemoryMode
from ocannl.mixed_prec import with_master_weights


def mlp_step(width: int = 64):
    """A bf16 MLP's training step, with its hidden activations' nodes."""
    T.set_seed(4)
    x = T.term(np.random.default_rng(4).normal(size=(32, 48)), label="sx", batch_dims=(32,),
               output_dims=(48,))
    y, _ = with_master_weights(prec="bf16", f=lambda: nn_blocks.mlp(
        T.cast(x, "bf16"), (width, width), 5, label="sm"))
    loss = T.sum(T.cast(y, "f32") * T.cast(y, "f32"))
    return loss, train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.05)


def _relus(code):  # noqa: ANN001, ANN202 - lowered code in, the relu outputs out
    return [n.assign.lhs for g in code if isinstance(g, LoopGroup) for n in g.nests
            if n.assign.lhs.label == "relu" and n.assign.lhs.prec is Precision.bf16]


def test_a_widening_for_products_is_made_in_the_writing_pass_and_read_in_place():
    """Without bf16 products, each hidden relu's f32 copy is a nest of the pass computing the
    relu; the forward product and backprop's weight-gradient product read that one copy, the
    relu's gradient mask reads it too, and the bf16 relu is never stored (a register)."""
    loss, comp = mlp_step()
    code = lower(comp, Target())
    relus = _relus(code)
    assert len(relus) == 2
    stored = {n.id for n in stored_nodes(code)}
    for relu in relus:
        assert relu.id not in stored
        [group] = [g for g in code if isinstance(g, LoopGroup)
                   and any(n.assign.lhs.id == relu.id for n in g.nests)]
        [copy] = [n.assign.lhs for n in group.nests if copy_source(n) is relu]
        assert copy.prec is Precision.f32 and copy.memory_mode is MemoryMode.local
        readers = [g for g in code if isinstance(g, Gemm) and copy.id in (g.a.node.id,
                                                                          g.b.node.id)]
        assert len(readers) == 2  # the next layer's product and its weight's gradient
        assert not any(isinstance(g, LoopGroup) and g.conversion and any(
            copy_source(n) is relu for n in g.nests) for g in code)


def test_with_bf16_products_the_library_reads_the_16_bit_node_as_stored():
    """A target whose library multiplies bf16 takes the first relu as stored: nothing widens it,
    and it is stored in bf16 (an inline product's left operand, the last relu's, still gets its
    f32 copy)."""
    loss, comp = mlp_step(512)
    code = lower(comp, Target(native_products=frozenset({Precision.bf16})))
    first = _relus(code)[0]
    assert first.id in {n.id for n in stored_nodes(code)}
    assert any(isinstance(g, Gemm) and first.id in (g.a.node.id, g.b.node.id) for g in code)
    assert not any(copy_source(n) is first for g in code if isinstance(g, LoopGroup)
                   for n in g.nests)


@pytest.mark.parametrize("width", [64, 512])
def test_copies_in_writers_and_in_place_keep_the_bits(width, monkeypatch, tmp_path):
    """The step's gradients and updated masters with both passes, and with neither (each copy a
    pass of its own, a large one made again for backprop), bit for bit; 512 wide, the
    activations are large copies (``schedule.FRESH_COPY``)."""
    from ocannl.backends.cpu import codegen, native_products

    monkeypatch.setattr(native_products, "_decided", {
        p: native_products.ProductPath(p, False, "", 0, "widened by the test")
        for p in native_products.ENV})
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))

    def run(passes: bool) -> tuple[list[bytes], int]:
        if not passes:
            monkeypatch.setattr(schedule, "copies_in_writers", lambda code, target: code)
            monkeypatch.setattr(schedule, "widened_in_place", lambda code, native=frozenset(): code)
        monkeypatch.setattr(codegen, "_VERSION", codegen._VERSION + f"-{passes}")
        loss, comp = mlp_step(width)
        ctx = train.init_params(Context.cpu(), loss)
        n_items = len(ctx.lower(comp))
        ctx, r = ctx.compile(comp)
        for _ in range(2):
            ctx = ctx.run(r)
        return [ctx.get_values(p).tobytes() for p in loss.params] + [
            ctx.get_values(p.grad).tobytes() for p in loss.params], n_items

    fused, fused_items = run(True)
    plain, plain_items = run(False)
    assert fused == plain
    assert fused_items < plain_items


def _broadcast_add(c: int, op: str = "relu", transposed: bool = False,
                   prec: Precision = Precision.f32) -> LoopGroup:
    """The one loop group of ``y[i, j] = op(x[i, j] + b[j])`` over 64 rows of ``c``: a bias
    broadcast over the rows (``transposed``: ``x`` stored ``c x 64``, read 64 cells apart
    along the innermost loop)."""
    from ocannl.ir.assignments import Accum, Comp, Get, apply
    from ocannl.ir.tnode import Tnode

    x = Tnode("x", (c, 64) if transposed else (64, c), prec)
    b, y = Tnode("b", (c,), prec), Tnode("y", (64, c), prec)
    read = Get(x, (1, 0) if transposed else (0, 1))
    [group] = [g for g in lower(Comp((Accum(y, (0, 1), "=", apply(op, apply("add", read,
                                                                             Get(b, (1,)))),
                                            (64, c)),)), Target())
               if isinstance(g, LoopGroup)]
    return group


@pytest.mark.parametrize("c", [4, 8, 16])
@pytest.mark.parametrize("prec", [Precision.f32, Precision.bf16, Precision.f16])
def test_a_short_innermost_loop_of_a_broadcast_is_vectorized_whole(c, prec):
    """A pointwise group that is not one walk over the cells (a bias read along one axis) and
    whose innermost loop is short: vectorized at its extent (LLVM would unroll it first and
    leave scalar code)."""
    g = _broadcast_add(c, prec=prec)
    assert not g.flat and g.inner_vector == c


@pytest.mark.parametrize(("c", "op", "transposed"), [
    (2, "relu", False), (3, "relu", False), (12, "relu", False), (32, "relu", False),
    (8, "exp", False),  # a libm call: no lanes
    (8, "relu", True),  # x read 64 cells apart along the innermost loop
])
def test_other_innermost_loops_are_left_to_the_compiler(c, op, transposed):
    assert _broadcast_add(c, op, transposed).inner_vector == 0


def test_flat_groups_and_reductions_are_not_given_an_inner_width():
    from ocannl.ir.assignments import Accum, Comp, Get, apply
    from ocannl.ir.tnode import Tnode

    x, y = Tnode("x", (64, 8), Precision.f32), Tnode("y", (64, 8), Precision.f32)
    s = Tnode("s", (64,), Precision.f32)
    code = lower(Comp((Accum(y, (0, 1), "=", apply("relu", Get(x, (0, 1))), (64, 8)),
                       Accum(s, (0,), "+", Get(x, (0, 1)), (64, 8), reset=True))), Target())
    groups = [g for g in code if isinstance(g, LoopGroup)]
    assert any(g.flat for g in groups) and len(groups) == 2
    assert all(g.inner_vector == 0 for g in groups)


def _row_sum(space: tuple[int, ...]) -> LoopGroup:
    """The loop group of ``s[i, j] = sum x[i, j, ...]`` over ``space`` (f16 ``x``, row-major:
    each cell's terms contiguous)."""
    from ocannl.ir.assignments import Accum, Comp, Get
    from ocannl.ir.tnode import Tnode

    x = Tnode("x", space, Precision.f16)
    s = Tnode("s", space[:2], Precision.f32)
    [group] = [g for g in lower(Comp((Accum(s, (0, 1), "+", Get(x, tuple(range(len(space)))),
                                            space, reset=True),)), Target())
               if isinstance(g, LoopGroup)]
    return group


def test_a_row_sum_is_transposed_into_lanes_only_where_its_rows_load_whole():
    """``schedule.transposable``: a sum whose read strides across the jammed cells runs in
    lanes only where that read is contiguous along the one reduction iterator and the terms
    come in whole vectors (else the cells stay scalar: a gathered read costs a sum more than
    it saves)."""
    g = _row_sum((4, 16, 64))
    assert (g.jam, g.lanes, g.transposed) == (8, True, (0,))
    for other in (_row_sum((4, 16, 36)),  # the terms not a multiple of the jam
                  _row_sum((4, 16, 8, 8))):  # two reduction iterators
        assert other.jam == 8 and not other.lanes and other.transposed == ()


def lenet_f16_step():
    """An f16 LeNet stage's gradient step (3x3 conv, relu, 2x2 max-pool, then a small MLP)."""
    T.set_seed(11)
    x = T.term(np.random.default_rng(11).normal(size=(4, 8, 8, 2)), label="xs",
               batch_dims=(4,), output_dims=(8, 8, 2), prec="f16")
    y, _ = with_master_weights(prec="f16", f=lambda: nn_blocks.lenet(
        x, num_classes=3, channels=(4,), hidden=8, label="ls"))
    loss = T.sum(T.cast(y, "f32"))
    return loss, train.grad_update(loss)


def _grads_on_cpu(loss, comp) -> list[bytes]:  # noqa: ANN001 - a loss tensor, its step
    ctx = train.init_params(Context.cpu(), loss)
    ctx, routine = ctx.compile(comp)
    ctx = ctx.run(routine)
    grads = [ctx.get_values(p.grad) for p in loss.params]
    assert all(np.any(g != 0) for g in grads)
    return [g.tobytes() for g in grads]


def test_a_scatters_16_bit_sums_are_read_rounded_by_the_next_pass_and_never_stored(
        monkeypatch, tmp_path):
    """A max-pool's gradient scattered into an f16 node (the relu's) is summed in an f32 copy;
    where only the next item's pointwise nests read the node (the relu mask's), they read the
    f32 sums rounded as the rounding pass would store them: that pass and the f16 node are
    gone, with the same bits. (The 2x2 pool's gradient is a gather on a CPU, one term a cell:
    kept a scatter here, as a pool whose windows overlap stays.)"""
    from ocannl.ir import lowering

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "scatter_as_gather", lambda a, target: None)
    loss, comp = lenet_f16_step()

    def relu_grads(code: list) -> list:  # the conv stage's: the max-pool's scatter's target
        return [n for n in nodes_of(code) if n.label.startswith("grad_relu")
                and n.prec is Precision.f16 and len(n.dims) == 4]

    forwarded = lower(comp, Target())
    rounded = [g for item in forwarded if isinstance(item, LoopGroup) for n in item.nests
               for g in reads(n.assign.expr) if g.rounded is Precision.f16]
    assert any(g.node.label.startswith("grad_relu") and g.node.prec is Precision.f32
               for g in rounded)
    got = _grads_on_cpu(loss, comp)
    monkeypatch.setattr(schedule, "_sums_forwarded", lambda code, index, k: False)
    stored = lower(comp, Target())
    assert relu_grads(stored) and not relu_grads(forwarded)
    assert len(forwarded) < len(stored)
    assert got == _grads_on_cpu(loss, comp)


def test_a_pools_16_bit_gather_is_read_rounded_by_the_next_pass_and_never_stored(
        monkeypatch, tmp_path):
    """The 2x2 max-pool's gradient, a gather on a CPU (one term a cell), into the relu's f16
    gradient: written into an f32 node that the relu mask's pass reads rounded, so the f16
    node is never stored (as the scatter's sums were not); the same bits as storing it."""
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    loss, comp = lenet_f16_step()
    code = lower(comp, Target())
    gathers = [g for g in code if isinstance(g, LoopGroup) and g.lead.gather]
    assert [(g.lead.assign.lhs.label, g.lead.assign.lhs.prec) for g in gathers] == [
        ("grad_relu_f32", Precision.f32)]
    assert not [n for n in nodes_of(code) if n.label == "grad_relu"
                and n.prec is Precision.f16 and len(n.dims) == 4]
    rounded = [r for g in code if isinstance(g, LoopGroup) for n in g.nests
               for r in reads(n.assign.expr) if r.rounded is Precision.f16]
    assert any(r.node is gathers[0].lead.assign.lhs for r in rounded)
    got = _grads_on_cpu(loss, comp)
    monkeypatch.setattr(schedule, "_sums_forwarded", lambda code, index, k: False)
    stored = lower(comp, Target())
    assert [n for n in nodes_of(stored) if n.label == "grad_relu"
            and n.prec is Precision.f16 and len(n.dims) == 4]
    assert got == _grads_on_cpu(loss, comp)


def _pools(code: list) -> list:
    """The max-pools' reductions (not their tie masks') of lowered code."""
    return [g for g in code if isinstance(g, LoopGroup) and g.lead.red
            and g.lead.assign.accum == "max" and g.lead.assign.lhs.label.startswith("max_pool2d")
            and "ties" not in g.lead.assign.lhs.label]


def test_a_max_pools_16_bit_result_is_written_into_its_f32_copy(monkeypatch, tmp_path):
    """A 2x2 max-pool over f16 values stores one of them a cell: where the next item is its
    f32 copy (the next layer's product reads it, a target without f16 products), the pool
    writes the copy and backprop's tie mask reads it; no f16 pooled node, no copy pass, the
    same bits. With f16 products, the library reads the pool as stored: no change."""
    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    loss, comp = lenet_f16_step()

    def f16_pooled(code: list) -> list:
        return [n for n in nodes_of(code) if n.label == "max_pool2d" and n.prec is Precision.f16]

    code = lower(comp, Target())
    [pool] = _pools(code)
    assert pool.lead.assign.lhs.prec is Precision.f32 and not f16_pooled(code)
    ties = [g for g in code if isinstance(g, LoopGroup)
            and g.lead.assign.lhs.label == "max_pool2d_ties"]
    assert ties and any(r.node is pool.lead.assign.lhs for g in ties
                        for r in reads(g.lead.assign.expr))
    assert f16_pooled(lower(comp, Target(native_products=frozenset({Precision.f16}))))
    got = _grads_on_cpu(loss, comp)
    monkeypatch.setattr(schedule, "selections_widened", lambda code, native=frozenset(): code)
    plain = lower(comp, Target())
    assert f16_pooled(plain) and len(plain) == len(code) + 1
    assert got == _grads_on_cpu(loss, comp)


def test_a_read_steady_over_a_reductions_window_widens_in_place_not_from_a_copy(
        monkeypatch, tmp_path):
    """The max-pool's backward scatter reads the pooled output's f16 gradient once per window
    cell, at the same cell: it is read as stored, widened once per cell, with no f32 copy of
    its own (a nest fewer); a reduction reading a node at many places (the convolution its
    input) still reads a copy. The same bits as with the copy. (The scatter kept one, as in
    the test above.)"""
    from ocannl.ir import lowering

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(lowering, "scatter_as_gather", lambda a, target: None)
    loss, comp = lenet_f16_step()

    def copied(code: list) -> Counter[str]:  # the f16 nodes widened, each time
        return Counter(copy_source(n).label for g in code
                       if isinstance(g, LoopGroup) and g.conversion for n in g.nests
                       if copy_source(n) is not None and copy_source(n).prec is Precision.f16)

    steady = lower(comp, Target())
    got = _grads_on_cpu(loss, comp)
    every = schedule.REUSE

    real = schedule.reused_narrow

    def counting_points(nest, gathers=False):  # noqa: ANN001, ANN202 - the reductions' rule
        if not nest.red:  # before: points over cells; the gathers' rule unchanged
            return real(nest, gathers)
        points = np.prod(nest.space)
        return [g.node for g in reads(nest.assign.expr) if g.node.prec.is_narrow
                and g.node is not nest.assign.lhs and points >= every * g.node.size]

    monkeypatch.setattr(schedule, "reused_narrow", counting_points)
    plain = lower(comp, Target())
    # the pooled output's gradient, which the scatter into the relu's reads at each window
    # cell (the pooled output's copy serves the product too, and stays)
    assert copied(plain) - copied(steady) == Counter(("grad_max_pool2d",))
    assert copied(steady)["xs"] == 1  # the convolution's input: read at nine places a cell
    assert got == _grads_on_cpu(loss, comp)


def _patch_reads(code: list) -> dict[str, list[tuple[str, Precision]]]:
    """Each im2col gather's target -> the nodes it reads (label, precision)."""
    return {n.assign.lhs.label: [(g.node.label, g.node.prec) for g in reads(n.assign.expr)]
            for g in code if isinstance(g, LoopGroup) for n in g.nests
            if n.assign.lhs.label.endswith("_patches")}


def test_f32_patches_of_a_16_bit_node_gather_its_f32_copy_on_a_cpu(monkeypatch, tmp_path):
    """The kernel gradient's f32 patches of the convolution's f16 input read each input cell
    once per window offset: on a CPU (no vector gather of 16-bit cells) they gather the f32
    copy the direct convolution already reads (no pass of their own), not the f16 cells a lane
    at a time; a GPU target gathers the f16 cells as stored. The same bits either way."""
    from ocannl.backends.cuda.plan import cuda_target

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    loss, comp = lenet_f16_step()
    cpu = lower(comp, Target())
    (read,), = _patch_reads(cpu).values()  # one gather, of one node
    assert read[1] is Precision.f32
    conv = [(r.node.label, r.node.prec) for g in cpu if isinstance(g, LoopGroup)
            for n in g.nests if n.assign.lhs.label.startswith("conv2d")
            for r in reads(n.assign.expr)]
    assert read in conv  # the direct convolution's own copy: no pass of its own
    copies = [g for g in cpu if isinstance(g, LoopGroup) for n in g.nests
              if n.assign.lhs.label == read[0]]
    assert len(copies) == 1
    (stored,), = _patch_reads(lower(comp, cuda_target())).values()
    assert stored[1] is Precision.f16
    got = _grads_on_cpu(loss, comp)
    real = schedule.reused_narrow
    monkeypatch.setattr(schedule, "reused_narrow", lambda nest, gathers=False: real(nest))
    assert list(_patch_reads(lower(comp, Target())).values()) == [[stored]]
    assert got == _grads_on_cpu(loss, comp)


def _adam_update(prec: str, rows: int):
    """Adam's update of an MLP's weights, ``prec`` twins of f32 masters (or f32 weights): the
    loss and the update's computation."""
    from ocannl import optim

    T.set_seed(5)
    x = T.term(np.random.default_rng(5).normal(size=(8, 64)), label="ax", batch_dims=(8,),
               output_dims=(64,))

    def model():  # noqa: ANN202 - the logits
        return nn_blocks.mlp(x if prec == "f32" else T.cast(x, prec), (rows,), 4, label="am")

    y = model() if prec == "f32" else with_master_weights(prec=prec, f=model)
    y = y[0] if isinstance(y, tuple) else y
    loss = T.sum(T.cast(y, "f32") * T.cast(y, "f32"))
    return loss, optim.Adam(0.001).update(loss)


@pytest.mark.parametrize("prec", ["f16", "bf16"])
def test_a_twin_in_an_update_pass_is_shared_over_threads_as_the_f32_pass_is(prec):
    """The update of a master that writes its 16-bit twin in the same pass (a store of one
    read, no arithmetic) is shared over threads exactly where the f32 step's update is: a
    64 x 64 weight's (3 computing nests of 4,096 points) runs on one thread either way, a
    256 x 64 weight's on two. The twin had tipped the small one over the threshold, and its
    pass ran 1.0 us slower shared than alone."""
    two = Target(threads=2)

    def split_of(p: str, rows: int) -> int | None:
        _, comp = _adam_update(p, rows)
        groups = [g for g in lower(comp, two) if isinstance(g, LoopGroup)
                  and any(n.assign.lhs.label.startswith("exp_avg_sq") for n in g.nests)
                  and math.prod(g.lead.space) == 64 * rows]
        assert len(groups) == 1, groups
        (g,) = groups
        twins = [n for n in g.nests if n.assign.lhs.keeps is not None or "kept" in
                 n.assign.lhs.name]
        assert bool(twins) == (p != "f32"), [n.assign.lhs.name for n in g.nests]
        assert schedule.computing(g) == len(g.nests) - len(twins)
        return g.split

    assert split_of(prec, 64) is None and split_of("f32", 64) is None
    assert split_of(prec, 256) is not None and split_of("f32", 256) is not None


def test_a_16_bit_node_the_library_reads_as_stored_keeps_its_reads_beside_an_inline_copy():
    """On a target with bf16 products, an inline product (a narrow one, computed swapped)
    reads an f32 copy of a bf16 relu that the library's product of the weight gradient reads
    as stored: the copy is that product's, and no later read is moved onto it (the library
    would get a bf16 operand beside an f32 one, which the renderer refuses)."""
    T.set_seed(6)
    x = T.term(np.random.default_rng(6).normal(size=(24, 37)), label="nx", batch_dims=(24,),
               output_dims=(37,), prec="bf16")
    y, _ = nn_blocks.mlp(x, (19, 45), 7, label="nm", prec="bf16")
    comp = train.grad_update(T.sum(y * y))
    native = Target(native_products=frozenset({Precision.bf16}))
    gemms = [g for g in lower(comp, native) if isinstance(g, Gemm)]
    assert any(g.kernel == "inline" and g.swapped for g in gemms)
    library = [g for g in gemms if g.kernel == "blas"]
    assert library and all(g.a.node.prec is g.b.node.prec for g in library)
    assert any(g.a.node.prec is Precision.bf16 for g in library)  # read as stored


def _bias_gradient(dims: tuple[int, ...], order: tuple[int, ...] | None = None):
    """A ReLU's gradient ``g`` over ``dims``, then its bias's, ``b[c] += g[..., c]``:
    ``order`` permutes the bias's reduction iterators (its terms then come in another order
    than the gradient's points)."""
    from ocannl.ir.assignments import Accum, Comp, Const, Get, apply
    from ocannl.ir.tnode import Tnode

    dy, y, g = (Tnode(c, dims, Precision.f32) for c in ("dy", "y", "g"))
    b = Tnode("b", dims[-1:], Precision.f32)
    at = tuple(range(len(dims)))
    mask = apply("mul", Get(dy, at), apply("gt", Get(y, at), Const(0.0)))
    space = dims if order is None else tuple(dims[i] for i in order) + dims[-1:]
    bias_at = at if order is None else tuple(order.index(i) for i in at[:-1]) + at[-1:]
    return Comp((Accum(g, at, "=", mask, dims),
                 Accum(b, (len(dims) - 1,), "+", Get(g, bias_at), space, reset=True)))


def test_a_bias_gradient_runs_in_the_pass_writing_the_activations_gradient():
    """``row_sums_in_writers``: on a CPU the bias's row walk joins the gradient's pass
    (``LoopGroup.row_sum``, its row vectorized where short: ``row_vector``); not on a GPU, not
    where the row walk is shared over threads, not a long row where the pass is, not where its
    terms come in another order than the pass's points. The bits are the corpus's to check
    (``bias_gradient_*`` in ``tests/backends/test_cpu_render.py``)."""
    from ocannl.backends.cuda.plan import cuda_target

    [fused] = lower(_bias_gradient((64, 8, 8, 8)), Target())
    assert fused.row_sum and fused.inner_vector == 8 and fused.split is None
    assert [n.assign.lhs.label for n in fused.nests] == ["g", "b"]
    [wide] = lower(_bias_gradient((64, 10)), Target())
    assert wide.row_sum and wide.inner_vector == 0  # 10 lanes: the compiler's choice
    gpu = lower(_bias_gradient((64, 8, 8, 8)), cuda_target())
    assert len(gpu) == 2 and not any(g.row_sum for g in gpu)
    two = Target(threads=2)
    [threaded] = lower(_bias_gradient((64, 8, 8, 8)), two)  # the pass alone would be shared
    assert threaded.row_sum and threaded.split is None
    long_rows = lower(_bias_gradient((16, 64, 128)), two)
    assert len(long_rows) == 2 and long_rows[0].split is not None  # the pass keeps its threads
    assert lower(_bias_gradient((16, 64, 128)), Target())[0].row_sum  # one thread: one pass
    shared = lower(_bias_gradient((512, 1024)), two)
    assert len(shared) == 2 and shared[1].split is not None  # a long row, shared by blocks
    apart = lower(_bias_gradient((16, 12, 8), order=(1, 0)), Target())
    assert len(apart) == 2 and apart[1].lead.walk_rows and not any(g.row_sum for g in apart)
