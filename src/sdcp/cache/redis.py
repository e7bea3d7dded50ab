"""Networked tier on a real `redis-server`: objects, leases and commit logs.

Layout under a key prefix (default `sdcp:mlc:`): `o:<uri>` hash {d: bytes, e: ETag}; `lru` sorted
set of URIs by last access (ms); `used` total object bytes; `l:<uri>` hash holder -> lease expiry
(ms, server clock); `log:<uri>` list of CBOR records and `logm:<uri>` hash {n, gen, fence, maxe}.
Every check-and-write is one Lua script, so it is atomic on the server. The scripts touch keys they
compute from the prefix, which a single Redis server (the supported deployment) allows.
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from sdcp.cache.commitlog import (
    EMPTY_LOG_ETAG,
    CommitLog,
    LogSnapshot,
    decode_record,
    encode_record,
    fence_record,
)
from sdcp.cache.errors import (
    CacheFull,
    Fenced,
    LeaseNotHeld,
    ObjectNotFound,
    ObjectTooLarge,
    PreconditionFailed,
    StoreUnavailable,
)
from sdcp.cache.tiers import CachedObject

_NOW_MS = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

_LIVE_LEASE = """
local function live_lease(key, now)
  local fields = redis.call('HGETALL', key)
  for i = 2, #fields, 2 do
    if tonumber(fields[i]) > now then return true end
  end
  return false
end
"""

# KEYS: object, lru, used. ARGV: uri, data, etag, if_match ('' = none), capacity (-1 = none), prefix.
_PUT = (
    _NOW_MS
    + _LIVE_LEASE
    + """
local current = redis.call('HGET', KEYS[1], 'e')
if ARGV[4] ~= '' and current ~= ARGV[4] then return 'PRECONDITION' end
local old = 0
if current then old = redis.call('HSTRLEN', KEYS[1], 'd') end
local size = string.len(ARGV[2])
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local capacity = tonumber(ARGV[5])
local need = used - old + size - capacity
if capacity >= 0 and need > 0 then
  local victims = {}
  for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    if member ~= ARGV[1] and not live_lease(ARGV[6] .. 'l:' .. member, now) then
      victims[#victims + 1] = member
      need = need - redis.call('HSTRLEN', ARGV[6] .. 'o:' .. member, 'd')
      if need <= 0 then break end
    end
  end
  if need > 0 then return 'FULL' end
  for _, member in ipairs(victims) do
    used = used - redis.call('HSTRLEN', ARGV[6] .. 'o:' .. member, 'd')
    redis.call('DEL', ARGV[6] .. 'o:' .. member, ARGV[6] .. 'l:' .. member)
    redis.call('ZREM', KEYS[2], member)
  end
end
redis.call('HSET', KEYS[1], 'd', ARGV[2], 'e', ARGV[3])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('SET', KEYS[3], used - old + size)
return 'OK'
"""
)

# KEYS: object, lru, used, lease. ARGV: uri.
_DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('DECRBY', KEYS[3], redis.call('HSTRLEN', KEYS[1], 'd'))
redis.call('DEL', KEYS[1], KEYS[4])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: object, lease. ARGV: holder, ttl_ms, mode ('take' | 'renew'). Returns expiry ms or -1.
_LEASE = (
    _NOW_MS
    + """
if ARGV[3] == 'take' then
  if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
else
  local current = redis.call('HGET', KEYS[2], ARGV[1])
  if not current or tonumber(current) <= now then return -1 end
end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], now + ttl)
if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
return now + ttl
"""
)

# KEYS: lease. Returns the holders of live leases.
_HOLDERS = (
    _NOW_MS
    + """
local fields = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #fields, 2 do
  if tonumber(fields[i + 1]) > now then live[#live + 1] = fields[i] end
end
return live
"""
)

# KEYS: lease. ARGV: holder. Returns 1 if a live lease was dropped.
_RELEASE = (
    _NOW_MS
    + """
local current = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
if current and tonumber(current) > now then return 1 end
return 0
"""
)

# KEYS: records, meta. ARGV: payload, epoch, mode ('append' | 'fence'), if_match, is_fence, new gen.
# SDCP 6.8: the fence check, the If-Match check and the append are one atomic step.
_APPEND = """
local meta = redis.call('HMGET', KEYS[2], 'n', 'gen', 'fence', 'maxe')
local n = tonumber(meta[1] or '0')
local gen = meta[2] or ARGV[6]
local fence = tonumber(meta[3] or '-1')
local maxe = tonumber(meta[4] or '-1')
local function etag(count)
  if count == 0 then return '"0"' end
  return '"' .. count .. '-' .. gen .. '"'
end
local epoch = tonumber(ARGV[2])
if ARGV[3] == 'fence' then
  if epoch < maxe then return {'FENCED', tostring(maxe)} end
  if epoch == fence then return {'OK', etag(n)} end
else
  if epoch < fence then return {'FENCED', tostring(fence)} end
  if ARGV[4] ~= etag(n) then return {'PRECONDITION', etag(n)} end
end
redis.call('RPUSH', KEYS[1], ARGV[1])
n = n + 1
if ARGV[5] == '1' and epoch > fence then fence = epoch end
if epoch > maxe then maxe = epoch end
redis.call('HSET', KEYS[2], 'n', n, 'gen', gen, 'fence', fence, 'maxe', maxe)
return {'OK', etag(n)}
"""


def _etag_of(count: int, gen: bytes | str | None) -> str:
    if count == 0:
        return EMPTY_LOG_ETAG
    text = gen.decode() if isinstance(gen, bytes) else gen
    return f'"{count}-{text}"'


_P = ParamSpec("_P")
_R = TypeVar("_R")
# A connection the pool kept across a Redis restart fails once: it is opened again and the command
# repeated, twice at most within a quarter second. A timeout is not repeated (Redis is there but
# slow or stopped). Past that, or with Redis down, StoreUnavailable.
_RETRY = Retry(ExponentialBackoff(cap=0.2, base=0.05), 2, supported_errors=(RedisConnectionError,))


def _unavailable_on_redis_errors(
    method: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    @functools.wraps(method)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await method(*args, **kwargs)
        except RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    return call


class RedisStore:
    """Shared store on Redis; `capacity_bytes=None` leaves the bound to the server's own maxmemory."""

    def __init__(self, url: str, capacity_bytes: int | None = None, prefix: str = "sdcp:mlc:") -> None:
        self.name = "redis"
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        self.client: aioredis.Redis = aioredis.Redis.from_url(url, decode_responses=False, retry=_RETRY)
        self._put = self.client.register_script(_PUT)
        self._delete = self.client.register_script(_DELETE)
        self._lease = self.client.register_script(_LEASE)
        self._release = self.client.register_script(_RELEASE)
        self._holders = self.client.register_script(_HOLDERS)
        self.append_script = self.client.register_script(_APPEND)

    def _key(self, kind: str, uri: str) -> str:
        return f"{self.prefix}{kind}:{uri}"

    @_unavailable_on_redis_errors
    async def head(self, uri: str) -> str | None:
        etag: bytes | str | None = await self.client.hget(self._key("o", uri), "e")
        return etag.decode() if isinstance(etag, bytes) else etag

    @_unavailable_on_redis_errors
    async def fetch(self, uri: str) -> CachedObject | None:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(self._key("o", uri), "d", "e")
            pipe.zadd(self.prefix + "lru", {uri: time.time() * 1000}, xx=True)
            (data, etag), _ = await pipe.execute()
        if data is None or etag is None:
            return None
        return CachedObject(uri, data, etag.decode())

    @_unavailable_on_redis_errors
    async def store(self, obj: CachedObject, if_match: str | None) -> None:
        if self.capacity_bytes is not None and len(obj.data) > self.capacity_bytes:
            raise ObjectTooLarge(f"{len(obj.data)} bytes exceed the redis capacity {self.capacity_bytes}")
        keys = [self._key("o", obj.uri), self.prefix + "lru", self.prefix + "used"]
        capacity = -1 if self.capacity_bytes is None else self.capacity_bytes
        args: list[str | bytes | int] = [obj.uri, obj.data, obj.etag, if_match or "", capacity, self.prefix]
        outcome = await self._put(keys=keys, args=args)
        if outcome == b"PRECONDITION":
            raise PreconditionFailed(f"{obj.uri}: If-Match {if_match} is not the current ETag")
        if outcome == b"FULL":
            raise CacheFull(f"redis: no room for {obj.uri}, the remaining objects are leased")

    @_unavailable_on_redis_errors
    async def remove(self, uri: str) -> bool:
        keys = [self._key("o", uri), self.prefix + "lru", self.prefix + "used", self._key("l", uri)]
        return bool(await self._delete(keys=keys, args=[uri]))

    @_unavailable_on_redis_errors
    async def lease(self, uri: str, holder: str, ttl_s: float) -> float:
        expires = await self._lease(keys=[self._key("o", uri), self._key("l", uri)], args=[holder, _ms(ttl_s), "take"])
        if expires < 0:
            raise ObjectNotFound(uri)
        return int(expires) / 1000

    @_unavailable_on_redis_errors
    async def renew(self, uri: str, holder: str, ttl_s: float) -> float:
        expires = await self._lease(keys=[self._key("o", uri), self._key("l", uri)], args=[holder, _ms(ttl_s), "renew"])
        if expires < 0:
            raise LeaseNotHeld(f"{holder} holds no lease on {uri}")
        return int(expires) / 1000

    @_unavailable_on_redis_errors
    async def release(self, uri: str, holder: str) -> bool:
        return bool(await self._release(keys=[self._key("l", uri)], args=[holder]))

    @_unavailable_on_redis_errors
    async def lease_holders(self, uri: str) -> frozenset[str]:
        holders = await self._holders(keys=[self._key("l", uri)])
        return frozenset(holder.decode() if isinstance(holder, bytes) else str(holder) for holder in holders)

    def commit_log(self, uri: str) -> CommitLog:
        return RedisCommitLog(uri, self)

    async def close(self) -> None:
        await self.client.aclose()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisCommitLog(CommitLog):
    """Commit log as a Redis list; ETag `"<count>-<generation>"`, the generation random per log."""

    def __init__(self, uri: str, store: RedisStore) -> None:
        super().__init__(uri)
        self._store = store
        self._records_key = store._key("log", uri)
        self._meta_key = store._key("logm", uri)

    @_unavailable_on_redis_errors
    async def read(self) -> LogSnapshot:
        async with self._store.client.pipeline(transaction=True) as pipe:
            pipe.lrange(self._records_key, 0, -1)
            pipe.hmget(self._meta_key, "n", "gen")
            payloads, (count, gen) = await pipe.execute()
        records = [decode_record(payload, f"{self.uri} record {index}") for index, payload in enumerate(payloads)]
        return LogSnapshot(records, _etag_of(int(count or 0), gen))

    @_unavailable_on_redis_errors
    async def append(self, record: dict[str, Any], if_match: str) -> str:
        payload, epoch, fence_shaped = encode_record(record)
        return await self._run(payload, epoch, "append", if_match, fence_shaped)

    @_unavailable_on_redis_errors
    async def fence(self, epoch: int, verifier: str | None = None) -> str:
        payload, _, _ = encode_record(fence_record(epoch, verifier))
        return await self._run(payload, epoch, "fence", "", True)

    async def _run(self, payload: bytes, epoch: int, mode: str, if_match: str, fence_shaped: bool) -> str:
        outcome, detail = await self._store.append_script(
            keys=[self._records_key, self._meta_key],
            args=[payload, epoch, mode, if_match, "1" if fence_shaped else "0", secrets.token_hex(8)],
        )
        text = str(detail.decode())
        if outcome == b"FENCED":
            raise Fenced(f"{self.uri}: log carries epoch {text}; record has epoch {epoch}")
        if outcome == b"PRECONDITION":
            raise PreconditionFailed(f"{self.uri}: If-Match {if_match} is not the current ETag {text}")
        return text
