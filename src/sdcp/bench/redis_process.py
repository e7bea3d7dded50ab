"""A private `redis-server` process on a free loopback port, stopped by its pid.

For tests and benchmarks of the Redis tier: persistence off, so it starts empty and leaves nothing.
Optionally with an ACL file (`sdcp.cache.redis_acl.acl_file_text`: one user per role, the default
user off) and TLS only (a `rediss://` URL; clients must present a certificate from `ca`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from sdcp.localhost import free_port

__all__ = ["RedisServerError", "RedisTLS", "local_redis_server", "redis_server_available"]

START_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """redis-server is missing or did not start."""


@dataclass(frozen=True)
class RedisTLS:
    """The server's certificate and key, and the CA its clients' certificates must come from."""

    cert: Path
    key: Path
    ca: Path


def redis_server_available() -> bool:
    return shutil.which("redis-server") is not None


@contextmanager
def local_redis_server(
    workdir: Path,
    *,
    aclfile: Path | None = None,
    admin: tuple[str, str] | None = None,
    tls: RedisTLS | None = None,
    client_tls: tuple[Path, Path] | None = None,
) -> Iterator[str]:
    """Start redis-server in ``workdir``; yield its URL; stop it by pid on exit. With ``aclfile``,
    ``admin`` is a user and password of it that may PING (to see it is ready); with ``tls`` it
    listens with TLS only and ``client_tls`` is a client certificate and key for that check."""
    executable = shutil.which("redis-server")
    if executable is None:
        raise RedisServerError("redis-server is not installed (apt-get install redis-server; `make test` does it)")
    workdir.mkdir(parents=True, exist_ok=True)
    pidfile = workdir / "redis.pid"
    port = free_port()
    listen = ["--port", str(port)]
    if tls is not None:
        listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls.cert)]
        listen += ["--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "yes"]
    if aclfile is not None:
        listen += ["--aclfile", str(aclfile)]
    subprocess.run(
        [
            executable,
            *listen,
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
    scheme = "redis" if tls is None else "rediss"
    options: dict[str, Any] = {}
    if admin is not None:
        options.update(username=admin[0], password=admin[1])
    if tls is not None:
        options.update(ssl=True, ssl_ca_certs=str(tls.ca))
        if client_tls is not None:
            options.update(ssl_certfile=str(client_tls[0]), ssl_keyfile=str(client_tls[1]))
    try:
        _wait_until_ready(port, pidfile, options)
        yield f"{scheme}://127.0.0.1:{port}/0"
    finally:
        if pidfile.exists():
            _stop(int(pidfile.read_text().strip()))


def _wait_until_ready(port: int, pidfile: Path, options: dict[str, Any]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0, **options)
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
