"""Networked tier on a real `redis-server`: objects, leases and commit logs, keyed per role.

Layout under a key prefix P (default `sdcp:mlc:`). Objects live in one namespace per kind (`q-rows`,
`tokens`, `target-kv`, `history`, and `other` for every other name: `sdcp.cache.redis_acl`), each
with its own eviction accounting:

- `P<ns>:o:<uri>` hash {d: bytes, e: ETag}; `P<ns>:l:<uri>` hash holder -> lease expiry (ms,
  server clock); `P<ns>:lru` sorted set of the namespace's URIs by last access (ms); `P<ns>:used`
  the namespace's object bytes. `capacity_bytes` bounds each namespace: a put evicts only objects
  of its own namespace, so a drafter's draft rows never push out a verifier's target KV.
- A commit log is split by writer: `P log:c:<uri>` the commit records (a list) and `P log:cm:<uri>`
  {n, gen, maxe} are the verifiers'; `P log:f:<uri>` the fence records, each stored as
  `<commit records before it>:<CBOR>`, and `P log:fm:<uri>` {k, gen, fence, maxe} are the routers'.
  A read merges the two lists by those positions into the log's one sequence; the ETag is
  `"<records>-<generations>"`. The append script writes only the verifiers' keys and reads the
  fence state; the fence script writes only the routers' keys and reads the commit count.

Every check-and-write is one Lua script, atomic on the server. Keys a script writes are declared
(KEYS), so a caller without write access is refused before the script starts; the other side's keys
a log script only reads are computed from its arguments, which one Redis server (not Redis Cluster)
allows. Redis >= 7 checks each command of a script against the caller's ACL user, so with one user
per role (`sdcp.cache.redis_acl`) the server, not this code, decides who appends, who fences and who
writes which kind: a refusal is `AccessDenied`.
"""

from __future__ import annotations

import functools
import inspect
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from sdcp.cache.commitlog import (
    EMPTY_LOG_ETAG,
    CommitLog,
    LogSnapshot,
    decode_record,
    encode_record,
    fence_record,
)
from sdcp.cache.errors import (
    AccessDenied,
    CacheFull,
    CorruptRecord,
    Fenced,
    InvalidArgument,
    InvalidURI,
    LeaseNotHeld,
    ObjectNotFound,
    ObjectTooLarge,
    PreconditionFailed,
    StoreUnavailable,
)
from sdcp.cache.redis_acl import COMMITS, COMMITS_META, FENCES, FENCES_META, RedisAccess, namespace_of_kind, writes
from sdcp.cache.tiers import CachedObject
from sdcp.cache.uri import parse_uri

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

# KEYS: object, lru, used (of one namespace). ARGV: uri, data, etag, if_match ('' = none, 'absent' =
# only where no object is: ABSENT_ETAG),
# capacity (-1 = none), namespace prefix (victims are of the same namespace only).
_PUT = (
    _NOW_MS
    + _LIVE_LEASE
    + """
local current = redis.call('HGET', KEYS[1], 'e')
if ARGV[4] ~= '' and (current or 'absent') ~= ARGV[4] then return 'PRECONDITION' end
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

# KEYS: object, lru, used, lease. ARGV: uri. Its commands are all a router's user may send to the
# `target-kv` keys it cleans up (sdcp.cache.redis_acl): reads, DEL, DECRBY and ZREM, never a write.
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

# ARGV: lease key (only read, so not declared: readers without write access may ask).
# Returns the holders of live leases.
_HOLDERS = (
    _NOW_MS
    + """
local fields = redis.call('HGETALL', ARGV[1])
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

# The state of both halves of a log and its ETag, shared by the append and the fence scripts.
# c, cm: the commit records' keys; f, fm: the fences' keys.
_LOG_STATE = """
local function log_state(cm, fm)
  local meta = redis.call('HMGET', cm, 'n', 'gen', 'maxe')
  local fmeta = redis.call('HMGET', fm, 'k', 'gen', 'fence', 'maxe')
  return {
    n = tonumber(meta[1] or '0'), cgen = meta[2] or '', cmaxe = tonumber(meta[3] or '-1'),
    k = tonumber(fmeta[1] or '0'), fgen = fmeta[2] or '', fence = tonumber(fmeta[3] or '-1'),
    fmaxe = tonumber(fmeta[4] or '-1')
  }
end
local function etag(s)
  local count = s.n + s.k
  if count == 0 then return '"0"' end
  return '"' .. count .. '-' .. s.cgen .. s.fgen .. '"'
end
"""

# The verifiers' append. KEYS: commits, commits meta (written). ARGV: payload, epoch, if_match,
# is_fence, new generation, fences, fences meta (the fences' keys are only read, except by a
# fence-shaped record, which is a fence and is stored with them: a user that may not fence is
# refused at its first write, before anything changed).
# SDCP 6.8: the fence check, the If-Match check and the append are one atomic step.
_APPEND = (
    _LOG_STATE
    + """
local s = log_state(KEYS[2], ARGV[7])
local epoch = tonumber(ARGV[2])
if epoch < s.fence then return {'FENCED', tostring(s.fence)} end
if ARGV[3] ~= etag(s) then return {'PRECONDITION', etag(s)} end
if ARGV[4] == '1' then
  if s.fgen == '' then s.fgen = ARGV[5] end
  redis.call('RPUSH', ARGV[6], s.n .. ':' .. ARGV[1])
  s.k = s.k + 1
  local fence, maxe = math.max(s.fence, epoch), math.max(s.fmaxe, epoch)
  redis.call('HSET', ARGV[7], 'k', s.k, 'gen', s.fgen, 'fence', fence, 'maxe', maxe)
else
  if s.cgen == '' then s.cgen = ARGV[5] end
  redis.call('RPUSH', KEYS[1], ARGV[1])
  s.n = s.n + 1
  redis.call('HSET', KEYS[2], 'n', s.n, 'gen', s.cgen, 'maxe', math.max(s.cmaxe, epoch))
end
return {'OK', etag(s)}
"""
)

# The routers' fence. KEYS: fences, fences meta (written). ARGV: payload, epoch, new generation,
# commits meta (only read).
_FENCE = (
    _LOG_STATE
    + """
local s = log_state(ARGV[4], KEYS[2])
local epoch = tonumber(ARGV[2])
local maxe = math.max(s.cmaxe, s.fmaxe)
if epoch < maxe then return {'FENCED', tostring(maxe)} end
if epoch == s.fence then return {'OK', etag(s)} end
if s.fgen == '' then s.fgen = ARGV[3] end
redis.call('RPUSH', KEYS[1], s.n .. ':' .. ARGV[1])
s.k = s.k + 1
redis.call('HSET', KEYS[2], 'k', s.k, 'gen', s.fgen, 'fence', epoch, 'maxe', epoch)
return {'OK', etag(s)}
"""
)


def _etag_of(count: int, gen: str) -> str:
    return EMPTY_LOG_ETAG if count == 0 else f'"{count}-{gen}"'


def _text(value: bytes | str | None) -> str:
    return "" if value is None else value.decode() if isinstance(value, bytes) else value


_P = ParamSpec("_P")
_R = TypeVar("_R")
# A connection the pool kept across a Redis restart fails once: it is opened again and the command
# repeated, twice at most within a quarter second. A timeout is not repeated (Redis is there but
# slow or stopped). Past that, or with Redis down, StoreUnavailable.
_RETRY = Retry(ExponentialBackoff(cap=0.2, base=0.05), 2, supported_errors=(RedisConnectionError,))
# How Redis words a refusal by the caller's ACL user inside a script (outside one: NoPermissionError).
_SCRIPT_REFUSALS = ("NOPERM", "The user executing the script can't")


def _unavailable_on_redis_errors(
    method: Callable[_P, Coroutine[Any, Any, _R]],
) -> Callable[_P, Coroutine[Any, Any, _R]]:
    @functools.wraps(method)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await method(*args, **kwargs)
        except (NoPermissionError, AuthenticationError) as exc:
            raise AccessDenied(f"redis refused this user: {exc}") from exc
        except ResponseError as exc:
            if any(refusal in str(exc) for refusal in _SCRIPT_REFUSALS):
                raise AccessDenied(f"redis refused this user: {exc}") from exc
            raise StoreUnavailable(f"redis: {exc}") from exc
        except RedisError as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc

    return call


def connect(url: str, access: RedisAccess | None = None) -> aioredis.Redis:
    """A client for `url` with the user, password and TLS files of `access` (the URL's own
    credentials are used where `access` names none)."""
    access = access or RedisAccess()
    options: dict[str, Any] = {}
    if access.username is not None:
        options["username"] = access.username
    if access.password is not None:
        options["password"] = access.password
    if access.ca is not None:
        options["ssl_ca_certs"] = access.ca
    if access.cert is not None:
        options["ssl_certfile"] = access.cert
    if access.key is not None:
        options["ssl_keyfile"] = access.key
    if options.keys() & {"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"} and not url.startswith("rediss://"):
        raise InvalidArgument("Redis TLS files need a rediss:// URL")
    # No CLIENT SETINFO on connecting: the roles' users may not send it (sdcp.cache.redis_acl),
    # and a refusal would fill the server's ACL LOG. redis-py < 7 names the switch differently.
    if "driver_info" in inspect.signature(aioredis.Redis.__init__).parameters:
        options.update(driver_info=None)
    else:
        options.update(lib_name=None, lib_version=None)
    return aioredis.Redis.from_url(url, decode_responses=False, retry=_RETRY, **options)


class RedisStore:
    """Shared store on Redis; `capacity_bytes=None` leaves the bound to the server's own maxmemory,
    otherwise it bounds each namespace's objects (see the module doc)."""

    def __init__(
        self,
        url: str,
        capacity_bytes: int | None = None,
        prefix: str = "sdcp:mlc:",
        access: RedisAccess | None = None,
    ) -> None:
        self.name = "redis"
        self.capacity_bytes = capacity_bytes
        self.prefix = prefix
        # Only the namespaces its user may write get their recency refreshed by this store's reads.
        self.role = access.role if access is not None else None
        self.client: aioredis.Redis = connect(url, access)
        self._put = self.client.register_script(_PUT)
        self._delete = self.client.register_script(_DELETE)
        self._lease = self.client.register_script(_LEASE)
        self._release = self.client.register_script(_RELEASE)
        self._holders = self.client.register_script(_HOLDERS)
        self.append_script = self.client.register_script(_APPEND)
        self.fence_script = self.client.register_script(_FENCE)

    @staticmethod
    def namespace(uri: str) -> str:
        """The namespace of an object: its kind's, or `other` for a name outside our grammar."""
        try:
            kind: str | None = parse_uri(uri).kind
        except InvalidURI:
            kind = None
        return namespace_of_kind(kind)

    def _object_keys(self, uri: str) -> tuple[str, str, str, str]:
        """The object, lease, lru and used keys of `uri`'s namespace."""
        space = f"{self.prefix}{self.namespace(uri)}:"
        return f"{space}o:{uri}", f"{space}l:{uri}", f"{space}lru", f"{space}used"

    def log_key(self, part: str, uri: str) -> str:
        """A commit log's key: `part` is `log:c`, `log:cm`, `log:f` or `log:fm` (module doc)."""
        return f"{self.prefix}{part}:{uri}"

    @_unavailable_on_redis_errors
    async def head(self, uri: str) -> str | None:
        etag: bytes | str | None = await self.client.hget(self._object_keys(uri)[0], "e")
        return etag.decode() if isinstance(etag, bytes) else etag

    @_unavailable_on_redis_errors
    async def fetch(self, uri: str) -> CachedObject | None:
        key, _, lru, _ = self._object_keys(uri)
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hmget(key, "d", "e")
            if writes(self.role, self.namespace(uri)):
                pipe.zadd(lru, {uri: time.time() * 1000}, xx=True)
            (data, etag), *_ = await pipe.execute()
        if data is None or etag is None:
            return None
        return CachedObject(uri, data, etag.decode())

    @_unavailable_on_redis_errors
    async def store(self, obj: CachedObject, if_match: str | None) -> None:
        if self.capacity_bytes is not None and len(obj.data) > self.capacity_bytes:
            raise ObjectTooLarge(f"{len(obj.data)} bytes exceed the redis capacity {self.capacity_bytes}")
        key, _, lru, used = self._object_keys(obj.uri)
        capacity = -1 if self.capacity_bytes is None else self.capacity_bytes
        space = f"{self.prefix}{self.namespace(obj.uri)}:"
        args: list[str | bytes | int] = [obj.uri, obj.data, obj.etag, if_match or "", capacity, space]
        outcome = await self._put(keys=[key, lru, used], args=args)
        if outcome == b"PRECONDITION":
            raise PreconditionFailed(f"{obj.uri}: If-Match {if_match} is not the current ETag")
        if outcome == b"FULL":
            raise CacheFull(f"redis: no room for {obj.uri}, the remaining objects are leased")

    @_unavailable_on_redis_errors
    async def remove(self, uri: str) -> bool:
        key, lease, lru, used = self._object_keys(uri)
        return bool(await self._delete(keys=[key, lru, used, lease], args=[uri]))

    @_unavailable_on_redis_errors
    async def lease(self, uri: str, holder: str, ttl_s: float) -> float:
        key, lease, _, _ = self._object_keys(uri)
        expires = await self._lease(keys=[key, lease], args=[holder, _ms(ttl_s), "take"])
        if expires < 0:
            raise ObjectNotFound(uri)
        return int(expires) / 1000

    @_unavailable_on_redis_errors
    async def renew(self, uri: str, holder: str, ttl_s: float) -> float:
        key, lease, _, _ = self._object_keys(uri)
        expires = await self._lease(keys=[key, lease], args=[holder, _ms(ttl_s), "renew"])
        if expires < 0:
            raise LeaseNotHeld(f"{holder} holds no lease on {uri}")
        return int(expires) / 1000

    @_unavailable_on_redis_errors
    async def release(self, uri: str, holder: str) -> bool:
        return bool(await self._release(keys=[self._object_keys(uri)[1]], args=[holder]))

    @_unavailable_on_redis_errors
    async def lease_holders(self, uri: str) -> frozenset[str]:
        holders = await self._holders(keys=[], args=[self._object_keys(uri)[1]])
        return frozenset(holder.decode() if isinstance(holder, bytes) else str(holder) for holder in holders)

    @_unavailable_on_redis_errors
    async def ping(self) -> None:
        """Whether the server takes this process's user now: AccessDenied where it refuses it (a
        user gone after a restart that did not keep it), StoreUnavailable where it is unreachable."""
        await self.client.ping()

    def commit_log(self, uri: str) -> CommitLog:
        return RedisCommitLog(uri, self)

    async def close(self) -> None:
        await self.client.aclose()


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class RedisCommitLog(CommitLog):
    """Commit log as two Redis lists, the verifiers' commit records and the routers' fences (module
    doc); ETag `"<count>-<generations>"`, the generations random per log."""

    def __init__(self, uri: str, store: RedisStore) -> None:
        super().__init__(uri)
        self._store = store
        self._commits = store.log_key(COMMITS, uri)
        self._commits_meta = store.log_key(COMMITS_META, uri)
        self._fences = store.log_key(FENCES, uri)
        self._fences_meta = store.log_key(FENCES_META, uri)

    @_unavailable_on_redis_errors
    async def read(self) -> LogSnapshot:
        async with self._store.client.pipeline(transaction=True) as pipe:
            pipe.lrange(self._commits, 0, -1)
            pipe.hmget(self._commits_meta, "n", "gen")
            pipe.lrange(self._fences, 0, -1)
            pipe.hmget(self._fences_meta, "k", "gen")
            commits, (count, cgen), fences, (fence_count, fgen) = await pipe.execute()
        payloads = list(commits)
        # Each fence goes before the commit record that followed it: its position is the number of
        # commit records there were when it was appended. Inserting from the last keeps positions.
        placed: list[tuple[int, bytes]] = []
        for index, entry in enumerate(fences):
            where, sep, payload = bytes(entry).partition(b":")
            if not sep or not where.isdigit() or int(where) > len(commits):
                raise CorruptRecord(f"{self.uri} fence {index}: not <position>:<record>")
            placed.append((int(where), payload))
        for position, payload in reversed(placed):
            payloads.insert(position, payload)
        records = [decode_record(payload, f"{self.uri} record {index}") for index, payload in enumerate(payloads)]
        total = int(count or 0) + int(fence_count or 0)
        return LogSnapshot(records, _etag_of(total, _text(cgen) + _text(fgen)))

    @_unavailable_on_redis_errors
    async def read_from(self, start: int) -> LogSnapshot:
        """The records from index `start` of the merged log on, reading only the commit records
        from the first of them (a router replaying a long log reads what is new): the fences, few,
        are read whole to place them; the commit records past the count read with them are left
        out, so that the records are exactly the version the ETag names."""
        async with self._store.client.pipeline(transaction=True) as pipe:
            pipe.hmget(self._commits_meta, "n", "gen")
            pipe.lrange(self._fences, 0, -1)
            pipe.hget(self._fences_meta, "gen")
            (count, cgen), fences, fgen = await pipe.execute()
        commits = int(count or 0)
        # Fence i goes before the commit record that followed it: merged index position + i.
        fence_at: dict[int, bytes] = {}
        for index, entry in enumerate(fences):
            where, sep, payload = bytes(entry).partition(b":")
            if not sep or not where.isdigit() or int(where) > commits:
                raise CorruptRecord(f"{self.uri} fence {index}: not <position>:<record>")
            fence_at[int(where) + index] = payload
        first_commit = start - sum(1 for merged in fence_at if merged < start)
        tail: list[bytes] = []
        if first_commit < commits:
            async with self._store.client.pipeline(transaction=False) as pipe:
                pipe.lrange(self._commits, first_commit, commits - 1)
                (tail,) = await pipe.execute()
        following = iter(tail)
        total = commits + len(fences)
        records = [
            decode_record(fence_at[merged] if merged in fence_at else next(following), f"{self.uri} record {merged}")
            for merged in range(start, total)
        ]
        return LogSnapshot(records, _etag_of(total, _text(cgen) + _text(fgen)))

    @_unavailable_on_redis_errors
    async def append(self, record: dict[str, Any], if_match: str) -> str:
        payload, epoch, fence_shaped = encode_record(record)
        outcome, detail = await self._store.append_script(
            keys=[self._commits, self._commits_meta],
            args=[
                payload,
                epoch,
                if_match,
                "1" if fence_shaped else "0",
                secrets.token_hex(8),
                self._fences,
                self._fences_meta,
            ],
        )
        return self._outcome(outcome, detail, epoch, if_match)

    @_unavailable_on_redis_errors
    async def fence(self, epoch: int, verifier: str | None = None) -> str:
        payload, _, _ = encode_record(fence_record(epoch, verifier))
        outcome, detail = await self._store.fence_script(
            keys=[self._fences, self._fences_meta],
            args=[payload, epoch, secrets.token_hex(8), self._commits_meta],
        )
        return self._outcome(outcome, detail, epoch, "")

    def _outcome(self, outcome: bytes, detail: bytes, epoch: int, if_match: str) -> str:
        text = str(detail.decode())
        if outcome == b"FENCED":
            raise Fenced(f"{self.uri}: log carries epoch {text}; record has epoch {epoch}")
        if outcome == b"PRECONDITION":
            raise PreconditionFailed(f"{self.uri}: If-Match {if_match} is not the current ETag {text}")
        return text
