"""Fixtures shared by every test directory: a real redis-server on loopback, and a guard that fails
a test in which any sdcp component logged an error."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest


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
