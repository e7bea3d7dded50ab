"""Service helpers: early answers keep the connection alive, problems round-trip to the client."""

from __future__ import annotations

import asyncio

import cbor2
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sdcp.protocol.codec import MEDIA_TYPE
from sdcp.protocol.problems import BadContract, BadMessage, ProblemType, ProtocolError
from sdcp.transport import (
    PeerClientError,
    PeerServerError,
    UnexpectedResponse,
    cbor_response,
    client_context,
    exception_handlers,
    read_cbor_body,
    require_peer,
)

from .tls_harness import PKI, client_for, mtls_listener, serving

pytestmark = pytest.mark.timeout(60)

BODY_LIMIT = 4096
# Several HTTP/2 DATA frames and more than the initial flow-control window: body data keeps
# arriving after an early answer would have been sent.
LARGE_BODY = cbor2.dumps({"pad": b"\x00" * 200_000})


class RecordClientPorts:
    """Notes the client port of every request that reaches the application."""

    def __init__(self, app: ASGIApp, ports: list[int]) -> None:
        self.app = app
        self.ports = ports

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.ports.append(scope["client"][1])
        await self.app(scope, receive, send)


def service_app(pki: PKI, release: asyncio.Event) -> Starlette:
    async def echo(request: Request) -> Response:
        return cbor_response(await read_cbor_body(request, max_size=BODY_LIMIT))

    async def drafter_only(request: Request) -> Response:
        await require_peer(request, {pki.drafter_a.uri})
        return cbor_response(await read_cbor_body(request, max_size=10**6))

    async def ignores_body(_request: Request) -> Response:
        return Response(status_code=204)

    async def slow(_request: Request) -> Response:
        await release.wait()
        return cbor_response({"slow": "done"})

    async def raise_protocol_error(request: Request) -> Response:
        kind = request.query_params["kind"]
        if kind == "limit":
            raise ProtocolError(ProblemType.LIMIT, "M exceeds m_cap")
        if kind == "contract":
            raise BadContract("unknown key 'x'")
        if kind == "closed":
            raise ProtocolError(ProblemType.SESSION_CLOSED, "session finished")
        raise RuntimeError("secret internal path /var/lib/model")

    async def bare_status(request: Request) -> Response:
        return Response(b"plain words", status_code=int(request.query_params["status"]), media_type="text/plain")

    async def wrong_media_type(_request: Request) -> Response:
        return Response(b"{}", media_type="application/json")

    async def predicate_peer(request: Request) -> Response:
        async def is_drafter_b(uri: str) -> bool:
            return uri == pki.drafter_b.uri

        return cbor_response({"peer": await require_peer(request, is_drafter_b)})

    return Starlette(
        routes=[
            Route("/echo", echo, methods=["POST"]),
            Route("/drafter-only", drafter_only, methods=["POST"]),
            Route("/ignores-body", ignores_body, methods=["POST"]),
            Route("/slow", slow),
            Route("/fail", raise_protocol_error),
            Route("/predicate", predicate_peer),
            Route("/status", bare_status),
            Route("/json", wrong_media_type),
        ],
        exception_handlers=exception_handlers(),
    )


async def test_early_answers_do_not_break_other_streams_on_the_connection(pki: PKI) -> None:
    release = asyncio.Event()
    client_ports: list[int] = []
    app = RecordClientPorts(service_app(pki, release), client_ports)
    async with serving(app, mtls_listener(pki)) as server:
        context = client_context(pki.drafter_b.cert, pki.drafter_b.key, pki.ca)
        async with httpx.AsyncClient(http1=False, http2=True, verify=context, timeout=20) as client:
            url = server.base_url
            slow = asyncio.create_task(client.get(url + "slow"))
            cbor = {"content-type": MEDIA_TYPE}
            early = await asyncio.gather(
                client.post(url + "drafter-only", content=LARGE_BODY, headers=cbor),  # 403 before reading
                client.post(url + "echo", content=LARGE_BODY, headers={"content-type": "application/json"}),
                client.post(url + "echo", content=LARGE_BODY, headers=cbor),  # 413
                client.post(url + "echo", content=b"\xff\x00garbage", headers=cbor),  # 400 after reading
                client.post(url + "ignores-body", content=LARGE_BODY, headers=cbor),
                client.post(url + "no-such-route", content=LARGE_BODY, headers=cbor),
                client.post(url + "slow", content=LARGE_BODY, headers=cbor),  # 405
            )
            release.set()
            slow_response = await slow
            after = await client.post(url + "echo", content=cbor2.dumps({"ok": 1}), headers=cbor)
    assert [r.status_code for r in early] == [403, 415, 413, 400, 204, 404, 405]
    for response in early:
        if response.status_code != 204:
            assert response.headers["content-type"] == "application/problem+json"
            assert response.json()["status"] == response.status_code
    assert slow_response.status_code == 200 and cbor2.loads(slow_response.content) == {"slow": "done"}
    assert after.status_code == 200 and cbor2.loads(after.content) == {"ok": 1}
    assert len(client_ports) == len(early) + 2 and len(set(client_ports)) == 1


async def test_problem_responses_parse_back_into_the_same_error_types(pki: PKI) -> None:
    async with serving(service_app(pki, asyncio.Event()), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a) as client:
            with pytest.raises(ProtocolError) as limit:
                await client.get_cbor("fail", {"kind": "limit"})
            with pytest.raises(BadContract) as contract:
                await client.get_cbor("fail", {"kind": "contract"})
            with pytest.raises(ProtocolError) as closed:
                await client.get_cbor("fail", {"kind": "closed"})
            with pytest.raises(BadMessage) as malformed:
                await client._exchange("POST", "echo", body=b"\xa1", idempotent=False, timeout=None)
            with pytest.raises(ProtocolError) as too_large:
                await client.post_cbor("echo", {"pad": b"\x00" * (BODY_LIMIT + 1)})
    assert (limit.value.problem, limit.value.status, limit.value.detail) == (ProblemType.LIMIT, 422, "M exceeds m_cap")
    assert contract.value.problem is ProblemType.BAD_CONTRACT and contract.value.detail == "unknown key 'x'"
    assert (closed.value.problem, closed.value.status) == (ProblemType.SESSION_CLOSED, 410)
    assert malformed.value.status == 400
    assert (too_large.value.problem, too_large.value.status) == (None, 413)


async def test_unexpected_errors_become_500_problems_without_internals(
    pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    async with serving(service_app(pki, asyncio.Event()), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a) as client:
            with pytest.raises(PeerServerError) as failure:
                await client.get_cbor("fail", {"kind": "crash"})
            with pytest.raises(ProtocolError) as missing:
                await client.get_cbor("no-such-route")
    assert failure.value.status == 500
    assert failure.value.problem == {"type": "about:blank", "title": "Internal Server Error", "status": 500}
    assert "secret" not in str(failure.value)
    assert (missing.value.status, missing.value.problem) == (404, None)
    # The internals go to the server's log, not to the client; this error is the test's own.
    assert any("secret internal path" in r.getMessage() or r.exc_info for r in caplog.records if r.levelname == "ERROR")
    caplog.clear()


@pytest.mark.parametrize(
    ("status", "error"),
    [(418, PeerClientError), (451, PeerClientError), (503, PeerServerError), (599, PeerServerError)],
)
async def test_statuses_without_problem_bodies_are_handled_by_class(pki: PKI, status: int, error: type) -> None:
    async with serving(service_app(pki, asyncio.Event()), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a) as client:
            with pytest.raises(error) as raised:
                await client.get_cbor("status", {"status": status})
    assert (raised.value.status, raised.value.problem, raised.value.detail) == (status, None, "plain words")


async def test_answers_outside_sdcp_are_unexpected_responses(pki: PKI) -> None:
    async with serving(service_app(pki, asyncio.Event()), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a) as client:
            with pytest.raises(UnexpectedResponse, match="application/json"):
                await client.get_cbor("json")
            with pytest.raises(UnexpectedResponse, match="300"):
                await client.get_cbor("status", {"status": 300})
            assert await client.get_cbor("status", {"status": 204}) == (204, None)


async def test_require_peer_with_a_set_and_with_a_predicate(pki: PKI) -> None:
    async with serving(service_app(pki, asyncio.Event()), mtls_listener(pki)) as server:
        async with client_for(server, pki, pki.drafter_a) as a, client_for(server, pki, pki.drafter_b) as b:
            assert await a.post_cbor("drafter-only", {"n": 1}) == (200, {"n": 1})
            with pytest.raises(ProtocolError) as refused:
                await b.post_cbor("drafter-only", {"n": 1})
            assert await b.get_cbor("predicate") == (200, {"peer": pki.drafter_b.uri})
            with pytest.raises(ProtocolError):
                await a.get_cbor("predicate")
    assert refused.value.status == 403 and refused.value.problem is None
    assert pki.drafter_b.uri in refused.value.detail
