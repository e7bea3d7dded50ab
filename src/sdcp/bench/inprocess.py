"""System 3: SDCP's engines in one process, joined by an in-memory link instead of HTTP/2 + mTLS.

The verifier and drafter engines are the ones the services run (``sdcp.engines``), with their model
threads, batching, host-memory MLC and commit log; messages still travel as deterministic CBOR, so
that the gap to the end-to-end system is what HTTP/2, TLS, the processes and the router cost. The
router's part is the least a session needs: open it, assign the n-gram drafter, assign it again
when the verifier's event asks for one (SDCP 6.5.2).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sdcp.bench.systems import RunResult, result_from_stats
from sdcp.cache import MLC, build_uri
from sdcp.client import build_contract
from sdcp.config import DrafterConfig, RouterConfig, VerifierConfig
from sdcp.engines.drafter import DrafterEngine
from sdcp.engines.ports import VerifierLink
from sdcp.engines.verifier import VerifierEngine
from sdcp.models.backend import Target
from sdcp.models.draft import Drafter, NgramDrafter
from sdcp.protocol.messages import Action, Contract, Event, Output, Proposal, Verdict
from sdcp.protocol.router import RouterSession
from sdcp.threads import CoreGovernor

__all__ = ["InMemoryVerifierLink", "InProcessSDCPSystem"]

VERIFIER_URI = "https://verifier.inprocess"
DRAFTER_URI = "https://drafter-ngram.inprocess"
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


class InProcessSDCPSystem:
    """The verifier and a drafter engine in this process; ``generate`` decodes one session.

    By default the n-gram drafter, joined to the verifier by an `InMemoryVerifierLink`; ``drafter``,
    ``drafter_settings``, ``link`` (wraps that link, e.g. to delay it), ``cores`` (the verifier's
    core governor), ``authority`` and ``uris`` (the verifier's and the drafter's) let a benchmark
    vary them."""

    name = "sdcp_inprocess"

    def __init__(
        self,
        target: Target,
        stop: Sequence[int],
        *,
        drafter: Drafter | None = None,
        drafter_settings: DrafterConfig | None = None,
        link: Callable[[InMemoryVerifierLink], VerifierLink] | None = None,
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
        self.m_init = RouterConfig().m_init
        self._plans: dict[bytes, RouterSession] = {}
        self._sessions = 0

    async def start(self) -> None:
        await self.verifier.start()
        await self.drafter.start()

    async def aclose(self) -> None:
        await self.drafter.stop()
        await self.verifier.stop()
        await self.mlc.close()

    async def generate(self, prompt: Sequence[int], max_new: int, contract: Contract | None = None) -> RunResult:
        """One session of ``prompt``; under ``contract`` where given (its max_new then applies), else
        under the client's default contract."""
        self._sessions += 1
        session = self._sessions.to_bytes(16, "big")
        if contract is None:
            contract = build_contract(
                target=self.target.weights_digest,
                tokenizer=self.target.tokenizer_digest,
                max_new=max_new,
                stop=self.stop,
            )
        plan = RouterSession(
            session=session,
            epoch=1,
            contract=contract,
            prompt=tuple(prompt),
            commit_log=build_uri(self.mlc.authority, contract.scope, "log", session.hex()),
            verifier=self.verifier_uri,
        )
        self._plans[session] = plan
        started = time.perf_counter()
        try:
            await self.verifier.open_session(plan.open_message())
            await self._assign(plan)
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
        finally:
            del self._plans[session]
        result = result_from_stats(self.verifier.stats(session), seconds)
        result.tokens, result.first_token_ms = tokens, first_token_ms
        return result

    async def _assign(self, plan: RouterSession) -> None:
        """SDCP 6.1: the verifier learns of the drafter first, then the drafter gets the assignment."""
        state = self.verifier.state(plan.session)
        assignment = plan.assignment(
            self.drafter_uri, round=state.round, committed=state.committed, digest=state.digest, m_init=self.m_init
        )
        await self.verifier.assign(assignment)
        await self.drafter.assign(assignment)

    async def _on_event(self, event: Event) -> None:
        received = Event.from_cbor(event.to_cbor())
        plan = self._plans.get(received.session)
        if plan is not None and received.kind == Action.SWITCH:
            # A switch or the end of a self-decoding period: the one drafter is assigned again.
            await self._assign(plan)
