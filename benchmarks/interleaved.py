"""Two ways of doing one thing, timed in one process, alternating by round: the A/B scripts'
loop (``ab_gather.py``, ``ab_synced_bn.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def interleaved(sides: Sequence[Callable[[], object]], rounds: int, calls: int
                ) -> tuple[list[list[float]], list[float]]:
    """Per round, each side runs once untimed, then ``calls`` times timed one by one; the
    side going first alternates by round. Returns each side's call times and each round's
    ratio of the second side's median call to the first's."""
    times: list[list[float]] = [[] for _ in sides]
    ratios = []
    for r in range(rounds):
        median = {}
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):
            run = sides[side]
            run()
            spent = []
            for _ in range(calls):
                t0 = time.perf_counter()
                run()
                spent.append(time.perf_counter() - t0)
            times[side] += spent
            median[side] = statistics.median(spent)
        ratios.append(median[1] / median[0])
    return times, ratios
