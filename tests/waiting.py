"""Waiting on a condition, not on the clock.

A test that needs something to have happened polls for it. The bound only keeps a broken run
from hanging: it is far above what any machine needs, so that a slow (or loaded) machine passes
where a fast one does, and the test asserts on what happened, not on when.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

# Far above any healthy wait, below pytest's per-test timeout (pyproject.toml).
HANG_GUARD_S = 120.0
_POLL_S = 0.02


async def eventually(condition: Callable[[], bool], timeout_s: float = HANG_GUARD_S) -> None:
    """Wait until ``condition()`` holds."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(_POLL_S)


async def eventually_async(condition: Callable[[], Awaitable[bool]], timeout_s: float = HANG_GUARD_S) -> None:
    """Wait until ``await condition()`` holds."""
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(_POLL_S)


def wait_until(condition: Callable[[], bool], timeout_s: float = HANG_GUARD_S, what: str = "") -> None:
    """Wait until ``condition()`` holds, from synchronous code (a test driving subprocesses)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout_s:.0f} s: {what}"
        time.sleep(_POLL_S * 5)
