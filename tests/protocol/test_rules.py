"""Acceptance rules and verifier randomness (SDCP 6.3, 6.4)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sdcp.protocol.problems import BadContract, ProblemType, ProtocolError
from sdcp.protocol.rules import (
    GREEDY,
    PURPOSE_ACCEPT,
    PURPOSE_EXTRA_TOKEN,
    RULES,
    SPECULATIVE_SAMPLING,
    Acceptance,
    SecureRandom,
    SeededRandom,
    check_draft_rows,
    get_rule,
    hmac_sha256,
    parse_q_rows,
    verifier_random,
)
from sdcp.protocol.sampling import draw_token

VECTORS = Path(__file__).parent / "vectors" / "rfc4231_hmac_sha256.json"
SESSION = bytes(range(16))

# Upper 0.1% points of the chi-square distribution (standard tables, e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, section 1.3.6.7.4).
CHI2_CRITICAL_0_001 = {5: 20.515, 35: 66.619}


class ScriptedRandom:
    """A random source that replays fixed values and records what was asked of it."""

    def __init__(self, values: dict[tuple[int, int], float]) -> None:
        self.values = values
        self.requests: list[tuple[int, int]] = []

    def uniform(self, i: int, purpose: int) -> float:
        self.requests.append((i, purpose))
        return self.values[(i, purpose)]


# --- HMAC and verifier_random ---------------------------------------------------------------


@pytest.mark.parametrize("case", json.loads(VECTORS.read_text())["cases"], ids=lambda c: f"case{c['case']}")
def test_rfc4231_vectors_through_the_verifier_primitive(case: dict) -> None:
    mac = hmac_sha256(bytes.fromhex(case["key"]), bytes.fromhex(case["data"]))
    truncate_bits = case.get("truncate_bits", 256)
    assert mac[: truncate_bits // 8].hex() == case["mac"]


def test_vector_file_holds_cases_one_to_seven_and_its_source() -> None:
    document = json.loads(VECTORS.read_text())
    assert [case["case"] for case in document["cases"]] == list(range(1, 8))
    assert "RFC 4231" in document["source"]


def _independent_verifier_random(seed: int, session: bytes, round: int, i: int, purpose: int) -> float:
    message = (
        "SDCP-VERIFY-1".encode("ascii")
        + bytes([0])
        + session
        + round.to_bytes(4, "big")
        + i.to_bytes(4, "big")
        + bytes([purpose])
    )
    digest = hmac.new(seed.to_bytes(8, "big"), message, hashlib.sha256).digest()
    bits = int(digest.hex()[:14], 16) >> 3  # 56 leading bits, keep the top 53
    return bits / (1 << 53)


@pytest.mark.parametrize(
    ("seed", "round", "i", "purpose"),
    [(0, 0, 0, 0), (1, 1, 1, 0), (42, 7, 3, 1), (2**64 - 1, 2**32 - 1, 2**32 - 1, 1), (123456789, 10, 65, 1)],
)
def test_verifier_random_matches_an_independent_derivation(seed: int, round: int, i: int, purpose: int) -> None:
    value = verifier_random(seed, SESSION, round, i, purpose)
    assert value == _independent_verifier_random(seed, SESSION, round, i, purpose)
    assert 0.0 <= value < 1.0


def test_verifier_random_depends_on_every_input() -> None:
    base = verifier_random(5, SESSION, 3, 2, 0)
    variants = [
        verifier_random(6, SESSION, 3, 2, 0),
        verifier_random(5, bytes(16), 3, 2, 0),
        verifier_random(5, SESSION, 4, 2, 0),
        verifier_random(5, SESSION, 3, 1, 0),
        verifier_random(5, SESSION, 3, 2, 1),
    ]
    assert base not in variants


@pytest.mark.parametrize(
    ("seed", "session", "round", "i", "purpose"),
    [
        (-1, SESSION, 0, 0, 0),
        (2**64, SESSION, 0, 0, 0),
        (0, b"short", 0, 0, 0),
        (0, SESSION, 2**32, 0, 0),
        (0, SESSION, 0, -1, 0),
        (0, SESSION, 0, 0, 2),
    ],
)
def test_verifier_random_rejects_out_of_range_inputs(
    seed: int, session: bytes, round: int, i: int, purpose: int
) -> None:
    with pytest.raises(ValueError):
        verifier_random(seed, session, round, i, purpose)


def test_random_sources() -> None:
    seeded = SeededRandom(seed=9, session=SESSION, round=4)
    assert seeded.uniform(2, PURPOSE_EXTRA_TOKEN) == verifier_random(9, SESSION, 4, 2, PURPOSE_EXTRA_TOKEN)
    secure = SecureRandom()
    values = [secure.uniform(1, PURPOSE_ACCEPT) for _ in range(64)]
    assert all(0.0 <= value < 1.0 for value in values)
    assert len(set(values)) > 60


# --- registry ---------------------------------------------------------------------------------


def test_registry_holds_rules_one_and_two() -> None:
    assert RULES[1] is GREEDY and not GREEDY.needs_q and GREEDY.id == 1
    assert RULES[2] is SPECULATIVE_SAMPLING and SPECULATIVE_SAMPLING.needs_q and SPECULATIVE_SAMPLING.id == 2
    assert get_rule(2) is SPECULATIVE_SAMPLING


def test_unregistered_rule_is_a_bad_contract() -> None:
    with pytest.raises(BadContract) as caught:
        get_rule(3)
    assert caught.value.problem is ProblemType.BAD_CONTRACT


# --- rule 1 -----------------------------------------------------------------------------------


def test_greedy_ties_go_to_the_smallest_token_id() -> None:
    tied = np.array([0.1, 0.4, 0.4, 0.1])
    p_rows = np.stack([tied, tied, tied])
    assert GREEDY.accept(p_rows, None, (1, 1), SecureRandom()) == Acceptance(2, 1)
    assert GREEDY.accept(p_rows, None, (2, 1), SecureRandom()) == Acceptance(0, 1)


def test_greedy_stops_at_the_first_mismatch_and_adds_argmax_of_the_next_row() -> None:
    p_rows = np.eye(5)[[3, 1, 4, 0]]
    assert GREEDY.accept(p_rows, None, (3, 1, 2), SecureRandom()) == Acceptance(2, 4)
    assert GREEDY.accept(p_rows, None, (3, 1, 4), SecureRandom()) == Acceptance(3, 0)
    assert GREEDY.accept(p_rows, None, (0, 1, 4), SecureRandom()) == Acceptance(0, 3)


def test_greedy_draws_no_random_value() -> None:
    source = ScriptedRandom({})
    GREEDY.accept(np.eye(3)[[0, 1]], None, (0,), source)
    assert source.requests == []


@pytest.mark.parametrize("tokens", [(), (7,), (-1,)])
def test_rules_reject_tokens_outside_the_vocabulary(tokens: tuple[int, ...]) -> None:
    p_rows = np.full((len(tokens) + 1, 4), 0.25)
    with pytest.raises(ProtocolError) as caught:
        GREEDY.accept(p_rows, None, tokens, SecureRandom())
    assert caught.value.problem is ProblemType.BAD_PROPOSAL


def test_rules_reject_p_rows_of_the_wrong_count() -> None:
    with pytest.raises(ValueError):
        GREEDY.accept(np.full((2, 4), 0.25), None, (0, 1), SecureRandom())


# --- draft rows -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q_rows", "tokens"),
    [
        (None, (0,)),
        (np.array([[0.5, 0.5, 0.0]]), (2,)),
        (np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]), (0,)),
        (np.array([[0.5, np.nan, 0.5]]), (0,)),
        (np.array([[1.5, -0.5, 0.0]]), (0,)),
        (np.array([0.5, 0.5, 0.0]), (0,)),
    ],
)
def test_bad_draft_rows_are_bad_proposals(q_rows: np.ndarray | None, tokens: tuple[int, ...]) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_draft_rows(q_rows, tokens)
    assert caught.value.problem is ProblemType.BAD_PROPOSAL


def test_draft_rows_must_match_the_vocabulary() -> None:
    with pytest.raises(ProtocolError) as caught:
        check_draft_rows(np.full((1, 4), 0.25), (0,), vocab_size=5)
    assert caught.value.problem is ProblemType.BAD_PROPOSAL


def test_draft_rows_are_normalised() -> None:
    rows = check_draft_rows(np.array([[2.0, 6.0], [1.0, 1.0]], dtype=np.float32), (1, 0), vocab_size=2)
    np.testing.assert_allclose(rows, [[0.25, 0.75], [0.5, 0.5]])


def test_rule_two_checks_every_row_before_drawing_any_random_value() -> None:
    p_rows = np.full((3, 3), 1 / 3)
    q_rows = np.array([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])
    source = ScriptedRandom({})
    with pytest.raises(ProtocolError) as caught:
        SPECULATIVE_SAMPLING.accept(p_rows, q_rows, (1, 0), source)
    assert caught.value.problem is ProblemType.BAD_PROPOSAL
    assert source.requests == []


def test_parse_q_rows_reads_little_endian_binary32() -> None:
    rows = np.array([[0.25, 0.75], [1.0, 0.0]], dtype="<f4")
    np.testing.assert_array_equal(parse_q_rows(rows.tobytes(), 2, 2), rows)
    with pytest.raises(ProtocolError) as caught:
        parse_q_rows(rows.tobytes()[:-1], 2, 2)
    assert caught.value.problem is ProblemType.BAD_PROPOSAL


# --- rule 2 -----------------------------------------------------------------------------------


def test_rule_two_uses_position_and_purpose_for_each_value() -> None:
    p_rows = np.array([[0.5, 0.5], [0.5, 0.5], [0.25, 0.75]])
    q_rows = np.array([[0.5, 0.5], [0.5, 0.5]])
    source = ScriptedRandom({(1, 0): 0.9, (2, 0): 0.9, (3, 1): 0.3})
    assert SPECULATIVE_SAMPLING.accept(p_rows, q_rows, (0, 1), source) == Acceptance(2, 1)
    assert source.requests == [(1, 0), (2, 0), (3, 1)]


def test_rule_two_rejection_draws_from_the_residual_at_index_a_plus_one() -> None:
    p_rows = np.array([[0.2, 0.3, 0.5], [0.3, 0.3, 0.4], [1.0, 0.0, 0.0]])
    q_rows = np.array([[0.2, 0.3, 0.5], [0.8, 0.1, 0.1]])
    # Position 1 has p == q: accepted whatever r. Position 2: p/q = 0.375 for token 0, r = 0.5
    # rejects; the residual max(0, p - q) = (0, 0.2, 0.3) normalised draws token 1 for r = 0.3.
    source = ScriptedRandom({(1, 0): 0.999, (2, 0): 0.5, (2, 1): 0.3})
    assert SPECULATIVE_SAMPLING.accept(p_rows, q_rows, (2, 0), source) == Acceptance(1, 1)
    assert source.requests == [(1, 0), (2, 0), (2, 1)]


def test_rule_two_falls_back_to_p_when_the_residual_vanishes() -> None:
    # A q row that is a scaled copy of p normalises to p: the residual is all zero. Only a
    # forced rejection (r >= 1 is impossible from real sources) reaches that branch.
    p_rows = np.array([[0.25, 0.75], [0.5, 0.5]])
    q_rows = np.array([[0.5, 1.5]])
    source = ScriptedRandom({(1, 0): 1.0, (1, 1): 0.5})
    assert SPECULATIVE_SAMPLING.accept(p_rows, q_rows, (1,), source) == Acceptance(0, draw_token(p_rows[0], 0.5))


def _chi_square(counts: Counter[int], expected: np.ndarray, trials: int) -> float:
    observed = np.array([counts.get(cell, 0) for cell in range(expected.size)], dtype=np.float64)
    expected_counts = expected * trials
    return float(np.sum((observed - expected_counts) ** 2 / expected_counts))


# A context-dependent toy target: the distribution of output token k+1 depends on token k. The
# draft is deliberately bad: it favours what the target disfavours.
VOCAB = 6
FIRST_TARGET = np.array([0.05, 0.10, 0.15, 0.20, 0.22, 0.28])
DRAFT = np.array([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])


def _target_after(previous: int | None) -> np.ndarray:
    return FIRST_TARGET if previous is None else np.roll(FIRST_TARGET, previous + 1)


def _generate_two_tokens(trial: int, drafter: np.random.Generator, accept_blindly: bool) -> tuple[int, int]:
    output: list[int] = []
    round = 0
    while len(output) < 2:
        round += 1
        proposed = 2
        tokens = tuple(int(t) for t in drafter.choice(VOCAB, size=proposed, p=DRAFT))
        context: list[int | None] = [output[-1] if output else None, *tokens]
        p_rows = np.stack([_target_after(previous) for previous in context])
        if accept_blindly:
            output.extend(tokens)
            continue
        q_rows = np.tile(DRAFT, (proposed, 1))
        rng = SeededRandom(seed=2024, session=SESSION, round=trial * 8 + round)
        verdict = SPECULATIVE_SAMPLING.accept(p_rows, q_rows, tokens, rng)
        output.extend(tokens[: verdict.accepted])
        output.append(verdict.extra_token)
    return output[0], output[1]


def _emitted_pairs(trials: int, accept_blindly: bool) -> list[tuple[int, int]]:
    drafter = np.random.default_rng(7)
    return [_generate_two_tokens(trial, drafter, accept_blindly) for trial in range(trials)]


def _joint_target() -> np.ndarray:
    return np.concatenate([FIRST_TARGET[first] * _target_after(first) for first in range(VOCAB)])


@pytest.mark.timeout(60)
def test_rule_two_output_follows_the_target_distribution() -> None:
    trials = 6000
    pairs = _emitted_pairs(trials, accept_blindly=False)
    first_counts = Counter(first for first, _ in pairs)
    joint_counts = Counter(first * VOCAB + second for first, second in pairs)
    assert _chi_square(first_counts, FIRST_TARGET, trials) < CHI2_CRITICAL_0_001[5]
    assert _chi_square(joint_counts, _joint_target(), trials) < CHI2_CRITICAL_0_001[35]


def test_chi_square_check_detects_the_draft_distribution() -> None:
    # The same statistic on unverified draft output must fail, or the test above proves nothing.
    trials = 1000
    pairs = _emitted_pairs(trials, accept_blindly=True)
    first_counts = Counter(first for first, _ in pairs)
    joint_counts = Counter(first * VOCAB + second for first, second in pairs)
    assert _chi_square(first_counts, FIRST_TARGET, trials) > CHI2_CRITICAL_0_001[5]
    assert _chi_square(joint_counts, _joint_target(), trials) > CHI2_CRITICAL_0_001[35]
