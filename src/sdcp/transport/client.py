"""HTTP/2 client for talking to one SDCP peer over mutual TLS (SDCP 5.1).

One ``SDCPClient`` per peer base URI holds one HTTP/2 connection (``sdcp.transport.h2conn``), opened
on first use and again after it is lost or the peer sends GOAWAY; all requests to the peer share it.
Answers are interpreted as SDCP defines them: 2xx bodies are CBOR, problem bodies become
``ProtocolError``, and other statuses are handled by class (RFC 9110).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, NoReturn
from urllib.parse import urlencode, urlsplit

from sdcp.protocol.codec import DEFAULT_MAX_SIZE, MEDIA_TYPE, decode, encode
from sdcp.protocol.problems import PROBLEM_MEDIA_TYPE, BadMessage, ProtocolError
from sdcp.transport.errors import (
    ClientCertificateRejected,
    ConnectionLost,
    PeerClientError,
    PeerServerError,
    PeerTimeout,
    TLSFailure,
    TransportError,
    UnexpectedResponse,
)
from sdcp.transport.h2conn import ConnectionClosed, H2Connection, H2Response, ResponseTooLarge, WrongServer
from sdcp.transport.tls import client_context

__all__ = ["CONNECT_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "BytesResponse", "PeerClients", "RetryPolicy", "SDCPClient"]

log = logging.getLogger("sdcp.transport")

CONNECT_TIMEOUT_S = 5.0
# The whole exchange, answer included: longer than any server-chosen wait of an output request.
DEFAULT_TIMEOUT_S = 30.0
# The longest octet answer taken (an MLC object of the default largest size): refused while it arrives.
DEFAULT_MAX_OBJECT_SIZE = 64 * 1024 * 1024
_OCTETS = "application/octet-stream"
# How long the certificate-refusal probe waits for the server's HTTP/2 preface.
_PROBE_TIMEOUT_S = 5.0
# After a request timed out, how long its connection has to acknowledge a PING before it is dropped:
# a loaded peer's event loop answers within this, a connection whose packets wait behind TCP's
# retransmission backoff does not.
PING_TIMEOUT_S = 3.0

PathLike = Path | str
Params = Mapping[str, str | int]


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with capped exponential backoff and full jitter."""

    attempts: int = 4
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("backoff must not be negative")

    def delay(self, retry_number: int) -> float:
        return random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2**retry_number))


@dataclass(frozen=True)
class BytesResponse:
    """A 2xx answer whose body is raw octets (MLC objects), with its headers."""

    status: int
    content: bytes
    headers: Mapping[str, str]


class SDCPClient:
    """A client for one peer, identified by its base URI.

    The peer's certificate must carry ``server_identity`` as its URI SAN, by default the base URI
    itself: checked when the TLS handshake completes, before a byte of HTTP/2 is sent, so that another
    instance with a certificate from the same CA cannot answer in the peer's place (docs/security.md).
    """

    # Whether it opens connections: a peer served in this process (sdcp.transport.local) is asked
    # by a call, and builds no TLS context it would never use.
    CONNECTS: ClassVar[bool] = True

    def __init__(
        self,
        base_uri: str,
        cert: PathLike,
        key: PathLike,
        ca: PathLike,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy = RetryPolicy(),
        max_response_size: int = DEFAULT_MAX_SIZE,
        max_object_size: int = DEFAULT_MAX_OBJECT_SIZE,
        server_identity: str | None = None,
    ) -> None:
        parts = urlsplit(base_uri)
        if parts.scheme != "https" or not parts.hostname:
            raise ValueError(f"peer base URI must be https://host[:port][/path], got {base_uri!r}")
        self.base_uri = base_uri
        self._host = parts.hostname
        self._port = parts.port or 443
        self._path_prefix = parts.path.rstrip("/") + "/"
        self._ssl_context = client_context(cert, key, ca) if self.CONNECTS else None
        self._timeout = timeout
        self._retry = retry
        self._max_response_size = max_response_size
        self._max_object_size = max_object_size
        self._server_identity = server_identity if server_identity is not None else base_uri
        self._peer_answered = False
        self._connection: H2Connection | None = None
        self._connecting = asyncio.Lock()
        self._closed = False
        # The PING in flight on each connection a request timed out on (at most one each).
        self._pings: dict[H2Connection, asyncio.Task[None]] = {}

    async def post_cbor(
        self,
        path: str,
        obj: object,
        *,
        idempotent: bool = False,
        timeout: float | None = None,
        params: Params | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, object | None]:
        """POST ``obj`` as CBOR. Pass ``idempotent=True`` for requests that may be repeated, such as
        proposals (SDCP 6.9: proposals and verdicts are idempotent per round)."""
        return await self._exchange(
            "POST", path, body=encode(obj), params=params, headers=headers, idempotent=idempotent, timeout=timeout
        )

    async def put_cbor(self, path: str, obj: object, *, timeout: float | None = None) -> tuple[int, object | None]:
        return await self._exchange("PUT", path, body=encode(obj), idempotent=True, timeout=timeout)

    async def get_cbor(
        self, path: str, params: Params | None = None, *, timeout: float | None = None
    ) -> tuple[int, object | None]:
        return await self._exchange("GET", path, params=params, idempotent=True, timeout=timeout)

    async def get_bytes(
        self,
        path: str,
        params: Params | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> BytesResponse:
        """GET a raw octet body (no CBOR): MLC objects such as q rows travel as they are."""
        return await self._exchange_bytes("GET", path, params=params, headers=headers, idempotent=True, timeout=timeout)

    async def put_bytes(
        self,
        path: str,
        data: bytes,
        params: Params | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        idempotent: bool = True,
        timeout: float | None = None,
    ) -> BytesResponse:
        """PUT a raw ``application/octet-stream`` body. A conditional PUT (If-Match) is not safe to
        repeat after a lost connection, since a repeat of a PUT that succeeded fails its
        precondition: pass ``idempotent=False`` for it."""
        return await self._exchange_bytes(
            "PUT",
            path,
            body=data,
            params=params,
            headers=headers,
            idempotent=idempotent,
            timeout=timeout,
            content_type=_OCTETS,
        )

    async def head(self, path: str, params: Params | None = None, *, timeout: float | None = None) -> BytesResponse:
        return await self._exchange_bytes("HEAD", path, params=params, idempotent=True, timeout=timeout)

    async def delete(self, path: str, params: Params | None = None, *, timeout: float | None = None) -> BytesResponse:
        """DELETE is idempotent in effect (RFC 9110 9.2.2), so it is retried like GET and PUT."""
        return await self._exchange_bytes("DELETE", path, params=params, idempotent=True, timeout=timeout)

    @property
    def connected(self) -> bool:
        """Whether a connection to the peer is open and takes new requests."""
        return self._connection is not None and self._connection.usable

    async def connect(self) -> None:
        """Open the connection now, so that the first request finds it open (its TLS handshake
        out of that request's time); a failure is left to that request, which connects again."""
        try:
            await self._connect()
        except (TransportError, ssl.SSLError, _ConnectFailed) as error:
            log.debug("%s: no connection opened ahead: %s", self.base_uri, error)

    async def aclose(self) -> None:
        self._closed = True
        for ping in self._pings.values():
            ping.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()

    async def __aenter__(self) -> SDCPClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _exchange(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        params: Params | None = None,
        headers: Mapping[str, str] | None = None,
        idempotent: bool,
        timeout: float | None,
    ) -> tuple[int, object | None]:
        response = await self._send(
            method,
            path,
            body=body,
            params=params,
            idempotent=idempotent,
            timeout=timeout,
            headers={**(headers or {}), "accept": f"{MEDIA_TYPE}, {PROBLEM_MEDIA_TYPE}"},
            content_type=MEDIA_TYPE,
            max_size=self._max_response_size,
        )
        return self._interpret(response)

    async def _exchange_bytes(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        params: Params | None = None,
        headers: Mapping[str, str] | None = None,
        idempotent: bool,
        timeout: float | None,
        content_type: str | None = None,
    ) -> BytesResponse:
        response = await self._send(
            method,
            path,
            body=body,
            params=params,
            idempotent=idempotent,
            timeout=timeout,
            headers={**(headers or {}), "accept": f"{_OCTETS}, {PROBLEM_MEDIA_TYPE}"},
            content_type=content_type,
            max_size=self._max_object_size,
        )
        status = response.status
        if not 200 <= status < 300:
            self._raise_for_status(response)
        return BytesResponse(status, response.content, response.headers)

    async def _send(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None,
        params: Params | None,
        headers: dict[str, str],
        idempotent: bool,
        timeout: float | None,
        content_type: str | None,
        max_size: int,
    ) -> H2Response:
        if body is not None and content_type is not None:
            headers["content-type"] = content_type
        target = self._path_prefix + path.lstrip("/")
        if params:
            target += "?" + urlencode({name: str(value) for name, value in params.items()})
        encoded = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
        return await self._deliver(method, path, target, encoded, body, idempotent, timeout, max_size)

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
        """Send the request for ``target`` (path and query) on the peer's connection, retrying where
        that is safe; ``path`` names it in errors."""
        attempt = 0
        while True:
            attempt += 1
            try:
                connection = await self._connect()
                response = await connection.request(
                    method,
                    target,
                    headers,
                    body,
                    timeout=self._timeout if timeout is None else timeout,
                    max_size=max_size,
                )
            except ssl.SSLError as error:
                raise TLSFailure(f"TLS handshake with {self.base_uri} failed: {error}") from error
            except ResponseTooLarge as error:
                raise UnexpectedResponse(f"{method} {path} to {self.base_uri}: {error}") from error
            except _ConnectFailed as failure:
                # Nothing was sent on a connection that never opened: retrying is always safe.
                if attempt >= self._retry.attempts:
                    raise ConnectionLost(f"cannot connect to {self.base_uri}: {failure.cause!r}") from failure.cause
            except ConnectionClosed as error:
                if not self._peer_answered and not error.unprocessed and await self._client_certificate_refused():
                    raise ClientCertificateRejected(
                        f"{self.base_uri} refused our client certificate (closed the connection after the "
                        "TLS handshake without answering)"
                    ) from error
                # RFC 9113 8.7: a request the peer did not process may be retried whatever its method.
                if not (idempotent or error.unprocessed) or attempt >= self._retry.attempts:
                    raise ConnectionLost(
                        f"{method} {path} to {self.base_uri}: connection lost ({error}) after {attempt} attempt(s)"
                    ) from error
            except TimeoutError as error:
                self._drop_if_silent(connection)
                raise PeerTimeout(f"{method} {path} to {self.base_uri} timed out") from error
            else:
                self._peer_answered = True
                return response
            await asyncio.sleep(self._retry.delay(attempt - 1))

    def _drop_if_silent(self, connection: H2Connection) -> None:
        """After a request on ``connection`` timed out: a peer that is only slow still answers a
        PING, and the connection stays; one that does not is dropped, so that the next request
        opens a new connection instead of waiting behind a dead one (a partition that healed
        leaves TCP retransmitting on its own backoff, seconds apart). Requests that time out
        together on one connection share its PING."""

        async def ping() -> None:
            if not await connection.answers_ping(PING_TIMEOUT_S):
                log.info("%s: the connection answered no PING after a timeout; dropped", self.base_uri)
                connection.abort()

        if connection in self._pings:
            return
        task = asyncio.get_running_loop().create_task(ping())
        self._pings[connection] = task
        task.add_done_callback(lambda _: self._pings.pop(connection, None))

    async def _connect(self) -> H2Connection:
        """The open connection to the peer, or a new one; raises ``_ConnectFailed`` or ``ssl.SSLError``."""
        if self._closed:
            raise TransportError(f"the client for {self.base_uri} is closed")
        connection = self._connection
        if connection is not None and connection.usable:
            return connection
        async with self._connecting:
            connection = self._connection
            if connection is not None and connection.usable:
                return connection
            try:
                connection = await H2Connection.open(
                    self._host,
                    self._port,
                    self._tls_context(),
                    timeout=CONNECT_TIMEOUT_S,
                    identity=self._server_identity,
                )
            except WrongServer as error:
                raise TLSFailure(f"{self.base_uri}: {error}; nothing was sent") from error
            except ssl.SSLError:
                raise
            except TimeoutError as error:
                raise PeerTimeout(f"connecting to {self.base_uri} timed out") from error
            except (OSError, ConnectionClosed) as error:
                raise _ConnectFailed(error) from error
            self._connection = connection
            return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            raise TypeError(f"{type(self).__name__} opens no connection")
        return self._ssl_context

    async def _client_certificate_refused(self) -> bool:
        """Whether the peer completes TLS and then closes without its HTTP/2 preface.

        RFC 9113 3.4: a server sends its preface (a SETTINGS frame) first, so a server that accepted
        our certificate always has something to say; a TLS 1.3 server that refused it just closes.
        """
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._tls_context())
        except (OSError, TimeoutError):
            return False
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                first = await reader.read(1)
        except (OSError, TimeoutError):
            return False
        finally:
            writer.close()
        return first == b""

    def _interpret(self, response: H2Response) -> tuple[int, object | None]:
        status = response.status
        if 200 <= status < 300:
            return status, self._success_body(response)
        self._raise_for_status(response)

    def _raise_for_status(self, response: H2Response) -> NoReturn:
        status = response.status
        problem = _problem_body(response)
        if 400 <= status < 500:
            if problem is not None:
                try:
                    # The HTTP status is authoritative; the body's copy is advisory (RFC 9457 3.1.2).
                    error = ProtocolError.from_problem({**problem, "status": status})
                except BadMessage as malformed:
                    raise PeerClientError(status, problem, f"malformed problem body: {malformed}") from malformed
                raise error
            raise PeerClientError(status, None, _excerpt(response))
        if status >= 500:
            raise PeerServerError(status, problem, str((problem or {}).get("detail", "")) or _excerpt(response))
        raise UnexpectedResponse(f"{self.base_uri} answered with unexpected status {status}")

    def _success_body(self, response: H2Response) -> object | None:
        if not response.content:
            return None
        media_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != MEDIA_TYPE:
            raise UnexpectedResponse(f"{self.base_uri} answered with {media_type or 'no media type'}, not {MEDIA_TYPE}")
        try:
            return decode(response.content, max_size=self._max_response_size)
        except BadMessage as error:
            raise UnexpectedResponse(f"{self.base_uri} sent an undecodable body: {error}") from error


class PeerClients:
    """One ``SDCPClient`` per peer base URI, created on first use, all with our own certificate."""

    def __init__(self, cert: PathLike, key: PathLike, ca: PathLike, **client_options: Any) -> None:
        self._credentials = (cert, key, ca)
        self._options = client_options
        self._clients: dict[str, SDCPClient] = {}

    @property
    def credentials(self) -> tuple[PathLike, PathLike, PathLike]:
        """Our certificate, key and CA (cert, key, ca)."""
        return self._credentials

    @property
    def options(self) -> Mapping[str, Any]:
        """What every client is made with besides the credentials (SDCPClient's options)."""
        return self._options

    def holds(self, base_uri: str) -> bool:
        """Whether a client of that peer exists (it has been asked, or connected ahead)."""
        return base_uri in self._clients

    def add(self, client: SDCPClient) -> None:
        """Ask ``client``'s peer through ``client`` from now on (a peer this process serves:
        sdcp.transport.local)."""
        self._clients[client.base_uri] = client

    def get(self, base_uri: str) -> SDCPClient:
        client = self._clients.get(base_uri)
        if client is None:
            client = SDCPClient(base_uri, *self._credentials, **self._options)
            self._clients[base_uri] = client
        return client

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(client.aclose() for client in clients))


def _problem_body(response: H2Response) -> dict[str, Any] | None:
    media_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != PROBLEM_MEDIA_TYPE:
        return None
    try:
        body = json.loads(response.content)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _excerpt(response: H2Response, limit: int = 200) -> str:
    text = response.content[:limit].decode("utf-8", errors="replace")
    try:
        return text or HTTPStatus(response.status).phrase
    except ValueError:
        return text or str(response.status)


class _ConnectFailed(Exception):
    """No connection could be opened (refused, unreachable, not HTTP/2): nothing was sent."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
