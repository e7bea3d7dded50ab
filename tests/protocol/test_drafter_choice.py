"""The router's choice of drafter by expected rate (SDCP 6.1 local policy, 6.2 cost model), with
fake timings: what a drafter reports is all the router goes by."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sdcp.protocol.drafter import CONSTRAINED, PLAIN, expected_rate, expected_tokens, session_class
from sdcp.protocol.messages import Constraint, PassCost, Role, Status
from sdcp.protocol.passcost import FIRST_CURVE_MS, PASS_ROWS
from sdcp.protocol.router import (
    DecodingChoice,
    DrafterCosts,
    InstanceRegistry,
    InstanceView,
    VerifierPasses,
    choose_decoding,
    drafter_costs,
    drafter_rate,
    measured_acceptance,
    verifier_passes,
)

SELF_S = 0.050  # the verifier decodes alone at 20 tokens/s
VERIFY_S = 0.060


def choose(drafters: list[DrafterCosts], self_decode_s: float | None = SELF_S, **kwargs: object):
    return choose_decoding(drafters, self_decode_s=self_decode_s, verify_s=VERIFY_S, m_limit=16, **kwargs)


def test_expected_rate_is_the_cost_models_best_m_and_its_rate() -> None:
    m, rate = expected_rate(0.8, 0.002, 0.05, 16)
    assert rate == pytest.approx(expected_tokens(0.8, m) / (m * 0.002 + 0.05))
    assert all(expected_tokens(0.8, k) / (k * 0.002 + 0.05) <= rate for k in range(1, 17))


def test_a_drafter_slower_than_self_decoding_is_never_assigned() -> None:
    # A drafter as costly per token as the target itself: even perfect acceptance loses to the
    # verifier decoding alone, once verification time is added.
    twin = DrafterCosts("https://twin", alpha=0.99, draft_s=0.050, verify_s=0.065)
    choice = choose([twin])
    assert choice is not None
    assert choice.drafter is None
    assert choice.rate == pytest.approx(1 / SELF_S)


def test_an_unmeasured_drafter_that_cannot_pay_even_at_full_acceptance_is_not_explored() -> None:
    twin = DrafterCosts("https://twin", alpha=None, draft_s=0.050, verify_s=0.065)
    choice = choose([twin])
    assert choice is not None and choice.drafter is None


def test_of_two_drafters_with_equal_acceptance_the_faster_is_picked() -> None:
    slow = DrafterCosts("https://a-slow", alpha=0.7, draft_s=0.010)
    fast = DrafterCosts("https://b-fast", alpha=0.7, draft_s=0.001)
    for order in ([slow, fast], [fast, slow]):
        choice = choose(order)
        assert choice is not None
        assert choice.drafter == "https://b-fast"
        assert choice.rate > drafter_rate(slow, verify_s=VERIFY_S, m_limit=16)
        assert not choice.exploring


def test_acceptance_can_outweigh_drafting_time() -> None:
    cheap_but_wrong = DrafterCosts("https://ngram", alpha=0.05, draft_s=0.00001)
    costly_but_right = DrafterCosts("https://model", alpha=0.9, draft_s=0.004)
    choice = choose([cheap_but_wrong, costly_but_right])
    assert choice is not None and choice.drafter == "https://model"


def test_a_busy_drafter_counts_its_queue() -> None:
    idle = DrafterCosts("https://b", alpha=0.8, draft_s=0.004, queue=0)
    busy = DrafterCosts("https://a", alpha=0.8, draft_s=0.004, queue=6)
    choice = choose([busy, idle])
    assert choice is not None and choice.drafter == "https://b"


def test_equal_rates_go_to_the_smaller_uri() -> None:
    left = DrafterCosts("https://a", alpha=0.5, draft_s=0.001)
    right = DrafterCosts("https://b", alpha=0.5, draft_s=0.001)
    assert choose([right, left]).drafter == "https://a"  # type: ignore[union-attr]


def test_an_unmeasured_drafter_that_could_pay_is_explored_within_its_bound() -> None:
    measured = DrafterCosts("https://ngram", alpha=0.1, draft_s=0.00001)
    new = DrafterCosts("https://new", alpha=None, draft_s=0.002)
    explored = choose([measured, new])
    assert explored is not None and explored.drafter == "https://new" and explored.exploring
    # Once the bound on exploring sessions is reached, the best measured option serves.
    settled = choose([measured, new], may_explore=lambda uri: False)
    assert settled is not None and not settled.exploring
    assert settled.drafter in (None, "https://ngram")


def test_without_self_decoding_a_drafter_always_serves() -> None:
    twin = DrafterCosts("https://twin", alpha=0.99, draft_s=0.050)
    choice = choose([twin], self_decode_s=None)
    assert choice is not None and choice.drafter == "https://twin"
    unmeasured = DrafterCosts("https://twin", alpha=None, draft_s=0.050)
    fallback = choose([unmeasured], self_decode_s=None, may_explore=lambda uri: False)
    assert fallback is not None and fallback.drafter == "https://twin"


def test_nothing_to_choose() -> None:
    assert choose([], self_decode_s=None) is None
    only_self = choose([])
    assert only_self is not None and only_self.drafter is None


def test_costs_come_from_the_status_extension_members() -> None:
    status = Status(
        instance="https://d",
        role=Role.DRAFTER,
        load=10,
        queue=2,
        ttl_ms=3000,
        alpha_milli=750,
        draft_us=1500,
        verify_us=40000,
    )
    costs = drafter_costs(InstanceView(status, expires_at=10.0))
    assert costs == DrafterCosts("https://d", alpha=0.75, draft_s=0.0015, verify_s=0.04, queue=2, load=10)
    plain = Status(instance="https://e", role=Role.DRAFTER, load=0, queue=0, ttl_ms=3000)
    assert drafter_costs(InstanceView(plain, expires_at=10.0)) == DrafterCosts("https://e", None, None)


def test_status_round_trips_the_cost_members() -> None:
    status = Status(instance="https://v", role=Role.VERIFIER, load=0, queue=0, ttl_ms=3000, self_us=21000)
    assert Status.from_obj(status.to_obj()) == status


def test_zero_times_reported_by_a_peer_do_not_break_the_choice() -> None:
    instant = DrafterCosts("https://instant", alpha=0.5, draft_s=0.0, verify_s=0.0)
    choice = choose([instant], self_decode_s=0.0)
    assert choice is not None and choice.drafter == "https://instant"


# -- drafters that report only the status members of SDCP 5.2 ---------------------------------------


def drafted_status(uri: str, accept_milli: int | None, load: int = 0, queue: int = 0) -> Status:
    """A drafter written from the draft alone: no alpha_milli, draft_us or verify_us."""
    return Status(instance=uri, role=Role.DRAFTER, load=load, queue=queue, accept_milli=accept_milli, ttl_ms=3000)


def registered(*statuses: Status) -> InstanceRegistry:
    registry = InstanceRegistry()
    for status in statuses:
        registry.report(status, now=0.0)
    return registry


def test_a_drafter_without_our_cost_terms_is_measured_by_accept_milli() -> None:
    registry = registered(drafted_status("https://vendor", accept_milli=400, load=30, queue=1))
    view = registry.get("https://vendor")
    assert view is not None and measured_acceptance(view) == pytest.approx(0.4)
    assert drafter_costs(view) == DrafterCosts("https://vendor", alpha=0.4, draft_s=None, queue=1, load=30)


def test_one_of_ours_is_measured_by_alpha_milli_only() -> None:
    # Our drafter reports the a/M of its open sessions from the first verdict, but its
    # per-token alpha only after MEASURED_AFTER_VERDICTS: until then it is unmeasured.
    ours = Status(instance="https://ours", role=Role.DRAFTER, load=0, queue=0, ttl_ms=3000, accept_milli=900)
    assert measured_acceptance(InstanceView(replace(ours, draft_us=800), 10.0)) is None
    assert measured_acceptance(InstanceView(replace(ours, verify_us=9000), 10.0)) is None
    measured = replace(ours, draft_us=800, alpha_milli=950)
    assert measured_acceptance(InstanceView(measured, 10.0)) == pytest.approx(0.95)


def test_a_drafter_is_measured_per_class_of_session() -> None:
    # #30: alpha_milli covers sessions without a constraint, alpha_constrained_milli constrained
    # ones; one of ours measured on a class only is unmeasured (explored) on the other.
    ours = Status(instance="https://ours", role=Role.DRAFTER, load=0, queue=0, ttl_ms=3000, draft_us=10)
    plain_only = InstanceView(replace(ours, alpha_milli=50), 10.0)
    assert measured_acceptance(plain_only) == pytest.approx(0.05)
    assert measured_acceptance(plain_only, CONSTRAINED) is None
    both = InstanceView(replace(ours, alpha_milli=50, alpha_constrained_milli=950), 10.0)
    assert measured_acceptance(both, PLAIN) == pytest.approx(0.05)
    assert drafter_costs(both, CONSTRAINED).alpha == pytest.approx(0.95)
    constrained_only = InstanceView(replace(ours, draft_us=None, alpha_constrained_milli=950), 10.0)
    assert measured_acceptance(constrained_only) is None
    # So the same drafter loses to the verifier alone on one class and beats it on the other.
    assert choose([drafter_costs(both, PLAIN)]) == DecodingChoice(None, 1 / SELF_S)
    assert choose([drafter_costs(both, CONSTRAINED)]).drafter == "https://ours"  # type: ignore[union-attr]
    # A drafter without our members has one measurement, the SDCP 5.2 accept_milli, for both.
    status = Status(instance="https://v", role=Role.DRAFTER, load=0, queue=0, ttl_ms=3000)
    vendor = InstanceView(status, 10.0, accept_milli=400)
    assert measured_acceptance(vendor, PLAIN) == measured_acceptance(vendor, CONSTRAINED) == pytest.approx(0.4)
    assert session_class(None) == PLAIN and session_class(Constraint(kind="regex", text="a+")) == CONSTRAINED


def test_the_last_reported_accept_milli_is_kept_while_reports_omit_it() -> None:
    # An idle drafter may leave the optional member out (as ours does with no session open): what it
    # measured before stays its measurement, so it is not explored again.
    registry = registered(
        drafted_status("https://vendor", accept_milli=None),
        drafted_status("https://vendor", accept_milli=400),
        drafted_status("https://vendor", accept_milli=None),
    )
    view = registry.get("https://vendor")
    assert view is not None and view.status.accept_milli is None
    assert measured_acceptance(view) == pytest.approx(0.4)
    registry.report(drafted_status("https://vendor", accept_milli=350), now=0.0)
    assert measured_acceptance(registry.get("https://vendor")) == pytest.approx(0.35)  # type: ignore[arg-type]
    # An instance whose status expired starts again unmeasured.
    registry.expire(now=10.0)
    registry.report(drafted_status("https://vendor", accept_milli=None), now=10.0)
    assert measured_acceptance(registry.get("https://vendor")) is None  # type: ignore[arg-type]


def test_a_drafter_without_our_cost_terms_stops_being_explored_once_it_reports_acceptance() -> None:
    ours = DrafterCosts("https://ours", alpha=0.8, draft_s=0.001)
    unmeasured = drafter_costs(InstanceView(drafted_status("https://vendor", accept_milli=None), 10.0))
    explored = choose([ours, unmeasured])
    assert explored is not None and explored.drafter == "https://vendor" and explored.exploring
    # At 40 % it is ranked by its rate, below ours: no longer every session's first assignment.
    low = drafter_costs(InstanceView(drafted_status("https://vendor", accept_milli=400), 10.0))
    choice = choose([ours, low])
    assert choice is not None and choice.drafter == "https://ours" and not choice.exploring
    assert choice.rate > drafter_rate(low, verify_s=VERIFY_S, m_limit=16)
    # At 95 % (and no reported drafting time) it is expected to beat ours, and is chosen, measured.
    high = drafter_costs(InstanceView(drafted_status("https://vendor", accept_milli=950), 10.0))
    preferred = choose([ours, high])
    assert preferred is not None and preferred.drafter == "https://vendor" and not preferred.exploring


def test_equal_rates_go_to_the_shorter_queue_then_the_lower_load() -> None:
    # Drafters that report no drafting time have equal rates at equal acceptance: queue and load
    # rank them (SDCP 6.1), then the URI.
    busy = drafter_costs(InstanceView(drafted_status("https://a", accept_milli=400, load=90), 10.0))
    idle = drafter_costs(InstanceView(drafted_status("https://b", accept_milli=400, load=10), 10.0))
    queued = drafter_costs(InstanceView(drafted_status("https://c", accept_milli=400, load=0, queue=2), 10.0))
    for order in ([busy, idle, queued], [queued, idle, busy]):
        choice = choose(order)
        assert choice is not None and choice.drafter == "https://b"


def _verifier(sessions: int, curve: list[float] | None = None, *, apart: bool | None = None) -> InstanceView:
    points = curve if curve is not None else list(FIRST_CURVE_MS)
    status = Status(
        instance="https://verifier",
        role=Role.VERIFIER,
        load=0,
        queue=0,
        ttl_ms=3000,
        self_us=50_000,
        pass_us=tuple(PassCost(rows=rows, us=round(1000 * ms)) for rows, ms in zip(PASS_ROWS, points, strict=True)),
        pass_sessions=sessions,
        pass_apart=apart,
    )
    return InstanceView(status, expires_at=10.0)


def test_with_the_verifiers_pass_costs_a_drafter_is_chosen_where_its_rows_pay() -> None:
    # A drafter whose verdicts come back fast (measured while few sessions shared the passes) looks
    # faster than decoding alone by its round trips; the verifier's pass costs say that at 16
    # sessions its rows cost more than they save, and that for a lone session they pay.
    ngram = DrafterCosts("https://ngram", alpha=0.8, draft_s=0.0001, verify_s=0.015)
    assert choose([ngram]).drafter == ngram.uri  # type: ignore[union-attr]
    crowded = verifier_passes(_verifier(16))
    assert crowded is not None and crowded.sessions == 16
    assert choose([ngram], passes=crowded).drafter is None  # type: ignore[union-attr]
    copying = replace(ngram, alpha=0.97)
    assert choose([copying], passes=verifier_passes(_verifier(1))).drafter == copying.uri  # type: ignore[union-attr]
    # Where the verifier may not decode alone, a drafter serves whatever the costs.
    assert choose([ngram], self_decode_s=None, passes=crowded).drafter == ngram.uri  # type: ignore[union-attr]


def test_a_verifier_that_runs_rows_apart_gets_a_drafter_only_where_they_pay_as_a_pass() -> None:
    # At 4 sessions a drafter accepted 95 % of the time beats decoding alone where its rows share
    # the pass; where the verifier reports pass_apart (llama.cpp), they cost a pass of their own.
    copying = DrafterCosts("https://copying", alpha=0.95, draft_s=0.0001, verify_s=0.015)
    shared = verifier_passes(_verifier(4))
    apart = verifier_passes(_verifier(4, apart=True))
    assert shared is not None and not shared.apart and apart is not None and apart.apart
    assert choose([copying], passes=shared).drafter == copying.uri  # type: ignore[union-attr]
    assert choose([copying], passes=apart).drafter is None  # type: ignore[union-attr]


def test_pass_costs_that_are_not_a_curve_are_not_used() -> None:
    unordered = _verifier(4)
    points = unordered.status.pass_us
    assert points is not None
    shuffled = replace(unordered.status, pass_us=(points[1], points[0], *points[2:]))
    assert verifier_passes(InstanceView(shuffled, expires_at=10.0)) is None
    assert verifier_passes(InstanceView(replace(unordered.status, pass_sessions=None), expires_at=10.0)) is None
    assert verifier_passes(None) is None


def test_pass_costs_of_no_cost_or_falling_with_rows_are_read_safely() -> None:
    # Another implementation's points: none of no cost, the first at one row; a cost that falls
    # as rows grow is read as the highest before it, so that no rate divides by zero or goes below.
    base = _verifier(40)

    def reported(points: list[tuple[int, int]], sessions: int = 40) -> VerifierPasses | None:
        status = replace(
            base.status, pass_us=tuple(PassCost(rows=r, us=us) for r, us in points), pass_sessions=sessions
        )
        return verifier_passes(InstanceView(status, expires_at=10.0))

    assert reported([(1, 0), (2, 0)]) is None
    assert reported([(1, 0), (2, 5000)]) is None
    assert reported([(4, 10000), (8, 30000)]) is None
    falling = reported([(1, 20000), (2, 25000), (32, 4000)])
    assert falling is not None and falling.curve.points_ms == [20.0, 25.0, 25.0]
    ngram = DrafterCosts("https://ngram", alpha=0.8, draft_s=0.0001, verify_s=0.015)
    choice = choose([ngram], passes=falling)
    assert choice is not None and choice.drafter is None and choice.rate > 0
