"""Structured output through the verifier engine (docs/interpretations.md, "Structured output"): the
tiny random target self-decodes under a JSON schema, its greedy runs and lookahead guided by the
grammar, and a failover hands the session to a second verifier, which resumes the grammar after the
committed tokens. Under rule 1 the output is greedy decoding of the masked target, under rule 2
(seeded) the draws from the masked distribution; every output parses and validates.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from tests.engines.verifier_pair import EOT, PROMPT, SESSION, Pair, decode, fail_over, self_decoding_contract

from sdcp.grammar import GrammarConstraint, grammar_tokenizer
from sdcp.models.batching import TargetMostProbable
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.constraint import constrain_rows
from sdcp.protocol.messages import Action, Constraint, Sampling, SessionOpen
from sdcp.protocol.problems import BadContract
from sdcp.protocol.router import RouterSession
from sdcp.protocol.rules import PURPOSE_EXTRA_TOKEN, verifier_random
from sdcp.protocol.sampling import draw_token, target_distribution
from sdcp.protocol.shaping import TargetLogits

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 96
# Tokens self-decoded per period: the first verifier stops after one period.
SELF_MAX = 10
# Bounded strings and numbers: a random model's text ends within MAX_NEW.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["alpha", "beta"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "kind", "ok"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint(kind="json_schema", text=json.dumps(SCHEMA))
SEED = 20261130
SAMPLING = Sampling(temperature_milli=800, seed=SEED)


def reference(loaded: LoadedModel, rule: int) -> tuple[int, ...]:
    """The masked target's decoding of PROMPT, one token per pass, written from the definition:
    rule 1 the most probable allowed token, rule 2 a draw from the restricted distribution with the
    verifier's seeded value of the token's round (each self-decoded token is a round of its own)."""
    target = TargetModel(loaded.model, loaded.tokenizer, name="tiny")
    grammar = GrammarConstraint(
        grammar_tokenizer(target.tokenizer_definition, target.vocab_size), CONSTRAINT, [EOT], target.vocab_size
    )
    target.open_session(SESSION, PROMPT)
    tokens: list[int] = []
    while not tokens or tokens[-1] != EOT:
        (rows,) = target.score([(SESSION, ())])
        row = constrain_rows(rows[:1], grammar.allowed(()), len(tokens), 0, [EOT])[0]
        if rule == 1:
            token = int(np.argmax(row))
        else:
            r = verifier_random(SEED, SESSION, len(tokens) + 1, 1, PURPOSE_EXTRA_TOKEN)
            token = draw_token(target_distribution(row, SAMPLING), r)
        tokens.append(token)
        grammar.commit([token])
        target.commit(SESSION, 0, [token])
    return tuple(tokens)


@pytest.mark.parametrize("rule", [1, 2])
async def test_a_constrained_session_fails_over_and_its_output_validates(
    pair: Pair, tiny_loaded: LoadedModel, rule: int
) -> None:
    assert isinstance(pair.first.target, TargetModel)
    contract = self_decoding_contract(
        pair.first.target, rule, max_new=MAX_NEW, self_max=SELF_MAX, sampling=SAMPLING if rule == 2 else None
    )
    plan = RouterSession(
        session=SESSION,
        epoch=1,
        contract=contract,
        prompt=PROMPT,
        commit_log=pair.commit_log,
        verifier=pair.first.uri,
        constraint=CONSTRAINT,
    )
    passes_before = pair.first.scorer.batches_run + pair.second.scorer.batches_run
    await pair.first.open_session(plan.open_message())
    await decode(pair.first, 1, SELF_MAX)
    assert pair.first.sessions[SESSION].machine.committed == SELF_MAX

    await fail_over(pair, plan)
    await decode(pair.second, 2, MAX_NEW)

    output = await pair.second.output(SESSION, 0)
    assert output.final and output.finish == Action.FINISH
    assert output.tokens == reference(tiny_loaded, rule)
    # The tokens the grammar forces (the keys, the punctuation, the rest of an enum value) are
    # scored along with each pass: far fewer passes than tokens.
    passes = pair.first.scorer.batches_run + pair.second.scorer.batches_run - passes_before
    assert 2 * passes < len(output.tokens)
    assert output.tokens[-1] == EOT
    text = tiny_loaded.tokenizer.decode(list(output.tokens[:-1]))
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_a_constraint_the_verifier_cannot_compile_is_refused(pair: Pair) -> None:
    assert isinstance(pair.first.target, TargetModel)
    message = SessionOpen(
        session=SESSION,
        epoch=1,
        contract=self_decoding_contract(pair.first.target, 1, max_new=MAX_NEW, self_max=SELF_MAX),
        prompt=PROMPT,
        commit_log=pair.commit_log,
        constraint=Constraint(kind="regex", text="(["),
    )
    with pytest.raises(BadContract, match="constraint"):
        await pair.first.open_session(message)
    assert SESSION not in pair.first.sessions


def test_a_greedy_run_ends_at_a_proposed_stop_token(tiny_loaded: LoadedModel) -> None:
    """Self-decoding scores the stop token the grammar forces where the output is complete; the
    greedy run after that pass has nothing to feed: the picker stops it rather than commit a token
    after the stop token (which broke the scorer's thread)."""
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    choice = Constraint(kind="choice", text=json.dumps(["ab"]))
    grammar = GrammarConstraint(
        grammar_tokenizer(target.tokenizer_definition, target.vocab_size), choice, [EOT], target.vocab_size
    )
    forced = grammar.forced((), 8)
    complete = forced + grammar.forced(forced, 8)
    assert complete[-1] == EOT
    picker = TargetMostProbable(TargetLogits(prompt=PROMPT, stop=(EOT,), constraint=grammar), None)
    # Rows whose most probable tokens are the proposal and then some token after it.
    rows = np.zeros((len(complete) + 1, target.vocab_size), dtype=np.float32)
    for row, token in zip(rows, (*complete, 5), strict=True):
        row[token] = 10.0
    assert picker.follow(rows, complete) is None
