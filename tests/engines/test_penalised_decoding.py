"""Penalties, logit_bias and min_p through the verifier engine (docs/interpretations.md, "Penalties,
logit_bias and min_p"): the tiny random target self-decodes, under rule 1 with greedy runs that feed
the penalised argmax, and a failover hands the session to a second verifier, which resumes the
counts from the committed tokens. The output is, token for token, the decoding of the penalised
target that the reference in tests/protocol/shaping_reference.py writes from the definitions."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from tests.engines.verifier_pair import EOT, PROMPT, SESSION, Pair, decode, fail_over, self_decoding_contract
from tests.protocol.shaping_reference import reference_logits, reference_p

from sdcp.models.batching import BatchingScorer, TargetMostProbable
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.messages import Action, Sampling
from sdcp.protocol.router import RouterSession
from sdcp.protocol.rules import PURPOSE_EXTRA_TOKEN, verifier_random
from sdcp.protocol.sampling import draw_token
from sdcp.protocol.shaping import TargetLogits

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 48
SELF_MAX = 12
SEED = 20261202
PENALTIES = Sampling(
    presence_penalty_milli=600,
    frequency_penalty_milli=900,
    repetition_penalty_milli=1400,
    logit_bias_milli=((EOT, -100_000), (PROMPT[3], 1500)),
)
PROFILES = {1: PENALTIES, 2: dataclasses.replace(PENALTIES, temperature_milli=900, seed=SEED, min_p_milli=40)}


def reference(loaded: LoadedModel, rule: int, sampling: Sampling) -> tuple[int, ...]:
    """The penalised target's decoding of PROMPT, one token per pass: rule 1 the argmax of the
    reference's shaped row, rule 2 a draw from its p with the verifier's seeded value of the token's
    round (each self-decoded token is a round of its own)."""
    target = TargetModel(loaded.model, loaded.tokenizer, name="tiny")
    target.open_session(SESSION, PROMPT)
    tokens: list[int] = []
    while len(tokens) < MAX_NEW and (not tokens or tokens[-1] != EOT):
        (rows,) = target.score([(SESSION, ())])
        row = reference_logits(rows[0], PROMPT, tokens, sampling)
        if rule == 1:
            token = int(np.argmax(row))
        else:
            assert sampling.temperature_milli is not None and sampling.min_p_milli is not None
            p = reference_p(row, sampling.temperature_milli / 1000, sampling.min_p_milli / 1000)
            token = draw_token(p, verifier_random(SEED, SESSION, len(tokens) + 1, 1, PURPOSE_EXTRA_TOKEN))
        tokens.append(token)
        target.commit(SESSION, 0, [token])
    return tuple(tokens)


@pytest.mark.parametrize("rule", [1, 2])
async def test_a_penalised_session_fails_over_and_decodes_the_penalised_target(
    pair: Pair, tiny_loaded: LoadedModel, rule: int
) -> None:
    assert isinstance(pair.first.target, TargetModel)
    sampling = PROFILES[rule]
    plan = RouterSession(
        session=SESSION,
        epoch=1,
        contract=self_decoding_contract(pair.first.target, rule, max_new=MAX_NEW, self_max=SELF_MAX, sampling=sampling),
        prompt=PROMPT,
        commit_log=pair.commit_log,
        verifier=pair.first.uri,
    )
    await pair.first.open_session(plan.open_message())
    await decode(pair.first, 1, SELF_MAX)
    assert pair.first.sessions[SESSION].machine.committed == SELF_MAX

    await fail_over(pair, plan)
    await decode(pair.second, 2, MAX_NEW)

    output = await pair.second.output(SESSION, 0)
    assert output.final and output.finish == Action.FINISH
    expected = reference(tiny_loaded, rule, sampling)
    assert output.tokens == expected
    # The penalties change the output: the tiny target's plain decoding repeats itself.
    plain = reference(
        tiny_loaded, rule, Sampling(temperature_milli=sampling.temperature_milli, min_p_milli=sampling.min_p_milli)
    )
    assert expected != plain
    assert len(set(expected)) > len(set(plain))


async def test_a_greedy_run_feeds_the_penalised_argmax(tiny_loaded: LoadedModel) -> None:
    """The scorer's greedy run (TargetMostProbable) takes, step by step, the token the verifier
    decides under rule 1: counts advance with every token it feeds, repeats included."""
    sampling = PROFILES[1]
    expected = reference(tiny_loaded, 1, sampling)
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    target.open_session(SESSION, PROMPT)
    steps = 16
    scorer = BatchingScorer(target, window_s=0.0)
    with scorer:
        picker = TargetMostProbable(TargetLogits(prompt=PROMPT, stop=(EOT,)), sampling)
        run = scorer.score_ahead_async(SESSION, (), steps, frozenset({EOT}), picker)
        await asyncio.wait_for(run.rows, timeout=30)
        for step in run.steps:
            await asyncio.wait_for(step, timeout=30)
    assert tuple(run.fed) == expected[:steps]
