"""The CPU backend's buffers: where they start in memory."""

from __future__ import annotations

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, nn_blocks, train
from ocannl.backends.cpu.backend import aligned
from ocannl.ir.lowered import stored_nodes
from ocannl.ir.ops import Precision
from ocannl.ir.tnode import MemoryMode


def test_every_buffer_a_routine_binds_starts_on_a_cache_line():
    """Materialized buffers and the views of a routine's arena of local nodes (bf16: 2-byte
    cells, odd sizes; the products' f32 copies, nodes of lowering's own) all start at a
    multiple of 64 bytes, so no vector load or store of the generated code straddles two cache
    lines."""
    rng = np.random.default_rng(5)
    x = T.term(rng.normal(size=(24, 37)).astype(np.float32), label="alx",
               batch_dims=(24,), output_dims=(37,), prec="bf16")
    y, _ = nn_blocks.mlp(x, (19, 45), 7, label="al", prec="bf16")
    loss = T.sum(y * y)
    ctx = train.init_params(Context.cpu(), loss)
    comp = train.grad_update(loss)
    copies = [n for n in stored_nodes(ctx.lower(comp)) if n.memory_mode is MemoryMode.local
              and n.prec is Precision.f32]
    assert copies  # the products' f32 copies and results
    ctx, r = ctx.compile(comp)
    ctx.run(r)
    arrays = [a for a in r.buffers if a.size]
    assert len(arrays) > 10 and len(r.buffers) == len(arrays)
    assert [a.ctypes.data % 64 for a in arrays] == [0] * len(arrays)


def test_an_aligned_array_has_its_size_and_dtype_and_is_zero():
    for size, dtype in ((0, np.float32), (1, np.uint16), (1001, np.float64), (5000, np.float32)):
        a = aligned(size, np.dtype(dtype))
        assert (a.size, a.dtype) == (size, np.dtype(dtype))
        assert not a.any()
        if size:  # NumPy gives an empty slice the address of the array it slices
            assert a.ctypes.data % 64 == 0


@pytest.mark.parametrize("size", [-1, 2.5])
def test_an_aligned_array_of_a_size_that_is_no_count_is_refused(size):
    with pytest.raises(ValueError, match=f"got {size!r}"):
        aligned(size, np.dtype(np.float32))


def test_a_routine_compiled_to_count_adds_each_items_ticks_and_computes_the_same(
        monkeypatch, tmp_path):
    """``CpuBackend.count_item_cycles``: routines compiled from then on add, per lowered item,
    the counter ticks each run took; their own code (never the uncounted routine's, nor its
    cache entry), the same bits."""
    from ocannl.backends.cpu.backend import CpuBackend

    monkeypatch.setenv("OCANNL_CACHE_DIR", str(tmp_path))
    rng = np.random.default_rng(2)
    x = T.term(rng.normal(size=(16, 40)).astype(np.float32), label="cnx",
               batch_dims=(16,), output_dims=(40,))
    y, _ = nn_blocks.mlp(x, (48,), 5, label="cn")
    loss = T.sum(y * y)
    comp = train.grad_update(loss) + train.sgd_update(loss, learning_rate=0.01)

    def trained(counting: bool) -> tuple[list[bytes], object]:
        monkeypatch.setattr(CpuBackend, "_counting", counting)
        T.set_seed(4)
        ctx = train.init_params(Context.cpu(), loss)
        ctx, r = ctx.compile(comp)
        for _ in range(3):
            ctx.run(r)
        return [ctx.get_values(p).tobytes() for p in loss.params], r

    plain, r0 = trained(False)
    counted, r = trained(True)
    assert counted == plain and r0.compiled.cycles is None
    assert r.compiled is not r0.compiled and r.compiled.address != r0.compiled.address
    ticks = r.compiled.cycles.copy()
    assert ticks.shape == (len(r.lowered),) and len(r.lowered) > 5 and (ticks > 0).all()
    r.call()
    assert (r.compiled.cycles > ticks).all()
