"""im2col (``Target.im2col``): convolutions, their kernel gradients and their input
gradients as patches and GEMMs, run by the reference interpreter against the direct loop nests
and an f64 NumPy reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, Precision, train
from ocannl.backends.cpu.backend import CpuBackend
from ocannl.ir import interpret, lowering
from ocannl.ir.assignments import Accum, Affine, Comp, Const, Get, apply
from ocannl.ir.interpret import stored
from ocannl.ir.lowering import Fill, Gemm, LoopGroup, lower, nests, nodes_of
from ocannl.ir.target import PRODUCTS, Target
from ocannl.ir.tnode import MemoryMode, Tnode
from ocannl.tensor.spatial import conv2d

F32 = Precision.f32


@pytest.fixture
def any_size(monkeypatch):
    """im2col wherever a GEMM is recognised, however small (the size rule is tested apart)."""
    monkeypatch.setattr(lowering, "IM2COL_MIN_INNER", 1)
    monkeypatch.setattr(lowering, "IM2COL_MIN_REUSE", 0)


class Conv:
    """``y[b, oh, ow, o] = sum x[b, s*oh + kh - p, s*ow + kw - p, c] * w[o, kh, kw, c]`` over the
    space ``(b, oh, ow, o, kh, kw, c)``, and the two gradients' assignments (``dy`` read from
    ``y``'s node, written into ``x`` and ``w``'s nodes), as ``spatial.conv2d`` builds them."""

    def __init__(self, b: int, h: int, w: int, c: int, o: int, k: int, stride: int, pad: int,
                 prec: Precision = F32, *, flip: bool = False) -> None:
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        self.dims = dict(b=b, h=h, w=w, c=c, o=o, k=k, stride=stride, pad=pad)
        self.x = Tnode("x", (b, h, w, c), prec)
        self.w = Tnode("w", (o, k, k, c), prec)
        self.y = Tnode("y", (b, oh, ow, o), prec)
        self.space = (b, oh, ow, o, k, k, c)
        self.flip = flip  # the window read backwards: x[b, s*oh - kh + k-1 - p, ...]
        win = (-1, k - 1 - pad) if flip else (1, -pad)
        self.xi = (0, Affine(((stride, 1), (win[0], 4)), win[1]),
                   Affine(((stride, 2), (win[0], 5)), win[1]), 6)
        self.wi, self.yi = (3, 4, 5, 6), (0, 1, 2, 3)

    def forward(self, reset: bool = True) -> Accum:
        return Accum(self.y, self.yi, "+", apply("mul", Get(self.x, self.xi),
                                                  Get(self.w, self.wi)), self.space, reset)

    def kernel_grad(self, reset: bool = True) -> Accum:
        return Accum(self.w, self.wi, "+", apply("mul", Get(self.y, self.yi),
                                                  Get(self.x, self.xi)), self.space, reset)

    def input_grad(self, reset: bool = False) -> Accum:
        return Accum(self.x, self.xi, "+", apply("mul", Get(self.y, self.yi),
                                                  Get(self.w, self.wi)), self.space, reset)

    def reference(self, xv: np.ndarray, wv: np.ndarray, yv: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """f64 forward, kernel gradient and input gradient (each alone, from zero)."""
        if self.flip:  # the same with the kernel flipped (and its gradient flipped back)
            self.flip = False
            y, dw, dx = self.reference(xv, wv[:, ::-1, ::-1, :], yv)
            self.flip = True
            return y, dw[:, ::-1, ::-1, :], dx
        d = self.dims
        s, p, k = d["stride"], d["pad"], d["k"]
        xp = np.pad(xv.astype(np.float64), ((0, 0), (p, p), (p, p), (0, 0)))
        _, oh, ow, _ = self.y.dims
        y = np.zeros(self.y.dims)
        dw = np.zeros(self.w.dims)
        dxp = np.zeros(xp.shape)
        for kh in range(k):
            for kw in range(k):
                win = xp[:, kh:kh + s * (oh - 1) + 1:s, kw:kw + s * (ow - 1) + 1:s, :]
                y += np.einsum("bhwc,oc->bhwo", win, wv[:, kh, kw, :])
                dw[:, kh, kw, :] += np.einsum("bhwo,bhwc->oc", yv, win)
                dxp[:, kh:kh + s * (oh - 1) + 1:s, kw:kw + s * (ow - 1) + 1:s, :] += np.einsum(
                    "bhwo,oc->bhwc", yv, wv[:, kh, kw, :])
        dx = dxp[:, p:p + d["h"], p:p + d["w"], :]
        return y, dw, dx


def _run(comp: Comp, values: dict[Tnode, np.ndarray], *, im2col: bool
         ) -> tuple[dict[int, np.ndarray], list]:
    """Lower (im2col on or off) and run ``comp`` in the interpreter on zeros holding
    ``values``; the values of every node by id (as f64), and the lowered code."""
    code = lower(comp, Target(batched_gemm=False, im2col=im2col))
    state = {n.id: np.zeros(n.dims, n.prec.numpy_dtype) for n in nodes_of(code)}
    for n, v in values.items():
        if n.id in state:
            state[n.id] = stored(np.asarray(v, np.float64).reshape(n.dims), n.prec)
    interpret.run(code, state)
    return {k: v.astype(np.float64) for k, v in state.items()}, code


def _values(cv: Conv, seed: int = 0) -> dict[Tnode, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(n.dims) for n in (cv.x, cv.w, cv.y)}


def _gemms(code: list) -> list[Gemm]:
    return [i for i in code if isinstance(i, Gemm)]


def _close(got: np.ndarray, want: np.ndarray, terms: int, eps: float) -> None:
    """Within rounding of sums of ``terms`` products of standard normals."""
    np.testing.assert_allclose(got, want, rtol=0, atol=eps * 8 * np.sqrt(terms) + 1e-12)


CASES = [  # b, h, w, c, o, k, stride, pad
    (2, 6, 6, 3, 4, 3, 1, 1),  # same
    (2, 6, 5, 3, 4, 3, 1, 0),  # valid, not square
    (3, 7, 7, 2, 5, 3, 2, 1),  # stride 2, same
    (3, 9, 8, 4, 3, 3, 2, 0),  # stride 2, valid
    (2, 5, 5, 1, 8, 3, 1, 1),  # one input channel
    (4, 4, 4, 8, 16, 3, 1, 1),  # the benchmark's second convolution, smaller batch
    (2, 9, 9, 2, 4, 5, 2, 2),  # 5x5 window, stride 2
    (2, 6, 6, 3, 4, 2, 1, 0),  # even window
    (2, 6, 6, 3, 4, 3, 1, 1, True),  # the window read backwards (coefficient -1)
    (3, 7, 7, 2, 5, 3, 2, 1, True),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
@pytest.mark.parametrize("which", ["forward", "kernel_grad", "input_grad"])
def test_im2col_matches_the_direct_loops_and_the_reference(any_size, case, which):
    *dims, flip = case if len(case) == 9 else (*case, False)
    cv = Conv(*dims, flip=flip)
    vals = _values(cv)
    a = getattr(cv, which)()
    target = a.lhs
    ref = dict(zip(("forward", "kernel_grad", "input_grad"),
                   cv.reference(vals[cv.x], vals[cv.w], vals[cv.y]), strict=True))[which]
    if which == "input_grad":  # it adds into what x holds
        ref = ref + vals[cv.x]
    direct, code_off = _run(Comp((a,)), vals, im2col=False)
    got, code_on = _run(Comp((a,)), vals, im2col=True)
    assert not _gemms(code_off)
    assert len(_gemms(code_on)) == 1
    terms = int(np.prod(cv.space)) // target.size
    _close(got[target.id], ref, terms, np.finfo(np.float32).eps)
    _close(got[target.id], direct[target.id], terms, np.finfo(np.float32).eps)
    if which != "forward":  # the operands are left as they were
        for n in (cv.x, cv.w, cv.y):
            if n is not target:
                np.testing.assert_array_equal(got[n.id], vals[n].astype(np.float32))


def test_the_patches_are_a_node_of_their_own_read_through_plain_iterators(any_size):
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1)
    code = lower(Comp((cv.forward(),)), Target(batched_gemm=False))
    [gather_group, gemm] = code
    assert isinstance(gather_group, LoopGroup) and isinstance(gemm, Gemm)
    [gather] = gather_group.nests
    patches = gather.assign.lhs
    assert patches.dims == (2, 6, 6, 3, 3, 3)  # (b, oh, ow, kh, kw, c)
    assert patches.name.startswith(f"{cv.x.name}_patches_")
    assert gather.assign.accum == "=" and gather.red == ()
    assert isinstance(gather.assign.expr, Get) and gather.assign.expr.node is cv.x
    assert gemm.a.node is patches and gemm.b.node is cv.w
    assert (gemm.rows, gemm.inner, gemm.cols) == (72, 27, 4)
    # Lowered again, the same computation finds the same node (one buffer per context).
    again = lower(Comp((cv.forward(),)), Target(batched_gemm=False))
    assert nests(again)[0].assign.lhs is patches
    assert patches in nodes_of(code)


def test_a_convolution_and_its_kernel_gradient_share_one_gather(any_size):
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1)
    comp = Comp((cv.forward(), cv.kernel_grad()))
    code = lower(comp, Target(batched_gemm=False))
    gathers = [n for n in nests(code) if n.assign.lhs.label.endswith("_patches")]
    assert len(gathers) == 1 and len(_gemms(code)) == 2
    assert _gemms(code)[1].b.node is gathers[0].assign.lhs
    vals = _values(cv)
    got, _ = _run(comp, vals, im2col=True)
    direct, _ = _run(comp, vals, im2col=False)
    eps = np.finfo(np.float32).eps
    _close(got[cv.y.id], direct[cv.y.id], 27, eps)
    # The kernel gradient reads the y just computed, in both.
    _close(got[cv.w.id], direct[cv.w.id], 2 * 36 * 27, eps)


def test_a_kernel_gradient_alone_over_its_window_lays_its_patches_for_long_runs():
    """A 3 x 3 window over one channel (9 terms: a convolution over it is never worth patches,
    ``IM2COL_MIN_INNER``): its kernel gradient's patches are laid out window offsets first,
    so the gather copies each image row as a run (``LoopGroup.run``), not runs of 3 cells;
    the product reads them transposed, with the reference's values. Over 2 channels and a
    5 x 5 window (50 terms), the convolution's canonical patches stay, for both products."""
    cv = Conv(4, 8, 8, 1, 8, 3, 1, 1)
    code = lower(Comp((cv.kernel_grad(),)), Target(batched_gemm=False))
    [group] = [g for g in code if isinstance(g, LoopGroup)]
    patches = group.lead.assign.lhs
    assert patches.dims == (3, 3, 1, 4, 8, 8)  # (kh, kw, c, b, oh, ow)
    assert group.run == 1 and len(_gemms(code)) == 1 and _gemms(code)[0].b.node is patches
    vals = _values(cv)
    got, _ = _run(Comp((cv.kernel_grad(),)), vals, im2col=True)
    _, dw, _ = cv.reference(vals[cv.x], vals[cv.w], vals[cv.y])
    _close(got[cv.w.id], dw, 4 * 64, np.finfo(np.float32).eps)
    wide = Conv(2, 8, 8, 2, 4, 5, 1, 2)
    code = lower(Comp((wide.forward(), wide.kernel_grad())), Target(batched_gemm=False))
    gathers = [n for n in nests(code) if n.assign.lhs.label.endswith("_patches")]
    assert [g.assign.lhs.dims for g in gathers] == [(2, 8, 8, 5, 5, 2)]
    assert len(_gemms(code)) == 2


def test_a_gather_is_redone_after_its_source_changes(any_size):
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1)
    bump = Accum(cv.x, (0, 1, 2, 3), "+", Const(1.0), cv.x.dims)
    comp = Comp((cv.forward(), bump, cv.kernel_grad()))
    code = lower(comp, Target(batched_gemm=False))
    gathers = [n for n in nests(code) if n.assign.lhs.label.endswith("_patches")]
    assert len(gathers) == 2
    vals = _values(cv)
    got, _ = _run(comp, vals, im2col=True)
    direct, _ = _run(comp, vals, im2col=False)
    eps = np.finfo(np.float32).eps
    _close(got[cv.w.id], direct[cv.w.id], 2 * 36 * 27, eps * 4)


@pytest.mark.parametrize("stride", [1, 2])
def test_the_input_gradient_is_a_gemm_then_col2im(any_size, stride):
    """Stride 1: each cell sums the patch-gradient cells landing on it (a reduction over the
    window); stride 2: those are scattered (a gather would read mostly outside)."""
    cv = Conv(2, 8, 8, 3, 4, 3, stride, 1)
    code = lower(Comp((cv.input_grad(),)), Target(batched_gemm=False))
    [gemm, back] = code
    grad = gemm.assign.lhs
    assert isinstance(gemm, Gemm) and gemm.assign.reset and grad.prec is F32
    assert grad.name.startswith(f"{cv.x.name}_patch_grad_")
    [nest] = back.nests
    assert nest.assign.lhs is cv.x and not nest.assign.reset and nest.assign.accum == "+"
    assert [g.node for g in lowering.reads(nest.assign.expr)] == [grad]
    assert nest.scatter == (stride == 2)


@pytest.mark.parametrize("stride", [1, 2])
def test_a_zeroed_input_gradient_is_reset_not_filled_then_added(any_size, stride):
    cv = Conv(2, 7, 7, 3, 4, 3, stride, 1)
    zero = Accum(cv.x, (0, 1, 2, 3), "=", Const(0.0), cv.x.dims)
    comp = Comp((zero, cv.input_grad()))
    code = lower(comp, Target(batched_gemm=False))
    fills = [i for i in code if isinstance(i, Fill)]
    if stride == 1:  # the col2im covers x: it resets it instead
        assert not fills and nests(code)[-1].assign.reset
    else:  # the scatter does not: the fill stays
        assert [f.node for f in fills] == [cv.x]
    vals = _values(cv)
    got, _ = _run(comp, vals, im2col=True)
    _, _, dx = cv.reference(vals[cv.x], vals[cv.w], vals[cv.y])
    _close(got[cv.x.id], dx, 4 * 9, np.finfo(np.float32).eps)


def test_a_reset_input_gradient_without_a_fill(any_size):
    """An assignment that itself resets its (scattered) target."""
    for stride in (1, 2):
        cv = Conv(2, 7, 7, 3, 4, 3, stride, 1)
        comp = Comp((cv.input_grad(reset=True),))
        vals = _values(cv)
        got, _ = _run(comp, vals, im2col=True)
        _, _, dx = cv.reference(vals[cv.x], vals[cv.w], vals[cv.y])
        _close(got[cv.x.id], dx, 4 * 9, np.finfo(np.float32).eps)


def test_a_fill_read_before_the_col2im_stays(any_size):
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1)
    s = Tnode("s", (2, 6, 6, 3), F32)
    zero = Accum(cv.x, (0, 1, 2, 3), "=", Const(0.0), cv.x.dims)
    copy = Accum(s, (0, 1, 2, 3), "=", Get(cv.x, (0, 1, 2, 3)), cv.x.dims)
    code = lower(Comp((zero, copy, cv.input_grad())), Target(batched_gemm=False))
    assert any(isinstance(i, Fill) and i.node is cv.x for i in code)
    assert not nests(code)[-1].assign.reset


@pytest.mark.parametrize("prec", [Precision.bf16, Precision.f16, Precision.f64])
@pytest.mark.parametrize("which", ["forward", "kernel_grad", "input_grad"])
def test_other_precisions(any_size, prec, which):
    """Patches of a 16-bit node are f32 (its values exactly, and what the GEMM reads); a 16-bit
    target is rounded once, as by the direct loops: the two differ by at most about an ulp."""
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1, prec)
    vals = {n: v.astype(prec.numpy_dtype).astype(np.float64) for n, v in _values(cv).items()}
    a = getattr(cv, which)()
    got, code = _run(Comp((a,)), vals, im2col=True)
    direct, _ = _run(Comp((a,)), vals, im2col=False)
    assert len(_gemms(code)) == 1
    for n in nodes_of(code):
        if n.label.endswith(("_patches", "_patch_grad")):
            assert n.prec is (prec if prec is Precision.f64 else F32)
    want = direct[a.lhs.id]
    ulp = {Precision.bf16: 2.0 ** -7, Precision.f16: 2.0 ** -10, Precision.f64: 1e-14}[prec]
    np.testing.assert_allclose(got[a.lhs.id], want, rtol=2 * ulp,
                               atol=2 * ulp * np.abs(want).max() / 8)


def test_the_size_rule():
    """Defaults: a 3x3 convolution of one channel (9 terms) and one to 2 output channels (each
    patch cell read twice) stay direct; their gradients and a wider convolution do not. The
    input gradient (a scatter) goes through a GEMM whenever one is recognised."""
    def on(cv: Conv, which: str) -> bool:
        return bool(_gemms(lower(Comp((getattr(cv, which)(),)), Target(batched_gemm=False))))

    first = Conv(64, 8, 8, 1, 8, 3, 1, 1)  # the benchmark's first convolution
    assert not on(first, "forward") and on(first, "kernel_grad") and on(first, "input_grad")
    second = Conv(64, 4, 4, 8, 16, 3, 1, 1)
    assert on(second, "forward") and on(second, "kernel_grad") and on(second, "input_grad")
    narrow = Conv(64, 8, 8, 8, 2, 3, 1, 1)
    assert not on(narrow, "forward") and not on(narrow, "kernel_grad")
    assert on(narrow, "input_grad")
    tiny = Conv(1, 3, 3, 1, 1, 2, 1, 0)  # below GEMM_MIN_FLOPS
    assert not any(on(tiny, w) for w in ("forward", "kernel_grad", "input_grad"))


def test_off_by_default_and_other_sums_are_unchanged(any_size):
    cv = Conv(2, 6, 6, 3, 4, 3, 1, 1)
    comp = Comp((cv.forward(), cv.kernel_grad(), cv.input_grad()))
    assert not _gemms(lower(comp, PRODUCTS))
    # A max over a window (pooling), a product not accumulated by +, a matmul: as before.
    m = Tnode("m", (2, 3, 3, 3), F32)
    pool = Accum(m, (0, 1, 2, 6), "max", Get(cv.x, (0, Affine(((2, 1), (1, 4))),
                                                     Affine(((2, 2), (1, 5))), 6)),
                 (2, 3, 3, 1, 2, 2, 3), reset=True)
    assert lower(Comp((pool,)), Target(batched_gemm=False)) == lower(Comp((pool,)), PRODUCTS)
    a, b, c = (Tnode(n, (32, 32), F32) for n in "abc")
    mm = Accum(c, (0, 1), "+", apply("mul", Get(a, (0, 2)), Get(b, (2, 1))), (32, 32, 32), True)
    assert lower(Comp((mm,)), Target(batched_gemm=False)) == lower(Comp((mm,)), PRODUCTS)


def _convnet(prec: Precision = F32):
    x = T.term(label="img", batch_dims=[4], output_dims=[6, 6, 3], prec=prec)
    k1 = T.param("k1", output_dims=[8], input_dims=[3, 3, 3], prec=prec)
    k2 = T.param("k2", output_dims=[8], input_dims=[3, 3, 8], prec=prec)
    h = T.relu(conv2d(x, k1, padding=1))
    y = conv2d(h, k2, stride=2, padding=1)
    loss = T.sum(y * y)
    return x, [k1, k2], loss


class _DirectCpu(CpuBackend):
    """The CPU backend with im2col off: the direct loops, for comparison."""

    @property
    def target(self) -> Target:
        return replace(super().target, im2col=False)


def test_a_context_compiles_runs_and_keeps_the_patches_local():
    """Through a context: the same loss and gradients as with the direct loops; the patch nodes
    are local to the routine (no buffer of the context's, not readable from the host), and
    neither parameters nor inputs the routine needs."""
    results = []
    for ctx in (Context(CpuBackend()), Context(_DirectCpu())):
        x, params, loss = _convnet()
        ctx = ctx.set_values(x, np.random.default_rng(1).standard_normal(x.value.dims))
        comp = train.grad_update(loss)
        ctx, routine = ctx.compile(comp)
        for k, p in enumerate(params):
            ctx = ctx.set_values(p, np.random.default_rng(k).standard_normal(p.value.dims) * 0.3)
        ctx = ctx.run(routine)
        extra = [n for n in nodes_of(ctx.lower(comp)) if "_patch" in n.label]
        assert not any(n in routine.nodes or n in ctx.nodes() for n in extra)
        for n in extra:
            assert n.memory_mode is MemoryMode.local
            with pytest.raises(ValueError, match="local to the routines"):
                ctx.get_values(n)
        results.append((ctx.get_value(loss), [ctx.get_values(p.grad) for p in params], extra,
                        routine))
    (l_on, g_on, extra_on, r_on), (l_off, g_off, extra_off, _) = results
    assert extra_on and not extra_off
    assert not any(n in r_on.inputs for n in extra_on)
    np.testing.assert_allclose(l_on, l_off, rtol=1e-5)
    for a, b in zip(g_on, g_off, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_an_image_without_batch_axes(any_size):
    """``x[h, w, c]``: the patches are ``(oh, ow, kh, kw, c)``."""
    x, w, y = Tnode("x", (7, 6, 3), F32), Tnode("w", (4, 3, 3, 3), F32), Tnode("y", (7, 6, 4), F32)
    xi = (Affine(((1, 0), (1, 3)), -1), Affine(((1, 1), (1, 4)), -1), 5)
    space = (7, 6, 4, 3, 3, 3)
    assigns = [Accum(y, (0, 1, 2), "+", apply("mul", Get(x, xi), Get(w, (2, 3, 4, 5))), space,
                     True),
               Accum(w, (2, 3, 4, 5), "+", apply("mul", Get(y, (0, 1, 2)), Get(x, xi)), space,
                     True),
               Accum(x, xi, "+", apply("mul", Get(y, (0, 1, 2)), Get(w, (2, 3, 4, 5))), space)]
    rng = np.random.default_rng(5)
    vals = {n: rng.standard_normal(n.dims) for n in (x, w, y)}
    for a in assigns:
        got, code = _run(Comp((a,)), vals, im2col=True)
        direct, _ = _run(Comp((a,)), vals, im2col=False)
        assert len(_gemms(code)) == 1
        _close(got[a.lhs.id], direct[a.lhs.id], 42 * 27, np.finfo(np.float32).eps)




def test_a_gpu_keeps_the_canonical_patches():
    """The long runs are the CPU's (its gather copies runs): a GPU target, whose threads copy
    a cell each, keeps the canonical layout for the 1-channel kernel gradient."""
    from ocannl.backends.cuda.plan import cuda_target

    cv = Conv(4, 8, 8, 1, 8, 3, 1, 1)
    code = lower(Comp((cv.kernel_grad(),)), replace(cuda_target(), batched_gemm=False))
    [gather] = [n for n in nests(code) if n.assign.lhs.label.endswith("_patches")]
    assert gather.assign.lhs.dims == (4, 8, 8, 3, 3, 1)
