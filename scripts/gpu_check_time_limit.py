"""A pytest plugin of ``scripts/gpu_check.sh``: each test's call under a time limit.

    GPU_CHECK_TEST_LIMIT=40 python -m pytest -p gpu_check_time_limit ...   (scripts/ on the path)

A test running past ``GPU_CHECK_TEST_LIMIT`` seconds (0 or unset: no limit) fails with a
``TimeoutError`` naming it, and the next test runs, so one slow test does not take the whole
part's time and the part's log names it. SIGALRM interrupts Python code only: a test stuck in a
driver call is named by pytest's faulthandler and ended by the part's own limit. The image has
no pytest-timeout; this is the little of it the check needs.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator
from typing import Any

import pytest


def _limit() -> int:
    value = os.environ.get("GPU_CHECK_TEST_LIMIT", "0")
    try:
        limit = int(value)
    except ValueError:
        raise pytest.UsageError(f"GPU_CHECK_TEST_LIMIT must be whole seconds, got {value!r}"
                                ) from None
    if limit < 0:
        raise pytest.UsageError(f"GPU_CHECK_TEST_LIMIT must be >= 0, got {limit}")
    return limit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    limit = _limit()
    if limit == 0:
        yield
        return

    def over(signum: int, frame: object) -> None:
        raise TimeoutError(f"{item.nodeid} ran over its limit of {limit} s")

    old = signal.signal(signal.SIGALRM, over)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
