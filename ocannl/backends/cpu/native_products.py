"""Which 16-bit products are multiplied as stored, decided once per process.

A product of two bf16 (or two f16) operands is either *native*, one call of a 16-bit routine
(MKL's ``gemm_bf16bf16f32`` / ``gemm_f16f16f32``, OpenBLAS's ``sbgemm``, oneDNN's
``dnnl_gemm_bf16bf16f32``: 16-bit operands, f32 accumulation and result), or *widened*:
scheduling copies each operand into f32 and calls ``sgemm``. The result is exact either way;
the native routine sums in another order than ``sgemm``, and on a CPU with 16-bit units it is
several times faster and needs no f32 copies. The default, by precision:

- bf16: native where the CPU has AMX-BF16 or AVX512-BF16 (``/proc/cpuinfo`` flags
  ``amx_bf16``, ``avx512_bf16``) and there is a routine: the BLAS's own (MKL's on Intel's
  CPUs), else oneDNN's (``onednn.py``: on an AMD EPYC with AVX512-BF16, where MKL's ran at
  its ``sgemm``'s rate). On a CPU without those units MKL runs its bf16 routine by widening
  internally, at about ``sgemm``'s rate (an AVX2 AMD EPYC, one thread, 1024^3: 72.9 against
  69.6 GFLOP/s), so the default keeps the path it has always had.
- f16: native only where the CPU has AMX-FP16 (``amx_fp16``). On Sapphire Rapids, which has
  AVX512-FP16 but no AMX-FP16, MKL's f16 routine ran at 0.66x to 1.0x ``sgemm``'s rate.
  An f16 operand is never converted to bf16: that would change the numerics silently.

``OCANNL_BF16_PRODUCTS`` and ``OCANNL_F16_PRODUCTS`` force a path: ``native`` (the routine
the default would pick), ``blas`` (the BLAS's own routine), ``onednn`` (oneDNN's; bf16 only) or
``widened``. A routine asked for that is not there is refused, named, never replaced by another.
Every choice is a pure function of the CPU's facts (``host.CpuFacts``), the BLAS and the
environment's setting (:func:`decide`); :func:`paths` hands it this process's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ocannl.backends.cpu import blas, host, onednn
from ocannl.backends.cpu.host import CpuFacts
from ocannl.ir.ops import Precision

# The CPU flags under which each precision's native products are the default.
UNITS = {Precision.bf16: ("amx_bf16", "avx512_bf16"), Precision.f16: ("amx_fp16",)}
ENV = {Precision.bf16: "OCANNL_BF16_PRODUCTS", Precision.f16: "OCANNL_F16_PRODUCTS"}
# What each setting asks for: the default's routine, the BLAS's own, oneDNN's, f32 copies.
SETTINGS = {"native": "the routine the default picks", "blas": "the BLAS's own routine",
            "onednn": "oneDNN's routine, bf16 only", "widened": "f32 copies and sgemm"}


@dataclass(frozen=True)
class ProductPath:
    """How products of two ``prec`` operands run: ``native`` or not, the BLAS routine
    (``routine``, ``address``; empty and 0 where widened) and why, as a phrase;
    ``inline_work``, the routine's measured ``Target.inline_native_work`` (0: the target's
    default)."""

    prec: Precision
    native: bool
    routine: str
    address: int
    why: str
    inline_work: int = 0

    def describe(self) -> str:
        how = f"native ({self.routine})" if self.native else "widened to f32 copies (sgemm)"
        return f"{self.prec.value} products: {how}, {self.why}"


def decide(prec: Precision, cpu: CpuFacts, library: blas.Blas, forced: str = "",
           second: Callable[[], onednn.OneDnn | str] = lambda: "not looked for"
           ) -> ProductPath:
    """The path of ``prec`` products on ``cpu`` with the BLAS ``library``; ``forced``, the
    environment's setting (``""``: the default; else one of ``SETTINGS``); ``second``,
    oneDNN's bf16 product or why there is none, asked for only where it may serve
    (:func:`routine`). ``ValueError`` naming the variable for a setting that is none of
    ``SETTINGS``, and for a routine asked for that is not there."""
    name = ENV[prec]
    if forced not in ("", *SETTINGS) or (forced == "onednn" and prec is not Precision.bf16):
        expected = ", ".join(f"{k!r} ({v})" for k, v in SETTINGS.items()
                             if k != "onednn" or prec is Precision.bf16)
        raise ValueError(f"{name}={forced!r}: expected one of {expected}")
    if forced == "widened":
        return ProductPath(prec, False, "", 0, f"as {name} asks")
    units = [f for f in UNITS[prec] if f in cpu.flags]
    if not (forced or units):
        own = library.product16(prec.value)
        return ProductPath(prec, False, "", 0, f"this CPU has no {' or '.join(UNITS[prec])}" + (
            f" (its {library.name} {own[0]} would widen internally)" if own else ""))
    found, missing = routine(prec, cpu, library, second, forced)
    if found is None:
        if forced:
            raise ValueError(f"{name}={forced}: {missing}; {_REMEDY[forced](prec)}, or unset "
                             f"{name}")
        return ProductPath(prec, False, "", 0, missing)
    why = (f"as {name} asks" + ("" if units else f" (this CPU has no {' or '.join(UNITS[prec])})")
           if forced else f"this CPU has {' and '.join(units)}")
    routine_name, address, inline = found
    return ProductPath(prec, True, routine_name, address, why, inline)


_MKL_HINT = "install MKL (pip install mkl) and set OCANNL_BLAS=mkl"
_ONEDNN_HINT = "install oneDNN (pip install onednn-cpu-gomp) on a CPU with AVX-512"
# What to do where a routine asked for is not there, by setting.
_REMEDY: dict[str, Callable[[Precision], str]] = {
    "native": lambda p: _MKL_HINT + (f" or {_ONEDNN_HINT}" if p is Precision.bf16 else ""),
    "blas": lambda p: _MKL_HINT,
    "onednn": lambda p: _ONEDNN_HINT,
}


def routine(prec: Precision, cpu: CpuFacts, library: blas.Blas,
            second: Callable[[], onednn.OneDnn | str], forced: str = ""
            ) -> tuple[tuple[str, int, int] | None, str]:
    """The routine ``prec`` products call, as (name, address, its measured inline bound or 0),
    or None and why. ``forced`` ``blas`` or ``onednn``: that one. Else the BLAS's own, but for
    MKL's on another vendor's CPU where oneDNN's is there (MKL's 16-bit kernels use the CPU's
    16-bit units on Intel's CPUs only: ``onednn.py``); oneDNN's where the BLAS has none. f16
    has only the BLAS's: oneDNN's product API has no f16 routine."""
    found = library.product16(prec.value)
    own = None if found is None else (*found, 0)
    no_own = (f"the BLAS in use ({library.name}, {library.path or 'no file'}) has no "
              f"{prec.value} product")
    if forced == "blas" or prec is not Precision.bf16 or (
            forced != "onednn" and own and (library.name != "mkl" or cpu.intel)):
        return own, "" if own else no_own
    other = second()
    if isinstance(other, onednn.OneDnn):
        return (f"oneDNN {other.version} {onednn.ROUTINE}", other.shim, onednn.INLINE_WORK), ""
    if forced == "onednn":
        return None, f"oneDNN's bf16 product is not there: {other}"
    if own:
        return own, ""
    return None, f"{no_own}, and oneDNN's is not there: {other}"


_decided: dict[Precision, ProductPath] = {}


def paths() -> dict[Precision, ProductPath]:
    """Each 16-bit precision's path in this process (decided on first use, from the BLAS
    :func:`blas.chosen` picked, this CPU's facts and the environment)."""
    if not _decided:
        library, cpu = blas.chosen(), host.running()
        found = {p: decide(p, cpu, library, os.environ.get(ENV[p], "").strip(),
                           lambda: onednn.bf16_product(library.int_bits))
                 for p in ENV}
        _decided.update(found)  # all or nothing: a refused choice decides nothing
    return dict(_decided)


def native() -> frozenset[Precision]:
    """The precisions whose products run native here (``Target.native_products``)."""
    return frozenset(p for p, path in paths().items() if path.native)


def inline_work(default: int) -> int:
    """``Target.inline_native_work`` here: the smallest bound the native routines measured,
    ``default`` where none did."""
    return min((path.inline_work for path in paths().values() if path.native and
                path.inline_work), default=default)


def describe() -> str:
    """One line naming each 16-bit precision's product path here, and why."""
    return "; ".join(path.describe() for path in paths().values())
