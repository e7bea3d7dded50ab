"""Host-memory tiers: an LRU cache bounded by bytes, and the store of a memory-only MLC."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from sdcp.cache.commitlog import CommitLog, MemoryCommitLog
from sdcp.cache.errors import CacheFull, LeaseNotHeld, ObjectNotFound, ObjectTooLarge, PreconditionFailed
from sdcp.cache.etags import ABSENT_ETAG
from sdcp.cache.tiers import CachedObject


class LruBytes:
    """Objects in recency order, bounded by the sum of their sizes.

    Subclasses choose how bytes are held (`_hold`/`_bytes`); the accelerator tier keeps tensors.
    """

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"{name} capacity must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, tuple[object, int, str]] = OrderedDict()
        self._lock = threading.Lock()

    def _hold(self, data: bytes) -> object:
        return data

    def _bytes(self, held: object) -> bytes:
        assert isinstance(held, bytes)
        return held

    def holds(self, uri: str) -> bool:
        with self._lock:
            return uri in self._entries

    def peek_etag(self, uri: str) -> str | None:
        with self._lock:
            entry = self._entries.get(uri)
            return entry[2] if entry else None

    def lookup_sync(self, uri: str) -> CachedObject | None:
        with self._lock:
            entry = self._entries.get(uri)
            if entry is None:
                return None
            self._entries.move_to_end(uri)
            held, _, etag = entry
        return CachedObject(uri, self._bytes(held), etag)

    def install_sync(self, obj: CachedObject, protected: Callable[[str], bool] | None = None) -> list[CachedObject]:
        """Insert `obj`, evicting least recently used entries that are not `protected`.

        Without `protected` (a cache tier), an object larger than the tier is simply not cached.
        With it (the store of a memory-only MLC) the lack of room is an error.
        """
        size = len(obj.data)
        if size > self.capacity_bytes:
            if protected is None:
                return []
            raise ObjectTooLarge(f"{size} bytes exceed the {self.name} capacity {self.capacity_bytes}")
        held = self._hold(obj.data)
        with self._lock:
            previous = self._entries.pop(obj.uri, None)
            if previous is not None:
                self.used_bytes -= previous[1]
            victims = self._choose_victims(size, protected)
            if victims is None:
                if previous is not None:
                    self._entries[obj.uri] = previous
                    self.used_bytes += previous[1]
                raise CacheFull(f"{self.name}: no room for {size} bytes, the rest is leased")
            evicted = []
            for uri in victims:
                victim_held, victim_size, victim_etag = self._entries.pop(uri)
                self.used_bytes -= victim_size
                evicted.append(CachedObject(uri, self._bytes(victim_held), victim_etag))
            self._entries[obj.uri] = (held, size, obj.etag)
            self.used_bytes += size
        return evicted

    def _choose_victims(self, size: int, protected: Callable[[str], bool] | None) -> list[str] | None:
        need = self.used_bytes + size - self.capacity_bytes
        victims: list[str] = []
        for uri, (_, victim_size, _) in self._entries.items():
            if need <= 0:
                break
            if protected is not None and protected(uri):
                continue
            victims.append(uri)
            need -= victim_size
        return victims if need <= 0 else None

    def discard_sync(self, uri: str) -> bool:
        with self._lock:
            entry = self._entries.pop(uri, None)
            if entry is None:
                return False
            self.used_bytes -= entry[1]
            return True

    # Cache-tier role (`sdcp.cache.tiers.CacheTier`).

    async def lookup(self, uri: str) -> CachedObject | None:
        return self.lookup_sync(uri)

    async def install(self, obj: CachedObject) -> list[CachedObject]:
        return self.install_sync(obj)

    async def discard(self, uri: str) -> None:
        self.discard_sync(uri)


class MemoryTier(LruBytes):
    """Per-process host-memory cache in front of the shared store."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__("memory", capacity_bytes)


class MemoryStore:
    """Shared store of a memory-only MLC: visible to this process only, leases respected."""

    def __init__(self, capacity_bytes: int) -> None:
        self.name = "memory"
        self._objects = LruBytes("memory", capacity_bytes)
        self._leases: dict[str, dict[str, float]] = {}
        self._logs: dict[str, MemoryCommitLog] = {}
        self._lock = threading.Lock()

    def holds(self, uri: str) -> bool:
        return self._objects.holds(uri)

    async def head(self, uri: str) -> str | None:
        return self._objects.peek_etag(uri)

    async def fetch(self, uri: str) -> CachedObject | None:
        return self._objects.lookup_sync(uri)

    async def store(self, obj: CachedObject, if_match: str | None) -> None:
        with self._lock:
            if if_match is not None and (self._objects.peek_etag(obj.uri) or ABSENT_ETAG) != if_match:
                raise PreconditionFailed(f"{obj.uri}: If-Match {if_match} is not the current ETag")
            for evicted in self._objects.install_sync(obj, self._is_leased):
                self._leases.pop(evicted.uri, None)

    async def remove(self, uri: str) -> bool:
        with self._lock:
            self._leases.pop(uri, None)
            return self._objects.discard_sync(uri)

    async def lease(self, uri: str, holder: str, ttl_s: float) -> float:
        with self._lock:
            if not self._objects.holds(uri):
                raise ObjectNotFound(uri)
            expires = time.time() + ttl_s
            self._leases.setdefault(uri, {})[holder] = expires
            return expires

    async def renew(self, uri: str, holder: str, ttl_s: float) -> float:
        with self._lock:
            holders = self._leases.get(uri, {})
            if holders.get(holder, 0.0) <= time.time():
                raise LeaseNotHeld(f"{holder} holds no lease on {uri}")
            holders[holder] = time.time() + ttl_s
            return holders[holder]

    async def release(self, uri: str, holder: str) -> bool:
        with self._lock:
            expires = self._leases.get(uri, {}).pop(holder, 0.0)
            return expires > time.time()

    async def lease_holders(self, uri: str) -> frozenset[str]:
        with self._lock:
            now = time.time()
            return frozenset(holder for holder, expires in self._leases.get(uri, {}).items() if expires > now)

    def _is_leased(self, uri: str) -> bool:
        now = time.time()
        return any(expires > now for expires in self._leases.get(uri, {}).values())

    def commit_log(self, uri: str) -> CommitLog:
        with self._lock:
            return self._logs.setdefault(uri, MemoryCommitLog(uri))

    async def close(self) -> None:
        return None
