"""What a client can make the mTLS server hold, on 127.0.0.1: each abuse ends by itself, the server
answers within its limits, its memory stays bounded, and ordinary requests keep being served."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tests.waiting import eventually

from sdcp.protocol.codec import MEDIA_TYPE
from sdcp.transport import (
    Listener,
    MTLSServer,
    cbor_response,
    client_context,
    exception_handlers,
    read_cbor_body,
)

from .tls_harness import PKI, client_for

pytestmark = pytest.mark.timeout(120)

BODY_LIMIT = 16 << 20
MiB = 1 << 20


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * 4096


def abuse_app(handlers: list[asyncio.Task[object]]) -> Starlette:
    async def echo(request: Request) -> Response:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        return cbor_response(await read_cbor_body(request, max_size=BODY_LIMIT))

    async def wait(_request: Request) -> Response:
        handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        await asyncio.sleep(1.0)
        return cbor_response({"waited": True})

    async def ok(_request: Request) -> Response:
        return cbor_response({"ok": True})

    return Starlette(
        routes=[Route("/echo", echo, methods=["POST"]), Route("/wait", wait), Route("/ok", ok)],
        exception_handlers=exception_handlers(),
    )


@contextlib.asynccontextmanager
async def abuse_server(pki: PKI, handlers: list[asyncio.Task[object]]) -> AsyncIterator[MTLSServer]:
    listener = Listener.mtls(
        "127.0.0.1", 0, cert=pki.server.cert, key=pki.server.key, ca=pki.ca, max_body_bytes=BODY_LIMIT
    )
    # Short enough for a test: a stalled body is given up after half a second.
    server = MTLSServer(abuse_app(handlers), listener)
    server._h2.state.body_timeout_s = 0.5
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class RawClient:
    """An HTTP/2 client that does what well-behaved clients do not: it ignores limits and stalls."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.events: list[h2.events.Event] = []

    @classmethod
    async def connect(cls, server: MTLSServer, pki: PKI) -> RawClient:
        context = client_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
        client = cls(reader, writer)
        client.h2.initiate_connection()
        await client.flush()
        return client

    def headers(self, path: str, *, method: str = "POST", end: bool = False) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(
            stream_id,
            [
                (b":method", method.encode()),
                (b":path", path.encode()),
                (b":scheme", b"https"),
                (b":authority", b"127.0.0.1"),
                (b"content-type", MEDIA_TYPE.encode()),
            ],
            end_stream=end,
        )
        return stream_id

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    async def read_events(
        self, timeout: float = 5.0, until: Callable[[list[h2.events.Event]], bool] | None = None
    ) -> list[h2.events.Event]:
        """Events until ``until`` holds (or, without one, the server is quiet for a moment), the
        server closes, or ``timeout`` passes."""
        got: list[h2.events.Event] = []
        deadline = asyncio.get_running_loop().time() + timeout
        with contextlib.suppress(TimeoutError, ConnectionError, ssl.SSLError, h2.exceptions.ProtocolError):
            while until is None or not until(got):
                remaining = deadline - asyncio.get_running_loop().time()
                quiet = remaining if until is not None or not got else min(remaining, 0.3)
                data = await asyncio.wait_for(self.reader.read(65536), max(quiet, 0.01))
                if not data:
                    break
                got.extend(self.h2.receive_data(data))
                await self.flush()
        self.events.extend(got)
        return got

    def close(self) -> None:
        self.writer.close()


def terminated(events: list[h2.events.Event]) -> bool:
    """Whether the server has ended the connection (GOAWAY): read until then, not until it has been
    quiet for a moment, which a busy machine's server can be before it answers a flood."""
    return any(isinstance(event, h2.events.ConnectionTerminated) for event in events)


async def ordinary_request_works(server: MTLSServer, pki: PKI) -> None:
    async with client_for(server, pki, pki.drafter_b) as client:
        assert await client.get_cbor("ok") == (200, {"ok": True})


async def test_slowloris_headers_then_silence_is_given_up(pki: PKI) -> None:
    handlers: list[asyncio.Task[object]] = []
    async with abuse_server(pki, handlers) as server:
        raw = await RawClient.connect(server, pki)
        stalled = [raw.headers("/echo") for _ in range(20)]  # no body, no END_STREAM: silence
        await raw.flush()
        await ordinary_request_works(server, pki)  # served meanwhile

        def all_reset(events: list[h2.events.Event]) -> bool:
            return {e.stream_id for e in events if isinstance(e, h2.events.StreamReset)} >= set(stalled)

        events = await raw.read_events(timeout=5.0, until=all_reset)
        resets = {e.stream_id for e in events if isinstance(e, h2.events.StreamReset)}
        assert resets == set(stalled)
        await eventually(lambda: all(task.done() for task in handlers) and server._h2.state.in_flight == 0)
        assert handlers
        raw.close()


async def test_rapid_resets_end_the_connection_and_cancel_their_handlers(pki: PKI) -> None:
    handlers: list[asyncio.Task[object]] = []
    async with abuse_server(pki, handlers) as server:
        raw = await RawClient.connect(server, pki)
        for _ in range(1000):
            stream_id = raw.headers("/wait", method="GET", end=True)
            raw.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        with contextlib.suppress(ConnectionError):
            await raw.flush()
        events = await raw.read_events(until=terminated)
        goaway = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        await eventually(lambda: all(task.done() for task in handlers) and server._h2.state.in_flight == 0)
        # Every handler the resets left was cancelled, none waited out its second.
        assert all(task.cancelled() for task in handlers)
        await ordinary_request_works(server, pki)
        raw.close()


@pytest.mark.slow
async def test_ten_thousand_streams_on_one_connection(pki: PKI) -> None:
    handlers: list[asyncio.Task[object]] = []
    async with abuse_server(pki, handlers) as server:
        # A client within the advertised stream limit: every one of 10,000 requests is answered.
        before = rss_bytes()
        async with client_for(server, pki, pki.drafter_b) as client:
            answers = await asyncio.gather(*(client.get_cbor("ok") for _ in range(10_000)))
        assert answers == [(200, {"ok": True})] * 10_000
        assert rss_bytes() - before < 64 * MiB
        # A client that opens streams past the limit without waiting loses its connection.
        raw = await RawClient.connect(server, pki)
        for _ in range(2_000):
            raw.headers("/wait", method="GET", end=True)
        with contextlib.suppress(ConnectionError):
            await raw.flush()
        events = await raw.read_events(until=terminated)
        assert any(isinstance(e, h2.events.ConnectionTerminated) for e in events) or raw.reader.at_eof()
        await ordinary_request_works(server, pki)
        raw.close()


@pytest.mark.slow
async def test_a_50_mb_body_is_refused_while_it_arrives(pki: PKI) -> None:
    handlers: list[asyncio.Task[object]] = []
    async with abuse_server(pki, handlers) as server:
        before = rss_bytes()
        raw = await RawClient.connect(server, pki)
        stream_id = raw.headers("/echo")
        chunk = bytes(16384)
        sent = 0
        answer: list[h2.events.Event] = []
        # Send 50 MB as fast as the windows allow; the server stops it with 413 and RST_STREAM.
        while sent < 50 * 1000 * 1000 and not any(isinstance(e, h2.events.StreamReset) for e in answer):
            window = min(raw.h2.local_flow_control_window(stream_id), raw.h2.max_outbound_frame_size)
            if window >= len(chunk):
                raw.h2.send_data(stream_id, chunk)
                sent += len(chunk)
                await raw.flush()
                continue
            answer.extend(await raw.read_events(timeout=2.0))
        answer.extend(await raw.read_events(timeout=1.0))
        statuses = [dict(e.headers).get(b":status") for e in answer if isinstance(e, h2.events.ResponseReceived)]
        assert statuses == [b"413"]
        assert sent < 20 * MiB  # stopped near the limit, not after 50 MB
        # What the server held: the app's bytes up to its limit and one window, not the whole body.
        assert rss_bytes() - before < 48 * MiB
        await ordinary_request_works(server, pki)
        raw.close()


async def test_200_concurrent_long_polls_and_ordinary_requests(pki: PKI) -> None:
    handlers: list[asyncio.Task[object]] = []
    async with abuse_server(pki, handlers) as server:
        async with client_for(server, pki, pki.drafter_a) as polling, client_for(server, pki, pki.drafter_b) as other:
            polls = asyncio.gather(*(polling.get_cbor("wait") for _ in range(200)))
            await asyncio.sleep(0.2)
            assert await other.get_cbor("ok") == (200, {"ok": True})  # not stuck behind the polls
            assert await polls == [(200, {"waited": True})] * 200
