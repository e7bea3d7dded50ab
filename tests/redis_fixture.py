"""pytest plugin: a real `redis-server` on 127.0.0.1, started once per test session, stopped by pid.

Loaded by tests/conftest.py, so every test directory can ask for `redis_url`.
If `redis-server` is not installed the tests that need it FAIL, by design:
`make test` installs it (scripts/install-system-packages).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sdcp.bench.redis_process import local_redis_server, redis_server_available


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a private, empty-at-start redis-server with persistence off."""
    if not redis_server_available():
        pytest.fail("redis-server is not installed; run `make test` (it installs it) or apt-get install redis-server")
    with local_redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
