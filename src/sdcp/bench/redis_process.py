"""A private `redis-server` process on a free loopback port, stopped by its pid.

For tests and benchmarks of the Redis tier: persistence off, so it starts empty and leaves nothing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from sdcp.localhost import free_port

__all__ = ["RedisServerError", "local_redis_server", "redis_server_available"]

START_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start."""


def redis_server_available() -> bool:
    return shutil.which("redis-server") is not None


@contextmanager
def local_redis_server(workdir: Path) -> Iterator[str]:
    """Start redis-server in ``workdir``; yield its URL; stop it by pid on exit."""
    executable = shutil.which("redis-server")
    if executable is None:
        raise RedisServerError("redis-server is not installed (apt-get install redis-server; `make test` does it)")
    workdir.mkdir(parents=True, exist_ok=True)
    pidfile = workdir / "redis.pid"
    port = free_port()
    subprocess.run(
        [
            executable,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--daemonize",
            "yes",
            "--pidfile",
            str(pidfile),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        check=True,
        timeout=START_TIMEOUT_S,
    )
    try:
        _wait_until_ready(port, pidfile)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if pidfile.exists():
            _stop(int(pidfile.read_text().strip()))


def _wait_until_ready(port: int, pidfile: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0)
    try:
        while True:
            try:
                if client.ping() and pidfile.exists():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise RedisServerError(f"redis-server on port {port} did not become ready in {START_TIMEOUT_S} s")
            time.sleep(0.05)
    finally:
        client.close()


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
