"""The drafter engine (SDCP 6.2, 6.3 after the verdict, 6.9), free of any transport: the facade the
drafter service and the in-process bench call. ``sdcp.protocol.drafter.DrafterSession`` keeps each
session's rounds, the drafter backend (``sdcp.models.drafter``) proposes tokens in one worker thread,
the MLC holds the draft rows under a lease until the verdict, a ``VerifierLink`` carries proposals
and output reads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from sdcp.cache import MLC, InvalidURI
from sdcp.config import DrafterConfig
from sdcp.engines.drafter.catchup import PrefixCatchUp
from sdcp.engines.drafter.guided import session_grammar
from sdcp.engines.drafter.observe import Acceptance, DrafterMetrics, RoundTrip
from sdcp.engines.drafter.rounds import Rounds
from sdcp.engines.drafter.runs import SessionRun
from sdcp.engines.history import HistoryReader, directory_uri, history_scope_key, index_uri, warm
from sdcp.engines.ports import VerifierLink
from sdcp.engines.tasks import BackgroundTasks
from sdcp.models.drafter import Drafter
from sdcp.models.errors import UnknownSession
from sdcp.models.lookup.suffix import SharesHistory
from sdcp.models.worker import InlineModelThread, ModelThread
from sdcp.protocol.digest import prefix_digest
from sdcp.protocol.drafter import CONSTRAINED, PLAIN, AcceptanceEstimate, DrafterSession
from sdcp.protocol.messages import Assignment, HistoryStatus, Role, Status
from sdcp.protocol.problems import BadContract, BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import decode_token_list
from sdcp.protocol.rules import get_rule
from sdcp.threads import CoreGovernor

__all__ = ["DrafterEngine"]

log = logging.getLogger("sdcp.drafter")

# The longest an assignment waits for its history scope's new entries before drafting without them.
_HISTORY_READ_S = 2.0


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
        self._tasks = BackgroundTasks(uri, log)
        self.runs: dict[bytes, SessionRun] = {}
        self.worker: ModelThread | InlineModelThread = (
            InlineModelThread() if drafter.runs_inline else ModelThread(f"drafter-{drafter.name}", cores=cores)
        )
        self._round_trip = RoundTrip()
        # ``on_measured``: a router may be waiting for this instance's first acceptance measurement.
        self.acceptance = Acceptance(on_measured)
        self._assigning = asyncio.Lock()
        # A drafter that drafts from earlier sessions reads finished sessions' output from the MLC.
        self._history: HistoryReader | None = None
        self._shares: SharesHistory | None = None
        if isinstance(drafter, SharesHistory):
            self._shares = drafter
            self._history = HistoryReader(mlc, entries=settings.history_entries, refresh_s=settings.history_refresh_s)
        self.metrics = DrafterMetrics(
            uri, seconds_per_token=lambda: drafter.seconds_per_token, acceptance=self.acceptance, history=self._shares
        )
        self._catchup = PrefixCatchUp(uri=uri, mlc=mlc, link=link)
        self._rounds = Rounds(
            uri=uri,
            settings=settings,
            drafter=drafter,
            worker=self.worker,
            mlc=mlc,
            link=link,
            catchup=self._catchup,
            round_trip=self._round_trip,
            acceptance=self.acceptance,
            metrics=self.metrics,
            status=self.status,
        )

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
            alpha_milli=self.acceptance.alpha_milli(PLAIN),
            alpha_constrained_milli=self.acceptance.alpha_milli(CONSTRAINED),
            draft_us=round(1e6 * self.drafter.seconds_per_token),
            verify_us=round(1e6 * self._round_trip.seconds) if self._round_trip.measured else None,
            history=self._history_status(),
        )

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
            self.metrics.history_learned()

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
            run = SessionRun(assignment, DrafterSession(assignment, estimate))
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

    async def _stop_run(self, run: SessionRun) -> None:
        if run.task is not None and not run.task.done():
            run.task.cancel()
            await asyncio.wait([run.task])

    async def _serve(self, run: SessionRun) -> None:
        try:
            await self._prepare(run)
            await self._rounds.propose_until_stopped(run)
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

    async def _prepare(self, run: SessionRun) -> None:
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
            await self._catchup.adopt_committed_object(run, assignment.committed_tokens)
        await self._catchup.catch_up(run, assignment.committed, assignment.digest)
        await self.worker.run_async(self.drafter.sync, run.session, run.committed_prefix)
        if assignment.constraint is not None:
            run.grammar = await asyncio.to_thread(
                session_grammar, assignment, self.settings.target, self.drafter.vocab_size, self.uri
            )

    async def _bind_history(self, run: SessionRun, drafter: SharesHistory) -> None:
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
            self.metrics.history_learned()

        try:
            async with asyncio.timeout(_HISTORY_READ_S):
                await reader.refresh(index, learn)
        except Exception as exc:  # noqa: BLE001 - the history only makes drafts longer
            log.warning("%s: history %s not read: %r", self.uri, index, exc)
