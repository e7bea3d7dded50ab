"""Concurrent conditional appenders on one commit log: every log version has exactly one winner."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sdcp.cache import CommitLog, PreconditionFailed


async def race_appenders(logs: list[CommitLog], record: Callable[[int], dict[str, object]]) -> None:
    """Writer i appends ``record(i)`` to ``logs[i]`` (handles on one log) until it wins a version."""
    start = asyncio.Event()
    winners_by_etag: dict[str, list[int]] = {}

    async def appender(writer: int) -> int:
        await start.wait()
        failures = 0
        while True:
            snapshot = await logs[writer].read()
            try:
                etag = await logs[writer].append(record(writer), if_match=snapshot.etag)
            except PreconditionFailed:
                failures += 1
                continue
            winners_by_etag.setdefault(etag, []).append(writer)
            return failures

    tasks = [asyncio.create_task(appender(i)) for i in range(len(logs))]
    start.set()
    failures = await asyncio.gather(*tasks)
    assert sum(failures) > 0  # they really raced
    assert all(len(writers) == 1 for writers in winners_by_etag.values())
    final = await logs[0].read()
    assert sorted(record["round"] for record in final.records) == list(range(len(logs)))
    assert len(winners_by_etag) == len(logs) and final.etag in winners_by_etag
