"""Drafter session state and choice of M (SDCP 6.2, 6.3, 6.9)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.drafter import AcceptanceEstimate, DrafterSession, ProposalNotAllowed, choose_m, expected_tokens
from sdcp.protocol.messages import Action, Assignment, Contract, Role, Sampling, SessionState, Status, Verdict
from sdcp.protocol.problems import BadContract, BadMessage, ProblemType, ProtocolError

SESSION = bytes(range(16))
DRAFTER = "https://drafter-1.example"
VERIFIER = "https://verifier-1.example"
STATUS = Status(instance=DRAFTER, role=Role.DRAFTER, load=20, queue=0, ttl_ms=5000)


def brute_force_m(alpha: float, t_d: float, t_v: float, m_limit: int) -> list[float]:
    """Rates of every M by the draft's own closed form, index 0 standing for M = 1."""
    rates = []
    for m in range(1, m_limit + 1):
        tokens = m + 1 if alpha == 1 else (1 - alpha ** (m + 1)) / (1 - alpha)
        rates.append(tokens / (m * t_d + t_v))
    return rates


@pytest.mark.parametrize(
    ("alpha", "t_d", "t_v", "m_limit"),
    list(itertools.product([0.0, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0], [0.05, 1.0, 4.0], [1.0, 20.0], [1, 8, 64])),
)
def test_choose_m_agrees_with_brute_force(alpha: float, t_d: float, t_v: float, m_limit: int) -> None:
    rates = brute_force_m(alpha, t_d, t_v, m_limit)
    chosen = choose_m(alpha, t_d, t_v, m_limit)
    assert 1 <= chosen <= m_limit
    assert rates[chosen - 1] >= max(rates) * (1 - 1e-12)
    assert chosen == min(m for m in range(1, m_limit + 1) if rates[m - 1] >= max(rates) * (1 - 1e-12))


@settings(max_examples=80, deadline=None)
@given(
    alpha=st.floats(0.0, 1.0),
    t_d=st.floats(0.001, 10.0),
    t_v=st.floats(0.0, 100.0),
    m_limit=st.integers(1, 64),
)
def test_choose_m_is_optimal_for_random_inputs(alpha: float, t_d: float, t_v: float, m_limit: int) -> None:
    rates = brute_force_m(alpha, t_d, t_v, m_limit)
    assert rates[choose_m(alpha, t_d, t_v, m_limit) - 1] >= max(rates) * (1 - 1e-9)


def test_choose_m_follows_the_costs() -> None:
    assert choose_m(0.0, 1.0, 10.0, 8) == 1
    assert choose_m(1.0, 0.0, 10.0, 8) == 8
    # A loaded drafter (slower per token) proposes fewer tokens.
    assert choose_m(0.8, 2.0, 10.0, 16) < choose_m(0.8, 0.2, 10.0, 16)


@pytest.mark.parametrize(
    ("alpha", "t_d", "t_v", "m_limit"),
    [(-0.1, 1, 1, 4), (1.1, 1, 1, 4), (0.5, -1, 1, 4), (0.5, 0, 0, 4), (0.5, 1, 1, 0)],
)
def test_choose_m_refuses_bad_input(alpha: float, t_d: float, t_v: float, m_limit: int) -> None:
    with pytest.raises(ValueError):
        choose_m(alpha, t_d, t_v, m_limit)


@pytest.mark.parametrize(("alpha", "m"), [(0.0, 3), (0.5, 1), (0.9, 10), (1.0, 5), (1 - 1e-12, 4)])
def test_expected_tokens_matches_the_closed_form(alpha: float, m: int) -> None:
    closed = m + 1 if alpha == 1 else (1 - alpha ** (m + 1)) / (1 - alpha)
    assert expected_tokens(alpha, m) == pytest.approx(closed, rel=1e-6)


# --- acceptance estimate ----------------------------------------------------------------------


def test_estimate_reports_nothing_before_the_first_verdict() -> None:
    estimate = AcceptanceEstimate(prior_alpha=0.4)
    assert estimate.accept_milli is None
    assert estimate.alpha == pytest.approx(0.4)


def test_estimate_with_full_weight_reflects_the_last_verdict() -> None:
    estimate = AcceptanceEstimate(weight=1.0)
    estimate.update(2, 4)
    assert estimate.accept_milli == 500
    assert estimate.alpha == pytest.approx(2 / 3)
    estimate.update(4, 4)
    assert (estimate.accept_milli, estimate.alpha) == (1000, 1.0)


def test_estimate_moves_toward_recent_verdicts() -> None:
    estimate = AcceptanceEstimate()
    for _ in range(30):
        estimate.update(0, 5)
    assert estimate.alpha < 0.01 and estimate.accept_milli == 0
    for _ in range(30):
        estimate.update(5, 5)
    assert estimate.alpha > 0.99 and estimate.accept_milli == 1000


def test_estimate_recovers_the_per_token_acceptance_probability() -> None:
    # Rounds whose tokens are each accepted with probability 0.7, stopping at the first rejection.
    generator = np.random.default_rng(5)
    estimate = AcceptanceEstimate(weight=0.01)
    for _ in range(3000):
        accepted = 0
        while accepted < 6 and generator.random() < 0.7:
            accepted += 1
        estimate.update(accepted, 6)
    assert estimate.alpha == pytest.approx(0.7, abs=0.05)
    assert estimate.accept_milli is not None and estimate.accept_milli < 600  # a / M runs lower


@pytest.mark.parametrize(("accepted", "proposed"), [(1, 0), (5, 4), (-1, 2)])
def test_estimate_refuses_impossible_counts(accepted: int, proposed: int) -> None:
    with pytest.raises(ValueError):
        AcceptanceEstimate().update(accepted, proposed)


@pytest.mark.parametrize(("weight", "prior"), [(0.0, 0.5), (1.5, 0.5), (0.5, 1.5)])
def test_estimate_refuses_bad_parameters(weight: float, prior: float) -> None:
    with pytest.raises(ValueError):
        AcceptanceEstimate(weight=weight, prior_alpha=prior)


# --- drafter session --------------------------------------------------------------------------


def make_contract(rule: int = 1, m_max: int = 8) -> Contract:
    return Contract(
        target=bytes(32),
        tokenizer=bytes(32),
        rule=rule,
        m_max=m_max,
        max_new=100,
        stop=(),
        low_rounds=2,
        fallback=(Action.REDUCE,),
        sampling=Sampling(temperature_milli=0),
    )


PROMPT = (1, 2, 3)


def make_assignment(contract: Contract | None = None, *, m_init: int = 4, **changes: object) -> Assignment:
    contract = contract or make_contract()
    fields: dict[str, object] = dict(
        session=SESSION,
        epoch=1,
        contract=contract,
        verifier=VERIFIER,
        drafter=DRAFTER,
        prompt=PROMPT,
        round=0,
        committed=0,
        digest=prefix_digest(contract.digest, PROMPT),
        m_init=m_init,
    )
    fields.update(changes)
    return Assignment(**fields)  # type: ignore[arg-type]


def verdict_for(drafter: DrafterSession, emitted: tuple[int, ...], accepted: int, **changes: object) -> Verdict:
    proposal = drafter.outstanding
    assert proposal is not None
    fields: dict[str, object] = dict(
        session=SESSION,
        epoch=proposal.epoch,
        round=proposal.round,
        accepted=accepted,
        emitted=emitted,
        committed=proposal.base + len(emitted),
        digest=extend_digest(proposal.base_digest, emitted),
        action=Action.CONTINUE,
        m_cap=6,
        low=0,
        load=30,
    )
    fields.update(changes)
    return Verdict(**fields)  # type: ignore[arg-type]


def test_first_proposal_extends_the_assigned_prefix() -> None:
    assignment = make_assignment(round=3, committed=2, digest=b"\x07" * 32)
    session = DrafterSession(assignment)
    assert session.may_propose and session.m_limit == 4
    assert session.sampling == Sampling(temperature_milli=0)
    proposal = session.propose((5, 6), status=STATUS)
    assert (proposal.round, proposal.base, proposal.base_digest) == (4, 2, b"\x07" * 32)
    assert (proposal.session, proposal.epoch, proposal.drafter, proposal.tokens) == (SESSION, 1, DRAFTER, (5, 6))
    assert session.outstanding is proposal and not session.may_propose


def test_assignment_sampling_overrides_the_contract_profile() -> None:
    session = DrafterSession(make_assignment(sampling=Sampling(temperature_milli=700)))
    assert session.sampling == Sampling(temperature_milli=700)


def test_only_one_proposal_may_be_outstanding() -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    with pytest.raises(ProposalNotAllowed):
        session.propose((6,), status=STATUS)


@pytest.mark.parametrize("count", [0, 5])
def test_proposal_length_is_limited_by_m_init_before_the_first_verdict(count: int) -> None:
    session = DrafterSession(make_assignment(m_init=4))
    with pytest.raises(ProtocolError) as caught:
        session.propose(tuple(range(count)), status=STATUS)
    assert caught.value.problem is ProblemType.LIMIT
    assert session.may_propose


def test_m_limit_is_the_smaller_of_m_max_and_m_cap() -> None:
    assert DrafterSession(make_assignment(make_contract(m_max=3), m_init=10)).m_limit == 3
    assert DrafterSession(make_assignment(m_init=0)).m_limit == 1


def test_rule_two_proposals_carry_q_rows() -> None:
    session = DrafterSession(make_assignment(make_contract(rule=2)))
    with pytest.raises(ProtocolError) as caught:
        session.propose((5,), status=STATUS)
    assert caught.value.problem is ProblemType.BAD_PROPOSAL
    assert session.propose((5,), status=STATUS, q_rows="mlc://q/1").q_rows == "mlc://q/1"


def test_unregistered_rule_is_refused_at_assignment() -> None:
    with pytest.raises(BadContract):
        DrafterSession(make_assignment(make_contract(rule=9)))


def test_verdict_moves_the_session_forward() -> None:
    session = DrafterSession(make_assignment())
    session.propose((5, 6, 7), status=STATUS)
    verdict = verdict_for(session, (5, 6, 9), accepted=2, m_cap=2)
    assert session.apply_verdict(verdict) is Action.CONTINUE
    assert (session.round, session.committed, session.digest, session.m_cap) == (1, 3, verdict.digest, 2)
    assert session.may_propose
    assert session.estimate.accept_milli is not None
    following = session.propose((1, 2), status=STATUS)
    assert (following.round, following.base, following.base_digest) == (2, 3, verdict.digest)


def test_verdict_m_cap_is_read_within_one_and_m_max() -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    session.apply_verdict(verdict_for(session, (5, 6), accepted=1, m_cap=99))
    assert session.m_cap == 8


def test_choose_m_uses_the_session_limit_and_estimate() -> None:
    session = DrafterSession(make_assignment(m_init=3), AcceptanceEstimate(prior_alpha=1.0))
    assert session.choose_m(t_d=0.0, t_v=1.0) == 3


def test_a_predraft_covers_the_m_chosen_after_full_acceptance() -> None:
    # Acceptance starts low, so M is short; a full acceptance raises the choice, and the pre-draft
    # made meanwhile must be long enough for it, up to m_max whatever the current m_cap.
    session = DrafterSession(make_assignment(m_init=2), AcceptanceEstimate(prior_alpha=0.5))
    session.propose((5, 6), status=STATUS)
    longer = session.m_after_full_acceptance(t_d=0.01, t_v=1.0)
    assert longer > 2
    session.apply_verdict(verdict_for(session, (5, 6, 7), accepted=2, m_cap=8))
    assert session.choose_m(t_d=0.01, t_v=1.0) == longer


def test_the_predraft_length_needs_an_outstanding_proposal() -> None:
    session = DrafterSession(make_assignment())
    with pytest.raises(ProposalNotAllowed):
        session.m_after_full_acceptance(t_d=0.01, t_v=1.0)


@pytest.mark.parametrize("action", [Action.SWITCH, Action.SELF_DECODE, Action.FINISH, Action.FAIL])
def test_drafter_stops_on_actions_that_take_the_session_away(action: Action) -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    assert session.apply_verdict(verdict_for(session, (5, 6), accepted=1, action=action)) is action
    assert not session.may_propose and session.stopped_by is action
    with pytest.raises(ProposalNotAllowed):
        session.propose((7,), status=STATUS)


def test_reduce_lets_the_drafter_continue_with_the_new_m_cap() -> None:
    session = DrafterSession(make_assignment())
    session.propose((5, 6, 7, 8), status=STATUS)
    session.apply_verdict(verdict_for(session, (9,), accepted=0, action=Action.REDUCE, m_cap=2))
    assert session.may_propose and session.m_limit == 2


@pytest.mark.parametrize(
    "changes",
    [{"round": 2}, {"epoch": 2}, {"accepted": 3}, {"committed": 7}, {"session": bytes(16)}],
)
def test_verdict_that_does_not_answer_the_proposal_is_refused(changes: dict[str, object]) -> None:
    session = DrafterSession(make_assignment())
    session.propose((5, 6), status=STATUS)
    with pytest.raises(BadMessage):
        session.apply_verdict(verdict_for(session, (5, 6, 1), **{"accepted": 2, **changes}))  # type: ignore[arg-type]
    assert session.outstanding is not None and session.round == 0


def test_verdict_without_an_outstanding_proposal_is_refused() -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    verdict = verdict_for(session, (5, 6), accepted=1)
    session.apply_verdict(verdict)
    with pytest.raises(BadMessage):
        session.apply_verdict(verdict)


def test_stale_base_resynchronises_to_the_session_state() -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    state = SessionState(session=SESSION, epoch=1, round=7, committed=12, digest=b"\x01" * 32)
    session.on_problem(ProtocolError(ProblemType.STALE_BASE, "base moved", state=state))
    assert (session.round, session.committed, session.digest) == (7, 12, b"\x01" * 32)
    assert session.may_propose
    assert session.propose((5,), status=STATUS).round == 8


def test_resync_to_another_epoch_stops_the_drafter() -> None:
    session = DrafterSession(make_assignment())
    session.resync(SessionState(session=SESSION, epoch=2, round=7, committed=12, digest=b"\x01" * 32))
    assert session.stopped_by is ProblemType.STALE_EPOCH and session.round == 0


def test_without_a_session_state_the_round_is_found_within_the_tokens_committed_since() -> None:
    # The verifier self-decoded 3 tokens (3 rounds) after round 0: the output tells the prefix,
    # and the next rounds are tried, up to 3, the most the verifier can have reached.
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    session.on_problem(ProtocolError(ProblemType.STALE_BASE, "moved on"))
    session.learn_prefix(3, b"\x02" * 32)
    assert (session.committed, session.digest, session.round) == (3, b"\x02" * 32, 0)
    assert [session.try_later_round() for _ in range(4)] == [True, True, True, False]
    assert session.propose((5,), status=STATUS).round == 4
    with pytest.raises(BadMessage):
        session.learn_prefix(2, b"\x03" * 32)


def test_resync_to_another_session_is_refused() -> None:
    session = DrafterSession(make_assignment())
    with pytest.raises(BadMessage):
        session.resync(SessionState(session=bytes(16), epoch=1, round=7, committed=12, digest=b"\x01" * 32))


@pytest.mark.parametrize("problem", [ProblemType.STALE_EPOCH, ProblemType.NOT_ASSIGNED, ProblemType.SESSION_CLOSED])
def test_problems_that_end_the_assignment_stop_the_drafter(problem: ProblemType) -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    session.on_problem(ProtocolError(problem, "gone"))
    assert session.stopped_by is problem and not session.may_propose


@pytest.mark.parametrize("problem", [ProblemType.Q_UNAVAILABLE, ProblemType.LIMIT, ProblemType.BAD_PROPOSAL, None])
def test_problems_that_commit_nothing_free_the_round(problem: ProblemType | None) -> None:
    session = DrafterSession(make_assignment())
    session.propose((5,), status=STATUS)
    session.on_problem(ProtocolError(problem, "try again"))
    assert session.may_propose and session.round == 0
    assert session.propose((5,), status=STATUS).round == 1
