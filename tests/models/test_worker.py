"""The model thread: calls in submission order on one thread, busy share, queue, refusal once closed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from tests.waiting import HANG_GUARD_S, eventually

from sdcp.models.worker import InlineModelThread, ModelThread, ModelThreadClosed


async def test_calls_run_in_order_on_one_thread_and_are_measured() -> None:
    gate = threading.Event()
    seen: list[tuple[int, str]] = []

    def record(index: int) -> int:
        gate.wait(HANG_GUARD_S)
        seen.append((index, threading.current_thread().name))
        return index

    with ModelThread("model-test") as thread:
        futures = [thread.schedule(record, index) for index in range(5)]
        await eventually(lambda: thread.queue == 4)  # one is running, blocked on the gate
        gate.set()
        assert await asyncio.gather(*futures) == list(range(5))
        assert thread.queue == 0 and thread.busy_fraction() > 0
    assert [index for index, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"model-test"}


async def test_a_failing_call_fails_its_caller_only() -> None:
    with ModelThread("model-test") as thread:

        def fail() -> None:
            raise ValueError("no")

        with pytest.raises(ValueError, match="no"):
            await thread.run_async(fail)
        assert await thread.run_async(lambda: 7) == 7


def test_closing_runs_the_queued_work_and_refuses_later_work() -> None:
    thread = ModelThread("model-test")
    started = threading.Event()
    running = thread.run(lambda: started.set() or time.sleep(0.1))
    started.wait(5)
    queued = thread.run(lambda: 1)
    thread.close()
    assert running.result(5) is None and queued.result(5) == 1
    with pytest.raises(ModelThreadClosed):
        thread.run(lambda: 1)


async def test_the_inline_thread_runs_at_once() -> None:
    inline = InlineModelThread()
    future = inline.schedule(lambda: threading.current_thread().name)
    assert future.done() and await future == threading.current_thread().name
    assert inline.queue == 0
