"""pytest plugin: a real `redis-server` on 127.0.0.1, started once per test session, stopped by pid.

Loaded by tests/conftest.py, so every test directory can ask for `redis_url`.
If `redis-server` is not installed the tests that need it FAIL, by design:
`make test` installs it (scripts/install-redis).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
                pytest.fail(f"redis-server on port {port} did not become ready in {START_TIMEOUT_S} s")
            time.sleep(0.05)
    finally:
        client.close()


def _stop(pidfile: Path) -> None:
    pid = int(pidfile.read_text().strip())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a private, empty-at-start redis-server with persistence off."""
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.fail("redis-server is not installed; run `make test` (it installs it) or apt-get install redis-server")
    workdir = tmp_path_factory.mktemp("redis")
    pidfile = workdir / "redis.pid"
    port = _free_port()
    subprocess.run(
        [
            executable, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "yes",
            "--pidfile", str(pidfile), "--save", "", "--appendonly", "no", "--dir", str(workdir),
        ],
        check=True,
        timeout=START_TIMEOUT_S,
    )
    try:
        _wait_until_ready(port, pidfile)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if pidfile.exists():
            _stop(pidfile)
