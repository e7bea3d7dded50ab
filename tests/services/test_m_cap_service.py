"""SDCP 6.5.1 through a real verifier service: m_cap follows the measured pass costs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.services.router_harness import greedy_reference as transformers_greedy
from tests.services.verifier_harness import (
    DRAFTER,
    PROMPT,
    SESSION,
    Cluster,
    advance,
    contract,
    open_and_assign,
    proposal,
    running_cluster,
)

from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol.drafter import AcceptanceEstimate
from sdcp.protocol.messages import Assignment, Verdict, session_path_id


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")


@pytest.fixture
async def cluster(tmp_path: Path, target: TargetModel) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path, target) as env:
        yield env


@pytest.mark.pass_costs
async def test_m_cap_follows_the_pass_costs_and_the_acceptance(cluster: Cluster, target: TargetModel) -> None:
    """SDCP 6.5.1: where each row costs as much as a pass, even proposals accepted in full are not
    worth a second token, and m_cap falls to 1; where rows cost little, it is restored a round at a
    time."""
    greedy_reference = transformers_greedy(target, 12)
    curve = cluster.node.engine.pass_curves.base
    state = await open_and_assign(cluster, contract(target, m_max=4, max_new=12))
    drafter = cluster.client("drafter")
    m_caps = []
    committed = 0
    for costly in (True, True, False, False, False):
        # Set before each round: the curve also learns from the passes served here.
        costs = [10.0, 20.0, 40.0, 80.0, 160.0, 320.0] if costly else [10.0, 10.1, 10.2, 10.4, 10.8, 11.6]
        curve.points_ms = costs
        tokens = tuple(greedy_reference[committed : committed + 1])
        status, body = await drafter.post_cbor("proposals", proposal(state, tokens).to_obj(), idempotent=True)
        assert status == 200
        verdict = Verdict.from_obj(body)
        committed += len(verdict.emitted)
        state = advance(state, verdict)
        m_caps.append(verdict.m_cap)
    assert m_caps == [1, 1, 2, 3, 4]


@pytest.mark.pass_costs
async def test_another_drafters_acceptance_starts_afresh(cluster: Cluster, target: TargetModel) -> None:
    """The acceptance that caps m_cap is the current drafter's: a rejected proposal lowers it, and
    an assignment to another drafter starts it again from the prior; the same drafter's again
    keeps it."""
    state = await open_and_assign(cluster, contract(target, m_max=4, max_new=12))
    wrong = (transformers_greedy(target, 1)[0] + 1) % target.vocab_size
    status, body = await cluster.client("drafter").post_cbor(
        "proposals", proposal(state, (wrong, wrong)).to_obj(), idempotent=True
    )
    assert status == 200
    state = advance(state, Verdict.from_obj(body))
    live = cluster.node.engine.sessions[SESSION]
    lowered = live.acceptance.alpha
    assert lowered < AcceptanceEstimate().alpha

    async def assign(drafter: str) -> None:
        assignment = Assignment(
            session=SESSION,
            epoch=1,
            contract=live.machine.contract,
            verifier=cluster.node.uri,
            drafter=drafter,
            prompt=PROMPT,
            round=state.round,
            committed=state.committed,
            digest=state.digest,
            m_init=4,
        )
        status, _ = await cluster.client("router").put_cbor(
            f"sessions/{session_path_id(SESSION)}/drafter", assignment.to_obj()
        )
        assert status == 200

    await assign(DRAFTER)
    assert live.acceptance.alpha == lowered
    await assign("https://127.0.0.1:3")
    assert live.acceptance.alpha == AcceptanceEstimate().alpha
