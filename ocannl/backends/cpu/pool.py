"""The threads that share a routine's large loops: a pool started once per process.

A routine's split items call ``ocannl_pool_run(job, frame, extent, per_thread)``. The extent
of the item's outermost loop is cut into chunks (``per_thread`` per thread); the calling thread
and the pool's workers claim chunks one at a time until none is left, and the call returns when
every chunk is done. A chunk computes its own cells as one thread would, so the bits never
depend on who ran it or on the thread count. Claiming chunks, rather than owning a fixed share,
means that a worker kept off its core (another process, another library's spinning threads)
holds up at most the chunk it took: the caller takes the rest.

Workers are started on the first shared item and live as long as the process. Between jobs a
worker spins for about ``SPIN_CYCLES`` (a step's next large loop usually comes sooner than a
sleeping thread would wake), then sleeps on a futex. The pool is written in LLVM IR like the
routines, so it needs no C compiler; it serves Linux (futexes). A second thread calling in while
a job runs (two routines run from two Python threads) runs its whole extent itself, and a forked
child (which has none of its parent's threads) starts workers of its own on first use.

The protocol: a job is posted by writing its fields, then the ticket (its generation, its
number of chunks, the next chunk to claim: 0), then ``generation``. A chunk is claimed by a
compare-and-swap of the ticket, so it is claimed only while that job has chunks left; and the
next job is posted only once every chunk of the current one is done, so whoever claims a chunk
read that job's fields. A late worker still holding an old generation fails to claim.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir

from ocannl.backends.cpu.scalar import I32, I64, const_int

_VOID_P = ir.IntType(8).as_pointer()
JOB = ir.FunctionType(ir.VoidType(), [_VOID_P, I64, I64])  # job(frame, lo, hi)
RUN = ir.FunctionType(ir.VoidType(), [JOB.as_pointer(), _VOID_P, I64, I64])
RUN_SYMBOL, SIZE_SYMBOL = "ocannl_pool_run", "ocannl_pool_size"

# A worker spins this many timestamp-counter ticks (about 40 us at 3 GHz) before sleeping.
SPIN_CYCLES = 1 << 17
# Chunks per thread taking part in a job, by default (``ocannl_pool_run``'s last argument).
CHUNKS_PER_THREAD = 4
MAX_THREADS = 1 << 12  # chunks count in 16 bits of the ticket
# The caller waiting for chunks others took yields its core after this many pauses.
WAIT_PAUSES = 1 << 14

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 128, 129  # the _PRIVATE forms: the pool is one process's


def supported() -> bool:
    """Linux on x86-64 or AArch64 (the futex system call's number is known)."""
    return sys.platform.startswith("linux") and platform.machine().lower() in _SYS_FUTEX


def module_ir() -> str:
    """The pool's module: ``ocannl_pool_run`` and ``ocannl_pool_size``."""
    return str(_Pool().module)


class _Pool:
    def __init__(self) -> None:
        m = self.module = ir.Module(name="ocannl_pool")
        machine = platform.machine().lower()
        x86 = machine in ("x86_64", "amd64")

        def var(name: str, ty: ir.Type) -> ir.GlobalVariable:
            g = ir.GlobalVariable(m, ty, name)
            g.linkage = "internal"
            g.initializer = ir.Constant(ty, None if isinstance(ty, ir.PointerType) else 0)
            return g

        self.gen = var("generation", I32)  # bumped once per job: the futex word workers sleep on
        self.ticket = var("ticket", I64)  # generation << 32 | chunks << 16 | next chunk
        self.done = var("done", I64)  # chunks of the current job done
        self.sleepers = var("sleepers", I32)  # workers asleep, or about to be
        self.busy = var("busy", I32)  # a caller owns the pool
        self.started = var("started", I32)  # workers started by the process ``owner``
        self.owner = var("owner", I32)  # the process id the workers belong to
        self.size = var("size", I32)  # workers wanted (``ocannl_pool_size``)
        self.job = var("job", JOB.as_pointer())
        self.frame = var("frame", _VOID_P)
        self.extent = var("extent", I64)
        self.chunks = var("chunks", I64)

        def declare(name: str, ret: ir.Type, args: list[ir.Type], var_arg: bool = False
                    ) -> ir.Function:
            return ir.Function(m, ir.FunctionType(ret, args, var_arg=var_arg), name)

        self.syscall = declare("syscall", I64, [I64], var_arg=True)
        self.thread_fn = ir.FunctionType(_VOID_P, [_VOID_P])
        self.create = declare("pthread_create", I32, [I64.as_pointer(), _VOID_P,
                                                      self.thread_fn.as_pointer(), _VOID_P])
        self.detach = declare("pthread_detach", I32, [I64])
        self.getpid = declare("getpid", I32, [])
        self.sched_yield = declare("sched_yield", I32, [])
        void = ir.FunctionType(ir.VoidType(), [])
        self.pause = m.declare_intrinsic("llvm.x86.sse2.pause", (), void) if x86 else None
        self.clock = (m.declare_intrinsic("llvm.readcyclecounter", (), ir.FunctionType(I64, []))
                      if x86 else None)
        self.futex = const_int(_SYS_FUTEX[machine])
        self.claim = self._claim()
        self.worker = self._worker()
        self._run()
        self._resize()

    # --- helpers ----------------------------------------------------------------------------

    @staticmethod
    def load(b: ir.IRBuilder, g: ir.GlobalVariable, order: str = "acquire") -> ir.Value:
        return b.load_atomic(g, order, 4 if g.value_type == I32 else 8)

    @staticmethod
    def store(b: ir.IRBuilder, value: ir.Value, g: ir.GlobalVariable,
              order: str = "monotonic") -> None:
        b.store_atomic(value, g, order, 4 if g.value_type == I32 else 8)

    def relax(self, b: ir.IRBuilder) -> None:
        if self.pause is not None:
            b.call(self.pause, [])

    def futex_call(self, b: ir.IRBuilder, op: int, value: ir.Value) -> None:
        b.call(self.syscall, [self.futex, b.ptrtoint(self.gen, I64), const_int(op),
                              b.zext(value, I64) if value.type != I64 else value, const_int(0)])

    # --- functions --------------------------------------------------------------------------

    def _claim(self) -> ir.Function:
        """``void claim(i32 generation)``: run chunks of that job until none is left."""
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [I32]), "ocannl_pool_claim")
        fn.linkage = "internal"
        gen = fn.args[0]
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        top, take, run, out = (fn.append_basic_block(n) for n in ("top", "take", "run", "out"))
        b.branch(top)
        b.position_at_end(top)
        job, frame = self.load(b, self.job, "monotonic"), self.load(b, self.frame, "monotonic")
        extent = self.load(b, self.extent, "monotonic")
        chunks = self.load(b, self.chunks, "monotonic")
        ticket = self.load(b, self.ticket)
        tag = b.trunc(b.lshr(ticket, const_int(32)), I32)
        chunk = b.and_(ticket, const_int(0xFFFF))
        bound = b.and_(b.lshr(ticket, const_int(16)), const_int(0xFFFF))
        open_ = b.and_(b.icmp_unsigned("==", tag, gen), b.icmp_unsigned("<", chunk, bound))
        b.cbranch(open_, take, out)
        b.position_at_end(take)
        got = b.cmpxchg(self.ticket, ticket, b.add(ticket, const_int(1)), "acq_rel", "acquire")
        b.cbranch(b.extract_value(got, 1), run, top)
        b.position_at_end(run)
        lo = b.udiv(b.mul(extent, chunk), chunks)
        hi = b.udiv(b.mul(extent, b.add(chunk, const_int(1))), chunks)
        b.call(job, [frame, lo, hi])
        b.atomic_rmw("add", self.done, const_int(1), "release")
        b.branch(top)
        b.position_at_end(out)
        b.ret_void()
        return fn

    def _worker(self) -> ir.Function:
        """``void *worker(void *)``: spin, then sleep, until a job is posted; claim its chunks;
        for ever."""
        fn = ir.Function(self.module, self.thread_fn, "ocannl_pool_worker")
        fn.linkage = "internal"
        entry, top, spin, spun, sleep, work = (fn.append_basic_block(n) for n in (
            "entry", "top", "spin", "spun", "sleep", "work"))
        b = ir.IRBuilder(entry)
        seen, tries = b.alloca(I32), b.alloca(I64)
        b.store(self.load(b, self.gen), seen)
        b.branch(top)
        b.position_at_end(top)
        t0 = b.call(self.clock, []) if self.clock is not None else None
        b.store(const_int(0), tries)
        b.branch(spin)
        b.position_at_end(spin)
        now = self.load(b, self.gen)
        b.cbranch(b.icmp_unsigned("!=", now, b.load(seen)), work, spun)
        b.position_at_end(spun)
        self.relax(b)
        if t0 is not None:
            over = b.icmp_unsigned(">", b.sub(b.call(self.clock, []), t0), const_int(SPIN_CYCLES))
        else:  # no cycle counter to read: count pauses
            n = b.add(b.load(tries), const_int(1))
            b.store(n, tries)
            over = b.icmp_unsigned(">", n, const_int(SPIN_CYCLES >> 6))
        b.cbranch(over, sleep, spin)
        b.position_at_end(sleep)
        b.atomic_rmw("add", self.sleepers, ir.Constant(I32, 1), "seq_cst")
        with b.if_then(b.icmp_unsigned("==", self.load(b, self.gen, "seq_cst"), b.load(seen))):
            self.futex_call(b, _FUTEX_WAIT, b.load(seen))
        b.atomic_rmw("sub", self.sleepers, ir.Constant(I32, 1), "seq_cst")
        b.branch(top)
        b.position_at_end(work)
        b.store(now, seen)
        b.call(self.claim, [now])
        b.branch(top)
        return fn

    def _run(self) -> None:
        """``void ocannl_pool_run(job, frame, extent, per_thread)``."""
        fn = ir.Function(self.module, RUN, RUN_SYMBOL)
        job, frame, extent, per_thread = fn.args
        entry, alone, owned, grow, grown, wait, done = (fn.append_basic_block(n) for n in (
            "entry", "alone", "owned", "grow", "grown", "wait", "done"))
        b = ir.IRBuilder(entry)
        tid, polls = b.alloca(I64), b.alloca(I64)
        got = b.cmpxchg(self.busy, ir.Constant(I32, 0), ir.Constant(I32, 1), "acquire",
                        "monotonic")
        b.cbranch(b.extract_value(got, 1), owned, alone)
        b.position_at_end(alone)  # another thread's job is running: do all of this one here
        b.call(job, [frame, const_int(0), extent])
        b.ret_void()

        b.position_at_end(owned)
        pid = b.call(self.getpid, [])
        with b.if_then(b.icmp_unsigned("!=", b.load(self.owner), pid)):  # first use, or a fork
            b.store(pid, self.owner)
            b.store(ir.Constant(I32, 0), self.sleepers)
            b.store(ir.Constant(I32, 0), self.started)
        size = self.load(b, self.size)
        b.cbranch(b.icmp_unsigned("<", b.load(self.started), size), grow, grown)
        b.position_at_end(grow)  # start workers up to the size asked for
        k = b.add(b.load(self.started), ir.Constant(I32, 1))
        status = b.call(self.create, [tid, ir.Constant(_VOID_P, None), self.worker,
                                      b.inttoptr(b.zext(k, I64), _VOID_P)])
        ok = b.icmp_signed("==", status, ir.Constant(I32, 0))
        with b.if_then(ok):
            b.call(self.detach, [b.load(tid)])
            b.store(k, self.started)
        b.cbranch(b.and_(ok, b.icmp_unsigned("<", k, size)), grow, grown)

        b.position_at_end(grown)
        started = b.load(self.started)
        use = b.select(b.icmp_unsigned("<", size, started), size, started)
        chunks = b.mul(b.add(b.zext(use, I64), const_int(1)), per_thread)
        chunks = b.select(b.icmp_unsigned("<", extent, chunks), extent, chunks)
        gen = b.add(self.load(b, self.gen, "monotonic"), ir.Constant(I32, 1))
        self.store(b, job, self.job)
        self.store(b, frame, self.frame)
        self.store(b, extent, self.extent)
        self.store(b, chunks, self.chunks)
        self.store(b, const_int(0), self.done)
        self.store(b, b.or_(b.shl(b.zext(gen, I64), const_int(32)), b.shl(chunks, const_int(16))),
                   self.ticket, "release")
        self.store(b, gen, self.gen, "seq_cst")
        with b.if_then(b.icmp_unsigned("!=", self.load(b, self.sleepers, "seq_cst"),
                                       ir.Constant(I32, 0))):
            self.futex_call(b, _FUTEX_WAKE, const_int(0x7FFFFFFF))
        b.call(self.claim, [gen])
        b.store(const_int(0), polls)
        b.branch(wait)
        b.position_at_end(wait)  # chunks others took
        finished = b.icmp_unsigned("==", self.load(b, self.done), chunks)
        with b.if_then(b.not_(finished)):
            self.relax(b)
            n = b.add(b.load(polls), const_int(1))
            b.store(n, polls)
            with b.if_then(b.icmp_unsigned(">", n, const_int(WAIT_PAUSES))):
                b.call(self.sched_yield, [])
        b.cbranch(finished, done, wait)
        b.position_at_end(done)
        self.store(b, ir.Constant(I32, 0), self.busy, "release")
        b.ret_void()

    def _resize(self) -> None:
        """``void ocannl_pool_size(i32 workers)``: how many workers jobs from now on use."""
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [I32]), SIZE_SYMBOL)
        b = ir.IRBuilder(fn.append_basic_block())
        self.store(b, fn.args[0], self.size, "release")
        b.ret_void()
