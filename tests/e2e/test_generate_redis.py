"""End to end with Redis as the MLC's shared tier and commit log: `sdcp up --redis URL`."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import redis
from tests.e2e.support import MAX_NEW, PROMPTS, sdcp

pytestmark = pytest.mark.timeout(600)


def test_generate_over_the_redis_tier_equals_greedy(
    empty_home: Path, redis_url: str, reference: dict[str, list[int]]
) -> None:
    started = sdcp(empty_home, "up", "--redis", redis_url, "--drafter", "ngram", "--gateway-port", "0")
    assert started.returncode == 0, started.stderr
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
