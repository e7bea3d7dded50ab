"""The HTTP/2 server of SDCP's mutual-TLS listeners: ASGI on ``h2`` and asyncio's TLS transport.

SDCP roles speak only HTTP/2 over TLS 1.3 with client certificates (SDCP 5.1), a request or more per
round. hypercorn, which still serves the front end (HTTP/1.1 too), spent about 0.45 ms of CPU per
request; on the cores the model also uses, that came out of its passes (docs/performance.md). This
server does what those listeners need and no more:

- one task per request running the ASGI app, with the ASGI TLS extension (and ``peer_uri``) of the
  connection in ``scope["extensions"]["tls"]``; a stream the client resets, or a connection that is
  lost, cancels its task;
- flow control both ways: request data is credited back to the client only as the app reads it, so
  what a client can make the server hold is bounded by the windows (1 MiB a stream, 16 MiB a
  connection), whatever it sends;
- request bodies limited while they arrive (``max_body_bytes``: a declared or received excess is
  answered 413 at once and the upload stopped with RST_STREAM), and a body that stalls for
  ``body_timeout_s`` ends its stream;
- ``max_concurrent_streams`` advertised and enforced (a stream beyond it is refused); a client that
  resets streams faster than ``_RESET_RATE`` a second (the rapid-reset pattern) gets GOAWAY
  ENHANCE_YOUR_CALM;
- graceful shutdown as RFC 9113 6.8 describes it, after ``keep_alive_max_requests`` requests or when
  the server stops: GOAWAY with 2^31-1 and a PING; once the PING is answered (or after
  ``_GOAWAY_GRACE_S``), GOAWAY with the last stream taken, after which new streams are refused
  (REFUSED_STREAM, safe to retry, RFC 9113 8.7); the streams taken are answered, and the connection
  closes then. The GOAWAY frames are written past h2, which could send nothing after one;
- the rest of a body that the app did not read (it answered early) is credited back as it comes,
  never buffered; a refused body's upload is ended with RST_STREAM NO_ERROR (RFC 9113 8.1);
- idle connections closed after ``keep_alive_timeout_s``; a connection silent for
  ``ping_interval_s`` is sent a PING, and one that does not answer it within as long again is
  dropped, so that a vanished peer holds no stream;
- a client that did not negotiate ``h2`` gets one HTTP/1.1 505 problem answer, then the connection
  closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame

from sdcp.protocol.problems import PROBLEM_MEDIA_TYPE
from sdcp.transport.asgi import problem_body
from sdcp.transport.errors import HTTPProblem, HTTPVersionNotSupported, InternalServerError, PayloadTooLarge
from sdcp.transport.h2conn import send_within_windows
from sdcp.transport.peer import PeerTLS

__all__ = ["DEFAULT_MAX_BODY_BYTES", "H2Listener", "H2ServerProtocol", "H2ServerState", "http_scope", "run_lifespan"]

_log = logging.getLogger("sdcp.transport.h2server")

# The server only reads what the app sends: any mapping, so that an app typed as starlette's
# (which sends MutableMappings) is one.
ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[Mapping[str, Any]], Awaitable[None]]],
    Awaitable[None],
]

# The connection's receive window, and each stream's: the most a client can have the server buffer.
_RECEIVE_WINDOW = 1 << 24
_STREAM_WINDOW = 1 << 20
# Stream resets a client may send: a burst, then this many a second (rapid reset, CVE-2023-44487).
_RESET_BURST = 200
_RESET_RATE = 100.0
DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_PING_INTERVAL_S = 20.0
_PING_PAYLOAD = b"sdcp-ka!"
_SHUTDOWN_PING = b"sdcp-end"
# The longest wait for the shutdown PING's answer before the final GOAWAY.
_GOAWAY_GRACE_S = 1.0
# How long a connection ended for abuse stays open, its input dropped, so that the client reads
# the GOAWAY that says why (_linger).
_LINGER_S = 1.0
_LAST_POSSIBLE_STREAM = 2**31 - 1
_ALPN_H2 = "h2"
_ABORT_WAIT_S = 1.0
_ASGI = {"version": "3.0", "spec_version": "2.3"}


def http_scope(
    method: str,
    scheme: str,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    tls: dict[str, Any] | None,
) -> dict[str, Any]:
    """The ASGI scope of an HTTP/2 request for ``target`` (its path and query), with the ASGI TLS
    extension ``tls`` of its connection: the listener's, and a local peer's (sdcp.transport.local)."""
    raw_path, _, query = target.partition(b"?")
    return {
        "type": "http",
        "asgi": _ASGI,
        "http_version": "2",
        "method": method,
        "scheme": scheme,
        "path": unquote(raw_path.decode("ascii", errors="replace")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
        "extensions": {"tls": tls} if tls is not None else {},
        "state": {},
    }


@dataclass
class H2ServerState:
    """What a listener's connections share: limits, the open connections, requests in flight."""

    max_concurrent_streams: int
    keep_alive_max_requests: int
    keep_alive_timeout_s: float
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    ping_interval_s: float = DEFAULT_PING_INTERVAL_S
    connections: set[H2ServerProtocol] = field(default_factory=set)
    in_flight: int = 0
    stopping: bool = False

    def stop_accepting(self) -> None:
        """Every connection refuses new streams and closes once its requests are answered."""
        self.stopping = True
        for connection in list(self.connections):
            connection.drain()

    def abort_all(self) -> None:
        for connection in list(self.connections):
            connection.abort()


@dataclass
class _Stream:
    stream_id: int
    # Received chunks not yet read by the app, each with its flow-controlled length (padding too).
    body: deque[tuple[bytes, int]] = field(default_factory=deque)
    received: int = 0
    # A problem to answer instead of running (or after cancelling) the app.
    refusal: HTTPProblem | None = None
    complete: bool = False
    body_delivered: bool = False
    disconnected: bool = False
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    headers_sent: bool = False
    ended: bool = False
    bodiless: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The task answering the request; held here, since the event loop keeps only weak references.
    task: asyncio.Task[None] | None = None


class H2ServerProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, app: ASGIApp, state: H2ServerState) -> None:
        self._app = app
        self._state = state
        self._transport: asyncio.Transport | None = None
        self._h2: h2.connection.H2Connection | None = None
        self._streams: dict[int, _Stream] = {}
        self._requests = 0
        self._draining = False
        self._capacity = asyncio.Event()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._flush_scheduled = False
        self._tls: dict[str, Any] | None = None
        self._client: tuple[str, int] | None = None
        self._server: tuple[str, int] | None = None
        self._reset_allowance = float(_RESET_BURST)
        self._reset_checked = 0.0
        self._heard_at = 0.0
        self._ping_sent_at: float | None = None
        # Graceful shutdown: the first GOAWAY sent; the highest stream taken; the final GOAWAY's timer.
        self._announced = False
        self._last_stream_id = 0
        self._final_goaway_timer: asyncio.TimerHandle | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        # Closing after a GOAWAY that ended an abusive connection (_linger).
        self._lingering = False
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._state.connections.add(self)
        self._client = _address(transport.get_extra_info("peername"))
        self._server = _address(transport.get_extra_info("sockname"))
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            self._tls = PeerTLS.from_ssl_object(ssl_object).asgi_extension()
        if ssl_object is None or ssl_object.selected_alpn_protocol() != _ALPN_H2:
            return  # HTTP/1.x: answered with 505 on its first bytes
        self._h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self._h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self._state.max_concurrent_streams,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _STREAM_WINDOW,
            },
        )
        self._h2.initiate_connection()
        self._h2.increment_flow_control_window(_RECEIVE_WINDOW - 65535)
        self._flush()
        if self._state.stopping:
            self.drain()
        self._arm_idle_timer()
        self._heard_at = asyncio.get_running_loop().time()
        self._schedule_keepalive()

    def data_received(self, data: bytes) -> None:
        if self._h2 is None:
            self._refuse_http1()
            return
        if self._lingering:
            return
        self._heard_at = asyncio.get_running_loop().time()
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            _log.info("HTTP/2 protocol error from %s: %s", self._client, error)
            self._flush_now()
            self.abort()
            return
        for event in events:
            if self._transport is None or self._transport.is_closing() or self._lingering:
                break  # closed meanwhile (GOAWAY): what else the client sent is not answered
            self._handle(event)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._state.connections.discard(self)
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._final_goaway_timer is not None:
            self._final_goaway_timer.cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        self._end_streams()
        self._capacity.set()

    def _end_streams(self) -> None:
        """Every stream's client is gone: its handler is cancelled."""
        for stream in self._streams.values():
            stream.disconnected = True
            stream.changed.set()
            if stream.task is not None:
                stream.task.cancel()

    # -- control from the listener ---------------------------------------------------------------

    def drain(self) -> None:
        """Shut the connection down gracefully (RFC 9113 6.8, see the module doc)."""
        if self._h2 is None or self._transport is None or self._transport.is_closing():
            self._draining = True
            self._close_if_drained()
            return
        if self._announced:
            return
        self._announced = True
        self._write_goaway(_LAST_POSSIBLE_STREAM)
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self._h2.ping(_SHUTDOWN_PING)
        self._flush_now()
        self._final_goaway_timer = asyncio.get_running_loop().call_later(_GOAWAY_GRACE_S, self._final_goaway)

    def _final_goaway(self) -> None:
        """The client has seen the first GOAWAY (its PING answer came after it): streams past the
        last one taken will not be processed."""
        if self._draining:
            return
        if self._final_goaway_timer is not None:
            self._final_goaway_timer.cancel()
        self._draining = True
        if self._transport is not None and not self._transport.is_closing():
            self._write_goaway(self._last_stream_id)
        self._close_if_drained()

    def _write_goaway(self, last_stream_id: int) -> None:
        """A graceful GOAWAY written past h2, which would refuse to send anything after it."""
        assert self._transport is not None
        self._flush_now()
        frame = hyperframe.frame.GoAwayFrame(0)
        frame.last_stream_id, frame.error_code = last_stream_id, h2.errors.ErrorCodes.NO_ERROR
        self._transport.write(frame.serialize())

    @property
    def settled(self) -> bool:
        """Shut down and every stream answered: nothing is lost by cutting the connection."""
        return self._draining and not self._streams

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    @property
    def flushed(self) -> bool:
        return self._transport is None or self._transport.is_closing() or self._transport.get_write_buffer_size() == 0

    # -- HTTP/2 events ----------------------------------------------------------------------------

    def _handle(self, event: h2.events.Event) -> None:
        assert self._h2 is not None
        if isinstance(event, h2.events.RequestReceived):
            self._start_request(event.stream_id, event.headers)
        elif isinstance(event, h2.events.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None or stream.disconnected or stream.refusal is not None:
                # Nobody will read it: credit the connection window back at once.
                self._acknowledge(event.flow_controlled_length, event.stream_id)
                return
            stream.received += len(event.data)
            if stream.received > self._state.max_body_bytes:
                self._acknowledge(event.flow_controlled_length, event.stream_id)
                self._refuse(stream, PayloadTooLarge(f"request body exceeds {self._state.max_body_bytes} bytes"))
                return
            stream.body.append((event.data, event.flow_controlled_length))
            stream.changed.set()
        elif isinstance(event, h2.events.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.complete = True
                stream.changed.set()
        elif isinstance(event, h2.events.StreamReset):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.disconnected = True
                stream.changed.set()
                if stream.task is not None:
                    stream.task.cancel()
                self._count_reset()
            self._capacity.set()
        elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
            self._capacity.set()
        elif isinstance(event, h2.events.PingAckReceived):
            if event.ping_data == _SHUTDOWN_PING:
                self._final_goaway()
            else:
                self._ping_sent_at = None
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.drain()

    def _start_request(self, stream_id: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        assert self._h2 is not None
        if self._draining or len(self._streams) >= self._state.max_concurrent_streams:
            # Handlers of reset streams may still be ending: the advertised limit holds for tasks too.
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        self._requests += 1
        self._last_stream_id = max(self._last_stream_id, stream_id)
        if self._requests >= self._state.keep_alive_max_requests:
            self.drain()
        pseudo: dict[bytes, bytes] = {}
        headers: list[tuple[bytes, bytes]] = []
        for name, value in raw_headers:
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                headers.append((name, value))
        if b":authority" in pseudo:
            headers.insert(0, (b"host", pseudo[b":authority"]))
        scope = http_scope(
            pseudo.get(b":method", b"GET").decode("ascii"),
            pseudo.get(b":scheme", b"https").decode("ascii"),
            pseudo.get(b":path", b"/"),
            headers,
            self._client,
            self._server,
            self._tls,
        )
        stream = _Stream(stream_id, bodiless=scope["method"] == "HEAD")
        declared = _content_length(headers)
        if declared is not None and declared > self._state.max_body_bytes:
            stream.refusal = PayloadTooLarge(f"request body of {declared} bytes exceeds {self._state.max_body_bytes}")
        self._streams[stream_id] = stream
        self._state.in_flight += 1
        self._disarm_idle_timer()
        stream.task = asyncio.get_running_loop().create_task(self._run(stream, scope))
        stream.task.add_done_callback(lambda _: self._finished(stream))

    # -- one request ------------------------------------------------------------------------------

    async def _run(self, stream: _Stream, scope: dict[str, Any]) -> None:
        try:
            if stream.refusal is None:
                await self._app(
                    scope, lambda: self._receive(stream), lambda message: self._send_from_app(stream, message)
                )
        except asyncio.CancelledError:
            pass  # the client reset the stream or left, or its body was refused: settled below
        except Exception:  # noqa: BLE001 - the app's failure is logged and answered, not raised
            _log.exception("unhandled error answering %s %s", scope["method"], scope["path"])
        finally:
            if not stream.disconnected and not stream.ended:
                if stream.refusal is not None and not stream.headers_sent:
                    await self._answer_problem(stream, stream.refusal)
                else:
                    await self._finish_unanswered(stream)
            if stream.refusal is not None and not stream.complete and not stream.disconnected:
                # RFC 9113 8.1: the answer is complete; the rest of a refused body is not wanted.
                self._reset(stream, h2.errors.ErrorCodes.NO_ERROR)

    def _finished(self, stream: _Stream) -> None:
        """The stream's task is done, also when it was cancelled before it ever ran."""
        self._release(stream)
        self._state.in_flight -= 1
        self._capacity.set()
        self._close_if_drained()
        self._arm_idle_timer()

    def _release(self, stream: _Stream) -> None:
        """Credit back what the app did not read and forget the stream."""
        for _, flow_length in stream.body:
            self._acknowledge(flow_length, stream.stream_id)
        stream.body.clear()
        self._streams.pop(stream.stream_id, None)

    async def _receive(self, stream: _Stream) -> dict[str, Any]:
        while True:
            if stream.body:
                chunk, flow_length = stream.body.popleft()
                # Credited back only now that the app has it: the windows bound what is buffered.
                self._acknowledge(flow_length, stream.stream_id)
                self._flush()
                last = stream.complete and not stream.body
                stream.body_delivered = last
                return {"type": "http.request", "body": chunk, "more_body": not last}
            if stream.complete and not stream.body_delivered:
                stream.body_delivered = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if stream.disconnected or stream.ended or stream.refusal is not None:
                return {"type": "http.disconnect"}
            stream.changed.clear()
            try:
                async with asyncio.timeout(self._state.body_timeout_s):
                    await stream.changed.wait()
            except TimeoutError:
                # A body that stalls (headers, then silence) would hold its task forever.
                self._reset(stream, h2.errors.ErrorCodes.CANCEL)
                return {"type": "http.disconnect"}

    async def _send_from_app(self, stream: _Stream, message: Mapping[str, Any]) -> None:
        if stream.refusal is not None and not stream.headers_sent:
            return  # the server answers this stream itself
        await self._send(stream, message)

    async def _send(self, stream: _Stream, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            stream.status = int(message["status"])
            stream.headers = [(bytes(name).lower(), bytes(value)) for name, value in message.get("headers", [])]
            return
        if kind != "http.response.body" or stream.disconnected or stream.ended or self._h2 is None:
            return
        if stream.status is None:
            raise RuntimeError("http.response.body before http.response.start")
        more = bool(message.get("more_body", False))
        # RFC 9110 6.4.1: answers to HEAD and 204 and 304 answers carry no content.
        body = b"" if stream.bodiless or stream.status in (204, 304) else bytes(message.get("body", b""))
        if not stream.headers_sent:
            stream.headers_sent = True
            self._h2.send_headers(
                stream.stream_id,
                [(b":status", str(stream.status).encode("ascii")), *stream.headers],
                end_stream=not body and not more,
            )
            if not body and not more:
                stream.ended = True
        if body:
            completed = await send_within_windows(
                self._h2,
                stream.stream_id,
                body,
                end_stream=not more,
                capacity=self._capacity,
                flush=self._flush,
                gone=lambda: stream.disconnected,
            )
            stream.ended = completed and not more
        elif not more and not stream.ended:
            self._h2.send_data(stream.stream_id, b"", end_stream=True)
            stream.ended = True
        self._flush()

    async def _finish_unanswered(self, stream: _Stream) -> None:
        """The app returned or failed without completing its answer."""
        assert self._h2 is not None
        if stream.headers_sent:
            self._reset(stream, h2.errors.ErrorCodes.INTERNAL_ERROR)
            return
        await self._answer_problem(stream, InternalServerError())

    async def _answer_problem(self, stream: _Stream, problem: HTTPProblem) -> None:
        body = problem_body(problem)
        stream.status = problem.status
        stream.headers = [
            (b"content-type", PROBLEM_MEDIA_TYPE.encode("ascii")),
            (b"content-length", str(len(body)).encode()),
        ]
        await self._send(stream, {"type": "http.response.body", "body": body})

    # -- limits -----------------------------------------------------------------------------------

    def _refuse(self, stream: _Stream, problem: HTTPProblem) -> None:
        """Answer ``problem`` in place of the app: its body reads end, what it sends is dropped, and
        the buffered data is credited back."""
        stream.refusal = problem
        for _, flow_length in stream.body:
            self._acknowledge(flow_length, stream.stream_id)
        stream.body.clear()
        stream.changed.set()

    def _reset(self, stream: _Stream, code: h2.errors.ErrorCodes) -> None:
        assert self._h2 is not None
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self._h2.reset_stream(stream.stream_id, code)
        stream.ended = True
        stream.disconnected = True
        stream.changed.set()
        self._flush()

    def _acknowledge(self, flow_length: int, stream_id: int) -> None:
        if self._h2 is not None and flow_length:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.acknowledge_received_data(flow_length, stream_id)

    def _count_reset(self) -> None:
        """Rapid reset: a client that resets streams faster than ``_RESET_RATE`` a second (after a
        burst of ``_RESET_BURST``) is told to calm down and disconnected."""
        now = asyncio.get_running_loop().time()
        if self._reset_checked:
            self._reset_allowance = min(_RESET_BURST, self._reset_allowance + (now - self._reset_checked) * _RESET_RATE)
        self._reset_checked = now
        self._reset_allowance -= 1
        if self._reset_allowance < 0 and self._h2 is not None and self._transport is not None:
            _log.warning("%s reset streams too fast; connection closed", self._client)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            self._flush_now()
            self._linger()

    def _linger(self) -> None:
        """Close after the GOAWAY just sent, once the client has had _LINGER_S to read it: a
        socket closed with input still unread (a flood's frames) answers with a reset, which can
        discard the GOAWAY before the client reads it. Meanwhile its handlers are cancelled and
        what it sends is read and dropped."""
        self._lingering = True
        self._end_streams()
        transport = self._transport
        if transport is not None:
            self._linger_timer = asyncio.get_running_loop().call_later(_LINGER_S, transport.close)

    # -- connection housekeeping ------------------------------------------------------------------

    def _schedule_keepalive(self) -> None:
        interval = self._state.ping_interval_s
        self._keepalive = asyncio.get_running_loop().call_later(interval / 2, self._check_alive)

    def _check_alive(self) -> None:
        """A PING after ``ping_interval_s`` of silence; no answer within as long again: dropped."""
        if self._transport is None or self._transport.is_closing() or self._h2 is None:
            return
        now = asyncio.get_running_loop().time()
        interval = self._state.ping_interval_s
        if self._ping_sent_at is not None:
            if now - self._ping_sent_at >= interval:
                _log.info("%s did not answer a PING within %.0f s; connection dropped", self._client, interval)
                self.abort()
                return
        elif now - self._heard_at >= interval:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.ping(_PING_PAYLOAD)
                self._ping_sent_at = now
                self._flush()
        self._schedule_keepalive()

    def _close_if_drained(self) -> None:
        if not self._draining or self._streams or self._transport is None or self._transport.is_closing():
            return
        if self._h2 is not None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self._h2.close_connection(last_stream_id=self._last_stream_id)
            self._flush_now()
        self._transport.close()

    def _arm_idle_timer(self) -> None:
        if self._streams or self._transport is None or self._transport.is_closing():
            return
        self._disarm_idle_timer()
        self._idle_timer = asyncio.get_running_loop().call_later(self._state.keep_alive_timeout_s, self.drain)

    def _disarm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _refuse_http1(self) -> None:
        # SDCP 5.1: HTTP/2 or HTTP/3 is REQUIRED.
        if self._transport is None or self._transport.is_closing():
            return
        body = problem_body(HTTPVersionNotSupported("SDCP requires HTTP/2 or HTTP/3"))
        head = (
            f"HTTP/1.1 505 HTTP Version Not Supported\r\ncontent-type: {PROBLEM_MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self._transport.write(head.encode("ascii") + body)
        self._transport.close()

    def _flush(self) -> None:
        """Write what h2 has queued at the end of this loop iteration: the answers released
        together (16 sessions' output after one pass) leave in one TLS write, not one each."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_scheduled = False
        if self._h2 is None or self._transport is None or self._transport.is_closing():
            return
        data = self._h2.data_to_send()
        if data:
            self._transport.write(data)


async def run_lifespan(app: ASGIApp, started: asyncio.Future[str | None], stop: asyncio.Event) -> None:
    """The ASGI lifespan protocol: startup, then shutdown once ``stop`` is set.

    ``started`` gets None when startup completed (or the app has no lifespan support) and the
    failure message when it failed.
    """
    phase = "startup"

    async def receive() -> dict[str, Any]:
        if phase == "startup":
            return {"type": "lifespan.startup"}
        await stop.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: Mapping[str, Any]) -> None:
        nonlocal phase
        kind = message["type"]
        if kind == "lifespan.startup.complete" and not started.done():
            phase = "running"
            started.set_result(None)
        elif kind == "lifespan.startup.failed" and not started.done():
            started.set_result(str(message.get("message", "")) or "startup failed")

    try:
        await app({"type": "lifespan", "asgi": _ASGI, "state": {}}, receive, send)
    except Exception as exc:  # noqa: BLE001 - an app without lifespan support raises or returns
        if phase == "startup" and not started.done():
            _log.debug("the app does not take part in the lifespan protocol: %r", exc)
    finally:
        if not started.done():
            started.set_result(None)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def _address(value: object) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return str(value[0]), int(value[1])
    return None


class H2Listener:
    """Serves an ASGI app on a bound socket: lifespan, connections, graceful stop."""

    def __init__(
        self,
        app: ASGIApp,
        ssl_context: Any,
        *,
        max_concurrent_streams: int,
        keep_alive_max_requests: int,
        keep_alive_timeout_s: float,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self._app = app
        self._ssl_context = ssl_context
        self.state = H2ServerState(
            max_concurrent_streams, keep_alive_max_requests, keep_alive_timeout_s, max_body_bytes, body_timeout_s
        )
        self._server: asyncio.Server | None = None
        self._lifespan: asyncio.Task[None] | None = None
        self._lifespan_stop = asyncio.Event()

    async def start(self, sock: Any, *, startup_timeout_s: float) -> str | None:
        """Run the app's startup, then accept connections; the startup failure, or None."""
        started: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._lifespan = asyncio.create_task(run_lifespan(self._app, started, self._lifespan_stop))
        try:
            async with asyncio.timeout(startup_timeout_s):
                failure = await asyncio.shield(started)
        except TimeoutError:
            failure = f"the application did not start within {startup_timeout_s} s"
        if failure is not None:
            sock.close()
            await self._end_lifespan()
            return failure
        self._server = await asyncio.get_running_loop().create_server(
            lambda: H2ServerProtocol(self._app, self.state), sock=sock, ssl=self._ssl_context
        )
        return None

    async def stop(self, graceful_timeout_s: float, poll_s: float) -> None:
        """Stop accepting, let requests in flight finish (bounded), close every connection."""
        if self._server is not None:
            self._server.close()
        self.state.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + graceful_timeout_s
        # Aborted transports report their loss on a later loop iteration; this bounds the wait.
        give_up = deadline + _ABORT_WAIT_S
        while self.state.connections and loop.time() < give_up:
            if loop.time() >= deadline:
                self.state.abort_all()
            else:
                # TLS close waits for the peer's close_notify; shut down, answered and flushed,
                # nothing is lost by cutting a connection.
                for connection in list(self.state.connections):
                    if connection.settled and connection.flushed:
                        connection.abort()
            await asyncio.sleep(poll_s)
        if self._server is not None:
            await self._server.wait_closed()
        await self._end_lifespan()

    async def _end_lifespan(self) -> None:
        self._lifespan_stop.set()
        if self._lifespan is not None:
            await asyncio.gather(self._lifespan, return_exceptions=True)
