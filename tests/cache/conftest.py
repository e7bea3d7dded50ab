"""Fixtures of the MLC tests: one MLC factory per backend (redis_url comes from tests/conftest.py).

Every backend-parametrised test runs against the embedded backend (disk directory shared store)
and against Redis; each test gets its own disk directory and its own Redis key prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from sdcp.cache import MLC

MlcFactory = Callable[..., MLC]


@pytest.fixture(params=["embedded", "redis"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_config(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    """Keyword arguments naming one shared store; two MLCs built from it see the same objects."""
    if backend == "embedded":
        return {"disk_dir": tmp_path / "mlc"}
    return {"redis_url": request.getfixturevalue("redis_url"), "redis_prefix": f"test:{uuid.uuid4().hex}:"}


@pytest.fixture
async def make_mlc(backend: str, store_config: dict[str, object], tmp_path: Path) -> AsyncIterator[MlcFactory]:
    """`make_mlc(memory_bytes=..., shared_bytes=..., disk_cache=False)` -> MLC on this test's store."""
    created: list[MLC] = []

    def factory(*, memory_bytes: int = 1 << 20, shared_bytes: int = 64 << 20, disk_cache: bool = False) -> MLC:
        config: dict[str, object] = dict(store_config, memory_bytes=memory_bytes)
        if backend == "embedded":
            config["disk_bytes"] = shared_bytes
        else:
            config["redis_bytes"] = shared_bytes
            if disk_cache:
                config["disk_dir"] = tmp_path / f"disk-cache-{len(created)}"
        mlc = MLC.from_config(**config)  # type: ignore[arg-type]
        created.append(mlc)
        return mlc

    yield factory
    for mlc in created:
        await mlc.close()
