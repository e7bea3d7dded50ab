"""The two tier roles of the MLC.

The *shared store* is the source of truth: every put is written through to it before `put()` returns,
existence and the current ETag are read from it, leases are recorded in it, and capacity pressure
there evicts objects for good, so it respects leases. *Cache tiers* (accelerator memory, host memory,
a local disk in front of Redis) hold copies for one process or host; they evict without regard to
leases, because the shared store still holds the object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sdcp.cache.commitlog import CommitLog


@dataclass(frozen=True, slots=True)
class CachedObject:
    uri: str
    data: bytes
    etag: str


class CacheTier(Protocol):
    name: str

    async def lookup(self, uri: str) -> CachedObject | None:
        """The cached copy, refreshing its recency, or None."""

    async def install(self, obj: CachedObject) -> list[CachedObject]:
        """Cache a copy; returns the copies evicted to make room (to be demoted by the caller)."""

    async def discard(self, uri: str) -> None: ...

    def holds(self, uri: str) -> bool: ...


class SharedStore(Protocol):
    name: str

    async def head(self, uri: str) -> str | None:
        """Current ETag, or None if the object does not exist."""

    async def fetch(self, uri: str) -> CachedObject | None: ...

    async def store(self, obj: CachedObject, if_match: str | None) -> None:
        """Write the object; raises PreconditionFailed, ObjectTooLarge or CacheFull."""

    async def remove(self, uri: str) -> bool:
        """Delete; True if the object existed."""

    async def lease(self, uri: str, holder: str, ttl_s: float) -> float:
        """Take or extend a lease; returns its expiry (seconds since the epoch, store clock)."""

    async def renew(self, uri: str, holder: str, ttl_s: float) -> float:
        """Extend a live lease; raises LeaseNotHeld when there is none."""

    async def release(self, uri: str, holder: str) -> bool:
        """Drop a lease; True if a live one was dropped."""

    async def lease_holders(self, uri: str) -> frozenset[str]:
        """Who holds a live lease on the object now."""

    def commit_log(self, uri: str) -> CommitLog: ...

    async def close(self) -> None: ...
