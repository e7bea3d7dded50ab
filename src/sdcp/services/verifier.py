"""The verifier role over HTTP/2 + mTLS (SDCP Table 1, 6.1, 6.3, 6.5.2, 6.6, 6.7).

Route handlers over ``sdcp.engines.VerifierEngine``: each reads and checks the request (body,
caller, path), calls the engine and answers in CBOR. Events go to the router over mTLS. A call that
changes a session runs to its end even when its client resets the stream or goes away (the server
cancels the handler then): a round cut off between its commit-log append and its release would
leave a durable record unreleased (SDCP 6.3).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import replace
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sdcp.cache import MLC
from sdcp.config import ServiceConfig, thread_budget
from sdcp.engines.errors import SessionNotFound, Unanswered
from sdcp.engines.tasks import shielded_unless_gone
from sdcp.engines.verifier import TRACE_ROUNDS, VerifierEngine
from sdcp.models.backend import DEFAULT_KV_SLOTS, LLAMACPP_KV_SLOTS, Target, TargetBackend
from sdcp.models.batching import BatchingScorer
from sdcp.models.choice import BackendChoice, choose_backend
from sdcp.models.registry import load_target
from sdcp.protocol.messages import (
    Assignment,
    CancelRequest,
    Event,
    Output,
    OutputBatch,
    OutputReads,
    Policy,
    Proposal,
    ReadRefusal,
    SelfDecodeRequest,
    SessionOpen,
    Status,
    parse_session_path_id,
)
from sdcp.protocol.problems import BadMessage, ProtocolError
from sdcp.services.authz import Party, SessionParties
from sdcp.services.node import Node
from sdcp.threads import CoreGovernor
from sdcp.transport.asgi import cbor_response, read_cbor_body
from sdcp.transport.errors import ConnectionLost, HTTPProblem, NotFound, PeerClientError, PeerServerError, PeerTimeout
from sdcp.transport.peer import peer_uri
from sdcp.transport.signing import RecordCheck, RecordSigner

__all__ = ["VerifierNode"]

log = logging.getLogger("sdcp.verifier")

_RouterMessage = TypeVar("_RouterMessage", Assignment, Policy, SelfDecodeRequest)


class VerifierNode(Node):
    """The target model's verifier, served over HTTP/2 + mTLS."""

    role = "verifier"

    def __init__(self, config: ServiceConfig, *, target: Target | None = None, mlc: MLC | None = None) -> None:
        super().__init__(config, mlc)
        settings = config.verifier
        threads = thread_budget(config, "verifier")
        if target is None:
            choice = choose_backend(settings.backend, settings.model, device=settings.device, threads=threads)
            log.info("%s: the target runs on %s (%s)", self.uri, choice.backend, _described(choice))
            target = load_target(
                settings.model,
                device=settings.device,
                dtype=settings.dtype,
                kv_slots=_kv_slots(settings.kv_slots, choice.backend),
                kv_capacity=settings.kv_capacity or None,
                backend=choice.backend,
                threads=threads,
                prefix_cache_bytes=settings.prefix_cache_bytes,
            )
        self.backend = target.backend
        settings = replace(settings, backend=target.backend)
        if target.backend == "llamacpp":
            # llama.cpp holds kv_slots sessions at most: an open past them is answered 503 with
            # Retry-After, as past max_sessions, rather than failing in the prefill.
            slots = _kv_slots(settings.kv_slots, target.backend)
            settings = replace(settings, max_sessions=min(settings.max_sessions, slots))
        cores = CoreGovernor(threads, set_threads=target.set_threads)
        target.follow_load(cores)
        self.engine = VerifierEngine(
            uri=self.uri,
            settings=settings,
            target=target,
            mlc=self.mlc,
            ttl_ms=config.instance.ttl_ms,
            cores=cores,
            events=self._post_event if config.instance.routers else None,
            # Signed commit records (docs/security.md): with the key of this instance's certificate.
            sign=RecordSigner.load(config.instance.cert, config.instance.key).sign,
            record_check=RecordCheck.load(config.instance.ca),
            trusted_verifier=lambda uri: self.trust.is_member(uri, Party.VERIFIER),
        )
        # The router each session last heard from or answered (SDCP 6.5.2): its events go there
        # first, the configured routers after it (docs/reliability.md, "Routers"). As many entries
        # as sessions may be held here, twice over, the oldest forgotten first.
        self._session_routers: OrderedDict[bytes, str] = OrderedDict()

    def build(self) -> dict[str, str]:
        # The digests a session-open's contract must name here (SDCP 6.1), as `sdcp models digest`
        # prints them for this backend.
        return {
            "model": self.config.verifier.model,
            "backend": self.backend,
            "target": self.engine.target.weights_digest.hex(),
            "tokenizer": self.engine.target.tokenizer_digest.hex(),
        }

    def status(self) -> Status:
        return self.engine.status()

    def model_threads(self) -> tuple[BatchingScorer]:
        return (self.engine.scorer,)

    async def on_start(self) -> None:
        await self.engine.start()

    async def on_stop(self) -> None:
        await self.engine.stop()

    async def _post_event(self, event: Event) -> None:
        """POST events at the session's router, or at the next one where it does not answer: any
        router can load the session from the shared tier and act on it."""
        first = self._session_routers.get(event.session)
        routers = ([first] if first is not None else []) + [r for r in self.config.instance.routers if r != first]
        unanswered = []
        for router in routers:
            try:
                await self.peers.get(router).post_cbor("events", event.to_obj(), idempotent=True)
            except PeerClientError as exc:
                raise ProtocolError(None, exc.detail, status=exc.status) from exc
            except (ConnectionLost, PeerTimeout, PeerServerError) as exc:
                unanswered.append(f"{router}: {exc}")
                continue
            self._heard_from(event.session, router)
            return
        raise Unanswered("; ".join(unanswered))

    def _heard_from(self, session: bytes, router: str) -> None:
        self._session_routers[session] = router
        self._session_routers.move_to_end(session)
        while len(self._session_routers) > 2 * self.engine.settings.max_sessions:
            self._session_routers.popitem(last=False)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/sessions", self.open_session, methods=["POST"]),
            Route("/sessions/{id}/drafter", self.assign_drafter, methods=["PUT"]),
            Route("/proposals", self.propose, methods=["POST"]),
            Route("/sessions/{id}/output", self.output, methods=["GET"]),
            Route("/outputs", self.outputs, methods=["POST"]),
            Route("/sessions/{id}/policy", self.policy, methods=["POST"]),
            Route("/sessions/{id}/stats", self.stats, methods=["GET"]),
            Route("/sessions/{id}/trace", self.trace, methods=["GET"]),
            Route("/sessions/{id}/self-decode", self.self_decode, methods=["POST"]),
            Route("/sessions/{id}/cancel", self.cancel, methods=["POST"]),
        ]

    async def open_session(self, request: Request) -> Response:
        """POST sessions (SDCP 6.1, 6.9 resume)."""
        router = self.trust.admit(request, "POST sessions")
        body = await read_cbor_body(request)
        message = SessionOpen.from_obj(body)
        state = await shielded_unless_gone(lambda gone: self.engine.open_session(message, gone))
        self._heard_from(message.session, router)
        return cbor_response(state.to_obj(), status=201)

    async def assign_drafter(self, request: Request) -> Response:
        """PUT sessions/{id}/drafter (SDCP 6.1)."""
        message = await self._router_message(request, "PUT sessions/{id}/drafter", Assignment)
        state = await asyncio.shield(self.engine.assign(message))
        return cbor_response(state.to_obj())

    async def policy(self, request: Request) -> Response:
        """POST sessions/{id}/policy (SDCP 6.6)."""
        policy = await self._router_message(request, "POST sessions/{id}/policy", Policy)
        state = await asyncio.shield(self.engine.apply_policy(policy))
        return cbor_response(state.to_obj())

    async def self_decode(self, request: Request) -> Response:
        """POST sessions/{id}/self-decode (extension, docs/interpretations.md)."""
        message = await self._router_message(request, "POST sessions/{id}/self-decode", SelfDecodeRequest)
        state = await asyncio.shield(self.engine.self_decode(message))
        return cbor_response(state.to_obj())

    async def cancel(self, request: Request) -> Response:
        """POST sessions/{id}/cancel (extension, docs/interpretations.md): the router or the
        session's front end ends it before max_new."""
        session = parse_session_path_id(request.path_params["id"])
        peer = self.trust.admit(request, "POST sessions/{id}/cancel", self._parties(session))
        if self.trust.is_member(peer, Party.ROUTER):
            self._heard_from(session, peer)
        message = CancelRequest.from_obj(await read_cbor_body(request))
        if message.session != session:
            raise BadMessage("the cancel request names another session than the path")
        state = await asyncio.shield(self.engine.cancel(message))
        return cbor_response(state.to_obj())

    async def _router_message(self, request: Request, endpoint: str, kind: type[_RouterMessage]) -> _RouterMessage:
        """A router's message about the session the path names."""
        router = self.trust.admit(request, endpoint)
        body = await read_cbor_body(request)
        session = parse_session_path_id(request.path_params["id"])
        message = kind.from_obj(body)
        if message.session != session:
            raise BadMessage(f"the {kind.__name__.lower()} names another session than the path")
        self._heard_from(session, router)
        return message

    async def propose(self, request: Request) -> Response:
        """POST proposals (SDCP 6.3)."""
        body = await read_cbor_body(request)
        verdict = await asyncio.shield(self.engine.propose(Proposal.from_obj(body), peer_uri(request)))
        return cbor_response(verdict.to_obj())

    async def stats(self, request: Request) -> Response:
        """GET sessions/{id}/stats (not in Table 1)."""
        session = parse_session_path_id(request.path_params["id"])
        self.trust.admit(request, "GET sessions/{id}/stats", self._parties(session))
        return cbor_response(self.engine.stats(session))

    async def trace(self, request: Request) -> Response:
        """GET sessions/{id}/trace (not in Table 1): the session's recent rounds, where time went."""
        session = parse_session_path_id(request.path_params["id"])
        self.trust.admit(request, "GET sessions/{id}/trace", self._parties(session))
        last_text = request.query_params.get("last", str(TRACE_ROUNDS))
        if not (last_text.isascii() and last_text.isdigit() and len(last_text) <= 10):
            raise BadMessage("'last' must be an unsigned integer")
        return cbor_response(self.engine.trace(session, int(last_text)))

    def _parties(self, session: bytes) -> SessionParties:
        owner, drafter = self.engine.parties(session)
        return SessionParties(drafter=drafter, owner=owner)

    async def output(self, request: Request) -> Response:
        """GET sessions/{id}/output?from=n (SDCP 6.7)."""
        session = parse_session_path_id(request.path_params["id"])
        self.trust.admit(request, "GET sessions/{id}/output", self._parties(session))
        start_text = request.query_params.get("from", "0")
        if not (start_text.isascii() and start_text.isdigit() and len(start_text) <= 10):
            raise BadMessage("'from' must be an unsigned integer below 2^32")
        output = await self.engine.output(session, int(start_text))
        return cbor_response(output.to_obj())

    async def outputs(self, request: Request) -> Response:
        """POST outputs (extension, docs/interpretations.md): several sessions' output reads in one,
        each admitted as its GET sessions/{id}/output would be."""
        message = OutputReads.from_obj(await read_cbor_body(request))
        refused: list[ReadRefusal] = []
        reads: list[tuple[bytes, int]] = []
        for read in message.reads:
            try:
                self.trust.admit(request, "POST outputs", self._parties(read.session))
            except (ProtocolError, HTTPProblem) as exc:
                refused.append(_refusal(read.session, exc))
                continue
            except SessionNotFound as exc:
                refused.append(_refusal(read.session, NotFound(str(exc))))
                continue
            reads.append((read.session, read.from_))
        # A refused read is answered at once; the reads admitted beside it are asked again.
        answers = await self.engine.outputs(reads) if reads and not refused else []
        outputs = [answer for _, answer in answers if isinstance(answer, Output)]
        refused += [_refusal(session, answer) for session, answer in answers if isinstance(answer, ProtocolError)]
        return cbor_response(OutputBatch(outputs=tuple(outputs), refused=tuple(refused)).to_obj())


def _refusal(session: bytes, error: ProtocolError | HTTPProblem) -> ReadRefusal:
    """The problem the read's GET sessions/{id}/output would have answered."""
    problem = error.to_problem()
    detail = str(problem.get("detail") or problem["title"])
    return ReadRefusal(session=session, type=problem["type"], status=problem["status"], detail=detail[:1024])


def _kv_slots(configured: int | None, backend: TargetBackend) -> int:
    if configured is not None:
        return configured
    return LLAMACPP_KV_SLOTS if backend == "llamacpp" else DEFAULT_KV_SLOTS


def _described(choice: BackendChoice) -> str:
    measured = ", ".join(
        f"{backend} {one_token:.1f} ms a one-token pass, {proposal:.1f} ms a proposal's"
        for backend, (one_token, proposal) in choice.measured_ms.items()
    )
    return f"{choice.reason}: {measured}" if measured else choice.reason
