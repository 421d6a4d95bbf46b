"""The CPU backend: one LLVM-compiled function per routine, over flat NumPy buffers.

Lowered code goes straight to LLVM IR (``codegen.py``), which LLVM optimizes for this CPU and
loads into the process (``jit.py``, with an on-disk cache of the machine code). Products call
the BLAS ``blas.py`` chose (MKL, NumPy's OpenBLAS or SciPy's). A bound routine is a built-in
callable (``entry.py``) that passes the compiled code one argument, a table of its buffers'
addresses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from ocannl.backends.arena import ALIGN_BYTES
from ocannl.backends.cpu import blas, entry, jit, native_products
from ocannl.backends.cpu.codegen import one_thread_products, routine_ir, signature
from ocannl.backends.rounding import to_precision
from ocannl.ir.lowered import Lowered
from ocannl.ir.ops import Precision
from ocannl.ir.target import Target
from ocannl.ir.tnode import Tnode


def storage_dtype(prec: Precision) -> np.dtype:
    """The dtype of this backend's buffers: f16 and bf16 are stored as their bit patterns
    (uint16), converted in the generated code."""
    return np.dtype(np.uint16) if prec.is_narrow else prec.numpy_dtype


def aligned(size: int, dtype: np.dtype, zero: bool = True) -> np.ndarray:
    """A flat array of ``size`` elements starting on a cache line (``ALIGN_BYTES``), so a
    vector of 32 or 64 bytes never straddles two. NumPy's own large arrays start 16 bytes
    into a page, where every other 32-byte access crossed a line (in-process A/B, steps paired
    by block, aligned / NumPy's: mlp_wide f32 0.966x, gpt_mini f32 0.964x, convnet f32
    0.968x)."""
    if not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"aligned: size must be a count of elements >= 0, got {size!r}")
    dtype = np.dtype(dtype)
    raw = (np.zeros if zero else np.empty)(size * dtype.itemsize + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + size * dtype.itemsize].view(dtype)


def emit_ir(code: list[Lowered], nodes: list[Tnode]) -> list[str]:
    """The LLVM IR of a routine over ``nodes``, one text per part (buffers named by position,
    so the same code over other nodes is the same text)."""
    return routine_ir(code, nodes, jit.target())


class CpuBackend:
    """Buffers are flat NumPy arrays; routines are LLVM-compiled functions, cached by IR."""

    name = "cpu"
    _compiled: dict[str, CompiledRoutine] = {}  # shared by every CPU context in the process
    # Set (``count_item_cycles``): routines compiled from then on count each item's ticks.
    _counting = False

    def __init__(self) -> None:
        native_products.paths()  # a refused OCANNL_*_PRODUCTS is refused here, named

    def describe(self) -> str:
        library = blas.chosen()
        return (f"cpu: {jit.threads()} threads, BLAS {library.name} "
                f"({library.path or 'SciPy'}); {native_products.describe()}")

    @property
    def target(self) -> Target:
        """What lowering may rely on here: BLAS products (batched, im2col, small ones inline),
        this process's threads and the CPU's conversions (``jit.target``)."""
        return jit.target()

    def alloc(self, node: Tnode) -> np.ndarray:
        return aligned(node.size, storage_dtype(node.prec))

    def write(self, node: Tnode, buf: np.ndarray, host: np.ndarray) -> None:
        """Round ``host`` once, from the values given, to the node's precision (ties to even;
        a plain cast to bf16 would go through f32 and could round twice) and copy it in place."""
        if node.prec.is_narrow:
            buf.view(node.prec.numpy_dtype)[...] = to_precision(host, node.prec).reshape(-1)
        else:
            buf[...] = host  # NumPy's casts to f32 / f64 round once (copyto's, at half the cost)

    def writer(self, node: Tnode, buf: np.ndarray) -> Callable[[np.ndarray], None]:
        """:meth:`write` bound to ``buf``; for an f32 or f64 node NumPy's copy alone (a batch
        staged every step, without the call around it)."""
        if node.prec.is_narrow:
            return functools.partial(self.write, node, buf)
        return functools.partial(buf.__setitem__, Ellipsis)

    def read(self, node: Tnode, buf: np.ndarray) -> np.ndarray:
        return (buf.view(node.prec.numpy_dtype) if node.prec.is_narrow else buf).copy()

    @staticmethod
    def reader(node: Tnode, buf: np.ndarray, pos: int) -> Callable[[], float]:
        if node.prec.is_narrow:
            values = buf.view(node.prec.numpy_dtype)
            return lambda: float(values[pos])
        return functools.partial(buf.item, pos)  # a Python float, straight from memory

    def bind(self, compiled: CompiledRoutine, buffers: tuple) -> Callable[[], None]:
        return compiled.bind(buffers)

    @staticmethod
    def gated(first: tuple[CompiledRoutine, tuple], second: tuple[CompiledRoutine, tuple],
              flag: np.ndarray, pos: int) -> Callable[[], bool]:
        """One call running ``first`` (compiled code and its buffers), then ``second`` only
        when the f32 ``flag[pos]`` is finite, and returning whether it was (``entry.py``)."""
        (c1, b1), (c2, b2) = first, second
        (t1, a1), (t2, a2) = CompiledRoutine.table(b1), CompiledRoutine.table(b2)
        return entry.gated_builtin(jit.gated_trampoline(), (c1.address, t1), (c2.address, t2),
                                   flag.ctypes.data + flag.itemsize * pos, (a1, a2, flag))

    def compile(self, label: str, code: list[Lowered], nodes: list[Tnode]
                ) -> tuple[CompiledRoutine, bool]:
        """The routine's machine code: from this process, from the disk cache (no IR is
        built), or compiled now; and whether it was not already in this process."""
        target = jit.target()
        jit.size_pool(target)
        cycles = np.zeros(len(code), np.int64) if CpuBackend._counting else None
        counted = "" if cycles is None else f"\ncycles at {cycles.ctypes.data}"
        key = jit.key_of(signature(code, nodes, target) + counted)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled, False
        hit = jit.load(key)
        if hit is None:
            texts = routine_ir(code, nodes, target, 0 if cycles is None else cycles.ctypes.data)
            hit = (jit.compile_ir(key, texts, single_blas=one_thread_products(code),
                                  bits=target.vector_bits), False)
        compiled = self._compiled[key] = CompiledRoutine(*hit)
        compiled.cycles = cycles
        return compiled, True

    @staticmethod
    def count_item_cycles() -> None:
        """Compile every later routine of this process to count, per item, the time-stamp
        counter's ticks its runs took (``CompiledRoutine.cycles``): a profile of the items in
        place, inside the step, for ``benchmarks/item_cycles.py``. Each such routine is compiled
        anew (the counts' address is in its code); point ``OCANNL_CACHE_DIR`` at a scratch
        directory, as that script does."""
        CpuBackend._counting = True


class CompiledRoutine:
    """Machine code shared by every routine with the same IR, bound to buffers once: a table
    of their addresses, in the order of the routine's nodes."""

    def __init__(self, address: int, from_disk: bool) -> None:
        self.address = address
        self.loaded_from_disk = from_disk  # the on-disk cache supplied the machine code
        # Counter ticks per lowered item, summed over runs (CpuBackend.count_item_cycles).
        self.cycles: np.ndarray | None = None

    @staticmethod
    def table(buffers: Sequence[np.ndarray]) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """The routine's table over ``buffers``, and every array it points into (valid while
        they live)."""
        return np.array([a.ctypes.data for a in buffers], dtype=np.int64), tuple(buffers)

    def bind(self, buffers: tuple[np.ndarray, ...]) -> Callable[[], None]:
        table, arrays = self.table(buffers)
        # The addresses stay valid while the builtin lives: it holds the arrays.
        return entry.builtin(jit.trampoline(), self.address, table, arrays)
