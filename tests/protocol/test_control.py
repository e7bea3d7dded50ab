"""Speculation limit and escalation ladder (SDCP 6.5)."""

from __future__ import annotations

import pytest

from sdcp.protocol.control import HIGH_LOAD_PERCENT, ControlDecision, SpeculationControl, is_low_round, m_cap_ceiling
from sdcp.protocol.messages import Action, Contract
from sdcp.protocol.problems import ProblemType, ProtocolError

IDLE = 10
BUSY = 95


def make_contract(
    fallback: tuple[Action | int, ...],
    *,
    low_rounds: int = 2,
    m_max: int = 8,
    low_ratio: int | None = None,
    self_load: int | None = None,
    self_max: int | None = None,
) -> Contract:
    return Contract(
        target=bytes(32),
        tokenizer=bytes(32),
        rule=1,
        m_max=m_max,
        max_new=100,
        stop=(),
        low_rounds=low_rounds,
        low_ratio=low_ratio,
        fallback=fallback,
        self_load=self_load,
        self_max=self_max,
    )


def low_rounds(control: SpeculationControl, count: int, load: int = IDLE) -> list[ControlDecision]:
    return [control.after_round(0, 4, load) for _ in range(count)]


def good_rounds(control: SpeculationControl, count: int, load: int = IDLE) -> list[ControlDecision]:
    return [control.after_round(4, 4, load) for _ in range(count)]


# --- low rounds -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accepted", "proposed", "low_ratio", "low"),
    [
        (0, 4, None, True),
        (1, 4, None, False),
        (0, 1, 0, True),
        (1, 4, 0, False),
        (1, 4, 50, True),
        (2, 4, 50, False),
        (3, 4, 100, True),
        (4, 4, 100, False),
        (0, 4, 1, True),
    ],
)
def test_is_low_round(accepted: int, proposed: int, low_ratio: int | None, low: bool) -> None:
    assert is_low_round(accepted, proposed, low_ratio) is low


@pytest.mark.parametrize(("accepted", "proposed"), [(0, 0), (5, 4), (-1, 4)])
def test_is_low_round_rejects_impossible_counts(accepted: int, proposed: int) -> None:
    with pytest.raises(ValueError):
        is_low_round(accepted, proposed, None)


def test_low_ratio_of_the_contract_decides_lowness() -> None:
    control = SpeculationControl(make_contract((Action.SWITCH,), low_rounds=1, low_ratio=50), m_init=4)
    assert control.after_round(2, 4, IDLE).action is Action.CONTINUE
    assert control.after_round(1, 4, IDLE).action is Action.SWITCH


# --- counters and the ladder -------------------------------------------------------------------


def test_counters_follow_low_and_good_rounds() -> None:
    control = SpeculationControl(make_contract((Action.SWITCH,), low_rounds=3), m_init=4)
    low_rounds(control, 2)
    assert (control.consecutive_low, control.consecutive_good, control.low) == (2, 0, 2)
    good_rounds(control, 1)
    assert (control.consecutive_low, control.consecutive_good, control.low) == (0, 1, 0)
    low_rounds(control, 1)
    assert (control.consecutive_low, control.consecutive_good) == (1, 0)


def test_entry_applies_when_c_reaches_r_and_resets_c() -> None:
    control = SpeculationControl(make_contract((Action.SWITCH, Action.FAIL), low_rounds=3), m_init=4)
    assert [d.action for d in low_rounds(control, 3)] == [Action.CONTINUE, Action.CONTINUE, Action.SWITCH]
    assert (control.consecutive_low, control.ladder_position) == (0, 1)


def test_full_ladder_reduce_self_decode_switch_fail() -> None:
    contract = make_contract((Action.REDUCE, Action.SELF_DECODE, Action.SWITCH, Action.FAIL), self_load=50, self_max=2)
    control = SpeculationControl(contract, m_init=8)
    assert low_rounds(control, 2)[-1] == ControlDecision(Action.REDUCE, 4)
    assert low_rounds(control, 2)[-1].action is Action.SELF_DECODE
    assert control.self_decoding
    assert control.after_self_decode_token(IDLE) is Action.SELF_DECODE
    assert control.after_self_decode_token(IDLE) is Action.SWITCH
    control.assign_drafter(m_init=6)
    assert control.ladder_position == 2
    assert low_rounds(control, 2)[-1] == ControlDecision(Action.SWITCH, 6)
    control.assign_drafter(m_init=6)
    assert low_rounds(control, 2)[-1].action is Action.FAIL
    assert control.ended is Action.FAIL


def test_j_persists_across_a_drafter_switch() -> None:
    control = SpeculationControl(make_contract((Action.SWITCH, Action.REDUCE)), m_init=8)
    assert low_rounds(control, 2)[-1].action is Action.SWITCH
    control.assign_drafter(m_init=8)
    assert low_rounds(control, 2)[-1] == ControlDecision(Action.REDUCE, 4)


def test_j_resets_after_r_rounds_that_are_not_low() -> None:
    control = SpeculationControl(make_contract((Action.SWITCH, Action.REDUCE)), m_init=8)
    assert low_rounds(control, 2)[-1].action is Action.SWITCH
    control.assign_drafter(m_init=8)
    good_rounds(control, 2)
    assert control.ladder_position == 0
    assert low_rounds(control, 2)[-1].action is Action.SWITCH


def test_fewer_than_r_good_rounds_keep_j() -> None:
    control = SpeculationControl(make_contract((Action.SWITCH, Action.REDUCE), low_rounds=3), m_init=8)
    low_rounds(control, 3)
    control.assign_drafter(m_init=8)
    good_rounds(control, 2)
    low_rounds(control, 1)
    good_rounds(control, 2)
    assert control.ladder_position == 1
    assert low_rounds(control, 3)[-1].action is Action.REDUCE


def test_j_persists_across_a_self_decoding_period() -> None:
    # Self-decoded rounds are neither low nor good: R of them must not reset j.
    contract = make_contract((Action.SELF_DECODE, Action.SWITCH), self_load=50, self_max=5)
    control = SpeculationControl(contract, m_init=8)
    assert low_rounds(control, 2)[-1].action is Action.SELF_DECODE
    actions = [control.after_self_decode_token(IDLE) for _ in range(5)]
    assert actions == [Action.SELF_DECODE] * 4 + [Action.SWITCH]
    assert (control.consecutive_low, control.consecutive_good, control.ladder_position) == (0, 0, 1)
    control.assign_drafter(m_init=8)
    assert low_rounds(control, 2)[-1].action is Action.SWITCH


def test_self_decode_is_skipped_when_the_verifier_is_too_loaded() -> None:
    contract = make_contract((Action.SELF_DECODE, Action.SWITCH, Action.SELF_DECODE), self_load=50)
    control = SpeculationControl(contract, m_init=8)
    assert low_rounds(control, 2, load=51)[-1].action is Action.SWITCH
    assert control.ladder_position == 2
    assert not control.self_decoding


def test_self_decode_at_exactly_self_load_is_permitted() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=50), m_init=8)
    assert low_rounds(control, 2, load=50)[-1].action is Action.SELF_DECODE


def test_self_decode_is_skipped_without_self_load_in_the_contract() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE, Action.REDUCE)), m_init=8)
    assert low_rounds(control, 2)[-1] == ControlDecision(Action.REDUCE, 4)


def test_skipping_the_last_entry_fails_the_session() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=20), m_init=8)
    assert low_rounds(control, 2, load=BUSY)[-1].action is Action.FAIL


def test_exhausted_ladder_fails() -> None:
    control = SpeculationControl(make_contract((Action.REDUCE,), low_rounds=1), m_init=8)
    assert control.after_round(0, 4, IDLE) == ControlDecision(Action.REDUCE, 4)
    assert control.after_round(0, 4, IDLE).action is Action.FAIL
    with pytest.raises(ProtocolError) as caught:
        control.after_round(4, 4, IDLE)
    assert caught.value.problem is ProblemType.SESSION_CLOSED


def test_unknown_ladder_value_reads_as_fail() -> None:
    control = SpeculationControl(make_contract((99, Action.REDUCE), low_rounds=1), m_init=8)
    assert control.after_round(0, 4, IDLE).action is Action.FAIL


# --- self-decoding periods ---------------------------------------------------------------------


def test_self_decoding_stops_when_load_exceeds_self_load() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=50), m_init=8)
    low_rounds(control, 2)
    assert control.after_self_decode_token(40) is Action.SELF_DECODE
    assert control.after_self_decode_token(60) is Action.SWITCH
    assert not control.self_decoding


def test_self_decoding_without_self_max_continues_while_load_permits() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=50), m_init=8)
    low_rounds(control, 2)
    assert {control.after_self_decode_token(IDLE) for _ in range(50)} == {Action.SELF_DECODE}


def test_self_decode_room_counts_down_to_self_max_and_is_none_without_it() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=50, self_max=3), m_init=8)
    low_rounds(control, 2)
    assert control.self_decode_room() == 3
    control.after_self_decode_token(IDLE)
    assert control.self_decode_room() == 2
    control.after_self_decode_token(IDLE)
    assert control.after_self_decode_token(IDLE) is Action.SWITCH
    assert control.self_decode_room() == 0
    unbounded = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=50), m_init=8)
    low_rounds(unbounded, 2)
    assert unbounded.self_decode_room() is None


def test_proposal_rounds_and_self_decoded_tokens_do_not_mix() -> None:
    control = SpeculationControl(make_contract((Action.SELF_DECODE,), self_load=50), m_init=8)
    with pytest.raises(ValueError):
        control.after_self_decode_token(IDLE)
    low_rounds(control, 2)
    with pytest.raises(ValueError):
        control.after_round(1, 4, IDLE)


# --- speculation limit -------------------------------------------------------------------------


def test_reduce_halves_and_good_rounds_restore_one_at_a_time() -> None:
    control = SpeculationControl(make_contract((Action.REDUCE,) * 5, low_rounds=1), m_init=8)
    assert [d.m_cap for d in low_rounds(control, 5)] == [4, 2, 1, 1, 1]
    assert [d.m_cap for d in good_rounds(control, 9)] == [2, 3, 4, 5, 6, 7, 8, 8, 8]


def test_low_round_without_escalation_keeps_m_cap() -> None:
    control = SpeculationControl(make_contract((Action.REDUCE,), low_rounds=3), m_init=5)
    assert [d.m_cap for d in low_rounds(control, 2)] == [5, 5]


def test_high_load_lowers_m_cap_and_low_load_lets_it_recover() -> None:
    control = SpeculationControl(make_contract((Action.REDUCE,), m_max=8), m_init=8)
    assert good_rounds(control, 1, load=HIGH_LOAD_PERCENT)[-1].m_cap == 8
    assert [d.m_cap for d in good_rounds(control, 2, load=HIGH_LOAD_PERCENT + 1)] == [4, 4]
    assert low_rounds(control, 1, load=BUSY)[-1].m_cap == 4
    assert [d.m_cap for d in good_rounds(control, 5)] == [5, 6, 7, 8, 8]


@pytest.mark.parametrize(("m_max", "load", "ceiling"), [(8, 0, 8), (8, 80, 8), (8, 81, 4), (1, 100, 1), (7, 90, 3)])
def test_m_cap_ceiling(m_max: int, load: int, ceiling: int) -> None:
    assert m_cap_ceiling(m_max, load) == ceiling


def test_m_cap_ceiling_rejects_a_load_that_is_not_a_percentage() -> None:
    with pytest.raises(ValueError):
        m_cap_ceiling(8, 101)


@pytest.mark.parametrize(("m_init", "m_cap"), [(0, 1), (3, 3), (64, 8)])
def test_m_init_is_clamped_to_one_through_m_max(m_init: int, m_cap: int) -> None:
    assert SpeculationControl(make_contract((Action.REDUCE,)), m_init=m_init).m_cap == m_cap


@pytest.mark.parametrize("proposed", [0, 4])
def test_check_length_refuses_proposals_outside_the_limit(proposed: int) -> None:
    control = SpeculationControl(make_contract((Action.REDUCE,)), m_init=3)
    control.check_length(3)
    with pytest.raises(ProtocolError) as caught:
        control.check_length(proposed)
    assert caught.value.problem is ProblemType.LIMIT


# --- ending ------------------------------------------------------------------------------------


def test_finish_and_fail_close_the_session() -> None:
    finished = SpeculationControl(make_contract((Action.REDUCE,)), m_init=3)
    assert finished.finish() == ControlDecision(Action.FINISH, 3)
    failed = SpeculationControl(make_contract((Action.REDUCE,)), m_init=3)
    assert failed.fail().action is Action.FAIL
    for control in (finished, failed):
        with pytest.raises(ProtocolError) as caught:
            control.check_length(1)
        assert caught.value.problem is ProblemType.SESSION_CLOSED


def test_self_max_zero_skips_self_decode() -> None:
    from sdcp.protocol.control import SpeculationControl
    from sdcp.protocol.messages import Action, Contract

    contract = Contract.from_obj(
        {
            "target": b"\x01" * 32,
            "tokenizer": b"\x02" * 32,
            "rule": 1,
            "m_max": 4,
            "max_new": 10,
            "stop": [],
            "low_rounds": 1,
            "fallback": [Action.SELF_DECODE, Action.REDUCE],
            "self_load": 100,
            "self_max": 0,
        }
    )
    control = SpeculationControl(contract, 4)
    assert control.after_round(0, 4, 0).action == Action.REDUCE and not control.self_decoding


def test_m_cap_stays_within_what_the_pass_costs_make_worth_scoring() -> None:
    # SDCP 6.5.1: the verifier lowers m_cap when its load makes long proposals costly; at least 1
    # is granted, and once long proposals pay again m_cap is restored one round at a time.
    control = SpeculationControl(make_contract((Action.REDUCE,), m_max=16), m_init=16)
    assert control.after_round(4, 4, IDLE, worth=0).m_cap == 1
    assert control.after_round(1, 1, IDLE, worth=3).m_cap == 2
    assert [control.after_round(1, 1, IDLE, worth=16).m_cap for _ in range(3)] == [3, 4, 5]
    assert control.after_round(1, 1, HIGH_LOAD_PERCENT + 1, worth=16).m_cap == 6
    assert control.after_round(1, 1, IDLE).m_cap == 7


@pytest.mark.parametrize(("load", "worth", "ceiling"), [(0, None, 8), (0, 3, 3), (0, 0, 1), (90, 6, 4), (90, 2, 2)])
def test_m_cap_ceiling_is_also_what_the_pass_costs_make_worth(load: int, worth: int | None, ceiling: int) -> None:
    assert m_cap_ceiling(8, load, worth) == ceiling
