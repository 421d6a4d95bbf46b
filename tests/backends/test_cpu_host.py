"""Every choice the CPU backend makes from the machine (``host.py``), as a table over the CPUs
and libraries the project may meet: the BLAS, each 16-bit product's path and routine, f16
conversions, vector registers and LLVM's features. Each choice is a pure function of the facts
passed in (``cpus.py``), so every row holds on whatever machine runs it."""

from __future__ import annotations

import warnings

import cpus
import pytest
from cpus import DNNL, MKL, OPENBLAS, SCIPY

from ocannl.backends.cpu import blas, host, jit, native_products, onednn
from ocannl.ir.ops import Precision

BF16, F16 = Precision.bf16, Precision.f16

# The libraries an environment may hold: `make test`'s (MKL, NumPy's OpenBLAS, oneDNN), a
# plain `pip install ocannl` (NumPy's OpenBLAS), and the sets between.
LIBRARIES = {"all": {"mkl", "openblas", "onednn"}, "no-mkl": {"openblas", "onednn"},
             "no-onednn": {"mkl", "openblas"}, "plain": {"openblas"}, "scipy-only": set()}


def _decisions(cpu: host.CpuFacts, present: set[str], setting: str = "",
               blas_choice: str = "") -> tuple[str, str, str, bool]:
    """What a process on ``cpu`` with the ``present`` libraries decides, as ``paths`` does: the
    BLAS's name, the bf16 and f16 products' routine (``widened`` where there is none) and
    whether it warned of a fallback."""
    def dnnl() -> onednn.OneDnn | str:
        if "onednn" not in present:
            return "no libdnnl.so.3 under /env/lib (pip install onednn-cpu-gomp)"
        if "avx512f" not in cpu.flags:  # as the real probe answers there (status 3)
            return "oneDNN 3.2.0 (/env/lib/libdnnl.so.3) has no bf16 product on this CPU"
        return DNNL

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        saved, blas._warned = blas._warned, set()
        try:
            library = blas.choose(
                blas_choice, cpu, find_mkl=lambda: MKL if "mkl" in present else "no MKL",
                find_openblas=lambda: OPENBLAS if "openblas" in present else "no OpenBLAS",
                find_scipy=lambda: SCIPY)
        finally:
            blas._warned = saved
    found = [native_products.decide(p, cpu, library, setting if p is BF16 else "", dnnl)
             for p in (BF16, F16)]
    names = [_short(path) for path in found]
    return library.name, names[0], names[1], bool(said)


def _short(path: native_products.ProductPath) -> str:
    if not path.native:
        return "widened"
    return {11: "mkl-bf16", 12: "mkl-f16", DNNL.shim: "onednn"}[path.address]


# cpu, libraries -> BLAS, bf16 products, f16 products, a fallback said
TABLE = [
    ("sapphire_rapids", "all", "mkl", "mkl-bf16", "widened", False),
    ("sapphire_rapids", "no-mkl", "numpy", "onednn", "widened", True),
    ("sapphire_rapids", "no-onednn", "mkl", "mkl-bf16", "widened", False),
    ("sapphire_rapids", "plain", "numpy", "widened", "widened", True),
    ("sapphire_rapids", "scipy-only", "scipy", "widened", "widened", True),
    ("granite_rapids", "all", "mkl", "mkl-bf16", "mkl-f16", False),
    ("granite_rapids", "no-mkl", "numpy", "onednn", "widened", True),
    ("granite_rapids", "plain", "numpy", "widened", "widened", True),
    ("cooper_lake", "all", "mkl", "mkl-bf16", "widened", False),
    ("cooper_lake", "no-mkl", "numpy", "onednn", "widened", True),
    ("cooper_lake", "plain", "numpy", "widened", "widened", True),
    ("ice_lake", "all", "mkl", "widened", "widened", False),
    ("ice_lake", "no-mkl", "numpy", "widened", "widened", True),
    ("ice_lake", "plain", "numpy", "widened", "widened", True),
    ("skylake", "all", "mkl", "widened", "widened", False),
    ("skylake", "plain", "numpy", "widened", "widened", True),
    ("skylake", "scipy-only", "scipy", "widened", "widened", True),
    ("zen5", "all", "numpy", "onednn", "widened", False),
    ("zen5", "no-mkl", "numpy", "onednn", "widened", False),
    ("zen5", "no-onednn", "numpy", "widened", "widened", False),
    ("zen5", "plain", "numpy", "widened", "widened", False),
    ("zen5", "scipy-only", "scipy", "widened", "widened", True),
    ("zen4", "all", "numpy", "onednn", "widened", False),
    ("zen4", "no-onednn", "numpy", "widened", "widened", False),
    ("zen3", "all", "numpy", "widened", "widened", False),
    ("zen3", "plain", "numpy", "widened", "widened", False),
    ("zen3", "scipy-only", "scipy", "widened", "widened", True),
    ("plain_x86", "all", "mkl", "widened", "widened", False),
    ("graviton", "plain", "numpy", "widened", "widened", False),
    ("graviton", "scipy-only", "scipy", "widened", "widened", True),
]


@pytest.mark.parametrize(("cpu", "libraries", "want_blas", "want_bf16", "want_f16", "warns"),
                         TABLE, ids=[f"{r[0]}-{r[1]}" for r in TABLE])
def test_the_default_decisions_on_each_cpu_and_library_set(cpu, libraries, want_blas, want_bf16,
                                                           want_f16, warns):
    """MKL by default on Intel's CPUs only; bf16 products native where the CPU has bf16 units:
    MKL's routine on Intel's, oneDNN's on AMD's (MKL's widens there) or beside a BLAS with
    none; f16 native only with AMX-FP16; a default that falls back says so."""
    got = _decisions(cpus.ALL[cpu], LIBRARIES[libraries])
    assert got == (want_blas, want_bf16, want_f16, warns)


# cpu, OCANNL_BLAS, OCANNL_BF16_PRODUCTS -> BLAS, bf16 products (all libraries present)
FORCED = [
    ("sapphire_rapids", "", "onednn", "mkl", "onednn"),  # the CI failure of issue 36
    ("sapphire_rapids", "", "blas", "mkl", "mkl-bf16"),
    ("sapphire_rapids", "", "native", "mkl", "mkl-bf16"),
    ("sapphire_rapids", "numpy", "native", "numpy", "onednn"),
    ("sapphire_rapids", "", "widened", "mkl", "widened"),
    ("zen5", "mkl", "", "mkl", "onednn"),
    ("zen5", "mkl", "native", "mkl", "onednn"),
    ("zen5", "mkl", "blas", "mkl", "mkl-bf16"),
    ("zen5", "", "onednn", "numpy", "onednn"),
    ("zen3", "mkl", "native", "mkl", "mkl-bf16"),  # MKL's widens internally: asked for, taken
    ("zen3", "mkl", "blas", "mkl", "mkl-bf16"),
    ("skylake", "", "native", "mkl", "mkl-bf16"),
    ("cooper_lake", "", "onednn", "mkl", "onednn"),
]


@pytest.mark.parametrize(("cpu", "blas_choice", "setting", "want_blas", "want_bf16"), FORCED,
                         ids=[f"{r[0]}-{r[1] or 'default'}-{r[2] or 'default'}" for r in FORCED])
def test_a_routine_asked_for_is_the_one_used_on_every_cpu(cpu, blas_choice, setting, want_blas,
                                                         want_bf16):
    got = _decisions(cpus.ALL[cpu], LIBRARIES["all"], setting, blas_choice)
    assert got[:2] == (want_blas, want_bf16)


@pytest.mark.parametrize(("cpu", "libraries", "setting", "message"), [
    ("sapphire_rapids", "no-onednn", "onednn",
     r"OCANNL_BF16_PRODUCTS=onednn: oneDNN's bf16 product is not there: no libdnnl.so.3 .*; "
     r"install oneDNN \(pip install onednn-cpu-gomp\) on a CPU with AVX-512, or unset "
     r"OCANNL_BF16_PRODUCTS"),
    ("zen3", "all", "onednn",
     r"OCANNL_BF16_PRODUCTS=onednn: oneDNN's bf16 product is not there: oneDNN 3.2.0 .* has "
     r"no bf16 product on this CPU"),
    ("zen5", "no-mkl", "blas",
     r"OCANNL_BF16_PRODUCTS=blas: the BLAS in use \(numpy, libscipy_openblas64_.so\) has no "
     r"bf16 product; install MKL \(pip install mkl\) and set OCANNL_BLAS=mkl, or unset"),
    ("zen5", "plain", "native",
     r"OCANNL_BF16_PRODUCTS=native: the BLAS in use \(numpy, .*\) has no bf16 product, and "
     r"oneDNN's is not there: no libdnnl.so.3 .*; install MKL .* or install oneDNN"),
], ids=["onednn-absent", "onednn-without-avx512", "blas-without-routine", "native-without-any"])
def test_a_routine_asked_for_that_is_not_there_is_refused_not_replaced(cpu, libraries, setting,
                                                                       message):
    with pytest.raises(ValueError, match=message):
        _decisions(cpus.ALL[cpu], LIBRARIES[libraries], setting)


def test_f16_products_never_ask_for_onednn():
    with pytest.raises(ValueError, match=r"OCANNL_F16_PRODUCTS='onednn': expected one of "
                                         r"'native' .*'blas' .*'widened'"):
        native_products.decide(F16, cpus.ZEN5, MKL, "onednn", lambda: DNNL)


# cpu -> f16 conversions by instructions, AVX (vzeroupper), 512-bit vectors preferred in loops
CODE = [
    ("sapphire_rapids", True, True, True),
    ("granite_rapids", True, True, True),
    ("cooper_lake", True, True, False),
    ("ice_lake", True, True, False),
    ("skylake", True, True, False),
    ("zen5", True, True, True),
    ("zen4", True, True, True),
    ("zen3", True, True, False),
    ("plain_x86", False, False, False),
    ("graviton", True, False, False),
]


@pytest.mark.parametrize(("cpu", "want_f16", "want_avx", "want_512"), CODE,
                         ids=[r[0] for r in CODE])
def test_the_code_decisions_on_each_cpu(cpu, want_f16, want_avx, want_512):
    """F16C converts f16 with instructions (AArch64 natively; ``OCANNL_SOFT_F16`` forces the
    integer code); AVX clears the upper halves; AVX512-FP16 CPUs (Sapphire Rapids and later)
    and AMD Zen 4 and 5 prefer 512-bit vectors, the other AVX-512 CPUs 256-bit ones (said to
    LLVM, whatever its tuning), LLVM's features otherwise passed on as they are."""
    facts = cpus.ALL[cpu]
    assert jit.hardware_f16(facts) is want_f16
    assert jit.hardware_f16(facts, soft=True) is False
    assert jit.has_avx(facts) is want_avx
    assert jit.vector_bits(facts) == (512 if want_512 else 256)
    features = jit.features(facts, jit.vector_bits(facts))
    assert features.startswith(facts.llvm_features)
    assert features.endswith(",-prefer-256-bit") is want_512
    assert features.endswith(",+prefer-256-bit") is (not want_512 and facts.llvm_has("avx512f"))


def test_cpuinfo_is_read_from_the_first_processor_block():
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) 8480+\n"
            "flags\t\t: fpu avx2 avx512_bf16 amx_bf16\n\nprocessor\t: 1\nvendor_id\t: Other\n"
            "flags\t\t: fpu\n")
    assert host.parse_cpuinfo(text) == ("GenuineIntel", "Intel(R) Xeon(R) 8480+",
                                        frozenset({"fpu", "avx2", "avx512_bf16", "amx_bf16"}))
    assert host.parse_cpuinfo("model name : x\n") == ("", "x", frozenset())


def test_the_running_cpu_is_read_once_as_llvm_and_the_kernel_see_it():
    """The one reader of the machine: LLVM's view verbatim (what the JIT compiles for) and
    ``/proc/cpuinfo``'s, the same record every call."""
    import llvmlite.binding as llvm

    facts = host.running()
    assert facts is host.running()
    assert facts.llvm_features == llvm.get_host_cpu_features().flatten()
    assert facts.llvm_cpu == llvm.get_host_cpu_name()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            assert facts.flags == host.parse_cpuinfo(info.read())[2]
    except OSError:
        assert facts.flags == frozenset()
