"""A peer that this very process serves (`sdcp together`): its requests go to the peer's ASGI app
by a call, not over HTTP/2 and TLS.

Everything else is the exchange a remote peer gives: the same app answers (routes, authorization by
the caller's identity, problem details) behind its listener's limits (the request body's size, the
streams a caller has in flight: ``LocalGate``), and the caller reads the answer as ``SDCPClient``
reads one (statuses, problems, CBOR, size limits, timeouts). The identity the app sees is the one
the caller's certificate would carry over mTLS (its URI SAN), so that authorization is the
deployment's. What goes is TLS's encryption both ways, HTTP/2's framing and the socket: in one process
on two cores, the opens, assignments, events and status reports of the other roles came out of the
target's passes.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from starlette.types import ASGIApp, Message

from sdcp.protocol.problems import PROBLEM_MEDIA_TYPE
from sdcp.transport.asgi import problem_body
from sdcp.transport.client import PeerClients, SDCPClient
from sdcp.transport.errors import (
    ConnectionLost,
    HTTPProblem,
    InternalServerError,
    PayloadTooLarge,
    PeerTimeout,
    UnexpectedResponse,
)
from sdcp.transport.h2conn import H2Response
from sdcp.transport.h2server import DEFAULT_MAX_BODY_BYTES, http_scope
from sdcp.transport.peer import PeerTLS
from sdcp.transport.server import DEFAULT_MAX_CONCURRENT_STREAMS

__all__ = ["LocalGate", "LocalPeer", "serve_locally"]

log = logging.getLogger(__name__)


class LocalGate:
    """What a peer's listener does for its streams, done for the calls of its own process: once the
    peer stops, a new call is refused (as a closed listener refuses a connection), and those in
    flight may finish before the peer stops its engine (as the listener drains its streams). A
    request body past ``max_body_bytes`` is answered 413 without reaching the app, and a caller has
    at most ``max_concurrent_streams`` calls in flight at once, the next waiting for one to end, as
    over its connection to the listener (sdcp.transport.h2server)."""

    def __init__(
        self,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
    ) -> None:
        self.max_body_bytes = max_body_bytes
        self.max_concurrent_streams = max_concurrent_streams
        self._closed = False
        self._in_flight: set[asyncio.Task[None]] = set()

    def admit(self, base_uri: str) -> None:
        if self._closed:
            raise ConnectionLost(f"{base_uri} is stopping: the call was not made")

    def track(self, answering: asyncio.Task[None]) -> None:
        # Held until it ends, as the listener holds a stream's task: one that runs on after its
        # answer is not collected midway.
        self._in_flight.add(answering)
        answering.add_done_callback(self._in_flight.discard)

    def close(self) -> None:
        """Refuse new calls."""
        self._closed = True

    async def drained(self, timeout_s: float) -> None:
        """Once the calls in flight have ended, or ``timeout_s`` has passed."""
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=timeout_s)


def serve_locally(peers: PeerClients, served: Mapping[str, tuple[ASGIApp, LocalGate]]) -> None:
    """From now on, ``peers`` ask each peer of ``served`` (base URI -> its ASGI app in this process
    and its gate, which stops taking calls) through its app, as the identity our certificate carries."""
    cert, key, ca = peers.credentials
    # What the peer's listener would learn of us over mTLS (TLS 1.3, h2).
    pem = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    tls = PeerTLS.from_certificate(pem.public_bytes(serialization.Encoding.DER), "TLSv1.3", "h2")
    for base_uri, (app, gate) in served.items():
        peers.add(LocalPeer(base_uri, app, gate, tls, cert, key, ca, **peers.options))


class LocalPeer(SDCPClient):
    """``SDCPClient`` of a peer served by ``app`` in this process behind ``gate``, the caller known
    to it as ``tls`` (the caller's certificate and identity, as its mTLS connection would tell them)."""

    CONNECTS = False

    def __init__(
        self, base_uri: str, app: ASGIApp, gate: LocalGate, tls: PeerTLS, *credentials: Any, **options: Any
    ) -> None:
        super().__init__(base_uri, *credentials, **options)
        self._app = app
        self._gate = gate
        # This caller's streams to the peer, as on its one connection to the listener.
        self._streams = asyncio.Semaphore(gate.max_concurrent_streams)
        self._tls = tls.asgi_extension()
        parts = urlsplit(base_uri)
        self._authority = parts.netloc.encode("ascii")
        self._server = (parts.hostname or "", parts.port or 443)

    @property
    def connected(self) -> bool:
        return not self._closed

    async def connect(self) -> None:
        """Nothing to open: the peer is in this process."""

    async def aclose(self) -> None:
        self._closed = True

    async def _deliver(
        self,
        method: str,
        path: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        idempotent: bool,
        timeout: float | None,
        max_size: int,
    ) -> H2Response:
        if self._closed:
            raise ConnectionLost(f"the client of {self.base_uri} is closed")
        self._gate.admit(self.base_uri)
        scope = http_scope(
            method,
            "https",
            target.encode("ascii"),
            [
                (b"host", self._authority),
                *headers,
                # As the HTTP/2 client declares a body's length (h2conn).
                *([(b"content-length", str(len(body)).encode("ascii"))] if body is not None else []),
            ],
            None,
            self._server,
            self._tls,
        )
        if body is not None and len(body) > self._gate.max_body_bytes:
            limit = self._gate.max_body_bytes
            return _listener_answer(PayloadTooLarge(f"request body of {len(body)} bytes exceeds {limit}"))
        exchange = _Exchange(body or b"", max_size, bodiless=method == "HEAD")
        answering: asyncio.Task[None] | None = None
        try:
            async with asyncio.timeout(self._timeout if timeout is None else timeout):
                await self._streams.acquire()
                # In a context of its own, as a task of the peer's listener would run: nothing of
                # the caller's context variables reaches the peer's handlers. The stream is held
                # until the handler returns, as the listener counts a stream's task.
                answering = asyncio.get_running_loop().create_task(
                    _answer(self._app, scope, exchange), context=contextvars.Context()
                )
                answering.add_done_callback(lambda _: self._streams.release())
                self._gate.track(answering)
                answering.add_done_callback(exchange.app_returned)
                response = await exchange.answer
        except TimeoutError as error:
            raise PeerTimeout(f"{method} {path} to {self.base_uri} timed out") from error
        except _TooLarge as error:
            raise UnexpectedResponse(f"{method} {path} to {self.base_uri}: {error}") from error
        finally:
            # The exchange is over: a handler that still waits for the body's end hears so. One
            # whose caller left before the whole answer came is cancelled, as a reset stream's is;
            # one that answered runs on (work it does after its answer, as behind a listener).
            exchange.leave()
            if not exchange.answered and answering is not None:
                answering.cancel()
        return response


def _listener_answer(problem: HTTPProblem) -> H2Response:
    """What the listener answers in the app's place: a refusal before the request reaches it, or
    the 500 for an app that failed without answering."""
    return H2Response(problem.status, {"content-type": PROBLEM_MEDIA_TYPE}, problem_body(problem))


async def _answer(app: ASGIApp, scope: dict[str, Any], exchange: _Exchange) -> None:
    await app(scope, exchange.receive, exchange.send)


class _TooLarge(Exception):
    pass


class _Exchange:
    """One request's body for the app, and the answer it sends back."""

    def __init__(self, body: bytes, max_size: int, *, bodiless: bool) -> None:
        self._body: bytes | None = body
        self._max_size = max_size
        # An answer to HEAD carries no content (RFC 9110 9.3.2), nor does a 204 or 304 (6.4.1).
        self._bodiless = bodiless
        self._left = asyncio.Event()
        self._status: int | None = None
        self._headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._size = 0
        self.answer: asyncio.Future[H2Response] = asyncio.get_running_loop().create_future()

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.answer.done():
            return
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            self._headers = {
                bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
                for name, value in message.get("headers", [])
            }
            return
        if message["type"] != "http.response.body" or self._status is None:
            return
        chunk = b"" if self._bodiless or self._status in (204, 304) else bytes(message.get("body", b""))
        self._size += len(chunk)
        if self._size > self._max_size:
            self.answer.set_exception(_TooLarge(f"response body exceeds {self._max_size} bytes"))
            return
        self._chunks.append(chunk)
        if not message.get("more_body", False):
            self.answer.set_result(H2Response(self._status, self._headers, b"".join(self._chunks)))

    def app_returned(self, answering: asyncio.Future[None]) -> None:
        """An app that returned or failed without completing its answer answers 500 with its
        problem body, as the server's listener does for it; a failure is logged as it logs one."""
        failure = None if answering.cancelled() else answering.exception()
        if failure is not None:
            log.error("unhandled error answering a request of this process", exc_info=failure)
        if not self.answer.done():
            self.answer.set_result(_listener_answer(InternalServerError()))

    @property
    def answered(self) -> bool:
        """Whether the whole answer came (not cut by its size)."""
        return self.answer.done() and not self.answer.cancelled() and self.answer.exception() is None

    def leave(self) -> None:
        self._left.set()
