"""The MLC over HTTP/2 + mTLS (SDCP 1.4, 6.8): one process's `MLC` served to instances elsewhere.

Resources, relative to the node's base URI; the object or log URI is the query parameter `uri`
(percent-encoded by the client), see docs/cache.md "MLC over HTTP":

| method and path          | body in                 | answer                                  |
|--------------------------|-------------------------|-----------------------------------------|
| `GET objects`            |                         | 200 raw octets, `ETag`                  |
| `HEAD objects`           |                         | 200, `ETag`                             |
| `PUT objects`            | raw octets, `If-Match`? | 201 created / 204 replaced, `ETag`      |
| `DELETE objects`         |                         | 204                                     |
| `POST leases`            | `{uri, holder, ttl_ms}` | `{expires_ms}`                          |
| `POST leases/renew`      | `{uri, holder, ttl_ms}` | `{expires_ms}`                          |
| `POST leases/release`    | `{uri, holder}`         | `{released}`                            |
| `GET logs`               |                         | `{records, etag}`                       |
| `POST logs/append`       | record, `If-Match`      | `{etag}`                                |
| `POST logs/fence`        | `{epoch, ?verifier}`    | `{etag}`                                |

Cache errors leave as problems (RFC 9457, type about:blank) whose status names them:
400 bad URI or argument, 403 lease holder other than the caller, 404 `ObjectNotFound`,
409 `Fenced` (logs) or `LeaseNotHeld` (leases), 412 `PreconditionFailed`, 413 `ObjectTooLarge`,
428 append without If-Match, 500 `CorruptRecord`, 507 `CacheFull`. Every problem also carries the
extension member `cache_error` with the error's class name, for operators and curl users.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sdcp.cache import (
    MLC,
    CacheError,
    CommitLog,
    InvalidArgument,
    InvalidRecord,
    InvalidURI,
    ObjectNotFound,
)
from sdcp.cache.uri import LOG_KIND, Q_ROWS_KIND, ROUTER_SESSION_KIND, TOKENS_KIND, check_ref, parse_uri
from sdcp.cache.wire import status_of
from sdcp.config import ConfigError, ServiceConfig
from sdcp.services.authz import Party
from sdcp.services.node import Node, build_mlc
from sdcp.transport.asgi import cbor_response, read_cbor_body
from sdcp.transport.errors import Forbidden, HTTPProblem, PayloadTooLarge, UnsupportedMediaType

__all__ = ["OCTETS", "CacheProblem", "MLCNode"]

OCTETS = "application/octet-stream"
# Commit-log handles kept open: a file log caches its parsed records, so reusing the handle saves
# re-reading the whole log on every append of a busy session.
_OPEN_LOGS = 1024
_V = TypeVar("_V")
_WRITERS_OF_FOREIGN_NAMES = (Party.ROUTER, Party.VERIFIER, Party.DRAFTER)


class CacheProblem(HTTPProblem):
    """A cache error as a problem answer; `cache_error` names the error class."""

    def __init__(self, error: CacheError) -> None:
        name = type(error).__name__
        status = status_of(error)
        super().__init__(f"{name}: {error}")
        template = HTTPProblem.for_status(status)
        self.status, self.title, self.error_name = status, template.title, name

    def to_problem(self) -> dict[str, Any]:
        return {**super().to_problem(), "cache_error": self.error_name}


class PreconditionRequired(HTTPProblem):
    status = 428
    title = "Precondition Required"


Handler = Callable[[Request], Awaitable[Response]]


def _translating(handler: Handler) -> Handler:
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except CacheError as error:
            raise CacheProblem(error) from error

    return endpoint


class MLCNode(Node):
    """Serves this process's MLC (disk or Redis shared store behind it) to the deployment's roles.

    Who may do what is the authorization table (sdcp.services.authz, docs/security.md), and within
    it: commit records come only from the verifier they name, and an epoch's records from one
    verifier; fences only from routers; draft rows (kind ``q-rows``) are written only by drafters,
    and only by the lease holder while a lease is live; committed-token objects and router sessions'
    durable facts (kind ``router-session``) only by routers; logs
    never through the object resources. A lease is taken, renewed and released only in the caller's
    own name, so a peer cannot drop another's protection.
    """

    role = "mlc"

    def __init__(self, config: ServiceConfig, mlc: MLC | None = None) -> None:
        if config.instance.router is not None:
            raise ConfigError(
                "an MLC node sends no status reports (status roles are drafter and verifier, SDCP 5.2): "
                "leave instance.router unset"
            )
        if config.mlc.mlc_url is not None and _same_base(config.mlc.mlc_url, config.instance.uri):
            raise ConfigError("an MLC node cannot use itself as its shared store (mlc.mlc_url is its own URI)")
        # A node stores every name sent to it: its clients' [mlc] authorities chose it for them.
        super().__init__(config, mlc if mlc is not None else build_mlc(config, store_every_authority=True))
        self._logs: OrderedDict[str, CommitLog] = OrderedDict()
        # Per log, the epoch and verifier of its latest commit record: who may append in that epoch.
        self._claims: OrderedDict[str, tuple[int, str]] = OrderedDict()

    @property
    def max_body_bytes(self) -> int:
        """An object of the largest size the store takes, with room for the request around it."""
        return self.mlc.max_object_bytes + (1 << 16)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/objects", self._head_object, methods=["HEAD"]),
            Route("/objects", _translating(self._get_object), methods=["GET"]),
            Route("/objects", _translating(self._put_object), methods=["PUT"]),
            Route("/objects", _translating(self._delete_object), methods=["DELETE"]),
            Route("/leases", _translating(self._lease_holders), methods=["GET"]),
            Route("/leases", _translating(self._lease), methods=["POST"]),
            Route("/leases/renew", _translating(self._renew), methods=["POST"]),
            Route("/leases/release", _translating(self._release), methods=["POST"]),
            Route("/logs", _translating(self._read_log), methods=["GET"]),
            Route("/logs/append", _translating(self._append), methods=["POST"]),
            Route("/logs/fence", _translating(self._fence), methods=["POST"]),
        ]

    # -- objects --------------------------------------------------------------------------------

    async def _head_object(self, request: Request) -> Response:
        # A HEAD answer carries no body, not even a problem (RFC 9110 9.3.2): errors are bare statuses.
        try:
            self.trust.admit(request, "HEAD objects")
            uri = _uri_param(request)
            etag = await self.mlc.shared.head(uri)
            if etag is None:
                raise ObjectNotFound(uri)
            response = Response(status_code=200, headers={"etag": etag})
        except CacheError as error:
            response = Response(status_code=CacheProblem(error).status)
        except HTTPProblem as problem:
            response = Response(status_code=problem.status)
        # The size is unknown without reading the object; Content-Length 0 would be wrong.
        del response.headers["content-length"]
        return response

    async def _get_object(self, request: Request) -> Response:
        self.trust.admit(request, "GET objects")
        data, info = await self.mlc.fetch(_uri_param(request))
        return Response(content=data, media_type=OCTETS, headers={"etag": info.etag})

    async def _put_object(self, request: Request) -> Response:
        caller = self.trust.admit(request, "PUT objects")
        uri = _uri_param(request)
        await self._check_object_writer(caller, uri)
        data = await _read_octets(request, self.mlc.max_object_bytes)
        if_match = request.headers.get("if-match")
        # Only the status code depends on this look-up; a creation racing it is reported as 204.
        created = if_match is None and await self.mlc.shared.head(uri) is None
        info = await self.mlc.put(uri, data, if_match=if_match)
        return Response(status_code=201 if created else 204, headers={"etag": info.etag})

    async def _delete_object(self, request: Request) -> Response:
        caller = self.trust.admit(request, "DELETE objects")
        uri = _uri_param(request)
        await self._check_object_writer(caller, uri)
        if not await self.mlc.delete(uri):
            raise ObjectNotFound(uri)
        return Response(status_code=204)

    async def _check_object_writer(self, caller: str, uri: str) -> None:
        """Who may write or delete an object, by its kind (see the class doc)."""
        kind = _kind(uri)
        if kind == LOG_KIND:
            raise Forbidden("commit logs change only through logs/append and logs/fence")
        if kind == Q_ROWS_KIND:
            if not self.trust.is_member(caller, Party.DRAFTER):
                raise Forbidden(f"{caller} is not a drafter: draft rows are the drafters'")
            holders = await self.mlc.lease_holders(uri)
            if holders and caller not in holders:
                raise Forbidden(f"{uri} is leased by another drafter")
        elif kind in (TOKENS_KIND, ROUTER_SESSION_KIND):
            if not self.trust.is_member(caller, Party.ROUTER):
                raise Forbidden(f"{caller} is not a router: {kind} objects are the routers'")
        elif kind is None:
            # Another implementation's name (SDCP 5.2 cache-ref): its kind is unknown, so any
            # deployment role may write it, and a lease keeps it its holder's.
            if not any(self.trust.is_member(caller, party) for party in _WRITERS_OF_FOREIGN_NAMES):
                raise Forbidden(f"{caller} is not a router, verifier or drafter of this deployment")
            holders = await self.mlc.lease_holders(uri)
            if holders and caller not in holders:
                raise Forbidden(f"{uri} is leased by another instance")
        elif not (self.trust.is_member(caller, Party.ROUTER) or self.trust.is_member(caller, Party.VERIFIER)):
            raise Forbidden(f"{caller} may not write {kind} objects")

    # -- leases ---------------------------------------------------------------------------------

    async def _lease_holders(self, request: Request) -> Response:
        self.trust.admit(request, "GET leases")
        return cbor_response({"holders": sorted(await self.mlc.lease_holders(_uri_param(request)))})

    async def _lease(self, request: Request) -> Response:
        uri, holder, ttl_s = await self._lease_request(request, "POST leases", with_ttl=True)
        lease = await self.mlc.lease(uri, holder, ttl_s)
        return cbor_response({"expires_ms": math.floor(lease.expires_at * 1000)})

    async def _renew(self, request: Request) -> Response:
        uri, holder, ttl_s = await self._lease_request(request, "POST leases/renew", with_ttl=True)
        lease = await self.mlc.renew(uri, holder, ttl_s)
        return cbor_response({"expires_ms": math.floor(lease.expires_at * 1000)})

    async def _release(self, request: Request) -> Response:
        uri, holder, _ = await self._lease_request(request, "POST leases/release", with_ttl=False)
        return cbor_response({"released": await self.mlc.release(uri, holder)})

    # -- commit logs (SDCP 6.8) -----------------------------------------------------------------

    def _log(self, uri: str) -> CommitLog:
        log = self._logs.get(uri) or self.mlc.commit_log(uri)
        self._remember(self._logs, uri, log)
        return log

    @staticmethod
    def _remember(cache: OrderedDict[str, _V], uri: str, value: _V) -> None:
        cache.pop(uri, None)
        cache[uri] = value
        while len(cache) > _OPEN_LOGS:
            cache.popitem(last=False)

    async def _lease_request(self, request: Request, endpoint: str, *, with_ttl: bool) -> tuple[str, str, float]:
        caller = self.trust.admit(request, endpoint)
        body = await read_cbor_body(request)
        if not isinstance(body, dict):
            raise InvalidArgument(f"a lease request is a map, got {type(body).__name__}")
        uri, holder, ttl_ms = body.get("uri"), body.get("holder"), body.get("ttl_ms")
        if not isinstance(uri, str):
            raise InvalidURI(f"a lease request names the object in uri (text), got {uri!r}")
        if not isinstance(holder, str) or not holder:
            raise InvalidArgument(f"a lease holder is a non-empty text, got {holder!r}")
        if holder != caller:
            raise Forbidden(f"{caller} may hold leases only in its own name, not as {holder}")
        if not with_ttl:
            return check_ref(uri), holder, 0.0
        if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0:
            raise InvalidArgument(f"ttl_ms is a positive integer, got {ttl_ms!r}")
        return check_ref(uri), holder, ttl_ms / 1000

    async def _read_log(self, request: Request) -> Response:
        """The log's records from index ``from`` (default 0) on, and the ETag of the whole log's
        version; ``from`` in the answer tells a client that the node took it."""
        self.trust.admit(request, "GET logs")
        start_text = request.query_params.get("from", "0")
        if not (start_text.isascii() and start_text.isdigit() and len(start_text) <= 10):
            raise InvalidArgument("'from' must be an unsigned integer")
        start = int(start_text)
        snapshot = await self._log(_uri_param(request)).read_from(start)
        response = cbor_response({"records": snapshot.records, "etag": snapshot.etag, "from": start})
        response.headers["etag"] = snapshot.etag
        return response

    async def _append(self, request: Request) -> Response:
        caller = self.trust.admit(request, "POST logs/append")
        uri = _uri_param(request)
        record = await read_cbor_body(request)
        if_match = request.headers.get("if-match")
        if if_match is None:
            # SDCP 6.8: a commit is a conditional append; an unconditional one could overwrite a race.
            raise PreconditionRequired("logs/append needs If-Match with the ETag of the version read")
        if not isinstance(record, dict):
            raise InvalidRecord(f"a record is a map, got {type(record).__name__}")
        epoch = record.get("epoch")
        if "writer" not in record:
            # We send `writer`; another verifier need not: the record is stored naming its caller,
            # so that the epoch stays claimed (docs/interpretations.md).
            record = {**record, "writer": caller}
        if record["writer"] != caller or not isinstance(epoch, int):
            raise Forbidden(f"{caller} may append only commit records that name it as their writer")
        log = self._log(uri)
        await self._check_claim(uri, log, epoch, caller)
        etag = await log.append(record, if_match)
        self._remember(self._claims, uri, (epoch, caller))
        return _etag_response(etag)

    async def _check_claim(self, uri: str, log: CommitLog, epoch: int, caller: str) -> None:
        """One verifier per epoch: the first commit record of an epoch claims it (SDCP 6.9 gives a
        new verifier a new epoch, after the router's fence)."""
        claim = self._claims.get(uri)
        if claim is None or claim[0] != epoch:
            records = (await log.read()).records
            writers = [r.get("writer") for r in records if r.get("epoch") == epoch and "writer" in r]
            claim = (epoch, str(writers[-1])) if writers else None
        if claim is not None and claim[1] != caller:
            raise Forbidden(f"epoch {epoch} of {uri} is written by another verifier")

    async def _fence(self, request: Request) -> Response:
        self.trust.admit(request, "POST logs/fence")
        uri = _uri_param(request)
        body = await read_cbor_body(request)
        fence = body if isinstance(body, dict) else {}
        epoch, verifier = fence.get("epoch"), fence.get("verifier")
        if (
            not isinstance(epoch, int)
            or isinstance(epoch, bool)
            or not set(fence) <= {"epoch", "verifier"}
            or not (verifier is None or isinstance(verifier, str))
        ):
            raise InvalidRecord(f"logs/fence takes {{epoch: uint, ? verifier: text}}, got {body!r}")
        # The verifier the router opens the epoch at: only its signed records count in it.
        return _etag_response(await self._log(uri).fence(epoch, verifier))


def _same_base(first: str, second: str) -> bool:
    return first.rstrip("/") == second.rstrip("/")


def _etag_response(etag: str) -> Response:
    response = cbor_response({"etag": etag})
    response.headers["etag"] = etag
    return response


def _kind(uri: str) -> str | None:
    """The kind of one of our own object URIs; None for a URI of another grammar."""
    try:
        return parse_uri(uri).kind
    except InvalidURI:
        return None


def _uri_param(request: Request) -> str:
    values = request.query_params.getlist("uri")
    if len(values) != 1:
        raise InvalidURI(f"exactly one query parameter uri= names the object, got {len(values)}")
    return check_ref(values[0])


async def _read_octets(request: Request, limit: int) -> bytes:
    """The raw body, at most `limit` bytes; the whole body is read even when it is refused."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received <= limit:
            chunks.append(chunk)
    if media_type != OCTETS:
        raise UnsupportedMediaType(f"object bodies are {OCTETS}, not {media_type or 'absent'}")
    if received > limit:
        raise PayloadTooLarge(f"object of {received} bytes exceeds the maximum object size {limit}")
    return b"".join(chunks)
