"""One client HTTP/2 connection over TLS: the ``h2`` protocol library on asyncio's TLS transport.

``SDCPClient`` sends every request to a peer over one ``H2Connection``. Each SDCP round is a
request, and on the cores the model also runs on, a request's CPU comes out of the model's passes:
an exchange through httpx costs the client about 0.85 ms of CPU, through this class about 0.2 ms
(docs/performance.md). The class does what SDCP's requests need and no more: requests with
complete bodies, flow control both ways, multiplexing up to the peer's stream limit, GOAWAY and
stream resets reported as retryable where RFC 9113 says the request was not processed.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from cryptography import x509

from sdcp.transport.certs import uri_sans

__all__ = ["ConnectionClosed", "H2Connection", "H2Response", "ResponseTooLarge", "WrongServer", "send_within_windows"]

# Our receive windows: large objects (KV caches) flow without a WINDOW_UPDATE round trip per 64 KiB.
_RECEIVE_WINDOW = 1 << 24
_ALPN_H2 = "h2"
_CLOSE_WAIT_S = 1.0
_FRAME_HEADER = 9
_GOAWAY = 0x7

Header = tuple[bytes, bytes]


class ConnectionClosed(Exception):
    """The request did not complete: the connection closed, or the peer reset the stream.

    ``unprocessed`` is true when the peer certainly did not process the request (a stream above a
    GOAWAY's last stream id, or REFUSED_STREAM; RFC 9113 8.7), so that any request may be retried.
    """

    def __init__(self, message: str, *, unprocessed: bool = False) -> None:
        super().__init__(message)
        self.unprocessed = unprocessed


class ResponseTooLarge(Exception):
    """An answer longer than the client takes (``max_response_size``); the stream was reset."""


class WrongServer(Exception):
    """The server's certificate, valid for the CA, names another instance than the one meant."""


def _uri_sans(der: bytes | None) -> list[str]:
    return uri_sans(x509.load_der_x509_certificate(der)) if der is not None else []


@dataclass(frozen=True)
class H2Response:
    status: int
    headers: dict[str, str]
    content: bytes


@dataclass
class _Stream:
    answer: asyncio.Future[H2Response]
    max_size: int
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    received: int = 0


async def send_within_windows(
    connection: h2.connection.H2Connection,
    stream_id: int,
    body: bytes,
    *,
    end_stream: bool,
    capacity: asyncio.Event,
    flush: Callable[[], None],
    gone: Callable[[], bool],
) -> bool:
    """Send ``body`` on a stream in frames the peer's flow-control windows allow; False when
    ``gone()`` says the stream or connection went away first. ``capacity`` is set whenever a window
    may have opened; ``flush`` writes what h2 queued. Both ends use it: request and answer bodies."""
    view = memoryview(body)
    sent = 0
    while sent < len(body):
        if gone():
            return False
        window = min(connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size)
        if window <= 0:
            flush()
            capacity.clear()
            await capacity.wait()
            continue
        chunk = bytes(view[sent : sent + window])
        sent += len(chunk)
        connection.send_data(stream_id, chunk, end_stream=end_stream and sent == len(body))
        flush()
    return True


class H2Connection(asyncio.Protocol):
    """A connection to one peer; open it with ``await H2Connection.open(...)``."""

    def __init__(self, authority: str, identity: str | None = None) -> None:
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        # The URI SAN the server's certificate must carry; checked before the preface is sent.
        self._identity = identity
        self.identity_error: str | None = None
        self._h2 = h2.connection.H2Connection(config)
        self._authority = authority.encode("ascii")
        self._transport: asyncio.Transport | None = None
        self._streams: dict[int, _Stream] = {}
        # Set whenever flow-control windows or the stream limit may have opened up.
        self._capacity = asyncio.Event()
        self._closed = asyncio.get_running_loop().create_future()
        self._goaway = False
        self._flush_scheduled = False
        # Received bytes of a frame not yet complete (see _take_goaways).
        self._inbound = bytearray()
        self.peer_certificate: bytes | None = None
        # PINGs sent (`answers_ping`), by their opaque data, until acknowledged.
        self._pings: dict[bytes, asyncio.Future[None]] = {}

    @classmethod
    async def open(
        cls, host: str, port: int, ssl_context: ssl.SSLContext, *, timeout: float, identity: str | None = None
    ) -> H2Connection:
        """Connect and complete TLS; raises ``OSError``, ``ssl.SSLError``, ``TimeoutError``, or
        ``WrongServer`` when the server's certificate does not name ``identity``."""
        loop = asyncio.get_running_loop()
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # asyncio.timeout, not wait_for: on 3.11 wait_for turns a cancellation that meets a finished
        # connect into that connect's result or error, and the cancellation is lost.
        async with asyncio.timeout(timeout):
            _, connection = await loop.create_connection(
                lambda: cls(authority, identity), host, port, ssl=ssl_context, server_hostname=host
            )
        if connection.identity_error is not None:
            raise WrongServer(connection.identity_error)
        if connection._transport is None:
            raise ConnectionClosed("the peer did not agree to HTTP/2 (ALPN h2), which SDCP requires")
        return connection

    @property
    def usable(self) -> bool:
        """Whether new requests may start on this connection."""
        return self._transport is not None and not self._closed.done() and not self._goaway

    async def request(
        self,
        method: str,
        path: str,
        headers: Sequence[Header],
        body: bytes | None,
        *,
        timeout: float,
        max_size: int = 1 << 30,
    ) -> H2Response:
        """One exchange; raises ``ConnectionClosed``, ``TimeoutError``, or ``ResponseTooLarge`` for
        an answer body past ``max_size`` bytes (refused as it arrives)."""
        answer: asyncio.Future[H2Response] = asyncio.get_running_loop().create_future()
        stream_id: int | None = None
        try:
            async with asyncio.timeout(timeout):
                await self._wait_for_stream_slot()
                stream_id = self._h2.get_next_available_stream_id()
                self._streams[stream_id] = _Stream(answer, max_size)
                request_headers: list[Header] = [
                    (b":method", method.encode("ascii")),
                    (b":scheme", b"https"),
                    (b":authority", self._authority),
                    (b":path", path.encode("ascii")),
                    *headers,
                ]
                if body is not None:
                    request_headers.append((b"content-length", str(len(body)).encode("ascii")))
                self._h2.send_headers(stream_id, request_headers, end_stream=not body)
                self._flush()
                # A peer may answer, or reset the stream, before it has read the whole body
                # (RFC 9113 8.1): its answer or its reset is the outcome then.
                if body and not await send_within_windows(
                    self._h2,
                    stream_id,
                    body,
                    end_stream=True,
                    capacity=self._capacity,
                    flush=self._flush,
                    gone=lambda: self._closed.done() or answer.done(),
                ):
                    if not answer.done():
                        raise ConnectionClosed("connection lost while sending the request body")
                    # The rest of the body stays unsent: close the stream, which would else count
                    # against the peer's stream limit for good.
                    self._abandon(stream_id)
                return await answer
        except BaseException:
            if stream_id is not None:
                self._abandon(stream_id)
            raise
        finally:
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved: a failure that arrived while the body was sent
            if stream_id is not None:
                self._streams.pop(stream_id, None)
                self._capacity.set()
                if self._goaway:
                    self._close_when_done()

    async def answers_ping(self, timeout: float) -> bool:
        """Whether the peer acknowledges a PING (RFC 9113 6.7) within ``timeout``: a connection
        whose packets go nowhere, or wait behind TCP's retransmission backoff after a partition
        healed, does not, however long its requests wait."""
        if not self.usable:
            return False
        opaque = os.urandom(8)
        acknowledged: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pings[opaque] = acknowledged
        try:
            self._h2.ping(opaque)
            self._flush()
            await asyncio.wait([acknowledged, self._closed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            return acknowledged.done()
        finally:
            self._pings.pop(opaque, None)

    def abort(self) -> None:
        """Drop the connection at once (no GOAWAY): its streams fail with ``ConnectionClosed``."""
        if self._transport is not None and not self._closed.done():
            self._transport.abort()

    async def close(self) -> None:
        """Send GOAWAY and close; streams still open fail with ``ConnectionClosed``."""
        if self._transport is None or self._closed.done():
            return
        try:
            self._h2.close_connection()
            self._flush_now()
        except h2.exceptions.ProtocolError:
            pass
        self._transport.close()
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await asyncio.shield(self._closed)
        except TimeoutError:
            # TLS close waits for the peer's close_notify; a peer that never sends it is cut off.
            self._transport.abort()

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.selected_alpn_protocol() != _ALPN_H2:
            # SDCP 5.1: HTTP/2 is required; a peer that does not speak it is not an SDCP peer.
            transport.abort()
            return
        self.peer_certificate = ssl_object.getpeercert(binary_form=True)
        if self._identity is not None:
            presented = _uri_sans(self.peer_certificate)
            if [uri.rstrip("/") for uri in presented] != [self._identity.rstrip("/")]:
                # Not a byte of HTTP/2 goes to a server that is not the one we meant to reach.
                self.identity_error = (
                    f"the server presented a certificate for {presented or 'no URI'}, not {self._identity}"
                )
                transport.abort()
                return
        self._transport = transport
        self._h2.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                h2.settings.SettingCodes.ENABLE_PUSH: 0,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _RECEIVE_WINDOW,
            },
        )
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(_RECEIVE_WINDOW)
        self._flush()

    def data_received(self, data: bytes) -> None:
        data = self._take_goaways(data)
        if not data:
            return
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            self._flush_now()
            self._fail_all(ConnectionClosed(f"HTTP/2 protocol error from the peer: {error}"))
            if self._transport is not None:
                self._transport.abort()
            return
        for event in events:
            self._handle(event)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail_all(ConnectionClosed(f"connection lost: {exc!r}" if exc else "connection closed by the peer"))
        if not self._closed.done():
            self._closed.set_result(None)
        self._capacity.set()

    # -- internals -------------------------------------------------------------------------------

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                for name, value in event.headers:
                    if name == b":status":
                        stream.status = int(value)
                    else:
                        stream.headers[name.decode("latin-1")] = value.decode("latin-1")
        elif isinstance(event, h2.events.DataReceived):
            # The stream may be gone already (abandoned); the connection window is restored anyway.
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            stream = self._streams.get(event.stream_id)
            if stream is not None and not stream.answer.done():
                stream.received += len(event.data)
                if stream.received > stream.max_size:
                    # Refused while it arrives: a peer cannot make us buffer more than the limit.
                    stream.chunks.clear()
                    stream.answer.set_exception(ResponseTooLarge(f"the answer exceeds {stream.max_size} bytes"))
                    self._abandon(event.stream_id)
                else:
                    stream.chunks.append(event.data)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None and not stream.answer.done():
                if stream.status is None:
                    stream.answer.set_exception(ConnectionClosed("the stream ended without a response"))
                else:
                    stream.answer.set_result(H2Response(stream.status, stream.headers, b"".join(stream.chunks)))
                # A request still sending its body waits for window; with its answer here, it stops.
                self._capacity.set()
        elif isinstance(event, h2.events.StreamReset):
            stream = self._streams.get(event.stream_id)
            if stream is not None and not stream.answer.done():
                refused = event.error_code == h2.errors.ErrorCodes.REFUSED_STREAM
                stream.answer.set_exception(
                    ConnectionClosed(f"the peer reset the stream ({event.error_code!r})", unprocessed=refused)
                )
            self._capacity.set()
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._capacity.set()
        elif isinstance(event, h2.events.PingAckReceived):
            acknowledged = self._pings.get(event.ping_data)
            if acknowledged is not None and not acknowledged.done():
                acknowledged.set_result(None)

    async def _wait_for_stream_slot(self) -> None:
        while True:
            if not self.usable:
                raise ConnectionClosed("the connection is closed or going away", unprocessed=True)
            if self._h2.open_outbound_streams < self._h2.remote_settings.max_concurrent_streams:
                return
            self._capacity.clear()
            await self._capacity.wait()

    def _take_goaways(self, data: bytes) -> bytes:
        """The received bytes less their GOAWAY frames, which are handled here: h2 moves to CLOSED
        on a GOAWAY and then refuses every frame, also the answers that a graceful GOAWAY still
        promises (RFC 9113 6.8, e.g. the two-step shutdown of Go's server). Only whole frames go on.

        On the hot path (no frame left over, no GOAWAY) the bytes go on as they came, uncopied."""
        buffer: bytes | bytearray = data
        if self._inbound:
            self._inbound += data
            buffer = self._inbound
        passed = bytearray()
        start = offset = 0
        while len(buffer) - offset >= _FRAME_HEADER:
            length = int.from_bytes(buffer[offset : offset + 3], "big")
            end = offset + _FRAME_HEADER + length
            if end > len(buffer):
                break
            stream_id = int.from_bytes(buffer[offset + 5 : offset + 9], "big") & 0x7FFFFFFF
            if buffer[offset + 3] == _GOAWAY and stream_id == 0 and length >= 8:
                passed += buffer[start:offset]
                payload = buffer[offset + _FRAME_HEADER : end]
                self._on_goaway(int.from_bytes(payload[0:4], "big") & 0x7FFFFFFF, int.from_bytes(payload[4:8], "big"))
                start = end
            offset = end
        if start == 0 and offset == len(buffer):
            whole = bytes(buffer) if buffer is self._inbound else data
            self._inbound = bytearray()
            return whole
        passed += buffer[start:offset]
        self._inbound = bytearray(buffer[offset:])
        return bytes(passed)

    def _on_goaway(self, last: int, error_code: int) -> None:
        """RFC 9113 6.8: streams above ``last`` were not processed and may be retried; after a
        graceful GOAWAY (NO_ERROR) those up to it are still answered, so they wait (bounded by their
        timeouts). No new request uses the connection, which closes once its streams are done."""
        self._goaway = True
        graceful = error_code == h2.errors.ErrorCodes.NO_ERROR
        for stream_id, stream in self._streams.items():
            if not stream.answer.done() and (stream_id > last or not graceful):
                unprocessed = stream_id > last
                stream.answer.set_exception(ConnectionClosed("the peer sent GOAWAY", unprocessed=unprocessed))
        self._close_when_done()

    def _close_when_done(self) -> None:
        if self._transport is not None and not any(not s.answer.done() for s in self._streams.values()):
            self._transport.close()

    def _abandon(self, stream_id: int) -> None:
        """A request given up (timeout, cancellation): tell the peer, unless the stream is done."""
        try:
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self._flush()
        except (h2.exceptions.ProtocolError, KeyError):
            pass

    def _flush(self) -> None:
        """Write what h2 has queued at the end of this loop iteration: requests made together
        (many sessions' output polls) leave in one TLS write, not one each."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_scheduled = False
        data = self._h2.data_to_send()
        if data and self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _fail_all(self, error: ConnectionClosed) -> None:
        for stream in self._streams.values():
            if not stream.answer.done():
                stream.answer.set_exception(error)
