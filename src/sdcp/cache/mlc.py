"""The multi-level cache (SDCP 1.2, 1.4): tiered objects named by URI, leases, commit logs.

Consistency model. The shared store (Redis if configured, else the disk directory, else this
process's memory) is the source of truth. `put()` returns only after the shared store holds the new
version, so any process using the same store sees it from then on. Faster tiers (accelerator, host
memory, a local disk in front of Redis) are per-process or per-host copies: every `get()` first asks
the shared store for the current ETag and serves a cached copy only if its ETag matches, so a put or
delete by another process is never hidden by a stale copy (read-your-writes and monotonic reads for
every reader, at the cost of one metadata round trip per get).

Placement. A put writes through to the shared store and allocates in the fastest cache tier. A hit
in a slower tier is promoted into every faster tier; an entry evicted from a cache tier by capacity
pressure (LRU) is demoted to the next slower cache tier, or dropped when there is none, since the
shared store keeps it. Only eviction in the shared store loses an object, and it never takes a
leased one: a put that could only make room by evicting leased objects fails with `CacheFull`.

Resolution. A `cache-ref` is an opaque URI (SDCP 5.2); which MLC serves it is configuration: its
authority is looked up in `routes` (other MLCs, such as a remote MLC node), and an authority not
listed is served here (as are `own_authorities`) unless `serves_unlisted` is off, when the
reference is `UnresolvableRef`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType

from prometheus_client import Counter

from sdcp.cache.bandwidth import BandwidthMeter
from sdcp.cache.commitlog import CommitLog
from sdcp.cache.device import DeviceTier, cuda_available
from sdcp.cache.disk import DiskTier
from sdcp.cache.errors import InvalidArgument, ObjectNotFound, ObjectTooLarge, UnresolvableRef
from sdcp.cache.etags import content_etag
from sdcp.cache.memory import MemoryStore, MemoryTier
from sdcp.cache.redis_acl import RedisAccess
from sdcp.cache.tiers import CachedObject, CacheTier, SharedStore
from sdcp.cache.uri import authority_of

MiB = 1 << 20
DEFAULT_MAX_OBJECT_BYTES = 64 * MiB


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What an HTTP wrapper needs for headers: the URI, its ETag and the size in bytes."""

    uri: str
    etag: str
    size: int


@dataclass(frozen=True, slots=True)
class Lease:
    uri: str
    holder: str
    expires_at: float  # seconds since the Unix epoch, on the shared store's clock


# Per tier (docs/observability.md): lookups that found the object or not, and bytes moved.
TIER_LOOKUPS = Counter(
    "sdcp_mlc_lookups_total", "Object reads by tier and result (hit, miss)", ["authority", "tier", "result"]
)
TIER_BYTES = Counter(
    "sdcp_mlc_bytes_total", "Bytes read from and written to each tier", ["authority", "tier", "direction"]
)
LEASES = Counter(
    "sdcp_mlc_leases_total", "Leases taken, renewed and released (held = taken - released)", ["authority", "event"]
)


class MLC:
    """Async facade over one shared store and zero or more cache tiers (fastest first)."""

    def __init__(
        self,
        *,
        authority: str,
        shared: SharedStore,
        caches: list[CacheTier],
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        routes: Mapping[str, MLC] | None = None,
        own_authorities: Iterable[str] = (),
        serves_unlisted: bool = True,
    ) -> None:
        if max_object_bytes <= 0:
            raise InvalidArgument(f"max_object_bytes must be positive, got {max_object_bytes}")
        self.authority = authority
        self.routes = {name.lower(): mlc for name, mlc in (routes or {}).items()}
        self.own_authorities = frozenset(name.lower() for name in (*own_authorities, authority))
        self.serves_unlisted = serves_unlisted
        self.shared = shared
        self.caches = caches
        self.max_object_bytes = max_object_bytes
        self._meter = BandwidthMeter()
        for tier in (*(cache.name for cache in caches), shared.name):
            for result in ("hit", "miss"):
                TIER_LOOKUPS.labels(authority, tier, result)
            for direction in ("read", "write"):
                TIER_BYTES.labels(authority, tier, direction)
        for event in ("taken", "renewed", "released"):
            LEASES.labels(authority, event)

    @classmethod
    def from_config(
        cls,
        *,
        authority: str = "localhost",
        memory_bytes: int = 256 * MiB,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 4096 * MiB,
        redis_url: str | None = None,
        redis_bytes: int | None = None,
        redis_prefix: str = "sdcp:mlc:",
        redis_access: RedisAccess | None = None,
        device_bytes: int = 0,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        remote: SharedStore | None = None,
        routes: Mapping[str, MLC] | None = None,
        own_authorities: Iterable[str] = (),
        serves_unlisted: bool = True,
    ) -> MLC:
        """Build the tiers from configuration.

        The shared store is Redis when `redis_url` is set (then `disk_dir`, if set, is a local
        cache), else the disk directory, else host memory (visible to this process only). A host
        memory cache of `memory_bytes` sits in front of a Redis or disk store (0 disables it), and
        an accelerator tier of `device_bytes` in front of everything when CUDA is present.
        `redis_prefix` namespaces the keys, so that several clusters can share one Redis server;
        `redis_access` names the user, password and TLS files, and the role whose user it is.
        `remote` (a remote MLC node's store, `sdcp.services.mlc_client.RemoteStore`, which the
        services build since it speaks the transport) is the shared store instead; `disk_dir` is
        then a local cache, as with Redis. `routes`, `own_authorities` and `serves_unlisted` say
        which MLC serves a reference by its authority (`serving`).
        """
        shared: SharedStore
        caches: list[CacheTier] = []
        if device_bytes > 0 and cuda_available():
            caches.append(DeviceTier(device_bytes))
        if remote is not None:
            if redis_url is not None:
                raise InvalidArgument("a remote MLC and redis_url both name a shared store; give one")
            shared = remote
            if memory_bytes > 0:
                caches.append(MemoryTier(memory_bytes))
            if disk_dir is not None:
                caches.append(DiskTier(disk_dir, disk_bytes, leases_protect=False))
        elif redis_url is not None:
            from sdcp.cache.redis import RedisStore

            shared = RedisStore(redis_url, redis_bytes, redis_prefix, redis_access)
            if memory_bytes > 0:
                caches.append(MemoryTier(memory_bytes))
            if disk_dir is not None:
                caches.append(DiskTier(disk_dir, disk_bytes, leases_protect=False))
        elif disk_dir is not None:
            shared = DiskTier(disk_dir, disk_bytes, leases_protect=True)
            if memory_bytes > 0:
                caches.append(MemoryTier(memory_bytes))
        else:
            shared = MemoryStore(memory_bytes)
        return cls(
            authority=authority,
            shared=shared,
            caches=caches,
            max_object_bytes=max_object_bytes,
            routes=routes,
            own_authorities=own_authorities,
            serves_unlisted=serves_unlisted,
        )

    async def __aenter__(self) -> MLC:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        for route in self.routes.values():
            await route.close()
        await self.shared.close()
        for tier in self.caches:
            if isinstance(tier, DiskTier):
                await tier.close()

    def serving(self, uri: str) -> MLC:
        """The MLC that serves `uri`, chosen by its authority (SDCP 5.2 cache-ref, docs/wire.md)."""
        authority = authority_of(uri)
        route = self.routes.get(authority)
        if route is not None:
            return route
        if self.serves_unlisted or authority in self.own_authorities:
            return self
        raise UnresolvableRef(f"no MLC is configured for authority {authority!r} of {uri[:100]!r}")

    # -- objects --------------------------------------------------------------------------------

    async def put(self, uri: str, data: bytes, *, if_match: str | None = None) -> ObjectInfo:
        """Store `data` under `uri`; with `if_match`, only if that is the current ETag."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.put(uri, data, if_match=if_match)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"object data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > self.max_object_bytes:
            raise ObjectTooLarge(f"{len(data)} bytes exceed the maximum object size {self.max_object_bytes}")
        started = time.perf_counter()
        obj = CachedObject(uri, data, content_etag(data))
        await self.shared.store(obj, if_match)
        TIER_BYTES.labels(self.authority, self.shared.name, "write").inc(len(data))
        if self.caches:
            await self._install(0, obj)
        self._meter.record(len(data), time.perf_counter() - started)
        return ObjectInfo(uri, obj.etag, len(data))

    async def get(self, uri: str) -> bytes:
        return (await self.fetch(uri))[0]

    async def fetch(self, uri: str) -> tuple[bytes, ObjectInfo]:
        """The object and its info; raises `ObjectNotFound` when no tier has it."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.fetch(uri)
        started = time.perf_counter()
        obj = await self._read(uri)
        self._meter.record(len(obj.data), time.perf_counter() - started)
        return obj.data, ObjectInfo(uri, obj.etag, len(obj.data))

    async def _read(self, uri: str) -> CachedObject:
        if self.caches:
            current = await self.shared.head(uri)
            if current is None:
                await self._forget(uri)
                raise ObjectNotFound(uri)
            for level, tier in enumerate(self.caches):
                hit = await tier.lookup(uri)
                if hit is not None and hit.etag == current:
                    self._looked_up(tier.name, hit)
                    await self._promote(level, hit)
                    return hit
                self._looked_up(tier.name, None)
                if hit is not None:
                    await tier.discard(uri)
        obj = await self.shared.fetch(uri)
        self._looked_up(self.shared.name, obj)
        if obj is None:
            raise ObjectNotFound(uri)
        await self._promote(len(self.caches), obj)
        return obj

    def _looked_up(self, tier: str, found: CachedObject | None) -> None:
        TIER_LOOKUPS.labels(self.authority, tier, "miss" if found is None else "hit").inc()
        if found is not None:
            TIER_BYTES.labels(self.authority, tier, "read").inc(len(found.data))

    async def _promote(self, level: int, obj: CachedObject) -> None:
        for faster in range(level):
            await self._install(faster, obj)

    async def _install(self, level: int, obj: CachedObject) -> None:
        evicted = await self.caches[level].install(obj)
        TIER_BYTES.labels(self.authority, self.caches[level].name, "write").inc(len(obj.data))
        if level + 1 < len(self.caches):
            for victim in evicted:
                await self._install(level + 1, victim)

    async def _forget(self, uri: str) -> None:
        """Drop cached copies of an object the shared store no longer has."""
        for tier in self.caches:
            await tier.discard(uri)

    async def exists(self, uri: str) -> bool:
        if (mlc := self.serving(uri)) is not self:
            return await mlc.exists(uri)
        if await self.shared.head(uri) is None:
            await self._forget(uri)
            return False
        return True

    async def delete(self, uri: str) -> bool:
        """Remove from every tier; True if the object existed. Explicit deletes ignore leases."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.delete(uri)
        existed = await self.shared.remove(uri)
        await self._forget(uri)
        return existed

    async def locate(self, uri: str) -> list[str]:
        """Names of the tiers holding a copy, fastest first (for tests, metrics and debugging)."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.locate(uri)
        if not await self.exists(uri):
            return []
        return [tier.name for tier in self.caches if tier.holds(uri)] + [self.shared.name]

    # -- leases ---------------------------------------------------------------------------------

    async def lease(self, uri: str, holder: str, ttl_s: float) -> Lease:
        """Protect the object from capacity eviction until released or `ttl_s` seconds pass."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.lease(uri, holder, ttl_s)
        _check_lease_args(holder, ttl_s)
        lease = Lease(uri, holder, await self.shared.lease(uri, holder, ttl_s))
        LEASES.labels(self.authority, "taken").inc()
        return lease

    async def renew(self, uri: str, holder: str, ttl_s: float) -> Lease:
        if (mlc := self.serving(uri)) is not self:
            return await mlc.renew(uri, holder, ttl_s)
        _check_lease_args(holder, ttl_s)
        lease = Lease(uri, holder, await self.shared.renew(uri, holder, ttl_s))
        LEASES.labels(self.authority, "renewed").inc()
        return lease

    async def release(self, uri: str, holder: str) -> bool:
        """Drop the holder's lease; True if it was live. Releasing twice is harmless."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.release(uri, holder)
        _check_lease_args(holder, 1.0)
        released = await self.shared.release(uri, holder)
        if released:
            LEASES.labels(self.authority, "released").inc()
        return released

    async def lease_holders(self, uri: str) -> frozenset[str]:
        """Who holds a live lease on the object now."""
        if (mlc := self.serving(uri)) is not self:
            return await mlc.lease_holders(uri)
        return await self.shared.lease_holders(uri)

    # -- commit logs and telemetry --------------------------------------------------------------

    def commit_log(self, uri: str) -> CommitLog:
        """The commit log named `uri` (SDCP 6.8), kept in the shared store of the MLC serving it."""
        if (mlc := self.serving(uri)) is not self:
            return mlc.commit_log(uri)
        return self.shared.commit_log(uri)

    def bandwidth_mbps(self) -> float | None:
        """MB/s achieved by the gets and puts of the last seconds; None before any transfer."""
        return self._meter.mbps()


def _check_lease_args(holder: str, ttl_s: float) -> None:
    if not isinstance(holder, str) or not holder:
        raise InvalidArgument(f"a lease holder is a non-empty string, got {holder!r}")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not (0 < ttl_s < math.inf):
        raise InvalidArgument(f"a lease TTL is a positive finite number of seconds, got {ttl_s!r}")
