"""A session's rounds at the drafter (SDCP 6.2, 6.3 after the verdict, 6.9 retries): choose M, draft
in the worker, write and lease q_rows (rule 2), propose (pre-drafting the next round meanwhile),
apply the verdict, sync the backend to the committed prefix, release and delete the rows."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sdcp.cache import MLC, CacheError
from sdcp.config import DrafterConfig
from sdcp.engines.drafter.catchup import PrefixCatchUp
from sdcp.engines.drafter.guided import current_guide, guided_draft
from sdcp.engines.drafter.observe import Acceptance, DrafterMetrics, RoundTrip
from sdcp.engines.drafter.runs import SessionRun, q_rows_uri
from sdcp.engines.errors import Unanswered
from sdcp.engines.ports import VerifierLink
from sdcp.models.drafter import Drafter, DraftResult
from sdcp.models.worker import InlineModelThread, ModelThread
from sdcp.protocol.digest import extend_digest
from sdcp.protocol.drafter import session_class
from sdcp.protocol.messages import Action, Proposal, SessionState, Status, Verdict
from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.protocol.rules import get_rule

__all__ = ["Rounds", "confirmed_predraft"]

log = logging.getLogger("sdcp.drafter")

_ROW_BYTES_PER_TOKEN = 4  # one binary32 value per vocabulary entry (SDCP 5.2 q_rows)
# Consecutive rounds that end without a verdict (problems, resyncs) before a session is given up:
# a verifier that keeps refusing us is better left to the router than hammered.
_MAX_ROUNDS_WITHOUT_VERDICT = 8
_RETRY_BACKOFF_S = 0.02
_MAX_RETRY_BACKOFF_S = 1.0
# Session-state `state` values after which proposals are pointless (docs/interpretations.md).
_NOT_PROPOSING_STATES = frozenset({Action.SELF_DECODE, Action.FINISH, Action.FAIL})


class Rounds:
    """The rounds of the drafter ``uri``'s sessions; ``status`` is the report each proposal carries."""

    def __init__(
        self,
        *,
        uri: str,
        settings: DrafterConfig,
        drafter: Drafter,
        worker: ModelThread | InlineModelThread,
        mlc: MLC,
        link: VerifierLink,
        catchup: PrefixCatchUp,
        round_trip: RoundTrip,
        acceptance: Acceptance,
        metrics: DrafterMetrics,
        status: Callable[[], Status],
    ) -> None:
        self.uri = uri
        self._settings = settings
        self._drafter = drafter
        self._worker = worker
        self._mlc = mlc
        self._link = link
        self._catchup = catchup
        self._round_trip = round_trip
        self._acceptance = acceptance
        self._metrics = metrics
        self._status = status

    async def propose_until_stopped(self, run: SessionRun) -> None:
        state = run.state
        ready: DraftResult | None = None
        rounds_without_verdict = 0
        while state.stopped_by is None:
            if rounds_without_verdict >= _MAX_ROUNDS_WITHOUT_VERDICT:
                log.warning(
                    "%s: session %s: %d rounds without a verdict; giving it up",
                    self.uri,
                    run.session.hex(),
                    rounds_without_verdict,
                )
                return
            draft = ready if ready is not None else await self._draft(run, self.choose_m(run))
            ready = None
            verdict, proposal, predraft = await self._round(run, draft)
            if verdict is None:
                rounds_without_verdict += 1
                await asyncio.sleep(min(_MAX_RETRY_BACKOFF_S, _RETRY_BACKOFF_S * 2**rounds_without_verdict))
                continue
            rounds_without_verdict = 0
            ready = await self._apply_verdict(run, proposal, verdict, predraft)

    def choose_m(self, run: SessionRun) -> int:
        """SDCP 6.2 RECOMMENDED rule."""
        return run.state.choose_m(*self._costs(run))

    def _costs(self, run: SessionRun) -> tuple[float, float]:
        """The cost model's t_d, including the rows' trip to the cache, and t_v (a round trip)."""
        t_d = self._drafter.seconds_per_token
        bandwidth = self._mlc.bandwidth_mbps()
        if get_rule(run.state.contract.rule).needs_q and bandwidth:
            t_d += self._drafter.vocab_size * _ROW_BYTES_PER_TOKEN / (bandwidth * 1e6)
        return t_d, self._round_trip.seconds

    async def _draft(self, run: SessionRun, m: int) -> DraftResult:
        guide = current_guide(run, self.uri)
        if guide is None:
            return await self._worker.run_async(self._drafter.draft, run.session, m, run.state.sampling)
        return await guided_draft(run, guide, m, drafter=self._drafter, worker=self._worker)

    async def _round(self, run: SessionRun, draft: DraftResult) -> tuple[Verdict | None, Proposal, DraftResult | None]:
        """Publish the rows, send the proposal, pre-draft the next round; the verdict or None."""
        state = run.state
        rows_uri = await self._publish_rows(run, draft) if get_rule(state.contract.rule).needs_q else None
        predraft: asyncio.Future[DraftResult] | None = None
        send: asyncio.Future[Verdict] | None = None
        try:
            # SDCP 6.2: base, base_digest and round come from the last verdict; one outstanding.
            proposal = state.propose(draft.tokens, status=self._status(), q_rows=rows_uri)
            send = asyncio.ensure_future(self._send(run, proposal))
            # A guided session's drafts are not the backend's own continuation: none is prepared.
            if self._settings.predraft and run.grammar is None:
                if self._drafter.runs_inline:
                    # An inline drafter pre-drafts on this event loop: the proposal leaves first.
                    await asyncio.sleep(0)
                # SDCP 6.2: the next proposal MAY be prepared assuming full acceptance. The backend
                # continues after the tentative tokens: one token stands for the verifier's extra token.
                length = state.m_after_full_acceptance(*self._costs(run)) + 1
                predraft = self._worker.schedule(self._drafter.draft, run.session, length, state.sampling)
            try:
                verdict = await send
            except ProtocolError as error:
                await self._on_problem(run, proposal, error)
                return None, proposal, None
            return verdict, proposal, await _settled(predraft) if predraft is not None else None
        finally:
            if send is not None and not send.done():
                send.cancel()
                await asyncio.wait([send])
            if predraft is not None and not predraft.done():
                await _settled(predraft)
            if rows_uri is not None:
                # SDCP 6.3: after the verdict the drafter MAY release its leases.
                await self._discard_rows(rows_uri)

    async def _publish_rows(self, run: SessionRun, draft: DraftResult) -> str:
        """SDCP 6.2: the rows go to the MLC under a lease held until the verdict."""
        uri = q_rows_uri(self._mlc, run.assignment, run.state.round + 1)
        await self._mlc.put(uri, draft.q_rows_bytes())
        await self._mlc.lease(uri, self.uri, self._settings.lease_s)
        return uri

    async def _discard_rows(self, uri: str) -> None:
        try:
            await self._mlc.release(uri, self.uri)
            await self._mlc.delete(uri)
        except CacheError as exc:
            log.warning("%s: draft rows %s not cleaned up: %s", self.uri, uri, exc)

    async def _send(self, run: SessionRun, proposal: Proposal) -> Verdict:
        """POST proposals; a lost answer is asked for again (SDCP 6.9) while the rows are leased."""
        deadline = time.monotonic() + self._settings.lease_s
        attempt = 0
        while True:
            started = time.perf_counter()
            if run.verdict_at is not None:
                # What the verdict left to do before this proposal: applying it, syncing the
                # backend and, without a confirmed pre-draft, drafting (docs/performance.md).
                self._metrics.before_proposal(started - run.verdict_at)
                run.verdict_at = None
            try:
                verdict = await self._link.propose(run.state.verifier, proposal)
            except Unanswered as exc:
                attempt += 1
                if time.monotonic() >= deadline:
                    raise
                log.info("%s: proposal for round %d unanswered (%s); asking again", self.uri, proposal.round, exc)
                await asyncio.sleep(min(_MAX_RETRY_BACKOFF_S, _RETRY_BACKOFF_S * 2**attempt))
                continue
            run.verdict_at = time.perf_counter()
            elapsed = run.verdict_at - started
            self._round_trip.record(elapsed)
            self._metrics.proposed(len(proposal.tokens), elapsed)
            return verdict

    async def _on_problem(self, run: SessionRun, proposal: Proposal, error: ProtocolError) -> None:
        state = run.state
        log.info(
            "%s: round %d of %s refused: %s %s",
            self.uri,
            proposal.round,
            run.session.hex(),
            error.problem.suffix if error.problem else error.status,
            error.detail,
        )
        if error.problem is ProblemType.LIMIT:
            if len(proposal.tokens) == 1:
                # Nothing shorter exists; the verifier and this drafter disagree on the limits.
                state.stopped_by = ProblemType.LIMIT
                return
            state.on_problem(error)
            state.m_cap = max(1, len(proposal.tokens) // 2)
        elif error.problem is ProblemType.STALE_BASE and error.state is not None:
            if error.state.state is not None and error.state.state in _NOT_PROPOSING_STATES:
                # The verifier decodes the session itself or has ended it: no proposal can land.
                state.stopped_by = Action.parse(error.state.state)
                return
            state.on_problem(error)
            if state.stopped_by is None:
                self._metrics.resynced()
                await self._catchup.catch_up(run, state.committed, state.digest)
        elif error.problem is ProblemType.STALE_BASE:
            self._metrics.resynced()
            await self._catchup.resync_from_output(run)
        else:
            state.on_problem(error)
        if state.stopped_by is None:
            await self._worker.run_async(self._drafter.sync, run.session, run.committed_prefix)

    async def _apply_verdict(
        self, run: SessionRun, proposal: Proposal, verdict: Verdict, predraft: DraftResult | None
    ) -> DraftResult | None:
        """SDCP 6.3: keep the accepted tokens, discard the rest; the confirmed pre-draft or None."""
        state = run.state
        if verdict.round == proposal.round and verdict.committed != proposal.base + len(verdict.emitted):
            # SDCP 6.3 Idempotency: a verdict that exists is returned unchanged, so a proposal for
            # an already decided round gets that round's verdict, built on another base. It still
            # tells the committed prefix after the round: resynchronise to it.
            await self._on_problem(
                run,
                proposal,
                ProtocolError(
                    ProblemType.STALE_BASE,
                    "the verdict of this round answers another proposal",
                    state=SessionState(
                        session=verdict.session,
                        epoch=verdict.epoch,
                        round=verdict.round,
                        committed=verdict.committed,
                        digest=verdict.digest,
                    ),
                ),
            )
            return None
        action = state.apply_verdict(verdict)
        self._metrics.accepted(verdict.accepted)
        self._acceptance.record(session_class(run.assignment.constraint), verdict.accepted, len(proposal.tokens))
        if extend_digest(run.output_digest, verdict.emitted) == verdict.digest:
            run.output.extend(verdict.emitted)
            run.output_digest = verdict.digest
        else:
            await self._catchup.catch_up(run, verdict.committed, verdict.digest)
        if state.stopped_by is not None:
            log.info("%s: session %s: %s", self.uri, run.session.hex(), action.name.lower())
            return None
        ready = confirmed_predraft(proposal, verdict, predraft, self.choose_m(run))
        if predraft is not None:
            self._metrics.predraft(used=ready is not None)
        tentative = ready.tokens if ready is not None else ()
        await self._worker.run_async(self._drafter.sync, run.session, [*run.committed_prefix, *tentative])
        return ready


def confirmed_predraft(
    proposal: Proposal, verdict: Verdict, predraft: DraftResult | None, m: int
) -> DraftResult | None:
    """The next proposal out of the pre-draft, if the verdict confirmed full acceptance.

    The pre-draft continued after x[1..M]; its first token guessed the verifier's extra token.
    When every x was accepted and the guess equals the emitted extra token, the rest was drafted
    on exactly the committed prefix, each token from the row it carries (SDCP 5.2).
    """
    if predraft is None or len(predraft.tokens) < 2 or verdict.accepted != len(proposal.tokens):
        return None
    if verdict.emitted != (*proposal.tokens, predraft.tokens[0]):
        return None
    keep = min(m, len(predraft.tokens) - 1)
    rows = predraft.q_rows[1 : 1 + keep] if predraft.q_rows is not None else None
    return DraftResult(predraft.tokens[1 : 1 + keep], rows, predraft.seconds)


async def _settled(task: asyncio.Future[DraftResult]) -> DraftResult | None:
    """The pre-draft's result, or None when it failed: it is an optimisation only."""
    try:
        return await task
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a pre-draft is an optimisation only
        log.warning("pre-draft failed: %s", exc)
        return None
