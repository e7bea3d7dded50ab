"""Rounds: a proposal verified (SDCP 6.3), and the commit of every round, whoever decided it.

A proposal round: score (and fetch q rows concurrently) -> decide -> commit. A commit: queue the
model sync -> append the commit record -> release the tokens and the verdict -> send the event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from sdcp.cache import MLC, Fenced, PreconditionFailed
from sdcp.engines.errors import Unavailable
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.events import RouterEvents, SessionSweeps
from sdcp.engines.verifier.kvpublish import KVPublisher
from sdcp.engines.verifier.kvsync import ModelSync
from sdcp.engines.verifier.live import LiveSession, RunningSessions
from sdcp.engines.verifier.observe import (
    PassCurves,
    RoundTrace,
    VerifierMetrics,
)
from sdcp.latency import observe_part
from sdcp.models.backend import Target
from sdcp.models.batching import BatchingScorer, GreedyPicker, PassInfo, ScoredRun
from sdcp.protocol.messages import Action, Event, Verdict
from sdcp.protocol.passcost import PassCurve, speculation_length
from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.protocol.records import bind_record
from sdcp.protocol.rules import parse_q_rows
from sdcp.protocol.verifier import PendingCommit, RoundTicket

__all__ = ["PartlyAppended", "Rounds", "Scoring"]

log = logging.getLogger("sdcp.verifier")


class PartlyAppended(Unavailable):
    """The commit records of the first ``appended`` rounds of an append are in the log, the others
    are not: ``cause`` says why."""

    def __init__(self, appended: int, cause: Exception) -> None:
        super().__init__(f"{appended} commit records appended, then: {cause}")
        self.appended = appended
        self.cause = cause


def _landed(log_records: list[dict[str, Any]], records: list[dict[str, Any]]) -> int:
    """How many of ``records`` (appended in order) end the log."""
    for count in range(len(records), 0, -1):
        if log_records[-count:] == records[:count]:
            return count
    return 0


class Scoring:
    """Scoring requests on their way through the batching scorer: how loaded the verifier is, and
    what each pass cost (the session's round timings, the verifier's pass costs)."""

    def __init__(self, scorer: BatchingScorer, pass_curves: PassCurves) -> None:
        self._scorer = scorer
        self._pass_curves = pass_curves
        self._last_recorded: PassInfo | None = None
        self.waiting = 0

    @property
    def max_batch(self) -> int:
        """The most sessions a pass holds."""
        return self._scorer.max_batch

    @property
    def rows_apart(self) -> bool:
        """Whether a shared pass runs a session's rows after its first apart (Target.extra_rows_apart)."""
        return self._scorer.target.extra_rows_apart

    @property
    def keeps_prefill_row(self) -> bool:
        """Whether a session's first request after its prefill needs no pass (Target.keeps_prefill_row)."""
        return self._scorer.target.keeps_prefill_row

    @property
    def load(self) -> int:
        """Percent of one full batch that is being scored now."""
        return min(100, round(100 * self.waiting / self._scorer.max_batch))

    def submit(self, live: LiveSession, tokens: tuple[int, ...]) -> asyncio.Future[np.ndarray]:
        """Queue a scoring request now (the scorer may be gathering a pass); its rows come with the
        future, and the pass's time is counted when they do."""
        rows = self._scorer.score_async(live.machine.session, tokens, reach=_reach(live, tokens))
        live.prefill_row_kept = False
        self.waiting += 1

        def scored(done: asyncio.Future[np.ndarray]) -> None:
            # One callback for both: each callback is a turn of the event loop, a pass or step each.
            try:
                self._scored(live, done)
            finally:
                self._settled()

        rows.add_done_callback(scored)
        return rows

    def curve(self, live: LiveSession, tokens: tuple[int, ...]) -> PassCurve:
        """The pass costs for a request of ``tokens`` of the session (by the context it attends)."""
        return self._pass_curves.curve(_reach(live, tokens))

    def submit_ahead(
        self, live: LiveSession, tokens: tuple[int, ...], steps: int, picker: GreedyPicker, deliver_every: int
    ) -> ScoredRun:
        """`submit`, and the greedy run of up to ``steps`` passes after it (BatchingScorer.score_ahead_async),
        which counts as waiting until its last step is settled; ``picker`` takes the run's tokens, and
        its steps' rows come ``deliver_every`` at a time."""
        machine = live.machine
        run = self._scorer.score_ahead_async(
            machine.session,
            tokens,
            steps,
            frozenset(machine.contract.stop),
            picker,
            reach=_reach(live, tokens),
            deliver_every=deliver_every,
        )
        live.prefill_row_kept = False
        self.waiting += 1
        futures: tuple[asyncio.Future[np.ndarray] | asyncio.Future[np.ndarray | None], ...] = (run.rows, *run.steps)
        unsettled = [len(futures)]

        def scored(done: asyncio.Future[np.ndarray] | asyncio.Future[np.ndarray | None]) -> None:
            try:
                self._scored(live, done)
            finally:
                unsettled[0] -= 1
                if not unsettled[0]:
                    self._settled()

        for future in futures:
            future.add_done_callback(scored)
        return run

    def _settled(self) -> None:
        self.waiting -= 1

    def _scored(self, live: LiveSession, done: asyncio.Future[np.ndarray] | asyncio.Future[np.ndarray | None]) -> None:
        """Count the pass's time where it ran (a step a run did not reach has none)."""
        scored = self._scorer.passes.pop(done, None)
        if done.cancelled() or done.exception() is not None or done.result() is None:
            return
        if scored is not None:
            live.timings.model_s += scored.seconds
            live.timings.batch_size = scored.batch_size
            if scored is not self._last_recorded:
                # Once per pass, whichever of its sessions hears of it first.
                self._last_recorded = scored
                self._pass_curves.record(scored.seconds, scored.rows, scored.reach)


def _reach(live: LiveSession, tokens: tuple[int, ...]) -> int:
    """The positions the last row of a request of ``tokens`` attends: the session's committed
    context and the tokens (tokens decided and not yet committed make it longer by a round or so)."""
    machine = live.machine
    return len(machine.prompt) + machine.committed + len(tokens)


# Signs a commit record, adding the certificate when asked (sdcp.transport.signing.RecordSigner.sign).
RecordSign = Callable[[dict[str, Any], bool], dict[str, Any]]


class Rounds:
    """Verifies proposals and commits rounds; a verdict that starts a self-decoding period calls
    ``start_self_decoding`` with its session."""

    def __init__(
        self,
        *,
        uri: str,
        target: Target,
        mlc: MLC,
        scoring: Scoring,
        model_sync: ModelSync,
        kv_publisher: KVPublisher,
        events: RouterEvents,
        sweeps: SessionSweeps,
        tasks: BackgroundTasks,
        start_self_decoding: Callable[[LiveSession], None],
        running: RunningSessions,
        metrics: VerifierMetrics,
        sign: RecordSign | None = None,
    ) -> None:
        self._uri = uri
        self._metrics = metrics
        self._sign = sign
        self._target = target
        self._mlc = mlc
        self._scoring = scoring
        self._model_sync = model_sync
        self._kv_publisher = kv_publisher
        self._events = events
        self._sweeps = sweeps
        self._tasks = tasks
        self._start_self_decoding = start_self_decoding
        self._running = running

    async def verify(self, live: LiveSession, ticket: RoundTicket) -> Verdict:
        """The admitted proposal round ``ticket``: scored, decided, committed."""
        proposal = ticket.proposal
        assert proposal is not None  # begin_round admits proposal rounds only
        done: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        live.rounds[ticket.round] = done
        fetch: asyncio.Task[bytes] | None = None
        timing = live.timing = RoundTrace()
        try:
            q_rows = None
            if live.machine.rule.needs_q and proposal.q_rows is not None:
                # SDCP 6.3: the rows may be fetched concurrently with scoring.
                fetch = asyncio.create_task(self._timed_get(proposal.q_rows, timing))
            logits = await self._scoring.submit(live, proposal.tokens)
            timing.scored_at = time.perf_counter()
            if fetch is not None:
                try:
                    data = await fetch
                except Exception as exc:  # a missing object, a lost MLC node or Redis: all unavailable
                    # SDCP 6.3: without every row, the round is rejected and nothing is committed.
                    raise ProtocolError(ProblemType.Q_UNAVAILABLE, f"draft rows unavailable: {exc}") from exc
                q_rows = parse_q_rows(data, len(proposal.tokens), self._target.vocab_size)
            # SDCP 6.5.1: the next proposal is no longer than the pass costs make worth scoring,
            # at the acceptance the session's proposals have had and the sessions sharing passes.
            worth = speculation_length(
                live.acceptance.alpha,
                self._running.count,
                live.machine.contract.m_max,
                self._scoring.curve(live, proposal.tokens),
                apart=self._scoring.rows_apart,
            )
            pending = live.machine.decide(ticket, logits, q_rows, self._scoring.load, worth=worth)
            live.acceptance.update(pending.verdict.accepted, len(proposal.tokens))
            verdict = await self.commit(live, pending)
            done.set_result(verdict)
            return verdict
        except BaseException as exc:
            if fetch is not None:
                fetch.cancel()
            live.machine.abandon(ticket)
            if not done.done():
                done.set_exception(exc if isinstance(exc, Exception) else Unavailable("the round was cancelled"))
                done.exception()  # retrieved here; waiters re-raise it
            await self._model_sync.drop_scored(live.machine)
            raise
        finally:
            if live.rounds.get(ticket.round) is done:
                del live.rounds[ticket.round]

    async def _timed_get(self, uri: str, timing: RoundTrace) -> bytes:
        started = time.perf_counter()
        try:
            return await self._mlc.get(uri)
        finally:
            timing.fetch_s = time.perf_counter() - started

    async def commit(self, live: LiveSession, pending: PendingCommit) -> Verdict:
        """SDCP 6.3 Commit: the record is appended first; only then tokens and verdict are released.

        The release follows the append with no await between them, so that no cancellation can
        leave a durable record unreleased (the commit and the verdict are atomic).
        """
        machine = live.machine
        self._model_sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)
        try:
            await self.append(live, pending)
        except BaseException:
            self._model_sync.realign_after_failure(machine)
            raise
        verdict = self.release(live, pending)
        self.after_commit(live, [pending])
        if verdict.action == Action.SELF_DECODE and machine.self_decoding:
            self._start_self_decoding(live)
        return verdict

    async def append(self, live: LiveSession, pending: PendingCommit) -> None:
        """Append the round's commit record; raises, and releases nothing, if it is not there."""
        try:
            await self.append_all(live, [pending])
        except PartlyAppended as exc:
            raise Unavailable(f"the commit record was not appended: {exc.cause}") from exc.cause

    async def append_all(self, live: LiveSession, pending: list[PendingCommit]) -> None:
        """Append the commit records of consecutive rounds of the session, in one step where the
        log can (CommitLog.append_all). Raises PartlyAppended where some of them are not there
        (those before ``appended`` are: the caller releases them), or the fencing's problem."""
        machine = live.machine
        # The writer's identity goes with the record: an MLC node admits commit records only from
        # the verifier they name (docs/security.md). The session and its terms go with it too, so
        # that, signed, it is valid in one place of one log (a router's replay checks both).
        records = self._signed(
            live,
            [bind_record(one.record, writer=self._uri, session=machine.session, terms=live.terms) for one in pending],
        )
        started = time.perf_counter()
        try:
            live.etag = await live.log.append_all(records, live.etag)
            self._appended(live, started)
            return
        except Fenced as exc:
            self._fenced(live, exc)
        except PreconditionFailed as exc:
            # The log changed since this verifier's last record: another writer (a new epoch), or
            # an earlier try of these very records whose answer was lost (a Redis restart).
            self._metrics.append_conflict()
            failure: Exception = exc
        except Exception as exc:  # noqa: BLE001 - a lost MLC node or Redis: the log tells what happened
            failure = exc
        # The appends may have landed before the failure was reported: the log says which.
        try:
            snapshot = await live.log.read()
        except Exception as exc:
            raise PartlyAppended(0, Unavailable(f"the commit log cannot be read after a failed append: {exc}")) from exc
        landed = _landed(snapshot.records, records)
        if landed < len(records) and (
            isinstance(failure, PreconditionFailed) or any(r.get("epoch", 0) > machine.epoch for r in snapshot.records)
        ):
            self._fenced(live, failure)
        live.etag = snapshot.etag
        if landed:
            self._appended(live, started)
        if landed < len(records):
            raise PartlyAppended(landed, failure) from failure

    def _signed(self, live: LiveSession, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self._sign is None:
            return records
        # SDCP 1.3: only the verifier commits; its signature lets a router tell its records from
        # anything else written to the store (docs/security.md, signed commit records). A retried
        # round sends the very record it signed before (ECDSA signatures differ each time), so that
        # one whose answer was lost is found in the log as its own: the records of the last append
        # are kept for that.
        kept = live.signed
        live.signed = []
        for record in records:
            signed = next((signed for unsigned, signed in kept if unsigned == record), None)
            if signed is None:
                signed = self._sign(record, not live.cert_logged)
            live.signed.append((record, signed))
        return [signed for _, signed in live.signed]

    def _appended(self, live: LiveSession, started: float) -> None:
        live.cert_logged = True
        live.append_s = time.perf_counter() - started
        self._metrics.appended(live.append_s)

    def _fenced(self, live: LiveSession, cause: Exception) -> NoReturn:
        # SDCP 6.3: a fenced append discards the round, releases nothing, stops serving.
        machine = live.machine
        machine.stop_serving()
        self._metrics.fenced()
        live.wake_readers()
        self._tasks.spawn(self._model_sync.close(machine.session))
        self._tasks.spawn(self._sweeps.forget_later(live))
        log.warning("%s: session %s fenced: %s", self._uri, machine.session.hex(), cause)
        # The router learns that the session stopped here: a fence of its own (a failover) has
        # moved the session to a later epoch already and the event is stale; a record someone else
        # appended (a second verifier, a writer with access to the store) would otherwise leave the
        # session stalled while this verifier, live, keeps its status (docs/reliability.md).
        state = machine.state()
        event = Event(
            session=machine.session,
            epoch=machine.epoch,
            kind=Action.SWITCH,
            committed=state.committed,
            digest=state.digest,
            fenced=True,
        )
        self._tasks.spawn(self._events.send(event))
        raise ProtocolError(ProblemType.STALE_EPOCH, f"the commit log was fenced: {cause}") from cause

    def release(self, live: LiveSession, pending: PendingCommit) -> Verdict:
        """The record is durable: the round's tokens become output."""
        if pending.record.emitted and "first_round" not in live.first_token_parts:
            live.first_token_parts["first_round"] = time.perf_counter() - live.opened_at
            observe_part(self._uri, "first_round", live.first_token_parts["first_round"])
        verdict = live.machine.apply(pending)
        live.driven()
        live.timings.committed()
        self._metrics.committed_round(live, pending)
        live.released()
        live.wake_readers()
        return verdict

    def after_commit(self, live: LiveSession, released: list[PendingCommit]) -> None:
        """Events go out once the model holds the committed tokens, since they let the router send
        the next proposal; the session's KV is published if due; an ended session's model state and
        published KV are dropped."""
        for pending in released:
            if pending.event is not None:
                self._tasks.spawn(self._events.send(pending.event))
        if live.machine.ended:
            self._running.recount()
            self._kv_publisher.retire(live)
            self._tasks.spawn(self._model_sync.close(live.machine.session))
            self._tasks.spawn(self._sweeps.forget_later(live))
        elif released:
            self._kv_publisher.committed(live)
