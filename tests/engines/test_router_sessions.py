"""A router session as the router holds it (sdcp.engines.router.sessions): the facts it keeps with
its phase, each change through the life table (sdcp.protocol.router_life)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tests.protocol.router_contracts import contract

from sdcp.engines.router.sessions import SELF_DECODING, TrackedSession
from sdcp.protocol.router import RouterSession
from sdcp.protocol.router_life import IllegalTransition, RouterPhase


def _tracked() -> TrackedSession:
    plan = RouterSession(
        session=bytes(16),
        epoch=1,
        contract=contract(),
        prompt=(1, 2, 3),
        commit_log="mlc://life.test/-/log/00",
        verifier="https://v1.test",
    )
    return TrackedSession(plan, (1, 2, 3))


def test_a_session_keeps_its_facts_with_its_phase() -> None:
    tracked = _tracked()
    assert tracked.phase is RouterPhase.WAITING and tracked.first_verifier == "https://v1.test"
    tracked.assigned("https://d1.test", exploring=True, now=5.0)
    assert (tracked.phase, tracked.plan.drafter, tracked.exploring, tracked.decided_at) == (
        RouterPhase.DRAFTING,
        "https://d1.test",
        "https://d1.test",
        5.0,
    )
    tracked.decoding_alone(now=6.0)
    assert (tracked.phase, tracked.plan.drafter, tracked.exploring) == (RouterPhase.SELF_DECODING, None, None)
    assert tracked.served == ["https://d1.test", SELF_DECODING]
    tracked.fenced("https://v2.test")
    assert tracked.moving and tracked.failover_to == "https://v2.test"
    with pytest.raises(IllegalTransition):
        tracked.assigned("https://d2.test", exploring=False, now=7.0)
    assert tracked.plan.drafter is None  # a refused event changes no fact
    moved = replace(tracked.plan, verifier="https://v2.test", epoch=2)
    tracked.reopened(moved)
    assert (tracked.phase, tracked.plan.verifier, tracked.failover_to) == (RouterPhase.WAITING, "https://v2.test", None)
    tracked.assigned("https://d2.test", exploring=False, now=8.0)
    assert tracked.end() and tracked.ended and tracked.plan.drafter is None
    assert not tracked.end()
    tracked.assigned("https://d3.test", exploring=False, now=9.0)  # a late answer
    assert tracked.ended and tracked.plan.drafter is None and tracked.served[-1] == "https://d2.test"
