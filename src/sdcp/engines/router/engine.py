"""The router engine (SDCP 6.1, 6.5.2 events, 6.6, 6.9), free of any transport.

``sdcp.protocol.router`` decides (registry with TTLs, selection, assignment and failover plans);
this engine keeps the sessions, runs the periodic task and tells verifiers and drafters through a
``RouterLink``. The router service (``sdcp.services.router``) translates HTTP/2 + mTLS requests to
its calls; ``sdcp bench``'s in-process system drives it over memory.

Every change to one session (assignment, switch, failover, policy) runs under that session's lock,
so the verifier and the drafter always hear of them in the order the router made them.

Each session's durable facts live in the shared tier (``store``): a router that does not hold a
session (restarted, or another router whose peer could not reach the one that held it) loads it on
first contact and can fail it over. A router claims a session before each change by a conditional
write of its facts; one that finds that another router changed them since lets the session go
(docs/reliability.md, "Routers").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

from sdcp.cache import MLC, CacheError, StoreUnavailable, build_uri
from sdcp.cache.uri import LOG_KIND
from sdcp.config import RouterConfig
from sdcp.engines.errors import OverQuota, RequesterGone, SessionNotFound, Unanswered, Unavailable
from sdcp.engines.ports import RouterLink
from sdcp.engines.router.assign import Assignments
from sdcp.engines.router.failover import Failover
from sdcp.engines.router.logs import SessionLogs
from sdcp.engines.router.observe import RouterMetrics, expected_rates, target_splits, targets
from sdcp.engines.router.placement import Placement
from sdcp.engines.router.sessions import TrackedSession
from sdcp.engines.router.store import SessionStore, Superseded
from sdcp.engines.tasks import BackgroundTasks, cancelled_if, shielded_unless_gone
from sdcp.protocol.messages import (
    Action,
    CancelRequest,
    Event,
    Policy,
    Role,
    SessionRequest,
    SessionState,
    Status,
)
from sdcp.protocol.problems import BadContract, ProblemType, ProtocolError
from sdcp.protocol.records import RecordAuthority
from sdcp.protocol.router import (
    InstanceRegistry,
    RouterSession,
)

__all__ = ["RouterEngine"]

log = logging.getLogger("sdcp.router")
# When a refused session request may be tried again (sessions end at their own pace).
_RETRY_AFTER_S = 5
# A cancel of a session-open that timed out is tried this often, this far apart.
_ABANDONED_CANCEL_TRIES, _ABANDONED_CANCEL_WAIT_S = 5, 1.0


class RouterEngine:
    """Assigns sessions to verifiers and drafters, and moves them when instances fail.

    ``settings`` gives the router's settings as they are at each look (they may be replaced while
    the engine runs); ``clock`` is what status TTLs and decision ages are measured with (tests jump
    it forward); ``interval_s`` is how often the periodic task looks at every session;
    ``record_check`` checks commit records before a failover replays them (None: unsigned logs);
    ``grace_s`` is how long after its start the router waits for the status report of an instance
    it has not heard of before it takes it for failed (instances report every third of their TTL).
    """

    def __init__(
        self,
        *,
        uri: str,
        settings: Callable[[], RouterConfig],
        mlc: MLC,
        link: RouterLink,
        record_check: RecordAuthority | None,
        interval_s: float,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.uri = uri
        self._settings = settings
        self.mlc = mlc
        self.link = link
        self.record_check = record_check
        self.interval_s = interval_s
        self.grace_s = grace_s
        self.clock = clock
        self.registry = InstanceRegistry()
        # How many target digests the live verifiers of each model advertised at the last report.
        self._digest_counts: dict[str, int] = {}
        self.sessions: dict[bytes, TrackedSession] = {}
        # Sessions whose verifier decodes them from their open on (Assignments.alone_from_open)
        # while this router has yet to hold them: their events wait for the open to finish.
        self._opening: dict[bytes, asyncio.Future[None]] = {}
        self.store = SessionStore(mlc, uri)
        self._started_at = clock()
        # Sessions a pass of the periodic task is changing now.
        self._changing: set[bytes] = set()
        self._wake = asyncio.Event()
        self._tasks = BackgroundTasks(uri, log)
        self.metrics = RouterMetrics(uri)
        self.placement = Placement(registry=self.registry, clock=clock, settings=settings)
        logs = SessionLogs(uri=uri, mlc=mlc, record_check=record_check, metrics=self.metrics)
        self._logs = logs
        self.assignments = Assignments(
            uri=uri,
            registry=self.registry,
            sessions=self.sessions,
            clock=clock,
            settings=settings,
            link=link,
            logs=logs,
            metrics=self.metrics,
        )
        self.failover = Failover(
            uri=uri,
            registry=self.registry,
            clock=clock,
            mlc=mlc,
            store=self.store,
            link=link,
            logs=logs,
            placement=self.placement,
            assignments=self.assignments,
            tasks=self._tasks,
            metrics=self.metrics,
        )

    @property
    def settings(self) -> RouterConfig:
        return self._settings()

    async def start(self) -> None:
        self.metrics.start()
        self._started_at = self.clock()
        self._tasks.spawn(self._maintain_forever())

    async def stop(self) -> None:
        await self._tasks.cancel_all()

    # -- instances -------------------------------------------------------------------------------

    def report(self, status: Status) -> None:
        """An instance's status report (SDCP 6.1), its sender already checked by the caller."""
        now = self.clock()
        if not self.registry.is_live(status.instance, now):
            # A new or returning instance may unblock sessions waiting for one.
            self._wake.set()
        # An instance cannot claim to stay live longer than the router allows.
        capped = replace(status, ttl_ms=min(status.ttl_ms, self.settings.max_ttl_ms))
        self.registry.report(capped, now, model=status.model)
        if status.role == Role.VERIFIER and status.model_name is not None:
            self._check_target_digests(status.model_name)
        if status.role == Role.DRAFTER:
            self.metrics.drafter_reported(status.instance)
        self.metrics.expected_rates(self.expected_rates())

    def target_splits(self) -> dict[str, dict[str, list[str]]]:
        """The models whose live verifiers advertise more than one target digest (``observe``)."""
        return target_splits(self.registry.live(Role.VERIFIER, self.clock()))

    def _check_target_digests(self, model_name: str) -> None:
        digests = {
            view.status.model
            for view in self.registry.live(Role.VERIFIER, self.clock())
            if view.status.model_name == model_name and view.status.model is not None
        }
        previous = self._digest_counts.get(model_name, 1)
        self._digest_counts[model_name] = len(digests)
        self.metrics.target_digests(model_name, len(digests))
        if len(digests) > 1 and len(digests) != previous:
            split = self.target_splits().get(model_name, {})
            log.warning(
                "%s: the live verifiers of %s advertise %d target digests and cannot take over each other's "
                "sessions: %s; pin `backend` in every verifier of the model (docs/deploy.md)",
                self.uri,
                model_name,
                len(digests),
                "; ".join(f"{digest[:16]}: {', '.join(where)}" for digest, where in split.items()),
            )

    def live_counts(self) -> tuple[int, int]:
        """How many verifiers and drafters are registered (their reports have not expired)."""
        now = self.clock()
        return len(self.registry.live(Role.VERIFIER, now)), len(self.registry.live(Role.DRAFTER, now))

    def targets(self) -> list[dict[str, object]]:
        """The live verifiers and the digests a contract must name to use them."""
        return targets(self.registry.live(Role.VERIFIER, self.clock()))

    def expected_rates(self) -> dict[str, float]:
        """The cost model's expected tokens per second of a session (SDCP 6.2), by live option."""
        now = self.clock()
        return expected_rates(
            self.registry.live(Role.DRAFTER, now), self.registry.live(Role.VERIFIER, now), m_init=self.settings.m_init
        )

    # -- sessions --------------------------------------------------------------------------------

    async def contact(
        self, session: bytes, admit: Callable[[TrackedSession], object] = lambda _tracked: None
    ) -> TrackedSession:
        """The session of that id as the shared tier holds it now, for a peer's request about it.

        One this router holds is checked against the shared tier: facts another router wrote since
        are taken over, and a session whose facts are gone has ended elsewhere. One it does not
        hold is loaded (after a restart, or another router's whose peer could not reach that
        router), once ``admit`` has passed the caller, and held from then on: this router fails it
        over and assigns it like its own. ``SessionNotFound`` where neither has it."""
        opening = self._opening.get(session)
        if opening is not None:
            # The verifier decodes the session from its open on: an event (its very end, for a
            # short one) can come before the open's answer, and concerns the session this router
            # is about to hold; one whose open failed is then unknown here.
            await asyncio.wait([opening])
        held = self.sessions.get(session)
        try:
            stored = await self.store.load(session)
        except StoreUnavailable:
            if held is None:
                raise
            # The shared tier is out of reach (a Redis outage): this router's own facts answer
            # until it is back, as before the tier held sessions; a front end following its
            # session must not fail because the check for another router's changes could not run.
            admit(held)
            return held
        if held is not None:
            admit(held)
            if stored is None:
                if not held.ended:
                    self._end(held, Action.FINISH, delete=False)
            elif stored.etag != held.etag and stored.router != self.uri and not held.lock.locked():
                # Another router's facts (ours, read while we wrote newer ones, are older than
                # memory). Not under a change of ours: its write fails on them, and lets go.
                log.info("%s: session %s was changed by %s; taken over", self.uri, session.hex(), stored.router)
                held.take_over(stored)
            return held
        if stored is None:
            raise SessionNotFound("no such session at this router or in the shared tier")
        admit(stored)
        self._check_capacity()
        self.sessions[session] = stored
        self.metrics.opened(loaded=True)
        log.info(
            "%s: session %s loaded from the shared tier (written by %s, epoch %d at %s)",
            self.uri,
            session.hex(),
            stored.router,
            stored.plan.epoch,
            stored.plan.verifier,
        )
        return stored

    def _check_capacity(self) -> None:
        held = sum(1 for tracked in self.sessions.values() if not tracked.ended)
        if held >= self.settings.max_sessions:
            raise Unavailable(f"this router holds {held} sessions, its limit", retry_after_s=_RETRY_AFTER_S)

    async def open_session(self, owner: str, wanted: SessionRequest) -> TrackedSession:
        """Open a session at a verifier, then assign a drafter (SDCP 6.1 order). Runs to its end
        even if the caller goes away (a session half opened would be tracked nowhere), except that
        a session-open still waiting for the verifier's prefill is withdrawn: the verifier stops
        the prefill at its next step."""
        quota = self.settings.max_sessions_per_front_end
        if sum(1 for t in self.sessions.values() if t.plan.owner == owner and not t.ended) >= quota:
            raise OverQuota(f"{owner} has {quota} open sessions, its quota", retry_after_s=_RETRY_AFTER_S)
        self._check_capacity()
        return await shielded_unless_gone(lambda gone: self._open_session(owner, wanted, gone))

    async def _open_session(self, owner: str, wanted: SessionRequest, gone: asyncio.Event) -> TrackedSession:
        started = time.perf_counter()
        at_verifiers = 0.0
        contract = wanted.contract
        tried: list[str] = []
        refused: list[str] = []
        while True:
            verifier = self.placement.pick_verifier(
                contract, avoid=tried + refused, prompt=wanted.prompt, tenant=wanted.tenant
            )
            if verifier is None:
                if tried:
                    raise Unavailable(
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
                constraint=wanted.constraint,
                self_decode_only=wanted.self_decode_only,
                tenant=wanted.tenant,
                self_decode_group_ms=wanted.self_decode_group_ms,
            )
            tracked = TrackedSession(plan, wanted.prompt)
            # Asked with the open where it is the router's choice: no round trip between the
            # prefill and the first pass. A policy must reach the verifier before the first round.
            ask_alone = wanted.sampling is None and self.assignments.alone_from_open(tracked)
            asked = time.perf_counter()
            try:
                # SDCP 6.1: session-open with epoch 1 and a commit_log reference in the MLC.
                opened = await self._open_at_verifier(verifier, plan, gone, self_decode=ask_alone)
                at_verifiers += time.perf_counter() - asked
                break
            except Unanswered as exc:
                at_verifiers += time.perf_counter() - asked
                log.warning("%s: verifier %s did not open a session: %s", self.uri, verifier, exc)
                tried.append(verifier)
                # It may have opened the session all the same: it must not decode it for nobody.
                self._tasks.spawn(self._cancel_abandoned(plan))
            except BadContract as exc:
                view = self.registry.get(verifier)
                if view is None or view.status.model is not None:
                    raise
                log.info("%s: verifier %s, which reports no model, refused the contract: %s", self.uri, verifier, exc)
                refused.append(verifier)
        alone = opened.state == Action.SELF_DECODE
        if alone:
            # In the facts' first write: one write of them per open (each is an fsync'd transaction).
            self.assignments.decoding_alone(tracked)
        try:
            # Durable before anyone depends on it: a session no router could find again would run
            # unattended (no failover, no cancel).
            await self.store.save(tracked)
            self.sessions[session] = tracked
        except Exception:
            self._tasks.spawn(self._cancel_abandoned(plan))
            raise
        finally:
            self._opened(session)
        log.info("%s: session %s opened at %s (request %s)", self.uri, session.hex(), verifier, wanted.request or "-")
        self.metrics.opened()
        async with tracked.lock:
            try:
                if wanted.sampling is not None:
                    # SDCP 6.6: the user's preference is a policy from the first round on.
                    await self.assignments.send_policy(
                        tracked, Policy(session=session, from_round=1, sampling=wanted.sampling)
                    )
                try:
                    if not alone:
                        await self.assignments.assign_drafter(tracked)
                except (ProtocolError, Unanswered) as exc:
                    log.warning("%s: session %s opened without a drafter: %s", self.uri, session.hex(), exc)
            finally:
                await self._save_quietly(tracked)
        self.metrics.routed(time.perf_counter() - started - at_verifiers)
        return tracked

    async def _open_at_verifier(
        self, verifier: str, plan: RouterSession, gone: asyncio.Event, *, self_decode: bool
    ) -> SessionState:
        """The session-open at ``verifier``, withdrawn (its request reset) if the front end goes
        away first: RequesterGone then, and the session, if the verifier opened it all the same,
        is cancelled. With ``self_decode``, the session's events wait for the open to finish
        (``contact``) until ``_opened``."""
        if self_decode:
            self._opening[plan.session] = asyncio.get_running_loop().create_future()
        try:
            with self.placement.prefill_at(verifier, len(plan.prompt)) as deadline:
                opened = await cancelled_if(
                    self.link.open_session(verifier, plan.open_message(self_decode=self_decode), timeout=deadline),
                    gone.wait(),
                )
        except BaseException:
            self._opened(plan.session)
            raise
        if opened is None:
            self._opened(plan.session)
            self._tasks.spawn(self._cancel_abandoned(plan))
            raise RequesterGone(f"session {plan.session.hex()}: its front end went away during the session-open")
        return opened[0]

    def _opened(self, session: bytes) -> None:
        """The open of ``session`` is over, held by this router or failed: its events go on."""
        opening = self._opening.pop(session, None)
        if opening is not None:
            opening.set_result(None)

    async def event(self, tracked: TrackedSession, event: Event) -> None:
        """An event from the session's verifier (SDCP 6.5.2): switch reassigns the drafter; finish
        and fail end the session. A switch is answered at once: the decision calls back into the
        verifier."""
        if event.epoch != tracked.plan.epoch:
            raise ProtocolError(
                ProblemType.STALE_EPOCH, f"event of epoch {event.epoch}; the session is at epoch {tracked.plan.epoch}"
            )
        self.metrics.event(event.kind)
        if event.kind == Action.SWITCH and event.fenced:
            # The verifier stopped the session at this epoch, its append fenced. A fence of this
            # router's would have moved the session to a later epoch (the event would be stale, or
            # the failover that appended it holds the session's lock and moves it first); any other
            # is a record someone else appended, and the session would stall while that verifier
            # stays live: it opens again above that record.
            log.warning(
                "%s: session %s: verifier %s stopped it at epoch %d, fenced by a record not this router's",
                self.uri,
                tracked.plan.session.hex(),
                tracked.plan.verifier,
                event.epoch,
            )
            self._tasks.spawn(self._locked(tracked, partial(self.failover.fail_over, tracked, stopped_at=event.epoch)))
        elif event.kind == Action.SWITCH:
            # SDCP 6.5.2 switch (also the end of a self-decoding period): another drafter with a
            # permitted model, not the current one if any other is live, or the verifier alone when
            # no drafter is expected to beat it.
            current = tracked.plan.drafter
            if current is not None:
                self.metrics.switched(current)
            avoid = (current,) if current else ()
            self._tasks.spawn(self._locked(tracked, lambda: self.assignments.after_switch(tracked, avoid=avoid)))
        elif event.kind in (Action.FINISH, Action.FAIL):
            self._end(tracked, event.kind)
        else:
            log.info(
                "%s: event %s for session %s needs no router action",
                self.uri,
                event.kind.name,
                tracked.plan.session.hex(),
            )

    async def cancel(self, tracked: TrackedSession) -> SessionState:
        """The front end ends its session (extension, docs/interpretations.md): the verifier stops
        at its next round boundary and records the end, and the router assigns no one again."""
        return await asyncio.shield(self._cancel(tracked))

    async def _cancel(self, tracked: TrackedSession) -> SessionState:
        async with tracked.lock:
            state = await self._cancel_at_verifier(tracked.plan)
            self._end(tracked, Action.FAIL)
            return state

    async def _cancel_abandoned(self, plan: RouterSession) -> None:
        """Cancel a session-open whose answer never came (extension, docs/interpretations.md); a
        verifier still opening it answers 404 a little longer."""
        for attempt in range(_ABANDONED_CANCEL_TRIES):
            try:
                await self._cancel_at_verifier(plan)
                where = plan.verifier
                log.info("%s: session %s cancelled at %s, which answered late", self.uri, plan.session.hex(), where)
                return
            except (ProtocolError, Unanswered) as exc:
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

    async def _cancel_at_verifier(self, plan: RouterSession) -> SessionState:
        """POST sessions/{id}/cancel at the session's verifier; its session-state once ended."""
        return await self.link.cancel(plan.verifier, CancelRequest(session=plan.session, epoch=plan.epoch))

    async def change_policy(self, tracked: TrackedSession, policy: Policy) -> SessionState:
        """Forwarded to the verifier, kept for later assignments (SDCP 6.6)."""
        return await asyncio.shield(self._change_policy(tracked, policy))

    async def _change_policy(self, tracked: TrackedSession, policy: Policy) -> SessionState:
        async with tracked.lock:
            if tracked.ended:
                raise ProtocolError(ProblemType.SESSION_CLOSED, "the session has ended")
            try:
                await self.store.save(tracked, force=True)
            except Superseded as exc:
                self._let_go(tracked, exc)
                raise Unavailable("another router changed the session just now", retry_after_s=1) from exc
            try:
                return await self.assignments.send_policy(tracked, policy)
            finally:
                await self._save_quietly(tracked)

    # -- assignment, failover and the periodic task ----------------------------------------------

    async def maintain(self) -> None:
        """One pass of the periodic task: expire instances, reassign drafters, fail over verifiers.
        A session whose change from an earlier pass is still under way (a peer that does not
        answer holds it up to its timeout) is left to a later pass."""
        now = self.clock()
        for view in self.registry.expire(now):
            log.info("%s: status of %s expired", self.uri, view.uri)
        work = []
        for tracked in list(self.sessions.values()):
            if tracked.ended or tracked.session in self._changing:
                continue
            if self._failed(tracked.plan.verifier, now) or tracked.moving:
                # A failed verifier; or a move whose fence is in the log but whose open failed, which
                # the old verifier, even live, can no longer serve past.
                change = partial(self.failover.fail_over, tracked)
            elif tracked.self_decoding or not self.registry.is_live(tracked.plan.verifier, now):
                continue  # the period ends with its verifier's event; or the verifier has yet to report
            elif tracked.plan.drafter is None or self._failed(tracked.plan.drafter, now):
                # SDCP 6.9 drafter failure, or a session still waiting for its first drafter.
                change = partial(self.assignments.assign_drafter, tracked, only_if_missing=True)
            elif self.assignments.worth_moving(tracked, now):
                self.metrics.switched(tracked.plan.drafter)
                change = partial(self.assignments.assign_drafter, tracked)
            else:
                continue
            work.append(self._maintained(tracked, change))
        await asyncio.gather(*work)

    async def _maintained(self, tracked: TrackedSession, change: Callable[[], Awaitable[None]]) -> None:
        self._changing.add(tracked.session)
        try:
            await self._locked(tracked, change)
        finally:
            self._changing.discard(tracked.session)

    def _failed(self, uri: str, now: float) -> bool:
        """Whether an instance has no live status here: one this router has not heard of yet
        counts only after ``grace_s`` (a restarted router learns of every live instance by then)."""
        if self.registry.is_live(uri, now):
            return False
        return self.registry.get(uri) is not None or now - self._started_at >= self.grace_s

    async def _maintain_forever(self) -> None:
        while True:
            # In the background: one slow session must not hold up the next pass, which expires
            # instances (a verifier cut off while a change waits on it is failed over on time).
            self._tasks.spawn(self.maintain())
            # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a cancel that arrives as
            # the wake-up does, and the loop would outlive stop().
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()

    async def _locked(self, tracked: TrackedSession, change: Callable[[], Awaitable[None]]) -> None:
        """Run one change of a session under its lock, claimed first and its new facts written
        after; a failure is logged and retried next tick; a session another router changed since
        is let go (it holds the session now)."""
        stale = False
        async with tracked.lock:
            if tracked.ended or self.sessions.get(tracked.session) is not tracked:
                return
            try:
                await self.store.save(tracked, force=True)
                try:
                    await change()
                finally:
                    await self.store.save(tracked)
            except Superseded as exc:
                self._let_go(tracked, exc)
            except ProtocolError as exc:
                if exc.problem is ProblemType.SESSION_CLOSED:
                    self._end(tracked, Action.FINISH)
                    return
                log.warning("%s: session %s: %s", self.uri, tracked.plan.session.hex(), exc)
                stale = exc.problem is ProblemType.STALE_EPOCH
            except Exception as exc:  # noqa: BLE001 - the change is retried on the next tick
                log.warning("%s: session %s: %r", self.uri, tracked.plan.session.hex(), exc)
        if stale:
            # The verifier answered that the session's epoch is not current there: fenced, maybe
            # by a record this router did not write.
            self._tasks.spawn(self.look_for_intrusion(tracked))

    async def look_for_intrusion(self, tracked: TrackedSession) -> None:
        """Read what the session's log gained since the last read (a front end asked where the
        session runs, or its verifier answered a stale epoch): a record of an epoch above the
        session's, or one of its epoch that is not its verifier's signed record, has stopped that
        verifier (its next append fails its precondition) or will, and the session opens again
        above it. Skipped while a change of the session is under way: that change reads the log."""
        if tracked.ended or tracked.lock.locked():
            return
        async with tracked.lock:
            epoch = tracked.plan.epoch
            try:
                replayer = await self._logs.read(tracked)
            except Exception as exc:  # noqa: BLE001 - the next question or change looks again
                log.info("%s: session %s: its log not read: %r", self.uri, tracked.session.hex(), exc)
                return
            intruded = replayer.replay.epoch > epoch or replayer.poisoned(epoch)
        if intruded:
            await self._locked(tracked, partial(self.failover.fail_over, tracked, stopped_at=epoch))

    # -- helpers ---------------------------------------------------------------------------------

    def _end(self, tracked: TrackedSession, kind: Action, *, delete: bool = True) -> None:
        """The session ended: nothing is assigned again, and its facts leave the shared tier
        (``delete``; not where they are gone already)."""
        if not tracked.end():
            return
        self.metrics.ended()
        log.info("%s: session %s ended (%s)", self.uri, tracked.plan.session.hex(), kind.name.lower())
        if delete:
            self._tasks.spawn(self._delete_state(tracked.session))
        self._tasks.spawn(self._forget_later(tracked))

    def _let_go(self, tracked: TrackedSession, why: Exception) -> None:
        """Another router changed the session since this one read it: that router holds it now.
        Not a session that has ended (here, or found gone from the shared tier): its facts left
        the tier because it ended (a write racing their deletion fails on it), and it stays
        answerable until forgotten."""
        if tracked.ended:
            return
        if self.sessions.get(tracked.session) is tracked:
            del self.sessions[tracked.session]
            self.metrics.let_go()
        log.info("%s: session %s is held by another router now: %s", self.uri, tracked.session.hex(), why)

    async def _save_quietly(self, tracked: TrackedSession) -> None:
        """Write the session's changed facts where no caller waits for the outcome: a failure is
        logged, and the next change writes them again."""
        try:
            await self.store.save(tracked)
        except Superseded as exc:
            self._let_go(tracked, exc)
        except CacheError as exc:
            log.warning("%s: session %s: its state not written: %s", self.uri, tracked.session.hex(), exc)

    async def _delete_state(self, session: bytes) -> None:
        try:
            await self.store.delete(session)
        except CacheError as exc:
            log.warning("%s: session %s: its state not deleted: %s", self.uri, session.hex(), exc)

    async def _forget_later(self, tracked: TrackedSession) -> None:
        """An ended session can be looked up for a while, then its memory is freed."""
        await asyncio.sleep(self.settings.ended_retention_s)
        if self.sessions.get(tracked.plan.session) is tracked:
            del self.sessions[tracked.plan.session]
