"""The SDCP listener: HTTP/2 over TLS 1.3, client certificates required, peer URI in the scope."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import shutil
import ssl
import subprocess

import httpx
import hyperframe.frame as frames
import pytest
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.protocol.h2 import H2Protocol
from prometheus_client import CollectorRegistry, Counter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sdcp.transport import (
    ClientCertificateRejected,
    FrontEndServer,
    Listener,
    MTLSServer,
    SDCPClient,
    ServerStartError,
    TLSFailure,
    cbor_response,
    client_context,
    exception_handlers,
    metrics_route,
    peer_uri,
)
from sdcp.transport.peer import peer_tls
from sdcp.transport.tls import server_context

from .tls_harness import PKI, client_for, mtls_listener, serving

pytestmark = pytest.mark.timeout(60)


async def whoami(request: Request) -> JSONResponse:
    tls = peer_tls(request) or {}
    return JSONResponse(
        {
            "peer": peer_uri(request),
            "http_version": request.scope["http_version"],
            "tls_version": tls.get("tls_version"),
            "client_port": request.scope["client"][1],
        }
    )


async def ok_cbor(_request: Request) -> Response:
    return cbor_response({"ok": True})


def whoami_app(registry: CollectorRegistry | None = None) -> Starlette:
    routes = [Route("/whoami", whoami), Route("/ok", ok_cbor)]
    if registry is not None:
        routes.append(metrics_route(registry=registry))
    return Starlette(routes=routes, exception_handlers=exception_handlers())


def httpx_client(pki: PKI, context: ssl.SSLContext) -> httpx.AsyncClient:
    return httpx.AsyncClient(http1=False, http2=True, verify=context, timeout=10)


def test_hypercorn_is_the_pinned_version_and_the_front_ends_patches_are_installed() -> None:
    # The patches wrap private hypercorn methods: an upgrade must be a deliberate, re-tested change.
    assert importlib.metadata.version("hypercorn") == "0.18.0"
    FrontEndServer(whoami_app(), Listener.front_end("127.0.0.1", 0))
    assert getattr(TCPServer.run, "__sdcp_connection_tracking__", False) is True
    assert TCPServer.run.__wrapped__.__qualname__ == "TCPServer.run"
    assert getattr(H2Protocol.handle, "__sdcp_h2_fix__", False) is True


async def test_http2_tls13_and_the_app_sees_the_client_uri(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        context = client_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
        async with httpx_client(pki, context) as client:
            response = await client.get(server.base_url + "whoami")
    assert response.http_version == "HTTP/2"
    assert response.extensions["network_stream"].get_extra_info("ssl_object") is not None
    assert response.json() == {
        "peer": pki.drafter_a.uri,
        "http_version": "2",
        "tls_version": 0x0304,
        "client_port": response.json()["client_port"],
    }


async def test_two_clients_with_different_certificates_are_told_apart(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a) as a, client_for(server, pki, pki.drafter_b) as b:
            seen = await asyncio.gather(*(c.get_bytes("whoami") for c in (a, b, a, b)))
    assert [json.loads(r.content)["peer"] for r in seen] == [pki.drafter_a.uri, pki.drafter_b.uri] * 2


async def test_many_concurrent_requests_share_one_connection(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        context = client_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
        async with httpx_client(pki, context) as client:
            responses = await asyncio.gather(*(client.get(server.base_url + "whoami") for _ in range(64)))
    assert {r.status_code for r in responses} == {200}
    assert {r.http_version for r in responses} == {"HTTP/2"}
    assert len({r.json()["client_port"] for r in responses}) == 1


@pytest.mark.parametrize("who", ["no certificate", "certificate from another CA"])
async def test_clients_without_a_trusted_certificate_are_refused_at_the_tls_layer(pki: PKI, who: str) -> None:
    cert, key = (None, None) if who == "no certificate" else (pki.rogue.cert, pki.rogue.key)
    reached = []

    async def record(request: Request) -> Response:
        reached.append(request)
        return Response(status_code=204)

    app = Starlette(routes=[Route("/whoami", record)])
    async with serving(app, mtls_listener(pki)) as server:
        context = client_context(cert, key, pki.ca)
        async with httpx_client(pki, context) as client:
            with pytest.raises(httpx.ReadError):
                await client.get(server.base_url + "whoami")
        if cert is not None and key is not None:
            async with client_for(server, pki, pki.rogue) as sdcp_client:
                with pytest.raises(ClientCertificateRejected):
                    await sdcp_client.get_cbor("whoami")
    assert reached == []


async def test_a_tls12_only_client_is_refused(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        context = client_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        # OpenSSL answers with a protocol_version alert or resets, depending on timing.
        with pytest.raises((ssl.SSLError, ConnectionResetError)):
            await asyncio.open_connection("127.0.0.1", server.port, ssl=context)


async def test_http1_over_the_sdcp_listener_gets_505(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        context = client_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
        context.set_alpn_protocols(["http/1.1"])
        async with httpx.AsyncClient(http1=True, http2=False, verify=context, timeout=10) as client:
            response = await client.get(server.base_url + "whoami")
    assert (response.http_version, response.status_code) == ("HTTP/1.1", 505)
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["status"] == 505


async def test_client_checks_the_server_identity(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a, server_identity=pki.server.uri) as right:
            status, body = await right.get_cbor("ok")
        assert (status, body) == (200, {"ok": True})
        async with client_for(server, pki, pki.drafter_a, server_identity=pki.drafter_b.uri) as wrong:
            with pytest.raises(TLSFailure, match="nothing was sent"):
                await wrong.get_cbor("whoami")


class _Recorder(asyncio.Protocol):
    """A TLS server that only records what arrives after the handshake."""

    received = bytearray()

    def data_received(self, data: bytes) -> None:
        _Recorder.received.extend(data)


async def test_an_impostor_with_a_valid_certificate_gets_not_a_byte(pki: PKI) -> None:
    # Another instance of the same CA (drafter A) listens on the port where the client expects the
    # server: the TLS handshake succeeds, and the client closes before sending its HTTP/2 preface.
    _Recorder.received = bytearray()
    impostor = await asyncio.get_running_loop().create_server(
        _Recorder, "127.0.0.1", 0, ssl=server_context(pki.drafter_a.cert, pki.drafter_a.key, pki.ca)
    )
    port = impostor.sockets[0].getsockname()[1]
    expected = f"https://127.0.0.1:{port}/"
    try:
        async with SDCPClient(expected, pki.drafter_b.cert, pki.drafter_b.key, pki.ca) as client:
            with pytest.raises(TLSFailure, match=f"certificate for .*{pki.drafter_a.uri}.*, not {expected}"):
                await client.post_cbor("proposals", {"secret": "prompt"})
        await asyncio.sleep(0.1)
        assert bytes(_Recorder.received) == b""
    finally:
        impostor.close()
        await impostor.wait_closed()


async def test_client_refuses_a_server_from_another_ca(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        async with SDCPClient(server.base_url, pki.drafter_a.cert, pki.drafter_a.key, pki.other_ca) as untrusting:
            with pytest.raises(TLSFailure, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.get_cbor("whoami")


async def test_metrics_are_served_to_any_authenticated_peer(pki: PKI) -> None:
    registry = CollectorRegistry()
    Counter("sdcp_rounds", "Rounds verified", registry=registry).inc(3)
    async with serving(whoami_app(registry), mtls_listener(pki)) as server:
        context = client_context(pki.drafter_b.cert, pki.drafter_b.key, pki.ca)
        async with httpx_client(pki, context) as client:
            response = await client.get(server.base_url + "metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "sdcp_rounds_total 3.0" in response.text.splitlines()


async def test_front_end_listener_plain_on_loopback_and_tls_without_client_certs(pki: PKI) -> None:
    async with serving(whoami_app(), Listener.front_end("127.0.0.1", 0)) as plain:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(plain.base_url + "whoami")
    assert (response.http_version, response.json()["peer"]) == ("HTTP/1.1", None)
    assert plain.base_url.startswith("http://")

    listener = Listener.front_end("127.0.0.1", 0, cert=pki.server.cert, key=pki.server.key)
    async with serving(whoami_app(), listener) as tls:
        trusting = ssl.create_default_context(cafile=str(pki.ca))
        async with httpx.AsyncClient(verify=trusting, timeout=10) as client:
            response = await client.get(tls.base_url + "whoami")
    assert response.status_code == 200 and response.json()["peer"] is None

    with pytest.raises(ValueError, match="loopback"):
        Listener.front_end("0.0.0.0", 0)


async def test_graceful_shutdown_lets_a_request_in_flight_finish(pki: PKI) -> None:
    entered, released = asyncio.Event(), asyncio.Event()

    async def slow(_request: Request) -> Response:
        entered.set()
        await released.wait()
        return Response(b"done")

    app = Starlette(routes=[Route("/slow", slow)])
    server = MTLSServer(app, mtls_listener(pki))
    await server.start()
    async with client_for(server, pki, pki.drafter_a) as client:
        in_flight = asyncio.create_task(client.get_bytes("slow"))
        await entered.wait()
        stopping = asyncio.create_task(server.stop())
        await asyncio.sleep(0)  # the stop has begun while the request is held in its handler
        released.set()
        await stopping
        response = await in_flight
    assert response.content == b"done"
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_graceful_shutdown_is_two_goaways_and_answers_what_it_took(pki: PKI) -> None:
    # RFC 9113 6.8: GOAWAY with 2^31-1 and a PING, then GOAWAY with the last stream taken; the
    # stream in flight is answered after both.
    from .h2_wire import Wire

    entered, released = asyncio.Event(), asyncio.Event()

    async def slow(_request: Request) -> Response:
        entered.set()
        await released.wait()
        return Response(b"done")

    server = MTLSServer(Starlette(routes=[Route("/slow", slow)]), mtls_listener(pki))
    await server.start()
    wire = await Wire.open(server, pki)
    await wire.send(wire.headers(1, path=b"/slow"))
    async with asyncio.timeout(10):
        await entered.wait()
    stopping = asyncio.create_task(server.stop())
    seen = await wire.until((frames.PingFrame,))
    ping = next(f for f in seen if isinstance(f, frames.PingFrame))
    answer = frames.PingFrame(0, flags=["ACK"])
    answer.opaque_data = ping.opaque_data
    await wire.send(answer)  # the client has seen the first GOAWAY
    seen += await wire.until((frames.GoAwayFrame,))  # the second, naming the stream it took
    released.set()
    seen += await wire.until((frames.DataFrame,))
    await stopping
    goaways = [f.last_stream_id for f in seen if isinstance(f, frames.GoAwayFrame)]
    assert goaways[:2] == [2**31 - 1, 1]
    data = [f for f in seen if isinstance(f, frames.DataFrame) and f.stream_id == 1]
    assert data and data[0].data == b"done"
    wire.close()


async def test_bind_failure_and_startup_failure_are_reported(pki: PKI) -> None:
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        taken = Listener.mtls("127.0.0.1", server.port, cert=pki.server.cert, key=pki.server.key, ca=pki.ca)
        with pytest.raises(ServerStartError, match="cannot listen"):
            await MTLSServer(whoami_app(), taken).start()

    def failing_lifespan(_app: Starlette) -> object:
        raise RuntimeError("model weights missing")

    broken = Starlette(lifespan=failing_lifespan)  # type: ignore[arg-type]
    with pytest.raises(ServerStartError, match="startup failed"):
        await MTLSServer(broken, mtls_listener(pki)).start()


async def test_curl_with_client_certificate(pki: PKI) -> None:
    assert shutil.which("curl"), "this test runs curl (Debian: apt-get install curl)"
    assert "HTTP2" in subprocess.run(["curl", "-V"], capture_output=True, text=True).stdout, "curl lacks HTTP/2"
    async with serving(whoami_app(), mtls_listener(pki)) as server:
        # The command documented in docs/transport.md.
        command = [
            "curl", "--silent", "--show-error", "--http2", "--tlsv1.3",
            "--cert", str(pki.drafter_a.cert), "--key", str(pki.drafter_a.key), "--cacert", str(pki.ca),
            "--write-out", "\n%{http_version}", server.base_url + "whoami",
        ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 0, stderr.decode()
    body, http_version = stdout.decode().rsplit("\n", 1)
    assert http_version == "2"
    assert json.loads(body)["peer"] == pki.drafter_a.uri
