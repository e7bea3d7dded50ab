"""The drafter service over real HTTP/2 + mTLS (SDCP Table 1, 6.1, 6.2, 6.3, 6.9).

The test plays the router with the router's certificate; the verifier is the real verifier
service on the tiny target, the drafter the n-gram drafter or the tiny-draft HF model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from tests.services.drafter_harness import (
    PROMPT,
    ROUTER,
    STRANGER,
    Env,
    env,
    greedy,
    make_assignment,
    make_contract,
    read_all_output,
    target,
    verifier_node,
)

from sdcp.cache import ObjectNotFound, build_uri
from sdcp.config import DrafterConfig
from sdcp.engines.drafter import confirmed_predraft, q_rows_uri
from sdcp.models.drafter import DraftResult
from sdcp.models.errors import UnknownModel
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.models.lookup.ngram import NgramDrafter
from sdcp.models.registry import target_vocab_size
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.messages import (
    Action,
    Contract,
    Proposal,
    Role,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
    session_path_id,
)
from sdcp.protocol.problems import BadContract, ProblemType, ProtocolError
from sdcp.services.drafter import DrafterNode
from sdcp.services.verifier import VerifierNode

__all__ = ["env", "target"]  # fixtures, from the drafter service tests' harness

pytestmark = pytest.mark.timeout(90)

VOCAB = 257


async def drafter_node(env: Env, model: str = "ngram", lease_s: float = 30.0) -> DrafterNode:
    node = DrafterNode(env.config(env.drafter_uri, drafter=DrafterConfig(model=model, target="tiny", lease_s=lease_s)))
    await node.start()
    return node


async def open_session(env: Env, contract: Contract, session: bytes) -> SessionState:
    """As the router: open the session at the verifier and name the drafter there (SDCP 6.1)."""
    router = env.client(env.verifier_uri, ROUTER)
    log_uri = build_uri("local", None, "log", session.hex())
    opened = SessionOpen(session=session, epoch=1, contract=contract, prompt=PROMPT, commit_log=log_uri)
    status, body = await router.post_cbor("sessions", opened.to_obj())
    assert status == 201
    await router.put_cbor(
        f"sessions/{session_path_id(session)}/drafter", make_assignment(env, contract, session).to_obj()
    )
    return SessionState.from_obj(body)


async def wait_for(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001 - async predicate
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def metric(name: str, instance: str) -> float:
    return REGISTRY.get_sample_value(name, {"instance": instance}) or 0.0


def metric_of(name: str, instance: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"instance": instance, **labels}) or 0.0


# -- assignments without a verifier: authorization, contract checks, epochs, rows under lease ------


async def test_assignments_are_admitted_from_the_router_only(env: Env, target: TargetModel) -> None:
    node = await drafter_node(env)
    try:
        assignment = make_assignment(env, make_contract(target), os.urandom(16)).to_obj()
        with pytest.raises(ProtocolError) as refused:
            await env.client(env.drafter_uri, STRANGER).post_cbor("assignments", assignment)
        assert refused.value.status == 403
        assert not node.engine.runs
        status, body = await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment)
        assert (status, body) == (204, None)
        assert len(node.engine.runs) == 1
    finally:
        await node.stop()


@pytest.mark.parametrize(
    "overrides",
    [{"rule": 99}, {"drafters": [bytes(32)]}],
    ids=["unregistered-rule", "drafter-not-permitted"],
)
async def test_unsupported_contracts_are_refused(env: Env, target: TargetModel, overrides: dict[str, object]) -> None:
    node = await drafter_node(env)
    try:
        assignment = make_assignment(env, make_contract(target, **overrides), os.urandom(16))
        with pytest.raises(BadContract) as refused:
            await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
        assert refused.value.status == 422
        assert refused.value.problem is ProblemType.BAD_CONTRACT
        assert not node.engine.runs
    finally:
        await node.stop()


async def test_permitted_drafter_and_older_epochs(env: Env, target: TargetModel) -> None:
    node = await drafter_node(env)
    try:
        contract = make_contract(target, drafters=[bytes(32), NgramDrafter(VOCAB).weights_digest])
        session = os.urandom(16)
        router = env.client(env.drafter_uri, ROUTER)
        status, _ = await router.post_cbor("assignments", make_assignment(env, contract, session, epoch=2).to_obj())
        assert status == 204
        first = node.engine.runs[session]
        with pytest.raises(ProtocolError) as stale:
            await router.post_cbor("assignments", make_assignment(env, contract, session, epoch=1).to_obj())
        assert stale.value.problem is ProblemType.STALE_EPOCH
        assert node.engine.runs[session] is first
        # A new assignment at the same epoch replaces the previous one, whose loop stops first.
        status, _ = await router.post_cbor("assignments", make_assignment(env, contract, session, epoch=2).to_obj())
        assert status == 204
        assert node.engine.runs[session] is not first
        assert first.task is not None and first.task.done()
    finally:
        await node.stop()


async def test_rule_2_rows_are_leased_until_the_verdict(env: Env, target: TargetModel) -> None:
    # No verifier listens: the proposal goes unanswered and is retried (SDCP 6.9) while the
    # rows stay in the MLC under the drafter's lease.
    node = await drafter_node(env)
    try:
        contract = make_contract(target, rule=2, sampling={"temperature_milli": 1000})
        assignment = make_assignment(env, contract, os.urandom(16))
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
        uri = q_rows_uri(env.mlc, assignment, 1)

        async def leased() -> bool:
            # The rows are written, then leased: a busy machine runs the test between the two.
            return env.drafter_uri in await env.mlc.lease_holders(uri)

        await wait_for(leased)
        rows = np.frombuffer(await env.mlc.get(uri), dtype="<f4").reshape(-1, VOCAB)
        assert 1 <= rows.shape[0] <= 4  # m_init
        # n-gram rows are one-hot: the exact distribution of its deterministic draw.
        assert np.array_equal(rows.sum(axis=1), np.ones(rows.shape[0], dtype=np.float32))
        assert np.array_equal(np.count_nonzero(rows, axis=1), np.ones(rows.shape[0]))
        lease = await env.mlc.renew(uri, env.drafter_uri, 30.0)
        assert lease.holder == env.drafter_uri
    finally:
        await node.stop()
    # Stopping the session loop gives the rows up.
    with pytest.raises(ObjectNotFound):
        await env.mlc.get(uri)


async def test_status_reports_the_drafter(env: Env, target: TargetModel) -> None:
    node = await drafter_node(env)
    try:
        status = node.status()
        assert status.instance == env.drafter_uri
        assert status.role is Role.DRAFTER
        assert 0 <= status.load <= 100
        assert status.queue == 0
        assert status.accept_milli is None  # no verdict yet
        assert status.ttl_ms == 60_000
        assert status.model == NgramDrafter(VOCAB).weights_digest
        assert status.history is None  # prompt lookup keeps no shared history
    finally:
        await node.stop()


def test_target_vocabulary_from_configuration_only(tmp_path: Path) -> None:
    assert target_vocab_size("tiny") == VOCAB
    tiny_model().config.save_pretrained(tmp_path)
    assert target_vocab_size(str(tmp_path)) == VOCAB
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(UnknownModel, match="names no vocab_size"):
        target_vocab_size(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnknownModel, match="not a readable model configuration"):
        target_vocab_size(str(tmp_path))


# -- against the real verifier service --------------------------------------------------------------


async def test_greedy_session_runs_to_the_end(env: Env, target: TargetModel) -> None:
    verifier = await verifier_node(env, target)
    drafter = await drafter_node(env)
    try:
        contract = make_contract(target)
        session = os.urandom(16)
        await open_session(env, contract, session)
        proposals_before = metric("sdcp_drafter_proposals_total", env.drafter_uri)
        assignment = make_assignment(env, contract, session)
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
        output = await asyncio.wait_for(read_all_output(env, session), 60)
        # SDCP 6.4 rule 1: whatever the drafter proposes, the output is the target's greedy decoding.
        assert output == greedy(target, PROMPT, contract.max_new)
        await wait_for(lambda: _no_runs(drafter))
        assert metric("sdcp_drafter_proposals_total", env.drafter_uri) > proposals_before
        assert metric("sdcp_drafter_tokens_accepted_total", env.drafter_uri) <= metric(
            "sdcp_drafter_tokens_proposed_total", env.drafter_uri
        )
    finally:
        await drafter.stop()
        await verifier.stop()


class OracleDrafter:
    """Proposes the tiny target's greedy continuation (its own copy of the model): every draft is
    accepted in full."""

    name = "oracle"
    runs_inline = False
    seconds_per_token = 0.001

    def set_threads(self, threads: int) -> None:
        return None  # one thread, the caller's

    def __init__(self, target: TargetModel) -> None:
        self.target = target
        self.vocab_size = target.vocab_size
        self.weights_digest = target.weights_digest
        self.sessions: dict[bytes, list[int]] = {}

    def prepare(self) -> None:
        return None

    def open_session(self, session: bytes, prompt_tokens: tuple[int, ...]) -> None:
        self.sessions[session] = list(prompt_tokens)

    def sync(self, session: bytes, committed_tokens: list[int]) -> None:
        self.sessions[session] = list(committed_tokens)

    def draft(self, session: bytes, m: int, sampling: object, rng: object = None) -> DraftResult:
        tokens = tuple(greedy(self.target, tuple(self.sessions[session]), m))
        # Drafted tokens stay tentative until `sync`, as in the real drafters: a pre-draft follows them.
        self.sessions[session].extend(tokens)
        rows = np.zeros((m, self.vocab_size), dtype=np.float32)
        rows[np.arange(m), tokens] = 1.0
        return DraftResult(tokens, rows, self.seconds_per_token * m)

    def close_session(self, session: bytes) -> None:
        self.sessions.pop(session, None)


async def test_proposals_grow_to_m_max_while_drafts_are_accepted(env: Env, target: TargetModel) -> None:
    """A proposal made from a pre-draft (SDCP 6.2) may be longer than the one before it: M follows
    the cost model up to m_max, not the length of the first proposal."""
    verifier = await verifier_node(env, target)
    oracle = OracleDrafter(TargetModel(tiny_model(), tiny_tokenizer(), name="tiny"))
    drafter = DrafterNode(env.config(env.drafter_uri, drafter=DrafterConfig(target="tiny")), drafter=oracle)
    await drafter.start()
    try:
        contract = make_contract(target, max_new=40)
        session = os.urandom(16)
        await open_session(env, contract, session)
        assignment = make_assignment(env, contract, session, m_init=1)
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
        assert await asyncio.wait_for(read_all_output(env, session), 60) == greedy(target, PROMPT, contract.max_new)
        _, stats = await env.client(env.verifier_uri, STRANGER).get_cbor(f"sessions/{session_path_id(session)}/stats")
        assert isinstance(stats, dict)
        assert stats["accepted"] == stats["proposed"]
        assert len(stats["proposed_by_position"]) == contract.m_max
    finally:
        await drafter.stop()
        await verifier.stop()


async def test_speculative_sampling_with_an_hf_drafter(env: Env, target: TargetModel) -> None:
    verifier = await verifier_node(env, target)
    drafter = await drafter_node(env, model="hf:tiny-draft")
    try:
        contract = make_contract(target, rule=2, sampling={"temperature_milli": 800, "seed": 7}, max_new=16)
        session = os.urandom(16)
        await open_session(env, contract, session)
        assignment = make_assignment(env, contract, session)
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
        output = await asyncio.wait_for(read_all_output(env, session), 60)
        assert len(output) == contract.max_new
        assert all(0 <= token < VOCAB for token in output)
        await wait_for(lambda: _no_runs(drafter))
        # Every round's rows were released and deleted after their verdict.
        for round_number in range(1, contract.max_new + 1):
            assert not await env.mlc.exists(q_rows_uri(env.mlc, assignment, round_number))
    finally:
        await drafter.stop()
        await verifier.stop()


@pytest.mark.parametrize(
    "outdated",
    [
        "prefix",
        "round",
        "prefix, a verifier without session_state",
        "prefix, a verifier with session_state in its own encoding",
    ],
)
async def test_stale_assignment_resyncs_from_the_verifier(
    env: Env, target: TargetModel, outdated: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if "session_state" in outdated:
        # Another implementation's verifier: sdcp-stale-base with no session-state member, or with
        # one that is not ours (here JSON), which the drafter reads as absent (SDCP 6.3).
        encode = ProtocolError.to_problem

        def foreign_state(error: ProtocolError) -> dict[str, object]:
            body = encode(error)
            if body.pop("session_state", None) is not None and "own encoding" in outdated:
                assert error.state is not None
                state = {"round": error.state.round, "committed": error.state.committed}
                body["session_state"] = json.dumps(state)
            return body

        monkeypatch.setattr(ProtocolError, "to_problem", foreign_state)
    verifier = await verifier_node(env, target)
    drafter = await drafter_node(env)
    # The first drafter's proposals from the third committed token on never reach the verifier, so
    # the session stands still below max_new however fast the machine decodes.
    first_drafter_gone = False
    propose = verifier.engine.propose

    async def held_from_the_third_token(proposal: Proposal, sender: str | None) -> Verdict:
        if proposal.base >= 3 and not first_drafter_gone:
            await asyncio.Event().wait()
        return await propose(proposal, sender)

    monkeypatch.setattr(verifier.engine, "propose", held_from_the_third_token)
    try:
        contract = make_contract(target, max_new=30)
        session = os.urandom(16)
        await open_session(env, contract, session)
        await env.client(env.drafter_uri, ROUTER).post_cbor(
            "assignments", make_assignment(env, contract, session).to_obj()
        )
        live = verifier.engine.sessions[session].machine
        await wait_for(lambda: _at_least(live, 3))
        await drafter.stop()
        first_drafter_gone = True
        drafter = await drafter_node(env)
        await wait_for(lambda: _idle(live))
        assert 3 <= live.committed < contract.max_new
        state = live.state()
        if outdated.startswith("prefix"):
            # The current round on an outdated prefix: the verifier answers sdcp-stale-base with
            # its session-state and the drafter reads the missing tokens from the output.
            stale = make_assignment(env, contract, session, round=state.round)
        else:
            # The current prefix with an outdated round: the verifier replays the verdicts of
            # decided rounds (SDCP 6.3 Idempotency), which answer other bases.
            stale = make_assignment(env, contract, session, committed=state.committed, digest=state.digest)
        resyncs_before = metric("sdcp_drafter_resyncs_total", env.drafter_uri)
        # A fresh client: the pooled connection went down with the first drafter node.
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", stale.to_obj())
        output = await asyncio.wait_for(read_all_output(env, session), 60)
        assert output == greedy(target, PROMPT, contract.max_new)
        assert metric("sdcp_drafter_resyncs_total", env.drafter_uri) > resyncs_before
        assert extend_digest(prefix_digest(contract.digest, PROMPT), output) == live.digest
    finally:
        await drafter.stop()
        await verifier.stop()


async def test_committed_tokens_by_reference_are_checked(env: Env, target: TargetModel) -> None:
    verifier = await verifier_node(env, target)
    drafter = await drafter_node(env)
    try:
        contract = make_contract(target, max_new=30)
        session = os.urandom(16)
        await open_session(env, contract, session)
        router = env.client(env.drafter_uri, ROUTER)
        await router.post_cbor("assignments", make_assignment(env, contract, session).to_obj())
        live = verifier.engine.sessions[session].machine
        await wait_for(lambda: _at_least(live, 4))
        await drafter.stop()
        drafter = await drafter_node(env)
        # A committed_tokens object that does not match `committed`: the drafter must not trust
        # it and reads the committed output from the verifier instead.
        state = live.state()
        bogus = build_uri("local", None, "tokens", session.hex())
        await env.mlc.put(bogus, bytes([0x83, 1, 2, 3]))
        handover = make_assignment(
            env,
            contract,
            session,
            round=state.round,
            committed=state.committed,
            digest=state.digest,
            committed_tokens=bogus,
        )
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", handover.to_obj())
        output = await asyncio.wait_for(read_all_output(env, session), 60)
        assert output == greedy(target, PROMPT, contract.max_new)
    finally:
        await drafter.stop()
        await verifier.stop()


async def _no_runs(node: DrafterNode) -> bool:
    return not node.engine.runs


async def _idle(machine: object) -> bool:
    return not machine.verifying  # type: ignore[attr-defined]


async def _at_least(machine: object, count: int) -> bool:
    return machine.committed >= count  # type: ignore[attr-defined]


async def test_proposals_are_retried_until_the_verifier_answers(
    env: Env, target: TargetModel, caplog: pytest.LogCaptureFixture
) -> None:
    # SDCP 6.9: the drafter asks again for a verdict it did not receive; here the verifier is
    # down when the first proposals are sent and comes up later.
    caplog.set_level(logging.INFO, logger="sdcp.drafter")
    drafter = await drafter_node(env)
    verifier: VerifierNode | None = None
    try:
        contract = make_contract(target)
        session = os.urandom(16)
        assignment = make_assignment(env, contract, session).to_obj()
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment)
        await wait_for(_asked_again(caplog), timeout=10)
        assert session in drafter.engine.runs
        verifier = await verifier_node(env, target)
        await open_session(env, contract, session)
        # SDCP 6.2: a router sends the assignment after informing the verifier; one the drafter got
        # before (as here) can race ahead of it and be refused with sdcp-not-assigned, which stops
        # the drafter. The assignment sent now restarts it if so (and replaces the run otherwise).
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment)
        output = await asyncio.wait_for(read_all_output(env, session), 60)
        assert output == greedy(target, PROMPT, contract.max_new)
    finally:
        await drafter.stop()
        if verifier is not None:
            await verifier.stop()


def _asked_again(caplog: pytest.LogCaptureFixture):  # noqa: ANN202 - an async predicate for wait_for
    async def asked() -> bool:
        return any("asking again" in record.getMessage() for record in caplog.records)

    return asked


def _verdict(proposal: Proposal, accepted: int, emitted: tuple[int, ...]) -> Verdict:
    return Verdict(
        session=proposal.session,
        epoch=1,
        round=proposal.round,
        accepted=accepted,
        emitted=emitted,
        committed=proposal.base + len(emitted),
        digest=bytes(32),
        action=Action.CONTINUE,
        m_cap=4,
        low=0,
        load=0,
    )


def test_a_predraft_is_used_only_when_the_verdict_confirms_it() -> None:
    status = Status(instance="https://127.0.0.1:2", role=Role.DRAFTER, load=0, queue=0, ttl_ms=1000)
    proposal = Proposal(
        session=bytes(16),
        epoch=1,
        round=1,
        drafter="https://127.0.0.1:2",
        base=0,
        base_digest=bytes(32),
        tokens=(5, 6),
        status=status,
    )
    rows = np.eye(VOCAB, dtype=np.float32)[[7, 8, 9, 10]]
    predraft = DraftResult((7, 8, 9, 10), rows, 0.0)
    ready = confirmed_predraft(proposal, _verdict(proposal, 2, (5, 6, 7)), predraft, m=2)
    assert ready is not None
    assert ready.tokens == (8, 9)
    assert np.array_equal(ready.q_rows, rows[1:3])
    # The extra token differs from the guess, or a proposed token was rejected: draft afresh.
    assert confirmed_predraft(proposal, _verdict(proposal, 2, (5, 6, 3)), predraft, m=2) is None
    assert confirmed_predraft(proposal, _verdict(proposal, 1, (5, 7)), predraft, m=2) is None
    assert confirmed_predraft(proposal, _verdict(proposal, 2, (5, 6, 7)), None, m=2) is None


class CountingOracle(OracleDrafter):
    """The oracle, counting its drafts: one per proposal without pre-drafting."""

    def __init__(self, target: TargetModel) -> None:
        super().__init__(target)
        self.drafts = 0

    def draft(self, session: bytes, m: int, sampling: object, rng: object = None) -> DraftResult:
        self.drafts += 1
        return super().draft(session, m, sampling, rng)


@pytest.mark.parametrize("predraft", [True, False])
async def test_predrafting_can_be_turned_off(env: Env, target: TargetModel, predraft: bool) -> None:
    """[drafter] predraft: off, every proposal is drafted after its verdict and none is
    pre-drafted; the output is the same (SDCP 6.2: pre-drafting MAY be done). On, a confirmed
    pre-draft is sent as the next proposal. Either way the gap from each verdict to the next
    proposal is observed."""
    verifier = await verifier_node(env, target)
    oracle = CountingOracle(TargetModel(tiny_model(), tiny_tokenizer(), name="tiny"))
    settings = DrafterConfig(target="tiny", predraft=predraft)
    drafter = DrafterNode(env.config(env.drafter_uri, drafter=settings), drafter=oracle)
    await drafter.start()
    try:
        before = {
            outcome: metric_of("sdcp_drafter_predrafts_total", env.drafter_uri, outcome=outcome)
            for outcome in ("used", "discarded")
        }
        proposals_before = metric("sdcp_drafter_proposals_total", env.drafter_uri)
        gaps_before = metric("sdcp_drafter_verdict_to_proposal_seconds_count", env.drafter_uri)
        contract = make_contract(target, max_new=24)
        session = os.urandom(16)
        await open_session(env, contract, session)
        assignment = make_assignment(env, contract, session, m_init=2)
        await env.client(env.drafter_uri, ROUTER).post_cbor("assignments", assignment.to_obj())
        assert await asyncio.wait_for(read_all_output(env, session), 60) == greedy(target, PROMPT, contract.max_new)
        await wait_for(lambda: _no_runs(drafter))
        proposals = metric("sdcp_drafter_proposals_total", env.drafter_uri) - proposals_before
        used = metric_of("sdcp_drafter_predrafts_total", env.drafter_uri, outcome="used") - before["used"]
        discarded = (
            metric_of("sdcp_drafter_predrafts_total", env.drafter_uri, outcome="discarded") - before["discarded"]
        )
        # Every proposal but the first follows a verdict.
        assert metric("sdcp_drafter_verdict_to_proposal_seconds_count", env.drafter_uri) - gaps_before == proposals - 1
        if predraft:
            # Every draft of the oracle is accepted and its guess of the extra token is right:
            # every proposal after the first is a pre-draft (the last verdict ends the session).
            assert used == proposals - 1 and discarded == 0
            # The first proposal, then one pre-draft a round (the last one's unused).
            assert oracle.drafts == proposals + 1
        else:
            assert used == discarded == 0
            assert oracle.drafts == proposals
    finally:
        await drafter.stop()
        await verifier.stop()
