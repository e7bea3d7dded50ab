"""The router role over HTTP/2 + mTLS (SDCP Table 1, 6.1, 6.5.2 events, 6.6, 6.9).

``sdcp.protocol.router`` decides (registry with TTLs, selection, assignment and failover plans);
this module sends. Besides Table 1 (``PUT instances/{id}/status``, ``POST events``) the router serves
a client API for front ends on the same listener (docs/services.md): ``GET targets``,
``POST sessions``, ``GET sessions/{id}`` and ``POST sessions/{id}/policy``.

Every change to one session (assignment, switch, failover, policy) runs under that session's lock,
so the verifier and the drafter always hear of them in the order the router made them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from prometheus_client import Counter, Gauge
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sdcp.cache import MLC, CacheError, build_uri, target_kv_uri
from sdcp.cache.uri import LOG_KIND, TOKENS_KIND
from sdcp.config import ServiceConfig
from sdcp.protocol.messages import (
    Action,
    Assignment,
    CancelRequest,
    Contract,
    Event,
    Policy,
    Role,
    SelfDecodeRequest,
    SessionRequest,
    SessionState,
    Status,
    parse_instance_path_id,
    parse_session_path_id,
    session_path_id,
)
from sdcp.protocol.problems import BadContract, BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import LogReplay, encode_token_list, replay_commit_log
from sdcp.protocol.router import (
    DecodingChoice,
    InstanceRegistry,
    InstanceView,
    RouterSession,
    choose_decoding,
    drafter_costs,
    drafter_permitted,
    drafter_rate,
    prefer_idle_and_accepting,
)
from sdcp.services.admin import Readiness
from sdcp.services.authz import Party, SessionParties
from sdcp.services.dashboard import SELF_DECODING_AT, Dashboard
from sdcp.services.node import Node
from sdcp.transport.asgi import cbor_response, read_cbor_body
from sdcp.transport.errors import Forbidden, NotFound, ServiceUnavailable, TooManyRequests, TransportError
from sdcp.transport.peer import peer_uri
from sdcp.transport.signing import RecordCheck

__all__ = ["RouterNode"]

log = logging.getLogger("sdcp.router")
# When a refused session request may be tried again (sessions end at their own pace).
_RETRY_AFTER_S = 5
# A cancel of a session-open that timed out is tried this often, this far apart.
_ABANDONED_CANCEL_TRIES, _ABANDONED_CANCEL_WAIT_S = 5, 1.0

SESSIONS_OPEN = Gauge("sdcp_router_sessions_open", "Sessions neither finished nor failed", ["instance"])
ASSIGNMENTS = Counter("sdcp_router_assignments_total", "Assignments sent, by drafter", ["instance", "drafter"])
SWITCHES = Counter(
    "sdcp_router_switches_total",
    "Sessions moved off a drafter (a switch event, or a faster option), by the drafter left",
    ["instance", "drafter"],
)
EVENTS = Counter("sdcp_router_events_total", "Events from verifiers, by kind", ["instance", "kind"])
EXPECTED_RATE = Gauge(
    "sdcp_router_expected_tokens_per_second",
    "The cost model's expected tokens per second of a session, by option (a drafter, or self-decoding at a verifier)",
    ["instance", "option"],
)
FAILOVERS = Counter("sdcp_router_failovers_total", "Sessions moved to another verifier", ["instance"])
UNTRUSTED_RECORDS = Counter(
    "sdcp_router_untrusted_records_total",
    "Commit records a replay left out: not signed by their epoch's verifier (each read of the log counts them)",
    ["instance"],
)
CHOICES = Counter(
    "sdcp_router_decoding_choices_total",
    "Decisions on who drafts for a session: a drafter, an exploration of an unmeasured drafter, or the verifier alone",
    ["instance", "choice"],
)

# Who served a session, in the router's session description: a drafter's URI, or this for the
# verifier decoding alone at the router's request.
SELF_DECODING = "self-decoding"
# A session is moved off its drafter only for an option expected to be this much faster, and at
# most once per this many seconds, so that estimates that differ by noise do not make it flap.
SWITCH_MARGIN = 1.25
REDECIDE_AFTER_S = 2.0
# A verification round at a verifier that reports no timing of its own.
DEFAULT_VERIFY_S = 0.05


@dataclass
class _TrackedSession:
    plan: RouterSession
    prompt: tuple[int, ...]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ended: bool = False
    # The verifier decodes the session alone at this router's request, until its event.
    self_decoding: bool = False
    # A drafter whose acceptance was unmeasured when it was assigned to this session.
    exploring: str | None = None
    decided_at: float = 0.0
    served: list[str] = field(default_factory=list)
    opened_at: float = field(default_factory=time.time)
    # The verifier of epoch 1 (opened without a fence): only its signed records count in epoch 1.
    first_verifier: str = ""
    # The verifier a failover's fence named, until the session is open there: a retry goes there
    # again, or spends that epoch (signed commit records, docs/reliability.md).
    failover_to: str | None = None

    def __post_init__(self) -> None:
        if not self.first_verifier and self.plan.epoch == 1:
            self.first_verifier = self.plan.verifier

    @property
    def session(self) -> bytes:
        return self.plan.session

    @property
    def verifier(self) -> str:
        return self.plan.verifier

    @property
    def drafter(self) -> str | None:
        return self.plan.drafter

    @property
    def request(self) -> str | None:
        return self.plan.request

    def serve(self, who: str) -> None:
        if not self.served or self.served[-1] != who:
            self.served.append(who)

    @property
    def path_id(self) -> str:
        return session_path_id(self.plan.session)

    def describe(self) -> dict[str, object]:
        described: dict[str, object] = {
            "session": self.plan.session,
            "epoch": self.plan.epoch,
            "verifier": self.plan.verifier,
            "ended": self.ended,
        }
        if self.plan.drafter is not None:
            described["drafter"] = self.plan.drafter
        if self.served:
            described["served"] = list(self.served)
        return described


def _serves(view: InstanceView, contract: Contract) -> bool:
    status = view.status
    # A verifier that reports no tokenizer digest is judged by its target digest alone.
    return status.model == contract.target and status.tokenizer in (None, contract.tokenizer)


def _unreported(views: Sequence[InstanceView]) -> list[InstanceView]:
    """Instances whose status lacks our private `model` member (another implementation's): the
    contract's digests cannot be matched here, so they are asked, and refuse with
    sdcp-bad-contract what they do not serve (SDCP 6.1); tried only when no reporting one fits."""
    return [view for view in views if view.status.model is None]


class RouterNode(Node):
    """The router: assigns sessions to verifiers and drafters, and moves them when instances fail."""

    role = "router"

    def __init__(
        self, config: ServiceConfig, *, mlc: MLC | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(config, mlc)
        # What status TTLs and decision ages are measured with (tests jump it forward).
        self.clock = clock
        # SDCP 1.3, 6.9: a failover replays only records its epoch's verifier signed.
        self.record_check = RecordCheck.load(config.instance.ca)
        self.registry = InstanceRegistry()
        self.sessions: dict[bytes, _TrackedSession] = {}
        self._wake = asyncio.Event()

    async def readiness(self) -> Readiness:
        """Ready once a verifier and a drafter are registered (their reports have not expired)."""
        now = self.clock()
        verifiers, drafters = (len(self.registry.live(role, now)) for role in (Role.VERIFIER, Role.DRAFTER))
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
            expected_rates=self.expected_rates,
        )
        return dashboard.routes()

    def _init_metrics(self) -> None:
        for kind in Action:
            EVENTS.labels(self.uri, kind.name.lower())
        for choice in ("drafter", "explore", "self"):
            CHOICES.labels(self.uri, choice)
        for family in (FAILOVERS, SESSIONS_OPEN):
            family.labels(self.uri)

    def _observe_drafter(self, uri: str) -> None:
        """A drafter's series start at zero when it first reports."""
        ASSIGNMENTS.labels(self.uri, uri)
        SWITCHES.labels(self.uri, uri)

    def expected_rates(self) -> dict[str, float]:
        """The cost model's expected tokens per second of a session (SDCP 6.2), by live option: a
        drafter's URI, or self-decoding at a verifier."""
        now = self.clock()
        verifiers = self.registry.live(Role.VERIFIER, now)
        verify_s = _verify_s(verifiers[0] if verifiers else None)
        m_limit = max(1, self.config.router.m_init)
        rates = {}
        for view in self.registry.live(Role.DRAFTER, now):
            costs = drafter_costs(view)
            if costs.alpha is not None:
                rates[view.uri] = drafter_rate(costs, verify_s=verify_s, m_limit=m_limit)
        for view in verifiers:
            if view.status.self_us:
                rates[f"{SELF_DECODING_AT}{view.uri}"] = 1e6 / view.status.self_us
        return rates

    async def on_start(self) -> None:
        self._init_metrics()
        self.spawn(self._maintain_forever())

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
        now = self.clock()
        if not self.registry.is_live(peer, now):
            # A new or returning instance may unblock sessions waiting for one.
            self._wake.set()
        # An instance cannot claim to stay live longer than the router allows.
        capped = replace(status, ttl_ms=min(status.ttl_ms, self.config.router.max_ttl_ms))
        self.registry.report(capped, now, model=status.model)
        if status.role == Role.DRAFTER:
            self._observe_drafter(peer)
        for option, rate in self.expected_rates().items():
            EXPECTED_RATE.labels(self.uri, option).set(rate)
        return Response(status_code=204)

    async def post_event(self, request: Request) -> Response:
        """POST events (SDCP 6.5.2): switch reassigns the drafter; finish and fail end the session."""
        body = await read_cbor_body(request)
        event = Event.from_obj(body)
        tracked = self._tracked(event.session)
        self.trust.admit(request, "POST events", SessionParties(verifier=tracked.plan.verifier))
        if event.epoch != tracked.plan.epoch:
            raise ProtocolError(
                ProblemType.STALE_EPOCH, f"event of epoch {event.epoch}; the session is at epoch {tracked.plan.epoch}"
            )
        EVENTS.labels(self.uri, event.kind.name.lower()).inc()
        if event.kind == Action.SWITCH:
            # SDCP 6.5.2 switch (also the end of a self-decoding period): another drafter with a
            # permitted model, not the current one if any other is live, or the verifier alone when
            # no drafter is expected to beat it. Answered at once: the decision calls back into the
            # verifier.
            current = tracked.plan.drafter
            if current is not None:
                SWITCHES.labels(self.uri, current).inc()
            self.spawn(self._locked(tracked, lambda: self._after_switch(tracked, avoid=(current,) if current else ())))
        elif event.kind in (Action.FINISH, Action.FAIL):
            self._end(tracked, event.kind)
        else:
            log.info(
                "%s: event %s for session %s needs no router action",
                self.uri,
                event.kind.name,
                tracked.plan.session.hex(),
            )
        return Response(status_code=204)

    # -- client API ------------------------------------------------------------------------------

    async def get_targets(self, request: Request) -> Response:
        """GET targets: the live verifiers and the digests a contract must name to use them."""
        self.trust.admit(request, "GET targets")
        targets = []
        for view in self.registry.live(Role.VERIFIER, self.clock()):
            if view.status.model is None:
                continue
            target: dict[str, object] = {"instance": view.uri, "model": view.status.model}
            if view.status.tokenizer is not None:
                target["tokenizer"] = view.status.tokenizer
            if view.status.context is not None:
                target["context"] = view.status.context
            targets.append(target)
        return cbor_response(sorted(targets, key=lambda t: str(t["instance"])))

    async def open_session(self, request: Request) -> Response:
        """POST sessions: open at a verifier, then assign a drafter (SDCP 6.1 order)."""
        owner = self.trust.admit(request, "POST sessions")
        quota = self.config.router.max_sessions_per_front_end
        if sum(1 for t in self.sessions.values() if t.plan.owner == owner and not t.ended) >= quota:
            raise TooManyRequests(f"{owner} has {quota} open sessions, its quota", retry_after_s=_RETRY_AFTER_S)
        wanted = SessionRequest.from_obj(await read_cbor_body(request))
        # Runs to its end even if the client goes away: a session half opened is tracked nowhere.
        tracked = await asyncio.shield(self._open_session(owner, wanted))
        return cbor_response({key: value for key, value in tracked.describe().items() if key != "ended"}, status=201)

    async def _open_session(self, owner: str, wanted: SessionRequest) -> _TrackedSession:
        contract = wanted.contract
        tried: list[str] = []
        refused: list[str] = []
        while True:
            verifier = self._pick_verifier(contract, avoid=tried + refused)
            if verifier is None:
                if tried:
                    raise ServiceUnavailable(
                        f"no verifier for this target answered (tried {', '.join(tried)})", retry_after_s=_RETRY_AFTER_S
                    )
                raise BadContract("no live verifier serves the contract's target and tokenizer")
            # A session of its own for each verifier tried: one that opened it too late cancels it,
            # and that end must not reach the commit log of the session opened elsewhere.
            session = secrets.token_bytes(16)
            commit_log = build_uri(self.mlc.authority, contract.scope, LOG_KIND, session.hex())
            plan = RouterSession(
                session=session,
                epoch=1,
                contract=contract,
                prompt=wanted.prompt,
                commit_log=commit_log,
                verifier=verifier,
                owner=owner,
                logprobs=wanted.logprobs,
                min_new=wanted.min_new,
                request=wanted.request,
            )
            try:
                # SDCP 6.1: session-open with epoch 1 and a commit_log reference in the MLC.
                await self.peers.get(verifier).post_cbor(
                    "sessions", plan.open_message().to_obj(), idempotent=True, timeout=self.config.router.open_timeout_s
                )
                break
            except TransportError as exc:
                log.warning("%s: verifier %s did not open a session: %s", self.uri, verifier, exc)
                tried.append(verifier)
                # It may have opened the session all the same: it must not decode it for nobody.
                self.spawn(self._cancel_abandoned(plan))
            except BadContract as exc:
                view = self.registry.get(verifier)
                if view is None or view.status.model is not None:
                    raise
                log.info("%s: verifier %s, which reports no model, refused the contract: %s", self.uri, verifier, exc)
                refused.append(verifier)
        tracked = _TrackedSession(plan, wanted.prompt)
        self.sessions[session] = tracked
        log.info("%s: session %s opened at %s (request %s)", self.uri, session.hex(), verifier, wanted.request or "-")
        SESSIONS_OPEN.labels(self.uri).inc()
        async with tracked.lock:
            if wanted.sampling is not None:
                # SDCP 6.6: the user's preference is a policy from the first round on.
                await self._send_policy(tracked, Policy(session=session, from_round=1, sampling=wanted.sampling))
            try:
                await self._assign_drafter(tracked)
            except (ProtocolError, TransportError) as exc:
                log.warning("%s: session %s opened without a drafter: %s", self.uri, tracked.plan.session.hex(), exc)
        return tracked

    async def get_session(self, request: Request) -> Response:
        """GET sessions/{id}: where the session runs now, so that a client can follow a failover."""
        tracked = self._tracked(parse_session_path_id(request.path_params["id"]))
        self.trust.admit(request, "GET sessions/{id}", SessionParties(owner=tracked.plan.owner))
        return cbor_response(tracked.describe())

    async def cancel_session(self, request: Request) -> Response:
        """POST sessions/{id}/cancel (extension): the front end ends its session; the verifier stops
        at its next round boundary and records the end, and the router assigns no one again."""
        tracked = self._tracked(parse_session_path_id(request.path_params["id"]))
        self.trust.admit(request, "POST sessions/{id}/cancel", SessionParties(owner=tracked.plan.owner))
        message = CancelRequest.from_obj(await read_cbor_body(request))
        if message.session != tracked.plan.session:
            raise BadMessage("the cancel request names another session than the path")
        state = await asyncio.shield(self._cancel(tracked))
        return cbor_response(state.to_obj())

    async def _cancel_abandoned(self, plan: RouterSession) -> None:
        """Cancel a session-open whose answer never came (extension, docs/interpretations.md); a
        verifier still opening it answers 404 a little longer."""
        for attempt in range(_ABANDONED_CANCEL_TRIES):
            try:
                await self._cancel_at_verifier(plan)
                log.info(
                    "%s: session %s cancelled at %s, which answered too late",
                    self.uri,
                    plan.session.hex(),
                    plan.verifier,
                )
                return
            except (ProtocolError, TransportError) as exc:
                if attempt + 1 == _ABANDONED_CANCEL_TRIES:
                    log.info(
                        "%s: abandoned session %s not cancelled at %s: %s",
                        self.uri,
                        plan.session.hex(),
                        plan.verifier,
                        exc,
                    )
                    return
                await asyncio.sleep(_ABANDONED_CANCEL_WAIT_S)

    async def _cancel(self, tracked: _TrackedSession) -> SessionState:
        async with tracked.lock:
            state = await self._cancel_at_verifier(tracked.plan)
            self._end(tracked, Action.FAIL)
            return state

    async def _cancel_at_verifier(self, plan: RouterSession) -> SessionState:
        """POST sessions/{id}/cancel at the session's verifier; its session-state once ended."""
        request = CancelRequest(session=plan.session, epoch=plan.epoch)
        _, body = await self.peers.get(plan.verifier).post_cbor(
            f"sessions/{session_path_id(plan.session)}/cancel", request.to_obj(), idempotent=True
        )
        return SessionState.from_obj(body)

    async def post_policy(self, request: Request) -> Response:
        """POST sessions/{id}/policy: forwarded to the verifier, kept for later assignments (SDCP 6.6)."""
        tracked = self._tracked(parse_session_path_id(request.path_params["id"]))
        self.trust.admit(request, "POST sessions/{id}/policy", SessionParties(owner=tracked.plan.owner))
        policy = Policy.from_obj(await read_cbor_body(request))
        if policy.session != tracked.plan.session:
            raise BadMessage("the policy names another session than the path")
        state = await asyncio.shield(self._change_policy(tracked, policy))
        return cbor_response(state.to_obj())

    async def _change_policy(self, tracked: _TrackedSession, policy: Policy) -> SessionState:
        async with tracked.lock:
            if tracked.ended:
                raise ProtocolError(ProblemType.SESSION_CLOSED, "the session has ended")
            return await self._send_policy(tracked, policy)

    # -- assignment, failover and the periodic task ----------------------------------------------

    async def maintain(self) -> None:
        """One pass of the periodic task: expire instances, reassign drafters, fail over verifiers."""
        now = self.clock()
        for view in self.registry.expire(now):
            log.info("%s: status of %s expired", self.uri, view.uri)
        work = []
        for tracked in list(self.sessions.values()):
            if tracked.ended:
                continue
            if not self.registry.is_live(tracked.plan.verifier, now):
                work.append(self._locked(tracked, partial(self._fail_over, tracked)))
            elif tracked.self_decoding:
                continue  # its verifier's event asks for a drafter when the period ends
            elif tracked.plan.drafter is None or not self.registry.is_live(tracked.plan.drafter, now):
                # SDCP 6.9 drafter failure, or a session still waiting for its first drafter.
                work.append(self._locked(tracked, partial(self._assign_drafter, tracked, only_if_missing=True)))
            elif self._worth_moving(tracked, now):
                SWITCHES.labels(self.uri, tracked.plan.drafter).inc()
                work.append(self._locked(tracked, partial(self._assign_drafter, tracked)))
        await asyncio.gather(*work)

    async def _maintain_forever(self) -> None:
        interval = self.config.instance.ttl_ms / 3000
        while True:
            await self.maintain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
            self._wake.clear()

    async def _locked(self, tracked: _TrackedSession, change: Callable[[], Awaitable[None]]) -> None:
        """Run one change of a session under its lock; a failure is logged and retried next tick."""
        async with tracked.lock:
            if tracked.ended:
                return
            try:
                await change()
            except ProtocolError as exc:
                if exc.problem is ProblemType.SESSION_CLOSED:
                    self._end(tracked, Action.FINISH)
                    return
                log.warning("%s: session %s: %s", self.uri, tracked.plan.session.hex(), exc)
            except Exception as exc:  # noqa: BLE001 - the change is retried on the next tick
                log.warning("%s: session %s: %r", self.uri, tracked.plan.session.hex(), exc)

    async def _assign_drafter(
        self, tracked: _TrackedSession, *, avoid: Sequence[str] = (), only_if_missing: bool = False
    ) -> None:
        """Decide who drafts for the session next, by expected rate (``choose_decoding``), and tell
        them: a drafter that does not answer is skipped; a verifier that does not decode alone at
        this router's request gets a drafter instead."""
        current = tracked.plan.drafter
        if only_if_missing and (
            tracked.self_decoding or (current is not None and self.registry.is_live(current, self.clock()))
        ):
            return
        unreachable: list[str] = []
        self_decode = True
        while True:
            choice = self._choose(tracked, avoid=avoid, skip=unreachable, self_decode=self_decode)
            if choice is None:
                tracked.plan.drafter = None
                log.info("%s: session %s waits for a drafter", self.uri, tracked.plan.session.hex())
                return
            if choice.drafter is None:
                try:
                    await self._send_self_decode(tracked)
                    return
                except ProtocolError as exc:
                    if exc.problem in (ProblemType.SESSION_CLOSED, ProblemType.STALE_EPOCH, ProblemType.STALE_BASE):
                        raise
                    log.info("%s: verifier %s does not decode alone: %s", self.uri, tracked.plan.verifier, exc)
                except TransportError as exc:
                    log.info("%s: verifier %s does not decode alone: %s", self.uri, tracked.plan.verifier, exc)
                self_decode = False
                continue
            try:
                await self._send_assignment(tracked, choice.drafter)
            except TransportError as exc:
                log.warning("%s: drafter %s took no assignment: %s", self.uri, choice.drafter, exc)
                unreachable.append(choice.drafter)
                continue
            except BadContract as exc:
                # A drafter reporting no model learns the contract only here (SDCP 6.1).
                log.info("%s: drafter %s refused the contract: %s", self.uri, choice.drafter, exc)
                unreachable.append(choice.drafter)
                continue
            except ProtocolError as exc:
                if exc.state is None or exc.state.state != Action.SELF_DECODE:
                    raise
                # The verifier is in a self-decoding period of its ladder; its event ends it.
                tracked.self_decoding = True
                return
            tracked.exploring = choice.drafter if choice.exploring else None
            CHOICES.labels(self.uri, "explore" if choice.exploring else "drafter").inc()
            return

    def _choose(
        self, tracked: _TrackedSession, *, avoid: Sequence[str] = (), skip: Sequence[str] = (), self_decode: bool = True
    ) -> DecodingChoice | None:
        """The expected fastest option for the session among live permitted drafters (those in
        ``avoid`` only when no other is live) and, where permitted, its verifier alone."""
        now = self.clock()
        contract = tracked.plan.contract
        live = [view for view in self.registry.live(Role.DRAFTER, now) if view.uri not in skip]
        permitted = [view for view in live if drafter_permitted(contract, view.model)] or _unreported(live)
        pool = [view for view in permitted if view.uri not in avoid] or permitted
        verifier = self.registry.get(tracked.plan.verifier)

        def may_explore(uri: str) -> bool:
            # Exploration is bounded: one session at a time per unmeasured drafter, and it ends
            # with the drafter's first acceptance report (measured_acceptance: our alpha_milli, or
            # SDCP 5.2 accept_milli from a drafter without our cost terms). Asked only about
            # unmeasured drafters, so that maintenance of measured ones scans no sessions.
            return not any(
                other.exploring == uri and other is not tracked and not other.ended for other in self.sessions.values()
            )

        return choose_decoding(
            [drafter_costs(view) for view in pool],
            self_decode_s=self._self_decode_s(contract, verifier) if self_decode else None,
            verify_s=_verify_s(verifier),
            m_limit=self._m_limit(contract),
            may_explore=may_explore,
        )

    def _m_limit(self, contract: Contract) -> int:
        return max(1, min(contract.m_max, self.config.router.m_init))

    @staticmethod
    def _self_decode_s(contract: Contract, verifier: InstanceView | None) -> float | None:
        """Seconds per token of the verifier decoding alone, where the contract permits that now
        (SDCP 6.5.2: self_load present and not exceeded) and the verifier reports its time."""
        if verifier is None or verifier.status.self_us is None or contract.self_load is None:
            return None
        if contract.self_max == 0 or verifier.status.load > contract.self_load:
            return None
        return verifier.status.self_us / 1e6

    def _worth_moving(self, tracked: _TrackedSession, now: float) -> bool:
        """Whether a session's drafter should give way: its exploration has been measured, or
        another option is now expected to be ``SWITCH_MARGIN`` times faster."""
        drafter = tracked.plan.drafter
        view = self.registry.get(drafter) if drafter is not None else None
        if view is None or now - tracked.decided_at < REDECIDE_AFTER_S:
            return False
        costs = drafter_costs(view)
        if costs.alpha is None:
            return False  # its measurement is on the way (alpha_milli or accept_milli: measured_acceptance)
        best = self._choose(tracked)
        if best is None or best.drafter == drafter:
            tracked.exploring = None
            return False
        if tracked.exploring == drafter:
            return True
        verifier = self.registry.get(tracked.plan.verifier)
        current = drafter_rate(costs, verify_s=_verify_s(verifier), m_limit=self._m_limit(tracked.plan.contract))
        return best.rate > SWITCH_MARGIN * current

    async def _send_self_decode(self, tracked: _TrackedSession) -> None:
        """Ask the verifier to decode the session alone (extension, docs/interpretations.md)."""
        plan = tracked.plan
        request = SelfDecodeRequest(session=plan.session, epoch=plan.epoch)
        await self.peers.get(plan.verifier).post_cbor(
            f"sessions/{tracked.path_id}/self-decode", request.to_obj(), idempotent=True
        )
        plan.drafter = None
        tracked.self_decoding = True
        tracked.exploring = None
        tracked.decided_at = self.clock()
        tracked.serve(SELF_DECODING)
        CHOICES.labels(self.uri, "self").inc()
        log.info("%s: session %s decoded by verifier %s alone", self.uri, tracked.plan.session.hex(), plan.verifier)

    async def _after_switch(self, tracked: _TrackedSession, *, avoid: Sequence[str]) -> None:
        tracked.self_decoding = False
        await self._assign_drafter(tracked, avoid=avoid)

    async def _send_assignment(self, tracked: _TrackedSession, drafter: str) -> None:
        """SDCP 6.1: inform the verifier first, then send the assignment to the drafter."""
        plan = tracked.plan

        async def current_assignment() -> tuple[int, Assignment]:
            replay, tokens = await self._committed_prefix(tracked)
            assignment = plan.assignment(
                drafter,
                round=replay.round,
                committed=len(replay.tokens),
                digest=replay.digest,
                m_init=self.config.router.m_init,
                committed_tokens=tokens,
            )
            return replay.round, assignment

        read_at, assignment = await current_assignment()
        verifier = self.peers.get(plan.verifier)
        _, answer = await verifier.put_cbor(f"sessions/{tracked.path_id}/drafter", assignment.to_obj())
        state = SessionState.from_obj(answer)
        plan.drafter = drafter
        if state.round != read_at:
            # The previous drafter's last round (or a self-decoded one) committed after the log was
            # read; it is in the log now, since the verifier appends before it answers (SDCP 6.3).
            read_at, assignment = await current_assignment()
        await self.peers.get(drafter).post_cbor("assignments", assignment.to_obj(), idempotent=True)
        tracked.self_decoding = False
        tracked.decided_at = self.clock()
        tracked.serve(drafter)
        ASSIGNMENTS.labels(self.uri, drafter).inc()
        log.info("%s: session %s assigned to %s at round %d", self.uri, tracked.plan.session.hex(), drafter, read_at)

    async def _fail_over(self, tracked: _TrackedSession) -> None:
        """SDCP 6.9 verifier failure: fence, replay the log, resume at another verifier, reassign."""
        plan = tracked.plan
        if self.registry.is_live(plan.verifier, self.clock()):
            return
        verifier = self._pick_verifier(plan.contract, avoid=[plan.verifier])
        named = tracked.failover_to
        if named is not None and named != plan.verifier and self.registry.is_live(named, self.clock()):
            verifier = named
        if verifier is None:
            log.info("%s: session %s waits for a verifier", self.uri, tracked.plan.session.hex())
            return
        if named is not None and named != verifier:
            # The last try's fence named another verifier at the next epoch, and a fence of that
            # epoch again appends nothing: that epoch is spent, the session moves at the one after.
            tracked.plan = plan = replace(plan, epoch=plan.epoch + 1)
        # SDCP 6.9: the fence comes first, so the old verifier can no longer commit or release output.
        # Fencing the same epoch again appends nothing, so a failover retried next tick is safe. The
        # fence names the new verifier: only its signed records count in the new epoch.
        tracked.failover_to = verifier
        fence = plan.fence_for_failover(verifier)
        await self.mlc.commit_log(plan.commit_log).fence(fence.epoch, fence.verifier)
        replay, tokens = await self._committed_prefix(tracked)
        published = target_kv_uri(plan.commit_log, plan.session, plan.epoch)
        moved = plan.fail_over(verifier, replay, tokens, target_kv=await self._available(published))
        await self.peers.get(verifier).post_cbor("sessions", moved.open_message().to_obj(), idempotent=True)
        tracked.plan = moved
        tracked.failover_to = None
        if published is not None:
            # The new verifier has imported it or prefilled: the failed epoch's KV serves no one now.
            self.spawn(self._discard(published))
        # The new verifier knows nothing of a self-decoding period the old one was asked for.
        tracked.self_decoding = False
        FAILOVERS.labels(self.uri).inc()
        log.info("%s: session %s moved to %s at epoch %d", self.uri, tracked.plan.session.hex(), verifier, moved.epoch)
        if moved.sampling is not None:
            # The new verifier knows only the contract; the current profile must follow the session.
            await self._send_policy(
                tracked, Policy(session=moved.session, from_round=replay.round + 1, sampling=moved.sampling)
            )
        drafter = moved.drafter
        if drafter is not None and self.registry.is_live(drafter, self.clock()):
            try:
                await self._send_assignment(tracked, drafter)
                return
            except TransportError as exc:
                log.warning("%s: drafter %s took no assignment: %s", self.uri, drafter, exc)
        await self._assign_drafter(tracked, avoid=(drafter,) if drafter else ())

    async def _committed_prefix(self, tracked: _TrackedSession) -> tuple[LogReplay, str]:
        """The committed state from the commit log, and its tokens written to the MLC."""
        plan = tracked.plan
        snapshot = await self.mlc.commit_log(plan.commit_log).read()
        # SDCP 1.3, 6.9: a record that is not its epoch's verifier's signed record is a fault: it
        # is never replayed, and its epoch counts no later record (the router has fenced it, or
        # fences it at the failover); the output up to the last good record stands.
        replay = replay_commit_log(
            snapshot.records,
            plan.contract.digest,
            tracked.prompt,
            authority=self.record_check,
            first_verifier=tracked.first_verifier,
        )
        for fault in replay.faults:
            UNTRUSTED_RECORDS.labels(self.uri).inc()
            log.warning("%s: session %s: a commit record left out: %s", self.uri, plan.session.hex(), fault)
        # The committed prefix of a given length never changes, so the name can say only its length.
        uri = build_uri(
            self.mlc.authority, plan.contract.scope, TOKENS_KIND, f"{plan.session.hex()}-{len(replay.tokens)}"
        )
        await self.mlc.put(uri, encode_token_list(replay.tokens))
        return replay, uri

    async def _available(self, uri: str | None) -> str | None:
        """``uri`` if the MLC holds it: the target KV the failed verifier published (SDCP 6.9)."""
        if uri is None:
            return None
        try:
            return uri if await self.mlc.exists(uri) else None
        except CacheError as exc:
            log.info("%s: target KV %s not looked up, the new verifier prefills: %s", self.uri, uri, exc)
            return None

    async def _discard(self, uri: str) -> None:
        try:
            await self.mlc.delete(uri)
        except CacheError as exc:
            log.info("%s: target KV %s not deleted: %s", self.uri, uri, exc)

    async def _send_policy(self, tracked: _TrackedSession, policy: Policy) -> SessionState:
        plan = tracked.plan
        _, answer = await self.peers.get(plan.verifier).post_cbor(
            f"sessions/{tracked.path_id}/policy", policy.to_obj(), idempotent=True
        )
        # SDCP 6.6: later assignments carry the profile; the contract stays as created.
        plan.sampling = policy.sampling
        return SessionState.from_obj(answer)

    # -- helpers ---------------------------------------------------------------------------------

    def _pick_verifier(self, contract: Contract, *, avoid: Sequence[str]) -> str | None:
        live = [view for view in self.registry.live(Role.VERIFIER, self.clock()) if view.uri not in avoid]
        candidates = [view for view in live if _serves(view, contract)] or _unreported(live)
        return prefer_idle_and_accepting(candidates).uri if candidates else None

    def _tracked(self, session: bytes) -> _TrackedSession:
        tracked = self.sessions.get(session)
        if tracked is None:
            raise NotFound("no such session at this router")
        return tracked

    def _end(self, tracked: _TrackedSession, kind: Action) -> None:
        if tracked.ended:
            return
        tracked.ended = True
        tracked.plan.drafter = None
        SESSIONS_OPEN.labels(self.uri).dec()
        log.info("%s: session %s ended (%s)", self.uri, tracked.plan.session.hex(), kind.name.lower())
        self.spawn(self._forget_later(tracked))

    async def _forget_later(self, tracked: _TrackedSession) -> None:
        """An ended session can be looked up for a while, then its memory is freed."""
        await asyncio.sleep(self.config.router.ended_retention_s)
        if self.sessions.get(tracked.plan.session) is tracked:
            del self.sessions[tracked.plan.session]


def _verify_s(verifier: InstanceView | None) -> float:
    """What a verification round costs at this verifier, for drafters that have not timed one: its
    time per self-decoded token, one pass."""
    if verifier is None or not verifier.status.self_us:
        return DEFAULT_VERIFY_S  # none reported, or a zero that no pass can take
    return verifier.status.self_us / 1e6
