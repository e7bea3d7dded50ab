"""Background tasks that live as long as their owner (an engine, a node)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundTasks", "cancelled_if", "shielded_unless_gone"]

_T = TypeVar("_T")


async def shielded_unless_gone(work: Callable[[asyncio.Event], Coroutine[Any, Any, _T]]) -> _T:
    """Run ``work`` to its end even if the caller is cancelled, as ``asyncio.shield`` does, and set
    the event ``work`` is given when the caller goes: the work may stop at its next step (a prefill
    nobody waits for). Its outcome is then retrieved and dropped."""
    gone = asyncio.Event()
    task = asyncio.ensure_future(work(gone))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        gone.set()
        task.add_done_callback(_dropped)
        raise


async def cancelled_if(work: Coroutine[Any, Any, _T], leaving: Coroutine[Any, Any, object]) -> tuple[_T] | None:
    """``work``'s result (in a 1-tuple; its error raised), or None where ``leaving`` ends first:
    ``work`` is then cancelled, and awaited, so that a request it made is reset before this returns."""
    done = asyncio.ensure_future(work)
    left = asyncio.ensure_future(leaving)
    try:
        await asyncio.wait({done, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if done.done():
        return (done.result(),)
    done.cancel()
    await asyncio.gather(done, return_exceptions=True)
    return None


def _dropped(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class BackgroundTasks:
    """Tasks started with ``spawn`` run until they end or ``cancel_all``; failures are logged."""

    def __init__(self, owner: str, log: logging.Logger) -> None:
        self._owner = owner
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    async def cancel_all(self) -> None:
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.error("%s: background task failed", self._owner, exc_info=task.exception())
