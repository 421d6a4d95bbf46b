"""oneDNN's bf16 product, for CPUs whose BLAS has none that uses their bf16 units.

MKL's ``gemm_bf16bf16f32`` runs on AMX-BF16 and AVX512-BF16 on Intel's CPUs only: on an AMD
EPYC (Zen 5) with AVX512-BF16 (``benchmarks/ab_routines.py``: one thread, 1024^3) it ran at
its ``sgemm``'s rate, 95.2 against 96.9 GFLOP/s, while oneDNN's ``dnnl_gemm_bf16bf16f32``,
which picks its kernels by the CPU's flags, ran 431 through the shim below (NumPy's OpenBLAS
``sgemm``: 111). NumPy's OpenBLAS wheels have no ``sbgemm``. So where
the BLAS in use has no bf16 routine of the CPU's units, oneDNN's serves bf16 products: the
``onednn-cpu-gomp`` wheel (the ``onednn`` extra), whose ``libdnnl.so.3`` needs only the system's
``libgomp``.

oneDNN takes its arguments by value and row-major; a routine's products call a BLAS's Fortran
interface, column-major. A small function compiled here (:func:`shim_ir`) turns the one into
the other (stopping the process, named, if oneDNN ever refuses a call's arguments, rather
than going on with an unwritten result), and sets the calling thread's OpenMP thread count
to 1 first: the routine's own threads share a product by whole blocks, one call each, so that
its bits do not depend on how many threads there are (OpenMP's count is per thread: the
pool's workers would otherwise each start a team of their own).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path

import llvmlite.binding as llvm

LIBRARY = "libdnnl.so.3"
ROUTINE = "dnnl_gemm_bf16bf16f32"
SHIM = "ocannl_onednn_gemm_bf16"
# Products of up to this many multiply-adds stay inline (``Target.inline_native_work``):
# ``benchmarks/ab_native_products.py`` on a 2-core AMD EPYC with AVX512-BF16 found oneDNN's
# call ahead from 65,536 on (0.89x-1.02x the loops' time there, 0.51x-0.66x from 110,592),
# behind below (1.12x-1.22x at 49,152, 3.4x at 4,096).
INLINE_WORK = 1 << 16
# What a refused call prints before it stops the process: the routine's arguments come from
# lowering, so a refusal is a bug, and going on would leave the product's output unwritten.
FAILED = "ocannl: dnnl_gemm_bf16bf16f32 refused its arguments\n"


@dataclass(frozen=True)
class OneDnn:
    """The loaded library: its file, version (``"3.2.0"``) and the address of :data:`SHIM`,
    which takes ``sgemm``'s Fortran arguments (``int_bits``-wide integers, bf16 operands)."""

    path: str
    version: str
    shim: int
    int_bits: int


_loaded: dict[int, OneDnn | str] = {}
_keep: list[object] = []  # the library's handle and the shim's engine live with the process


def bf16_product(int_bits: int) -> OneDnn | str:
    """oneDNN's bf16 product with ``int_bits``-wide integer arguments (the BLAS in use's
    width), loaded on first use from this environment's ``lib`` folder; where it cannot be,
    why, as a phrase."""
    if int_bits not in _loaded:
        _loaded[int_bits] = _load(Path(sys.prefix) / "lib" / LIBRARY, int_bits)
    return _loaded[int_bits]


def _load(path: Path, int_bits: int) -> OneDnn | str:
    if not path.is_file():
        return f"no {LIBRARY} under {path.parent} (pip install onednn-cpu-gomp)"
    try:
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        routine, threads = lib[ROUTINE], lib["omp_set_num_threads"]
        version = lib["dnnl_version"]
    except (OSError, AttributeError) as err:
        return f"{path} could not be used: {err}"
    version.restype = ctypes.POINTER(ctypes.c_int * 3)
    major, minor, patch = version().contents
    refused = _probe(routine)
    if refused:
        return f"oneDNN {major}.{minor}.{patch} ({path}) {refused}"
    addresses = {name: ctypes.cast(f, ctypes.c_void_p).value or 0
                 for name, f in ((ROUTINE, routine), ("omp_set_num_threads", threads))}
    libc = ctypes.CDLL(None)
    addresses.update({name: ctypes.cast(getattr(libc, name), ctypes.c_void_p).value or 0
                      for name in ("write", "abort")})
    shim, engine = _compile(shim_ir(int_bits), addresses)
    _keep.extend((lib, engine))
    return OneDnn(str(path), f"{major}.{minor}.{patch}", shim, int_bits)


def _probe(routine: ctypes._CFuncPtr) -> str:
    """Why oneDNN's routine will not do here (``""``: it will): one 1x1x1 product of ones. On a
    CPU without AVX-512 oneDNN has no bf16 product and answers "unimplemented"."""
    d, f, p = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    routine.restype = ctypes.c_int
    routine.argtypes = [ctypes.c_char, ctypes.c_char, d, d, d, f, p, d, p, d, f, p, d]
    one, out = (ctypes.c_uint16 * 1)(0x3F80), (ctypes.c_float * 1)(0.0)  # bf16 1.0
    status = routine(b"N", b"N", 1, 1, 1, 1.0, ctypes.addressof(one), 1, ctypes.addressof(one),
                     1, 0.0, ctypes.addressof(out), 1)
    if status != 0:
        return f"has no bf16 product on this CPU (status {status})"
    return "" if out[0] == 1.0 else f"multiplied 1 by 1 into {out[0]}"


def shim_ir(int_bits: int) -> str:
    """``void SHIM(char *transa, char *transb, int *m, int *n, int *k, float *alpha,
    bf16 *a, int *lda, bf16 *b, int *ldb, float *beta, float *c, int *ldc)``, column-major,
    as one call of oneDNN's row-major routine. A column-major matrix is the row-major storage
    of its transpose, so ``C = op(A) op(B)`` is ``C^T = op(B)^T op(A)^T``: the same transpose
    characters, the operands and their sizes swapped."""
    n = f"i{int_bits}"
    loads = []  # each integer argument loaded, then widened to i64 as %<name>_64
    for name in ("m", "n", "k", "lda", "ldb", "ldc"):
        loads.append(f"  %{name}_v = load {n}, {n}* %{name}")
        widen = "bitcast i64" if int_bits == 64 else f"sext {n}"
        loads.append(f"  %{name}_64 = {widen} %{name}_v to i64")
    m, nn, k, lda, ldb, ldc = (f"%{name}_64" for name in ("m", "n", "k", "lda", "ldb", "ldc"))
    body = "\n".join(loads)
    return f"""
declare i32 @{ROUTINE}(i8 signext, i8 signext, i64, i64, i64, float, i16*, i64, i16*, i64,
                       float, float*, i64)
declare void @omp_set_num_threads(i32)
declare i64 @write(i32, i8*, i64)
declare void @abort()
@failed = private constant [{len(FAILED)} x i8] c"{FAILED.rstrip()}\\0A"

define void @{SHIM}(i8* %ta, i8* %tb, {n}* %m, {n}* %n, {n}* %k, float* %alpha, i16* %a,
                    {n}* %lda, i16* %b, {n}* %ldb, float* %beta, float* %c, {n}* %ldc) {{
  call void @omp_set_num_threads(i32 1)
  %ta_v = load i8, i8* %ta
  %tb_v = load i8, i8* %tb
  %alpha_v = load float, float* %alpha
  %beta_v = load float, float* %beta
{body}
  %status = call i32 @{ROUTINE}(i8 signext %tb_v, i8 signext %ta_v, i64 {nn}, i64 {m},
                                i64 {k}, float %alpha_v, i16* %b, i64 {ldb}, i16* %a,
                                i64 {lda}, float %beta_v, float* %c, i64 {ldc})
  %ok = icmp eq i32 %status, 0
  br i1 %ok, label %done, label %fail
fail:
  %text = getelementptr [{len(FAILED)} x i8], [{len(FAILED)} x i8]* @failed, i64 0, i64 0
  %written = call i64 @write(i32 2, i8* %text, i64 {len(FAILED)})
  call void @abort()
  unreachable
done:
  ret void
}}
"""


def _compile(text: str, symbols: dict[str, int]) -> tuple[int, object]:
    """The address of :data:`SHIM` compiled from ``text`` on an engine of its own, with the
    library's functions at ``symbols``."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    for name, address in symbols.items():
        llvm.add_symbol(name, address)
    machine = llvm.Target.from_default_triple().create_target_machine()
    module = llvm.parse_assembly(text)
    module.verify()
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine.get_function_address(SHIM), engine
