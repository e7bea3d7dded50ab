"""ASGI helpers for SDCP services (starlette): bodies, problem responses, authorization.

hypercorn 0.18's HTTP/2 path drops the whole connection, with every stream on it, when request
body data arrives for a stream that has already been answered (a KeyError in its h2 handling).
``DrainRequestBody``, which the front end's server installs, therefore reads whatever is left of the
request body before the response starts, on every path (403, 404, 413, 415, handlers that ignore
the body), and ``read_cbor_body`` reads the whole body before it raises. The mTLS server drops an
unread body itself.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sdcp.protocol.codec import DEFAULT_MAX_SIZE, MEDIA_TYPE, decode, encode
from sdcp.protocol.problems import PROBLEM_MEDIA_TYPE, ProtocolError
from sdcp.transport.errors import (
    Forbidden,
    HTTPProblem,
    InternalServerError,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from sdcp.transport.peer import peer_uri

__all__ = [
    "DrainRequestBody",
    "PeerPolicy",
    "Problem",
    "cbor_response",
    "exception_handlers",
    "problem_body",
    "problem_response",
    "read_cbor_body",
    "require_peer",
]

_log = logging.getLogger(__name__)

PeerPolicy = set[str] | frozenset[str] | Callable[[str], bool] | Callable[[str], Awaitable[bool]]


class Problem(Protocol):
    """Anything that answers as an RFC 9457 problem: ProtocolError and HTTPProblem."""

    status: int

    def to_problem(self) -> dict[str, Any]: ...


def cbor_response(obj: object, status: int = 200) -> Response:
    """A response whose body is ``obj`` in deterministic CBOR (SDCP 5.1 media type)."""
    return Response(content=encode(obj), status_code=status, media_type=MEDIA_TYPE)


def problem_body(err: Problem) -> bytes:
    """The ``application/problem+json`` body (RFC 9457) for ``err``."""
    return json.dumps(err.to_problem(), separators=(",", ":")).encode("utf-8")


def problem_response(err: Problem) -> Response:
    """An ``application/problem+json`` response (RFC 9457) for ``err``, with Retry-After if it says."""
    response = Response(content=problem_body(err), status_code=err.status, media_type=PROBLEM_MEDIA_TYPE)
    retry_after = getattr(err, "retry_after_s", None)
    if retry_after is not None:
        response.headers["retry-after"] = str(retry_after)
    return response


async def read_cbor_body(request: Request, *, max_size: int = DEFAULT_MAX_SIZE) -> object:
    """The decoded CBOR body of ``request``; the whole body is read before any error is raised.

    Raises ``UnsupportedMediaType`` (415) for another Content-Type, ``PayloadTooLarge`` (413) past
    ``max_size`` bytes, and the codec's ``BadMessage`` (400) for a body that is not SDCP CBOR.
    """
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != MEDIA_TYPE:
        await _discard_body(request)
        raise UnsupportedMediaType(f"request body must be {MEDIA_TYPE}, not {media_type or 'absent'}")
    declared = _declared_length(request)
    if declared is not None and declared > max_size:
        await _discard_body(request)
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds {max_size} bytes")
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        # Past the limit, keep reading (see module doc) but stop keeping the bytes.
        if received <= max_size:
            chunks.append(chunk)
    if received > max_size:
        raise PayloadTooLarge(f"request body exceeds {max_size} bytes")
    return decode(b"".join(chunks), max_size=max_size)


async def require_peer(request: Request, allowed: PeerPolicy) -> str:
    """The authenticated peer URI of ``request`` if ``allowed`` admits it; otherwise ``Forbidden``.

    ``allowed`` is a set of base URIs or a (sync or async) predicate on the peer URI. Services that
    answer with an SDCP problem type instead (``sdcp-not-assigned``, SDCP 6.3) check ``peer_uri``
    themselves.
    """
    # The refusal leaves before the body is read: the mTLS server drops the rest of it, the front
    # end's DrainRequestBody reads it before the 403 starts.
    uri = peer_uri(request)
    if uri is None:
        raise Forbidden("no authenticated client certificate with a URI SAN")
    if isinstance(allowed, (set, frozenset)):
        admitted = uri in allowed
    else:
        verdict = allowed(uri)
        admitted = bool(await verdict) if inspect.isawaitable(verdict) else bool(verdict)
    if not admitted:
        raise Forbidden(f"{uri} is not allowed here")
    return uri


def exception_handlers() -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """Starlette ``exception_handlers``: every error leaves as a problem response.

    Unexpected exceptions become a 500 problem that names no internals; the traceback goes to the
    log only.
    """

    async def on_problem(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, (ProtocolError, HTTPProblem))
        return problem_response(exc)

    async def on_http_exception(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        response = problem_response(HTTPProblem.for_status(exc.status_code, exc.detail))
        response.headers.update(exc.headers or {})
        return response

    async def on_disconnect(_request: Request, _exc: Exception) -> Response:
        # Nobody reads this answer; it only ends the exchange without logging a server fault.
        return problem_response(HTTPProblem.for_status(400, "client disconnected"))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        _log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return problem_response(InternalServerError())

    return {
        ProtocolError: on_problem,
        HTTPProblem: on_problem,
        HTTPException: on_http_exception,
        ClientDisconnect: on_disconnect,
        Exception: on_unexpected,
    }


class DrainRequestBody:
    """Reads the rest of the request body before the response starts (see module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_complete = False

        async def tracking_receive() -> Message:
            nonlocal body_complete
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_complete = True
            return message

        async def draining_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                while not body_complete:
                    await tracking_receive()
            await send(message)

        await self.app(scope, tracking_receive, draining_send)


async def _discard_body(request: Request) -> None:
    async for _chunk in request.stream():
        pass


def _declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None
