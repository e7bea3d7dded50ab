"""The drafter role over HTTP/2 + mTLS (SDCP Table 1, 6.1, 6.2).

A route handler over ``sdcp.engines.DrafterEngine``, and the engine's way to verifiers over mTLS
(``HTTPVerifierLink``): POST proposals and GET sessions/{id}/output.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from sdcp.cache import MLC
from sdcp.config import ServiceConfig, thread_budget
from sdcp.engines.drafter import DrafterEngine
from sdcp.engines.errors import Unanswered
from sdcp.models.drafter import Drafter
from sdcp.models.registry import load_drafter, target_vocab_size
from sdcp.models.worker import InlineModelThread, ModelThread
from sdcp.protocol.messages import Assignment, Output, Proposal, Status, Verdict, session_path_id
from sdcp.services.node import Node
from sdcp.threads import CoreGovernor
from sdcp.transport.asgi import read_cbor_body
from sdcp.transport.client import PeerClients
from sdcp.transport.errors import ConnectionLost, PeerServerError, PeerTimeout

__all__ = ["DrafterNode", "HTTPVerifierLink"]

# What leaves a request unanswered, as opposed to answered with a problem (SDCP 6.9: ask again).
_UNANSWERED = (ConnectionLost, PeerTimeout, PeerServerError)


class HTTPVerifierLink:
    """Proposals and output reads to verifiers over HTTP/2 + mTLS (a ``VerifierLink``)."""

    def __init__(self, peers: PeerClients) -> None:
        self._peers = peers

    async def propose(self, verifier: str, proposal: Proposal) -> Verdict:
        try:
            _, body = await self._peers.get(verifier).post_cbor("proposals", proposal.to_obj(), idempotent=True)
        except _UNANSWERED as exc:
            raise Unanswered(str(exc)) from exc
        return Verdict.from_obj(body)

    async def output(self, verifier: str, session: bytes, start: int) -> Output:
        path = f"sessions/{session_path_id(session)}/output"
        try:
            _, body = await self._peers.get(verifier).get_cbor(path, {"from": start})
        except _UNANSWERED as exc:
            raise Unanswered(str(exc)) from exc
        return Output.from_obj(body)


class DrafterNode(Node):
    """A draft model instance, served over HTTP/2 + mTLS."""

    role = "drafter"

    def __init__(self, config: ServiceConfig, *, drafter: Drafter | None = None, mlc: MLC | None = None) -> None:
        super().__init__(config, mlc)
        settings = config.drafter
        threads = thread_budget(config, "drafter")
        if drafter is None:
            drafter = load_drafter(
                settings.model,
                vocab_size=target_vocab_size(settings.target),
                device=settings.device,
                dtype=settings.dtype,
                threads=threads,
            )
        self.engine = DrafterEngine(
            uri=self.uri,
            settings=settings,
            drafter=drafter,
            mlc=self.mlc,
            link=HTTPVerifierLink(self.peers),
            ttl_ms=config.instance.ttl_ms,
            cores=CoreGovernor(threads, set_threads=drafter.set_threads),
            on_measured=self.report_status_soon,
        )

    def status(self) -> Status:
        return self.engine.status()

    def model_threads(self) -> tuple[ModelThread | InlineModelThread]:
        return (self.engine.worker,)

    async def on_start(self) -> None:
        await self.engine.start()

    async def on_stop(self) -> None:
        await self.engine.stop()

    def routes(self) -> list[BaseRoute]:
        return [Route("/assignments", self.assign, methods=["POST"])]

    async def assign(self, request: Request) -> Response:
        """POST assignments (SDCP 6.1)."""
        self.trust.admit(request, "POST assignments")
        body = await read_cbor_body(request)
        await asyncio.shield(self.engine.assign(Assignment.from_obj(body)))
        return Response(status_code=204)
