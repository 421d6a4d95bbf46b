"""LLVM's JIT for the CPU backend: optimize a routine's IR for this CPU, cache the machine code
on disk, and load it into the process.

One MCJIT engine serves the process. A large routine comes in parts that compile in parallel,
one object each. A routine's objects are cached in one file under a key made of its IR and of
everything else the code depends on (the CPU and its features, LLVM's version), so a warm
process loads them without optimizing anything. The generated code calls libm for
``tanh``/``erf`` and SciPy's BLAS for GEMMs; both are resolved by symbol name when an object is
loaded, so cached objects hold no process-specific address.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import platform
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from ocannl.backends.cpu.codegen import GEMM_SYMBOLS

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    """Where compiled objects live (``OCANNL_CACHE_DIR``, default ``~/.cache/ocannl``)."""
    root = os.environ.get("OCANNL_CACHE_DIR") or Path.home() / ".cache" / "ocannl"
    return Path(root) / "llvm"


def hardware_f16() -> bool:
    """Whether LLVM lowers half conversions to instructions here (F16C on x86, native on
    AArch64); elsewhere it would call a runtime routine the JIT does not provide.
    ``OCANNL_SOFT_F16`` forces the integer conversions."""
    if os.environ.get("OCANNL_SOFT_F16"):
        return False
    machine = platform.machine().lower()
    return machine in ("aarch64", "arm64") or (
        machine in ("x86_64", "amd64") and bool(_features_dict().get("f16c", False)))


def has_avx() -> bool:
    """Whether this CPU has AVX (256-bit registers, ``vzeroupper``)."""
    return platform.machine().lower() in ("x86_64", "amd64") and bool(
        _features_dict().get("avx", False))


def _features_dict() -> dict[str, bool]:
    return dict(llvm.get_host_cpu_features())


def _blas_address(name: str) -> int:
    """The address of SciPy's Fortran-interface BLAS routine (``sgemm``, ``dgemm``)."""
    from scipy.linalg import cython_blas

    capsule = cython_blas.__pyx_capi__[name]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return get_pointer(capsule, get_name(capsule))


def workers() -> int:
    """How many parts a large routine is cut into and compiled at once: this process's cores,
    at most 8 (``OCANNL_COMPILE_THREADS`` overrides)."""
    given = os.environ.get("OCANNL_COMPILE_THREADS")
    if given:
        return max(1, int(given))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def _target_machine() -> llvm.TargetMachine:
    """A target machine for this CPU (one per compiling thread)."""
    target = llvm.Target.from_default_triple()
    return target.create_target_machine(cpu=llvm.get_host_cpu_name(),
                                        features=llvm.get_host_cpu_features().flatten(),
                                        opt=2, codemodel="jitdefault")


# LLVM's O2 pipeline, with loop vectorization and unrolling: O3 made the convnet step about 5%
# faster and took about 60% longer to compile. SLP vectorization is off: it is superlinear on
# long straight-line code (unrolled loops).
_LEVEL = 2


def _setup() -> tuple[llvm.ExecutionEngine, str]:
    """The process's engine and cache stamp, made on first use."""
    if "engine" not in _state:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name in ("tanhf", "tanh", "erff", "erf", "expf", "exp", "logf", "log", "powf",
                     "pow"):
            llvm.add_symbol(name, ctypes.cast(getattr(libm, name), ctypes.c_void_p).value)
        for ty, symbol in GEMM_SYMBOLS.items():
            llvm.add_symbol(symbol, _blas_address("sgemm" if str(ty) == "float" else "dgemm"))
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _target_machine())
        stamp = (f"{llvm.get_process_triple()} {llvm.get_host_cpu_name()} "
                 f"{llvm.get_host_cpu_features().flatten()} llvmlite {llvmlite.__version__} "
                 f"O{_LEVEL}")
        _state.update(engine=engine, stamp=stamp)
    return _state["engine"], _state["stamp"]  # type: ignore[return-value]


def _optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine) -> None:
    pto = llvm.create_pipeline_tuning_options(speed_level=_LEVEL)
    pto.loop_vectorization = True
    pto.slp_vectorization = False
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(module, pb)


def _object(text: str) -> bytes:
    """Parse, check, optimize and compile one module in an LLVM context of its own, so parts
    compile in parallel threads (LLVM's calls release the GIL)."""
    module = llvm.parse_assembly(text, context=llvm.create_context())
    module.verify()
    tm = _target_machine()
    _optimize(module, tm)
    return tm.emit_object(module)


def key_of(texts: list[str]) -> str:
    """The cache key of a routine: its IR and everything else its machine code depends on."""
    _, stamp = _setup()
    digest = hashlib.sha256(stamp.encode())
    for text in texts:
        digest.update(b"\0" + text.encode())
    return digest.hexdigest()[:24]


def _pack(objects: list[bytes]) -> bytes:
    sizes = [len(o).to_bytes(8, "little") for o in objects]
    return b"".join([len(objects).to_bytes(8, "little"), *sizes, *objects])


def _unpack(data: bytes) -> list[bytes]:
    """The objects of a cache file; ``ValueError`` when it is not one whole."""
    n = int.from_bytes(data[:8], "little")
    if len(data) < 8 + 8 * n:
        raise ValueError("truncated")
    sizes = [int.from_bytes(data[8 + 8 * k:16 + 8 * k], "little") for k in range(n)]
    out, at = [], 8 + 8 * n
    for size in sizes:
        out.append(data[at:at + size])
        at += size
    if at != len(data):
        raise ValueError("truncated")
    return out


def compile_ir(texts: list[str]) -> tuple[int, bool]:
    """The address of the routine whose parts are ``texts`` (each defining ``part(table)``,
    run in order), once loaded; and whether its machine code came from the disk cache. The
    parts compile in parallel."""
    with _lock:
        engine, _ = _setup()
        key = key_of(texts)
        loaded = _state.setdefault("loaded", {})
        if key in loaded:  # type: ignore[operator]
            return loaded[key]  # type: ignore[index]
        names = [f"p{k}_{key}" for k in range(len(texts))]
        modules = [t.replace('@"part"', f'@"{name}"', 1) for t, name in zip(texts, names,
                                                                              strict=True)]
        modules.append("".join(f'declare void @"{n}"(i64*)\n' for n in names)
                       + f'define void @"r_{key}"(i64* %t) {{\n'
                       + "".join(f'  call void @"{n}"(i64* %t)\n' for n in names)
                       + "  ret void\n}\n")
        path = cache_dir() / f"{key}.objects"
        objects = _cached(path, len(modules))
        from_disk = objects is not None
        if objects is None:
            with ThreadPoolExecutor(min(workers(), len(modules))) as pool:
                objects = list(pool.map(_object, modules))
            _write(path, _pack(objects))
        for obj in objects:
            engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        engine.finalize_object()
        address = engine.get_function_address(f"r_{key}")
        if not address:
            raise RuntimeError(f"the JIT did not load r_{key} (cache file {path})")
        loaded[key] = address, from_disk  # type: ignore[index]
        return address, from_disk


def _cached(path: Path, count: int) -> list[bytes] | None:
    """The objects cached at ``path``; None when there are none, or a damaged file (compiled
    again, it is replaced)."""
    try:
        objects = _unpack(path.read_bytes())
    except (OSError, ValueError):
        return None
    return objects if len(objects) == count else None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
