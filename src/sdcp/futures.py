"""Completing asyncio futures from worker threads, many in one event-loop callback.

The scorer thread (sdcp.models.batching) and the commit-log appends (sdcp.cache.commitlog) finish
work for many waiters of one loop at once; handing the loop all their outcomes in one callback lets
the waiters resume together, for one wake-up of the loop instead of one each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

Outcome = tuple["asyncio.Future[Any]", object]


def settle(outcomes: Iterable[Outcome]) -> None:
    """On the futures' loop: each future gets its outcome, an exception instance raising; a
    future that is already done (cancelled by its waiter) is left as it is."""
    for future, outcome in outcomes:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def settle_soon(loop: asyncio.AbstractEventLoop, outcomes: list[Outcome]) -> None:
    """From any thread: `settle` the outcomes on ``loop`` in one callback."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits these any more
        loop.call_soon_threadsafe(settle, outcomes)
