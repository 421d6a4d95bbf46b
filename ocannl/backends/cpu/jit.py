"""LLVM's JIT for the CPU backend: optimize a routine's IR for this CPU, cache the machine code
on disk, and load it into the process.

One MCJIT engine serves the process. A large routine comes in parts that compile in parallel
(in forked processes: llvmlite runs one LLVM call at a time per process), one object each. A
routine's objects are cached in one file under a key made of what its IR is made from (the
lowered code and the version of every module whose code reaches the object: ``version.py``,
through ``codegen.signature``) and of everything else the machine code depends on (the CPU and
its features, LLVM's version, the options), so a warm process neither builds the IR nor
optimizes anything. The generated code calls libm (f64 math, ``log``) and the BLAS
(``blas.py``); both are resolved by symbol name when an object is loaded, so cached objects
hold no process-specific address.

The cache is bounded: after each write, the files least recently used (written, or loaded:
a load sets its file's access time) are removed until the whole is at most ``OCANNL_CACHE_MAX_MB``
megabytes (default ``CACHE_MAX_MB``, 1024), the file just written always kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import re
import select
import signal
import tempfile
import threading
import time
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

from ocannl.backends.cpu import blas, entry, host, native_products, pool
from ocannl.backends.cpu.codegen import GEMM16_SYMBOLS, GEMM_SYMBOLS, Target
from ocannl.backends.cpu.host import CpuFacts

_lock = threading.Lock()
_state: dict[str, object] = {}


# A cache file's layout: its header's fields. Files of another layout are compiled again.
CACHE_FORMAT = "ocannl.llvm-objects/2"


def cache_dir() -> Path:
    """Where compiled objects live (``OCANNL_CACHE_DIR``, default ``~/.cache/ocannl``)."""
    root = os.environ.get("OCANNL_CACHE_DIR") or Path.home() / ".cache" / "ocannl"
    return Path(root) / "llvm"


# The cache's default bound, in megabytes (10**6 bytes): a routine's file takes tens to some
# hundreds of kilobytes, so this holds thousands.
CACHE_MAX_MB = 1024


def cache_max_bytes() -> int:
    """The cache's bound in bytes: ``OCANNL_CACHE_MAX_MB`` megabytes (a whole number of at
    least 1), else ``CACHE_MAX_MB``; ``ValueError`` naming the variable and its value."""
    given = _env_count("OCANNL_CACHE_MAX_MB")
    return (given if given is not None else CACHE_MAX_MB) * 10**6


def trim_cache(folder: Path, limit: int, keep: Path) -> list[Path]:
    """Remove the cache files of ``folder`` least recently used (the later of their access
    and modification times, oldest first) until the rest take at most ``limit`` bytes;
    ``keep`` is never removed. The files removed. A file another process removes meanwhile
    is passed over."""
    files = []
    for path in folder.glob("*.objects"):
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        files.append((max(stat.st_atime_ns, stat.st_mtime_ns), path.name, stat.st_size, path))
    files.sort()
    total = sum(size for _, _, size, _ in files)
    removed = []
    for _, _, size, path in files:
        if total <= limit:
            break
        if path == keep:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        total -= size
        removed.append(path)
    return removed


def hardware_f16(cpu: CpuFacts, soft: bool = False) -> bool:
    """Whether LLVM lowers half conversions to instructions on ``cpu`` (F16C on x86, native on
    AArch64); elsewhere it would call a runtime routine the JIT does not provide. ``soft``
    (``OCANNL_SOFT_F16``) forces the integer conversions."""
    return not soft and (cpu.machine in ("aarch64", "arm64")
                         or (cpu.x86 and cpu.llvm_has("f16c")))


def has_avx(cpu: CpuFacts) -> bool:
    """Whether ``cpu`` has AVX (256-bit registers, ``vzeroupper``)."""
    return cpu.x86 and cpu.llvm_has("avx")


def vector_bits(cpu: CpuFacts) -> int:
    """The vectors loops are compiled for (``Target.vector_bits``): 512 bits on a CPU with
    AVX512-FP16 (Sapphire Rapids and later Xeons), where LLVM's tuning keeps to 256 bits for
    the AVX-512 CPUs whose clock drops under 512-bit instructions, and on AMD Zen 4 and later
    (``znver4``...), whose clock does not drop and for which LLVM's own tuning is 512 bits;
    else 256. Each lane computes what a scalar would, so the bits are the same. In-process A/B
    on an AVX512-FP16 CPU, steps paired by block, 512 / 256: mlp_small bf16 0.898x,
    f16-gated16 0.933x, f32 0.988x; gpt_mini bf16 0.969x, f16 0.983x; convnet bf16 0.983x, f32
    0.995x."""
    if cpu.llvm_has("avx512fp16"):
        return 512
    zen = re.fullmatch(r"znver(\d+)", cpu.llvm_cpu)
    return 512 if zen is not None and int(zen.group(1)) >= 4 else 256


def features(cpu: CpuFacts, bits: int = 256) -> str:
    """The CPU features LLVM compiles for: ``cpu``'s, with 512-bit vectors preferred in loops
    where the target record says ``bits`` 512 and 256-bit ones where it says 256 on a CPU
    with AVX-512 (whatever LLVM's tuning for the CPU would prefer): the record is what runs."""
    text = cpu.llvm_features
    if bits == 512:
        return text + ",-prefer-256-bit"
    return text + ",+prefer-256-bit" if cpu.llvm_has("avx512f") else text


def target() -> Target:
    """What lowering and code generation may rely on in this process (``ocannl.ir.target``):
    the BLAS, the threads, the CPU's conversions and vectors; the products and thresholds at
    their CPU defaults. Reading it changes nothing: :func:`size_pool` gives the pool its
    threads before a routine runs."""
    count = threads()
    with _lock:
        _setup()
        resize = _state.get("pool_size")
    if resize is None:
        count = 1
    chosen, cpu = blas.chosen(), host.running()
    soft = bool(os.environ.get("OCANNL_SOFT_F16"))
    # Products are cut into PRODUCT_PARTS parts whatever this process's cores or
    # OCANNL_THREADS: which thread runs a part changes, never the parts, so a rank pinned to
    # one core lowers a step as a process on many does (the same bits).
    return Target(name="cpu", hardware_f16=hardware_f16(cpu, soft), workers=workers(),
                  avx=has_avx(cpu), blas_int=chosen.int_bits, threads=count,
                  native_products=native_products.native(),
                  inline_native_work=native_products.inline_work(Target.inline_native_work),
                  products_shared=resize is not None and chosen.threads is not None,
                  product_parts=PRODUCT_PARTS, vector_bits=vector_bits(cpu))


def size_pool(target: Target) -> None:
    """Give the thread pool the target's threads (its workers and this thread), where the
    pool exists: done before a routine lowered for ``target`` runs."""
    with _lock:
        _setup()
        resize = _state.get("pool_size")
    if resize is not None:
        resize(target.threads - 1)  # type: ignore[operator]


# The parts a large product is cut into (``schedule.gemm_split``): a constant of the CPU
# target, not a count of this machine's cores, so lowering depends on shapes alone.
PRODUCT_PARTS = 8


def _env_count(name: str) -> int | None:
    """A positive integer from the environment variable ``name``, None when it is unset or
    empty; ``ValueError`` naming the variable and its value otherwise."""
    given = os.environ.get(name, "").strip()
    if not given:
        return None
    try:
        value = int(given)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={given!r}: expected a whole number of at least 1")
    return value


def workers() -> int:
    """How many parts a large routine is cut into and compiled at once: this process's cores,
    at most 8 (``OCANNL_COMPILE_WORKERS`` overrides)."""
    given = _env_count("OCANNL_COMPILE_WORKERS")
    return given if given is not None else max(1, min(8, _cores()))


def threads() -> int:
    """How many threads share a routine's large loops (``pool.py``): ``OCANNL_THREADS``, else
    this process's cores, divided among the processes an MPI launcher started on this machine
    (data-parallel ranks would otherwise fight over the cores). Products are shared over the
    same threads where the BLAS's thread count can be set (MKL, NumPy's OpenBLAS), else over
    the BLAS's own."""
    given = _env_count("OCANNL_THREADS")
    if given is None:
        local = 1
        for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):  # MPICH, Open MPI
            ranks = _env_count(name)  # a value that is not a count is refused, named
            if ranks is not None:
                local = ranks
                break
        given = max(1, _cores() // local)
    return min(given, pool.MAX_THREADS)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _target_machine(bits: int = 256) -> llvm.TargetMachine:
    """A target machine for this CPU (one per compiling thread), its loops on ``bits``-bit
    vectors (``Target.vector_bits``)."""
    target = llvm.Target.from_default_triple()
    cpu = host.running()
    return target.create_target_machine(cpu=cpu.llvm_cpu, features=features(cpu, bits),
                                        opt=2, codemodel="jitdefault")


# LLVM's O2 pipeline, with loop vectorization and unrolling: O3 made the convnet step about 5%
# faster and took about 60% longer to compile. SLP vectorization is off: it is superlinear on
# long straight-line code (unrolled loops).
_LEVEL = 2
# LLVM's own options, set once per process (and part of the cache stamp). A loop of a known
# trip count under 16 was vectorized with its remainder as masked vector operations; LLVM 22's
# x86 back end lowers a masked store of one 16-bit lane (a bf16 cell, narrowed from 32 bits)
# as a 32-bit store, writing 0 over the next cell and, at a buffer's end, past it. With no
# trip count counted as tiny, such loops end with scalar iterations instead, as longer ones
# do (``tests/backends/test_cpu_jit.py``).
_LLVM_OPTIONS = ("-vectorizer-min-trip-count=0",)


def _setup() -> tuple[llvm.ExecutionEngine, str]:
    """The process's engine and cache stamp, made on first use."""
    if "engine" not in _state:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        for option in _LLVM_OPTIONS:
            llvm.set_option("ocannl", option)
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        for name in ("tanhf", "tanh", "erff", "erf", "expf", "exp", "logf", "log", "powf",
                     "pow"):
            llvm.add_symbol(name, ctypes.cast(getattr(libm, name), ctypes.c_void_p).value)
        libc = ctypes.CDLL(None)
        for name in ("pthread_create", "pthread_detach", "getpid", "syscall", "sched_yield"):
            llvm.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
        chosen = blas.chosen()
        for ty, symbol in GEMM_SYMBOLS.items():
            llvm.add_symbol(symbol, chosen.sgemm if str(ty) == "float" else chosen.dgemm)
        control = chosen.threads
        if control is not None:
            llvm.add_symbol("ocannl_blas_get_threads", control[0])
            llvm.add_symbol("ocannl_blas_set_threads", control[1])
        for name, address in entry.c_api_symbols().items():
            llvm.add_symbol(name, address)
        engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), _target_machine())
        # The builtin functions' trampoline (``entry.py``), compiled here once per process.
        engine.add_module(llvm.parse_assembly(entry.module_ir()))
        engine.finalize_object()
        _state["trampoline"] = engine.get_function_address(entry.TRAMPOLINE)
        _state["gated"] = engine.get_function_address(entry.GATED)
        if pool.supported():
            # The thread pool: a few functions, compiled here once per process.
            engine.add_module(llvm.parse_assembly(pool.module_ir()))
            engine.finalize_object()
            llvm.add_symbol(pool.RUN_SYMBOL, engine.get_function_address(pool.RUN_SYMBOL))
            _state["pool_size"] = ctypes.CFUNCTYPE(None, ctypes.c_int32)(
                engine.get_function_address(pool.SIZE_SYMBOL))
        llvm_version = ".".join(map(str, llvm.llvm_version_info))
        cpu = host.running()
        stamp = (f"{llvm.get_process_triple()} {cpu.llvm_cpu} "
                 f"{cpu.llvm_features} llvmlite {llvmlite.__version__} LLVM {llvm_version} "
                 f"O{_LEVEL} {' '.join(_LLVM_OPTIONS)}")
        _state.update(engine=engine, stamp=stamp)
    return _state["engine"], _state["stamp"]  # type: ignore[return-value]


def _link_native_products() -> None:
    """The 16-bit product symbols bound to the routines :mod:`native_products` decides now,
    at each load rather than once with the engine: a routine linked against a symbol the
    engine never bound would call address 0."""
    for prec, path in native_products.paths().items():
        if path.native:
            llvm.add_symbol(GEMM16_SYMBOLS[prec], path.address)


def trampoline() -> int:
    """The address of the compiled trampoline behind bound routines (``entry.py``)."""
    _setup()
    return _state["trampoline"]  # type: ignore[return-value]


def gated_trampoline() -> int:
    """The address of the trampoline running a routine and, gated on an f32, a second one."""
    _setup()
    return _state["gated"]  # type: ignore[return-value]


def _optimize(module: llvm.ModuleRef, tm: llvm.TargetMachine) -> None:
    pto = llvm.create_pipeline_tuning_options(speed_level=_LEVEL)
    pto.loop_vectorization = True
    pto.slp_vectorization = False
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(module, pb)


def _object(text: str, bits: int = 256) -> bytes:
    """Parse, check, optimize and compile one module, in an LLVM context of its own, for
    ``bits``-bit vectors."""
    module = llvm.parse_assembly(text, context=llvm.create_context())
    module.verify()
    tm = _target_machine(bits)
    _optimize(module, tm)
    return tm.emit_object(module)


def key_of(signature: str) -> str:
    """The cache key of a routine: what its IR is made from (``codegen.signature``) and
    everything else its machine code depends on (this CPU, LLVM, the optimization level)."""
    _, stamp = _setup()
    return hashlib.sha256(f"{stamp}\n{signature}".encode()).hexdigest()[:24]


def _digest(body: bytes) -> str:
    """The SHA-256 of a cache file's machine code: it is never loaded unverified."""
    return hashlib.sha256(body).hexdigest()


def _pack(objects: list[bytes]) -> bytes:
    """A cache file: a JSON header line (the objects' sizes, their digest), the objects."""
    body = b"".join(objects)
    header = json.dumps({"format": CACHE_FORMAT, "sizes": [len(o) for o in objects],
                         "sha256": _digest(body)})
    return b"".join([header.encode(), b"\n", body])


def _unpack(data: bytes) -> list[bytes]:
    """A cache file's objects; ``ValueError`` when it is not one whole (truncated, or any byte
    of the objects changed) or of another format, ``KeyError`` when its header lacks a field
    (another version's file)."""
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    if header["format"] != CACHE_FORMAT:
        raise ValueError(f"cache format {header['format']!r}, not {CACHE_FORMAT!r}")
    if _digest(body) != header["sha256"]:
        raise ValueError("the digest does not match")
    out, at = [], 0
    for size in header["sizes"]:
        out.append(body[at:at + size])
        at += size
    if at != len(body):
        raise ValueError("truncated")
    return out


def load(key: str) -> tuple[int, bool] | None:
    """The routine under ``key`` if this process or the disk cache has it: its address, and
    whether it came from disk."""
    with _lock:
        engine, _ = _setup()
        loaded = _state.setdefault("loaded", {})
        if key in loaded:  # type: ignore[operator]
            return loaded[key]  # type: ignore[index]
        path = cache_dir() / f"{key}.objects"
        try:
            objects = _unpack(path.read_bytes())
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, damaged or another format's: compiled again, and replaced
        try:  # used now, the last a bounded cache removes: its access time says so (its
            # modification time stays that of its writing)
            os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
        except OSError:
            pass  # removed meanwhile, or a read-only cache: the objects are loaded still
        return _add(key, objects, True)


def compile_ir(key: str, texts: list[str], single_blas: bool = False, bits: int = 256) -> int:
    """Compile the routine whose parts are ``texts`` (each defining ``part(table)``, run in
    order; the parts in parallel), cache it on disk under ``key`` and load it: its address.
    ``single_blas``: the routine runs BLAS single-threaded, on the pool's threads, restoring
    the thread count it found (OpenBLAS's own workers spin for about 0.1 s after each
    product they share, taking a core from the pool's). ``bits``: the target record's
    vectors (``Target.vector_bits``)."""
    limit = cache_max_bytes()  # a bad bound is refused before anything is compiled
    with _lock:
        names = [f"p{k}_{key}" for k in range(len(texts))]
        modules = [t.replace('@"part"', f'@"{name}"', 1) for t, name in zip(texts, names,
                                                                              strict=True)]
        calls = "".join(f'  call void @"{n}"(i64* %t)\n' for n in names)
        decls = "".join(f'declare void @"{n}"(i64*)\n' for n in names)
        if single_blas:
            decls += ("declare i32 @ocannl_blas_get_threads()\n"
                      "declare void @ocannl_blas_set_threads(i32)\n")
            calls = ("  %old = call i32 @ocannl_blas_get_threads()\n"
                     "  call void @ocannl_blas_set_threads(i32 1)\n" + calls
                     + "  call void @ocannl_blas_set_threads(i32 %old)\n")
        modules.append(f'{decls}define void @"r_{key}"(i64* %t) {{\n{calls}  ret void\n}}\n')
        objects = _objects(modules, bits)
        path = cache_dir() / f"{key}.objects"
        _write(path, _pack(objects))
        trim_cache(path.parent, limit, path)
        return _add(key, objects, False)[0]


def _add(key: str, objects: list[bytes], from_disk: bool) -> tuple[int, bool]:
    engine, _ = _setup()
    _link_native_products()
    for obj in objects:
        engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    address = engine.get_function_address(f"r_{key}")
    if not address:
        raise RuntimeError(f"the JIT did not load r_{key}")
    entry = _state["loaded"][key] = (address, from_disk)  # type: ignore[index]
    return entry


def _objects(texts: list[str], bits: int = 256) -> list[bytes]:
    """Every module compiled, the larger ones in forked processes at the same time as this
    one compiles the first: llvmlite serializes all LLVM calls of a process behind one lock,
    so threads would take turns. Where a child fails (or there is no ``fork``), this process
    compiles that module itself."""
    extra = workers() - 1
    if not hasattr(os, "fork") or extra < 1 or len(texts) < 2:
        return [_object(t, bits) for t in texts]
    order = sorted(range(len(texts)), key=lambda k: -len(texts[k]))
    forked = order[1:1 + extra]
    children = {k: _fork_compile(texts[k], bits) for k in forked}
    objects: dict[int, bytes] = {k: _object(texts[k], bits) for k in order
                                 if k not in children}
    for k, child in children.items():
        data = _collect(*child) if child is not None else None
        objects[k] = data if data is not None else _object(texts[k], bits)
    return [objects[k] for k in range(len(texts))]


def _fork_compile(text: str, bits: int = 256) -> tuple[int, int] | None:
    """A child process compiling ``text`` and writing the object to a pipe: (pid, read end),
    or None when it could not be started."""
    try:
        read, write = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:  # the child: compile, write, leave without running any of the parent's exit code
        status = 1
        try:
            os.close(read)
            data = _object(text, bits)
            with os.fdopen(write, "wb") as out:
                out.write(data)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    return pid, read


# A child that has written nothing for this long is stopped and its module compiled here (a
# fork can inherit a lock another thread held, and wait on it for ever).
CHILD_TIMEOUT_S = 300.0


def _collect(pid: int, read: int) -> bytes | None:
    """The object a child wrote, or None when it failed or went silent."""
    chunks = []
    with os.fdopen(read, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], CHILD_TIMEOUT_S)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            chunk = pipe.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    return data if status == 0 and data else None


def _write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` whole or not at all: written to a temporary file of this
    process's own, then renamed over ``path`` (atomic), so processes writing one key at once
    (the test suite's workers share a cache) leave one whole file, the last renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
