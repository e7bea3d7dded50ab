"""Penalties, logit_bias and min_p in the target distribution (docs/interpretations.md, "Penalties,
logit_bias and min_p"): each position's row shaped with the counts of the committed output and of
the proposal's tokens before it, and the verifier session deciding rounds under rule 1 and rule 2
exactly as a reference written from the definitions (vLLM's and OpenAI's) decides them
(tests/protocol/shaping_reference.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from tests.protocol.shaping_reference import reference_logits, reference_p

from sdcp.protocol.messages import Action, Assignment, Contract, Proposal, Role, Sampling, Status, Verdict
from sdcp.protocol.problems import BadContract
from sdcp.protocol.rules import PURPOSE_ACCEPT, PURPOSE_EXTRA_TOKEN, verifier_random
from sdcp.protocol.sampling import draw_token, target_distribution
from sdcp.protocol.shaping import TargetLogits, shapes_logits
from sdcp.protocol.verifier import RoundTicket, VerifierSession

V = 64
EOT = 0
SESSION = bytes(range(16))
DRAFTER = "https://drafter.test"
PROMPT = (5, 6, 7, 5)
PENALTIES = Sampling(
    presence_penalty_milli=400,
    frequency_penalty_milli=700,
    repetition_penalty_milli=1300,
    logit_bias_milli=((3, 2500), (9, -100_000), (V + 5, 1000)),
)


def contract(rule: int, sampling: Sampling, **overrides: object) -> Contract:
    obj: dict[str, object] = {
        "target": b"\x01" * 32,
        "tokenizer": b"\x02" * 32,
        "rule": rule,
        "sampling": sampling.to_obj(),
        "m_max": 8,
        "max_new": 32,
        "stop": [EOT],
        "low_rounds": 4,
        "fallback": [Action.REDUCE, Action.FAIL],
        "self_load": 100,
    }
    obj.update(overrides)
    return Contract.from_obj(obj)


def open_session(rule: int, sampling: Sampling) -> VerifierSession:
    machine = VerifierSession(session=SESSION, epoch=1, contract=contract(rule, sampling), prompt=PROMPT)
    machine.assign(
        Assignment(
            session=SESSION,
            epoch=1,
            contract=machine.contract,
            verifier="https://verifier.test",
            drafter=DRAFTER,
            prompt=PROMPT,
            round=machine.round,
            committed=machine.committed,
            digest=machine.digest,
            m_init=8,
        )
    )
    return machine


def round_of(
    machine: VerifierSession, tokens: tuple[int, ...], logits: np.ndarray, q: np.ndarray | None = None
) -> Verdict:
    proposal = Proposal(
        session=SESSION,
        epoch=1,
        round=machine.round + 1,
        drafter=DRAFTER,
        base=machine.committed,
        base_digest=machine.digest,
        tokens=tokens,
        q_rows="mlc://drafter.test/q/1",
        status=Status(instance=DRAFTER, role=Role.DRAFTER, load=0, queue=0, ttl_ms=1000),
    )
    admitted = machine.begin_round(proposal, DRAFTER)
    assert isinstance(admitted, RoundTicket)
    pending = machine.decide(admitted, logits, q, 0)
    machine.apply(pending)
    return pending.verdict


def random_logits(rows: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, V)) * 2).astype(np.float32)


def test_each_row_counts_the_committed_output_and_the_proposal_tokens_before_it() -> None:
    shaping = TargetLogits(prompt=PROMPT, stop=(EOT,))
    committed = (9, 4, 9)
    shaping.commit(committed)
    proposed = (4, 11, 4, 4)
    logits = random_logits(len(proposed) + 1, seed=3)
    shaped = shaping.rows(logits, proposed, PENALTIES)
    for index in range(len(proposed) + 1):
        before = committed + proposed[:index]
        np.testing.assert_allclose(shaped[index], reference_logits(logits[index], PROMPT, before, PENALTIES))
    # Token 4: once in the output, then at the proposal's first place; at its third place the
    # frequency penalty counts 3 (0.7 each), the presence penalty once.
    only_frequency = Sampling(frequency_penalty_milli=700, presence_penalty_milli=400)
    shaped = shaping.rows(logits, proposed, only_frequency)
    assert shaped[3, 4] == pytest.approx(float(logits[3, 4]) - 3 * 0.7 - 0.4)
    assert shaped[0, 4] == pytest.approx(float(logits[0, 4]) - 0.7 - 0.4)
    # A prompt token is not counted by the frequency and presence penalties (OpenAI: the output).
    assert shaped[0, 6] == logits[0, 6]
    # The committed state is left as it was.
    np.testing.assert_allclose(
        shaping.rows(logits[:1], (), PENALTIES)[0], reference_logits(logits[0], PROMPT, committed, PENALTIES)
    )


def test_a_fork_counts_on_its_own() -> None:
    shaping = TargetLogits(prompt=PROMPT, stop=(EOT,))
    fork = shaping.fork()
    fork.commit((9, 9))
    logits = random_logits(1, seed=4)
    assert shaping.rows(logits, (), PENALTIES)[0, 9] == pytest.approx(float(logits[0, 9]) - 100)
    assert fork.committed == 2 and shaping.committed == 0
    np.testing.assert_allclose(
        fork.rows(logits, (), PENALTIES)[0], reference_logits(logits[0], PROMPT, (9, 9), PENALTIES)
    )


def test_neutral_members_leave_the_rows_alone() -> None:
    shaping = TargetLogits(prompt=PROMPT, stop=(EOT,))
    logits = random_logits(2, seed=5)
    neutral = Sampling(temperature_milli=700, repetition_penalty_milli=1000, presence_penalty_milli=0)
    assert not shapes_logits(neutral) and not shapes_logits(None)
    assert shaping.rows(logits, (1,), neutral) is logits
    assert shapes_logits(PENALTIES)


def test_rule_1_rejects_a_repeat_the_penalties_make_less_probable() -> None:
    sampling = Sampling(frequency_penalty_milli=1500)
    machine = open_session(1, sampling)
    a, b, c = 20, 21, 22
    logits = random_logits(4, seed=6)
    logits[0, a] = 10.0
    logits[1, b] = 10.0
    # Raw, a is the most probable at the third place; counted once before it, it loses 1.5 to c.
    logits[2, a], logits[2, c] = 10.0, 9.0
    verdict = round_of(machine, (a, b, a), logits)
    assert verdict.accepted == 2
    expected = int(np.argmax(reference_logits(logits[2], PROMPT, (a, b), sampling)))
    assert expected == c and verdict.emitted == (a, b, c)
    # Next round: a is counted once, b once, c once; a proposal of b loses to an unpenalised token.
    logits = random_logits(2, seed=7)
    logits[0, b], logits[0, 30] = 10.0, 9.0
    verdict = round_of(machine, (b,), logits)
    assert verdict.accepted == 0 and verdict.emitted == (30,)


def test_rule_1_self_decoding_takes_the_argmax_of_the_penalised_row() -> None:
    sampling = Sampling(presence_penalty_milli=2000, logit_bias_milli=((40, 1000),))
    machine = open_session(1, sampling)
    machine.control.start_self_decode(0)
    decided: list[int] = []
    for seed in range(12):
        logits = random_logits(1, seed=100 + seed)
        logits[0, EOT] = -50.0
        # Raw, 40 ties with the most probable token every time.
        logits[0, 40] = logits[0].max()
        (pending,) = machine.decide_self_decoded(logits, (), 0)
        machine.apply(pending)
        expected = int(np.argmax(reference_logits(logits[0], PROMPT, decided, sampling)))
        assert pending.record.emitted == (expected,)
        decided.append(expected)
    # The bias makes 40 the first choice; from then on the presence penalty outweighs the bias.
    assert decided[0] == 40 and decided.count(40) == 1


def test_rule_2_accepts_and_draws_from_the_penalised_distribution() -> None:
    # A proposal whose token repeats: the verifier's accept tests and draws, seed by seed, are those
    # of speculative sampling over p computed by the reference from the counts before each position.
    a = 12
    outcomes: Counter[int] = Counter()
    for seed in range(60):
        sampling = Sampling(
            temperature_milli=800,
            seed=seed,
            presence_penalty_milli=300,
            frequency_penalty_milli=600,
            repetition_penalty_milli=1200,
            logit_bias_milli=((a, 3500),),
            min_p_milli=50,
        )
        machine = open_session(2, sampling)
        logits = random_logits(3, seed=200 + seed)
        q = np.full((2, V), 0.5 / (V - 1), dtype=np.float64)
        q[:, a] = 0.5
        verdict = round_of(machine, (a, a), logits, q)

        p = [reference_p(reference_logits(logits[i], PROMPT, (a,) * i, sampling), 0.8, 0.05) for i in range(3)]
        accepted, extra = 2, None
        for i in range(2):
            r = verifier_random(seed, SESSION, 1, i + 1, PURPOSE_ACCEPT)
            if not r < min(1.0, p[i][a] / q[i, a]):
                residual = np.maximum(0.0, p[i] - q[i])
                accepted, extra = i, draw_token(residual, verifier_random(seed, SESSION, 1, i + 1, PURPOSE_EXTRA_TOKEN))
                break
        if extra is None:
            extra = draw_token(p[2], verifier_random(seed, SESSION, 1, 3, PURPOSE_EXTRA_TOKEN))
        assert verdict.accepted == accepted, seed
        assert verdict.emitted == (a,) * accepted + (extra,), seed
        outcomes[accepted] += 1
    # The seeds reach every outcome: rejected first, at the repeat, and both accepted.
    assert set(outcomes) == {0, 1, 2}


def test_min_p_keeps_the_tokens_near_the_most_probable() -> None:
    logits = random_logits(2, seed=8).astype(np.float64)
    p = target_distribution(logits, Sampling(temperature_milli=500, min_p_milli=200))
    for row, shaped in zip(logits, p, strict=True):
        np.testing.assert_allclose(shaped, reference_p(row, 0.5, 0.2))
        assert 0 < np.count_nonzero(shaped) < V
    # min_p commutes with top-k; with top-p it comes first (vLLM's order).
    both = target_distribution(logits, Sampling(min_p_milli=100, top_k=3))
    assert all(np.count_nonzero(row) <= 3 for row in both)


def test_the_members_are_checked_in_the_contract() -> None:
    valid = contract(2, PENALTIES)
    assert Contract.from_cbor(valid.to_cbor()).sampling == PENALTIES
    bad_members: list[dict[str, object]] = [
        {"presence_penalty_milli": 2001},
        {"frequency_penalty_milli": -2001},
        {"repetition_penalty_milli": 0},
        {"min_p_milli": 1001},
        {"logit_bias_milli": [[5, 1], [5, 2]]},
        {"logit_bias_milli": [[6, 1], [5, 2]]},
        {"logit_bias_milli": [[5, 100_001]]},
        {"logit_bias_milli": [[5]]},
        {"logit_bias_milli": [[t, 1] for t in range(301)]},
    ]
    for bad in bad_members:
        with pytest.raises(BadContract):
            Contract.from_obj({**valid.to_obj(), "sampling": bad})
