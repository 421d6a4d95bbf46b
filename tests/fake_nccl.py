"""A stand-in for ``cupy.cuda.nccl`` that reduces over MPI, on top of the stand-in ``cupy``
(tests/backends/fake_cupy.py: NumPy arrays as device memory), so that
:class:`ocannl.parallel.NcclCommunicator` runs its real bootstrap and call sequence on a
machine without a GPU, under ``mpiexec``.

Strict where NCCL would misbehave silently: the communicator is created with the id rank 0
drew and every rank's distinct rank, on the rank's current device; every collective names a
non-blocking stream of the current device, current while it is called, which has waited
(``Stream.wait_event``) for every kernel and graph submitted to any other stream before it
(the gradients it sums were written); data types and operations are NCCL's enum values. Every
call is logged in :data:`calls`, and every event's record and wait too (with the event's id).
"""

from __future__ import annotations

import ctypes
import secrets
import sys
import types
from typing import Any

import numpy as np

calls: list[list[Any]] = []
#: Set to make every event stay pending, as after a collective the other ranks never joined.
stuck = False

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
_DTYPES = {NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_FLOAT16: np.float16,
           NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
STREAM_BASE = 0x5EED00


def _stream_ptr(device: int) -> int:
    return STREAM_BASE + device


def _host(ptr: int, count: int, dtype: Any) -> np.ndarray:
    dt = np.dtype(dtype)
    raw = (ctypes.c_uint8 * (count * dt.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dt)


def get_unique_id() -> bytes:
    calls.append(["get_unique_id"])
    return secrets.token_bytes(128)


class NcclCommunicator:
    def __init__(self, ndev: int, commId: bytes, rank: int) -> None:  # noqa: N803 - CuPy's
        from fake_cupy import current_device
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        assert isinstance(commId, bytes) and len(commId) == 128, commId
        seen = world.allgather((commId, rank, ndev))
        assert all(s[0] == commId for s in seen), "the ranks joined with different unique ids"
        assert sorted(s[1] for s in seen) == list(range(ndev)) == list(range(world.size))
        self._world, self._rank, self._device = world, rank, current_device()
        calls.append(["init", ndev, rank, self._device])

    def _check(self, what: str, stream: int) -> None:
        import fake_cupy

        assert fake_cupy.current_device() == self._device, (
            f"{what}: current device {fake_cupy.current_device()}, the communicator's "
            f"{self._device}")
        own = fake_cupy.current_stream()
        assert own is not None and own.ptr == stream and own.non_blocking, (
            f"{what}: stream {stream:#x} is not a non-blocking stream made current")
        behind = {ptr: n for ptr, n in fake_cupy.submitted.items()
                  if ptr != stream and own.waited.get(ptr, 0) < n}
        assert not behind, (f"{what} on stream {stream:#x} has not waited for the work before "
                            f"it on other streams (submissions not covered, by stream: {behind})")

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802
                  stream: int) -> None:
        from mpi4py import MPI

        self._check("allReduce", stream)
        assert op == NCCL_SUM and datatype in _DTYPES
        send = _host(sendbuf, count, _DTYPES[datatype])
        recv = _host(recvbuf, count, _DTYPES[datatype])
        if sendbuf == recvbuf:
            self._world.Allreduce(MPI.IN_PLACE, recv, op=MPI.SUM)
        else:
            self._world.Allreduce(send, recv, op=MPI.SUM)
        calls.append(["allReduce", count, datatype, op, stream, sendbuf == recvbuf])

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        from mpi4py import MPI

        self._check("allGather", stream)
        assert datatype in _DTYPES
        dt = np.dtype(_DTYPES[datatype])
        recv = _host(recvbuf, count * self._world.size, dt)
        in_place = sendbuf == recvbuf + self._rank * count * dt.itemsize
        if in_place:
            self._world.Allgather(MPI.IN_PLACE, recv)
        else:
            self._world.Allgather(_host(sendbuf, count, dt), recv)
        calls.append(["allGather", count, datatype, stream, in_place])

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self._check("bcast", stream)
        self._world.Bcast(_host(buff, count, _DTYPES[datatype]), root=root)
        calls.append(["bcast", count, datatype, root, stream])

    def destroy(self) -> None:
        calls.append(["destroy"])

    def abort(self) -> None:
        calls.append(["abort"])


def install(devices: int = 2) -> types.ModuleType:
    """The stand-in ``cupy`` with ``devices`` devices, a current stream per device, and this
    module as ``cupy.cuda.nccl``; for the rest of the process."""
    import fake_cupy
    import pytest

    cp = fake_cupy.install(pytest.MonkeyPatch(), devices=devices)

    def get_current_stream(device_id: int | None = None) -> Any:
        """The legacy stream (the stand-in's ``None``): recorded, an event covers every
        stream's work; it waits as a stream does."""
        dev = fake_cupy.current_device() if device_id is None else device_id

        def wait_event(event: Event) -> None:
            for hook in fake_cupy.wait_hooks:
                hook(_stream_ptr(dev), event)

        return types.SimpleNamespace(ptr=_stream_ptr(dev), synchronize=lambda: None,
                                     wait_event=wait_event, legacy=True)

    class Event:  # the stand-in runs every call at once: an event is reached when recorded
        ids = iter(range(1, 1 << 30))

        def __init__(self, block: bool = False, disable_timing: bool = False,
                      interprocess: bool = False) -> None:
            self.done = False
            self.id = next(Event.ids)
            self.covers: dict[int | None, int] = {}

        def record(self, stream: Any = None) -> None:
            ptr = getattr(stream, "ptr", stream)
            calls.append(["event.record", ptr, self.id])
            if getattr(stream, "legacy", False):  # it waits for every blocking stream
                self.covers = dict(fake_cupy.submitted)
            else:
                self.covers = {ptr: fake_cupy.submitted.get(ptr, 0)}
            self.done = not stuck

    fake_cupy.wait_hooks[:] = [lambda ptr, event: calls.append(["wait_event", ptr, event.id])]

    cp.cuda.get_current_stream = get_current_stream
    cp.cuda.Event = Event
    cp.cuda.nccl = sys.modules[__name__]
    sys.modules["cupy.cuda"] = cp.cuda  # type: ignore[assignment]
    sys.modules["cupy.cuda.nccl"] = sys.modules[__name__]
    return cp
