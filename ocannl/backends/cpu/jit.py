"""LLVM's JIT for the CPU backend: optimize a routine's IR for this CPU, cache the machine code
on disk, and load it into the process.

One MCJIT engine serves the process. A routine's object code is cached under a key made of its
IR and of everything else the code depends on (the CPU and its features, LLVM's version), so a
warm process loads the object without optimizing anything. The generated code calls libm for
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


def _setup() -> tuple[llvm.TargetMachine, llvm.ExecutionEngine, str]:
    """The process's target machine, engine and cache stamp, made on first use."""
    if "engine" not in _state:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        cpu = llvm.get_host_cpu_name()
        features = llvm.get_host_cpu_features().flatten()
        target = llvm.Target.from_default_triple()
        tm = target.create_target_machine(cpu=cpu, features=features, opt=3,
                                          codemodel="jitdefault")
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name in ("tanhf", "tanh", "erff", "erf", "expf", "exp", "logf", "log", "powf",
                     "pow"):
            llvm.add_symbol(name, ctypes.cast(getattr(libm, name), ctypes.c_void_p).value)
        for ty, symbol in GEMM_SYMBOLS.items():
            llvm.add_symbol(symbol, _blas_address("sgemm" if str(ty) == "float" else "dgemm"))
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), tm)
        stamp = f"{target.triple} {cpu} {features} llvmlite {llvmlite.__version__}"
        _state.update(tm=tm, engine=engine, stamp=stamp)
    return _state["tm"], _state["engine"], _state["stamp"]  # type: ignore[return-value]


def _optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine) -> None:
    pto = llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = False  # superlinear on long straight-line code (unrolled loops)
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(module, pb)


def compile_ir(ir_text: str) -> tuple[int, bool]:
    """The address of the routine in ``ir_text`` (a function named ``routine``) once loaded,
    and whether its object came from the disk cache."""
    with _lock:
        tm, engine, stamp = _setup()
        key = hashlib.sha256((stamp + "\n" + ir_text).encode()).hexdigest()[:24]
        name = f"routine_{key}"
        loaded = _state.setdefault("loaded", {})
        if key in loaded:  # type: ignore[operator]
            return loaded[key]  # type: ignore[index]
        folder = cache_dir()
        path = folder / f"{key}.o"
        from_disk = path.exists()
        if from_disk:
            obj = path.read_bytes()
        else:
            module = llvm.parse_assembly(ir_text.replace('@"routine"', f'@"{name}"', 1))
            module.verify()
            _optimize(module, tm)
            obj = tm.emit_object(module)
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(obj)
            os.replace(tmp, path)
        engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
        engine.finalize_object()
        address = engine.get_function_address(name)
        if not address:
            raise RuntimeError(f"the JIT did not load {name} from {path}")
        loaded[key] = address, from_disk  # type: ignore[index]
        return address, from_disk
