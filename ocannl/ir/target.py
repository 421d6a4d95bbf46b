"""The target record: what a backend can do, in one value that lowering reads.

Lowering makes every choice a backend would otherwise make for itself (which products go to a
library, which stay in registers, which copies are widened, which loops are shared over
threads and how, which reductions run as vectors, how values convert and store, how a GPU
launches each kernel) from this record alone, and writes each choice into the lowered items.
A renderer then reads the items and decides nothing: two
backends with the same record get the same lowered code, and a third backend is a new record
plus a renderer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ocannl.ir.ops import Precision


@dataclass(frozen=True)
class Target:
    """What lowering may rely on.

    Products: ``gemm``, products go to a library (BLAS on the CPU, cuBLAS on CUDA);
    ``batched_gemm``, batched ones too (a call per batch point, strided rows); ``im2col``,
    convolutions through patches and a product; ``native_products``, the 16-bit precisions the
    library multiplies as stored, accumulating in f32, when both operands are in it (others are
    widened to f32 copies first); ``inline_product_work``, products of at most this many
    multiply-adds each are computed inline, in registers (0: never), with columns
    ``inline_vector_bytes`` wide and a transposed right operand packed when it has at most
    ``inline_pack_cells`` cells; ``inline_native_work``, the same bound for products whose
    operands the library would take as stored (a native kernel beats the loops sooner).

    Threads: ``threads`` share a large loop's outermost loop; ``products_shared``, products are
    shared over them too, each large one cut into ``product_parts`` parts (whole blocks of
    rows or columns, by shape: the same parts whatever the thread count), each part a
    single-threaded library call; ``parallel_scatters``, a scatter may be shared by its first
    axis.

    Arithmetic and code: ``hardware_f16``, f16 converts with the CPU's instructions (F16C)
    rather than integer code, which also lets 16-bit reads widen in vectors; ``workers``, how
    many parts a large routine is cut into for the compiler; ``avx``, clear the vector
    registers' upper halves at each item's start; ``vector_bits``, the width of the vectors
    loops are compiled for (256, or 512 where the CPU keeps its clock under them: the same
    bits either way); ``blas_int``, the bits of the BLAS's integer arguments (32, or 64 for an
    ILP64 build); ``fma``, the compiler may contract a multiply and an add into one fused
    operation (CUDA's ``--fmad``: one rounding fewer, other bits than the plain loops);
    ``tf32``, f32 products may round their operands to TF32 on tensor cores (``Gemm.tf32``).

    A GPU: ``gpu_block``, its kernels' threads per block (0: not a GPU); every loop group is
    then mapped onto threads and blocks (``LoopGroup.mapping``, ``grid`` and ``block``);
    ``gpu_sms``, its multiprocessors: a small map's blocks shrink until they fill as many, and
    a gather too short to fill them takes a block per cell.
    """

    name: str = "cpu"
    gemm: bool = True
    batched_gemm: bool = True
    im2col: bool = True
    native_products: frozenset[Precision] = frozenset()
    inline_product_work: int = 1 << 18
    inline_native_work: int = 1 << 18
    inline_vector_bytes: int = 64
    inline_pack_cells: int = 1 << 14
    threads: int = 1
    products_shared: bool = False
    product_parts: int = 1
    parallel_scatters: bool = True
    hardware_f16: bool = True
    workers: int = 1
    avx: bool = False
    vector_bits: int = 256
    blas_int: int = 32
    fma: bool = False
    tf32: bool = False
    gpu_block: int = 0
    gpu_sms: int = 0


# Reference targets, for lowering without a backend (tests, tools): loops only, no library
# products; library products (not batched, no im2col), one thread.
LOOPS = Target(name="loops", gemm=False, batched_gemm=False, im2col=False, inline_product_work=0)
PRODUCTS = Target(name="products", batched_gemm=False, im2col=False)
