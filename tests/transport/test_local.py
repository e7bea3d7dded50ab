"""A peer of this very process (sdcp.transport.local): asked by a call, it answers what it answers
over HTTP/2 + mTLS, to the identity the caller's certificate carries."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.transport import (
    ConnectionLost,
    PeerClients,
    PeerServerError,
    PeerTimeout,
    SDCPClient,
    UnexpectedResponse,
    cbor_response,
    exception_handlers,
    peer_uri,
    read_cbor_body,
)
from sdcp.transport.local import LocalGate, LocalPeer, serve_locally

from .tls_harness import PKI, Identity, client_for, mtls_listener, serving

pytestmark = pytest.mark.timeout(60)


# A context variable of the caller: the peer's handlers, as a listener's, do not see it.
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller", default=None)

# Where the peer's listener would be; it is asked by a call.
LOCAL_URI = "https://127.0.0.1:9443/"


class Watch:
    """When the handler that never answers started, and the paths of those whose caller left."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        # Never set but by a test that lets the handler that never answers answer after all.
        self.released = asyncio.Event()
        self.gone = asyncio.Event()
        self.left: list[str] = []


def peer_app(*, pki: PKI, watch: Watch | None = None) -> Starlette:
    """whoami: the caller's identity; echo: a CBOR body and a query back; assigned: only drafter A
    (the others get SDCP's problem); never: no answer until its caller leaves; big: 64 KiB."""
    watching = watch if watch is not None else Watch()

    async def whoami(request: Request) -> Response:
        return cbor_response({"peer": peer_uri(request), "host": request.headers.get("host")})

    async def echo(request: Request) -> Response:
        body = await read_cbor_body(request)
        length = request.headers.get("content-length")
        return cbor_response({"body": body, "n": request.query_params.get("n"), "length": length}, 201)

    async def assigned(request: Request) -> Response:
        if peer_uri(request) != pki.drafter_a.uri:
            raise ProtocolError(ProblemType.NOT_ASSIGNED, "not the drafter of the session")
        return Response(status_code=204)

    async def never(request: Request) -> Response:
        watching.started.set()
        try:
            await watching.released.wait()
        finally:
            watching.left.append(request.url.path)
            watching.gone.set()
        return Response(status_code=204)

    async def after_answering() -> None:
        await asyncio.sleep(0)
        watching.left.append("after its answer")
        watching.gone.set()

    async def later(_request: Request) -> Response:
        return Response(status_code=204, background=BackgroundTask(after_answering))

    async def context(_request: Request) -> Response:
        return cbor_response({"caller": CALLER.get() or "unset"})

    async def big(_request: Request) -> Response:
        return Response(b"x" * 65536, media_type="application/octet-stream")

    return Starlette(
        routes=[
            Route("/whoami", whoami),
            Route("/echo", echo, methods=["POST"]),
            Route("/assigned", assigned, methods=["PUT"]),
            Route("/never", never),
            Route("/big", big),
            Route("/context", context),
            Route("/later", later),
        ],
        exception_handlers=exception_handlers(),
    )


def local_peer(
    pki: PKI, identity: Identity, app: Starlette, gate: LocalGate | None = None, **options: object
) -> SDCPClient:
    peers = PeerClients(identity.cert, identity.key, pki.ca, **options)
    serve_locally(peers, {LOCAL_URI: (app, gate if gate is not None else LocalGate())})
    return peers.get(LOCAL_URI)


async def outcomes(client: SDCPClient) -> list[object]:
    """What each request gives: its answer, or the error's type and problem type."""
    answers: list[object] = []
    for request in (
        client.get_cbor("whoami"),
        client.post_cbor("echo", {"tokens": [1, 2, 3]}, params={"n": 7}),
        client.put_cbor("assigned", {}),
    ):
        try:
            answers.append(await request)
        except ProtocolError as error:
            answers.append((type(error), error.problem, error.status))
    head = await client.head("big")
    answers.append((head.status, head.content))
    return answers


async def test_a_local_peer_answers_what_it_answers_over_mtls(pki: PKI) -> None:
    app = peer_app(pki=pki)
    for identity in (pki.drafter_a, pki.drafter_b):
        local = local_peer(pki, identity, app)
        assert isinstance(local, LocalPeer)
        async with serving(app, mtls_listener(pki)) as server, client_for(server, pki, identity) as remote:
            over_tls = await outcomes(remote)
        called = await outcomes(local)
        # The host header names the peer's address, which differs: the test server's port is not 9443.
        for answers in (over_tls, called):
            answers[0] = (answers[0][0], {"peer": answers[0][1]["peer"]})  # type: ignore[index]
        assert called == over_tls
        assert called[0] == (200, {"peer": identity.uri})
        assert called[1] == (201, {"body": {"tokens": [1, 2, 3]}, "n": "7", "length": "12"})
        expected = (204, None) if identity is pki.drafter_a else (ProtocolError, ProblemType.NOT_ASSIGNED, 403)
        assert called[2] == expected


async def test_the_peer_runs_in_a_context_of_its_own(pki: PKI) -> None:
    CALLER.set("the caller's")
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki))
    assert await client.get_cbor("context") == (200, {"caller": "unset"})


async def test_a_handler_runs_on_after_its_answer(pki: PKI) -> None:
    watch = Watch()
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki, watch=watch))
    assert await client.get_cbor("later") == (204, None)
    await watch.gone.wait()
    assert watch.left == ["after its answer"]


async def test_a_caller_that_times_out_leaves_the_handler(pki: PKI) -> None:
    watch = Watch()
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki, watch=watch))
    with pytest.raises(PeerTimeout, match="timed out"):
        await client.get_cbor("never", timeout=0.2)
    # Its task is cancelled as a reset stream's is: it ends at the loop's next turn.
    await watch.gone.wait()
    assert watch.left == ["/never"]
    assert await client.get_cbor("whoami") == (200, {"peer": pki.drafter_a.uri, "host": "127.0.0.1:9443"})


async def test_a_cancelled_caller_leaves_the_handler(pki: PKI) -> None:
    watch = Watch()
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki, watch=watch))
    waiting = asyncio.ensure_future(client.get_cbor("never"))
    await watch.started.wait()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await watch.gone.wait()
    assert watch.left == ["/never"]


async def test_an_answer_past_the_limit_and_an_app_that_answers_nothing_fail_as_over_mtls(pki: PKI) -> None:
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki), max_object_size=1024)
    with pytest.raises(UnexpectedResponse, match="exceeds 1024 bytes"):
        await client.get_bytes("big")

    async def silent(scope: dict[str, object], receive: object, send: object) -> None:
        return None

    mute = local_peer(pki, pki.drafter_a, silent)  # type: ignore[arg-type]
    with pytest.raises(PeerServerError) as failed:
        await mute.get_cbor("anything")
    assert failed.value.status == 500 and failed.value.problem is not None


async def test_a_stopping_peer_takes_no_new_call_and_lets_those_in_flight_finish(pki: PKI) -> None:
    watch, gate = Watch(), LocalGate()
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki, watch=watch), gate)
    waiting = asyncio.ensure_future(client.get_cbor("never"))
    await watch.started.wait()
    gate.close()
    closing = asyncio.ensure_future(gate.drained(timeout_s=60))
    with pytest.raises(ConnectionLost, match="is stopping"):
        await client.get_cbor("whoami")
    # The call in flight holds the stop until its handler has answered.
    await asyncio.sleep(0)
    assert not closing.done()
    watch.released.set()
    assert await waiting == (204, None)
    await closing


async def test_a_closed_local_peer_asks_nothing(pki: PKI) -> None:
    client = local_peer(pki, pki.drafter_a, peer_app(pki=pki))
    assert client.connected
    await client.aclose()
    assert not client.connected
    with pytest.raises(Exception, match="closed"):
        await client.get_cbor("whoami")


async def test_a_body_past_the_listeners_limit_is_refused_before_the_app_as_over_mtls(pki: PKI) -> None:
    asked: list[str] = []

    async def echo(request: Request) -> Response:
        asked.append(request.url.path)
        return cbor_response(await read_cbor_body(request))

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])], exception_handlers=exception_handlers())
    body = {"tokens": list(range(100))}
    local = local_peer(pki, pki.drafter_a, app, LocalGate(max_body_bytes=64))
    async with (
        serving(app, mtls_listener(pki, max_body_bytes=64)) as server,
        client_for(server, pki, pki.drafter_a) as remote,
    ):
        refusals = []
        for client in (remote, local):
            with pytest.raises(ProtocolError) as refused:
                await client.post_cbor("echo", body)
            refusals.append((refused.value.status, refused.value.problem))
    assert refusals[0] == refusals[1] and refusals[0][0] == 413
    assert asked == []
    # Within the limit, the app answers.
    small = LocalGate(max_body_bytes=1024)
    assert await local_peer(pki, pki.drafter_a, app, small).post_cbor("echo", body) == (200, body)


async def test_a_caller_past_the_listeners_stream_limit_waits_for_a_stream_to_end(pki: PKI) -> None:
    watch = Watch()
    started: list[str] = []
    app = peer_app(pki=pki, watch=watch)

    async def counted(scope: dict[str, object], receive: object, send: object) -> None:
        started.append(str(scope["path"]))
        await app(scope, receive, send)  # type: ignore[arg-type]

    client = local_peer(pki, pki.drafter_a, counted, LocalGate(max_concurrent_streams=2))  # type: ignore[arg-type]
    calls = [asyncio.ensure_future(client.get_cbor("never")) for _ in range(3)]
    await watch.started.wait()
    # The handlers of the first two run; the third call waits for one of their streams.
    # Turns of the loop enough for an ungated third call to have reached its handler too.
    for _ in range(50):
        await asyncio.sleep(0)
    assert started == ["/never", "/never"]
    watch.released.set()
    assert await asyncio.gather(*calls) == [(204, None)] * 3
    assert started == ["/never"] * 3
