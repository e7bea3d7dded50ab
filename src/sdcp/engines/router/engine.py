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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

from prometheus_client import Counter, Gauge

from sdcp.cache import MLC, CacheError, StoreUnavailable, build_uri, target_kv_uri
from sdcp.cache.prefix import SHARE_TOKENS, shared_hashes, tenant_scope
from sdcp.cache.uri import LOG_KIND, TOKENS_KIND
from sdcp.config import RouterConfig
from sdcp.engines.errors import OverQuota, RequesterGone, SessionNotFound, Unanswered, Unavailable
from sdcp.engines.ports import RouterLink
from sdcp.engines.router.sessions import TrackedSession
from sdcp.engines.router.store import SessionStore, Superseded
from sdcp.engines.tasks import BackgroundTasks, cancelled_if, shielded_unless_gone
from sdcp.latency import ROUTER_PARTS, observe_part, start_parts
from sdcp.protocol.drafter import CONSTRAINED, PLAIN
from sdcp.protocol.messages import (
    Action,
    Assignment,
    CancelRequest,
    Contract,
    Event,
    Policy,
    Role,
    SelfDecodeRequest,
    SessionRequest,
    SessionState,
    Status,
)
from sdcp.protocol.problems import BadContract, ProblemType, ProtocolError
from sdcp.protocol.records import LogReplay, LogReplayer, RecordAuthority, encode_token_list, session_terms
from sdcp.protocol.router import (
    DecodingChoice,
    InstanceRegistry,
    InstanceView,
    RouterSession,
    choose_decoding,
    drafter_costs,
    drafter_permitted,
    drafter_rate,
    open_deadline_s,
    prefer_cached_prefix,
    prefer_idle_and_accepting,
)
from sdcp.protocol.router_life import RouterEvent, RouterPhase

__all__ = ["SELF_DECODING_AT", "RouterEngine"]

log = logging.getLogger("sdcp.router")
# When a refused session request may be tried again (sessions end at their own pace).
_RETRY_AFTER_S = 5
# A cancel of a session-open that timed out is tried this often, this far apart.
_ABANDONED_CANCEL_TRIES, _ABANDONED_CANCEL_WAIT_S = 5, 1.0

SESSIONS_OPEN = Gauge("sdcp_router_sessions_open", "Sessions neither finished nor failed", ["instance"])
ASSIGNMENTS = Counter("sdcp_router_assignments_total", "Assignments sent, by drafter", ["instance", "drafter"])
SWITCHES = Counter(
    "sdcp_router_switches_total",
    "Sessions moved off a drafter (a switch event, or a faster option), by the drafter left",
    ["instance", "drafter"],
)
EVENTS = Counter("sdcp_router_events_total", "Events from verifiers, by kind", ["instance", "kind"])
EXPECTED_RATE = Gauge(
    "sdcp_router_expected_tokens_per_second",
    "The cost model's expected tokens per second of a session, by option (a drafter, or self-decoding at a verifier)",
    ["instance", "option"],
)
FAILOVERS = Counter("sdcp_router_failovers_total", "Sessions moved to another verifier", ["instance"])
REOPENED = Counter(
    "sdcp_router_sessions_reopened_total",
    "Sessions opened again above a record another party appended to their log, which stopped their verifier",
    ["instance"],
)
UNTRUSTED_RECORDS = Counter(
    "sdcp_router_untrusted_records_total",
    "Commit records a replay left out: not signed by their epoch's verifier",
    ["instance"],
)
TAKEN_OVER = Counter(
    "sdcp_router_sessions_loaded_total",
    "Sessions loaded from the shared tier on first contact (after a restart, or another router's)",
    ["instance"],
)
TARGET_DIGESTS = Gauge(
    "sdcp_router_verifier_target_digests",
    "Distinct target digests among the live verifiers of one model: above 1, those verifiers cannot take "
    "over each other's sessions (pin their backend, docs/deploy.md)",
    ["instance", "model"],
)
LET_GO = Counter(
    "sdcp_router_sessions_let_go_total", "Sessions another router changed since this one held them", ["instance"]
)
CHOICES = Counter(
    "sdcp_router_decoding_choices_total",
    "Decisions on who drafts for a session: a drafter, an exploration of an unmeasured drafter, or the verifier alone",
    ["instance", "choice"],
)


class VerifierUnanswered(Unanswered):
    """The session's verifier, not the drafter, left an assignment unanswered: another drafter
    would wait on the same verifier, so the assignment stops and the failover gets its turn."""


# The option of self-decoding at a verifier, in ``expected_rates`` (the dashboard's key).
SELF_DECODING_AT = "self-decoding at "
# A drafter's option for a constrained session, measured apart (``session_class``).
CONSTRAINED_BY = "constrained sessions by "
# A session is moved off its drafter only for an option expected to be this much faster, and at
# most once per this many seconds, so that estimates that differ by noise do not make it flap.
SWITCH_MARGIN = 1.25
REDECIDE_AFTER_S = 2.0
# A verification round at a verifier that reports no timing of its own.
DEFAULT_VERIFY_S = 0.05


def _serves(view: InstanceView, contract: Contract) -> bool:
    status = view.status
    # A verifier that reports no tokenizer digest is judged by its target digest alone.
    return status.model == contract.target and status.tokenizer in (None, contract.tokenizer)


def _unreported(views: Sequence[InstanceView]) -> list[InstanceView]:
    """Instances whose status lacks our private `model` member (another implementation's): the
    contract's digests cannot be matched here, so they are asked, and refuse with
    sdcp-bad-contract what they do not serve (SDCP 6.1); tried only when no reporting one fits."""
    return [view for view in views if view.status.model is None]


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
        self.store = SessionStore(mlc, uri)
        self._started_at = clock()
        # Sessions a pass of the periodic task is changing now.
        self._changing: set[bytes] = set()
        self._wake = asyncio.Event()
        self._tasks = BackgroundTasks(uri, log)
        # Prompt tokens of the session-opens in flight at each verifier (their prefill deadlines).
        self._opening: dict[str, int] = {}

    @property
    def settings(self) -> RouterConfig:
        return self._settings()

    async def start(self) -> None:
        for kind in Action:
            EVENTS.labels(self.uri, kind.name.lower())
        for choice in ("drafter", "explore", "self"):
            CHOICES.labels(self.uri, choice)
        for family in (FAILOVERS, REOPENED, SESSIONS_OPEN, TAKEN_OVER, LET_GO):
            family.labels(self.uri)
        start_parts(self.uri, ROUTER_PARTS)
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
            # A drafter's series start at zero when it first reports.
            ASSIGNMENTS.labels(self.uri, status.instance)
            SWITCHES.labels(self.uri, status.instance)
        for option, rate in self.expected_rates().items():
            EXPECTED_RATE.labels(self.uri, option).set(rate)

    def target_splits(self) -> dict[str, dict[str, list[str]]]:
        """The models whose live verifiers advertise more than one target digest: by model name,
        the verifiers of each digest (hex) with their backend. A session opened at one of them
        cannot fail over to a verifier of another digest (SDCP 6.1: the contract names the digest)."""
        groups: dict[str, dict[str, list[str]]] = {}
        for view in self.registry.live(Role.VERIFIER, self.clock()):
            status = view.status
            if status.model_name is None or status.model is None:
                continue
            described = f"{view.uri} ({status.backend or 'backend unknown'})"
            groups.setdefault(status.model_name, {}).setdefault(status.model.hex(), []).append(described)
        return {name: digests for name, digests in groups.items() if len(digests) > 1}

    def _check_target_digests(self, model_name: str) -> None:
        digests = {
            view.status.model
            for view in self.registry.live(Role.VERIFIER, self.clock())
            if view.status.model_name == model_name and view.status.model is not None
        }
        previous = self._digest_counts.get(model_name, 1)
        self._digest_counts[model_name] = len(digests)
        TARGET_DIGESTS.labels(self.uri, model_name).set(len(digests))
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

    @contextlib.contextmanager
    def _prefill_at(self, verifier: str, tokens: int) -> Iterator[float]:
        """The deadline of a session-open at ``verifier`` that prefills ``tokens``, counted among
        this router's opens there while the block runs. The verifier prefills one session at a
        time: this one's turn comes after its queue as it last reported it, and after this router's
        opens there since (not in that report yet)."""
        view = self.registry.get(verifier)
        queued = (view.status.prefill_tokens or 0) if view is not None else 0
        queued += self._opening.get(verifier, 0)
        self._opening[verifier] = self._opening.get(verifier, 0) + tokens
        try:
            yield open_deadline_s(
                self.settings.open_timeout_s, tokens + queued, self.settings.open_timeout_per_token_ms
            )
        finally:
            self._opening[verifier] -= tokens
            if not self._opening[verifier]:
                del self._opening[verifier]

    def live_counts(self) -> tuple[int, int]:
        """How many verifiers and drafters are registered (their reports have not expired)."""
        now = self.clock()
        return len(self.registry.live(Role.VERIFIER, now)), len(self.registry.live(Role.DRAFTER, now))

    def targets(self) -> list[dict[str, object]]:
        """The live verifiers and the digests a contract must name to use them."""
        targets = []
        for view in self.registry.live(Role.VERIFIER, self.clock()):
            if view.status.model is None:
                continue
            target: dict[str, object] = {"instance": view.uri, "model": view.status.model}
            if view.status.tokenizer is not None:
                target["tokenizer"] = view.status.tokenizer
            if view.status.context is not None:
                target["context"] = view.status.context
            if view.status.model_name is not None:
                target["model_name"] = view.status.model_name
            if view.status.backend is not None:
                target["backend"] = view.status.backend
            targets.append(target)
        return sorted(targets, key=lambda t: str(t["instance"]))

    def expected_rates(self) -> dict[str, float]:
        """The cost model's expected tokens per second of a session (SDCP 6.2), by live option: a
        drafter's URI, the same for a constrained session (``CONSTRAINED_BY``), or self-decoding
        at a verifier."""
        now = self.clock()
        verifiers = self.registry.live(Role.VERIFIER, now)
        verify_s = _verify_s(verifiers[0] if verifiers else None)
        m_limit = max(1, self.settings.m_init)
        rates = {}
        for view in self.registry.live(Role.DRAFTER, now):
            for klass, prefix in ((PLAIN, ""), (CONSTRAINED, CONSTRAINED_BY)):
                costs = drafter_costs(view, klass)
                if costs.alpha is not None:
                    rates[f"{prefix}{view.uri}"] = drafter_rate(costs, verify_s=verify_s, m_limit=m_limit)
        for view in verifiers:
            if view.status.self_us:
                rates[f"{SELF_DECODING_AT}{view.uri}"] = 1e6 / view.status.self_us
        return rates

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
        SESSIONS_OPEN.labels(self.uri).inc()
        TAKEN_OVER.labels(self.uri).inc()
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
            verifier = self._pick_verifier(contract, avoid=tried + refused, prompt=wanted.prompt, tenant=wanted.tenant)
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
            )
            asked = time.perf_counter()
            try:
                # SDCP 6.1: session-open with epoch 1 and a commit_log reference in the MLC.
                await self._open_at_verifier(verifier, plan, gone)
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
        tracked = TrackedSession(plan, wanted.prompt)
        try:
            # Durable before anyone depends on it: a session no router could find again would run
            # unattended (no failover, no cancel).
            await self.store.save(tracked)
        except Exception:
            self._tasks.spawn(self._cancel_abandoned(plan))
            raise
        self.sessions[session] = tracked
        log.info("%s: session %s opened at %s (request %s)", self.uri, session.hex(), verifier, wanted.request or "-")
        SESSIONS_OPEN.labels(self.uri).inc()
        async with tracked.lock:
            try:
                if wanted.sampling is not None:
                    # SDCP 6.6: the user's preference is a policy from the first round on.
                    await self._send_policy(tracked, Policy(session=session, from_round=1, sampling=wanted.sampling))
                try:
                    await self._assign_drafter(tracked)
                except (ProtocolError, Unanswered) as exc:
                    log.warning("%s: session %s opened without a drafter: %s", self.uri, session.hex(), exc)
            finally:
                await self._save_quietly(tracked)
        observe_part(self.uri, "route", time.perf_counter() - started - at_verifiers)
        return tracked

    async def _open_at_verifier(self, verifier: str, plan: RouterSession, gone: asyncio.Event) -> None:
        """The session-open at ``verifier``, withdrawn (its request reset) if the front end goes
        away first: RequesterGone then, and the session, if the verifier opened it all the same,
        is cancelled."""
        with self._prefill_at(verifier, len(plan.prompt)) as deadline:
            opened = await cancelled_if(
                self.link.open_session(verifier, plan.open_message(), timeout=deadline), gone.wait()
            )
        if opened is None:
            self._tasks.spawn(self._cancel_abandoned(plan))
            raise RequesterGone(f"session {plan.session.hex()}: its front end went away during the session-open")

    async def event(self, tracked: TrackedSession, event: Event) -> None:
        """An event from the session's verifier (SDCP 6.5.2): switch reassigns the drafter; finish
        and fail end the session. A switch is answered at once: the decision calls back into the
        verifier."""
        if event.epoch != tracked.plan.epoch:
            raise ProtocolError(
                ProblemType.STALE_EPOCH, f"event of epoch {event.epoch}; the session is at epoch {tracked.plan.epoch}"
            )
        EVENTS.labels(self.uri, event.kind.name.lower()).inc()
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
            self._tasks.spawn(self._locked(tracked, partial(self._fail_over, tracked, stopped_at=event.epoch)))
        elif event.kind == Action.SWITCH:
            # SDCP 6.5.2 switch (also the end of a self-decoding period): another drafter with a
            # permitted model, not the current one if any other is live, or the verifier alone when
            # no drafter is expected to beat it.
            current = tracked.plan.drafter
            if current is not None:
                SWITCHES.labels(self.uri, current).inc()
            avoid = (current,) if current else ()
            self._tasks.spawn(self._locked(tracked, lambda: self._after_switch(tracked, avoid=avoid)))
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
                return await self._send_policy(tracked, policy)
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
                change = partial(self._fail_over, tracked)
            elif tracked.self_decoding or not self.registry.is_live(tracked.plan.verifier, now):
                continue  # the period ends with its verifier's event; or the verifier has yet to report
            elif tracked.plan.drafter is None or self._failed(tracked.plan.drafter, now):
                # SDCP 6.9 drafter failure, or a session still waiting for its first drafter.
                change = partial(self._assign_drafter, tracked, only_if_missing=True)
            elif self._worth_moving(tracked, now):
                SWITCHES.labels(self.uri, tracked.plan.drafter).inc()
                change = partial(self._assign_drafter, tracked)
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
                replayer = await self._read_log(tracked)
            except Exception as exc:  # noqa: BLE001 - the next question or change looks again
                log.info("%s: session %s: its log not read: %r", self.uri, tracked.session.hex(), exc)
                return
            intruded = replayer.replay.epoch > epoch or replayer.poisoned(epoch)
        if intruded:
            await self._locked(tracked, partial(self._fail_over, tracked, stopped_at=epoch))

    async def _assign_drafter(
        self, tracked: TrackedSession, *, avoid: Sequence[str] = (), only_if_missing: bool = False
    ) -> None:
        """Decide who drafts for the session next, by expected rate (``choose_decoding``), and tell
        them: a drafter that does not answer is skipped; a verifier that does not decode alone at
        this router's request gets a drafter instead."""
        current = tracked.plan.drafter
        if only_if_missing and (
            tracked.self_decoding or (current is not None and self.registry.is_live(current, self.clock()))
        ):
            return
        if tracked.plan.self_decode_only:
            # The front end asked for no speculation (docs/interpretations.md, "Per-request
            # speculation"): the verifier decodes alone, period after period, whatever it costs.
            await self._send_self_decode(tracked)
            return
        unreachable: list[str] = []
        self_decode = True
        while True:
            choice = self._choose(tracked, avoid=avoid, skip=unreachable, self_decode=self_decode)
            if choice is None:
                tracked.unserved()
                log.info("%s: session %s waits for a drafter", self.uri, tracked.plan.session.hex())
                return
            if choice.drafter is None:
                try:
                    await self._send_self_decode(tracked)
                    return
                except ProtocolError as exc:
                    if exc.problem in (ProblemType.SESSION_CLOSED, ProblemType.STALE_EPOCH, ProblemType.STALE_BASE):
                        raise
                    log.info("%s: verifier %s does not decode alone: %s", self.uri, tracked.plan.verifier, exc)
                except Unanswered as exc:
                    log.info("%s: verifier %s does not decode alone: %s", self.uri, tracked.plan.verifier, exc)
                self_decode = False
                continue
            try:
                await self._send_assignment(tracked, choice.drafter, exploring=choice.exploring)
            except VerifierUnanswered:
                raise
            except Unanswered as exc:
                log.warning("%s: drafter %s took no assignment: %s", self.uri, choice.drafter, exc)
                unreachable.append(choice.drafter)
                continue
            except BadContract as exc:
                # A drafter reporting no model learns the contract only here (SDCP 6.1).
                log.info("%s: drafter %s refused the contract: %s", self.uri, choice.drafter, exc)
                unreachable.append(choice.drafter)
                continue
            except ProtocolError as exc:
                if exc.state is None or exc.state.state != Action.SELF_DECODE:
                    raise
                # The verifier is in a self-decoding period of its ladder; its event ends it.
                tracked.decoding_alone(now=None)
                return
            CHOICES.labels(self.uri, "explore" if choice.exploring else "drafter").inc()
            return

    def _choose(
        self, tracked: TrackedSession, *, avoid: Sequence[str] = (), skip: Sequence[str] = (), self_decode: bool = True
    ) -> DecodingChoice | None:
        """The expected fastest option for the session among live permitted drafters (those in
        ``avoid`` only when no other is live) and, where permitted, its verifier alone."""
        now = self.clock()
        contract = tracked.plan.contract
        live = [view for view in self.registry.live(Role.DRAFTER, now) if view.uri not in skip]
        permitted = [view for view in live if drafter_permitted(contract, view.model)] or _unreported(live)
        pool = [view for view in permitted if view.uri not in avoid] or permitted
        verifier = self.registry.get(tracked.plan.verifier)
        # A drafter is measured, and explored, per class of session: its acceptance on constrained
        # sessions is not its average (a guided drafter proposes what the grammar forces).
        klass = tracked.session_class

        def may_explore(uri: str) -> bool:
            # Exploration is bounded: one session of a class at a time per drafter unmeasured on
            # that class, and it ends with the drafter's first acceptance report for it
            # (measured_acceptance: our alpha_milli or alpha_constrained_milli, or SDCP 5.2
            # accept_milli from a drafter without our cost terms). Asked only about unmeasured
            # drafters, so that maintenance of measured ones scans no sessions.
            return not any(
                other.exploring == uri and other is not tracked and not other.ended and other.session_class == klass
                for other in self.sessions.values()
            )

        return choose_decoding(
            [drafter_costs(view, klass) for view in pool],
            self_decode_s=self._self_decode_s(contract, verifier) if self_decode else None,
            verify_s=_verify_s(verifier),
            m_limit=self._m_limit(contract),
            may_explore=may_explore,
        )

    def _m_limit(self, contract: Contract) -> int:
        return max(1, min(contract.m_max, self.settings.m_init))

    @staticmethod
    def _self_decode_s(contract: Contract, verifier: InstanceView | None) -> float | None:
        """Seconds per token of the verifier decoding alone, where the contract permits that now
        (SDCP 6.5.2: self_load present and not exceeded) and the verifier reports its time."""
        if verifier is None or verifier.status.self_us is None or contract.self_load is None:
            return None
        if contract.self_max == 0 or verifier.status.load > contract.self_load:
            return None
        return verifier.status.self_us / 1e6

    def _worth_moving(self, tracked: TrackedSession, now: float) -> bool:
        """Whether a session's drafter should give way: its exploration has been measured, or
        another option is now expected to be ``SWITCH_MARGIN`` times faster."""
        drafter = tracked.plan.drafter
        view = self.registry.get(drafter) if drafter is not None else None
        if view is None or now - tracked.decided_at < REDECIDE_AFTER_S:
            return False
        costs = drafter_costs(view, tracked.session_class)
        if costs.alpha is None:
            return False  # its measurement is on the way (alpha_milli or accept_milli: measured_acceptance)
        best = self._choose(tracked)
        if best is None or best.drafter == drafter:
            tracked.exploring = None
            return False
        if tracked.exploring == drafter:
            return True
        verifier = self.registry.get(tracked.plan.verifier)
        current = drafter_rate(costs, verify_s=_verify_s(verifier), m_limit=self._m_limit(tracked.plan.contract))
        return best.rate > SWITCH_MARGIN * current

    async def _send_self_decode(self, tracked: TrackedSession) -> None:
        """Ask the verifier to decode the session alone (extension, docs/interpretations.md)."""
        plan = tracked.plan
        await self.link.self_decode(plan.verifier, SelfDecodeRequest(session=plan.session, epoch=plan.epoch))
        tracked.decoding_alone(now=self.clock())
        CHOICES.labels(self.uri, "self").inc()
        log.info("%s: session %s decoded by verifier %s alone", self.uri, tracked.plan.session.hex(), plan.verifier)

    async def _after_switch(self, tracked: TrackedSession, *, avoid: Sequence[str]) -> None:
        if tracked.advance(RouterEvent.SWITCHED) is RouterPhase.MOVING:
            return  # the verifier's event came before its failover finished: the move assigns
        await self._assign_drafter(tracked, avoid=avoid)

    async def _send_assignment(self, tracked: TrackedSession, drafter: str, *, exploring: bool) -> None:
        """SDCP 6.1: inform the verifier first, then send the assignment to the drafter."""
        plan = tracked.plan
        replay, tokens = await self._committed_prefix(tracked)
        read_at = replay.round
        try:
            state = await self.link.inform_verifier(plan.verifier, self._assignment(tracked, drafter, replay, tokens))
        except Unanswered as exc:
            # A verifier cut off mid-assignment is silent to each drafter tried in turn, and the
            # session's lock, which its failover waits for, is held all that while.
            raise VerifierUnanswered(f"verifier {plan.verifier}: {exc}") from exc
        plan.drafter = drafter
        if state.round != read_at:
            # The previous drafter's last round (or a self-decoded one) committed after the log was
            # read; it is in the log now, since the verifier appends before it answers (SDCP 6.3).
            replay, tokens = await self._committed_prefix(tracked)
            read_at = replay.round
        await self.link.assign(drafter, self._assignment(tracked, drafter, replay, tokens))
        tracked.assigned(drafter, exploring=exploring, now=self.clock())
        ASSIGNMENTS.labels(self.uri, drafter).inc()
        log.info("%s: session %s assigned to %s at round %d", self.uri, tracked.plan.session.hex(), drafter, read_at)

    def _assignment(self, tracked: TrackedSession, drafter: str, replay: LogReplay, tokens: str) -> Assignment:
        return tracked.plan.assignment(
            drafter,
            round=replay.round,
            committed=len(replay.tokens),
            digest=replay.digest,
            m_init=self.settings.m_init,
            committed_tokens=tokens,
        )

    async def _fail_over(self, tracked: TrackedSession, *, stopped_at: int | None = None) -> None:
        """SDCP 6.9 verifier failure: fence, replay the log, resume at another verifier, reassign.

        With ``stopped_at``, the verifier stopped the session at that epoch, fenced by a record
        this router did not write (a second verifier's, or a writer's with access to the store): the
        session opens again above every epoch in the log, at that verifier while it is live. Without,
        a move whose fence is in the log but whose open failed is finished, even at a live verifier."""
        plan = tracked.plan
        live = self.registry.is_live(plan.verifier, self.clock())
        if stopped_at is not None:
            if tracked.ended or plan.epoch != stopped_at:
                return  # a fence of this router's moved the session on already: the one it met
        elif live and not tracked.moving:
            return
        # The epoch the failed verifier served, which names the target KV it published; the plan's
        # epoch may move up below, to fence above what the log holds.
        served = plan.epoch
        # A verifier that stopped the session (its append fenced) serves it again at the new epoch.
        verifier = (
            plan.verifier
            if live
            else self._pick_verifier(plan.contract, avoid=[plan.verifier], prompt=plan.prompt, tenant=plan.tenant)
        )
        named = tracked.failover_to
        if named is not None and named != plan.verifier and self.registry.is_live(named, self.clock()):
            verifier = named
        if verifier is None:
            log.info("%s: session %s waits for a verifier", self.uri, tracked.plan.session.hex())
            return
        if named is not None and named != verifier:
            # The last try's fence named another verifier at the next epoch, and a fence of that
            # epoch again appends nothing: that epoch is spent, the session moves at the one after.
            tracked.plan = plan = replace(plan, epoch=plan.epoch + 1)
        # The fence goes above every epoch in the log, not only above the session's: a record that
        # a second verifier (or anyone with write access to the store) appended at the next epoch
        # would otherwise precede the fence and leave the new verifier's epoch poisoned.
        epoch = (await self._read_log(tracked)).epoch_to_fence(plan.epoch, verifier)
        if epoch > plan.epoch + 1:
            log.warning(
                "%s: session %s: the log holds epoch %d; fenced at %d", self.uri, plan.session.hex(), epoch - 1, epoch
            )
            tracked.plan = plan = replace(plan, epoch=epoch - 1)
        # SDCP 6.9: the fence comes first, so the old verifier can no longer commit or release output.
        # Fencing the same epoch again appends nothing, so a failover retried next tick is safe. The
        # fence names the new verifier: only its signed records count in the new epoch.
        tracked.fenced(verifier)
        # Durable before the fence: a router that takes the session over retries at that verifier.
        await self.store.save(tracked)
        fence = plan.fence_for_failover(verifier)
        await self.mlc.commit_log(plan.commit_log).fence(fence.epoch, fence.verifier)
        replay, tokens = await self._committed_prefix(tracked)
        published = target_kv_uri(plan.commit_log, plan.session, served)
        moved = plan.fail_over(verifier, replay, tokens, target_kv=await self._available(published))
        with self._prefill_at(verifier, len(tracked.prompt) + len(replay.tokens)) as deadline:
            await self.link.open_session(verifier, moved.open_message(), timeout=deadline)
        tracked.reopened(moved)
        if published is not None:
            # The new verifier has imported it or prefilled: the failed epoch's KV serves no one now.
            self._tasks.spawn(self._discard(published))
        (FAILOVERS if verifier != plan.verifier else REOPENED).labels(self.uri).inc()
        log.info("%s: session %s moved to %s at epoch %d", self.uri, tracked.plan.session.hex(), verifier, moved.epoch)
        if moved.sampling is not None:
            # The new verifier knows only the contract; the current profile must follow the session.
            await self._send_policy(
                tracked, Policy(session=moved.session, from_round=replay.round + 1, sampling=moved.sampling)
            )
        drafter = moved.drafter
        if drafter is not None and self.registry.is_live(drafter, self.clock()):
            try:
                await self._send_assignment(tracked, drafter, exploring=tracked.exploring == drafter)
                return
            except Unanswered as exc:
                log.warning("%s: drafter %s took no assignment: %s", self.uri, drafter, exc)
        await self._assign_drafter(tracked, avoid=(drafter,) if drafter else ())

    async def _committed_prefix(self, tracked: TrackedSession) -> tuple[LogReplay, str]:
        """The committed state from the commit log, and its tokens written to the MLC. The log is
        read from the first record not read before, and each record replayed once."""
        plan = tracked.plan
        replay = (await self._read_log(tracked)).replay
        # The committed prefix of a given length never changes, so the name can say only its length.
        uri = build_uri(
            self.mlc.authority, plan.contract.scope, TOKENS_KIND, f"{plan.session.hex()}-{len(replay.tokens)}"
        )
        if uri != tracked.tokens_uri:
            await self.mlc.put(uri, encode_token_list(replay.tokens))
            tracked.tokens_uri = uri
        return replay, uri

    async def _read_log(self, tracked: TrackedSession) -> LogReplayer:
        """The session's replayer, fed the records appended to its log since the last read."""
        plan = tracked.plan
        replayer = tracked.replayer
        if replayer is None:
            replayer = tracked.replayer = LogReplayer(
                plan.contract.digest,
                tracked.prompt,
                authority=self.record_check,
                first_verifier=tracked.first_verifier,
                session=plan.session,
                terms=session_terms(constraint=plan.constraint, min_new=plan.min_new),
            )
        snapshot = await self.mlc.commit_log(plan.commit_log).read_from(replayer.fed)
        try:
            # SDCP 1.3, 6.9: a record that is not its epoch's verifier's signed record is a fault:
            # it is never replayed, and its epoch counts no later record (the router has fenced
            # it, or fences it at the failover); the output up to the last good record stands.
            faults = replayer.feed(snapshot.records)
        except Exception:
            tracked.replayer = None  # a corrupt log is read again from its start next time
            raise
        for fault in faults:
            UNTRUSTED_RECORDS.labels(self.uri).inc()
            log.warning("%s: session %s: a commit record left out: %s", self.uri, plan.session.hex(), fault)
        return replayer

    async def _available(self, uri: str | None) -> str | None:
        """``uri`` if the MLC holds it: the target KV the failed verifier published (SDCP 6.9)."""
        if uri is None:
            return None
        try:
            return uri if await self.mlc.exists(uri) else None
        except CacheError as exc:
            log.info("%s: target KV %s not looked up, the new verifier prefills: %s", self.uri, uri, exc)
            return None

    async def _discard(self, uri: str) -> None:
        try:
            await self.mlc.delete(uri)
        except CacheError as exc:
            log.info("%s: target KV %s not deleted: %s", self.uri, uri, exc)

    async def _send_policy(self, tracked: TrackedSession, policy: Policy) -> SessionState:
        state = await self.link.policy(tracked.plan.verifier, policy)
        # SDCP 6.6: later assignments carry the profile; the contract stays as created.
        tracked.plan.sampling = policy.sampling
        return state

    # -- helpers ---------------------------------------------------------------------------------

    def _pick_verifier(
        self, contract: Contract, *, avoid: Sequence[str], prompt: tuple[int, ...] | str = (), tenant: str | None = None
    ) -> str | None:
        """A live verifier of the contract's target: where the prompt's longest prefix is held, if
        any with room holds one, else the least loaded (sdcp.protocol.router)."""
        live = [view for view in self.registry.live(Role.VERIFIER, self.clock()) if view.uri not in avoid]
        candidates = [view for view in live if _serves(view, contract)] or _unreported(live)
        if not candidates:
            return None
        if isinstance(prompt, tuple) and len(prompt) > SHARE_TOKENS:
            # The verifier prefills all but the prompt's last token; its prefixes are named so.
            names = shared_hashes(prompt[:-1], salt=contract.target + contract.tokenizer, scope=tenant_scope(tenant))
            return prefer_cached_prefix(candidates, partial(_cached_length, names)).uri
        return prefer_idle_and_accepting(candidates).uri

    def _end(self, tracked: TrackedSession, kind: Action, *, delete: bool = True) -> None:
        """The session ended: nothing is assigned again, and its facts leave the shared tier
        (``delete``; not where they are gone already)."""
        if not tracked.end():
            return
        SESSIONS_OPEN.labels(self.uri).dec()
        log.info("%s: session %s ended (%s)", self.uri, tracked.plan.session.hex(), kind.name.lower())
        if delete:
            self._tasks.spawn(self._delete_state(tracked.session))
        self._tasks.spawn(self._forget_later(tracked))

    def _let_go(self, tracked: TrackedSession, why: Exception) -> None:
        """Another router changed the session since this one read it: that router holds it now."""
        if self.sessions.get(tracked.session) is tracked:
            del self.sessions[tracked.session]
            if not tracked.ended:
                SESSIONS_OPEN.labels(self.uri).dec()
            LET_GO.labels(self.uri).inc()
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


def _cached_length(names: Sequence[bytes], view: InstanceView) -> int:
    """How many tokens of a prompt (``names``: its prefixes' names) the verifier reports holding."""
    held = set(view.status.prefixes or ())
    return max(((index + 1) * SHARE_TOKENS for index, name in enumerate(names) if name in held), default=0)


def _verify_s(verifier: InstanceView | None) -> float:
    """What a verification round costs at this verifier, for drafters that have not timed one: its
    time per self-decoded token, one pass."""
    if verifier is None or not verifier.status.self_us:
        return DEFAULT_VERIFY_S  # none reported, or a zero that no pass can take
    return verifier.status.self_us / 1e6
