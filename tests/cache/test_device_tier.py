"""The accelerator tier's tensor storage and its place in front of the other tiers.

Service configurations create it only when CUDA is present; here it holds tensors on the CPU
device, which exercises the same code (torch tensors in, bytes out) on machines without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sdcp.cache import MLC, build_uri
from sdcp.cache.device import DeviceTier, cuda_available
from sdcp.cache.disk import DiskTier
from sdcp.cache.memory import MemoryTier
from sdcp.cache.tiers import CachedObject

pytestmark = pytest.mark.timeout(60)


def uri(name: str) -> str:
    return build_uri("localhost", None, "draft_kv", name)


async def test_device_tier_round_trips_bytes_as_tensors() -> None:
    tier = DeviceTier(2048, device="cpu")
    await tier.install(CachedObject(uri("a"), bytes(range(256)) * 4, '"a"'))
    await tier.install(CachedObject(uri("empty"), b"", '"e"'))
    hit = await tier.lookup(uri("a"))
    assert hit is not None and hit.data == bytes(range(256)) * 4 and hit.etag == '"a"'
    assert (await tier.lookup(uri("empty"))) == CachedObject(uri("empty"), b"", '"e"')
    evicted = await tier.install(CachedObject(uri("b"), bytes(1500), '"b"'))
    assert [victim.uri for victim in evicted] == [uri("a")] and evicted[0].data == bytes(range(256)) * 4


async def test_device_tier_demotes_into_memory(tmp_path: Path) -> None:
    mlc = MLC(
        authority="localhost",
        shared=DiskTier(tmp_path, 1 << 20, leases_protect=True),
        caches=[DeviceTier(1024, device="cpu"), MemoryTier(4096)],
    )
    async with mlc:
        await mlc.put(uri("a"), b"a" * 1000)
        await mlc.put(uri("b"), b"b" * 1000)
        assert await mlc.locate(uri("a")) == ["memory", "disk"]
        assert await mlc.locate(uri("b")) == ["device", "disk"]
        assert await mlc.get(uri("a")) == b"a" * 1000
        assert await mlc.locate(uri("a")) == ["device", "memory", "disk"]


async def test_from_config_adds_the_device_tier_only_with_cuda(tmp_path: Path) -> None:
    async with MLC.from_config(disk_dir=tmp_path, device_bytes=1 << 20) as mlc:
        assert ("device" in [tier.name for tier in mlc.caches]) == cuda_available()
