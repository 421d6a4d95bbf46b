"""``Context.set_values``: only the node's own shape (or flat) is accepted, and values are rounded
once, from the value given, to the node's precision (checked against exact rounding computed
here with integers, independently of NumPy's and ml_dtypes' casts)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ocannl.tensor as T
from ocannl import Context, datasets
from ocannl.backends.rounding import to_precision
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import Tnode

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered")

# (significand bits including the implicit one, smallest normal exponent, largest exponent)
FORMATS = {Precision.f16: (11, -14, 15), Precision.bf16: (8, -126, 127),
           Precision.f32: (24, -126, 127)}


def exact_rounding(x: int | float, prec: Precision) -> float:
    """``x`` rounded to nearest, ties to even, in ``prec``, with integer arithmetic only."""
    p, emin, emax = FORMATS[prec]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return x
    if x == 0:
        return math.copysign(0.0, x) if isinstance(x, float) else 0.0
    sign = -1.0 if x < 0 else 1.0
    if isinstance(x, int):
        n, k = abs(x), 0
    else:
        n, d = abs(x).as_integer_ratio()
        k = d.bit_length() - 1  # d is a power of two
    e = n.bit_length() - 1 - k  # floor(log2 |x|)
    if e > emax:
        return sign * math.inf  # at least 2**(emax + 1): beyond the largest value and a half
    q = max(e, emin) - (p - 1)  # the exponent of one unit in the last place
    s = k + q  # |x| / 2**q == n / 2**s
    if s <= 0:
        m = n << -s
    else:
        m = n >> s
        rem, half = n - (m << s), 1 << (s - 1)
        if rem > half or (rem == half and m & 1):
            m += 1
    largest = (2 ** p - 1) * 2.0 ** (emax - p + 1)
    value = math.ldexp(m, q)
    return sign * (math.inf if value > largest else value)


def positive_values(prec: Precision) -> np.ndarray:
    """Every finite positive value of ``prec``, ascending, as f64 (widening is exact)."""
    if prec is Precision.f32:
        rng = np.random.default_rng(1)
        bits = np.unique(np.concatenate([
            np.arange(1, 4097), rng.integers(1, 0x7F800000, 20000),
            np.arange(0x7F7FF000, 0x7F800000)]).astype(np.uint32))
        return bits.view(np.float32).astype(np.float64)
    bits = np.arange(1, 0x7C00 if prec is Precision.f16 else 0x7F80, dtype=np.uint16)
    return bits.view(prec.numpy_dtype).astype(np.float64)


def boundary_cases(prec: Precision) -> np.ndarray:
    """f64 values at and around every rounding boundary of ``prec``: each midpoint between
    neighbours (the overflow threshold included), one f64 ulp either side, offsets below f32's
    resolution (which a rounding through f32 would erase), the values themselves, and tiny
    values around half the smallest subnormal; with both signs."""
    v = positive_values(prec)
    p, _, emax = FORMATS[prec]
    top = 2.0 ** (emax + 1)  # where the next value would be
    nxt = np.append(v[1:], top)
    mid = v / 2 + nxt / 2  # exact: both halves and their sum are representable
    tiny = v[0] / 2
    parts = [mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), mid * (1 + 2.0 ** -30),
             mid * (1 - 2.0 ** -30), mid * (1 + 2.0 ** -26), v,
             np.array([tiny, np.nextafter(tiny, 0), np.nextafter(tiny, 1), tiny / 2, 5e-324,
                       top, 1e300, 1 + 2.0 ** -8 + 2.0 ** -30, 1 + 2.0 ** -11 + 2.0 ** -40])]
    pos = np.concatenate(parts)
    return np.concatenate([pos, -pos, [0.0, -0.0, np.inf, -np.inf]])


def as_bits(a: np.ndarray) -> np.ndarray:
    """f64 bit patterns, every NaN as one pattern (payloads are not compared)."""
    a = np.asarray(a, np.float64)
    return np.where(np.isnan(a), np.uint64(0x7FF8000000000000), a.view(np.uint64))


def written(prec: Precision, host: np.ndarray) -> np.ndarray:
    """What ``set_values`` stores on the CPU backend, widened to f64."""
    node = Tnode(f"r_{prec.value}", (host.size,), prec)
    ctx = Context.cpu().set_values(node, host)
    got = ctx.get_values(node)
    assert got.dtype == prec.numpy_dtype
    return got.astype(np.float64)


def test_the_issue_example_rounds_once() -> None:
    got = written(Precision.bf16, np.array([1 + 2.0 ** -8 + 2.0 ** -30]))
    assert got.tolist() == [1.0078125]


@pytest.mark.parametrize("prec", [Precision.bf16, Precision.f16, Precision.f32])
def test_f64_values_round_once_at_every_boundary(prec: Precision) -> None:
    host = boundary_cases(prec)
    expected = np.array([exact_rounding(float(x), prec) for x in host])
    got = written(prec, host)
    bad = np.nonzero(as_bits(got) != as_bits(expected))[0]
    assert bad.size == 0, [(float(host[i]).hex(), got[i], expected[i]) for i in bad[:10]]


@pytest.mark.parametrize("prec", [Precision.bf16, Precision.f16])
def test_f32_inputs_round_once(prec: Precision) -> None:
    v = positive_values(prec)
    mid = (v[:-1] / 2 + v[1:] / 2).astype(np.float32)  # exact in f32
    host = np.concatenate([mid, np.nextafter(mid, np.float32(0)),
                           np.nextafter(mid, np.float32(np.inf))])
    host = np.concatenate([host, -host])
    expected = np.array([exact_rounding(float(x), prec) for x in host])
    assert (as_bits(written(prec, host)) == as_bits(expected)).all()


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32])
def test_integers_beyond_f64_precision_round_once_to_bf16(dtype: type) -> None:
    """64-bit integers do not fit in f64: converting through it would round twice."""
    top = 62 if dtype is np.int64 else 63
    if dtype is np.int32:
        top = 30
    cases: list[int] = []
    for e in range(20, top + 1):
        for m in (0x80, 0x81, 0xFE, 0xFF):  # neighbours m, m + 1 at scale 2**(e - 7)
            lo = m << (e - 7)
            mid = lo + (1 << (e - 8))
            cases += [mid, mid - 1, mid + 1, lo, mid + (1 << max(e - 40, 0))]
    ints = [c for c in cases if c < 2 ** top]
    if dtype is not np.uint64:
        ints += [-c for c in ints]
    host = np.array(ints, dtype=dtype)
    expected = np.array([exact_rounding(int(x), Precision.bf16) for x in host])
    assert (as_bits(written(Precision.bf16, host)) == as_bits(expected)).all()


def test_long_double_inputs_round_once() -> None:
    if np.finfo(np.longdouble).nmant <= 52:
        pytest.skip("long double is f64 here")
    base = np.longdouble(1) + np.longdouble(2.0 ** -8)
    host = np.array([base + np.longdouble(2.0) ** -60, base - np.longdouble(2.0) ** -60, base],
                    dtype=np.longdouble)
    got = written(Precision.bf16, host)
    assert got.tolist() == [1.0078125, 1.0, 1.0]  # the tie goes to even (1.0)


def test_to_precision_keeps_nan_and_handles_scalars() -> None:
    out = to_precision(np.array([np.nan, -np.nan, 1.5]), Precision.bf16)
    assert np.isnan(out[:2].astype(np.float32)).all() and out[2] == 1.5
    assert to_precision(np.array(1 + 2.0 ** -8 + 2.0 ** -30), Precision.bf16) == 1.0078125
    assert to_precision(np.array(True), Precision.f16) == 1.0
    assert to_precision(np.array([3], ml_dtypes.bfloat16), Precision.f16).tolist() == [3.0]
    with pytest.warns(RuntimeWarning, match="overflow encountered in cast to f16"):
        assert to_precision(np.array([1e5, 1.0]), Precision.f16)[0] == np.inf


@pytest.mark.parametrize("prec", [Precision.f16, Precision.bf16])
def test_values_of_the_node_precision_are_stored_bit_for_bit(prec: Precision) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)  # NaN payloads and signs included
    node = Tnode("same", (bits.size,), prec)
    ctx = Context.cpu().set_values(node, bits.view(prec.numpy_dtype))
    assert np.array_equal(ctx.get_values(node).view(np.uint16), bits)


# --- shapes -----------------------------------------------------------------------------------


def test_a_transposed_batch_is_refused_and_changes_nothing() -> None:
    points, _ = datasets.half_moons(256)
    x = T.term(points, label="x")  # dims (256, 2)
    ctx = Context.cpu().set_values(x, points)
    before = ctx.get_values(x).copy()
    with pytest.raises(ValueError, match=r"shape \(2, 256\).*dims \(256, 2\)") as err:
        ctx.set_values(x, points.T)
    assert "x" in str(err.value) and "(512,)" in str(err.value)
    np.testing.assert_array_equal(ctx.get_values(x), before)
    fresh = Context.cpu()
    with pytest.raises(ValueError, match=r"\(2, 256\)"):
        fresh.set_values(x, points.T)
    assert not fresh.is_allocated(x) if hasattr(fresh, "is_allocated") else fresh.mem() == 0


def test_exact_dims_flat_and_one_element_scalars_are_accepted() -> None:
    node = Tnode("w", (3, 4), Precision.f32)
    ctx = Context.cpu().set_values(node, np.arange(12.0).reshape(3, 4))
    ctx = ctx.set_values(node, np.arange(12.0) + 1)  # flat: row-major
    np.testing.assert_array_equal(ctx.get_values(node), np.arange(1.0, 13).reshape(3, 4))
    for bad in (np.zeros((4, 3)), np.zeros((12, 1)), np.zeros((1, 12)), np.zeros((2, 6)),
                np.zeros((3, 4, 1)), np.float32(1.0)):
        with pytest.raises(ValueError, match=rf"shape {re_shape(bad.shape)}.*\(3, 4\)"):
            ctx.set_values(node, bad)
    np.testing.assert_array_equal(ctx.get_values(node), np.arange(1.0, 13).reshape(3, 4))
    one = Tnode("lr", (), Precision.f32)
    ctx = ctx.set_values(one, 0.5).set_values(one, [0.25]).set_values(one, np.float64(0.125))
    assert ctx.get_value(one) == 0.125
    col = Tnode("c", (1,), Precision.f32)
    ctx = ctx.set_values(col, 2.0).set_values(col, [3.0])
    assert ctx.get_value(col, (0,)) == 3.0


def test_staged_blocks_are_checked_as_set_values_checks_and_refuse_any_other_shape() -> None:
    """``Staged.check``: ``k`` blocks of the node's dims stacked on the first axis (or flat),
    one check of the dtype and shape, the node's own value check per block; a shape that is
    not exactly that is refused naming both, and nothing is written."""
    node = Tnode("x", (2, 3), Precision.bf16)
    values = np.arange(18.0).reshape(6, 3) / 7
    ctx = Context.cpu().set_values(node, np.zeros((2, 3)))
    staged = ctx.staged(node, 3)
    for good in (values, values.ravel(), values.T.copy().T, values.astype(np.float64).tolist()):
        assert staged.check(good).host.tobytes() == values.reshape(-1).tobytes()
    for bad in (np.zeros((3, 6)), np.zeros((6, 2)), np.zeros((4, 3)), np.zeros(17)):
        with pytest.raises(ValueError, match=rf"set_values on x\w*: got {bad.size} values of shape "
                                             rf"{re_shape(bad.shape)}, expected 3 blocks of the "
                                             r"node's dims \(2, 3\) stacked on the first axis "
                                             r"\(6, 3\) or flat \(18,\)"):
            staged.check(bad)
    with pytest.raises(ValueError, match=r"values must be numbers \(real\), got dtype <U1"):
        staged.check(np.full((6, 3), "a"))
    for count in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=rf"staged on x\w*: blocks must be an int >= 1, "
                                             rf"got {count!r}"):
            ctx.staged(node, count)
    scalar = Tnode("lr", (), Precision.f32)
    with pytest.raises(ValueError, match=r"expected 2 blocks .* \(none: the node has no axis\)"):
        ctx.staged(scalar, 2).check(np.zeros(2))
    ids = T.class_ids(batch_dims=(2,), num_classes=3, label="ids")
    with pytest.raises(ValueError, match=r"class ids ids: value 5 at position \(1,\) is out"):
        ctx.staged(ids, 2).check(np.array([0, 1, 2, 5]))  # the second block's second id
    np.testing.assert_array_equal(ctx.get_values(node), np.zeros((2, 3)))


@pytest.mark.parametrize("prec", [Precision.bf16, Precision.f32, Precision.f64])
def test_staged_blocks_round_as_set_values_and_refuse_values_it_did_not_check(
        prec: Precision) -> None:
    """``Context.staged``: the first block into the node's own buffer, the later ones into a
    buffer of their own, written in one call (each rounded once, as ``set_values`` rounds:
    16-bit nodes through the backend's write, f32 and f64 ones by NumPy's copy), ``put``
    copying a later one into the node; values checked by another Staged (another node,
    another block count) or not checked are refused naming what they are, with nothing
    written (the node, the later blocks)."""
    node, other = Tnode("x", (2, 3), prec), Tnode("y", (2, 3), prec)
    values = np.arange(18.0).reshape(6, 3) / 7  # not bf16 (nor f32) numbers
    ctx = Context.cpu()
    staged = ctx.staged(node, 3)
    assert len(staged.views) == 3 and staged.context is ctx
    assert ctx.mem() == 3 * node.size * prec.itemsize  # the node and its two later blocks
    with pytest.raises(ValueError, match="nothing has initialized"):
        ctx.get_values(node)
    staged.write(staged.check(values))
    wants = [Context.cpu().set_values(node, values[2 * b:2 * b + 2]).get_values(node)
             for b in range(3)]
    assert ctx.get_values(node).tobytes() == wants[0].tobytes()
    for b in (1, 2):
        staged.put(b)
        assert ctx.get_values(node).tobytes() == wants[b].tobytes()
    before = [v.copy() for v in staged.views]
    for bad, named in ((ctx.staged(node, 2).check(values[2:]), r"node id \d+, 2 block\(s\)"),
                       (ctx.staged(other, 3).check(values), r"node id \d+, 3 block\(s\)"),
                       (values, r"ndarray")):
        with pytest.raises(ValueError, match=rf"Staged\(x\w*, 3 blocks\) takes values it checked "
                                             rf"\(Staged.check\), got .*{named}"):
            staged.write(bad)
    assert all(np.array_equal(v, w) for v, w in zip(staged.views, before, strict=True))
    for block in (0, 3, -1):
        with pytest.raises(ValueError, match=rf"put: block {block}: expected a later block, 1 "
                                             r"to 2"):
            staged.put(block)
    assert ctx.get_values(node).tobytes() == wants[2].tobytes()
    held = ctx.mem()
    one = ctx.staged(node, 1)  # a block of one: the node alone, nothing apart
    assert len(one.views) == 1 and ctx.mem() == held
    one.write(one.check(values[:2]))
    assert ctx.get_values(node).tobytes() == wants[0].tobytes()


@pytest.mark.parametrize("prec", [Precision.f64, Precision.f32, Precision.bf16])
def test_strided_and_column_major_values_are_written_in_row_major_order(prec: Precision) -> None:
    """A view (a column slice, a transpose of the transposed, Fortran order) is written by its
    logical indices, not by its memory order."""
    node = Tnode("w", (3, 4), prec)
    ctx = Context.cpu()
    wide = np.arange(24.0).reshape(3, 8)
    for values in (wide[:, ::2], np.asfortranarray(wide[:, :4]), wide[:, :4].T.copy().T,
                   wide[:, 4:].astype(np.float32)):
        ctx.set_values(node, values)
        np.testing.assert_array_equal(ctx.get_values(node).astype(np.float64), values)
    flat_view = np.arange(24.0)[::2]
    ctx.set_values(node, flat_view)
    np.testing.assert_array_equal(ctx.get_values(node).reshape(-1).astype(np.float64), flat_view)


def re_shape(shape: tuple[int, ...]) -> str:
    return str(shape).replace("(", r"\(").replace(")", r"\)")


# --- fuzz: any bad input raises a documented error and changes nothing -------------------------

_DIMS = (3, 4)
_BAD_SCALARS = st.one_of(st.text(max_size=3), st.none(), st.complex_numbers(allow_nan=False),
                         st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                         st.just(object()), st.binary(max_size=4))


def _arrays_of_wrong_shape() -> st.SearchStrategy:
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=13).filter(
        lambda s: s not in (_DIMS, (12,)))
    dtypes = st.one_of(hnp.floating_dtypes(), hnp.integer_dtypes(), hnp.boolean_dtypes())
    return hnp.arrays(dtypes, shapes)


_BAD_VALUES = st.one_of(
    _arrays_of_wrong_shape(),
    hnp.arrays(st.one_of(hnp.complex_number_dtypes(), hnp.unicode_string_dtypes(),
                         hnp.datetime64_dtypes(), hnp.timedelta64_dtypes()), st.just(_DIMS)),
    _BAD_SCALARS,
    st.lists(_BAD_SCALARS, min_size=1, max_size=12),
    st.lists(st.lists(st.floats(), min_size=0, max_size=5), min_size=2, max_size=4).filter(
        lambda rows: len({len(r) for r in rows}) > 1),  # ragged (a 3 x 4 list would be good)
    st.lists(st.integers(min_value=2 ** 64, max_value=2 ** 80), min_size=12, max_size=12),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bad=_BAD_VALUES, prec=st.sampled_from(list(Precision)))
def test_fuzz_bad_values_raise_documented_errors_and_change_nothing(bad: object,
                                                                    prec: Precision) -> None:
    node = Tnode("fuzz", _DIMS, prec)
    ctx = Context.cpu().set_values(node, np.arange(12.0))
    before = ctx.get_values(node).tobytes()
    mem = ctx.mem()
    with pytest.raises((ValueError, TypeError)):
        ctx.set_values(node, bad)
    assert ctx.get_values(node).tobytes() == before
    fresh_node = Tnode("fresh", _DIMS, prec)
    with pytest.raises((ValueError, TypeError)):
        ctx.set_values(fresh_node, bad)
    assert ctx.mem() == mem  # nothing allocated


@settings(max_examples=60, deadline=None)
@given(values=hnp.arrays(st.one_of(hnp.floating_dtypes(), hnp.integer_dtypes()),
                         st.sampled_from([_DIMS, (12,)])),
       prec=st.sampled_from(list(Precision)))
def test_fuzz_good_values_are_stored_rounded_once(values: np.ndarray, prec: Precision) -> None:
    node = Tnode("ok", _DIMS, prec)
    ctx = Context.cpu().set_values(node, values)
    got = ctx.get_values(node).reshape(-1)
    flat = values.reshape(-1)
    if prec in FORMATS:
        exp = [exact_rounding(int(v) if values.dtype.kind in "iu" else float(v), prec)
               for v in flat]
        assert (as_bits(got.astype(np.float64)) == as_bits(np.array(exp))).all()
    else:  # f64: every tested dtype but long double widens exactly
        if values.dtype.itemsize <= 8 or values.dtype.kind != "f":
            np.testing.assert_array_equal(got, flat.astype(np.float64))


# --- issue 38, 7: the nodes an optimizer reads as rates take finite values only ----------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e39])
def test_a_non_finite_learning_rate_is_refused_naming_the_node(bad: float) -> None:
    """``ctx.set_values(lr, [nan])`` then a (gated) step applied the NaN to every weight: the
    gate checks only gradients. Refused, naming the node; the rate keeps its value, and a
    context that never held it allocates nothing (the rule is the node's, in every context).
    1e39 is finite in f64 but overflows the f32 node."""
    from ocannl import optim

    lr = T.term([0.01], label="lr")
    opt = optim.SGD(lr, momentum=0.9)
    ctx = Context.cpu().set_values(lr, [0.02])
    with pytest.raises(ValueError, match=r"set_values on lr_\d+: the learning rate of "
                                         r"SGD must be finite, got ") as err:
        ctx.set_values(lr, [bad])
    assert repr(bad) in str(err.value)
    assert ctx.get_value(lr, (0,)) == np.float32(0.02)
    fresh = Context.cpu()
    with pytest.raises(ValueError, match=r"the learning rate of SGD must be finite"):
        fresh.set_value(lr, bad, (0,))
    assert not fresh.is_allocated(lr)
    assert opt.learning_rate is lr


def test_a_non_finite_schedule_counter_is_refused_naming_the_node() -> None:
    """The step counter a schedule reads its rate from: a NaN there is a NaN rate."""
    from ocannl import optim, schedules

    opt = optim.Adam(schedules.StepLR(0.1, step_size=3))
    node = opt.schedule_counter
    ctx = Context.cpu().set_values(node, 4.0)
    with pytest.raises(ValueError, match=rf"set_values on {node.name}: the step counter "
                                         rf"Adam's schedule reads its rate from must be finite, "
                                         rf"got nan"):
        ctx.set_values(node, math.nan)
    assert ctx.get_value(node) == 4.0


def test_a_learning_rate_tensor_holding_nan_is_refused_by_the_optimizer() -> None:
    """A term built over a NaN would be copied into every context that allocates it."""
    from ocannl import optim

    lr = T.term([math.nan], label="lr_nan")
    with pytest.raises(ValueError, match=r"Adam: lr_nan_\d+, the learning rate of Adam, holds nan: "
                                         r"expected a finite number"):
        optim.Adam(lr)
    assert lr.value.check_values is None
