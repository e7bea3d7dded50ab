"""MLC latency per tier and conditional-append latency (bounded: a few seconds).

    .venv/bin/python benchmarks/mlc_bench.py [--iterations N]

Tiers measured: `memory` (a get served from this process's memory cache, validated against the
shared disk store), `disk` (memory cache off, disk store), `redis` (memory cache off, a private
redis-server started on a free port and stopped at the end). The commit-log rows measure
`append(record, if_match)` with a verifier-sized commit record (fsync per append on disk).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sdcp.cache import MLC, build_uri

SIZES = {"1 KB": 1024, "196 KB": 196 * 1024, "1.6 MB": 1600 * 1024}


@contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pidfile = workdir / "redis.pid"
    subprocess.run(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "yes", "--pidfile", str(pidfile),
         "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        check=True, timeout=10,
    )
    deadline = time.monotonic() + 10
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        os.kill(int(pidfile.read_text()), signal.SIGTERM)


async def timed(operation: Callable[[], Awaitable[object]], iterations: int) -> list[float]:
    await operation()  # warm-up
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        await operation()
        samples.append((time.perf_counter() - started) * 1e3)
    return samples


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def object_rows(tier: str, mlc: MLC, iterations: int) -> list[tuple[str, str, str, float, float]]:
    rows = []
    for label, size in SIZES.items():
        uri = build_uri("bench", None, "q_rows", f"{tier}-{size}")
        data = os.urandom(size)
        puts = await timed(lambda: mlc.put(uri, data), iterations)
        gets = await timed(lambda: mlc.get(uri), iterations)
        rows.append((tier, "put", label, statistics.median(puts), p99(puts)))
        rows.append((tier, "get", label, statistics.median(gets), p99(gets)))
    return rows


async def append_row(tier: str, mlc: MLC, iterations: int) -> tuple[str, str, str, float, float]:
    log = mlc.commit_log(build_uri("bench", None, "log", f"{tier}-log"))
    etag = (await log.read()).etag
    samples = []
    for round_ in range(1, iterations + 1):
        record = {"epoch": 1, "round": round_, "emitted": [1, 2, 3, 4], "committed": 4 * round_, "digest": bytes(32)}
        started = time.perf_counter()
        etag = await log.append(record, if_match=etag)
        samples.append((time.perf_counter() - started) * 1e3)
    return (tier, "append", "commit", statistics.median(samples), p99(samples))


async def main(iterations: int) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        async with MLC.from_config(disk_dir=root / "mem", memory_bytes=64 << 20) as mlc:
            rows += await object_rows("memory", mlc, iterations)
        async with MLC.from_config(disk_dir=root / "disk", memory_bytes=0) as mlc:
            rows += await object_rows("disk", mlc, iterations)
            rows.append(await append_row("disk", mlc, iterations))
        if shutil.which("redis-server") is None:
            Console().print("[yellow]redis-server not installed: redis rows skipped[/]")
        else:
            with redis_server(root) as url:
                async with MLC.from_config(redis_url=url, memory_bytes=0) as mlc:
                    rows += await object_rows("redis", mlc, iterations)
                    rows.append(await append_row("redis", mlc, iterations))
    table = Table(title=f"MLC latency, {iterations} iterations each (ms)")
    for column in ("tier", "operation", "size", "median ms", "p99 ms"):
        table.add_column(column, justify="right" if "ms" in column else "left")
    for tier, operation, size, median, tail in rows:
        table.add_row(tier, operation, size, f"{median:.3f}", f"{tail:.3f}")
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    asyncio.run(main(parser.parse_args().iterations))
