"""Fixtures of the end-to-end tests: a fresh SDCP home with the fetched model, the greedy reference."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.e2e.homes import fresh_home
from tests.e2e.support import cluster_up, greedy_reference


@pytest.fixture(scope="session")
def reference() -> dict[str, list[int]]:
    return greedy_reference()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A local cluster of the default shape, running for the tests of one module."""
    root = fresh_home(tmp_path_factory.mktemp("sdcp-home"))
    with cluster_up(root, "--gateway-port", "0") as started:
        assert started.returncode == 0, started.stderr
        assert "dashboard: http://127.0.0.1:" in started.stderr
        yield root


@pytest.fixture
def empty_home(tmp_path: Path) -> Path:
    return fresh_home(tmp_path)
