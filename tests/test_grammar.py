"""Structured output at the verifier (docs/interpretations.md, "Structured output"): the constraint's
masks over the tiny model's byte tokenizer (llguidance), and the verifier session deciding rounds
with them under rule 1 and rule 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sdcp.grammar import ConstraintError, GrammarConstraint, check, grammar_tokenizer
from sdcp.models.hf import tiny
from sdcp.protocol.messages import (
    Action,
    Assignment,
    Constraint,
    Contract,
    Policy,
    Proposal,
    Resume,
    Role,
    Sampling,
    Status,
    Verdict,
)
from sdcp.protocol.problems import BadMessage
from sdcp.protocol.rules import PURPOSE_EXTRA_TOKEN, verifier_random
from sdcp.protocol.sampling import draw_token
from sdcp.protocol.verifier import RoundTicket, VerifierSession

V = 257
EOT = 0
SESSION = bytes(range(16))
DRAFTER = "https://drafter.test"
PROMPT = (5, 6, 7)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def ids(text: str) -> tuple[int, ...]:
    """The tiny tokenizer's ids: one per byte, 1 + the byte's place in the byte-level alphabet."""
    return tuple(tiny.tiny_tokenizer().encode(text, add_special_tokens=False))


def grammar(kind: str, text: str, stop: tuple[int, ...] = (EOT,)) -> GrammarConstraint:
    tokenizer = grammar_tokenizer(tiny.tiny_tokenizer().backend_tokenizer.to_str(), V)
    return GrammarConstraint(tokenizer, Constraint(kind=kind, text=text), stop, V)


def json_grammar() -> GrammarConstraint:
    return grammar("json_schema", json.dumps(SCHEMA))


def contract(rule: int = 1, **overrides: object) -> Contract:
    obj: dict[str, object] = {
        "target": b"\x01" * 32,
        "tokenizer": b"\x02" * 32,
        "rule": rule,
        "m_max": 8,
        "max_new": 32,
        "stop": [EOT],
        "low_rounds": 4,
        "fallback": [Action.REDUCE, Action.FAIL],
    }
    obj.update(overrides)
    return Contract.from_obj(obj)


def open_session(constraint: GrammarConstraint, rule: int = 1, **kwargs: object) -> VerifierSession:
    machine = VerifierSession(
        session=SESSION, epoch=1, contract=contract(rule), prompt=PROMPT, constraint=constraint, **kwargs
    )
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


def propose(machine: VerifierSession, tokens: tuple[int, ...]) -> Proposal:
    return Proposal(
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


def peaked(tokens: list[int], seed: int = 1) -> np.ndarray:
    """Random logits whose most probable token at row i is ``tokens[i]``."""
    rows = np.random.default_rng(seed).normal(size=(len(tokens), V)).astype(np.float32)
    for row, token in zip(rows, tokens, strict=True):
        row[token] = 10.0
    return rows


def round_of(
    machine: VerifierSession, tokens: tuple[int, ...], logits: np.ndarray, q: np.ndarray | None = None
) -> Verdict:
    admitted = machine.begin_round(propose(machine, tokens), DRAFTER)
    assert isinstance(admitted, RoundTicket)
    pending = machine.decide(admitted, logits, q, 0)
    machine.apply(pending)
    return pending.verdict


def test_each_position_allows_what_the_grammar_allows_after_the_tokens_before_it() -> None:
    constraint = json_grammar()
    text = ids('{"a":12}')
    rows = constraint.allowed(text)
    assert rows.shape == (len(text) + 1, V)
    for position, token in enumerate(text):
        assert rows[position, token], position
    # Structure is forced: '{', '"', 'a', '"', ':' are the only tokens at their positions.
    assert [int(np.flatnonzero(row)[0]) for row in rows[:5]] == list(text[:5])
    assert all(row.sum() == 1 for row in rows[:5])
    # After the first digit more digits or '}'; the stop token only once the object is closed.
    assert rows[6, ids("}")[0]] and rows[6, ids("3")[0]] and not rows[6, EOT]
    assert np.flatnonzero(rows[-1]).tolist() == [EOT]
    # A stop token is no text inside the object, and nothing is defined after a disallowed token.
    assert not rows[2, EOT]
    assert len(constraint.allowed((*text[:3], ids("b")[0], *text[4:]))) == 4


def test_allowed_leaves_the_committed_state_as_it_was() -> None:
    constraint = json_grammar()
    before = constraint.allowed(())
    constraint.allowed(ids('{"a":1'))
    assert np.array_equal(constraint.allowed(()), before)
    constraint.commit(ids('{"a"'))
    assert np.flatnonzero(constraint.allowed(())[0]).tolist() == list(ids(":"))


def test_commit_refuses_a_token_outside_the_language_and_a_stop_before_the_end() -> None:
    constraint = json_grammar()
    with pytest.raises(ValueError, match="not allowed"):
        constraint.commit(ids("["))
    constraint = json_grammar()
    with pytest.raises(ValueError, match="incomplete"):
        constraint.commit((*ids('{"a":1'), EOT))


def test_forced_tokens_are_the_text_every_continuation_starts_with() -> None:
    constraint = json_grammar()
    assert constraint.forced((), 16) == ids('{"a":')
    assert constraint.forced((), 3) == ids('{"a')
    assert constraint.forced(ids('{"a":1'), 16) == ()
    # A complete output with one stop token: the stop token is forced.
    assert constraint.forced(ids('{"a":1}'), 16) == (EOT,)
    assert constraint.forced(ids("x"), 16) == ()
    choice = grammar("choice", json.dumps(["alpha", "beta"]))
    assert choice.forced(ids("a"), 16) == ids("lpha")


def test_every_kind_compiles_and_a_bad_text_is_a_constraint_error() -> None:
    for kind, text in [
        ("json_schema", json.dumps(SCHEMA)),
        ("regex", "[0-9]{3}-[a-z]+"),
        ("choice", json.dumps(["yes", "no"])),
        ("lark", 'start: "x" NUMBER\nNUMBER: /[0-9]+/'),
    ]:
        check(Constraint(kind=kind, text=text))
    for kind, text in [
        ("json_schema", "{not json"),
        ("json_schema", "[1]"),
        ("regex", "(["),
        ("choice", "[]"),
        ("choice", '["a", 1]'),
        ("lark", "start: undefined_rule"),
    ]:
        with pytest.raises(ConstraintError):
            check(Constraint(kind=kind, text=text))
    with pytest.raises(ConstraintError, match="stop tokens"):
        grammar("regex", "a+", stop=())


def test_rule_1_accepts_a_proposal_crossing_grammar_states_as_greedy_decoding_of_the_masked_target() -> None:
    machine = open_session(json_grammar())
    text = ids('{"a":7}')
    # The raw target prefers 'x' everywhere; only 'x' is never allowed: the masked argmax is the
    # text's token, the second most probable, at every position.
    x = ids("x")[0]
    logits = peaked([x] * (len(text) + 1))
    for row, token in zip(logits, (*text, EOT), strict=True):
        row[token] = 9.0
    verdict = round_of(machine, text, logits)
    assert verdict.accepted == len(text)
    assert verdict.emitted == (*text, EOT)
    assert verdict.action == Action.FINISH
    assert machine.tokens == [*text, EOT]


def test_a_rejection_rolls_the_grammar_back_to_the_committed_output() -> None:
    machine = open_session(json_grammar())
    # Proposed '{"a":' then 'b', which the grammar disallows where a digit must come; the target
    # most prefers 'b' there, but the decided token is its most probable digit.
    proposed = (*ids('{"a":'), ids("b")[0], *ids("12"))
    targets = [*ids('{"a":'), ids("b")[0], ids("1")[0], ids("2")[0], ids("}")[0]]
    logits = peaked(targets)
    logits[5, ids("4")[0]] = 9.0
    verdict = round_of(machine, proposed, logits)
    assert verdict.accepted == 5
    assert verdict.emitted == ids('{"a":4')
    # The speculative tokens after the rejection left no trace: the next row allows what follows '4'.
    allowed = machine.constraint.allowed(()) if machine.constraint else None
    assert allowed is not None and allowed[0, ids("}")[0]] and allowed[0, ids("5")[0]]
    assert not allowed[0, ids(":")[0]] and not allowed[0, EOT]
    verdict = round_of(machine, ids("}"), peaked([ids("}")[0], EOT]))
    assert verdict.emitted == (*ids("}"), EOT) and verdict.action == Action.FINISH


def masked_distribution(row: np.ndarray, allowed: np.ndarray, temperature: float) -> np.ndarray:
    """The restricted, renormalised target distribution, written out independently of sdcp."""
    scaled = np.where(allowed, row.astype(np.float64) / temperature, -np.inf)
    weights = np.exp(scaled - scaled[allowed].max())
    return weights / weights.sum()


def test_rule_2_draws_from_the_masked_renormalised_distribution() -> None:
    # A drafter that proposes a disallowed token at full confidence is rejected at that position
    # whatever r is (p(x) = 0), and the additional token comes from the residual, which is the
    # masked p itself: over many seeds, each drawn token is the one the formula gives.
    x = ids("x")[0]
    for seed in range(40):
        constraint = grammar("regex", "[0-9]{2}")
        allowed = constraint.allowed(())[0]
        machine = open_session(constraint, rule=2)
        machine.apply_policy(Policy(session=SESSION, from_round=1, sampling=Sampling(temperature_milli=700, seed=seed)))
        logits = np.random.default_rng(seed).normal(size=(2, V)).astype(np.float32) * 3
        q = np.zeros((1, V), dtype=np.float32)
        q[0, x] = 1.0
        verdict = round_of(machine, (x,), logits, q)
        assert verdict.accepted == 0
        expected = draw_token(
            masked_distribution(logits[0], allowed, 0.7), verifier_random(seed, SESSION, 1, 1, PURPOSE_EXTRA_TOKEN)
        )
        assert verdict.emitted == (expected,)
        assert allowed[expected]


def test_rule_2_accepts_an_allowed_proposal_by_the_masked_probability() -> None:
    # The forced token's masked probability is 1: accepted whatever r (the session has no seed),
    # though the raw target gives it little; so is the next one, drawn as the additional token.
    machine = open_session(json_grammar(), rule=2)
    logits = peaked([ids("x")[0]] * 2)
    q = np.zeros((1, V), dtype=np.float32)
    q[0, ids("{")[0]] = 1.0
    verdict = round_of(machine, ids("{"), logits, q)
    assert verdict.accepted == 1
    assert verdict.emitted == ids('{"')


def test_a_complete_output_ends_with_a_stop_token_even_before_min_new() -> None:
    machine = open_session(grammar("choice", json.dumps(["ok"])), min_new=10)
    verdict = round_of(machine, ids("ok"), peaked([ids("o")[0], ids("k")[0], ids("!")[0]]))
    assert verdict.emitted == (*ids("ok"), EOT)
    assert verdict.action == Action.FINISH


def test_min_new_holds_the_stop_back_where_the_language_goes_on() -> None:
    machine = open_session(grammar("regex", "a+"), min_new=3)
    logits = peaked([ids("a")[0], EOT, EOT])
    verdict = round_of(machine, ids("aa"), logits)
    # Position 2 (output index 1) prefers the stop token, held back: 'a' is what remains.
    assert verdict.emitted == ids("aaa")
    verdict = round_of(machine, ids("a"), peaked([EOT, EOT]))
    assert verdict.emitted == (EOT,)


def test_a_resume_continues_the_grammar_after_the_committed_tokens() -> None:
    first = open_session(json_grammar())
    round_of(first, ids('{"a":'), peaked(list(ids('{"a":3'))))
    resume = Resume(round=first.round, committed=first.committed, digest=first.digest, committed_tokens="mlc://x/t")
    resumed = VerifierSession(
        session=SESSION,
        epoch=2,
        contract=first.contract,
        prompt=PROMPT,
        resume=resume,
        committed_tokens=first.tokens,
        constraint=json_grammar(),
    )
    assert first.constraint is not None and resumed.constraint is not None
    assert np.array_equal(resumed.constraint.allowed(()), first.constraint.allowed(()))
    with pytest.raises(BadMessage, match="outside the constraint"):
        VerifierSession(
            session=SESSION,
            epoch=2,
            contract=first.contract,
            prompt=PROMPT,
            resume=resume,
            committed_tokens=first.tokens,
            constraint=grammar("regex", "[0-9]+"),
        )
