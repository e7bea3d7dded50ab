"""MLC objects and leases, against the embedded backend and a real redis-server (one suite)."""

from __future__ import annotations

import asyncio

import pytest

from sdcp.cache import (
    MLC,
    CacheFull,
    InvalidArgument,
    InvalidURI,
    LeaseNotHeld,
    ObjectNotFound,
    ObjectTooLarge,
    PreconditionFailed,
    build_uri,
    content_etag,
)
from sdcp.cache.etags import ABSENT_ETAG

pytestmark = pytest.mark.timeout(60)

KB = 1024


def uri(name: str, kind: str = "q_rows") -> str:
    return build_uri("localhost", bytes(16), kind, name)


async def test_put_get_exists_delete(make_mlc) -> None:
    mlc: MLC = make_mlc()
    info = await mlc.put(uri("a"), b"hello")
    assert info.etag == content_etag(b"hello") and info.size == 5
    assert await mlc.get(uri("a")) == b"hello"
    assert await mlc.exists(uri("a"))
    assert await mlc.delete(uri("a"))
    assert not await mlc.exists(uri("a"))
    assert not await mlc.delete(uri("a"))
    with pytest.raises(ObjectNotFound):
        await mlc.get(uri("a"))


async def test_empty_and_large_objects_round_trip(make_mlc) -> None:
    mlc: MLC = make_mlc(memory_bytes=4 << 20)
    row = bytes(range(256)) * (1600 * KB // 256)
    await mlc.put(uri("empty"), b"")
    await mlc.put(uri("rows"), row)
    assert await mlc.get(uri("empty")) == b""
    assert await mlc.get(uri("rows")) == row


async def test_conditional_put(make_mlc) -> None:
    mlc: MLC = make_mlc()
    first = await mlc.put(uri("c"), b"v1")
    second = await mlc.put(uri("c"), b"v2", if_match=first.etag)
    with pytest.raises(PreconditionFailed):
        await mlc.put(uri("c"), b"v3", if_match=first.etag)
    with pytest.raises(PreconditionFailed):
        await mlc.put(uri("missing"), b"x", if_match=first.etag)
    data, info = await mlc.fetch(uri("c"))
    assert data == b"v2" and info.etag == second.etag


async def test_a_conditional_create_fails_where_the_object_exists(make_mlc) -> None:
    """ABSENT_ETAG as If-Match creates only where no object is (If-None-Match: *): two writers
    creating one object at once, one of them fails instead of replacing the other's."""
    mlc: MLC = make_mlc()
    created = await mlc.put(uri("new"), b"first", if_match=ABSENT_ETAG)
    with pytest.raises(PreconditionFailed):
        await mlc.put(uri("new"), b"second", if_match=ABSENT_ETAG)
    data, info = await mlc.fetch(uri("new"))
    assert data == b"first" and info.etag == created.etag
    await mlc.put(uri("new"), b"third", if_match=created.etag)


async def test_bad_input_is_typed(make_mlc) -> None:
    mlc: MLC = MLC.from_config(memory_bytes=1 << 20, max_object_bytes=100)
    with pytest.raises(ObjectTooLarge):
        await mlc.put(uri("big"), bytes(101))
    with pytest.raises(InvalidArgument):
        await mlc.put(uri("text"), "not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidURI):
        await mlc.put("bucket/key", b"x")  # not an absolute URI
    await mlc.put(uri("ok"), b"x")
    with pytest.raises(InvalidArgument):
        await mlc.lease(uri("ok"), "", 1.0)
    with pytest.raises(InvalidArgument):
        await mlc.lease(uri("ok"), "holder", 0)
    shared_limited = make_mlc(shared_bytes=10 * KB)
    with pytest.raises(ObjectTooLarge):
        await shared_limited.put(uri("over"), bytes(11 * KB))


async def test_promotion_and_demotion(make_mlc, backend: str) -> None:
    mlc: MLC = make_mlc(memory_bytes=2 * KB, disk_cache=True)
    for name in ("a", "b", "c"):
        await mlc.put(uri(name), name.encode() * KB)
    shared = "disk" if backend == "embedded" else "redis"
    # Memory holds two objects: "a" was the least recently used and left it.
    assert (await mlc.locate(uri("a")))[0] != "memory"
    assert (await mlc.locate(uri("c")))[0] == "memory"
    if backend == "redis":
        assert await mlc.locate(uri("a")) == ["disk", "redis"]  # demoted to the local disk cache
    else:
        assert await mlc.locate(uri("a")) == [shared]
    assert await mlc.get(uri("a")) == b"a" * KB  # a read promotes into memory ...
    assert (await mlc.locate(uri("a")))[0] == "memory"
    assert "memory" not in await mlc.locate(uri("b"))  # ... demoting the LRU entry
    assert await mlc.get(uri("b")) == b"b" * KB


async def test_shared_tier_evicts_lru_but_never_a_leased_object(make_mlc) -> None:
    mlc: MLC = make_mlc(memory_bytes=1 * KB, shared_bytes=3 * KB)
    for name in ("a", "b", "c"):
        await mlc.put(uri(name), bytes(KB))
    lease = await mlc.lease(uri("a"), "drafter-1", 30.0)
    assert lease.holder == "drafter-1" and lease.uri == uri("a")
    await mlc.put(uri("d"), bytes(KB))  # pressure: the LRU object "a" is leased, "b" goes
    assert await mlc.exists(uri("a"))
    assert not await mlc.exists(uri("b"))
    await mlc.lease(uri("c"), "drafter-1", 30.0)
    await mlc.lease(uri("d"), "drafter-2", 30.0)
    with pytest.raises(CacheFull):
        await mlc.put(uri("e"), bytes(KB))
    assert all([await mlc.exists(uri(n)) for n in ("a", "c", "d")])
    assert await mlc.release(uri("c"), "drafter-1")
    assert not await mlc.release(uri("c"), "drafter-1")
    await mlc.put(uri("e"), bytes(KB))
    assert not await mlc.exists(uri("c"))
    assert await mlc.exists(uri("a")) and await mlc.exists(uri("d"))


async def test_lease_expiry_renew_and_errors(make_mlc) -> None:
    mlc: MLC = make_mlc(memory_bytes=1 * KB, shared_bytes=2 * KB)
    await mlc.put(uri("a"), bytes(KB))
    await mlc.put(uri("b"), bytes(KB))
    with pytest.raises(ObjectNotFound):
        await mlc.lease(uri("missing"), "h", 1.0)
    with pytest.raises(LeaseNotHeld):
        await mlc.renew(uri("a"), "h", 1.0)
    # Long enough that no machine is slow enough to see these expire before the renewal.
    first = await mlc.lease(uri("a"), "h", 600.0)
    renewed = await mlc.renew(uri("a"), "h", 600.0)
    assert renewed.expires_at >= first.expires_at
    # A crashed holder renews no more: once its last, short lease ran out, the object is freed.
    await mlc.renew(uri("a"), "h", 0.05)
    await asyncio.sleep(0.1)
    with pytest.raises(LeaseNotHeld):
        await mlc.renew(uri("a"), "h", 1.0)
    assert renewed.expires_at > 0
    await mlc.put(uri("c"), bytes(KB))
    assert not await mlc.exists(uri("a"))


async def test_other_instances_see_puts_updates_and_deletes(make_mlc) -> None:
    writer: MLC = make_mlc()
    reader: MLC = make_mlc()
    await writer.put(uri("x"), b"one")
    assert await reader.get(uri("x")) == b"one"  # now cached in the reader's memory too
    await writer.put(uri("x"), b"two")
    assert await reader.get(uri("x")) == b"two"  # a stale cached copy is never served
    await writer.delete(uri("x"))
    with pytest.raises(ObjectNotFound):
        await reader.get(uri("x"))
    assert "memory" not in await reader.locate(uri("x"))


async def test_leases_are_shared_between_instances(make_mlc) -> None:
    holder: MLC = make_mlc(shared_bytes=2 * KB)
    other: MLC = make_mlc(shared_bytes=2 * KB)
    await holder.put(uri("a"), bytes(KB))
    await holder.lease(uri("a"), "drafter", 30.0)
    await other.put(uri("b"), bytes(KB))
    await other.put(uri("c"), bytes(KB))  # must evict "b", not the leased "a"
    assert await other.exists(uri("a")) and not await other.exists(uri("b"))


async def test_bandwidth_reports_recent_transfers(make_mlc) -> None:
    mlc: MLC = make_mlc()
    assert mlc.bandwidth_mbps() is None
    await mlc.put(uri("bw"), bytes(196 * KB))
    await mlc.get(uri("bw"))
    mbps = mlc.bandwidth_mbps()
    assert mbps is not None and mbps > 0


async def test_memory_only_mlc_is_a_complete_store() -> None:
    mlc = MLC.from_config(memory_bytes=2 * KB)
    await mlc.put(uri("a"), bytes(KB))
    await mlc.lease(uri("a"), "h", 30.0)
    await mlc.put(uri("b"), bytes(KB))
    with pytest.raises(CacheFull):
        await mlc.put(uri("c"), bytes(KB) + b"x")
    await mlc.release(uri("a"), "h")
    await mlc.put(uri("c"), bytes(KB))
    assert await mlc.locate(uri("c")) == ["memory"]
    assert not await mlc.exists(uri("a"))
    await mlc.close()
