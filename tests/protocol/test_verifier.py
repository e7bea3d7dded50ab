"""The verifier session state machine (SDCP 6.3, 6.5.2, 6.6, 6.7, 6.8)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from sdcp.protocol.messages import (
    Action,
    Assignment,
    Contract,
    Output,
    Policy,
    Proposal,
    Resume,
    Role,
    Sampling,
    Status,
    Verdict,
)
from sdcp.protocol.problems import BadMessage, ProblemType, ProtocolError
from sdcp.protocol.records import CommitRecord
from sdcp.protocol.verifier import PendingCommit, Replay, RoundTicket, ServingState, VerifierSession, Wait

V = 8
SESSION = bytes(range(16))
DRAFTER = "https://drafter-a.test"
OTHER = "https://drafter-b.test"
PROMPT = (1, 2, 3)


def make_contract(**overrides: object) -> Contract:
    obj: dict[str, object] = {
        "target": b"\x01" * 32,
        "tokenizer": b"\x02" * 32,
        "rule": 1,
        "m_max": 4,
        "max_new": 20,
        "stop": [7],
        "low_rounds": 2,
        "fallback": [Action.REDUCE, Action.SWITCH, Action.FAIL],
    }
    obj.update(overrides)
    return Contract.from_obj({k: v for k, v in obj.items() if v is not None})


def open_session(contract: Contract | None = None, **kwargs: object) -> VerifierSession:
    contract = contract or make_contract()
    session = VerifierSession(session=SESSION, epoch=1, contract=contract, prompt=PROMPT, **kwargs)
    session.assign(assignment(session, DRAFTER))
    return session


def assignment(session: VerifierSession, drafter: str, epoch: int = 1, m_init: int = 4) -> Assignment:
    return Assignment(
        session=SESSION,
        epoch=epoch,
        contract=session.contract,
        verifier="https://verifier.test",
        drafter=drafter,
        prompt=PROMPT,
        round=session.round,
        committed=session.committed,
        digest=session.digest,
        m_init=m_init,
    )


def status() -> Status:
    return Status(instance=DRAFTER, role=Role.DRAFTER, load=10, queue=0, ttl_ms=1000)


def propose(session: VerifierSession, tokens: tuple[int, ...], **overrides: object) -> Proposal:
    fields: dict[str, object] = {
        "session": SESSION,
        "epoch": session.epoch,
        "round": session.round + 1,
        "drafter": DRAFTER,
        "base": session.committed,
        "base_digest": session.digest,
        "tokens": tokens,
        "status": status(),
    }
    fields.update(overrides)
    return Proposal(**fields)  # type: ignore[arg-type]


def greedy_logits(targets: list[int]) -> np.ndarray:
    """Logits whose argmax at each row is the given target token."""
    rows = np.zeros((len(targets), V), dtype=np.float32)
    for i, token in enumerate(targets):
        rows[i, token] = 5.0
    return rows


def chain(prompt: tuple[int, ...], contract: Contract, output: list[int]) -> bytes:
    """d[n] written from the draft's formula (SDCP 4.2), independently of sdcp.protocol.digest."""
    d = hashlib.sha256(
        b"SDCP-PREFIX-1\x00"
        + contract.digest
        + struct.pack(">I", len(prompt))
        + b"".join(struct.pack(">I", t) for t in prompt)
    ).digest()
    for token in output:
        d = hashlib.sha256(d + struct.pack(">I", token)).digest()
    return d


def run_round(session: VerifierSession, tokens: tuple[int, ...], targets: list[int], load: int = 10):
    ticket = session.begin_round(propose(session, tokens), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    pending = session.decide(ticket, greedy_logits(targets), None, load)
    return pending, session.apply(pending)


def test_greedy_round_commits_accepted_and_additional_token() -> None:
    session = open_session()
    pending, verdict = run_round(session, (4, 5, 6), [4, 5, 0, 3])
    assert verdict.accepted == 2
    assert verdict.emitted == (4, 5, 0)
    assert verdict.committed == 3 and session.tokens == [4, 5, 0]
    assert verdict.digest == chain(PROMPT, session.contract, [4, 5, 0]) == session.digest
    assert verdict.action == Action.CONTINUE and verdict.round == 1
    assert pending.record == CommitRecord(1, 1, (4, 5, 0), 3, verdict.digest)


def test_nothing_changes_before_apply_and_abandon_discards() -> None:
    session = open_session()
    before = session.state()
    ticket = session.begin_round(propose(session, (4,)), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    session.decide(ticket, greedy_logits([4, 4]), None, 0)
    assert session.state() == before
    session.abandon(ticket)
    assert session.state() == before and not session.verifying


def test_unassigned_drafter_is_refused() -> None:
    session = open_session()
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (4,), drafter=OTHER), OTHER)
    assert err.value.problem is ProblemType.NOT_ASSIGNED
    # The authenticated peer must be the drafter, whatever the proposal claims.
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (4,)), OTHER)
    assert err.value.problem is ProblemType.NOT_ASSIGNED


def test_reassignment_revokes_the_previous_drafter() -> None:
    session = open_session()
    session.assign(assignment(session, OTHER))
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (4,)), DRAFTER)
    assert err.value.problem is ProblemType.NOT_ASSIGNED


def test_stale_epoch_is_fenced() -> None:
    session = open_session()
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (4,), epoch=2), DRAFTER)
    assert err.value.problem is ProblemType.STALE_EPOCH and err.value.status == 409


def test_duplicate_proposal_returns_identical_verdict() -> None:
    session = open_session()
    proposal = propose(session, (4, 5))
    ticket = session.begin_round(proposal, DRAFTER)
    assert isinstance(ticket, RoundTicket)
    assert session.begin_round(proposal, DRAFTER) == Wait(1)
    verdict = session.apply(session.decide(ticket, greedy_logits([4, 1, 2]), None, 0))
    assert session.begin_round(proposal, DRAFTER) == Replay(verdict)
    run_round(session, (1,), [1, 1])
    assert session.begin_round(proposal, DRAFTER) == Replay(verdict)


def test_different_proposal_while_a_round_is_in_flight_is_refused() -> None:
    session = open_session()
    session.begin_round(propose(session, (4, 5)), DRAFTER)
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (4, 6)), DRAFTER)
    assert err.value.problem is ProblemType.STALE_BASE and err.value.state is not None


@pytest.mark.parametrize(
    "overrides",
    [{"base": 1}, {"base_digest": b"\x00" * 32}, {"round": 2}, {"round": 0}],
)
def test_stale_base_or_round_carries_state(overrides: dict[str, object]) -> None:
    session = open_session()
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (4,), **overrides), DRAFTER)
    assert err.value.problem is ProblemType.STALE_BASE
    assert err.value.state == session.state()


def test_limit_m_cap_and_m_max() -> None:
    session = open_session(make_contract(m_max=4))
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (1, 2, 3, 4, 5)), DRAFTER)
    assert err.value.problem is ProblemType.LIMIT
    session.assign(assignment(session, DRAFTER, m_init=2))
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (1, 2, 3)), DRAFTER)
    assert err.value.problem is ProblemType.LIMIT


def test_stop_token_truncates_and_finishes() -> None:
    session = open_session()
    pending, verdict = run_round(session, (4, 7, 5), [4, 7, 5, 1])
    assert verdict.emitted == (4, 7)
    assert verdict.action == Action.FINISH and pending.event is not None
    assert pending.event.kind == Action.FINISH
    out = session.output(0)
    assert out.tokens == (4, 7) and out.final and out.finish == Action.FINISH
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (1,)), DRAFTER)
    assert err.value.problem is ProblemType.SESSION_CLOSED and err.value.status == 410


def test_max_new_truncates_and_finishes() -> None:
    session = open_session(make_contract(max_new=4))
    run_round(session, (1, 2), [1, 2, 3])
    _, verdict = run_round(session, (1, 2, 3), [1, 2, 3, 4])
    assert verdict.emitted == (1,) and verdict.action == Action.FINISH
    assert session.tokens == [1, 2, 3, 1]
    assert session.state().state == ServingState.FINISHED


def test_max_new_zero_is_finished_at_creation() -> None:
    session = VerifierSession(session=SESSION, epoch=1, contract=make_contract(max_new=0), prompt=PROMPT)
    assert session.output(0).final


def test_escalation_reduce_then_switch_emits_event() -> None:
    session = open_session()
    _, v1 = run_round(session, (1, 1), [2, 2, 2])
    assert v1.action == Action.CONTINUE and v1.low == 1
    _, v2 = run_round(session, (1, 1), [2, 2, 2])
    assert v2.action == Action.REDUCE and v2.m_cap == 2
    run_round(session, (1,), [2, 2])
    pending, v4 = run_round(session, (1,), [2, 2])
    assert v4.action == Action.SWITCH
    assert pending.event is not None and pending.event.kind == Action.SWITCH
    assert pending.event.committed == session.committed and pending.event.digest == session.digest


def test_self_decode_rounds_are_consecutive_and_end_with_switch_event() -> None:
    contract = make_contract(fallback=[Action.SELF_DECODE], self_load=50, self_max=2, low_rounds=1)
    session = open_session(contract)
    _, verdict = run_round(session, (1,), [2, 2])
    assert verdict.action == Action.SELF_DECODE and session.self_decoding
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (1,)), DRAFTER)
    assert err.value.problem is ProblemType.STALE_BASE
    rounds, events = [], []
    while session.self_decoding:
        (pending,) = session.decide_self_decoded(greedy_logits([5]), (), 10)
        session.apply(pending)
        rounds.append(pending.record.round)
        events.append(pending.event)
    assert rounds == [2, 3] and session.tokens == [2, 5, 5]
    assert events[0] is None and events[1] is not None and events[1].kind == Action.SWITCH
    assert session.state().state == ServingState.ACTIVE


def test_self_decode_skipped_when_loaded() -> None:
    contract = make_contract(fallback=[Action.SELF_DECODE, Action.FAIL], self_load=50, low_rounds=1)
    session = open_session(contract)
    pending, verdict = run_round(session, (1,), [2, 2], load=90)
    assert verdict.action == Action.FAIL
    assert pending.event is not None and pending.event.kind == Action.FAIL
    out = session.output(0)
    assert out.final and out.finish == Action.FAIL and out.tokens == (2,)


def test_policy_applies_from_its_round() -> None:
    contract = make_contract(rule=2, sampling={"temperature_milli": 1000, "seed": 1})
    session = open_session(contract)
    new = Sampling(temperature_milli=0, seed=9)
    session.apply_policy(Policy(session=SESSION, from_round=3, sampling=new))
    assert session.sampling_for(2) == contract.sampling
    assert session.sampling_for(3) == new and session.sampling_for(7) == new
    with pytest.raises(ProtocolError) as err:
        session.apply_policy(Policy(session=SESSION, from_round=0, sampling=new))
    assert err.value.problem is ProblemType.STALE_BASE


def test_rule2_requires_rows_and_rejects_zero_q_before_drawing() -> None:
    session = open_session(make_contract(rule=2, sampling={"seed": 3}))
    with pytest.raises(ProtocolError) as err:
        session.begin_round(propose(session, (1,)), DRAFTER)
    assert err.value.problem is ProblemType.BAD_PROPOSAL

    class CountingRandom:
        draws = 0

        def uniform(self, i: int, purpose: int) -> float:
            CountingRandom.draws += 1
            return 0.5

    ticket = session.begin_round(propose(session, (1, 2), q_rows="mlc://x/-/q/1"), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    counted = RoundTicket(ticket.round, ticket.proposal, ticket.sampling, CountingRandom())
    session._in_flight = counted  # the counting source stands in for the seeded one
    q = np.full((2, V), 1.0 / V, dtype=np.float32)
    q[1, 2] = 0.0
    with pytest.raises(ProtocolError) as err:
        session.decide(counted, np.zeros((3, V), dtype=np.float32), q, 0)
    assert err.value.problem is ProblemType.BAD_PROPOSAL and CountingRandom.draws == 0


def test_rule2_seeded_verdicts_are_reproducible() -> None:
    def run() -> list[int]:
        session = open_session(make_contract(rule=2, sampling={"seed": 11}, max_new=12))
        rng = np.random.default_rng(0)
        while not session.ended:
            ticket = session.begin_round(propose(session, (1, 2), q_rows="mlc://x/-/q/r"), DRAFTER)
            assert isinstance(ticket, RoundTicket)
            q = np.full((2, V), 1.0 / V, dtype=np.float32)
            session.apply(session.decide(ticket, rng.normal(size=(3, V)).astype(np.float32), q, 0))
        return session.tokens

    assert run() == run()


def test_fenced_session_stops_serving() -> None:
    session = open_session()
    ticket = session.begin_round(propose(session, (4,)), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    session.decide(ticket, greedy_logits([4, 4]), None, 0)
    session.stop_serving()
    assert session.committed == 0
    with pytest.raises(ProtocolError) as err:
        session.output(0)
    assert err.value.problem is ProblemType.STALE_EPOCH
    with pytest.raises(ProtocolError):
        session.begin_round(propose(session, (4,)), DRAFTER)


def test_output_slices_are_stable() -> None:
    session = open_session()
    run_round(session, (4, 5), [4, 5, 6])
    run_round(session, (1,), [2, 3])
    assert session.output(0).tokens == (4, 5, 6, 2)
    assert session.output(3).tokens == (2,) and session.output(3).from_ == 3
    assert session.output(9).tokens == () and not session.output(0).final
    assert session.output(0).epoch == 1


def test_has_output_says_whether_output_answers_now() -> None:
    """A reader of many sessions checks has_output at each commit; it must agree with output:
    tokens past start, the final output, or the error of a fenced session."""

    def agrees(session: VerifierSession, start: int) -> bool:
        try:
            output = session.output(start)
        except ProtocolError:
            return session.has_output(start)
        return session.has_output(start) == (bool(output.tokens) or output.final)

    session = open_session()
    assert not session.has_output(0) and agrees(session, 0)
    run_round(session, (4, 5), [4, 5, 6])
    assert [session.has_output(start) for start in range(5)] == [True, True, True, False, False]
    assert all(agrees(session, start) for start in range(5))
    session.stop_serving()
    assert session.has_output(3) and agrees(session, 3)


def test_resume_checks_digest_and_continues() -> None:
    contract = make_contract()
    committed = [4, 5, 6]
    resume = Resume(round=5, committed=3, digest=chain(PROMPT, contract, committed), committed_tokens="mlc://x/-/t/1")
    session = VerifierSession(
        session=SESSION, epoch=2, contract=contract, prompt=PROMPT, resume=resume, committed_tokens=committed
    )
    assert session.state().round == 5 and session.committed == 3
    bad = Resume(round=5, committed=3, digest=b"\x00" * 32, committed_tokens="mlc://x/-/t/1")
    with pytest.raises(BadMessage):
        VerifierSession(
            session=SESSION, epoch=2, contract=contract, prompt=PROMPT, resume=bad, committed_tokens=committed
        )


def test_assignment_with_another_contract_or_epoch_is_refused() -> None:
    session = open_session()
    other = VerifierSession(session=SESSION, epoch=1, contract=make_contract(max_new=5), prompt=PROMPT)
    with pytest.raises(ProtocolError) as err:
        session.assign(assignment(other, DRAFTER))
    assert err.value.problem is ProblemType.BAD_CONTRACT
    with pytest.raises(ProtocolError) as err:
        session.assign(assignment(session, DRAFTER, epoch=3))
    assert err.value.problem is ProblemType.STALE_EPOCH


def test_unknown_rule_is_a_bad_contract() -> None:
    with pytest.raises(ProtocolError) as err:
        VerifierSession(session=SESSION, epoch=1, contract=make_contract(rule=99), prompt=PROMPT)
    assert err.value.problem is ProblemType.BAD_CONTRACT


def test_stats_count_rounds_acceptance_by_position_and_escalations() -> None:
    session = open_session()
    run_round(session, (4, 5, 6), [4, 5, 0, 3])
    run_round(session, (1, 1), [2, 2, 2])
    run_round(session, (1, 1), [2, 2, 2])
    stats = session.stats.to_obj()
    assert stats["rounds"] == 3 and stats["proposed"] == 7 and stats["accepted"] == 2
    assert stats["proposed_by_position"] == [3, 3, 1] and stats["accepted_by_position"] == [1, 1, 0]
    assert stats["escalations"] == 1 and stats["escalated"] == {"reduce": 1} and stats["self_decoded"] == 0


def test_assignment_while_a_round_is_in_flight_is_refused() -> None:
    session = open_session()
    ticket = session.begin_round(propose(session, (4,)), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    with pytest.raises(ProtocolError) as err:
        session.assign(assignment(session, OTHER))
    assert err.value.problem is ProblemType.STALE_BASE and session.drafter == DRAFTER
    session.apply(session.decide(ticket, greedy_logits([4, 4]), None, 0))
    session.assign(assignment(session, OTHER))
    assert session.drafter == OTHER


def test_an_interrupted_self_decoding_period_asks_for_a_drafter() -> None:
    contract = make_contract(fallback=[Action.SELF_DECODE], self_load=50, low_rounds=1)
    session = open_session(contract)
    run_round(session, (1,), [2, 2])
    session.begin_self_decode()
    event = session.interrupt_self_decode()
    assert event.kind == Action.SWITCH and event.committed == session.committed
    assert not session.self_decoding and not session.verifying
    assert session.state().state == ServingState.ACTIVE


def test_a_cancel_begun_while_self_decoding_stops_still_commits() -> None:
    # The cancel waited for the self-decoding task only so long; the task, still running, failed to
    # begin its next round (the cancel's is in flight) and ended its period: the cancel commits.
    contract = make_contract(fallback=[Action.SELF_DECODE], self_load=50, low_rounds=1)
    session = open_session(contract)
    run_round(session, (1,), [2, 2])
    assert session.self_decoding
    pending = session.cancel(session.epoch)
    with pytest.raises(ValueError, match="in flight"):
        session.begin_self_decode()
    session.interrupt_self_decode()
    session.apply(pending)
    assert session.state().state == ServingState.FAILED and not session.verifying


def test_logprobs_are_of_the_emitted_tokens_under_the_unprocessed_target_rows() -> None:
    session = open_session(logprobs=2)
    logits = np.log(np.array([[0.5, 0.25, 0.125, 0.125, 0, 0, 0, 0], [0.1, 0.2, 0.7, 0, 0, 0, 0, 0]]) + 1e-30)
    ticket = session.begin_round(propose(session, (0,)), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    session.apply(session.decide(ticket, logits, None, 10))
    first, extra = session.output(0).logprobs or ()
    assert first.logprob == round(1e6 * np.log(0.5)) and extra.logprob == round(1e6 * np.log(0.7))
    assert first.top is not None and [a.token for a in first.top] == [0, 1]
    assert extra.top is not None and [(a.token, a.logprob) for a in extra.top][0] == (2, extra.logprob)
    # Slices follow the tokens; without the extension the output carries none.
    assert session.output(1).logprobs == (extra,)
    assert open_session().output(0).logprobs is None


def test_logprobs_of_tokens_committed_before_a_failover_are_unknown() -> None:
    contract = make_contract()
    committed = [4, 5]
    resume = Resume(round=2, committed=2, digest=chain(PROMPT, contract, committed), committed_tokens="mlc://x/-/t/1")
    session = VerifierSession(
        session=SESSION,
        epoch=2,
        contract=contract,
        prompt=PROMPT,
        resume=resume,
        committed_tokens=committed,
        logprobs=0,
    )
    out = session.output(0)
    assert out.logprobs is not None and [e.logprob for e in out.logprobs] == [None, None]
    assert Output.from_obj(out.to_obj()) == out


def test_min_new_holds_stop_tokens_back_until_that_many_tokens_are_out() -> None:
    # The stop token 7 is the target's favourite everywhere; the runner-up is token 3.
    rows = np.tile(np.array([0, 0, 0, 4, 0, 0, 0, 5], dtype=np.float32), (3, 1))
    session = open_session(min_new=2)
    ticket = session.begin_round(propose(session, (7, 7)), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    verdict = session.apply(session.decide(ticket, rows, None, 10))
    # Positions 0 and 1 cannot stop: the proposal is rejected and 3 comes instead of 7.
    assert verdict.accepted == 0 and verdict.emitted == (3,)
    ticket = session.begin_round(propose(session, (3, 7)), DRAFTER)
    assert isinstance(ticket, RoundTicket)
    verdict = session.apply(session.decide(ticket, rows, None, 10))
    assert verdict.emitted == (3, 7) and verdict.action == Action.FINISH


def test_min_new_applies_to_self_decoded_tokens() -> None:
    contract = make_contract(self_load=100, self_max=8)
    session = VerifierSession(session=SESSION, epoch=1, contract=contract, prompt=PROMPT, min_new=1)
    session.self_decode_instead(1, 0)
    row = np.array([[0, 0, 0, 4, 0, 0, 0, 5]], dtype=np.float32)
    (first,) = session.decide_self_decoded(row, (), 0)
    assert session.apply(first).emitted == (3,)
    (second,) = session.decide_self_decoded(row, (), 0)
    assert session.apply(second).emitted == (7,)


def self_decoding_session(**overrides: object) -> VerifierSession:
    contract = make_contract(**{"self_load": 100, "self_max": 30, "max_new": 20, **overrides})
    session = VerifierSession(session=SESSION, epoch=1, contract=contract, prompt=PROMPT)
    session.self_decode_instead(1, 0)
    return session


def one_at_a_time(session: VerifierSession, rows: np.ndarray, count: int) -> list[PendingCommit]:
    decided = []
    for row in rows[:count]:
        (pending,) = session.decide_self_decoded(row[None], (), 10)
        session.apply(pending)
        decided.append(pending)
    return decided


@pytest.mark.parametrize("rule", [1, 2])
def test_rounds_decided_together_equal_rounds_decided_one_at_a_time(rule: int) -> None:
    """SDCP 6.5.2: each self-decoded token is a round of its own, whether the rows of several came
    in one pass (a guess) or a greedy run: the same records, verdicts and state as one at a time."""
    overrides: dict[str, object] = {"rule": rule, "sampling": {"seed": 5} if rule == 2 else None}
    rows = greedy_logits([3, 1, 4, 1, 5, 6])
    together, alone = self_decoding_session(**overrides), self_decoding_session(**overrides)
    tokens = [int(token) for token in np.argmax(rows, axis=-1)] if rule == 1 else None
    expected = one_at_a_time(alone, rows, len(rows))
    fed = tokens if tokens is not None else [pending.record.emitted[0] for pending in expected]
    decided = together.decide_self_decoded(rows, fed[:-1], 10)
    # Rows one by one (a greedy run's, handed over without a copy) decide the same rounds.
    rows_apart = self_decoding_session(**overrides).decide_self_decoded(list(rows), fed[:-1], 10)
    assert [p.record for p in rows_apart] == [p.record for p in expected]
    assert [p.record for p in decided] == [p.record for p in expected]
    assert [p.verdict for p in decided] == [p.verdict for p in expected]
    # Nothing is committed until each is applied, in order.
    assert together.committed == 0 and together.verifying
    with pytest.raises(ValueError, match="not the round in flight"):
        together.apply(decided[1])
    for pending in decided:
        together.apply(pending)
    assert together.tokens == alone.tokens and together.digest == alone.digest and together.round == alone.round
    assert not together.verifying
    assert together.control.self_decoded == alone.control.self_decoded


def test_rounds_decided_together_stop_after_a_token_that_was_not_fed() -> None:
    session = self_decoding_session()
    rows = greedy_logits([3, 1, 4, 1])
    # The run fed 3, then 2 where the target's token is 1: the rows after it follow another token.
    decided = session.decide_self_decoded(rows, [3, 2, 4], 10)
    assert [p.record.emitted for p in decided] == [(3,), (1,)]
    assert session.verifying
    for pending in decided:
        session.apply(pending)
    assert session.tokens == [3, 1] and session.digest == chain(PROMPT, session.contract, [3, 1])


def test_rounds_decided_together_stop_at_the_end_of_the_period_and_of_the_output() -> None:
    rows = greedy_logits([3, 1, 4, 1, 5])
    capped = self_decoding_session(self_max=2)
    decided = capped.decide_self_decoded(rows, [3, 1, 4, 1], 10)
    assert [p.verdict.action for p in decided] == [Action.SELF_DECODE, Action.SWITCH]
    assert decided[-1].event is not None and decided[-1].event.kind == Action.SWITCH
    stopped = self_decoding_session()
    decided = stopped.decide_self_decoded(greedy_logits([3, 7, 4]), [3, 7], 10)
    assert [p.verdict.action for p in decided] == [Action.SELF_DECODE, Action.FINISH]
    short = self_decoding_session(max_new=3)
    decided = short.decide_self_decoded(rows, [3, 1, 4, 1], 10)
    assert [p.record.emitted for p in decided] == [(3,), (1,), (4,)] and decided[-1].verdict.action == Action.FINISH
    for pending in decided:
        short.apply(pending)
    assert short.ended and short.output(0).final


def test_abandoning_rounds_decided_together_drops_them_all() -> None:
    session = self_decoding_session()
    decided = session.decide_self_decoded(greedy_logits([3, 1, 4]), [3, 1], 10)
    session.abandon(decided[0].ticket)
    assert not session.verifying and session.committed == 0
    ticket = session.begin_self_decode()
    assert ticket.round == 1
    # The first may be applied and the rest abandoned (an append that failed after it).
    session.abandon(ticket)
    decided = session.decide_self_decoded(greedy_logits([3, 1, 4]), [3, 1], 10)
    session.apply(decided[0])
    session.abandon(decided[1].ticket)
    assert session.tokens == [3] and not session.verifying and session.begin_self_decode().round == 2


def test_rounds_decided_together_under_a_constraint_follow_the_tokens_before_them() -> None:
    """The shaping of each row counts the tokens decided before it (min_new here): a stop token
    is refused until min_new tokens are decided, also where they were decided together."""
    contract = make_contract(self_load=100, self_max=8)
    session = VerifierSession(session=SESSION, epoch=1, contract=contract, prompt=PROMPT, min_new=2)
    session.self_decode_instead(1, 0)
    row = np.array([0, 0, 0, 4, 0, 0, 0, 5], dtype=np.float32)
    decided = session.decide_self_decoded(np.stack([row, row, row]), [3, 3], 0)
    assert [p.record.emitted for p in decided] == [(3,), (3,), (7,)]


def test_a_verdict_built_unjudged_still_refuses_a_load_outside_a_percentage() -> None:
    session = self_decoding_session()
    row = np.array([[0, 0, 0, 4, 0, 0, 0, 5]], dtype=np.float32)
    with pytest.raises(ValueError, match="percentage"):
        session.decide_self_decoded(row, (), 101)
    (pending,) = session.decide_self_decoded(row, (), 100)
    assert pending.verdict.load == 100 and Verdict.from_obj(pending.verdict.to_obj()) == pending.verdict
