"""A router session's life (sdcp.protocol.router_life): every (phase, event) pair, as
python-hyper/h2 tests its stream states."""

from __future__ import annotations

import pytest

from sdcp.protocol.router_life import TRANSITIONS, IllegalTransition, RouterEvent, RouterPhase, next_phase

W, D, S, M, E = (
    RouterPhase.WAITING,
    RouterPhase.DRAFTING,
    RouterPhase.SELF_DECODING,
    RouterPhase.MOVING,
    RouterPhase.ENDED,
)
X = None  # cannot happen: the router never sends it there

# Rows: the phase a session is in; columns: the event; cells: the phase it leads to.
EVENTS = (
    RouterEvent.ASSIGNED,
    RouterEvent.SELF_DECODING,
    RouterEvent.UNSERVED,
    RouterEvent.SWITCHED,
    RouterEvent.FENCED,
    RouterEvent.REOPENED,
    RouterEvent.ENDED,
)
EXPECTED: dict[RouterPhase, tuple[RouterPhase | None, ...]] = {
    #     ASSIGNED SELF  UNSERVED SWITCHED FENCED REOPENED ENDED
    W: (D, S, W, W, M, X, E),
    D: (D, S, W, D, M, X, E),
    S: (D, S, W, W, M, X, E),
    # Nothing is assigned while a fence names a verifier the session is not open at yet.
    M: (X, X, X, M, M, W, E),
    # An answer to a change under way when the session ended changes nothing.
    E: (E, E, E, E, E, E, E),
}


@pytest.mark.parametrize("phase", list(RouterPhase), ids=lambda p: p.value)
@pytest.mark.parametrize("event", list(RouterEvent), ids=lambda e: e.value)
def test_every_phase_and_event(phase: RouterPhase, event: RouterEvent) -> None:
    expected = EXPECTED[phase][EVENTS.index(event)]
    if expected is None:
        with pytest.raises(IllegalTransition, match=f"{event.value} cannot happen to a session that is {phase.value}"):
            next_phase(phase, event)
    else:
        assert next_phase(phase, event) is expected


def test_the_table_holds_only_the_pairs_that_can_happen() -> None:
    assert set(EVENTS) == set(RouterEvent) and set(EXPECTED) == set(RouterPhase)
    possible = {(p, e) for p, row in EXPECTED.items() for e, to in zip(EVENTS, row, strict=True) if to is not None}
    assert set(TRANSITIONS) == possible
