"""A session's life at its router (SDCP 6.1 assignment, 6.5.2 events, 6.9 failover), as a state
table: which phase each router event leads to from each phase.

The router engine (``sdcp.engines.router``) moves a session only through ``next_phase``, so that a
phase and the facts that go with it (who drafts, which verifier a fence named) always agree.
python-hyper/h2 keeps its stream states this way; tests/protocol/test_router_life.py walks every
(phase, event) pair.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["IllegalTransition", "RouterEvent", "RouterPhase", "TRANSITIONS", "next_phase"]


class RouterPhase(Enum):
    # Open at its verifier, which waits for a drafter (none assigned yet, none live or permitted,
    # or the verifier asked for another).
    WAITING = "waiting"
    # A drafter proposes for the session (SDCP 6.1).
    DRAFTING = "drafting"
    # The verifier decodes alone at the router's request, or in a period of its own ladder, until
    # its switch event (extension, docs/interpretations.md).
    SELF_DECODING = "self-decoding"
    # Failing over (SDCP 6.9): a fence naming the next verifier is in the log, and the session is not
    # open there yet; nothing is assigned until it is.
    MOVING = "moving"
    # Finished, failed or cancelled: nothing is assigned again.
    ENDED = "ended"


class RouterEvent(Enum):
    # A drafter took an assignment (after the verifier was told, SDCP 6.1).
    ASSIGNED = "assigned"
    # The verifier decodes alone: it took the router's request, or refused an assignment during a
    # period of its own.
    SELF_DECODING = "self-decoding"
    # No option is live or permitted: the session waits for a drafter.
    UNSERVED = "unserved"
    # The verifier's switch event (SDCP 6.5.2): another drafter, or the end of a self-decoding period.
    SWITCHED = "switched"
    # A fence naming the next verifier is in the log (SDCP 6.9).
    FENCED = "fenced"
    # The session is open at the verifier the fence named.
    REOPENED = "reopened"
    # Finish or fail (SDCP 6.5.2), a cancel, or a verifier that has closed the session.
    ENDED = "ended"


class IllegalTransition(Exception):
    """An event that cannot happen in the session's phase: a fault of the router, never of a peer."""


_LIVE_SERVED = (RouterPhase.WAITING, RouterPhase.DRAFTING, RouterPhase.SELF_DECODING)

TRANSITIONS: dict[tuple[RouterPhase, RouterEvent], RouterPhase] = {
    **{(phase, RouterEvent.ASSIGNED): RouterPhase.DRAFTING for phase in _LIVE_SERVED},
    **{(phase, RouterEvent.SELF_DECODING): RouterPhase.SELF_DECODING for phase in _LIVE_SERVED},
    **{(phase, RouterEvent.UNSERVED): RouterPhase.WAITING for phase in _LIVE_SERVED},
    (RouterPhase.WAITING, RouterEvent.SWITCHED): RouterPhase.WAITING,
    # The drafter serves until another takes the session.
    (RouterPhase.DRAFTING, RouterEvent.SWITCHED): RouterPhase.DRAFTING,
    (RouterPhase.SELF_DECODING, RouterEvent.SWITCHED): RouterPhase.WAITING,
    # An event of the verifier the session is leaving: the move comes first.
    (RouterPhase.MOVING, RouterEvent.SWITCHED): RouterPhase.MOVING,
    **{(phase, RouterEvent.FENCED): RouterPhase.MOVING for phase in (*_LIVE_SERVED, RouterPhase.MOVING)},
    (RouterPhase.MOVING, RouterEvent.REOPENED): RouterPhase.WAITING,
    **{(phase, RouterEvent.ENDED): RouterPhase.ENDED for phase in RouterPhase},
    # An answer to a change under way when the session ended changes nothing.
    **{(RouterPhase.ENDED, event): RouterPhase.ENDED for event in RouterEvent},
}


def next_phase(phase: RouterPhase, event: RouterEvent) -> RouterPhase:
    """The phase ``event`` leads to from ``phase``; IllegalTransition where it cannot happen."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalTransition(f"{event.value} cannot happen to a session that is {phase.value}") from None
