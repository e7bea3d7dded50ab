"""Penalties and logit_bias through the router, verifiers and drafters over HTTP/2 + mTLS
(docs/interpretations.md, "Penalties, logit_bias and min_p"): whatever the n-gram or model drafter
proposes (the n-gram drafter proposes repeats of earlier text, which the penalties count at every
position of a proposal), the output is the penalised target's greedy decoding under rule 1, and
under rule 2 at temperature 0; a failover keeps the penalties, which travel in the contract."""

from __future__ import annotations

import numpy as np
import pytest
from tests.protocol.shaping_reference import reference_logits
from tests.services.outputs import output_tokens, read_output
from tests.services.router_harness import (
    PROMPT,
    Deployment,
    deployment,
    open_session,
    start_drafter,
    start_verifier,
    target,
    tiny_contract,
)
from tests.waiting import eventually, eventually_async

from sdcp.config import DrafterConfig
from sdcp.models.hf.target import TargetModel
from sdcp.protocol.messages import Action, Sampling, session_path_id
from sdcp.services.drafter import DrafterNode

__all__ = ["deployment", "target"]  # fixtures, from the router service tests' harness

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 32
PENALTIES = Sampling(
    presence_penalty_milli=500,
    frequency_penalty_milli=800,
    repetition_penalty_milli=1300,
    logit_bias_milli=((PROMPT[1], 2000),),
)


def profile(rule: int) -> dict[str, object]:
    """The contract's sampling member: the penalties, and under rule 2 temperature 0 (p one-hot at
    the penalised argmax, so that the output is known) with a seed."""
    sampling = PENALTIES.to_obj()
    return {"sampling": sampling if rule == 1 else {**sampling, "temperature_milli": 0, "seed": 3}}


def penalised_greedy(target: TargetModel, count: int) -> list[int]:
    """Greedy decoding of the penalised tiny target after PROMPT, one token per pass, shaped by the
    reference written from the definitions."""
    reference = TargetModel(target.model, target.tokenizer, name="tiny")
    session = b"penalised-greedy"
    reference.open_session(session, PROMPT)
    tokens: list[int] = []
    while len(tokens) < count:
        (rows,) = reference.score([(session, ())])
        tokens.append(int(np.argmax(reference_logits(rows[0], PROMPT, tokens, PENALTIES))))
        reference.commit(session, 0, tokens[-1:])
    return tokens


async def test_the_output_is_the_penalised_targets_whoever_drafts(deployment: Deployment, target: TargetModel) -> None:
    verifier = await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    model_drafter = DrafterNode(
        deployment.config("drafter2", drafter=DrafterConfig(model="hf:tiny-draft", target="tiny"))
    )
    await deployment.start(model_drafter)
    expected = penalised_greedy(target, MAX_NEW)
    for rule in (1, 2):
        for drafter in (None, model_drafter.engine.drafter.weights_digest):
            extra = {} if drafter is None else {"drafters": [drafter]}
            opened = await open_session(
                deployment, tiny_contract(target, rule=rule, max_new=MAX_NEW, **profile(rule), **extra)
            )
            session = opened["session"]
            assert isinstance(session, bytes)
            outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
            assert outputs[-1].finish == Action.FINISH
            # SDCP 6.4: the penalised target's greedy decoding, whatever was proposed.
            assert output_tokens(outputs) == expected, (rule, drafter)
            assert verifier.engine.sessions[session].machine.stats.rounds > 0


@pytest.mark.parametrize("rule", [1, 2])
async def test_a_failover_keeps_the_penalties(deployment: Deployment, target: TargetModel, rule: int) -> None:
    first = await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    opened = await open_session(deployment, tiny_contract(target, rule=rule, max_new=MAX_NEW, **profile(rule)))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] == first.uri
    second = await start_verifier(deployment, "verifier2")
    before = await read_output(deployment.client("frontend", peer="verifier1"), session, until=4)
    assert not before[-1].final, "the session finished before the verifier could be stopped"
    await deployment.stop(first)

    frontend = deployment.client("frontend")

    async def moved() -> bool:
        _, described = await frontend.get_cbor(f"sessions/{session_path_id(session)}")
        return isinstance(described, dict) and described["verifier"] == second.uri

    await eventually_async(moved)
    await eventually(lambda: session in second.engine.sessions)
    after = await read_output(deployment.client("frontend", peer="verifier2"), session)
    assert {output.epoch for output in after} == {2} and after[-1].finish == Action.FINISH
    tokens = output_tokens(after)
    assert tokens[: len(output_tokens(before))] == output_tokens(before)
    assert tokens == penalised_greedy(target, MAX_NEW)
