"""Code run in child OS processes by test_cross_process.py (imported by name under spawn)."""

from __future__ import annotations

import asyncio
from typing import Any

from sdcp.cache import MLC, PreconditionFailed


def append_records(disk_dir: str, log_uri: str, writer: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    """Append `count` records, retrying lost races; returns (etag, record) of each success."""

    async def run() -> list[tuple[str, dict[str, Any]]]:
        successes = []
        async with MLC.from_config(disk_dir=disk_dir) as mlc:
            log = mlc.commit_log(log_uri)
            for seq in range(count):
                record = {"epoch": 1, "writer": writer, "seq": seq}
                while True:
                    try:
                        etag = await log.append(record, if_match=(await log.read()).etag)
                    except PreconditionFailed:
                        continue
                    successes.append((etag, record))
                    break
        return successes

    return asyncio.run(run())


def put_objects(disk_dir: str, objects: dict[str, bytes]) -> None:
    async def run() -> None:
        async with MLC.from_config(disk_dir=disk_dir) as mlc:
            for uri, data in objects.items():
                await mlc.put(uri, data)

    asyncio.run(run())


def watch_object(disk_dir: str, uri: str, cached: Any, changed: Any, results: Any) -> None:
    """Read `uri` (caching it in this process's memory), wait for `changed`, read it again."""

    async def read(mlc: MLC) -> bytes | None:
        return await mlc.get(uri) if await mlc.exists(uri) else None

    async def run() -> None:
        async with MLC.from_config(disk_dir=disk_dir) as mlc:
            results.put(("before", await read(mlc), await mlc.locate(uri)))
            cached.set()
            await asyncio.to_thread(changed.wait, 30)
            results.put(("after", await read(mlc), await mlc.locate(uri)))

    asyncio.run(run())
