"""End to end with Redis as the MLC's shared tier and commit log: `sdcp up --redis URL`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
from tests.e2e.support import MAX_NEW, PROMPTS, cluster_up, sdcp

from sdcp.cluster import LocalCluster
from sdcp.localhost import free_port

pytestmark = pytest.mark.timeout(600)


def test_generate_over_the_redis_tier_equals_greedy(
    empty_home: Path, redis_url: str, reference: dict[str, list[int]]
) -> None:
    # The session's Redis is open (its default user on without password): told so, sdcp up refuses
    # it, then takes it when the user insists.
    refused = sdcp(empty_home, "up", "--redis", redis_url, "--drafter", "ngram", "--gateway-port", "0")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "default user" in refused.stderr and "--lock-default" in refused.stderr
    started = sdcp(
        empty_home, "up", "--redis", redis_url, "--redis-insecure", "--drafter", "ngram", "--gateway-port", "0"
    )
    assert started.returncode == 0, started.stderr
    assert "NOT kept over a Redis restart" in started.stderr
    try:
        result = sdcp(empty_home, "generate", "--json", "--max-new", str(MAX_NEW), PROMPTS[1])
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["tokens"] == reference[PROMPTS[1]]
        assert_each_role_has_its_own_redis_user(empty_home / "cluster", redis_url)
    finally:
        assert sdcp(empty_home, "down").returncode == 0


def test_unreachable_redis_is_one_line(tmp_path: Path) -> None:
    result = sdcp(tmp_path, "up", "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "unreachable" in result.stderr


def assert_each_role_has_its_own_redis_user(cluster: Path, redis_url: str) -> None:
    """The generation above ran with ACLs on: each role's TOML names its own user and a password
    file of mode 0600 (no password in any TOML), and the drafter's user, with which a drafter host
    could reach the store, is refused a write to the session's commit log and to its fence."""
    admin = redis.Redis.from_url(redis_url)
    try:
        users = {}
        for name in ("router", "verifier", "drafter-1"):
            mlc = tomllib.loads((cluster / f"{name}.toml").read_text())["mlc"]
            password_file = cluster / mlc["redis_password_file"]
            assert password_file.stat().st_mode & 0o777 == 0o600
            password = password_file.read_text().strip()
            assert not any(password in toml.read_text() for toml in cluster.glob("*.toml"))
            users[name] = (mlc["redis_username"], password)
        assert len({user for user, _ in users.values()}) == 3
        logs = list(admin.scan_iter(match="sdcp:mlc:log:c:*"))
        assert logs, "the session's commit records are in Redis"
        user, password = users["drafter-1"]
        drafter = redis.Redis.from_url(redis_url, username=user, password=password)
        try:
            log = logs[0].decode()
            fences = log.replace("sdcp:mlc:log:c:", "sdcp:mlc:log:fm:", 1)
            for forge in (lambda: drafter.rpush(log, b"forged"), lambda: drafter.hset(fences, "fence", 99)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    forge()
        finally:
            drafter.close()
    finally:
        admin.close()


class AclRedis:
    """A redis-server as a careful user runs it: users in an ACL file whose default user is off (as
    `sdcp redis-acl --acl-file` writes it), the append-only file fsynced on every write; stopped and
    started again on the same files."""

    def __init__(self, directory: Path, acl_file: Path) -> None:
        self.directory, self.acl_file, self.port = directory, acl_file, free_port()
        self.pidfile = directory / "redis.pid"

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "yes", "--pidfile", str(self.pidfile)]
        args += ["--dir", str(self.directory), "--aclfile", str(self.acl_file), "--save", ""]
        args += ["--appendonly", "yes", "--appendfsync", "always"]
        subprocess.run(["redis-server", *args], check=True, timeout=30)
        for _ in range(600):
            if self.pidfile.exists():
                try:
                    redis.Redis(port=self.port, socket_timeout=1).ping()
                except redis.AuthenticationError:
                    return  # up, and refusing the default user as it should
                except redis.ConnectionError:
                    pass
            time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def stop(self) -> None:
        if not self.pidfile.exists():
            return
        pid = int(self.pidfile.read_text().strip())
        os.kill(pid, signal.SIGTERM)
        for _ in range(600):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise AssertionError("redis-server did not stop")


@pytest.fixture
def acl_redis(tmp_path: Path, empty_home: Path) -> Iterator[tuple[AclRedis, str]]:
    secrets, acl_file = tmp_path / "secrets", tmp_path / "users.acl"
    written = sdcp(empty_home, "redis-acl", "--secrets", str(secrets), "--acl-file", str(acl_file), "--role", "admin")
    assert written.returncode == 0, written.stderr
    password = (secrets / "admin.password").read_text().strip()
    data = tmp_path / "redis"
    data.mkdir()
    server = AclRedis(data, acl_file)
    server.start()
    try:
        yield server, f"redis://sdcp-admin:{password}@127.0.0.1:{server.port}/0"
    finally:
        server.stop()


def streamed(client: openai.OpenAI, prompt: str, *, after_first: object = None) -> str:
    """A greedy streamed completion's text; ``after_first`` (a callable) runs once its first
    tokens have arrived, mid-generation."""
    text = []
    stream = client.completions.create(model="smollm2", prompt=prompt, max_tokens=160, temperature=0, stream=True)
    for chunk in stream:
        text.append(chunk.choices[0].text if chunk.choices else "")
        if after_first is not None and len(text) == 8:
            after_first()  # type: ignore[operator]
    return "".join(text)


def test_a_redis_restart_mid_generation_keeps_every_role_in_and_the_output_identical(
    empty_home: Path, acl_redis: tuple[AclRedis, str]
) -> None:
    """Issue #36: `sdcp up --redis` created the roles' users with ACL SETUSER only, so a Redis
    restart dropped them: every role was refused, streams hung and new requests got 503 while
    readiness stayed green (failed before: the stream below never ended). The users are now kept in
    the server's ACL file (ACL SAVE), and the restart costs a pause."""
    server, url = acl_redis
    with cluster_up(empty_home, "--redis", url, "--drafter", "ngram", "--gateway-port", "0") as started:
        assert started.returncode == 0, started.stderr
        assert "kept in the server's ACL file" in started.stderr
        gateway = LocalCluster(empty_home).gateway
        assert gateway is not None
        client = openai.OpenAI(base_url=gateway, api_key="unused", timeout=120, max_retries=0)
        quiet = streamed(client, PROMPTS[0])

        def restart() -> None:
            server.stop()
            server.start()

        assert streamed(client, PROMPTS[0], after_first=restart) == quiet
        # Every role is still let in: a new request after the restart is served too.
        assert streamed(client, PROMPTS[0]) == quiet
