"""A remote MLC node (`sdcp.services.mlc`) as the shared store of a local `MLC` (SDCP 1.4, 6.8).

`RemoteStore` implements the `SharedStore` protocol over the node's HTTP/2 + mTLS resources with one
pooled `SDCPClient`, and `RemoteCommitLog` the `CommitLog` ABC. Problem answers are mapped back to
the cache's own errors (`sdcp.cache.wire`), so callers see exactly the exceptions an embedded store
raises.

Transport failures (`sdcp.transport.errors.TransportError`) and other statuses pass through.
Objects travel as raw `application/octet-stream` bodies: q rows are ~200 KB each.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sdcp.cache.commitlog import CommitLog, LogSnapshot, encode_record, fence_record
from sdcp.cache.errors import (
    CorruptRecord,
    InvalidArgument,
    ObjectNotFound,
)
from sdcp.cache.tiers import CachedObject
from sdcp.cache.wire import LEASE_ERRORS, LOG_ERRORS, OBJECT_ERRORS, ErrorMap
from sdcp.protocol.problems import ProtocolError
from sdcp.transport.client import SDCPClient
from sdcp.transport.errors import PeerServerError, StatusError, UnexpectedResponse

__all__ = ["RemoteCommitLog", "RemoteStore"]

PathLike = str | os.PathLike[str]
_T = TypeVar("_T")


@contextmanager
def _cache_errors(errors: ErrorMap) -> Iterator[None]:
    """Re-raise the node's problem answers as the cache errors they stand for."""
    try:
        yield
    except ProtocolError as error:
        mapped = errors.get(error.status)
        if mapped is None:
            raise
        raise mapped(error.detail) from error
    except StatusError as error:
        problem = error.problem or {}
        if isinstance(error, PeerServerError) and problem.get("cache_error") == CorruptRecord.__name__:
            raise CorruptRecord(error.detail) from error
        mapped = errors.get(error.status)
        if mapped is None:
            raise
        raise mapped(error.detail) from error


class RemoteStore:
    """The shared store of an MLC node reached at `base_uri` (its base URI, `https://...`)."""

    name = "remote"

    def __init__(self, base_uri: str, *, cert: PathLike, key: PathLike, ca: PathLike) -> None:
        try:
            self.client = SDCPClient(base_uri, Path(cert), Path(key), Path(ca))
        except ValueError as error:
            raise InvalidArgument(f"mlc_url: {error}") from error
        self.base_uri = base_uri

    async def head(self, uri: str) -> str | None:
        try:
            with _cache_errors(OBJECT_ERRORS):
                response = await self.client.head("objects", {"uri": uri})
        except ObjectNotFound:
            return None
        return _etag_of(response.headers, self.base_uri)

    async def fetch(self, uri: str) -> CachedObject | None:
        try:
            with _cache_errors(OBJECT_ERRORS):
                response = await self.client.get_bytes("objects", {"uri": uri})
        except ObjectNotFound:
            return None
        return CachedObject(uri, response.content, _etag_of(response.headers, self.base_uri))

    async def store(self, obj: CachedObject, if_match: str | None) -> None:
        headers = {} if if_match is None else {"if-match": if_match}
        with _cache_errors(OBJECT_ERRORS):
            # A repeated conditional PUT that had succeeded would fail its own precondition.
            await self.client.put_bytes(
                "objects", obj.data, {"uri": obj.uri}, headers=headers, idempotent=if_match is None
            )

    async def remove(self, uri: str) -> bool:
        try:
            with _cache_errors(OBJECT_ERRORS):
                await self.client.delete("objects", {"uri": uri})
        except ObjectNotFound:
            return False
        return True

    async def lease(self, uri: str, holder: str, ttl_s: float) -> float:
        return await self._lease_call("leases", uri, holder, ttl_s)

    async def renew(self, uri: str, holder: str, ttl_s: float) -> float:
        return await self._lease_call("leases/renew", uri, holder, ttl_s)

    async def _lease_call(self, path: str, uri: str, holder: str, ttl_s: float) -> float:
        # Whole milliseconds, rounded up so that a short lease never becomes a zero one.
        request = {"uri": uri, "holder": holder, "ttl_ms": max(1, math.ceil(ttl_s * 1000))}
        with _cache_errors(LEASE_ERRORS):
            _, body = await self.client.post_cbor(path, request, idempotent=True)
        expires_ms = _member(body, "expires_ms", int, self.base_uri)
        return expires_ms / 1000

    async def release(self, uri: str, holder: str) -> bool:
        with _cache_errors(LEASE_ERRORS):
            _, body = await self.client.post_cbor("leases/release", {"uri": uri, "holder": holder}, idempotent=True)
        return _member(body, "released", bool, self.base_uri)

    async def lease_holders(self, uri: str) -> frozenset[str]:
        with _cache_errors(LEASE_ERRORS):
            _, body = await self.client.get_cbor("leases", {"uri": uri})
        holders = _member(body, "holders", list, self.base_uri)
        return frozenset(holder for holder in holders if isinstance(holder, str))

    def commit_log(self, uri: str) -> CommitLog:
        return RemoteCommitLog(uri, self.client)

    async def close(self) -> None:
        await self.client.aclose()


class RemoteCommitLog(CommitLog):
    """A commit log kept by an MLC node; the node applies the rules of `sdcp.cache.commitlog`."""

    def __init__(self, uri: str, client: SDCPClient) -> None:
        super().__init__(uri)
        self.client = client

    async def read(self) -> LogSnapshot:
        return await self.read_from(0)

    async def read_from(self, start: int) -> LogSnapshot:
        with _cache_errors(LOG_ERRORS):
            _, body = await self.client.get_cbor("logs", {"uri": self.uri, "from": str(start)})
        records = _member(body, "records", list, self.client.base_uri)
        etag = _member(body, "etag", str, self.client.base_uri)
        if not isinstance(body, dict) or body.get("from") != start:
            records = records[start:]  # a node that does not take `from` answers the whole log
        where = f"{self.client.base_uri} log {self.uri}"
        # Through the same check as a record read from disk: a map with an integer epoch.
        checked = [_checked_record(record, f"{where} record {i}") for i, record in enumerate(records, start)]
        return LogSnapshot(checked, etag)

    async def append(self, record: dict[str, Any], if_match: str) -> str:
        encode_record(record)  # InvalidRecord here, as with a local log, before anything is sent
        with _cache_errors(LOG_ERRORS):
            # Not repeated after a lost connection: an append that had landed would then fail as
            # PreconditionFailed and the verifier would take its own commit for a lost race.
            _, body = await self.client.post_cbor(
                "logs/append", record, params={"uri": self.uri}, headers={"if-match": if_match}
            )
        return _member(body, "etag", str, self.client.base_uri)

    async def fence(self, epoch: int, verifier: str | None = None) -> str:
        fence = fence_record(epoch, verifier)
        with _cache_errors(LOG_ERRORS):
            # Repeating a fence is harmless: a fence already the highest appends nothing.
            _, body = await self.client.post_cbor("logs/fence", fence, params={"uri": self.uri}, idempotent=True)
        return _member(body, "etag", str, self.client.base_uri)


def _checked_record(record: object, where: str) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("epoch"), int):
        raise CorruptRecord(f"{where}: not a map with an integer epoch")
    return record


def _etag_of(headers: Any, peer: str) -> str:
    etag = headers.get("etag")
    if not etag:
        raise UnexpectedResponse(f"{peer} answered an object request without an ETag")
    return str(etag)


def _member(body: object, name: str, kind: type[_T], peer: str) -> _T:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise UnexpectedResponse(f"{peer} answered without a valid {name!r}: {body!r}")
    return value
