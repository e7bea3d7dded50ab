"""One thread owns a model: every call into it runs there, in submission order, off the event loop.

On CPU each thread that runs torch operators brings its own OpenMP team, and two teams on the same
cores slow every pass down by a quarter or more (docs/performance.md); one thread per model avoids
that, and ``sdcp.threads.CoreGovernor`` sizes its team to the free cores before each piece of work.
``ModelThread`` is that thread for a drafter backend; ``sdcp.models.batching.BatchingScorer``
extends it for the target model with passes batched across sessions. Both measure what a status
report needs: calls waiting to start (``queue``) and the share of the recent past spent busy.

A thread that dies of an error its work did not catch stays dead: ``failure`` says why, work queued
and submitted after fails with ``ModelThreadClosed`` at once (no caller waits for a thread that is
gone), and ``on_death`` tells the role, which stops being ready (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

from sdcp.models.errors import ModelError
from sdcp.threads import CoreGovernor

__all__ = ["Call", "InlineModelThread", "ModelThread", "ModelThreadClosed"]

_T = TypeVar("_T")
_STOP = object()

log = logging.getLogger("sdcp.models")


class ModelThreadClosed(ModelError):
    """Work was submitted to a model thread that has been closed."""


@dataclass(frozen=True)
class Call:
    """A call into the model, run on the model thread in arrival order."""

    function: Callable[[], object]
    future: Future[object]

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.function())
        except BaseException as exc:  # noqa: BLE001 - the caller learns every failure
            self.future.set_exception(exc)

    def refuse(self) -> None:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(ModelThreadClosed("the model thread was closed"))


class _BusyMeter:
    """Which share of the last ``window_s`` seconds the thread spent working."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._lock = threading.Lock()
        self._running_since: float | None = None
        self._spans: deque[tuple[float, float]] = deque()
        self._created = time.monotonic()

    def started(self) -> None:
        with self._lock:
            self._running_since = time.monotonic()

    def finished(self) -> None:
        with self._lock:
            if self._running_since is not None:
                self._spans.append((self._running_since, time.monotonic()))
            self._running_since = None

    def fraction(self) -> float:
        now = time.monotonic()
        start = max(now - self._window_s, self._created)
        with self._lock:
            while self._spans and self._spans[0][1] <= start:
                self._spans.popleft()
            busy = sum(end - max(begin, start) for begin, end in self._spans)
            if self._running_since is not None:
                busy += now - max(self._running_since, start)
        span = now - start
        return min(1.0, busy / span) if span > 0 else 0.0


class ModelThread:
    """A thread that runs calls into one model in submission order (see the module doc)."""

    def __init__(self, name: str, *, cores: CoreGovernor | None = None, busy_window_s: float = 10.0) -> None:
        self.cores = cores
        self._inbox: queue.Queue[object] = queue.Queue()
        self._closed = threading.Event()
        self._busy = _BusyMeter(busy_window_s)
        self._waiting = 0
        self._waiting_lock = threading.Lock()
        # Why the thread died, and who is told (set before any work can fail it).
        self.failure: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._serve_guarded, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread serves work: False once closed or dead."""
        return self.failure is None and not self._closed.is_set()

    def run(self, function: Callable[..., _T], *args: object) -> Future[_T]:
        """Queue ``function(*args)`` from any thread; its future completes on the model thread."""
        future: Future[_T] = Future()
        self._put(Call(lambda: function(*args), future))  # type: ignore[arg-type]
        return future

    def schedule(self, function: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """Queue a call now, from the running event loop (so that calls keep the order of
        submission); await the returned future there."""
        return asyncio.wrap_future(self.run(function, *args))

    async def run_async(self, function: Callable[..., _T], *args: object) -> _T:
        return await self.schedule(function, *args)

    @property
    def queue(self) -> int:
        """Pieces of work waiting to start."""
        with self._waiting_lock:
            return self._waiting

    def busy_fraction(self) -> float:
        return self._busy.fraction()

    def close(self) -> None:
        """Stop once the work queued so far has run; later work fails with ``ModelThreadClosed``."""
        if not self._closed.is_set():
            self._closed.set()
            self._inbox.put(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def __enter__(self) -> ModelThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- on the model thread -----------------------------------------------------------------------

    def _put(self, item: object) -> None:
        if self.failure is not None:
            raise ModelThreadClosed(f"{self._thread.name} died: {self.failure!r}")
        if self._closed.is_set():
            raise ModelThreadClosed(f"{self._thread.name} is closed")
        with self._waiting_lock:
            self._waiting += 1
        self._inbox.put(item)
        if self.failure is not None:
            self._refuse_pending()  # the thread died while this was put: nobody else will refuse it

    def _take(self, timeout: float | None = None) -> object:
        """The next item (``_STOP`` once closed); raises ``queue.Empty`` after ``timeout`` (0: none waiting)."""
        if timeout is None:
            item = self._inbox.get()
        elif timeout > 0:
            item = self._inbox.get(timeout=timeout)
        else:
            item = self._inbox.get_nowait()
        if item is not _STOP:
            with self._waiting_lock:
                self._waiting -= 1
        return item

    @staticmethod
    def _is_stop(item: object) -> bool:
        return item is _STOP

    def _working(self) -> _Working:
        """Brackets one piece of work: sizes the OpenMP team, counts the time as busy."""
        return _Working(self)

    def _serve_guarded(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever killed the thread, no caller may wait on it
            self.failure = exc
            log.critical("%s died: %r", self._thread.name, exc, exc_info=exc)
            self._closed.set()
            self._refuse_pending()
            if self.on_death is not None:
                self.on_death(exc)

    def _serve(self) -> None:
        while True:
            item = self._take()
            if item is _STOP:
                break
            with self._working():
                self._handle(item)
        self._refuse_pending()

    def _handle(self, item: object) -> None:
        assert isinstance(item, Call)
        item.run()

    def _refuse(self, item: object) -> None:
        assert isinstance(item, Call)
        item.refuse()

    def _refuse_pending(self) -> None:
        while True:
            try:
                item = self._take(0)
            except queue.Empty:
                return
            if item is not _STOP:
                self._refuse(item)


class _Working:
    def __init__(self, thread: ModelThread) -> None:
        self._thread = thread

    def __enter__(self) -> None:
        if self._thread.cores is not None:
            self._thread.cores.apply()
        self._thread._busy.started()

    def __exit__(self, *exc_info: object) -> None:
        self._thread._busy.finished()


class InlineModelThread:
    """The same interface for a backend that holds no model (prompt lookup): each call runs at once
    on the caller's thread, as cheap as a dictionary lookup."""

    failure: BaseException | None = None
    on_death: Callable[[BaseException], None] | None = None
    alive = True

    def __init__(self) -> None:
        self._busy = _BusyMeter(10.0)

    def schedule(self, function: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        done: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._busy.started()
        try:
            done.set_result(function(*args))
        except Exception as exc:  # noqa: BLE001 - the caller learns it when awaiting
            done.set_exception(exc)
        finally:
            self._busy.finished()
        return done

    async def run_async(self, function: Callable[..., _T], *args: object) -> _T:
        return await self.schedule(function, *args)

    @property
    def queue(self) -> int:
        return 0

    def busy_fraction(self) -> float:
        return self._busy.fraction()

    def close(self) -> None:
        """Nothing to stop."""
