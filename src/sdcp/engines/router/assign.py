"""Who drafts for a session (SDCP 6.1, 6.2 cost model, 6.5.2 switch): the choice by expected rate
(``sdcp.protocol.router.choose_for_session``), and telling the verifier, then the drafter, or asking
the verifier to decode alone (extension, docs/interpretations.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from sdcp.config import RouterConfig
from sdcp.engines.errors import Unanswered
from sdcp.engines.ports import RouterLink
from sdcp.engines.router.logs import SessionLogs
from sdcp.engines.router.observe import RouterMetrics
from sdcp.engines.router.sessions import TrackedSession
from sdcp.protocol.messages import Action, Assignment, Policy, Role, SelfDecodeRequest, SessionState
from sdcp.protocol.problems import BadContract, ProblemType, ProtocolError
from sdcp.protocol.records import LogReplay
from sdcp.protocol.router import (
    REDECIDE_AFTER_S,
    DecodingChoice,
    InstanceRegistry,
    choose_for_session,
    drafter_costs,
    outpaced,
)
from sdcp.protocol.router_life import RouterEvent, RouterPhase

__all__ = ["Assignments", "VerifierUnanswered"]

log = logging.getLogger("sdcp.router")


class VerifierUnanswered(Unanswered):
    """The session's verifier, not the drafter, left an assignment unanswered: another drafter
    would wait on the same verifier, so the assignment stops and the failover gets its turn."""


class Assignments:
    """The router ``uri``'s decisions on who drafts for its ``sessions``, from the live instances in
    ``registry``; each runs under its session's lock (the engine holds it)."""

    def __init__(
        self,
        *,
        uri: str,
        registry: InstanceRegistry,
        sessions: Mapping[bytes, TrackedSession],
        clock: Callable[[], float],
        settings: Callable[[], RouterConfig],
        link: RouterLink,
        logs: SessionLogs,
        metrics: RouterMetrics,
    ) -> None:
        self.uri = uri
        self._registry = registry
        self._sessions = sessions
        self._clock = clock
        self._settings = settings
        self._link = link
        self._logs = logs
        self._metrics = metrics
        # Explorations whose assignment is on its way, as (drafter, class): a session explores
        # only once its drafter took the assignment (TrackedSession.exploring), and sessions that
        # opened together each found the drafter unexplored meanwhile (ten of a wave of sixteen
        # explored one, their proposals in every pass of the sixteen: docs/performance.md,
        # session 32).
        self._explorations_under_way: set[tuple[str, str]] = set()

    async def assign_drafter(
        self, tracked: TrackedSession, *, avoid: Sequence[str] = (), only_if_missing: bool = False
    ) -> None:
        """Decide who drafts for the session next, by expected rate (``choose_decoding``), and tell
        them: a drafter that does not answer is skipped; a verifier that does not decode alone at
        this router's request gets a drafter instead."""
        current = tracked.plan.drafter
        if only_if_missing and (
            tracked.self_decoding or (current is not None and self._registry.is_live(current, self._clock()))
        ):
            return
        if tracked.plan.self_decode_only:
            # The front end asked for no speculation (docs/interpretations.md, "Per-request
            # speculation"): the verifier decodes alone, period after period, whatever it costs.
            await self.send_self_decode(tracked)
            return
        unreachable: list[str] = []
        self_decode = True
        while True:
            choice = self.choose(tracked, avoid=avoid, skip=unreachable, self_decode=self_decode)
            if choice is None:
                tracked.unserved()
                log.info("%s: session %s waits for a drafter", self.uri, tracked.plan.session.hex())
                return
            if choice.drafter is None:
                try:
                    await self.send_self_decode(tracked)
                    return
                except ProtocolError as exc:
                    if exc.problem in (ProblemType.SESSION_CLOSED, ProblemType.STALE_EPOCH, ProblemType.STALE_BASE):
                        raise
                    log.info("%s: verifier %s does not decode alone: %s", self.uri, tracked.plan.verifier, exc)
                except Unanswered as exc:
                    log.info("%s: verifier %s does not decode alone: %s", self.uri, tracked.plan.verifier, exc)
                self_decode = False
                continue
            exploration = (choice.drafter, tracked.session_class)
            if choice.exploring:
                self._explorations_under_way.add(exploration)
            try:
                await self.send_assignment(tracked, choice.drafter, exploring=choice.exploring)
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
            finally:
                if choice.exploring:
                    self._explorations_under_way.discard(exploration)
            self._metrics.chose("explore" if choice.exploring else "drafter")
            return

    def choose(
        self, tracked: TrackedSession, *, avoid: Sequence[str] = (), skip: Sequence[str] = (), self_decode: bool = True
    ) -> DecodingChoice | None:
        """The expected fastest option for the session among live permitted drafters (those in
        ``avoid`` only when no other is live) and, where permitted, its verifier alone."""
        klass = tracked.session_class

        def may_explore(uri: str) -> bool:
            # Exploration is bounded: one session of a class at a time per drafter unmeasured on
            # that class, and it ends with the drafter's first acceptance report for it
            # (measured_acceptance: our alpha_milli or alpha_constrained_milli, or SDCP 5.2
            # accept_milli from a drafter without our cost terms). Asked only about unmeasured
            # drafters, so that maintenance of measured ones scans no sessions.
            return (uri, klass) not in self._explorations_under_way and not any(
                other.exploring == uri and other is not tracked and not other.ended and other.session_class == klass
                for other in self._sessions.values()
            )

        return choose_for_session(
            tracked.plan.contract,
            klass,
            [view for view in self._registry.live(Role.DRAFTER, self._clock()) if view.uri not in skip],
            self._registry.get(tracked.plan.verifier),
            m_init=self._settings().m_init,
            avoid=avoid,
            self_decode=self_decode,
            may_explore=may_explore,
        )

    def worth_moving(self, tracked: TrackedSession, now: float) -> bool:
        """Whether a session's drafter should give way: its exploration has been measured, or
        another option is now expected to be ``SWITCH_MARGIN`` times faster."""
        drafter = tracked.plan.drafter
        view = self._registry.get(drafter) if drafter is not None else None
        if view is None or now - tracked.decided_at < REDECIDE_AFTER_S:
            return False
        costs = drafter_costs(view, tracked.session_class)
        if costs.alpha is None:
            return False  # its measurement is on the way (alpha_milli or accept_milli: measured_acceptance)
        best = self.choose(tracked)
        if best is None or best.drafter == drafter:
            tracked.exploring = None
            return False
        if tracked.exploring == drafter:
            return True
        verifier = self._registry.get(tracked.plan.verifier)
        return outpaced(costs, best, verifier, contract=tracked.plan.contract, m_init=self._settings().m_init)

    async def send_self_decode(self, tracked: TrackedSession) -> None:
        """Ask the verifier to decode the session alone (extension, docs/interpretations.md)."""
        plan = tracked.plan
        await self._link.self_decode(plan.verifier, SelfDecodeRequest(session=plan.session, epoch=plan.epoch))
        self.decoding_alone(tracked)

    def alone_from_open(self, tracked: TrackedSession) -> bool:
        """Whether the session, about to open, is to be decoded by its verifier alone, as
        ``assign_drafter`` would decide once it is open: the open then asks for it
        (docs/interpretations.md, "Self-decoding from the open")."""
        if tracked.plan.self_decode_only:
            return True
        choice = self.choose(tracked)
        return choice is not None and choice.drafter is None

    def decoding_alone(self, tracked: TrackedSession) -> None:
        """The verifier took the session's self-decode request (with its open, or after)."""
        plan = tracked.plan
        tracked.decoding_alone(now=self._clock())
        self._metrics.chose("self")
        log.info("%s: session %s decoded by verifier %s alone", self.uri, plan.session.hex(), plan.verifier)

    async def after_switch(self, tracked: TrackedSession, *, avoid: Sequence[str]) -> None:
        if tracked.advance(RouterEvent.SWITCHED) is RouterPhase.MOVING:
            return  # the verifier's event came before its failover finished: the move assigns
        await self.assign_drafter(tracked, avoid=avoid)

    async def send_assignment(self, tracked: TrackedSession, drafter: str, *, exploring: bool) -> None:
        """SDCP 6.1: inform the verifier first, then send the assignment to the drafter."""
        plan = tracked.plan
        replay, tokens = await self._logs.committed_prefix(tracked)
        read_at = replay.round
        try:
            state = await self._link.inform_verifier(plan.verifier, self._assignment(tracked, drafter, replay, tokens))
        except Unanswered as exc:
            # A verifier cut off mid-assignment is silent to each drafter tried in turn, and the
            # session's lock, which its failover waits for, is held all that while.
            raise VerifierUnanswered(f"verifier {plan.verifier}: {exc}") from exc
        plan.drafter = drafter
        if state.round != read_at:
            # The previous drafter's last round (or a self-decoded one) committed after the log was
            # read; it is in the log now, since the verifier appends before it answers (SDCP 6.3).
            replay, tokens = await self._logs.committed_prefix(tracked)
            read_at = replay.round
        await self._link.assign(drafter, self._assignment(tracked, drafter, replay, tokens))
        tracked.assigned(drafter, exploring=exploring, now=self._clock())
        self._metrics.assigned(drafter)
        log.info("%s: session %s assigned to %s at round %d", self.uri, tracked.plan.session.hex(), drafter, read_at)

    def _assignment(self, tracked: TrackedSession, drafter: str, replay: LogReplay, tokens: str) -> Assignment:
        return tracked.plan.assignment(
            drafter,
            round=replay.round,
            committed=len(replay.tokens),
            digest=replay.digest,
            m_init=self._settings().m_init,
            committed_tokens=tokens,
        )

    async def send_policy(self, tracked: TrackedSession, policy: Policy) -> SessionState:
        state = await self._link.policy(tracked.plan.verifier, policy)
        # SDCP 6.6: later assignments carry the profile; the contract stays as created.
        tracked.plan.sampling = policy.sampling
        return state
