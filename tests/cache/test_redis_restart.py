"""A Redis restart keeps every acknowledged write of every role (docs/reliability.md, #29).

A real redis-server as shipped (deploy/kubernetes/redis.yaml, docs/deploy.md): append-only file
with fsync on every write, the ACL file of `sdcp redis-acl` (a user per role, the default user off).
Each role writes through the store's scripts as its own user, Redis is killed -9 right after the
last answer and started again on the same directory: every commit record, fence, object and lease
it acknowledged is there, and the roles' users are held to the same rules as before.

Redis replays the file's transactions (every store script that writes more than one command) as
the default user, whose rights the ACL file must therefore give (`redis_acl.DEFAULT_USER`): with
none, the server logged NOPERM for each and came back without them. With `appendfsync always`
Redis writes and fsyncs each write before it answers, so an acknowledged write is on disk: a kill
-9 would keep it even with `everysec` (the page cache survives the process), a host's crash not.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from sdcp.bench.redis_process import redis_server_available
from sdcp.cache import MLC, AccessDenied, build_uri, target_kv_uri
from sdcp.cache.commitlog import EMPTY_LOG_ETAG
from sdcp.cache.redis_acl import ADMIN, ROLE_USERS, RedisAccess, acl_file_text, ensure_passwords
from sdcp.cache.uri import HISTORY_KIND, LOG_KIND, Q_ROWS_KIND, ROUTER_SESSION_KIND, TOKENS_KIND
from sdcp.localhost import free_port

PREFIX = "sdcp:mlc:"
READY_TIMEOUT_S = 10.0
SCOPE = bytes(range(16))
SESSION = bytes(range(8))
LOG = build_uri("local", SCOPE, LOG_KIND, SESSION.hex())
Q_ROWS = build_uri("local", SCOPE, Q_ROWS_KIND, f"{SESSION.hex()}-e1-r1")
TOKENS = build_uri("local", SCOPE, TOKENS_KIND, f"{SESSION.hex()}-3")
HISTORY = build_uri("local", SCOPE, HISTORY_KIND, "ab" * 16)
ROUTER_SESSION = build_uri("local", None, ROUTER_SESSION_KIND, SESSION.hex())
TARGET_KV_1 = str(target_kv_uri(LOG, SESSION, 1))
TARGET_KV_2 = str(target_kv_uri(LOG, SESSION, 2))


class PersistentRedis:
    """redis-server in the foreground (a child of the test, killed by its pid), started as shipped
    and restartable on the same directory and port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.passwords = ensure_passwords(workdir / "secrets", ("router", "verifier", "drafter", ADMIN))
        aclfile = workdir / "users.acl"
        aclfile.write_text(acl_file_text(self.passwords, PREFIX), encoding="utf-8")
        self.port = free_port()
        self.log = workdir / "redis.log"
        self.command = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        self.command += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir)]
        self.command += ["--aclfile", str(aclfile), "--logfile", str(self.log)]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def access(self, role: str) -> RedisAccess:
        return RedisAccess(role=role, username=ROLE_USERS[role], password=self.passwords[role])

    def mlc(self, role: str) -> MLC:
        return MLC.from_config(redis_url=self.url, redis_prefix=PREFIX, redis_access=self.access(role), memory_bytes=0)

    def start(self) -> None:
        """Start it and wait until it answers the admin's PING (after loading its files)."""
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        admin = redis.Redis(
            port=self.port, username=ROLE_USERS[ADMIN], password=self.passwords[ADMIN], socket_timeout=1.0
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while True:
                assert self.process.poll() is None, f"redis-server exited: {self.log.read_text()}"
                try:
                    if admin.ping():  # refused with LOADING (a ConnectionError) until loaded
                        return
                except redis.ConnectionError:
                    pass
                assert time.monotonic() < deadline, f"redis-server not ready in {READY_TIMEOUT_S} s"
                time.sleep(0.02)
        finally:
            admin.close()

    def kill(self) -> None:
        """kill -9, and wait until it is gone."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=READY_TIMEOUT_S)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PersistentRedis]:
    if not redis_server_available():
        pytest.fail("redis-server is not installed; run `make test` (it installs it) or apt-get install redis-server")
    found = PersistentRedis(tmp_path)
    found.start()
    try:
        yield found
    finally:
        found.kill()


async def test_a_restart_after_kill_9_keeps_every_acknowledged_write_of_every_role(server: PersistentRedis) -> None:
    records: list[dict[str, Any]] = [{"epoch": 1, "round": n, "writer": "verifier-a"} for n in range(1, 21)]
    records.append({"epoch": 2, "verifier": "https://verifier-b"})
    records += [{"epoch": 2, "round": n, "writer": "verifier-b"} for n in range(21, 26)]
    async with server.mlc("router") as router, server.mlc("verifier") as verifier, server.mlc("drafter") as drafter:
        await drafter.put(Q_ROWS, b"rows")
        await drafter.lease(Q_ROWS, "drafter-1", 600.0)
        await router.put(TOKENS, b"tokens")
        await router.put(ROUTER_SESSION, b"session facts")
        await verifier.put(HISTORY, b"history")
        await verifier.put(TARGET_KV_1, b"kv epoch 1")
        etag = EMPTY_LOG_ETAG
        for record in records:
            if "round" in record:
                etag = await verifier.commit_log(LOG).append(record, etag)
            else:
                etag = await router.commit_log(LOG).fence(record["epoch"], record["verifier"])
        await verifier.put(TARGET_KV_2, b"kv epoch 2")
        assert await router.delete(TARGET_KV_1)  # the failover's clean-up, acknowledged
        before = await router.commit_log(LOG).read()
        assert before.records == records and before.etag == etag

    server.kill()
    server.start()

    assert "NOPERM" not in server.log.read_text()
    async with server.mlc("router") as router, server.mlc("verifier") as verifier, server.mlc("drafter") as drafter:
        for mlc in (router, verifier):
            after = await mlc.commit_log(LOG).read()
            assert after.records == records and after.etag == etag
        assert await verifier.get(Q_ROWS) == b"rows"
        assert await drafter.lease_holders(Q_ROWS) == {"drafter-1"}
        assert await drafter.get(TOKENS) == b"tokens"
        assert await router.get(ROUTER_SESSION) == b"session facts"
        assert await drafter.get(HISTORY) == b"history"
        assert await router.get(TARGET_KV_2) == b"kv epoch 2"
        assert not await router.exists(TARGET_KV_1)

        # The log goes on from the ETag acknowledged before the restart; the rules hold as before.
        nxt = {"epoch": 2, "round": 26, "writer": "verifier-b"}
        etag = await verifier.commit_log(LOG).append(nxt, etag)
        assert (await router.commit_log(LOG).read()).records == [*records, nxt]
        for refused in (
            lambda: drafter.commit_log(LOG).append({"epoch": 2, "round": 27, "writer": "d"}, etag),
            lambda: verifier.commit_log(LOG).fence(3, "https://verifier-a"),
            lambda: router.commit_log(LOG).append({"epoch": 2, "round": 27, "writer": "r"}, etag),
            lambda: drafter.put(HISTORY, b"forged"),
        ):
            with pytest.raises(AccessDenied):
                await refused()

    # The default user, whose rights the replay used, is no one's: off, and without any password.
    stream, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        for command, refusal in (
            (b"PING", b"-NOAUTH"),
            (b"AUTH default nopass", b"-WRONGPASS"),
            (b"AUTH default " + server.passwords[ADMIN].encode(), b"-WRONGPASS"),
            (b"HELLO 3 AUTH default x", b"-WRONGPASS"),
        ):
            writer.write(command + b"\r\n")
            assert (await asyncio.wait_for(stream.readline(), READY_TIMEOUT_S)).startswith(refusal)
    finally:
        writer.close()
        await writer.wait_closed()
