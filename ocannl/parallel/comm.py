"""Communicators: one protocol, three worlds (a single process, MPI between processes, NCCL
between GPUs), every collective waited for with a deadline that names the rank missing."""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np

from ocannl.errors import Failure, real

# --- communicators ------------------------------------------------------------------------------


@runtime_checkable
class Communicator(Protocol):
    """A group of ``size`` processes, this one being ``rank``. Device buffers are what
    :meth:`Context.device_buffer` returns (NumPy on the CPU, CuPy on CUDA), flat and
    contiguous; every collective must be called by every rank, in the same order.

    A communicator may also keep a ``step`` attribute (the training step, which its errors
    name; :class:`DataParallel` sets it where there is one) and bound how long a collective
    may wait (:class:`MpiCommunicator`'s ``timeout``, raising :class:`CollectiveTimeout`)."""

    name: str
    rank: int
    size: int

    def allreduce_sum(self, buf: Any) -> None:
        """Sum an f32 device buffer over the ranks, in place (every rank gets the same bits)."""

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        """Overwrite a device buffer (any dtype) with root's, in place."""

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Root's (picklable) host object, on every rank."""

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's host object, in rank order, on every rank."""

    def alltoall_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Host f32 buffers: block ``r`` of ``send`` (its first axis) to rank ``r``, each
        rank's block for this one into ``recv``'s block of that rank. Bytes only: no sum."""

    def allgather_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Host f32 buffers: every rank's ``send`` into ``recv``, in rank order."""

    def allgather_inplace(self, buf: Any) -> None:
        """A device f32 buffer of ``size`` equal blocks: rank ``r``'s block ``r`` to every
        rank, in place (ZeRO-1's gather of the updated parameters)."""

    def start_allreduce_sum(self, buf: Any) -> Pending:
        """:meth:`allreduce_sum`, started: its result is in ``buf`` once the returned
        :class:`Pending` is waited for (a communicator without nonblocking collectives runs
        it at once)."""

    def start_alltoall(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        """:meth:`alltoall_buffer`, started."""

    def start_allgather(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        """:meth:`allgather_buffer`, started."""

    def allreduce_max(self, value: int) -> int:
        """The largest of the ranks' integers."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def abort(self, code: int = 1) -> NoReturn:
        """End every rank of the job (after an error on this one)."""


class Pending:
    """A started collective. ``test()`` lets it progress (MPI moves bytes inside its calls)
    and says whether it completed; ``wait()`` returns once it has, under the communicator's
    deadline. One made by :meth:`done` has completed already (the collective ran at once)."""

    def __init__(self, comm: Any = None, req: Any = None, what: str = "",
                 then: Any = None) -> None:
        self._comm, self._req, self._what, self._then = comm, req, what, then

    @classmethod
    def done(cls) -> Pending:
        return cls()

    def test(self) -> bool:
        return self._req is None or bool(self._req.Test())

    def wait(self) -> None:
        if self._req is not None:
            self._comm._wait(self._req, self._what)
            self._req = None
            if self._then is not None:
                self._then()


def _check_f32(buf: Any, what: str) -> None:
    if getattr(buf, "dtype", None) != np.float32:
        raise ValueError(f"{what}: expected an f32 buffer, got {getattr(buf, 'dtype', type(buf))}"
                         f" (narrow buffers are never summed; f64 is not supported)")


class SingleProcess:
    """A world of one: rank 0 of 1; every collective leaves its argument as it is."""

    name = "single"
    rank = 0
    size = 1
    step = 0

    def allreduce_sum(self, buf: Any) -> None:
        _check_f32(buf, "allreduce_sum")

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        _check_root(root, 1)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        _check_root(root, 1)
        return obj

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def alltoall_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = send.reshape(recv.shape)

    def allgather_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = send.reshape(recv.shape)

    def allgather_inplace(self, buf: Any) -> None:
        _check_f32(buf, "allgather_inplace")

    def start_allreduce_sum(self, buf: Any) -> Pending:
        self.allreduce_sum(buf)
        return Pending.done()

    def start_alltoall(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        self.alltoall_buffer(send, recv)
        return Pending.done()

    def start_allgather(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        self.allgather_buffer(send, recv)
        return Pending.done()

    def allreduce_max(self, value: int) -> int:
        return int(value)

    def barrier(self) -> None:
        return None

    def abort(self, code: int = 1) -> NoReturn:
        sys.stderr.flush()
        os._exit(code)

    def __repr__(self) -> str:
        return "SingleProcess()"


def _check_blocks(buf: Any, size: int) -> None:
    if int(buf.size) % size:
        raise ValueError(f"allgather_inplace: a buffer of {buf.size} elements does not split "
                         f"into {size} equal blocks (one per rank)")


def _check_root(root: int, size: int) -> None:
    if not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in [0, {size}), got {root!r}")


# --- deadlines ----------------------------------------------------------------------------------

#: The default of a communicator's ``timeout`` (seconds) where ``OCANNL_COLLECTIVE_TIMEOUT`` is
#: not set: longer than any compile or checkpoint write this project does while the other ranks
#: wait, short enough that a hung job does not hold its machines for hours.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "OCANNL_COLLECTIVE_TIMEOUT"
# A collective is first waited for as a blocking one would (testing it in a loop, which is
# also what drives MPI's progress) for _SPIN_S; then tested between naps growing from _NAP_MIN_S
# to _NAP_MAX_S (or _NAP_SHARE of the time waited so far, when that is longer, up to _NAP_CAP_S,
# below the shortest grace in which a rank that timed out waits for answers), so a rank waiting
# for a hung one sleeps instead of spinning a core. The price: a collective whose last rank
# comes later than _SPIN_S completes up to a nap later (1 ms, or 1% of the wait).
_SPIN_S = 20e-3
_NAP_MIN_S, _NAP_MAX_S, _NAP_SHARE, _NAP_CAP_S = 50e-6, 1e-3, 0.01, 0.1
_PING, _PONG = 1, 2  # tags of the side channel on which a rank that timed out asks the others


class CollectiveTimeout(Failure, TimeoutError):
    """A collective did not complete within its communicator's ``timeout``: a rank died, hung
    (stopped) or is stuck outside the collectives. ``missing``: the ranks that did not answer
    this rank's call (empty when every rank answered); ``step``: the communicator's ``step``
    when it timed out; ``what``: the collective. The communicator cannot be used after it (the
    collective is still pending); let the exception end the process: under ``python -m mpi4py``
    it aborts the whole job, and otherwise the communicator aborts it when the process exits."""

    def __init__(self, message: str, *, rank: int = -1, missing: Sequence[int] = (),
                 step: int | None = None, what: str = "") -> None:
        super().__init__(message)
        self.rank, self.missing, self.step, self.what = rank, tuple(missing), step, what


def collective_timeout(timeout: float | None = None) -> float:
    """The timeout of a collective in seconds: ``timeout`` when given, else the environment's
    ``OCANNL_COLLECTIVE_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`. A number > 0; ``inf`` (or
    ``"inf"``) waits forever (still without spinning). ``ValueError`` naming the value
    otherwise."""
    what = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_TIMEOUT_S
        what = TIMEOUT_ENV
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0 (or "
                             f"'inf')") from None
    v = real(what, timeout, "a number of seconds > 0 (or inf)")
    if not v > 0:  # NaN included
        raise ValueError(f"{what} must be a number of seconds > 0 (or inf), got {timeout!r}")
    return v


_SLOT = 256


def _slot(data: bytes) -> bytearray:
    """``data``'s slot of an object collective: its length, then itself if it fits."""
    slot = bytearray(_SLOT)
    n = len(data)
    struct.pack_into("<q", slot, 0, n)
    if n <= _SLOT - 8:
        slot[8:8 + n] = data
    return slot


def _process_state(pid: int) -> str:
    """What this machine's ``/proc`` says of process ``pid``: stopped, running, ..."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone (it died or exited)"
    return {"T": "stopped (SIGSTOP?)", "t": "stopped by a debugger", "Z": "dead (a zombie)",
            "R": "running (not in a collective)", "S": "sleeping (not in a collective)",
            "D": "in uninterruptible I/O"}.get(state, f"in state {state}")


class MpiCommunicator:
    """MPI through ``mpi4py`` (``pip install 'ocannl[dist]'``), over ``comm`` (default
    ``MPI.COMM_WORLD``). ``mpi4py.MPI`` is imported here, not when this module is: importing it
    initialises MPI. Creating one is itself collective (every rank of ``comm`` must).

    Host (NumPy) buffers are reduced in place; a device (CuPy) buffer is copied to the host,
    reduced and copied back (use :class:`NcclCommunicator` on GPUs).

    **Faults.** Every collective runs nonblocking (``Iallreduce``, ``Ibcast``, ``Iallgather``,
    ``Ibarrier``) and is waited for with a deadline of ``timeout`` seconds from this rank's
    call (default: :func:`collective_timeout`, ``OCANNL_COLLECTIVE_TIMEOUT`` else 300 s; ``inf``
    for none; an attribute, which may be changed between collectives): tested in a loop for its
    first 20 ms, as a blocking call spins, then between naps of at most 1 ms (or 1% of the time
    waited so far), so a rank waiting for a hung one sleeps. When the deadline passes, the rank
    asks every other rank, over a side channel (a duplicate of ``comm``), which collective it
    is in; a rank waiting in one answers, a dead, stopped or busy one does not, and
    :class:`CollectiveTimeout` names the ranks that did not answer (with their state, where
    they run on this machine), this rank's ``step`` and the collective.

    ``step``: the training step, named by the errors; :class:`DataParallel` keeps it (the
    steps reduced since its start, or since the checkpoint it loaded).
    """

    name = "mpi"
    step: int = 0

    def __init__(self, comm: Any = None, *, timeout: float | None = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as err:
            raise ImportError(f"MpiCommunicator needs mpi4py and an MPI library: pip install "
                              f"'ocannl[dist]' (mpi4py, mpich) ({err})") from None
        self._mpi = MPI
        self._timeout = collective_timeout(timeout)
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self._local_rank: int | None = None
        self._seq = 0  # the collectives this rank started
        self._what = "MpiCommunicator()"  # the one in progress, told to a rank that asks
        self._broken: str | None = None
        self._pending: list[Any] = []  # side-channel sends not yet known complete
        self._asked = 0  # this rank's rounds of questions
        self._side: Any = None
        self._where: list[tuple[str, int]] = []
        self._shared: list[Any] = []  # every shared window made, with its node communicator
        self._arrivals: SharedCounters | None = None  # each rank's count of shared_sync calls
        self._arrived = 0  # this rank's
        self._start("the side channel (Idup)")
        side, req = self.comm.Idup()
        self._wait(req, "the side channel (Idup)")
        self._side = side
        self._where = self.allgather((socket.gethostname(), os.getpid()))

    @property
    def timeout(self) -> float:
        """Seconds a collective may wait (:func:`collective_timeout`); may be set any time."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._timeout = collective_timeout(value)

    def local_rank(self) -> int:
        """This rank's index among the ranks on its node (to pick its GPU)."""
        if self._local_rank is None:
            node = self.comm.Split_type(self._mpi.COMM_TYPE_SHARED, key=self.rank)
            self._local_rank = int(node.Get_rank())
            node.Free()
        return self._local_rank

    # --- waiting with a deadline -----------------------------------------------------------

    def _start(self, what: str) -> None:
        if self._broken is not None:
            raise Failure(f"{self!r} cannot be used after {self._broken}")
        self._seq += 1
        self._what = what

    def _wait(self, req: Any, what: str) -> None:
        """Until ``req`` completes: tested in a loop for ``_SPIN_S``, then between growing
        naps, answering the other ranks' questions, until the deadline."""
        if req.Test():
            return
        t0 = time.monotonic()
        spin_end = t0 + _SPIN_S
        while time.monotonic() < spin_end:
            if req.Test():
                return
        deadline = t0 + self.timeout
        nap = _NAP_MIN_S
        while True:
            self._answer()
            if req.Test():
                return
            now = time.monotonic()
            if now >= deadline:
                if self._diagnose(req, what, now - t0):
                    return
            time.sleep(min(nap, max(deadline - now, 0.0)))
            nap = min(2 * nap, max(_NAP_MAX_S, _NAP_SHARE * (now - t0)), _NAP_CAP_S)

    def _answer(self) -> None:
        """Tell every rank that asked which collective this one is in."""
        side = self._side
        if side is None:
            return
        st = self._mpi.Status()
        while side.Iprobe(source=self._mpi.ANY_SOURCE, tag=_PING, status=st):
            src = st.Get_source()
            ask = side.recv(source=src, tag=_PING)
            self._pending.append(side.isend(
                {"ask": ask, "rank": self.rank, "seq": self._seq, "step": self.step,
                 "what": self._what}, dest=src, tag=_PONG))
        self._pending = [r for r in self._pending if not r.Test()]

    def _diagnose(self, req: Any, what: str, waited: float) -> bool:
        """The deadline passed: ask the other ranks where they are, for a short grace; True
        when the collective completed meanwhile, else :class:`CollectiveTimeout`."""
        others = [r for r in range(self.size) if r != self.rank]
        answers: dict[int, dict[str, Any]] = {}
        side = self._side
        if side is not None:
            self._asked += 1
            ask = self._asked
            for r in others:
                self._pending.append(side.isend(ask, dest=r, tag=_PING))
            st = self._mpi.Status()
            grace_end = time.monotonic() + min(2.0, max(0.2, 0.1 * self.timeout))
            while len(answers) < len(others) and time.monotonic() < grace_end:
                self._answer()
                if req.Test():
                    return True
                while side.Iprobe(source=self._mpi.ANY_SOURCE, tag=_PONG, status=st):
                    msg = side.recv(source=st.Get_source(), tag=_PONG)
                    if msg["ask"] == ask:
                        answers[int(msg["rank"])] = msg
                time.sleep(1e-3)
        if req.Test():
            return True
        missing = [r for r in others if r not in answers]
        here = socket.gethostname()
        parts = []
        if missing:
            def where(r: int) -> str:
                if r >= len(self._where):
                    return ""
                host, pid = self._where[r]
                state = f"on this host, {_process_state(pid)}" if host == here else f"on {host}"
                return f" (pid {pid} {state})"
            listed = ", ".join(f"rank {r}{where(r)}" for r in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            parts.append(f"{listed}{more} did not answer")
        elif side is None:
            parts.append("the other ranks could not be asked (no side channel yet)")

        def here_too(a: dict[str, Any]) -> bool:
            return a["seq"] == self._seq and a["what"] == self._what

        same = [r for r in sorted(answers) if here_too(answers[r])]
        for r in sorted(answers):
            a = answers[r]
            if not here_too(a):
                parts.append(f"rank {r} answered from collective #{a['seq']} ({a['what']}) at "
                             f"step {a['step']}")
        if same:
            parts.append(f"rank{'s' if len(same) > 1 else ''} "
                         f"{', '.join(map(str, same[:8]))}{' ...' if len(same) > 8 else ''} "
                         f"answered, waiting in the same collective")
        if answers and not missing and len(same) == len(others):
            parts.append("every rank is waiting in it: MPI did not complete it")
        elif answers and not missing and all(a["seq"] > self._seq for a in answers.values()):
            parts.append("every other rank is past it: this rank's own wait did not end")
        self._broken = f"collective #{self._seq} ({what}) timed out"
        atexit.register(self._abort_at_exit)
        raise CollectiveTimeout(
            f"{self.name} rank {self.rank}: {what} (collective #{self._seq}) at step "
            f"{self.step} did not complete within {self.timeout:g} s (waited {waited:.1f} s): "
            + "; ".join(parts) + ". A rank that died, hung or is stuck outside the "
            f"collectives ends the job; if one is only slow (a step, a compile or a checkpoint "
            f"longer than that), raise the timeout: MpiCommunicator(timeout=...) or "
            f"{TIMEOUT_ENV} (seconds)",
            rank=self.rank, missing=missing, step=self.step, what=what)

    def _abort_at_exit(self) -> None:
        # A pending collective would hold MPI_Finalize (and the other ranks) forever.
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(1)

    # --- the collectives -------------------------------------------------------------------

    def _run(self, what: str, start: Any) -> None:
        """Start a nonblocking MPI call (``start()`` returns its request) and wait for it with
        the deadline; ``what`` names it in errors (DataParallel's shard-tree exchange too)."""
        self._start(what)
        self._wait(start(), what)

    def allreduce_sum(self, buf: Any) -> None:
        _check_f32(buf, "allreduce_sum")
        what = f"allreduce_sum of {buf.size} f32"
        if isinstance(buf, np.ndarray):
            self._run(what, lambda: self.comm.Iallreduce(self._mpi.IN_PLACE, buf,
                                                          op=self._mpi.SUM))
            return
        host = np.ascontiguousarray(buf.get())
        self._run(what, lambda: self.comm.Iallreduce(self._mpi.IN_PLACE, host,
                                                      op=self._mpi.SUM))
        buf.set(host)

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        _check_root(root, self.size)
        what = f"bcast_buffer of {buf.size} {buf.dtype} from rank {root}"
        if isinstance(buf, np.ndarray):
            self._run(what, lambda: self.comm.Ibcast(buf, root=root))
            return
        host = np.ascontiguousarray(buf.get())
        self._run(what, lambda: self.comm.Ibcast(host, root=root))
        buf.set(host)

    # Objects travel pickled in a slot of _SLOT bytes (8 of them the pickle's length, the
    # pickle itself when it fits): one collective for a small object (a loss, a flag); a
    # second one carries the pickles that did not fit, every rank knowing their lengths.

    def bcast(self, obj: Any, root: int = 0) -> Any:
        _check_root(root, self.size)
        what = f"bcast from rank {root}"
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else b""
        slot = _slot(data)
        self._run(what, lambda: self.comm.Ibcast([slot, self._mpi.BYTE], root=root))
        n = struct.unpack_from("<q", slot)[0]
        if n <= _SLOT - 8:
            return obj if self.rank == root else pickle.loads(slot[8:8 + n])
        rest = bytearray(data) if self.rank == root else bytearray(n)
        self._run(what + " (a large object)",
                  lambda: self.comm.Ibcast([rest, self._mpi.BYTE], root=root))
        return obj if self.rank == root else pickle.loads(rest)

    def allgather(self, obj: Any) -> list[Any]:
        what = "allgather"
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        slots = bytearray(self.size * _SLOT)
        mine = _slot(data)
        self._run(what, lambda: self.comm.Iallgather([mine, self._mpi.BYTE],
                                                     [slots, self._mpi.BYTE]))
        sizes = [struct.unpack_from("<q", slots, r * _SLOT)[0] for r in range(self.size)]
        if max(sizes) <= _SLOT - 8:
            return [pickle.loads(slots[r * _SLOT + 8:r * _SLOT + 8 + n])
                    for r, n in enumerate(sizes)]
        big = [n if n > _SLOT - 8 else 0 for n in sizes]  # the second round: those only
        displs = [sum(big[:r]) for r in range(self.size)]
        out = bytearray(sum(big))
        send = data if big[self.rank] else b""
        self._run(what + " (large objects)", lambda: self.comm.Iallgatherv(
            [send, self._mpi.BYTE], [out, big, displs, self._mpi.BYTE]))
        return [pickle.loads(out[displs[r]:displs[r] + n]) if big[r]
                else pickle.loads(slots[r * _SLOT + 8:r * _SLOT + 8 + n])
                for r, n in enumerate(sizes)]

    def alltoall_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._run(f"all-to-all of {send.size} f32", lambda: self.comm.Ialltoall(send, recv))

    def allgather_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._run(f"allgather of {send.size} f32", lambda: self.comm.Iallgather(send, recv))

    def allgather_inplace(self, buf: Any) -> None:
        _check_f32(buf, "allgather_inplace")
        _check_blocks(buf, self.size)
        what = f"allgather of {buf.size} f32 in {self.size} blocks"
        host = buf if isinstance(buf, np.ndarray) else np.ascontiguousarray(buf.get())
        self._run(what, lambda: self.comm.Iallgather(self._mpi.IN_PLACE, host))
        if host is not buf:
            buf.set(host)

    def _started(self, what: str, start: Any, then: Any = None) -> Pending:
        self._start(what)
        return Pending(self, start(), what, then)

    def start_allreduce_sum(self, buf: Any) -> Pending:
        _check_f32(buf, "start_allreduce_sum")
        what = f"allreduce_sum of {buf.size} f32"
        if isinstance(buf, np.ndarray):
            return self._started(what, lambda: self.comm.Iallreduce(self._mpi.IN_PLACE, buf,
                                                                    op=self._mpi.SUM))
        host = np.ascontiguousarray(buf.get())
        return self._started(what, lambda: self.comm.Iallreduce(self._mpi.IN_PLACE, host,
                                                                op=self._mpi.SUM),
                             lambda: buf.set(host))

    def start_alltoall(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        return self._started(f"all-to-all of {send.size} f32",
                             lambda: self.comm.Ialltoall(send, recv))

    def start_allgather(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        return self._started(f"allgather of {send.size} f32",
                             lambda: self.comm.Iallgather(send, recv))

    def allreduce_max(self, value: int) -> int:
        a = np.array([int(value)], np.int64)  # OverflowError beyond 64 bits, on every rank
        self._run("allreduce_max", lambda: self.comm.Iallreduce(self._mpi.IN_PLACE, a,
                                                                 op=self._mpi.MAX))
        return int(a[0])

    def barrier(self) -> None:
        self._run("barrier", self.comm.Ibarrier)

    # --- memory every rank maps (ranks on one node) ------------------------------------------

    def shared_blocks(self, length: int) -> list[np.ndarray] | None:
        """``length`` zero f32 a rank in memory every rank maps (an MPI-3 shared window), as
        every rank's block, by rank (this rank's at ``[rank]``), or None where the ranks are
        not all on one node. Collective. A rank reads and writes another's block between two
        :meth:`shared_sync` calls: no bytes go through MPI."""
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise ValueError(f"shared_blocks: length must be an integer >= 1, got {length!r}")
        MPI = self._mpi
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        if node.Get_size() != self.size:  # the same answer on every rank
            node.Free()
            return None
        if self._arrivals is None:  # the counters shared_sync meets at, zeroed before any use
            self._arrivals = self._counters(node, 1)
            self._run("shared_blocks (arrival counters zeroed)", self.comm.Ibarrier)
        blocks = self._mapped(node, length, np.float32)
        self.shared_sync("shared_blocks (zeroed)")
        return blocks

    def _mapped(self, node: Any, length: int, dtype: type) -> list[np.ndarray]:
        """``length`` zeros of ``dtype`` a rank in a new shared window over ``node``, every
        rank's (each on a page of its own), this rank's zeroed."""
        MPI = self._mpi
        itemsize = np.dtype(dtype).itemsize
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each block aligned on its own page
        win = MPI.Win.Allocate_shared(itemsize * length, itemsize, info, comm=node)
        info.Free()
        blocks = []
        for r in range(self.size):  # the node's ranks are this communicator's, in order
            mem, _ = win.Shared_query(r)
            blocks.append(np.ndarray((length,), dtype, buffer=mem))
        blocks[self.rank][...] = 0
        win.Lock_all(MPI.MODE_NOCHECK)
        self._shared.append((win, node))  # kept for the process's life: the blocks view it
        return blocks

    def shared_sync(self, what: str) -> None:
        """Every rank's writes to the shared blocks before it seen by every rank after it: a
        barrier in the shared memory itself (each rank counts its arrivals in a counter every
        rank maps, and waits, as for a collective and with its deadline, until every counter
        has reached its own: 0.6 us against MPI's ``Ibarrier`` 1.2 on 2 ranks), between
        memory barriers (``Win.Sync``)."""
        if self._arrivals is None:  # no memory shared yet: nothing to see but the barrier
            self._run(what, self.comm.Ibarrier)
            return
        for win, _ in self._shared:
            win.Sync()
        self._arrived += 1
        arrived, arrivals = self._arrived, self._arrivals
        # the counter raised, and every rank's looked at once, without fences of their own:
        # the window's fences around them are this barrier's (no rank can be a barrier ahead)
        arrivals.store(0, arrived)
        self._start(what)
        if not arrivals.all_at(0, arrived):
            self._wait(_Reached(arrivals, 0, arrived), what)
        for win, _ in self._shared:
            win.Sync()

    def shared_counters(self, n: int) -> SharedCounters:
        """``n`` counters a rank, zero, in memory every rank maps (:class:`SharedCounters`),
        for ranks that signal each other without a barrier. Collective; only after
        :meth:`shared_blocks` has found the ranks on one node."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"shared_counters: n must be an integer >= 1, got {n!r}")
        if self._arrivals is None:
            raise ValueError(f"{self!r}: shared_counters needs memory the ranks map: call "
                             f"shared_blocks first (and only where it found one node)")
        counters = self._counters(self._shared[0][1], n)
        self.shared_sync("shared_counters (zeroed)")
        return counters

    def _counters(self, node: Any, n: int) -> SharedCounters:
        """``n`` zero counters a rank in a new shared window over ``node``."""
        return SharedCounters(self, [a.view(np.int64)
                                     for a in self._mapped(node, 8 * n, np.uint8)])

    def abort(self, code: int = 1) -> NoReturn:
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)
        os._exit(code)  # Abort does not return; this is for the type checker

    def __repr__(self) -> str:
        return f"MpiCommunicator(rank={self.rank}, size={self.size})"


class SharedCounters:
    """Counters every rank maps, ``n`` a rank, each only ever raised by its rank: a rank
    :meth:`raise_to` a count once the shared memory it stands for is written (its writes
    made visible first), and the others test (:meth:`reached`) or wait (:meth:`wait`, with
    the communicator's deadline and its named error) until every rank's counter has reached
    a count. A signal between some ranks' work, where :meth:`MpiCommunicator.shared_sync`
    would hold every rank at a barrier."""

    __slots__ = ("_comm", "_counters", "_fence")

    def __init__(self, comm: MpiCommunicator, counters: list[np.ndarray]) -> None:
        self._comm, self._counters = comm, counters
        self._fence = comm._shared[0][0].Sync  # a memory barrier (MPI_Win_sync)

    def raise_to(self, i: int, count: int) -> None:
        """This rank's counter ``i`` to ``count``, after its writes before it."""
        self._fence()
        self.store(i, count)

    def store(self, i: int, count: int) -> None:
        """This rank's counter ``i`` to ``count``, without the fence that makes its writes
        before it visible first (:meth:`raise_to`'s)."""
        self._counters[self._comm.rank][i] = count

    def reached(self, i: int, count: int) -> bool:
        """Whether every rank's counter ``i`` has reached ``count`` (its writes before then
        visible here when it has)."""
        if not self.all_at(i, count):
            return False
        self._fence()
        return True

    def all_at(self, i: int, count: int) -> bool:
        """Whether every rank's counter ``i`` has reached ``count``, without the fence that
        makes their writes visible (:meth:`reached`'s)."""
        for c in self._counters:
            if c[i] < count:
                return False
        return True

    def wait(self, i: int, count: int, what: str) -> None:
        """Until :meth:`reached`, as a collective waits (``what`` names it in a timeout)."""
        self._comm._start(what)
        self._comm._wait(_Reached(self, i, count), what)


class _Reached:
    """A request (``Test``) complete once :meth:`SharedCounters.reached`."""

    __slots__ = ("count", "counters", "i")

    def __init__(self, counters: SharedCounters, i: int, count: int) -> None:
        self.counters, self.i, self.count = counters, i, count

    def Test(self) -> bool:  # noqa: N802 - MPI's request protocol
        return self.counters.reached(self.i, self.count)


class NcclCommunicator:
    """NCCL through ``cupy.cuda.nccl``: one rank per GPU, bootstrapped over ``mpi`` (an
    :class:`MpiCommunicator`, created when not given), which also carries the host-side
    collectives (objects, barriers, integer maxima).

    ``device_id``: this rank's GPU; by default its rank among the ranks on its node, modulo the
    number of GPUs there. Build the context on it: ``Context.cuda(comm.device_id)``. Rank 0
    draws the unique id and broadcasts it over MPI; every rank then joins the NCCL
    communicator.

    **Streams.** Every device collective runs on the communicator's own stream
    (:attr:`stream`), after the work submitted so far to the stream the context's kernels run
    on (:meth:`follow`; ``DataParallel.setup`` tells it), and that stream waits for it only
    when its :class:`Pending` is waited for: a bucket's exchange started during the backward
    code overlaps the rest of it on the GPU, and the host never waits for the GPU there. The
    blocking forms (:meth:`allreduce_sum`, :meth:`bcast_buffer`, :meth:`allgather_inplace`)
    are started and waited for at once. With more than 2 ranks, the shard tree's sum
    (:meth:`start_tree_sum`) is an NCCL allgather of every rank's partial sums and the tree's
    additions on the device, on the same stream.

    **Faults.** NCCL's collectives have no deadline of their own: a rank that died or hung
    leaves the others' kernels waiting on the GPU, and their hosts in the next synchronisation.
    So each device collective records an event after itself, and the next one (and
    :meth:`barrier`) first waits for it as :class:`MpiCommunicator` waits for a collective,
    with ``timeout`` (the MPI communicator's), answering and asking the other ranks over MPI;
    on timeout NCCL's communicator is aborted (its kernels return) and
    :class:`CollectiveTimeout` names the ranks that did not answer. The host thus runs at most
    one device collective (a step) ahead of the GPU. The host-side collectives are MPI's, with
    its deadline. ``step`` and ``timeout`` are the MPI communicator's.
    """

    name = "nccl"

    def __init__(self, mpi: MpiCommunicator | None = None, *, device_id: int | None = None,
                 timeout: float | None = None) -> None:
        self.mpi = MpiCommunicator(timeout=timeout) if mpi is None else mpi
        if mpi is not None and timeout is not None:
            self.mpi.timeout = timeout
        self._last: Any = None  # the event after the last device collective
        self._follows: Any = None  # the stream the context's kernels run on (follow)
        self._gathered: dict[tuple[int, int], Any] = {}  # start_tree_sum's device scratch
        self.rank, self.size = self.mpi.rank, self.mpi.size
        # Every rank must be able to use NCCL before any NCCL call, or the others would wait.
        problem = None
        try:
            import importlib

            import cupy

            nccl = importlib.import_module("cupy.cuda.nccl")
            ndev = int(cupy.cuda.runtime.getDeviceCount())
            if ndev < 1:
                raise RuntimeError("no CUDA device is visible")
        except Exception as err:  # noqa: BLE001 - any reason NCCL is unusable on this rank
            problem = f"{type(err).__name__}: {err}"
        problems = self.mpi.allgather(problem)
        bad = [(r, p) for r, p in enumerate(problems) if p is not None]
        if bad:
            raise Failure("NcclCommunicator: NCCL through cupy.cuda.nccl is not usable on "
                          + "; ".join(f"rank {r} ({p})" for r, p in bad)
                          + ": use MpiCommunicator (CPU contexts) or install CuPy with NCCL")
        self._cupy, self._nccl = cupy, nccl
        self.device_id = self.mpi.local_rank() % ndev if device_id is None else int(device_id)
        uid: Any = None
        if self.rank == 0:
            try:
                uid = nccl.get_unique_id()
            except Exception as err:  # noqa: BLE001 - told to every rank below
                uid = Failure(f"NcclCommunicator: rank 0 could not draw the NCCL unique id "
                              f"({type(err).__name__}: {err})")
        uid = self.mpi.bcast(uid, root=0)
        if isinstance(uid, Failure):
            raise uid
        with cupy.cuda.Device(self.device_id):
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
            # its collectives' own: it does not wait for the legacy stream's work, nor it for it
            self.stream = cupy.cuda.Stream(non_blocking=True)

    @property
    def step(self) -> int:
        return self.mpi.step

    @step.setter
    def step(self, value: int) -> None:
        self.mpi.step = value

    @property
    def timeout(self) -> float:
        return self.mpi.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self.mpi.timeout = value

    def follow(self, stream: Any) -> None:
        """The CuPy stream the context's kernels run on (``Context.stream``; DataParallel's
        setup tells it): each device collective runs on the communicator's own stream after
        the work submitted there so far, and that stream waits for the collective's end
        before what is submitted after :meth:`Pending.wait`. Without it, the current stream
        (the legacy one: it orders every blocking stream's work around it)."""
        self._follows = stream

    def _compute_stream(self) -> Any:
        return self._follows if self._follows is not None \
            else self._cupy.cuda.get_current_stream()

    def _start(self, what: str, enqueue: Callable[[int], None]) -> Pending:
        """Run ``enqueue(stream_ptr)`` (the NCCL calls, and the device work between them) on
        the communicator's stream once the compute stream's work so far is done; returns the
        :class:`Pending` whose ``wait`` makes the compute stream wait for it (the host does
        not). The host waits (with the deadline) only for the device collective before this
        one, so a fault still ends the job (see the class docstring)."""
        cupy = self._cupy
        with cupy.cuda.Device(self.device_id):
            self._settle(what)
            compute = self._compute_stream()
            ready = cupy.cuda.Event(block=False, disable_timing=True)
            ready.record(compute)
            self.stream.wait_event(ready)
            with self.stream:
                enqueue(int(self.stream.ptr))
            done = cupy.cuda.Event(block=False, disable_timing=True)
            done.record(self.stream)
            self._last = (done, f"NCCL {what} at step {self.step}")
        return _DeviceWait(done, compute, self.device_id, cupy)

    def _settle(self, what: str) -> None:
        """Wait, with the deadline, until the GPU has done the last device collective."""
        last, self._last = self._last, None
        if last is None:
            return
        mpi = self.mpi
        mpi._start(f"{what}, after the last device collective ({last[1]})")
        try:
            mpi._wait(_EventDone(last[0]), f"{what}: waiting for {last[1]} on the GPU")
        except CollectiveTimeout:
            self.comm.abort()  # the waiting kernels return; the communicator is unusable
            raise

    def _ptr(self, buf: Any, what: str) -> int:
        data = getattr(buf, "data", None)
        ptr = getattr(data, "ptr", None)
        if ptr is None:
            raise ValueError(f"NcclCommunicator.{what}: expected a CuPy device buffer (a "
                             f"Context.cuda context), got {type(buf).__name__}")
        return int(ptr)

    def allreduce_sum(self, buf: Any) -> None:
        self.start_allreduce_sum(buf).wait()

    def start_allreduce_sum(self, buf: Any) -> Pending:
        """On the communicator's stream, after the context's kernels before it: in place."""
        _check_f32(buf, "allreduce_sum")
        nccl = self._nccl
        ptr = self._ptr(buf, "allreduce_sum")
        return self._start(f"allreduce_sum of {buf.size} f32", lambda stream: self.comm.allReduce(
            ptr, ptr, int(buf.size), nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream))

    def bcast_buffer(self, buf: Any, root: int = 0) -> None:
        _check_root(root, self.size)
        ptr = self._ptr(buf, "bcast_buffer")
        self._start(f"bcast_buffer of {buf.nbytes} bytes from rank {root}",
                    lambda stream: self.comm.bcast(ptr, int(buf.nbytes), self._nccl.NCCL_UINT8,
                                                   root, stream)).wait()

    def start_tree_sum(self, tree: Any, covers: list[list[tuple[int, int]]], flat: Any, a: int,
                       b: int, partials: Sequence[Any]) -> Pending:
        """The shard tree's sum over ``flat[a:b]`` on the device, started: this rank's partial
        sums (the tree's nodes covering its block, ``partials``, the last one ``flat``
        itself) allgathered from every rank (NCCL), then the tree's additions over them, in
        its order, into ``flat[a:b]``; all on the communicator's stream. Each rank receives
        every partial sum of the range: (N - 1) x its nodes' count x (b - a) f32, against a
        ring allreduce's 2 (N - 1) / N x (b - a)."""
        cupy, nccl = self._cupy, self._nccl
        n, most = b - a, max(len(c) for c in covers)
        key = (n, most)
        with cupy.cuda.Device(self.device_id):
            gathered = self._gathered.get(key)
            if gathered is None:  # every rank's partial sums, each padded to ``most`` nodes
                gathered = self._gathered[key] = cupy.zeros((self.size, most, n), np.float32)
        mine = gathered[self.rank]
        ptr = self._ptr(gathered, "start_tree_sum")

        def enqueue(stream: int) -> None:
            for i, p in enumerate(partials):
                mine[i] = p[a:b]
            self.comm.allGather(ptr + self.rank * most * n * 4, ptr, most * n,
                                nccl.NCCL_FLOAT32, stream)
            known = {node: gathered[r, i] for r in range(self.size)
                     for i, node in enumerate(covers[r])}
            tree.evaluate(known, out=flat[a:b])

        return self._start(f"the shard tree's sum of {n} f32", enqueue)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.mpi.bcast(obj, root)

    def allgather(self, obj: Any) -> list[Any]:
        return self.mpi.allgather(obj)

    def alltoall_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Over MPI, between host buffers (the shard tree's exchange)."""
        self.mpi.alltoall_buffer(send, recv)

    def allgather_buffer(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.mpi.allgather_buffer(send, recv)

    def start_alltoall(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        return self.mpi.start_alltoall(send, recv)

    def start_allgather(self, send: np.ndarray, recv: np.ndarray) -> Pending:
        return self.mpi.start_allgather(send, recv)

    def allgather_inplace(self, buf: Any) -> None:
        _check_f32(buf, "allgather_inplace")
        _check_blocks(buf, self.size)
        k = int(buf.size) // self.size
        ptr = self._ptr(buf, "allgather_inplace")
        # NCCL's in-place form: this rank's block is the send buffer
        self._start(f"allgather of {buf.size} f32 in {self.size} blocks",
                    lambda stream: self.comm.allGather(ptr + self.rank * k * 4, ptr, k,
                                                       self._nccl.NCCL_FLOAT32, stream)).wait()

    def allreduce_max(self, value: int) -> int:
        return self.mpi.allreduce_max(value)

    def barrier(self) -> None:
        with self._cupy.cuda.Device(self.device_id):
            self._settle("barrier")
            self._compute_stream().synchronize()
        self.mpi.barrier()

    def abort(self, code: int = 1) -> NoReturn:
        try:
            self.comm.abort()
        finally:
            self.mpi.abort(code)

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self.rank}, size={self.size}, device={self.device_id})"


class _EventDone:
    """A CUDA event as something with MPI's ``Test``: whether the GPU has reached it."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        return bool(self.event.done)


class _DeviceWait(Pending):
    """A device collective started on a communicator's stream: ``wait`` makes the compute
    stream wait for it on the GPU (the host goes on); ``test`` says whether the GPU is done."""

    def __init__(self, done: Any, compute: Any, device_id: int, cupy: Any) -> None:
        super().__init__()
        self._done, self._compute, self._device_id, self._cupy = done, compute, device_id, cupy

    def test(self) -> bool:
        return self._done is None or bool(self._done.done)

    def wait(self) -> None:
        if self._done is not None:
            with self._cupy.cuda.Device(self._device_id):
                self._compute.wait_event(self._done)
            self._done = None


_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID",
            "HYDI_CONTROL_FD")


def launched_by_mpi() -> bool:
    """Whether this process was started by an MPI launcher (``mpiexec``), or has MPI running."""
    return any(v in os.environ for v in _MPI_ENV) or "mpi4py.MPI" in sys.modules


def world(kind: str = "auto") -> Communicator:
    """The communicator of this job: ``"single"``, ``"mpi"``, ``"nccl"``, or ``"auto"`` (MPI
    when started by ``mpiexec``, else a world of one)."""
    if kind == "single":
        return SingleProcess()
    if kind == "mpi":
        return MpiCommunicator()
    if kind == "nccl":
        return NcclCommunicator()
    if kind == "auto":
        return MpiCommunicator() if launched_by_mpi() else SingleProcess()
    raise ValueError(f"world: kind must be 'auto', 'single', 'mpi' or 'nccl', got {kind!r}")


# --- sharding and agreement ---------------------------------------------------------------------


