"""Pass costs and what speculation is worth against them (sdcp.protocol.passcost)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcp.protocol.passcost import (
    FIRST_CURVE_MS,
    PassCurve,
    drafted_rate,
    self_decoded_rate,
    speculation_length,
)

# A GPU's: a row costs almost nothing against the pass's weights.
FLAT = PassCurve([10.0, 10.1, 10.2, 10.4, 10.8, 11.6])


def test_a_curve_needs_ascending_rows_one_cost_each() -> None:
    with pytest.raises(ValueError, match="ascending"):
        PassCurve([1.0, 2.0], (2, 1))
    with pytest.raises(ValueError, match="ascending"):
        PassCurve([1.0, 2.0, 3.0], (1, 2))
    with pytest.raises(ValueError, match="at least one row"):
        PassCurve([1.0, 2.0], (0, 2))
    curve = PassCurve([4.0, 6.0, 14.0], (1, 3, 7))
    assert curve.ms(2) == 5.0 and curve.ms(5) == 10.0 and curve.ms(9) == 18.0


def test_each_session_adds_at_most_its_share_of_the_largest_measured_pass() -> None:
    curve = PassCurve()
    assert [curve.rows_share(sessions) for sessions in (1, 4, 16, 32, 40)] == [31, 7, 1, 0, 0]


def test_on_a_cpu_a_drafter_pays_for_a_lone_session_only_and_on_a_gpu_at_a_low_acceptance() -> None:
    cpu = PassCurve(list(FIRST_CURVE_MS))
    assert drafted_rate(0.95, 1, 16, cpu) > self_decoded_rate(1, cpu)
    assert drafted_rate(0.8, 16, 16, cpu) < self_decoded_rate(16, cpu)
    assert drafted_rate(0.4, 1, 16, cpu) < self_decoded_rate(1, cpu)
    assert drafted_rate(0.3, 1, 16, FLAT) > self_decoded_rate(1, FLAT)
    # Drafting time counts against it.
    assert drafted_rate(0.3, 1, 16, FLAT, draft_ms=10.0) < self_decoded_rate(1, FLAT)


@pytest.mark.parametrize("apart", [False, True], ids=["rows-shared", "rows-apart"])
@pytest.mark.parametrize("curve", [PassCurve(list(FIRST_CURVE_MS)), FLAT], ids=["cpu", "flat"])
@pytest.mark.parametrize("sessions", [1, 2, 4, 8, 16, 17, 32, 40])
def test_the_router_drafts_where_the_verifier_would_score_a_proposal(
    curve: PassCurve, sessions: int, apart: bool
) -> None:
    # One judgement on both sides: a drafter is faster than decoding alone exactly where the
    # verifier finds a proposal of one token or more worth scoring; past half the largest measured
    # pass neither speculates.
    for acceptance in (0.1, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99):
        worth = speculation_length(acceptance, sessions, 16, curve, apart=apart)
        drafted = drafted_rate(acceptance, sessions, 16, curve, apart=apart)
        assert (drafted > self_decoded_rate(sessions, curve)) == (worth > 0)
    if sessions > 16:
        assert drafted_rate(1.0, sessions, 16, curve) == 0.0


def test_rows_run_apart_cost_a_pass_of_their_own_where_sessions_share_it() -> None:
    """llama.cpp with a cache per sequence runs a session's rows after its first as a ubatch of
    their own (Target.extra_rows_apart, Status pass_apart): at 4 sessions a drafter accepted 95 %
    of the time beats decoding alone where rows share the pass, and not where they run apart; a
    lone session's rows share its pass either way."""
    cpu = PassCurve(list(FIRST_CURVE_MS))
    assert drafted_rate(0.95, 4, 16, cpu) > self_decoded_rate(4, cpu) > drafted_rate(0.95, 4, 16, cpu, apart=True)
    assert drafted_rate(0.9, 1, 16, cpu, apart=True) == drafted_rate(0.9, 1, 16, cpu)


def _length_walking_every_length(acceptance: float, sessions: int, most: int, curve: PassCurve, apart: bool) -> int:
    """speculation_length as its docstring says it, each length up to the limit compared."""
    sessions = max(1, sessions)
    share_ms = curve.ms(sessions) / sessions
    gains = [0.0]
    for length in range(1, min(most, curve.rows_share(sessions)) + 1):
        saved = sum(acceptance**j * share_ms for j in range(1, length + 1))
        extra = curve.ms(length) if apart and sessions > 1 else curve.ms(sessions + length) - curve.ms(sessions)
        gains.append(saved - extra)
    best = max(gains)
    return 0 if best <= 0 else gains.index(best)


@settings(max_examples=300, deadline=None)
@given(
    acceptance=st.floats(0, 1),
    sessions=st.integers(1, 20),
    most=st.integers(0, 40),
    steps=st.lists(st.floats(-3, 40), min_size=6, max_size=6),
    apart=st.booleans(),
)
def test_the_length_that_stops_early_is_the_one_every_length_compared_gives(
    acceptance: float, sessions: int, most: int, steps: list[float], apart: bool
) -> None:
    # Curves that rise and, by noise, fall: the walk stops early only on those that never fall.
    points, cost = [], 0.5
    for step in steps:
        cost = max(0.1, cost + step)
        points.append(cost)
    curve = PassCurve(points)
    expected = _length_walking_every_length(acceptance, sessions, most, curve, apart)
    assert speculation_length(acceptance, sessions, most, curve, apart=apart) == expected
