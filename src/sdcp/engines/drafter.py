"""The drafter engine (SDCP 6.2, 6.3 after the verdict, 6.9), free of any transport.

``sdcp.protocol.drafter.DrafterSession`` keeps each session's rounds, the drafter backend
(``sdcp.models.drafter``) proposes tokens in one worker thread, the MLC holds the draft rows under a
lease until the verdict, a ``VerifierLink`` carries proposals and output reads. A session round:
choose M -> draft in the worker -> write and lease q_rows (rule 2) -> propose (pre-drafting the next
round meanwhile) -> apply the verdict -> sync the backend to the committed prefix -> release and
delete the rows.

A constrained session (structured output: the assignment's ``constraint``) is drafted with its
grammar where this drafter knows the contract's tokenizer (``[drafter] target``'s): where the
grammar forces the next tokens they start the proposal, at full confidence (one-hot rows, so rule 2
stays exact: each token is drawn from the row it carries), and the backend's draft after them goes
on up to its first token the grammar disallows (docs/interpretations.md, "Structured output").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from sdcp.cache import MLC, CacheError, InvalidURI, build_uri
from sdcp.cache.uri import Q_ROWS_KIND
from sdcp.config import DrafterConfig
from sdcp.engines.errors import Unanswered
from sdcp.engines.history import HistoryReader, directory_uri, history_scope_key, index_uri, warm
from sdcp.engines.ports import VerifierLink
from sdcp.engines.tasks import BackgroundTasks
from sdcp.grammar import ConstraintError, GrammarConstraint, grammar_tokenizer
from sdcp.models.drafter import Drafter, DraftResult
from sdcp.models.errors import ModelError, UnknownSession
from sdcp.models.lookup.suffix import SharesHistory
from sdcp.models.worker import InlineModelThread, ModelThread
from sdcp.protocol.contract import tokenizer_definition_digest
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.drafter import (
    CONSTRAINED,
    PLAIN,
    SESSION_CLASSES,
    AcceptanceEstimate,
    DrafterSession,
    session_class,
)
from sdcp.protocol.messages import (
    Action,
    Assignment,
    HistoryStatus,
    Output,
    Proposal,
    Role,
    SessionState,
    Status,
    Verdict,
)
from sdcp.protocol.problems import BadContract, BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import decode_token_list
from sdcp.protocol.rules import get_rule
from sdcp.threads import CoreGovernor

__all__ = [
    "DrafterEngine",
    "InconsistentPrefix",
    "MEASURED_AFTER_VERDICTS",
    "confirmed_predraft",
    "q_rows_uri",
]

log = logging.getLogger("sdcp.drafter")

PROPOSALS = Counter("sdcp_drafter_proposals_total", "Proposals sent", ["instance"])
TOKENS_PROPOSED = Counter("sdcp_drafter_tokens_proposed_total", "Tokens proposed", ["instance"])
TOKENS_ACCEPTED = Counter("sdcp_drafter_tokens_accepted_total", "Proposed tokens the verifier accepted", ["instance"])
RESYNCS = Counter("sdcp_drafter_resyncs_total", "Resynchronisations after sdcp-stale-base", ["instance"])
PREDRAFT_OUTCOMES = ("used", "discarded")
PREDRAFTS = Counter("sdcp_drafter_predrafts_total", "Pre-drafted rounds by outcome", ["instance", "outcome"])
ROUND_SECONDS = Histogram("sdcp_drafter_round_seconds", "Time from sending a proposal to its verdict", ["instance"])
# From microseconds (a pre-draft sent at once, an inline drafter) to a model drafter's pass.
_GAP_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
VERDICT_TO_PROPOSAL_SECONDS = Histogram(
    "sdcp_drafter_verdict_to_proposal_seconds",
    "Time from a verdict's arrival to the session's next proposal leaving",
    ["instance"],
    buckets=_GAP_BUCKETS,
)
SECONDS_PER_TOKEN = Gauge(
    "sdcp_drafter_seconds_per_token", "What drafting one token costs here (measured)", ["instance"]
)
ACCEPTANCE = Gauge("sdcp_drafter_acceptance", "Measured acceptance alpha of this drafter's proposals", ["instance"])
HISTORY_SESSIONS = Gauge(
    "sdcp_drafter_history_sessions", "Finished sessions' outputs the shared history holds", ["instance"]
)
HISTORY_TOKENS = Gauge("sdcp_drafter_history_tokens", "Tokens the shared history holds", ["instance"])
HISTORY_BYTES = Gauge("sdcp_drafter_history_bytes", "Estimated memory of the shared history", ["instance"])
HISTORY_MAX_TOKENS = Gauge("sdcp_drafter_history_max_tokens", "Tokens the shared history may hold", ["instance"])
HISTORY_LEARNED = Counter(
    "sdcp_drafter_history_learned_total", "Finished sessions' outputs read from the MLC into the history", ["instance"]
)

_ROW_BYTES_PER_TOKEN = 4  # one binary32 value per vocabulary entry (SDCP 5.2 q_rows)
# Verification time assumed before the first verdict has been timed.
_INITIAL_ROUND_TRIP_S = 0.05
_ROUND_TRIP_WEIGHT = 0.25
# Consecutive rounds that end without a verdict (problems, resyncs) before a session is given up:
# a verifier that keeps refusing us is better left to the router than hammered.
_MAX_ROUNDS_WITHOUT_VERDICT = 8
_RETRY_BACKOFF_S = 0.02
# Verdicts this instance takes in before its status reports an acceptance measurement; the report
# goes out at once then, which bounds how long a router explores an unmeasured drafter.
MEASURED_AFTER_VERDICTS = 4
_MAX_RETRY_BACKOFF_S = 1.0
# The longest an assignment waits for its history scope's new entries before drafting without them.
_HISTORY_READ_S = 2.0
# Session-state `state` values after which proposals are pointless (docs/interpretations.md).
_NOT_PROPOSING_STATES = frozenset({Action.SELF_DECODE, Action.FINISH, Action.FAIL})


class InconsistentPrefix(RuntimeError):
    """The committed tokens available to the drafter do not reproduce the committed digest."""


def q_rows_uri(mlc: MLC, assignment: Assignment, round_number: int) -> str:
    """Where the rows of one round's proposal live: unique per session, epoch and round."""
    name = f"{assignment.session.hex()}-e{assignment.epoch}-r{round_number}"
    return build_uri(mlc.authority, assignment.contract.scope, Q_ROWS_KIND, name)


class _RoundTrip:
    """Exponentially weighted time from sending a proposal to its verdict (t_v of SDCP 6.2)."""

    def __init__(self) -> None:
        self.seconds = _INITIAL_ROUND_TRIP_S
        self.measured = False

    def record(self, seconds: float) -> None:
        self.seconds = seconds if not self.measured else self.seconds + _ROUND_TRIP_WEIGHT * (seconds - self.seconds)
        self.measured = True


@dataclass
class _SessionRun:
    """One assigned session: its protocol state and what the drafter knows of its tokens."""

    assignment: Assignment
    state: DrafterSession
    prompt: tuple[int, ...] = ()
    output: list[int] = field(default_factory=list)
    output_digest: bytes = b""
    opened: bool = False
    task: asyncio.Task[None] | None = None
    # When the last verdict arrived (perf_counter), until the next proposal leaves.
    verdict_at: float | None = None
    # A constrained session's grammar where this drafter reads its tokenizer (else None): at the
    # empty output, and a copy advanced over ``guided``, the output tokens it has consumed.
    grammar: GrammarConstraint | None = None
    guide: GrammarConstraint | None = None
    guided: list[int] = field(default_factory=list)

    @property
    def session(self) -> bytes:
        return self.assignment.session

    @property
    def committed_prefix(self) -> list[int]:
        """What ``sdcp.models`` calls the committed prefix: prompt followed by committed output."""
        return [*self.prompt, *self.output]


class DrafterEngine:
    """A draft model instance: proposes tokens for the sessions the router assigns to it."""

    def __init__(
        self,
        *,
        uri: str,
        settings: DrafterConfig,
        drafter: Drafter,
        mlc: MLC,
        link: VerifierLink,
        ttl_ms: int,
        cores: CoreGovernor | None = None,
        on_measured: Callable[[], None] | None = None,
    ) -> None:
        self.uri = uri
        self.settings = settings
        self.drafter = drafter
        self.mlc = mlc
        self.ttl_ms = ttl_ms
        self._link = link
        # Called when this instance's acceptance is first measured: a router may be waiting for it.
        self._on_measured = on_measured
        self._tasks = BackgroundTasks(uri, log)
        self.runs: dict[bytes, _SessionRun] = {}
        self.worker: ModelThread | InlineModelThread = (
            InlineModelThread() if drafter.runs_inline else ModelThread(f"drafter-{drafter.name}", cores=cores)
        )
        self._round_trip = _RoundTrip()
        # Acceptance across the sessions this instance drafted, by session class (constrained or
        # not, ``session_class``): the alphas of its status reports, which the router compares with
        # self-decoding for a session of that class. How many verdicts each took in besides.
        self._acceptance = {klass: AcceptanceEstimate() for klass in SESSION_CLASSES}
        self._verdicts = dict.fromkeys(SESSION_CLASSES, 0)
        self._assigning = asyncio.Lock()
        for family in (
            PROPOSALS,
            TOKENS_PROPOSED,
            TOKENS_ACCEPTED,
            RESYNCS,
            ROUND_SECONDS,
            VERDICT_TO_PROPOSAL_SECONDS,
        ):
            family.labels(uri)
        for outcome in PREDRAFT_OUTCOMES:
            PREDRAFTS.labels(uri, outcome)
        SECONDS_PER_TOKEN.labels(uri).set_function(lambda: self.drafter.seconds_per_token)
        ACCEPTANCE.labels(uri).set_function(lambda: self._acceptance[PLAIN].alpha)
        # A drafter that drafts from earlier sessions reads finished sessions' output from the MLC.
        self._history: HistoryReader | None = None
        self._shares: SharesHistory | None = None
        if isinstance(drafter, SharesHistory):
            shares: SharesHistory = drafter
            self._shares = shares
            self._history = HistoryReader(mlc, entries=settings.history_entries, refresh_s=settings.history_refresh_s)
            HISTORY_SESSIONS.labels(uri).set_function(lambda: shares.history_size.sessions)
            HISTORY_TOKENS.labels(uri).set_function(lambda: shares.history_size.tokens)
            HISTORY_BYTES.labels(uri).set_function(lambda: shares.history_size.approx_bytes)
            HISTORY_MAX_TOKENS.labels(uri).set_function(lambda: shares.history_size.max_tokens)
            HISTORY_LEARNED.labels(uri)

    # -- status ----------------------------------------------------------------------------------

    def status(self) -> Status:
        estimates = [run.state.estimate.accept_milli for run in self.runs.values()]
        known = [milli for milli in estimates if milli is not None]
        bandwidth = self.mlc.bandwidth_mbps()
        return Status(
            instance=self.uri,
            role=Role.DRAFTER,
            load=round(100 * self.worker.busy_fraction()),
            queue=self.worker.queue,
            accept_milli=round(sum(known) / len(known)) if known else None,
            cache_mbps=int(bandwidth) if bandwidth is not None else None,
            ttl_ms=self.ttl_ms,
            model=self.drafter.weights_digest,
            alpha_milli=self._alpha_milli(PLAIN),
            alpha_constrained_milli=self._alpha_milli(CONSTRAINED),
            draft_us=round(1e6 * self.drafter.seconds_per_token),
            verify_us=round(1e6 * self._round_trip.seconds) if self._round_trip.measured else None,
            history=self._history_status(),
        )

    def _alpha_milli(self, klass: str) -> int | None:
        """The status report's acceptance on sessions of ``klass``, once measured."""
        if self._verdicts[klass] < MEASURED_AFTER_VERDICTS:
            return None
        return round(1000 * self._acceptance[klass].alpha)

    def _history_status(self) -> HistoryStatus | None:
        if self._shares is None:
            return None
        size = self._shares.history_size
        return HistoryStatus(sessions=size.sessions, tokens=size.tokens, max_tokens=size.max_tokens)

    async def start(self) -> None:
        # An HF drafter hashes and packs its weights once: before the first status report and draft.
        await self.worker.run_async(self.drafter.prepare)
        await self._warm_history()

    async def _warm_history(self) -> None:
        """Read the history scopes of the owners this instance is configured for, within
        ``history_warm_s`` (readiness waits no longer) and the history's token budget, so that it
        drafts from them from its first round (sdcp.engines.history, ``warm``). Only those owners'
        directories are read: another owner's history reaches this instance at an assignment of
        that owner's session, as the router decides, never at start."""
        settings = self.settings
        shares, reader = self._shares, self._history
        if shares is None or reader is None or settings.history_warm_s <= 0:
            return
        authority = self.mlc.authority
        if settings.history_scope == "target":
            directories = [directory_uri(authority, None, "target")]
        else:
            directories = [directory_uri(authority, owner, "owner") for owner in settings.history_warm_owners]
        if not directories:
            return

        async def learn(key: bytes, output: tuple[int, ...]) -> None:
            await self.worker.run_async(shares.learn, key, output)
            HISTORY_LEARNED.labels(self.uri).inc()

        def full() -> bool:
            size = shares.history_size
            return size.tokens >= size.max_tokens

        started = time.perf_counter()
        try:
            async with asyncio.timeout(settings.history_warm_s):
                learned = await warm(reader, directories, learn, full)
        except TimeoutError:
            log.warning("%s: history warming stopped after %.1f s", self.uri, settings.history_warm_s)
            return
        log.info("%s: history warmed with %d outputs in %.2f s", self.uri, learned, time.perf_counter() - started)

    async def stop(self) -> None:
        await self._tasks.cancel_all()
        # Closing joins the model's thread after its queued work: not on the event loop.
        await asyncio.to_thread(self.worker.close)

    # -- what the router asks --------------------------------------------------------------------

    async def assign(self, assignment: Assignment) -> None:
        """POST assignments (SDCP 6.1): start, or restart, drafting for a session."""
        self._check(assignment)
        async with self._assigning:
            held = self.runs.get(assignment.session)
            if held is not None:
                if assignment.epoch < held.state.epoch:
                    raise ProtocolError(
                        ProblemType.STALE_EPOCH,
                        f"this drafter holds the session at epoch {held.state.epoch}, not {assignment.epoch}",
                    )
                await self._stop_run(held)
            # The acceptance history belongs to this drafter and session, so it survives a reassignment.
            estimate = held.state.estimate if held is not None else AcceptanceEstimate()
            run = _SessionRun(assignment, DrafterSession(assignment, estimate))
            self.runs[assignment.session] = run
            run.task = self._tasks.spawn(self._serve(run))
        log.info("%s: drafting session %s at epoch %d", self.uri, assignment.session.hex(), assignment.epoch)

    def _check(self, assignment: Assignment) -> None:
        if assignment.drafter != self.uri:
            raise BadMessage(f"the assignment names drafter {assignment.drafter}, not {self.uri}")
        verifier = urlsplit(assignment.verifier)
        if verifier.scheme != "https" or not verifier.hostname:
            raise BadMessage(f"verifier must be an https base URI, got {assignment.verifier!r}")
        contract = assignment.contract
        get_rule(contract.rule)  # raises sdcp-bad-contract for an unregistered rule
        if contract.drafters is not None and self.drafter.weights_digest not in contract.drafters:
            # SDCP 6.1: only a drafter whose model the contract permits may serve the session.
            raise BadContract(f"the contract does not permit this drafter's model {self.drafter.weights_digest.hex()}")
        if assignment.m_init < 1:
            raise BadMessage("m_init must be at least 1")
        references = {"prompt": assignment.prompt, "committed_tokens": assignment.committed_tokens}
        for member, reference in references.items():
            if isinstance(reference, str):
                try:
                    self.mlc.serving(reference)
                except InvalidURI as exc:
                    raise BadMessage(f"{member}: {exc}") from exc

    async def _stop_run(self, run: _SessionRun) -> None:
        if run.task is not None and not run.task.done():
            run.task.cancel()
            await asyncio.wait([run.task])

    # -- the session loop ------------------------------------------------------------------------

    async def _serve(self, run: _SessionRun) -> None:
        try:
            await self._prepare(run)
            await self._propose_until_stopped(run)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: session %s stopped on an error", self.uri, run.session.hex())
        finally:
            if run.opened:
                await self._close_backend_session(run.session)
            if self.runs.get(run.session) is run:
                del self.runs[run.session]

    async def _close_backend_session(self, session: bytes) -> None:
        # UnknownSession: the open was cancelled before the worker started it.
        with contextlib.suppress(UnknownSession):
            await self.worker.run_async(self.drafter.close_session, session)

    async def _prepare(self, run: _SessionRun) -> None:
        """SDCP 6.2: bring the drafter's own state to the committed prefix of the assignment."""
        assignment = run.assignment
        if isinstance(assignment.prompt, str):
            run.prompt = decode_token_list(await self.mlc.get(assignment.prompt), "prompt")
        else:
            run.prompt = assignment.prompt
        run.output_digest = prefix_digest(assignment.contract.digest, run.prompt)
        # Marked before the call: a cancellation may land while the worker is opening it.
        run.opened = True
        await self.worker.run_async(self.drafter.open_session, run.session, list(run.prompt))
        if self._shares is not None:
            await self._bind_history(run, self._shares)
        if assignment.committed > 0 and assignment.committed_tokens is not None:
            await self._adopt_committed_object(run, assignment.committed_tokens)
        await self._catch_up(run, assignment.committed, assignment.digest)
        await self.worker.run_async(self.drafter.sync, run.session, run.committed_prefix)
        if assignment.constraint is not None:
            run.grammar = await asyncio.to_thread(self._grammar, assignment)

    def _grammar(self, assignment: Assignment) -> GrammarConstraint | None:
        """The session's grammar over the target's tokenizer, if ``[drafter] target`` names the
        contract's; else None (drafted unguided: the verifier applies the constraint anyway)."""
        assert assignment.constraint is not None
        contract = assignment.contract
        try:
            definition, digest = _target_tokenizer(self.settings.target)
            if digest != contract.tokenizer:
                return None
            tokenizer = grammar_tokenizer(definition, self.drafter.vocab_size)
            return GrammarConstraint(tokenizer, assignment.constraint, contract.stop, self.drafter.vocab_size)
        except (ModelError, OSError, ConstraintError) as exc:
            log.warning("%s: session %s drafted without its grammar: %s", self.uri, assignment.session.hex(), exc)
            return None

    async def _bind_history(self, run: _SessionRun, drafter: SharesHistory) -> None:
        """Draft from the finished sessions of the assignment's history scope (its contract and,
        by default, its owner: docs/security.md), after reading the scope's entries published since
        the last look (sdcp.engines.history): all of them at its first assignment here, which warms
        a new instance from the shared store. A store that does not answer costs the history only."""
        assignment = run.assignment
        key = history_scope_key(assignment.contract, assignment.owner, self.settings.history_scope, assignment.tenant)
        await self.worker.run_async(drafter.bind_history, run.session, key)
        reader = self._history
        if reader is None or not reader.due(index := index_uri(self.mlc.authority, assignment.contract, key)):
            return

        async def learn(output: tuple[int, ...]) -> None:
            await self.worker.run_async(drafter.learn, key, output)
            HISTORY_LEARNED.labels(self.uri).inc()

        try:
            async with asyncio.timeout(_HISTORY_READ_S):
                await reader.refresh(index, learn)
        except Exception as exc:  # noqa: BLE001 - the history only makes drafts longer
            log.warning("%s: history %s not read: %r", self.uri, index, exc)

    async def _adopt_committed_object(self, run: _SessionRun, uri: str) -> None:
        assignment = run.assignment
        try:
            tokens = decode_token_list(await self.mlc.get(uri), "committed_tokens")
        except (CacheError, BadMessage) as exc:
            log.warning("%s: committed tokens %s unusable, asking the verifier: %s", self.uri, uri, exc)
            return
        if len(tokens) == assignment.committed and extend_digest(run.output_digest, tokens) == assignment.digest:
            run.output = list(tokens)
            run.output_digest = assignment.digest
        else:
            log.warning("%s: committed tokens %s do not match the assignment, asking the verifier", self.uri, uri)

    async def _catch_up(self, run: _SessionRun, committed: int, digest: bytes) -> None:
        """Make the known output the first ``committed`` tokens with digest d[committed] (SDCP 4.2).

        Missing tokens come from the verifier's output resource; when the known tokens turn out
        to be on another prefix, the whole output is read again from index 0.
        """
        d0 = prefix_digest(run.assignment.contract.digest, run.prompt)
        if committed <= len(run.output):
            if extend_digest(d0, run.output[:committed]) == digest:
                del run.output[committed:]
                run.output_digest = digest
                return
        else:
            missing = await self._read_output(run, len(run.output), committed)
            if extend_digest(run.output_digest, missing) == digest:
                run.output.extend(missing)
                run.output_digest = digest
                return
        tokens = await self._read_output(run, 0, committed)
        if extend_digest(d0, tokens) != digest:
            raise InconsistentPrefix(f"the verifier's {committed} committed tokens do not give the committed digest")
        run.output = list(tokens)
        run.output_digest = digest

    async def _resync_from_output(self, run: _SessionRun) -> None:
        """sdcp-stale-base without the session-state (another implementation's verifier need not
        send our member): the output tells the committed prefix, and the round is found by trying
        the next one (docs/interpretations.md, "we send session_state; we accept its absence")."""
        state = run.state
        try:
            output = await self._output_at(run, len(run.output))
        except ProtocolError as exc:
            if exc.problem is not ProblemType.STALE_EPOCH:
                raise
            state.stopped_by = ProblemType.STALE_EPOCH
            return
        if output.tokens:
            run.output.extend(output.tokens)
            run.output_digest = extend_digest(run.output_digest, output.tokens)
            state.learn_prefix(len(run.output), run.output_digest)
        elif output.final:
            state.stopped_by = output.finish if output.finish is not None else Action.FAIL
        elif not state.try_later_round():
            state.stopped_by = ProblemType.STALE_BASE

    async def _output_at(self, run: _SessionRun, start: int) -> Output:
        """GET sessions/{id}/output?from=start (SDCP 6.7), checked to answer this session, index and
        epoch (another epoch is sdcp-stale-epoch: the session moved, SDCP 6.9)."""
        output = await self._link.output(run.state.verifier, run.session, start)
        if output.session != run.session or output.from_ != start:
            raise BadMessage("the verifier's output answers another session or index")
        if output.epoch != run.state.epoch:
            raise ProtocolError(ProblemType.STALE_EPOCH, f"the verifier serves epoch {output.epoch}")
        return output

    async def _read_output(self, run: _SessionRun, start: int, end: int) -> list[int]:
        """Output tokens start..end-1 from GET sessions/{id}/output (SDCP 6.7)."""
        tokens: list[int] = []
        while start + len(tokens) < end:
            output = await self._output_at(run, start + len(tokens))
            if not output.tokens:
                raise InconsistentPrefix(f"the verifier has no output at index {start + len(tokens)} of {end}")
            tokens.extend(output.tokens)
        return tokens[: end - start]

    async def _propose_until_stopped(self, run: _SessionRun) -> None:
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
            draft = ready if ready is not None else await self._draft(run, self._choose_m(run))
            ready = None
            verdict, proposal, predraft = await self._round(run, draft)
            if verdict is None:
                rounds_without_verdict += 1
                await asyncio.sleep(min(_MAX_RETRY_BACKOFF_S, _RETRY_BACKOFF_S * 2**rounds_without_verdict))
                continue
            rounds_without_verdict = 0
            ready = await self._apply_verdict(run, proposal, verdict, predraft)

    def _choose_m(self, run: _SessionRun) -> int:
        """SDCP 6.2 RECOMMENDED rule."""
        return run.state.choose_m(*self._costs(run))

    def _costs(self, run: _SessionRun) -> tuple[float, float]:
        """The cost model's t_d, including the rows' trip to the cache, and t_v (a round trip)."""
        t_d = self.drafter.seconds_per_token
        bandwidth = self.mlc.bandwidth_mbps()
        if get_rule(run.state.contract.rule).needs_q and bandwidth:
            t_d += self.drafter.vocab_size * _ROW_BYTES_PER_TOKEN / (bandwidth * 1e6)
        return t_d, self._round_trip.seconds

    async def _draft(self, run: _SessionRun, m: int) -> DraftResult:
        guide = self._guide(run)
        if guide is None:
            return await self.worker.run_async(self.drafter.draft, run.session, m, run.state.sampling)
        # Masks take up to a millisecond each: off the event loop.
        forced = await asyncio.to_thread(guide.forced, (), m)
        needs_q = get_rule(run.state.contract.rule).needs_q
        if len(forced) == m or (forced and forced[-1] in run.state.contract.stop):
            return DraftResult(forced, self._one_hot(forced) if needs_q else None, 0.0)
        if forced:
            # The backend drafts on after the forced tokens, from the prefix they extend (the
            # verdict's sync brings it back to the committed prefix).
            await self.worker.run_async(self.drafter.sync, run.session, [*run.committed_prefix, *forced])
        draft = await self.worker.run_async(self.drafter.draft, run.session, m - len(forced), run.state.sampling)
        tokens = (*forced, *draft.tokens)
        allowed = await asyncio.to_thread(guide.allowed, tokens)
        # The tokens up to the first one the grammar disallows (a stop token where the output is
        # complete included); at least one, as a proposal has: the verifier then emits its own.
        keep = len(allowed) - 1
        if keep < len(tokens) and allowed[keep][tokens[keep]]:
            keep += 1
        keep = max(keep, 1)
        rows = None
        if draft.q_rows is not None:
            rows = np.concatenate([self._one_hot(forced), draft.q_rows[: keep - len(forced)]])
        return DraftResult(tokens[:keep], rows, draft.seconds)

    def _one_hot(self, tokens: tuple[int, ...]) -> np.ndarray:
        """The q rows of tokens proposed at full confidence: each is drawn from its row (SDCP 5.2)."""
        rows = np.zeros((len(tokens), self.drafter.vocab_size), dtype=np.float32)
        rows[np.arange(len(tokens)), tokens] = 1.0
        return rows

    def _guide(self, run: _SessionRun) -> GrammarConstraint | None:
        """The session's grammar at its committed output (None when unguided), advanced from the
        tokens it consumed before, or again from the start where a resync changed those."""
        if run.grammar is None:
            return None
        if run.guide is None or run.output[: len(run.guided)] != run.guided:
            run.guide, run.guided = run.grammar.fork(), []
        try:
            run.guide.commit(run.output[len(run.guided) :])
        except ValueError as exc:
            # Not the verifier's language after all: draft unguided rather than guess.
            log.warning("%s: session %s: grammar left: %s", self.uri, run.session.hex(), exc)
            run.grammar = run.guide = None
            return None
        run.guided = list(run.output)
        return run.guide

    async def _round(self, run: _SessionRun, draft: DraftResult) -> tuple[Verdict | None, Proposal, DraftResult | None]:
        """Publish the rows, send the proposal, pre-draft the next round; the verdict or None."""
        state = run.state
        rows_uri = await self._publish_rows(run, draft) if get_rule(state.contract.rule).needs_q else None
        predraft: asyncio.Future[DraftResult] | None = None
        send: asyncio.Future[Verdict] | None = None
        try:
            # SDCP 6.2: base, base_digest and round come from the last verdict; one outstanding.
            proposal = state.propose(draft.tokens, status=self.status(), q_rows=rows_uri)
            send = asyncio.ensure_future(self._send(run, proposal))
            # A guided session's drafts are not the backend's own continuation: none is prepared.
            if self.settings.predraft and run.grammar is None:
                if self.drafter.runs_inline:
                    # An inline drafter pre-drafts on this event loop: the proposal leaves first.
                    await asyncio.sleep(0)
                # SDCP 6.2: the next proposal MAY be prepared assuming full acceptance. The backend
                # continues after the tentative tokens: one token stands for the verifier's extra token.
                length = state.m_after_full_acceptance(*self._costs(run)) + 1
                predraft = self.worker.schedule(self.drafter.draft, run.session, length, state.sampling)
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

    async def _publish_rows(self, run: _SessionRun, draft: DraftResult) -> str:
        """SDCP 6.2: the rows go to the MLC under a lease held until the verdict."""
        uri = q_rows_uri(self.mlc, run.assignment, run.state.round + 1)
        await self.mlc.put(uri, draft.q_rows_bytes())
        await self.mlc.lease(uri, self.uri, self.settings.lease_s)
        return uri

    async def _discard_rows(self, uri: str) -> None:
        try:
            await self.mlc.release(uri, self.uri)
            await self.mlc.delete(uri)
        except CacheError as exc:
            log.warning("%s: draft rows %s not cleaned up: %s", self.uri, uri, exc)

    async def _send(self, run: _SessionRun, proposal: Proposal) -> Verdict:
        """POST proposals; a lost answer is asked for again (SDCP 6.9) while the rows are leased."""
        deadline = time.monotonic() + self.settings.lease_s
        attempt = 0
        while True:
            started = time.perf_counter()
            if run.verdict_at is not None:
                # What the verdict left to do before this proposal: applying it, syncing the
                # backend and, without a confirmed pre-draft, drafting (docs/performance.md).
                VERDICT_TO_PROPOSAL_SECONDS.labels(self.uri).observe(started - run.verdict_at)
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
            ROUND_SECONDS.labels(self.uri).observe(elapsed)
            PROPOSALS.labels(self.uri).inc()
            TOKENS_PROPOSED.labels(self.uri).inc(len(proposal.tokens))
            return verdict

    async def _on_problem(self, run: _SessionRun, proposal: Proposal, error: ProtocolError) -> None:
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
                RESYNCS.labels(self.uri).inc()
                await self._catch_up(run, state.committed, state.digest)
        elif error.problem is ProblemType.STALE_BASE:
            RESYNCS.labels(self.uri).inc()
            await self._resync_from_output(run)
        else:
            state.on_problem(error)
        if state.stopped_by is None:
            await self.worker.run_async(self.drafter.sync, run.session, run.committed_prefix)

    async def _apply_verdict(
        self, run: _SessionRun, proposal: Proposal, verdict: Verdict, predraft: DraftResult | None
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
        TOKENS_ACCEPTED.labels(self.uri).inc(verdict.accepted)
        self._measure_acceptance(session_class(run.assignment.constraint), verdict.accepted, len(proposal.tokens))
        if extend_digest(run.output_digest, verdict.emitted) == verdict.digest:
            run.output.extend(verdict.emitted)
            run.output_digest = verdict.digest
        else:
            await self._catch_up(run, verdict.committed, verdict.digest)
        if state.stopped_by is not None:
            log.info("%s: session %s: %s", self.uri, run.session.hex(), action.name.lower())
            return None
        ready = confirmed_predraft(proposal, verdict, predraft, self._choose_m(run))
        if predraft is not None:
            PREDRAFTS.labels(self.uri, "used" if ready is not None else "discarded").inc()
        tentative = ready.tokens if ready is not None else ()
        await self.worker.run_async(self.drafter.sync, run.session, [*run.committed_prefix, *tentative])
        return ready

    def _measure_acceptance(self, klass: str, accepted: int, proposed: int) -> None:
        self._acceptance[klass].update(accepted, proposed)
        self._verdicts[klass] += 1
        # The router may be exploring this drafter on that class: the measurement ends that at once.
        if self._verdicts[klass] == MEASURED_AFTER_VERDICTS and self._on_measured is not None:
            self._on_measured()


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


@functools.lru_cache(maxsize=2)
def _target_tokenizer(name: str) -> tuple[str, bytes]:
    """A target's tokenizer definition (its ``tokenizer.json``, as the verifier's grammar reads it)
    and digest, from the tokenizer alone; kept, as a drafter serves one target."""
    from sdcp.models.registry import load_tokenizer
    from sdcp.models.weights.digests import tokenizer_definition

    definition = tokenizer_definition(load_tokenizer(name))
    return definition, tokenizer_definition_digest(definition)


async def _settled(task: asyncio.Future[DraftResult]) -> DraftResult | None:
    """The pre-draft's result, or None when it failed: it is an optimisation only."""
    try:
        return await task
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a pre-draft is an optimisation only
        log.warning("pre-draft failed: %s", exc)
        return None
