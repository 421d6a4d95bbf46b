"""The CPUs and libraries the project may run on, as the facts its choices read
(``host.CpuFacts``, ``blas.Blas``, ``onednn.OneDnn``): the tests of those choices pass these in,
so each expects the same on every machine it runs on.

The flags are ``/proc/cpuinfo``'s for the features the choices look at; the LLVM feature
string is built from them as LLVM spells them. The libraries are records with made-up
addresses: what a choice reads of them (name, integer width, 16-bit routines), nothing to call.
"""

from __future__ import annotations

from ocannl.backends.cpu import blas, onednn
from ocannl.backends.cpu.host import CpuFacts

MKL = blas.Blas("mkl", 1, 2, 32, (3, 4), "libmkl_core.so.2",
                (("bf16", "gemm_bf16bf16f32_", 11), ("f16", "gemm_f16f16f32_", 12)))
OPENBLAS = blas.Blas("numpy", 5, 6, 64, (7, 8), "libscipy_openblas64_.so")
SCIPY = blas.Blas("scipy", 9, 10, 32, None)
DNNL = onednn.OneDnn("libdnnl.so.3", "3.2.0", 21, 64)

# /proc/cpuinfo's name -> LLVM's, for the features the choices read.
LLVM_NAMES = {"avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f",
              "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile",
              "amx_bf16": "amx-bf16", "amx_fp16": "amx-fp16"}

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f"}


def cpu(vendor: str, flags: frozenset[str], model: str, llvm_cpu: str,
        machine: str = "x86_64") -> CpuFacts:
    features = ",".join(("+" if f in flags else "-") + name for f, name in LLVM_NAMES.items())
    return CpuFacts(machine=machine, vendor=vendor, flags=flags, llvm_features=features,
                    llvm_cpu=llvm_cpu, model=model)


INTEL, AMD = "GenuineIntel", "AuthenticAMD"
# Intel Xeon 4th gen: AMX-BF16 tiles, AVX512-BF16 and AVX512-FP16, no AMX-FP16
SAPPHIRE_RAPIDS = cpu(INTEL, AVX512 | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"},
                      "Intel(R) Xeon(R) Platinum 8480+", "sapphirerapids")
# Intel Xeon 6: AMX-FP16 too
GRANITE_RAPIDS = cpu(INTEL, SAPPHIRE_RAPIDS.flags | {"amx_fp16"}, "Intel(R) Xeon(R) 6960P",
                     "graniterapids")
# Intel Xeon 3rd gen (Cooper Lake): AVX512-BF16 without AMX
COOPER_LAKE = cpu(INTEL, AVX512 | {"avx512_bf16"}, "Intel(R) Xeon(R) Platinum 8380H",
                  "cooperlake")
# Intel Xeon 3rd gen (Ice Lake): AVX-512 without bf16 units or AMX
ICE_LAKE = cpu(INTEL, AVX512, "Intel(R) Xeon(R) Platinum 8375C", "icelake-server")
# Intel, AVX2 only
SKYLAKE = cpu(INTEL, AVX2, "Intel(R) Core(TM) i7-6700", "skylake")
# AMD EPYC Zen 4 and Zen 5: AVX512-BF16, no AVX512-FP16, no AMX
ZEN4 = cpu(AMD, AVX512 | {"avx512_bf16"}, "AMD EPYC 9654", "znver4")
ZEN5 = cpu(AMD, AVX512 | {"avx512_bf16"}, "AMD EPYC 9755", "znver5")
# AMD EPYC Zen 1 to 3: AVX2 only
ZEN3 = cpu(AMD, AVX2, "AMD EPYC 7763", "znver3")
# An x86 CPU without F16C or AVX (an old or emulated one)
PLAIN_X86 = cpu(INTEL, frozenset(), "QEMU Virtual CPU", "x86-64")
# AArch64: no /proc/cpuinfo vendor, f16 conversions native
GRAVITON = CpuFacts(machine="aarch64", vendor="", flags=frozenset({"fp", "asimd", "fphp"}),
                    llvm_features="+neon,+fullfp16", llvm_cpu="neoverse-v1",
                    model="Neoverse-V1")

ALL = {"sapphire_rapids": SAPPHIRE_RAPIDS, "granite_rapids": GRANITE_RAPIDS,
       "cooper_lake": COOPER_LAKE, "ice_lake": ICE_LAKE, "skylake": SKYLAKE, "zen4": ZEN4,
       "zen5": ZEN5, "zen3": ZEN3, "plain_x86": PLAIN_X86, "graviton": GRAVITON}
