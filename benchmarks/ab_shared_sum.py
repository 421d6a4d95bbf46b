"""The whole gradient buffer's sum on ranks of one node: MPI's exchange (``Iallreduce``, as
``DataParallel`` runs it without shared memory) against the sum in memory every rank maps
(``MpiCommunicator.shared_blocks``: a barrier, each rank's slice summed over every rank's
buffer and written into all, a barrier), the two alternating by round.

    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py benchmarks/ab_shared_sum.py \\
        [--sizes 12288 1300000] [--rounds 5]

Sizes in f32 elements (convnet's gradients are about 12,000, mlp_wide's 1.3 million). Rank 0
prints each side's best round, per call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ocannl.parallel import MpiCommunicator, ShardTree  # noqa: E402
from ocannl.parallel.data_parallel import SharedSum  # noqa: E402


def time_size(comm: MpiCommunicator, tree: ShardTree, n: int, rounds: int
              ) -> tuple[dict[str, float], bool]:
    """Each side's best round, seconds per call, for ``n`` f32, and whether both sums gave
    the same bits."""
    covers = [tree.cover(r, r + 1) for r in range(comm.size)]
    blocks = comm.shared_blocks(n)
    if blocks is None:
        raise SystemExit("the ranks are not on one node: no memory to share")
    mine = np.random.default_rng(comm.rank).normal(size=n).astype(np.float32)
    plain = mine.copy()
    calls = max(10, int(3e6 // n))

    shared = SharedSum(comm, tree, covers, blocks)

    def mpi() -> None:
        comm.allreduce_sum(plain)

    best = {"mpi": float("inf"), "shared": float("inf")}
    with np.errstate(all="ignore"):  # the sums grow call by call: let them overflow
        for r in range(rounds):
            for name in (("mpi", "shared") if r % 2 == 0 else ("shared", "mpi")):
                run = mpi if name == "mpi" else shared
                blocks[comm.rank][...] = mine
                plain[...] = mine
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    run()
                best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    blocks[comm.rank][...] = mine
    plain[...] = mine
    comm.barrier()
    shared()
    mpi()
    return best, bool(np.array_equal(blocks[comm.rank], plain))


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[12_288, 1_300_000])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    comm = MpiCommunicator()
    tree = ShardTree(comm.size)
    out: dict[int, dict[str, float]] = {}
    for n in args.sizes:
        best, same = time_size(comm, tree, n, args.rounds)
        out[n] = best
        if comm.rank == 0:
            # on 2 ranks both sums are one addition a cell: the same bits
            print(f"{n} f32 on {comm.size} ranks: MPI Iallreduce {best['mpi'] * 1e6:.1f} us, "
                  f"shared memory {best['shared'] * 1e6:.1f} us"
                  + (f" (same bits: {same})" if comm.size == 2 else ""), flush=True)
    return out


if __name__ == "__main__":
    main()
