"""Client retries: GOAWAY after keep_alive_max_requests, connections lost mid-request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tests.waiting import eventually

from sdcp.transport import (
    ConnectionLost,
    MTLSServer,
    PeerClients,
    PeerServerError,
    PeerTimeout,
    RetryPolicy,
    SDCPClient,
    UnexpectedResponse,
    cbor_response,
    exception_handlers,
    read_cbor_body,
)

from .tls_harness import PKI, client_for, mtls_listener, serving

pytestmark = pytest.mark.timeout(60)


class CuttingProxy:
    """A TCP relay in front of a server that can abort every relayed connection on demand, or hold
    their bytes (a partition: nothing is relayed, nothing closed) until released."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.accepted = 0
        self._transports: list[asyncio.StreamWriter] = []
        self._flowing = asyncio.Event()
        self._flowing.set()

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        for writer in self._transports:
            writer.transport.abort()
        self._transports.clear()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[CuttingProxy]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        try:
            yield self
        finally:
            self.cut()
            server.close()
            await server.wait_closed()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._transports += [client_writer, server_writer]

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await reader.read(65536):
                    await self._flowing.wait()
                    writer.write(data)
                    await writer.drain()
            writer.transport.abort()

        await asyncio.gather(pump(client_reader, server_writer), pump(server_reader, client_writer))


def counting_app(calls: list[str], on_call: list[CuttingProxy]) -> Starlette:
    """Each request is counted; the first call of a given key cuts the connection it came on."""

    async def handle(request: Request) -> Response:
        body = await read_cbor_body(request) if request.method != "GET" else dict(request.query_params)
        assert isinstance(body, dict)
        key = str(body["key"])
        calls.append(key)
        if calls.count(key) == 1 and on_call:
            # abort() is immediate: this answer has no connection left to travel on.
            on_call[0].cut()
        return cbor_response({"key": key, "calls": calls.count(key)})

    return Starlette(
        routes=[Route("/op", handle, methods=["GET", "PUT", "POST"])], exception_handlers=exception_handlers()
    )


def proxied_client(pki: PKI, proxy: CuttingProxy) -> SDCPClient:
    return SDCPClient(
        f"https://127.0.0.1:{proxy.port}/",
        pki.drafter_a.cert,
        pki.drafter_a.key,
        pki.ca,
        retry=RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.02),
        server_identity=pki.server.uri,
    )


async def test_idempotent_calls_are_retried_after_the_connection_is_lost(pki: PKI) -> None:
    calls: list[str] = []
    cutter: list[CuttingProxy] = []
    async with serving(counting_app(calls, cutter), mtls_listener(pki)) as server:
        async with CuttingProxy(server.port).running() as proxy:
            cutter.append(proxy)
            async with proxied_client(pki, proxy) as client:
                assert await client.get_cbor("op", {"key": "g"}) == (200, {"key": "g", "calls": 2})
                assert await client.put_cbor("op", {"key": "u"}) == (200, {"key": "u", "calls": 2})
                proposal = {"key": "p"}
                assert await client.post_cbor("op", proposal, idempotent=True) == (200, {"key": "p", "calls": 2})
    assert calls == ["g", "g", "u", "u", "p", "p"]


async def test_a_non_idempotent_post_is_not_repeated(pki: PKI) -> None:
    calls: list[str] = []
    cutter: list[CuttingProxy] = []
    async with serving(counting_app(calls, cutter), mtls_listener(pki)) as server:
        async with CuttingProxy(server.port).running() as proxy:
            cutter.append(proxy)
            async with proxied_client(pki, proxy) as client:
                with pytest.raises(ConnectionLost, match="1 attempt"):
                    await client.post_cbor("op", {"key": "once"})
    assert calls == ["once"]


async def test_retries_are_bounded(pki: PKI) -> None:
    async with serving(counting_app([], []), mtls_listener(pki)) as server:
        port = server.port
    client = SDCPClient(
        f"https://127.0.0.1:{port}/", pki.drafter_a.cert, pki.drafter_a.key, pki.ca,
        retry=RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.02),
    )  # fmt: skip
    async with client:
        with pytest.raises(ConnectionLost, match="cannot connect"):
            await client.get_cbor("op", {"key": "k"})


async def test_goaway_after_keep_alive_max_requests_is_retried(pki: PKI) -> None:
    calls: list[str] = []
    server = MTLSServer(counting_app(calls, []), mtls_listener(pki, keep_alive_max_requests=3))
    await server.start()
    try:
        async with client_for(server, pki, pki.drafter_a) as client:
            for round_number in range(8):
                status, _ = await client.post_cbor("op", {"key": f"s{round_number}"}, idempotent=True)
                assert status == 200
        # Requests multiplexed past the limit are refused by GOAWAY together; each retry round
        # gets at least keep_alive_max_requests of them through.
        burst = RetryPolicy(attempts=6, backoff_s=0.01, max_backoff_s=0.02)
        async with client_for(server, pki, pki.drafter_a, retry=burst) as client:
            answers = await asyncio.gather(*(client.get_cbor("op", {"key": f"c{i}"}) for i in range(6)))
    finally:
        loop = asyncio.get_running_loop()
        stop_started = loop.time()
        await server.stop()
    # Connections dropped under a response do not hold shutdown up to graceful_timeout_s
    # (sdcp.transport.h2fix).
    assert loop.time() - stop_started < server.listener.graceful_timeout_s / 2
    assert {status for status, _ in answers} == {200}
    assert {f"s{i}" for i in range(8)} | {f"c{i}" for i in range(6)} <= set(calls)


def echo_app() -> Starlette:
    """PUT /echo answers with the request body; GET /whoami names the client's port."""

    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/octet-stream")

    async def whoami(request: Request) -> Response:
        assert request.client is not None
        return cbor_response({"port": request.client.port})

    return Starlette(routes=[Route("/echo", echo, methods=["PUT"]), Route("/whoami", whoami)])


async def test_large_bodies_flow_both_ways(pki: PKI) -> None:
    # Larger than every HTTP/2 flow-control window on either side: the sender must wait for
    # WINDOW_UPDATE frames, the receiver must send them.
    payload = bytes(range(256)) * (6 * 4096 + 7)
    async with serving(echo_app(), mtls_listener(pki)) as server, client_for(server, pki, pki.drafter_a) as client:
        answers = await asyncio.gather(*(client.put_bytes("echo", payload) for _ in range(3)))
    assert all(answer.content == payload for answer in answers)


async def test_concurrent_requests_share_one_connection(pki: PKI) -> None:
    async with serving(echo_app(), mtls_listener(pki)) as server, client_for(server, pki, pki.drafter_a) as client:
        answers = await asyncio.gather(*(client.get_cbor("whoami") for _ in range(64)))
    assert {status for status, _ in answers} == {200}
    assert len({body["port"] for _, body in answers}) == 1  # type: ignore[index]


async def test_an_unanswered_request_times_out(pki: PKI) -> None:
    async def never(_request: Request) -> Response:
        await asyncio.sleep(30)
        return Response(status_code=204)

    async def ok(_request: Request) -> Response:
        return cbor_response({"ok": True})

    app = Starlette(routes=[Route("/never", never), Route("/ok", ok)])
    async with serving(app, mtls_listener(pki)) as server, client_for(server, pki, pki.drafter_a) as client:
        with pytest.raises(PeerTimeout, match="timed out"):
            await client.get_cbor("never", timeout=0.3)
        # The abandoned stream was reset; the peer, only slow, answered the PING that followed the
        # timeout, and the same connection carries the next request.
        connection = client._connection
        await eventually(lambda: not client._pings)
        assert await client.get_cbor("ok") == (200, {"ok": True})
        assert client._connection is connection


async def test_a_connection_that_answers_no_ping_after_a_timeout_is_dropped(
    pki: PKI, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A partition that heals leaves a TCP connection waiting for its retransmission backoff: the
    # client drops a connection silent after a timeout, and the next request opens another.
    monkeypatch.setattr("sdcp.transport.client.PING_TIMEOUT_S", 0.2)
    calls: list[str] = []
    async with serving(counting_app(calls, []), mtls_listener(pki)) as server:
        async with CuttingProxy(server.port).running() as proxy, proxied_client(pki, proxy) as client:
            assert await client.get_cbor("op", {"key": "before"}) == (200, {"key": "before", "calls": 1})
            silent = client._connection
            assert silent is not None
            proxy.hold()
            with pytest.raises(PeerTimeout):
                await client.get_cbor("op", {"key": "held"}, timeout=0.2)
            await eventually(lambda: not silent.usable)
            proxy.release()
            assert await client.get_cbor("op", {"key": "after"}) == (200, {"key": "after", "calls": 1})
            assert proxy.accepted == 2


async def test_idle_connections_are_closed_and_opened_again(pki: PKI) -> None:
    listener = mtls_listener(pki, keep_alive_timeout_s=0.2)
    async with serving(echo_app(), listener) as server, client_for(server, pki, pki.drafter_a) as client:
        _, first = await client.get_cbor("whoami")
        await asyncio.sleep(0.6)
        _, second = await client.get_cbor("whoami")
    assert first != second  # type: ignore[comparison-overlap]


async def test_an_app_that_does_not_answer_gets_a_500_problem(pki: PKI) -> None:
    async def silent(scope: dict[str, object], receive: object, send: object) -> None:
        if scope["type"] == "lifespan":
            raise RuntimeError("no lifespan support")

    async with serving(silent, mtls_listener(pki)) as server, client_for(server, pki, pki.drafter_a) as client:
        with pytest.raises(PeerServerError) as failed:
            await client.get_cbor("anything")
    assert failed.value.status == 500 and failed.value.problem is not None


async def test_peer_clients_keep_one_client_per_peer(pki: PKI) -> None:
    async with (
        serving(counting_app([], []), mtls_listener(pki)) as first,
        serving(counting_app([], []), mtls_listener(pki)) as second,
    ):
        peers = PeerClients(pki.drafter_a.cert, pki.drafter_a.key, pki.ca, server_identity=pki.server.uri)
        try:
            assert peers.get(first.base_url) is peers.get(first.base_url)
            assert peers.get(first.base_url) is not peers.get(second.base_url)
            assert await peers.get(second.base_url).get_cbor("op", {"key": "x"}) == (200, {"key": "x", "calls": 1})
        finally:
            await peers.aclose()


def test_retry_policy_and_client_arguments_are_checked(pki: PKI) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(backoff_s=-1)
    with pytest.raises(ValueError, match="https"):
        SDCPClient("http://127.0.0.1:1/", pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
    assert all(0 <= RetryPolicy(backoff_s=0.1, max_backoff_s=0.3).delay(n) <= 0.3 for n in range(10))


class EarlyAnswerServer(asyncio.Protocol):
    """A raw HTTP/2 server, one stream at a time, that answers 413 on a request's headers without
    reading the body (RFC 9113 8.1 allows it), opening no flow-control window for it; with
    ``reset``, it then resets the stream with NO_ERROR, as 8.1 suggests."""

    def __init__(self, reset: bool) -> None:
        self.reset = reset

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import h2.config
        import h2.connection

        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.local_settings.max_concurrent_streams = 1
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        import h2.errors
        import h2.events

        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.h2.send_headers(event.stream_id, [(":status", "413"), ("content-length", "0")], end_stream=True)
                if self.reset:
                    self.h2.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)
        self.transport.write(self.h2.data_to_send())


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "no-reset"])
async def test_an_answer_before_the_whole_body_was_sent_is_the_outcome(pki: PKI, reset: bool) -> None:
    from sdcp.transport import PeerClientError
    from sdcp.transport.tls import server_context

    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: EarlyAnswerServer(reset), "127.0.0.1", 0, ssl=server_context(pki.server.cert, pki.server.key, pki.ca)
    )
    port = server.sockets[0].getsockname()[1]
    client = SDCPClient(
        f"https://127.0.0.1:{port}/", pki.drafter_a.cert, pki.drafter_a.key, pki.ca, server_identity=pki.server.uri
    )
    try:
        # Four times the initial flow-control window: the client is still sending when the answer
        # arrives. The peer takes one stream at a time: the second request needs the first closed.
        for _ in range(2):
            with pytest.raises(PeerClientError) as refused:
                await client.put_bytes("upload", bytes(4 * 65535), timeout=5)
            assert refused.value.status == 413
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_an_answer_past_the_limit_is_refused_while_it_arrives(pki: PKI) -> None:
    big = bytes(3 << 20)

    async def octets(_request: Request) -> Response:
        return Response(big, media_type="application/octet-stream")

    async def cbor(_request: Request) -> Response:
        return Response(b"\x5a" + len(big).to_bytes(4, "big") + big, media_type="application/sdcp+cbor")

    app = Starlette(routes=[Route("/octets", octets), Route("/cbor", cbor)])
    async with (
        serving(app, mtls_listener(pki)) as server,
        client_for(server, pki, pki.drafter_a, max_object_size=1 << 20) as client,
    ):
        with pytest.raises(UnexpectedResponse, match="exceeds"):
            await client.get_bytes("octets")
        with pytest.raises(UnexpectedResponse, match="exceeds"):
            await client.get_cbor("cbor")  # the default limit of an SDCP message, 1 MiB
        # The connection carries on.
        async with client_for(server, pki, pki.drafter_a) as roomy:
            assert (await roomy.get_bytes("octets")).content == big


class TwoStepShutdownServer(asyncio.Protocol):
    """A raw HTTP/2 server that shuts down as RFC 9113 6.8 describes, as Go's server does: on each
    request, GOAWAY with 2^31-1 and a PING, then GOAWAY with the last stream it took, then the answer."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        import h2.config
        import h2.connection

        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        import h2.events
        import hyperframe.frame

        def goaway(last: int) -> bytes:
            frame = hyperframe.frame.GoAwayFrame(0)
            frame.last_stream_id, frame.error_code = last, 0
            return frame.serialize()

        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.transport.write(self.h2.data_to_send() + goaway(2**31 - 1))
                self.h2.ping(b"shutdown")
                self.transport.write(self.h2.data_to_send() + goaway(event.stream_id))
                body = cbor2_dumps({"answered": event.stream_id})
                headers = [(":status", "200"), ("content-type", "application/sdcp+cbor")]
                self.h2.send_headers(event.stream_id, headers)
                self.h2.send_data(event.stream_id, body, end_stream=True)
        self.transport.write(self.h2.data_to_send())


def cbor2_dumps(obj: object) -> bytes:
    from sdcp.protocol.codec import encode

    return encode(obj)


async def test_a_two_step_goaway_still_delivers_the_answers_it_promises(pki: PKI) -> None:
    from sdcp.transport.tls import server_context

    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        TwoStepShutdownServer, "127.0.0.1", 0, ssl=server_context(pki.server.cert, pki.server.key, pki.ca)
    )
    port = server.sockets[0].getsockname()[1]
    client = SDCPClient(
        f"https://127.0.0.1:{port}/", pki.drafter_a.cert, pki.drafter_a.key, pki.ca, server_identity=pki.server.uri
    )
    try:
        # Each request is answered after the server's two GOAWAYs; the next one opens a new connection.
        assert await client.get_cbor("first") == (200, {"answered": 1})
        assert await client.get_cbor("second") == (200, {"answered": 1})
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
