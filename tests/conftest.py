"""Fixtures shared by every test directory: the `redis_url` of a real redis-server on loopback."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _load_redis_plugin() -> object:
    path = Path(__file__).resolve().parent / "redis_fixture.py"
    spec = importlib.util.spec_from_file_location("redis_fixture", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


redis_url = _load_redis_plugin().redis_url  # type: ignore[attr-defined]
