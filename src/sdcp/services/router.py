"""The router role over HTTP/2 + mTLS (SDCP Table 1, 6.1, 6.5.2 events, 6.6, 6.9).

Route handlers over ``sdcp.engines.router.RouterEngine``: each reads and checks the request (body,
caller, path), calls the engine and answers in CBOR; ``HTTPRouterLink`` carries the engine's
messages to verifiers and drafters over mTLS. Besides Table 1 (``PUT instances/{id}/status``,
``POST events``) the router serves a client API for front ends on the same listener
(docs/services.md): ``GET targets``, ``POST sessions``, ``GET sessions/{id}``,
``POST sessions/{id}/policy`` and ``POST sessions/{id}/cancel``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sdcp.cache import MLC
from sdcp.config import ServiceConfig
from sdcp.engines.errors import Unanswered
from sdcp.engines.router import RouterEngine, TrackedSession
from sdcp.protocol.messages import (
    Assignment,
    CancelRequest,
    Event,
    Policy,
    Role,
    SelfDecodeRequest,
    SessionOpen,
    SessionRequest,
    SessionState,
    Status,
    parse_instance_path_id,
    parse_session_path_id,
    session_path_id,
)
from sdcp.protocol.problems import BadMessage
from sdcp.services.admin import Readiness
from sdcp.services.authz import Party, SessionParties
from sdcp.services.dashboard import Dashboard
from sdcp.services.node import Node
from sdcp.transport.asgi import cbor_response, read_cbor_body
from sdcp.transport.client import PeerClients
from sdcp.transport.errors import Forbidden, TransportError
from sdcp.transport.peer import peer_uri
from sdcp.transport.signing import RecordCheck

__all__ = ["HTTPRouterLink", "RouterNode"]

log = logging.getLogger("sdcp.router")


class HTTPRouterLink:
    """The router engine's messages to verifiers and drafters over HTTP/2 + mTLS (a ``RouterLink``):
    every answer outside the protocol's problems leaves the message unanswered."""

    def __init__(self, peers: PeerClients) -> None:
        self._peers = peers

    async def open_session(self, verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        return await self._state(verifier, "POST", "sessions", message.to_obj(), timeout=timeout)

    async def inform_verifier(self, verifier: str, assignment: Assignment) -> SessionState:
        path = f"sessions/{session_path_id(assignment.session)}/drafter"
        return await self._state(verifier, "PUT", path, assignment.to_obj())

    async def assign(self, drafter: str, assignment: Assignment) -> None:
        try:
            await self._peers.get(drafter).post_cbor("assignments", assignment.to_obj(), idempotent=True)
        except TransportError as exc:
            raise Unanswered(str(exc)) from exc

    async def policy(self, verifier: str, policy: Policy) -> SessionState:
        path = f"sessions/{session_path_id(policy.session)}/policy"
        return await self._state(verifier, "POST", path, policy.to_obj())

    async def self_decode(self, verifier: str, request: SelfDecodeRequest) -> SessionState:
        path = f"sessions/{session_path_id(request.session)}/self-decode"
        return await self._state(verifier, "POST", path, request.to_obj())

    async def cancel(self, verifier: str, request: CancelRequest) -> SessionState:
        path = f"sessions/{session_path_id(request.session)}/cancel"
        return await self._state(verifier, "POST", path, request.to_obj())

    async def _state(
        self, peer: str, method: str, path: str, body: object, *, timeout: float | None = None
    ) -> SessionState:
        client = self._peers.get(peer)
        try:
            if method == "PUT":
                _, answer = await client.put_cbor(path, body, timeout=timeout)
            else:
                _, answer = await client.post_cbor(path, body, idempotent=True, timeout=timeout)
        except TransportError as exc:
            raise Unanswered(str(exc)) from exc
        return SessionState.from_obj(answer)


class RouterNode(Node):
    """The router: assigns sessions to verifiers and drafters, and moves them when instances fail."""

    role = "router"

    def __init__(
        self, config: ServiceConfig, *, mlc: MLC | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(config, mlc)
        self.engine = RouterEngine(
            uri=self.uri,
            settings=lambda: self.config.router,
            mlc=self.mlc,
            link=HTTPRouterLink(self.peers),
            # SDCP 1.3, 6.9: a failover replays only records its epoch's verifier signed.
            record_check=RecordCheck.load(config.instance.ca),
            interval_s=config.instance.ttl_ms / 3000,
            # The deployment's instances are taken to share the router's TTL (sdcp up gives all one).
            grace_s=config.instance.ttl_ms / 1000,
            clock=clock,
        )
        # What the tests and the dashboard look at: the engine's clock, registry and sessions.
        self.clock = clock
        self.registry = self.engine.registry
        self.sessions = self.engine.sessions

    async def readiness(self) -> Readiness:
        """Ready once a verifier and a drafter are registered (their reports have not expired)."""
        verifiers, drafters = self.engine.live_counts()
        reason = f"{verifiers} verifier(s) and {drafters} drafter(s) registered"
        return Readiness(verifiers > 0 and drafters > 0, reason)

    def admin_routes(self) -> list[BaseRoute]:
        """The dashboard: figures only, no session content (docs/security.md, "Admin listeners")."""
        if self.config.admin.model is not None:
            log.warning("%s: [admin] model is no longer used: the dashboard shows no session text", self.uri)
        dashboard = Dashboard(
            registry=self.registry,
            sessions=lambda: list(self.sessions.values()),
            peers=self.peers,
            clock=self.clock,
            expected_rates=self.engine.expected_rates,
            target_splits=self.engine.target_splits,
        )
        return dashboard.routes()

    async def on_start(self) -> None:
        await self.engine.start()

    async def on_stop(self) -> None:
        await self.engine.stop()

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/instances/{id}/status", self.put_status, methods=["PUT"]),
            Route("/events", self.post_event, methods=["POST"]),
            Route("/targets", self.get_targets, methods=["GET"]),
            Route("/sessions", self.open_session, methods=["POST"]),
            Route("/sessions/{id}", self.get_session, methods=["GET"]),
            Route("/sessions/{id}/policy", self.post_policy, methods=["POST"]),
            Route("/sessions/{id}/cancel", self.cancel_session, methods=["POST"]),
        ]

    # -- Table 1 ---------------------------------------------------------------------------------

    async def put_status(self, request: Request) -> Response:
        """PUT instances/{id}/status: only the instance the path names may report for it."""
        named = parse_instance_path_id(request.path_params["id"])
        peer = self.trust.admit(request, "PUT instances/{id}/status", instance=named or peer_uri(request))
        status = Status.from_obj(await read_cbor_body(request))
        if status.instance != peer:
            raise Forbidden(f"{peer} may not report the status of {status.instance}")
        if not self.trust.is_member(peer, Party.VERIFIER if status.role == Role.VERIFIER else Party.DRAFTER):
            raise Forbidden(f"{peer} is not a trusted {status.role.name.lower()} ([trust] {status.role.name.lower()}s)")
        self.engine.report(status)
        if not self.peers.holds(status.instance):
            # Connected at its first report: the first session it gets skips the TLS handshake.
            self._tasks.spawn(self.peers.get(status.instance).connect())
        return Response(status_code=204)

    async def post_event(self, request: Request) -> Response:
        """POST events (SDCP 6.5.2): switch reassigns the drafter; finish and fail end the session."""
        body = await read_cbor_body(request)
        event = Event.from_obj(body)
        self._member(request, Party.VERIFIER)
        tracked = await self.engine.contact(
            event.session,
            lambda t: self.trust.admit(request, "POST events", SessionParties(verifier=t.plan.verifier)),
        )
        await self.engine.event(tracked, event)
        return Response(status_code=204)

    # -- client API ------------------------------------------------------------------------------

    async def get_targets(self, request: Request) -> Response:
        """GET targets: the live verifiers and the digests a contract must name to use them."""
        self.trust.admit(request, "GET targets")
        return cbor_response(self.engine.targets())

    async def open_session(self, request: Request) -> Response:
        """POST sessions: open at a verifier, then assign a drafter (SDCP 6.1 order)."""
        owner = self.trust.admit(request, "POST sessions")
        wanted = SessionRequest.from_obj(await read_cbor_body(request))
        tracked = await self.engine.open_session(owner, wanted)
        return cbor_response({key: value for key, value in tracked.describe().items() if key != "ended"}, status=201)

    async def get_session(self, request: Request) -> Response:
        """GET sessions/{id}: where the session runs now, so that a client can follow a failover."""
        tracked = await self._session_of_owner(request, "GET sessions/{id}", Party.FRONT_END, Party.OPERATOR)
        if not tracked.ended:
            # A front end asks where the session runs when its verifier gives it nothing new: one
            # that stopped the session, fenced by a record another party appended to the log,
            # stays live and sends no event the router could have missed otherwise.
            self.spawn(self.engine.look_for_intrusion(tracked))
        return cbor_response(tracked.describe())

    async def cancel_session(self, request: Request) -> Response:
        """POST sessions/{id}/cancel (extension): the front end ends its session."""
        tracked = await self._session_of_owner(request, "POST sessions/{id}/cancel", Party.FRONT_END)
        message = CancelRequest.from_obj(await read_cbor_body(request))
        if message.session != tracked.plan.session:
            raise BadMessage("the cancel request names another session than the path")
        state = await self.engine.cancel(tracked)
        return cbor_response(state.to_obj())

    async def post_policy(self, request: Request) -> Response:
        """POST sessions/{id}/policy: forwarded to the verifier, kept for later assignments (SDCP 6.6)."""
        tracked = await self._session_of_owner(request, "POST sessions/{id}/policy", Party.FRONT_END)
        policy = Policy.from_obj(await read_cbor_body(request))
        if policy.session != tracked.plan.session:
            raise BadMessage("the policy names another session than the path")
        state = await self.engine.change_policy(tracked, policy)
        return cbor_response(state.to_obj())

    async def _session_of_owner(self, request: Request, endpoint: str, *parties: Party) -> TrackedSession:
        """The session the path names, for a caller the endpoint admits for it (its front end)."""
        self._member(request, *parties)
        session = parse_session_path_id(request.path_params["id"])
        return await self.engine.contact(
            session, lambda t: self.trust.admit(request, endpoint, SessionParties(owner=t.plan.owner))
        )

    def _member(self, request: Request, *parties: Party) -> None:
        """Only a trusted party of a role that may hold rights to sessions makes the router look a
        session up in the shared tier (what a peer can make the router read and hold is bounded)."""
        peer = peer_uri(request)
        if peer is None or not any(self.trust.is_member(peer, party) for party in parties):
            raise Forbidden(f"{peer} may not ask about sessions here")
