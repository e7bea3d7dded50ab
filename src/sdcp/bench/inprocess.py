"""System 3: SDCP's engines in one process, joined by in-memory links instead of HTTP/2 + mTLS.

The router, verifier and drafter engines are the ones the services run (``sdcp.engines``), with
their model threads, batching, host-memory MLC and commit log; messages still travel as
deterministic CBOR, so that the gap to the end-to-end system is what HTTP/2, TLS and the processes
cost. The router engine opens each session, chooses who drafts for it (the drafter, or the verifier
alone where the cost model expects that to be faster) and assigns again when the verifier's event
asks (SDCP 6.5.2), from the status reports both engines send it every third of their TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from sdcp.bench.systems import RunResult, result_from_stats
from sdcp.cache import MLC
from sdcp.config import DrafterConfig, RouterConfig, VerifierConfig
from sdcp.engines.drafter import DrafterEngine
from sdcp.engines.ports import RouterLink, VerifierLink
from sdcp.engines.router import RouterEngine
from sdcp.engines.tasks import shielded_unless_gone
from sdcp.engines.verifier import VerifierEngine
from sdcp.frontend.client import build_contract
from sdcp.models.backend import Target
from sdcp.models.drafter import Drafter
from sdcp.models.lookup.ngram import NgramDrafter
from sdcp.protocol.messages import (
    Assignment,
    CancelRequest,
    Constraint,
    Contract,
    Event,
    Output,
    Policy,
    Proposal,
    SelfDecodeRequest,
    SessionOpen,
    SessionRequest,
    SessionState,
    Verdict,
)
from sdcp.threads import CoreGovernor

__all__ = ["InMemoryRouterLink", "InMemoryVerifierLink", "InProcessSDCPSystem"]

ROUTER_URI = "https://router.inprocess"
VERIFIER_URI = "https://verifier.inprocess"
DRAFTER_URI = "https://drafter-ngram.inprocess"
# The front end that opens the benchmark's sessions, as the router knows it.
FRONT_END = "https://bench.inprocess"
_TTL_MS = 3000


class InMemoryVerifierLink:
    """A ``VerifierLink`` that calls the verifier engine directly, each message encoded and decoded
    as on the wire, the caller authenticated as ``drafter``."""

    def __init__(self, verifier: VerifierEngine, drafter: str) -> None:
        self._verifier = verifier
        self._drafter = drafter

    async def propose(self, verifier: str, proposal: Proposal) -> Verdict:
        received = Proposal.from_cbor(proposal.to_cbor())
        verdict = await self._verifier.propose(received, self._drafter)
        return Verdict.from_cbor(verdict.to_cbor())

    async def output(self, verifier: str, session: bytes, start: int) -> Output:
        output = await self._verifier.output(session, start)
        return Output.from_cbor(output.to_cbor())


class InMemoryRouterLink:
    """A ``RouterLink`` that calls the verifier and drafter engines (by URI) directly, each message
    encoded and decoded as on the wire."""

    def __init__(self, verifiers: Mapping[str, VerifierEngine], drafters: Mapping[str, DrafterEngine]) -> None:
        self._verifiers = verifiers
        self._drafters = drafters

    async def open_session(self, verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        # As the verifier's service: withdrawn (cancelled) during the prefill, the open stops there.
        opened = SessionOpen.from_cbor(message.to_cbor())
        engine = self._verifiers[verifier]
        return _state(await shielded_unless_gone(lambda gone: engine.open_session(opened, gone)))

    async def inform_verifier(self, verifier: str, assignment: Assignment) -> SessionState:
        return _state(await self._verifiers[verifier].assign(Assignment.from_cbor(assignment.to_cbor())))

    async def assign(self, drafter: str, assignment: Assignment) -> None:
        await self._drafters[drafter].assign(Assignment.from_cbor(assignment.to_cbor()))

    async def policy(self, verifier: str, policy: Policy) -> SessionState:
        return _state(await self._verifiers[verifier].apply_policy(Policy.from_cbor(policy.to_cbor())))

    async def self_decode(self, verifier: str, request: SelfDecodeRequest) -> SessionState:
        message = SelfDecodeRequest.from_cbor(request.to_cbor())
        return _state(await self._verifiers[verifier].self_decode(message))

    async def cancel(self, verifier: str, request: CancelRequest) -> SessionState:
        return _state(await self._verifiers[verifier].cancel(CancelRequest.from_cbor(request.to_cbor())))


def _state(state: SessionState) -> SessionState:
    return SessionState.from_cbor(state.to_cbor())


class InProcessSDCPSystem:
    """The router, the verifier and a drafter engine in this process; ``generate`` decodes one
    session, opened through the router engine.

    By default the n-gram drafter, joined to the verifier by an `InMemoryVerifierLink`; ``drafter``,
    ``drafter_settings``, ``link`` (wraps that link, e.g. to delay it), ``router_link`` (wraps the
    router's `InMemoryRouterLink`), ``cores`` (the verifier's core governor), ``authority`` and
    ``uris`` (the verifier's and the drafter's) let a benchmark vary them; with
    ``self_decoding=False`` the router is not told how fast the verifier decodes alone, so that it
    always chooses the drafter (the verifier's own ladder may still self-decode, SDCP 6.5.2)."""

    name = "sdcp_inprocess"

    def __init__(
        self,
        target: Target,
        stop: Sequence[int],
        *,
        drafter: Drafter | None = None,
        drafter_settings: DrafterConfig | None = None,
        link: Callable[[InMemoryVerifierLink], VerifierLink] | None = None,
        router_link: Callable[[InMemoryRouterLink], RouterLink] | None = None,
        self_decoding: bool = True,
        cores: CoreGovernor | None = None,
        authority: str = "inprocess",
        uris: tuple[str, str] = (VERIFIER_URI, DRAFTER_URI),
    ) -> None:
        self.target = target
        self.stop = list(stop)
        self.mlc = MLC.from_config(authority=authority)
        self.verifier_uri, self.drafter_uri = uris
        self.verifier = VerifierEngine(
            uri=self.verifier_uri,
            settings=VerifierConfig(),
            target=target,
            mlc=self.mlc,
            ttl_ms=_TTL_MS,
            cores=cores,
            events=self._on_event,
        )
        in_memory = InMemoryVerifierLink(self.verifier, self.drafter_uri)
        self.drafter = DrafterEngine(
            uri=self.drafter_uri,
            settings=drafter_settings or DrafterConfig(),
            drafter=drafter or NgramDrafter(target.vocab_size),
            mlc=self.mlc,
            link=link(in_memory) if link is not None else in_memory,
            ttl_ms=_TTL_MS,
        )
        in_memory_router = InMemoryRouterLink({self.verifier_uri: self.verifier}, {self.drafter_uri: self.drafter})
        self.router = RouterEngine(
            uri=ROUTER_URI,
            settings=RouterConfig,
            mlc=self.mlc,
            link=router_link(in_memory_router) if router_link is not None else in_memory_router,
            # The verifier engine here signs nothing: its records are replayed unchecked.
            record_check=None,
            interval_s=_TTL_MS / 3000,
            grace_s=_TTL_MS / 1000,
        )
        self._self_decoding = self_decoding
        self._reports: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.verifier.start()
        await self.drafter.start()
        await self.router.start()
        self._report()
        self._reports = asyncio.create_task(self._report_forever())

    async def aclose(self) -> None:
        if self._reports is not None:
            self._reports.cancel()
        await self.router.stop()
        await self.drafter.stop()
        await self.verifier.stop()
        await self.mlc.close()

    def _report(self) -> None:
        """Both engines' status reports to the router (SDCP 6.1)."""
        verifier = self.verifier.status()
        self.router.report(verifier if self._self_decoding else replace(verifier, self_us=None))
        self.router.report(self.drafter.status())

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(_TTL_MS / 3000)
            self._report()

    async def generate(
        self,
        prompt: Sequence[int],
        max_new: int,
        contract: Contract | None = None,
        constraint: Constraint | None = None,
    ) -> RunResult:
        """One session of ``prompt``; under ``contract`` where given (its max_new then applies), else
        under the client's default contract; its output in the language of ``constraint``, if given."""
        if contract is None:
            contract = build_contract(
                target=self.target.weights_digest,
                tokenizer=self.target.tokenizer_digest,
                max_new=max_new,
                stop=self.stop,
            )
        started = time.perf_counter()
        request = SessionRequest(prompt=tuple(prompt), contract=contract, constraint=constraint)
        tracked = await self.router.open_session(FRONT_END, request)
        session = tracked.session
        tokens: list[int] = []
        first_token_ms: float | None = None
        while True:
            output = await self.verifier.output(session, len(tokens))
            if output.tokens and first_token_ms is None:
                first_token_ms = 1000 * (time.perf_counter() - started)
            tokens.extend(output.tokens)
            if output.final:
                break
        seconds = time.perf_counter() - started
        result = result_from_stats(self.verifier.stats(session), seconds)
        result.tokens, result.first_token_ms = tokens, first_token_ms
        return result

    async def _on_event(self, event: Event) -> None:
        received = Event.from_cbor(event.to_cbor())
        await self.router.event(await self.router.contact(received.session), received)
