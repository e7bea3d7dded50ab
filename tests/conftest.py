"""Fixtures shared by every test directory: a real redis-server on loopback, and a guard that fails
a test in which any sdcp component logged an error."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdcp.threads import limit_native_threads

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each worker is one of several test processes sharing the cores (`make test`): a torch team of
    # more than one thread would spin at the end of every operator for a thread parked behind another
    # worker (sdcp.threads), which made the torch tests seven times slower than alone. Read before
    # torch is imported; the roles a test starts as processes set their own budget.
    limit_native_threads(1)


def _load_redis_plugin() -> object:
    path = Path(__file__).resolve().parent / "redis_fixture.py"
    spec = importlib.util.spec_from_file_location("redis_fixture", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


redis_url = _load_redis_plugin().redis_url  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def no_background_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A background task of a node that fails logs an error and nothing else notices: fail the test."""
    yield
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR and r.name.startswith("sdcp")]
    assert not errors, "errors logged during the test: " + "; ".join(r.getMessage() for r in errors)
