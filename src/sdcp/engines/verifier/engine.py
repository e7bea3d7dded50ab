"""The verifier engine's facade: what the router, drafters and readers ask (SDCP 6.1, 6.3, 6.6, 6.7).

``sdcp.protocol.verifier.VerifierSession`` decides, the ``BatchingScorer`` computes target rows
(batched across sessions) on the one thread that owns the model, the MLC holds draft rows and the
commit log. A round: admit -> score (and fetch q rows concurrently) -> decide -> append the commit
record -> apply -> reply and wake output readers (rounds.py). Self-decoding periods (selfdecode.py),
the model's copy of each session (kvsync.py), events and sweeps (events.py) and measurements
(observe.py) are parts the engine wires together here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

from sdcp.cache import MLC, CacheError, InvalidURI, ObjectNotFound, target_kv_uri
from sdcp.cache.prefix import tenant_scope
from sdcp.config import VerifierConfig
from sdcp.engines.errors import RequesterGone, SessionNotFound, Unavailable
from sdcp.engines.history import HistoryReader
from sdcp.engines.ports import EventSink
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.admission import Admissions
from sdcp.engines.verifier.events import RouterEvents, SessionSweeps
from sdcp.engines.verifier.history import HistoryPublisher
from sdcp.engines.verifier.kvpublish import KVPublisher
from sdcp.engines.verifier.kvsync import ModelSync
from sdcp.engines.verifier.live import LiveSession, RunningSessions
from sdcp.engines.verifier.lookahead import VerifierLookahead
from sdcp.engines.verifier.observe import (
    TRACE_ROUNDS,
    PassCurves,
    VerifierMetrics,
    session_stats,
    session_trace,
)
from sdcp.engines.verifier.prefills import ShortPrefills
from sdcp.engines.verifier.prefixshare import PrefixSharing
from sdcp.engines.verifier.rounds import RecordSign, Rounds, Scoring
from sdcp.engines.verifier.selfdecode import SelfDecoding
from sdcp.grammar import ConstraintError, GrammarConstraint, grammar_tokenizer
from sdcp.latency import observe_part
from sdcp.models.backend import Opening, Target
from sdcp.models.batching import BatchingScorer
from sdcp.models.drafter import TokenTimer
from sdcp.models.errors import DigestMismatch, ModelError
from sdcp.models.worker import ModelThreadClosed
from sdcp.protocol.drafter import AcceptanceEstimate
from sdcp.protocol.messages import (
    MAX_REPORTED_PREFIXES,
    Assignment,
    CancelRequest,
    Constraint,
    Output,
    PassCost,
    Policy,
    Proposal,
    Role,
    SelfDecodeRequest,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
)
from sdcp.protocol.passcost import FIRST_CURVE_MS, PASS_ROWS
from sdcp.protocol.problems import BadContract, BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import RecordAuthority, decode_token_list, session_terms
from sdcp.protocol.verifier import Replay, VerifierSession, Wait
from sdcp.threads import CoreGovernor

__all__ = ["OUTPUT_LINGER_TOKENS", "VerifierEngine"]

log = logging.getLogger("sdcp.verifier")

# The scratch session with which the verifier times one pass before serving.
_PROBE_SESSION = b"sdcp-pass-probe!"
_PROBE_PROMPT_TOKENS = 64
# How long a router's message waits for the round in flight to be decided.
_ROUTER_WAIT_S = 5.0
# When a refused session-open may be tried again (sessions end at their own pace).
_RETRY_AFTER_S = 5
# A lingering output read answers once it holds this many tokens (VerifierConfig.output_linger_ms).
OUTPUT_LINGER_TOKENS = 16


def _nothing() -> None:
    """A call the scorer's thread runs once the work queued before it has: the pass under way."""


def _read(live: LiveSession, start: int) -> Output | ProtocolError:
    try:
        return live.machine.output(start)
    except ProtocolError as exc:
        return exc


def _has_news(read: Output | ProtocolError) -> bool:
    return not isinstance(read, Output) or bool(read.tokens) or read.final


class VerifierEngine:
    """The target model's verifier: the sole commit authority of its sessions."""

    def __init__(
        self,
        *,
        uri: str,
        settings: VerifierConfig,
        target: Target,
        mlc: MLC,
        ttl_ms: int,
        cores: CoreGovernor | None = None,
        events: EventSink | None = None,
        sign: RecordSign | None = None,
        record_check: RecordAuthority | None = None,
        trusted_verifier: Callable[[str], bool] = lambda _uri: False,
    ) -> None:
        self.uri = uri
        self.settings = settings
        self.target = target
        self.mlc = mlc
        self.ttl_ms = ttl_ms
        # The opens waiting for or in their prefill (status prefill_tokens); short ones go first.
        self.admissions = admissions = Admissions(lambda: self.settings.admission_hold_ms / 1000)
        self.scorer = BatchingScorer(
            target,
            window_s=settings.batch_window_ms / 1000,
            max_batch=settings.max_batch,
            active_sessions=self._active_sessions,
            cores=cores,
            # The loop hears of a greedy run's rounds after each pass while it would hold the
            # running sessions for a prompt's prefill (Admissions), not a group of steps later.
            deliver_now=lambda: admissions.first,
        )
        self.sessions: dict[bytes, LiveSession] = {}
        self._running = RunningSessions(self.sessions)
        self._tasks = BackgroundTasks(uri, log)
        self.pass_curves = PassCurves()
        self.metrics = VerifierMetrics(
            uri,
            running=self._active_sessions,
            waiting=lambda: self._scoring.waiting,
            kv_usage=target.kv_usage,
            prefix_bytes=self._prefix_bytes,
            pass_curve=self.pass_curves.base,
        )
        self._model_sync = ModelSync(uri, target, self.scorer, self.sessions)
        self._events = RouterEvents(
            uri,
            events,
            self.sessions,
            orphan_s=lambda: self.settings.orphan_timeout_s,
            orphaned=lambda session, epoch: self.cancel(CancelRequest(session=session, epoch=epoch)),
        )
        # Prefix KV through the MLC: published with the record-signing key, used only as signed by a
        # verifier of [trust] verifiers.
        self._prefix_sharing = PrefixSharing(
            uri=uri,
            metrics=self.metrics,
            target=target,
            mlc=mlc,
            tasks=self._tasks,
            sign=sign,
            authority=record_check,
            trusted=trusted_verifier,
            idle=self._running.idle,
        )
        self._kv_publisher = KVPublisher(
            uri=uri,
            target=target,
            thread=self.scorer,
            mlc=mlc,
            settings=lambda: self.settings,
            tasks=self._tasks,
            shared=self._prefix_sharing.shares,
        )
        # Self-decoding's guesses, from the session and the outputs of earlier finished sessions:
        # those that finished here and those of the session's history scope in the MLC.
        self.lookahead = VerifierLookahead(
            lambda: self.settings.history_scope,
            reader=HistoryReader(mlc, entries=settings.history_entries, refresh_s=settings.history_refresh_s),
            vocab_size=target.vocab_size,
        )
        self._sweeps = SessionSweeps(
            uri=uri,
            settings=lambda: self.settings,
            sessions=self.sessions,
            running=self._running,
            events=self._events,
            model_sync=self._model_sync,
            kv_publisher=self._kv_publisher,
            tasks=self._tasks,
            history=HistoryPublisher(
                uri=uri, mlc=mlc, settings=lambda: self.settings, tasks=self._tasks, metrics=self.metrics
            ),
            lookahead=self.lookahead,
        )
        self._long_polls = 0
        self._prefill_turn = asyncio.Lock()
        self._short_prefills = ShortPrefills(
            turn=self._prefill_turn,
            prefill=self._prefill_group,
            close=self._forget,
            cost=self._prefill_cost,
            ready=lambda: self.scorer.run_async(_nothing),
        )
        # Seconds per self-decoded token, for the router's choice between drafters and this
        # verifier alone (status self_us); timed before serving (_time_passes).
        self.self_decode_time = TokenTimer(initial=FIRST_CURVE_MS[0] / 1000)
        self._scoring = Scoring(self.scorer, self.pass_curves)
        self._rounds = Rounds(
            uri=uri,
            metrics=self.metrics,
            target=target,
            mlc=mlc,
            scoring=self._scoring,
            model_sync=self._model_sync,
            kv_publisher=self._kv_publisher,
            events=self._events,
            sweeps=self._sweeps,
            tasks=self._tasks,
            start_self_decoding=self._start_self_decoding,
            running=self._running,
            sign=sign,
        )
        self._self_decoding = SelfDecoding(
            uri=uri,
            rounds=self._rounds,
            scoring=self._scoring,
            model_sync=self._model_sync,
            events=self._events,
            tasks=self._tasks,
            pass_curves=self.pass_curves,
            token_time=self.self_decode_time,
            active_sessions=self._active_sessions,
            lookahead=self.lookahead,
            admissions=self.admissions,
            group_apart_s=lambda: self.settings.self_decode_group_ms / 1000,
        )

    # -- life and status -------------------------------------------------------------------------

    async def start(self) -> None:
        # Digests hash every weight and the weights are packed once: before the first status report,
        # contract check or pass, on the scorer thread.
        await self.scorer.run_async(self.target.prepare)
        await self.scorer.run_async(self._time_passes)
        self._prefix_sharing.start()
        self._sweeps.start()

    async def stop(self) -> None:
        await self._tasks.cancel_all()
        for live in self.sessions.values():
            if live.self_decoder is not None:
                live.self_decoder.cancel()
        # The target may outlive this engine (a node restarted in the same process): the model
        # sessions go with the engine's, also where their closing was still queued as a task. The
        # scorer runs this before its thread ends; a scorer that died holds nothing worth closing.
        if self.scorer.alive:
            self.scorer.run(self._close_model_sessions)
        # Closing joins the scorer's thread once the work queued on it has run, which takes up to a
        # few passes: the event loop goes on serving the node's other work meanwhile.
        await asyncio.to_thread(self.scorer.close)

    def _close_model_sessions(self) -> None:
        """On the scorer thread."""
        for session in list(self.sessions):
            if self.target.has_session(session):
                self.target.close_session(session)

    def _prefix_bytes(self) -> int:
        # Read without the scorer's lock: a metric needs no exact snapshot.
        prefixes = self.target.prefixes
        return 0 if prefixes is None else prefixes.held_bytes

    def _active_sessions(self) -> int:
        return self._running.count

    @property
    def load(self) -> int:
        """Percent of one full batch that is being scored now."""
        return self._scoring.load

    def status(self) -> Status:
        return Status(
            instance=self.uri,
            role=Role.VERIFIER,
            load=self.load,
            queue=sum(1 for live in self.sessions.values() if live.machine.verifying),
            ttl_ms=self.ttl_ms,
            model=self.target.weights_digest,
            tokenizer=self.target.tokenizer_digest,
            self_us=round(1e6 * self.self_decode_time.value),
            context=self.target.context_length,
            model_name=self.settings.model,
            backend=self.target.backend,
            prefixes=self._reported_prefixes(),
            prefill_tokens=self.admissions.tokens,
            pass_us=tuple(
                PassCost(rows=rows, us=round(1000 * ms))
                for rows, ms in zip(self.pass_curves.base.rows, self.pass_curves.base.points_ms, strict=True)
            ),
            pass_sessions=self._active_sessions(),
            pass_apart=self.target.extra_rows_apart,
        )

    def _reported_prefixes(self) -> tuple[bytes, ...] | None:
        prefixes = self.target.prefixes
        if prefixes is None:
            return None
        return tuple(prefixes.reported(MAX_REPORTED_PREFIXES))

    def _time_passes(self) -> None:
        """On the scorer thread: passes of a scratch session scoring each of PASS_ROWS rows, the
        quicker of two after one that pays one-off costs; the one-row pass is the first estimate of
        the time per self-decoded token (issue 38: speculate only where the measured curve says)."""
        self.target.open_session(_PROBE_SESSION, list(range(min(_PROBE_PROMPT_TOKENS, self.target.vocab_size))))
        try:
            self.target.score([(_PROBE_SESSION, ())])
            for rows in PASS_ROWS:
                proposal = tuple(token % self.target.vocab_size for token in range(rows - 1))
                times = []
                for _ in range(2):
                    started = time.perf_counter()
                    self.target.score([(_PROBE_SESSION, proposal)])
                    times.append(time.perf_counter() - started)
                self.pass_curves.base.measured(rows, min(times))
            self.self_decode_time.value = self.pass_curves.base.ms(1) / 1000
        finally:
            self.target.close_session(_PROBE_SESSION)

    # -- what the router asks --------------------------------------------------------------------

    async def open_session(self, message: SessionOpen, requester_gone: asyncio.Event | None = None) -> SessionState:
        """POST sessions (SDCP 6.1, 6.9 resume); an open of the same epoch and contract is a replay.
        Where ``requester_gone`` is set during the prefill, the prefill stops at its next step and
        RequesterGone is raised: nobody waits for the session."""
        contract = message.contract
        try:
            # SDCP 6.1: the verifier MUST refuse a contract whose target digest does not match.
            self.target.check_digests(contract.target, contract.tokenizer)
        except DigestMismatch as exc:
            raise BadContract(str(exc)) from exc
        existing = self.sessions.get(message.session)
        self._running.recount()
        if existing is None and self._active_sessions() >= self.settings.max_sessions:
            raise Unavailable(
                f"this verifier decodes {self.settings.max_sessions} sessions, its limit", retry_after_s=_RETRY_AFTER_S
            )
        if existing is not None:
            if existing.machine.epoch >= message.epoch:
                if existing.machine.epoch == message.epoch and existing.machine.contract.digest == contract.digest:
                    return existing.machine.state()
                raise ProtocolError(
                    ProblemType.STALE_EPOCH, f"session is open here with epoch {existing.machine.epoch}"
                )
            await self._sweeps.forget(message.session)
        prompt = await self._tokens(message.prompt, "prompt")
        if not prompt:
            raise BadMessage("the prompt holds no tokens")
        self._check_vocabulary(prompt, "prompt")
        committed: tuple[int, ...] = ()
        if message.resume is not None:
            committed = await self._tokens(message.resume.committed_tokens, "resume.committed_tokens")
            self._check_vocabulary(committed, "resume.committed_tokens")
        context = self.target.context_length
        if context is not None and len(prompt) + contract.max_new > context:
            raise BadContract(
                f"prompt ({len(prompt)} tokens) plus max_new ({contract.max_new}) "
                f"exceeds the model's context of {context}"
            )
        constraint = None
        if message.constraint is not None:
            constraint = await self._constraint(message.constraint, contract.stop)
        machine = VerifierSession(
            session=message.session,
            epoch=message.epoch,
            contract=contract,
            prompt=prompt,
            resume=message.resume,
            committed_tokens=committed,
            logprobs=message.logprobs,
            min_new=message.min_new or 0,
            constraint=constraint,
        )
        try:
            commit_log = self.mlc.commit_log(message.commit_log)
            snapshot = await commit_log.read()
        except InvalidURI as exc:
            # A reference this instance cannot resolve is the request's fault, not a server error.
            raise BadMessage(f"commit_log {message.commit_log!r} cannot be resolved here: {exc}") from exc
        except CacheError as exc:
            raise Unavailable(f"the commit log cannot be read: {exc}") from exc
        newest = max((record.get("epoch", 0) for record in snapshot.records), default=0)
        if newest > message.epoch:
            raise ProtocolError(ProblemType.STALE_EPOCH, f"the commit log is fenced at epoch {newest}")
        log.info(
            "%s: session %s opening, %d tokens to prefill (request %s)",
            self.uri,
            message.session.hex(),
            len(prompt) + len(committed),
            message.request or "-",
        )
        # The scope's new history arrives while the prompt is prefilled, for the session's guesses.
        self._tasks.spawn(self.lookahead.refresh(contract, message.owner, message.tenant))
        parts: dict[str, float] = {}
        with self._running.open_under_way():
            imported = await self._prefill(
                message, prompt, committed, tenant_scope(message.tenant), requester_gone, parts
            )
            live = LiveSession(
                machine,
                commit_log,
                snapshot.etag,
                session_terms(constraint=message.constraint, min_new=message.min_new),
                owner=message.owner,
                tenant=message.tenant,
                self_decode_group_ms=message.self_decode_group_ms,
                kv_uri=target_kv_uri(message.commit_log, message.session, message.epoch),
                kv_imported=imported,
                first_token_parts=parts,
            )
            self.sessions[message.session] = live
            self._running.add(live)
        log.info(
            "%s: session %s open at epoch %d (request %s)",
            self.uri,
            message.session.hex(),
            message.epoch,
            message.request or "-",
        )
        if message.self_decode:
            self._self_decode_from_open(live)
        return machine.state()

    def _self_decode_from_open(self, live: LiveSession) -> None:
        """The router's self-decode request made with the open (extension, docs/interpretations.md,
        "Self-decoding from the open"): the period starts now, with no round trip between the
        prefill and the first pass. A load above self_load leaves the session waiting for the
        router, which reads the state the open answers and assigns as after any open."""
        try:
            self._decode_alone(live, live.machine.epoch)
        except ProtocolError as exc:
            log.info("%s: session %s not self-decoded from its open: %s", self.uri, live.machine.session.hex(), exc)

    def _decode_alone(self, live: LiveSession, epoch: int) -> None:
        """A self-decoding period at the router's request starts now, if it is permitted (raises
        its ProtocolError where not)."""
        live.machine.self_decode_instead(epoch, self.load)
        self._self_decoding.start(live)

    async def assign(self, assignment: Assignment) -> SessionState:
        """PUT sessions/{id}/drafter (SDCP 6.1): the latest assignment names the drafter."""
        live = self._driven(assignment.session)
        await self._between_rounds(live)
        previous = live.machine.drafter
        live.machine.assign(assignment)
        if assignment.drafter != previous:
            # Another drafter's proposals are accepted as often as its own are, not as the last one's.
            live.acceptance = AcceptanceEstimate()
        return live.machine.state()

    async def apply_policy(self, policy: Policy) -> SessionState:
        """POST sessions/{id}/policy (SDCP 6.6)."""
        live = self._driven(policy.session)
        live.machine.apply_policy(policy)
        return live.machine.state()

    async def self_decode(self, message: SelfDecodeRequest) -> SessionState:
        """POST sessions/{id}/self-decode (extension): a self-decoding period at the router's request."""
        live = self._driven(message.session)
        await self._between_rounds(live)
        if not live.machine.self_decoding:
            self._decode_alone(live, message.epoch)
        return live.machine.state()

    async def cancel(self, message: CancelRequest) -> SessionState:
        """POST sessions/{id}/cancel (extension): the session ends at the next round boundary with
        a record that commits nothing, its model state and leases are released, and the router
        hears of the end (a fail event). Cancelling an ended session changes nothing."""
        live = self._driven(message.session)
        if live.machine.ended:
            return live.machine.state()
        live.cancelling = True
        if live.cut_run is not None:
            live.cut_run()
        if live.self_decoder is not None:
            await asyncio.wait([live.self_decoder], timeout=_ROUTER_WAIT_S)
        await self._between_rounds(live)
        if live.machine.ended:
            return live.machine.state()
        try:
            pending = live.machine.cancel(message.epoch)
        except ValueError as exc:
            raise Unavailable(f"a round is being decided: {exc}", retry_after_s=1) from exc
        await self._rounds.commit(live, pending)
        log.info("%s: session %s cancelled", self.uri, message.session.hex())
        return live.machine.state()

    async def _between_rounds(self, live: LiveSession) -> None:
        """Let the proposal round in flight be decided first (bounded): a new drafter or a
        self-decoding period takes effect between rounds, since commit and verdict are atomic with
        respect to other changes (SDCP 6.3); the router would otherwise have to try again."""
        if live.rounds:
            await asyncio.wait(list(live.rounds.values()), timeout=_ROUTER_WAIT_S)

    # -- what drafters and readers ask -----------------------------------------------------------

    async def propose(self, proposal: Proposal, drafter: str | None) -> Verdict:
        """POST proposals: the procedure of SDCP 6.3; ``drafter`` is the authenticated sender."""
        try:
            live = self._driven(proposal.session)
            admitted = live.machine.begin_round(proposal, drafter)
            if isinstance(admitted, Replay):
                return admitted.verdict
            if isinstance(admitted, Wait):
                return await asyncio.shield(live.rounds[admitted.round])
            try:
                self._check_vocabulary(proposal.tokens, "proposal tokens")
            except BadMessage:
                live.machine.abandon(admitted)
                raise
            with self.metrics.round_seconds.time():
                return await self._rounds.verify(live, admitted)
        except ProtocolError as exc:
            if exc.problem is not None:
                self.metrics.problem(exc.problem)
            raise

    async def output(self, session: bytes, start: int) -> Output:
        """GET sessions/{id}/output?from=n (SDCP 6.7), waiting up to ``output_wait_s`` for tokens.

        Past its first tokens (``start`` > 0) a read's answer gathers the tokens released within
        ``output_linger_ms`` of the first new one, up to OUTPUT_LINGER_TOKENS, rather than one
        read per round (_due, docs/performance.md)."""
        (read,) = await self._reads([(self._live(session), start)])
        if isinstance(read, ProtocolError):
            raise read
        return read

    async def outputs(self, reads: Sequence[tuple[bytes, int]]) -> list[tuple[bytes, Output | ProtocolError]]:
        """POST outputs (extension, docs/interpretations.md): several sessions' output reads in one,
        each as ``output`` reads it, answered when one has news (lingering as ``output`` does); the
        reads with tokens, a final output or an error, in the order asked, by session. A session
        not held here raises SessionNotFound, as ``output`` does."""
        answers = await self._reads([(self._live(session), start) for session, start in reads])
        return [(session, read) for (session, _), read in zip(reads, answers, strict=True) if _has_news(read)]

    async def _reads(self, reads: Sequence[tuple[LiveSession, int]]) -> list[Output | ProtocolError]:
        """Each session's output from its start, once any has news that is due (_due).

        The reads count towards ``max_long_polls`` one each while they wait; a request is refused
        only where the reads already waiting reach it, so that the waiting reads stay below it plus
        one request's."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.output_wait_s
        woken: asyncio.Event | None = None
        try:
            while True:
                news = [(live, start) for live, start in reads if live.machine.has_output(start)]
                answer_at = min(deadline, self._due(news)) if news else deadline
                remaining = answer_at - loop.time()
                # A session forgotten meanwhile (idle, reopened at a later epoch) has no more
                # output here: its reader learns so (404) at its next read, not at its timeout.
                if remaining <= 0 or any(live.forgotten for live, _ in reads):
                    return [_read(live, start) for live, start in reads]
                if woken is None:
                    if self._long_polls >= self.settings.max_long_polls:
                        if news:
                            # Only the linger would wait: the tokens are answered now, not refused.
                            return [_read(live, start) for live, start in reads]
                        raise Unavailable(f"{self._long_polls} output reads are waiting already", retry_after_s=1)
                    self._long_polls += len(reads)
                    woken = asyncio.Event()
                    for live, _ in reads:
                        live.watchers.add(woken)
                woken.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), remaining)
        finally:
            if woken is not None:
                for live, _ in reads:
                    live.watchers.discard(woken)
                self._long_polls -= len(reads)

    def _due(self, news: Sequence[tuple[LiveSession, int]]) -> float:
        """When reads with ``news`` are answered (the event loop's clock, time.monotonic): at once
        for a first token, an end or an error; a read past its first tokens gathers the tokens
        released within ``output_linger_ms`` of its first new one, up to OUTPUT_LINGER_TOKENS,
        whether it waited for that token or came after it, so that a reader that keeps pace with
        the rounds makes one request per few tokens, not one per round or two (docs/performance.md)."""
        linger_s = self.settings.output_linger_ms / 1000
        due = math.inf
        for live, start in news:
            machine = live.machine
            if (
                linger_s <= 0
                or start == 0
                or machine.fenced
                or machine.ended
                or machine.committed - start >= OUTPUT_LINGER_TOKENS
            ):
                return -math.inf
            due = min(due, live.released_at(start) + linger_s)
        return due

    def parties(self, session: bytes) -> tuple[str | None, str | None]:
        """Who the session gives rights to here: the front end that opened it, its assigned drafter."""
        live = self._live(session)
        return live.owner, live.machine.drafter

    def state(self, session: bytes) -> SessionState:
        """Where the session stands: its round, committed length and digest, serving state."""
        return self._live(session).machine.state()

    def stats(self, session: bytes) -> dict[str, object]:
        """GET sessions/{id}/stats (not in Table 1): what the session's rounds did so far."""
        return session_stats(self._live(session))

    def trace(self, session: bytes, last: int = TRACE_ROUNDS) -> list[dict[str, object]]:
        """The session's ``last`` rounds, oldest first (GET sessions/{id}/trace): who drafted, M,
        accepted, the verdict, and where the time went, in microseconds."""
        return session_trace(self._live(session), last)

    # -- helpers ---------------------------------------------------------------------------------

    def _live(self, session: bytes) -> LiveSession:
        live = self.sessions.get(session)
        if live is None:
            raise SessionNotFound("no such session at this verifier")
        return live

    def _driven(self, session: bytes) -> LiveSession:
        """The session a message concerns, marked as driven now (it is not idle)."""
        live = self._live(session)
        live.driven()
        return live

    def _check_vocabulary(self, tokens: Sequence[int], what: str) -> None:
        vocab = self.target.vocab_size
        outside = next((token for token in tokens if token >= vocab), None)
        if outside is not None:
            raise BadMessage(f"{what}: token id {outside} is outside the target's vocabulary of {vocab}")

    async def _tokens(self, value: tuple[int, ...] | str, what: str) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return decode_token_list(await self.mlc.get(value), what)
        except (InvalidURI, ObjectNotFound) as exc:
            # A reference this instance cannot resolve is the request's fault (SDCP 5.2 cache-ref).
            raise BadMessage(f"{what} {value!r} cannot be resolved here: {exc}") from exc
        except CacheError as exc:
            raise Unavailable(f"{what} {value!r} cannot be read from the MLC now: {exc}") from exc

    async def _prefill(
        self,
        message: SessionOpen,
        prompt: tuple[int, ...],
        committed: tuple[int, ...],
        scope: bytes,
        requester_gone: asyncio.Event | None,
        parts: dict[str, float],
    ) -> int:
        """Open the session in the target at its committed tokens: from the resume's target KV
        where it is usable (SDCP 6.9), else by a prefill from the longest prefix the prefix cache
        holds of the tenant's (``scope``), locally or in the MLC. Returns how many tokens the
        resume's KV covered; ``parts`` gets the prefill's parts of the first token's latency."""
        tokens = prompt + committed
        resume = message.resume
        if resume is not None and resume.target_kv is not None:
            try:
                blob = await self.mlc.get(resume.target_kv)
                return await self._model_sync.resume_from_kv(message.session, blob, tokens)
            except Exception as exc:  # noqa: BLE001 - the prefill below always applies
                # The KV only saves a prefill ("if available", SDCP 6.9), and the blob is whatever
                # the MLC holds: gone, corrupt, of another model, build or layout, over other tokens.
                # Any failure to use it costs the prefill, never the open.
                log.warning("%s: target KV %s unusable, prefilling: %r", self.uri, resume.target_kv, exc)
        queued = time.perf_counter()
        with self.admissions.prefilling(len(tokens)):
            # One prefill at a time, in arrival order, its steps between other sessions' passes: a
            # queue of long prompts waits its turn, and running streams keep decoding meanwhile
            # (while the prompts are short, the running self-decoding sessions wait: Admissions).
            # Short prompts waiting when one's turn comes are prefilled with it (ShortPrefills).
            if self.admissions.short(len(tokens)):
                opening = Opening(message.session, tokens, scope)
                turn = await self._short_prefills.prefill(opening, requester_gone)
            else:
                async with self._prefill_turn:
                    turn = time.perf_counter()
                    await self._prefix_sharing.fetch(tokens[:-1], scope)
                    await self._prefill_in_steps(message.session, tokens, scope, requester_gone)
            parts["prefill_wait"] = turn - queued
            parts["prefill"] = time.perf_counter() - turn
            for part, seconds in parts.items():
                observe_part(self.uri, part, seconds)
        return 0

    async def _prefill_group(self, openings: Sequence[Opening]) -> list[ModelError | None]:
        """Short prompts prefilled together (ShortPrefills), in one call on the model's thread. No
        verifier shares a prefix this short through the MLC (SHARE_TOKENS): nothing to fetch."""
        with self._prefix_lookups_counted():
            failures = await self.scorer.run_async(self.target.open_sessions, openings)
        if len(openings) > 1:
            tokens = sum(len(opening.tokens) for opening in openings)
            log.info("%s: %d short prompts prefilled together (%d tokens)", self.uri, len(openings), tokens)
        return failures

    def _prefill_cost(self, opening: Opening) -> int:
        """The tokens a prefill of ``opening`` computes: its prompt past the prefix the prefix cache
        holds of it now (the prefill restores all but the last token's KV; ShortPrefills groups by
        this, and the cache may change before the group runs)."""
        prefixes = self.target.prefixes
        held = 0 if prefixes is None else prefixes.covered(opening.tokens[:-1], opening.prefix_scope)
        return len(opening.tokens) - held

    def _forget(self, session: bytes) -> None:
        """Close a session opened in the target for an opener that went away."""
        with contextlib.suppress(ModelThreadClosed):
            self.scorer.run(self.target.close_session, session)

    async def _prefill_in_steps(
        self, session: bytes, tokens: tuple[int, ...], scope: bytes, requester_gone: asyncio.Event | None
    ) -> None:
        steps = self.target.open_session_steps(session, tokens, prefix_scope=scope)
        with self._prefix_lookups_counted():
            try:
                while await self.scorer.run_async(next, steps, None) is not None:
                    if requester_gone is not None and requester_gone.is_set():
                        log.info("%s: session %s: prefill stopped, its opener went away", self.uri, session.hex())
                        raise RequesterGone(f"session {session.hex()}: its opener went away during the prefill")
            except BaseException:
                # After the step in flight, if any: the session the steps added is forgotten.
                with contextlib.suppress(ModelThreadClosed):
                    self.scorer.run(steps.close)
                raise

    @contextlib.contextmanager
    def _prefix_lookups_counted(self) -> Iterator[None]:
        """Counts the prefix cache's lookups and hits of the prefill in the block, once it completes."""
        prefixes = self.target.prefixes
        if prefixes is None:
            yield
            return
        queries, hits = prefixes.queries, prefixes.hits
        yield
        self.metrics.prefix_lookups(prefixes.queries - queries, prefixes.hits - hits)

    async def _constraint(self, constraint: Constraint, stop: Sequence[int]) -> GrammarConstraint:
        """The session's constraint over the target's tokenizer; one this verifier cannot apply
        makes the session unsupported: its target distribution would not be the one asked for."""
        vocab = self.target.vocab_size

        def compiled() -> GrammarConstraint:
            # Off the event loop: a tokenizer's first use takes about half a second, a grammar up to one.
            return GrammarConstraint(
                grammar_tokenizer(self.target.tokenizer_definition, vocab), constraint, stop, vocab
            )

        try:
            return await asyncio.to_thread(compiled)
        except ConstraintError as exc:
            raise BadContract(f"constraint: {exc}") from exc

    def _start_self_decoding(self, live: LiveSession) -> None:
        # Rounds start self-decoding periods, whose rounds they commit: each refers to the other.
        self._self_decoding.start(live)
