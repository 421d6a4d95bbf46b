"""Ranks that write their blocks of shared memory and read each other's between
``MpiCommunicator.shared_sync`` calls (tests/test_parallel.py). Run under ``mpiexec -n N
python -m mpi4py``::

    python -m mpi4py tests/shared_memory_worker.py --rounds 2000

Round ``k``: every rank fills its block with ``k`` and its rank, meets the others, checks
every other block holds round ``k``'s values, and meets them again before the next round
overwrites its own. A barrier that let a rank through before the others had written (or
before they had read) shows as a block holding another round's values. Rank 0 prints
``rounds ok``, or the process exits 1 naming the round and the block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ocannl.parallel import MpiCommunicator  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--cells", type=int, default=4096)
    args = ap.parse_args(argv)
    comm = MpiCommunicator()
    blocks = comm.shared_blocks(args.cells)
    if blocks is None:
        print("the ranks are not on one node", flush=True)
        return 1
    for bad in (0, 1.5, True):  # refused before anything is mapped, naming the value
        try:
            comm.shared_counters(bad)  # type: ignore[arg-type]
        except ValueError as err:
            assert f"got {bad!r}" in str(err), err
        else:
            print(f"rank {comm.rank}: shared_counters({bad!r}) was not refused", flush=True)
            return 1
    for k in range(1, args.rounds + 1):
        blocks[comm.rank][...] = k * 16 + comm.rank
        comm.shared_sync(f"round {k} (written)")
        for q, b in enumerate(blocks):
            want = np.float32(k * 16 + q)
            if not (b == want).all():
                print(f"rank {comm.rank}: round {k}: rank {q}'s block holds "
                      f"{b[b != want][0]}, not {want}", flush=True)
                return 1
        comm.shared_sync(f"round {k} (read)")
    if comm.rank == 0:
        print(f"{args.rounds} rounds ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
