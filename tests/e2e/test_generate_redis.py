"""End to end with Redis as the MLC's shared tier and commit log: `sdcp up --redis URL`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
        assert "redis_url" in (empty_home / "cluster" / "verifier.toml").read_text()
    finally:
        assert sdcp(empty_home, "down").returncode == 0


def test_unreachable_redis_is_one_line(tmp_path: Path) -> None:
    result = sdcp(tmp_path, "up", "--redis", "redis://127.0.0.1:1/0")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "unreachable" in result.stderr
