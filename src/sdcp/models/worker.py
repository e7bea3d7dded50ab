"""The drafter's model thread: one thread runs every call into a drafter backend, in order.

(The verifier's model thread is ``sdcp.models.batching.BatchingScorer``, which also batches scoring
requests across sessions.) Both size their OpenMP team with ``sdcp.threads.CoreGovernor``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from sdcp.threads import CoreGovernor

__all__ = ["ModelWorker"]

_T = TypeVar("_T")


class ModelWorker:
    """One thread that runs every call into a model, in submission order, off the event loop
    (or, for a drafter that holds no model, the caller's thread at once).

    It also measures what the status report needs: calls waiting to start (queue) and the share
    of the recent past the thread spent busy (load).
    """

    def __init__(
        self, name: str, window_s: float = 10.0, *, inline: bool = False, cores: CoreGovernor | None = None
    ) -> None:
        # Inline: calls run at once on the caller's thread (for drafters that hold no model).
        self._inline = inline
        # Sizes the worker thread's OpenMP team to the free cores before each call.
        self._cores = None if inline else cores
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._window_s = window_s
        self._lock = threading.Lock()
        self._waiting = 0
        self._running_since: float | None = None
        self._busy: deque[tuple[float, float]] = deque()
        self._created = time.monotonic()

    def submit(self, function: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """Queue a call now (so that calls keep the order of submission) and return its future."""
        with self._lock:
            self._waiting += 1
        if self._inline:
            done: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
            try:
                done.set_result(self._timed(function, *args))
            except Exception as exc:  # noqa: BLE001 - the caller learns it when awaiting
                done.set_exception(exc)
            return done
        future = self._executor.submit(self._timed, function, *args)
        # A call cancelled before it started never reaches _timed, which would count it down.
        future.add_done_callback(self._count_cancelled)
        return asyncio.wrap_future(future)

    async def run(self, function: Callable[..., _T], *args: object) -> _T:
        return await self.submit(function, *args)

    def _count_cancelled(self, future: Future[object]) -> None:
        if future.cancelled():
            with self._lock:
                self._waiting -= 1

    def _timed(self, function: Callable[..., _T], *args: object) -> _T:
        if self._cores is not None:
            self._cores.apply()
        started = time.monotonic()
        with self._lock:
            self._waiting -= 1
            self._running_since = started
        try:
            return function(*args)
        finally:
            with self._lock:
                self._running_since = None
                self._busy.append((started, time.monotonic()))

    @property
    def queue(self) -> int:
        with self._lock:
            return self._waiting

    def busy_fraction(self) -> float:
        now = time.monotonic()
        start = max(now - self._window_s, self._created)
        with self._lock:
            while self._busy and self._busy[0][1] <= start:
                self._busy.popleft()
            busy = sum(end - max(begin, start) for begin, end in self._busy)
            if self._running_since is not None:
                busy += now - max(self._running_since, start)
        span = now - start
        return min(1.0, busy / span) if span > 0 else 0.0

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
