"""The verifier service over real HTTP/2 + mTLS (SDCP Table 1, 6.3, 6.7, 6.8, Table 2).

The test plays the router and the drafter with their own certificates, so every request is a real
one from an authenticated peer; the target is the tiny random-weight model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import cbor2
import numpy as np
import pytest
import torch
from tests.services.outputs import output_tokens, read_output
from tests.services.router_harness import greedy_reference as transformers_greedy
from tests.services.verifier_harness import (
    DRAFTER,
    PROMPT,
    SESSION,
    Cluster,
    advance,
    assign,
    contract,
    open_and_assign,
    proposal,
    running_cluster,
)
from tests.waiting import eventually, eventually_async
from torch.utils._python_dispatch import TorchDispatchMode

from sdcp.bench.redis_process import local_redis_server
from sdcp.cache import MLC, LogSnapshot, build_uri
from sdcp.config import InstanceConfig, MLCConfig, ServiceConfig, VerifierConfig
from sdcp.engines.verifier import selfdecode
from sdcp.engines.verifier.engine import OUTPUT_LINGER_TOKENS
from sdcp.localhost import free_port
from sdcp.models.batching import RUN_DELIVERY_STEPS
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol.digest import extend_digest
from sdcp.protocol.drafter import AcceptanceEstimate
from sdcp.protocol.messages import (
    MAX_OUTPUT_READS,
    Action,
    CancelRequest,
    Output,
    OutputBatch,
    OutputRead,
    OutputReads,
    Policy,
    Sampling,
    SessionOpen,
    SessionState,
    Verdict,
    session_path_id,
)
from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.protocol.records import session_terms
from sdcp.services.verifier import VerifierNode
from sdcp.transport.certs import make_certs
from sdcp.transport.client import SDCPClient
from sdcp.transport.errors import PeerServerError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")


@pytest.fixture(scope="module")
def greedy_reference(target: TargetModel) -> list[int]:
    return transformers_greedy(target, 12)


@pytest.fixture
async def cluster(tmp_path: Path, target: TargetModel) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path, target) as env:
        yield env


async def problem_of(call: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as err:
        await call  # type: ignore[misc]
    return err.value


async def test_greedy_session_equals_target_greedy_decoding(
    cluster: Cluster, target: TargetModel, greedy_reference: list[int]
) -> None:
    c = contract(target)
    state = await open_and_assign(cluster, c)
    drafter = cluster.client("drafter")
    rng = np.random.default_rng(1)
    committed: list[int] = []
    final = False
    m = 3
    while not final:
        tokens = tuple(int(t) for t in rng.integers(0, 257, size=m))
        if committed and rng.random() < 0.5:
            # Sometimes propose the true continuation, so that rounds accept several tokens.
            tokens = tuple(greedy_reference[len(committed) : len(committed) + m]) or tokens
        status, body = await drafter.post_cbor("proposals", proposal(state, tokens).to_obj(), idempotent=True)
        assert status == 200
        verdict = Verdict.from_obj(body)
        committed.extend(verdict.emitted)
        assert verdict.digest == extend_digest(state.digest, verdict.emitted)
        state = advance(state, verdict)
        m = min(3, verdict.m_cap)
        final = verdict.action == Action.FINISH
    assert committed == greedy_reference

    status, body = await drafter.get_cbor(f"sessions/{session_path_id(SESSION)}/output", {"from": "0"})
    output = Output.from_obj(body)
    assert output.tokens == tuple(greedy_reference) and output.final and output.finish == Action.FINISH
    for start in (3, 7, 11):
        _, body = await drafter.get_cbor(f"sessions/{session_path_id(SESSION)}/output", {"from": str(start)})
        assert Output.from_obj(body).tokens == tuple(greedy_reference[start:])

    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1,)).to_obj()))
    assert err.problem is ProblemType.SESSION_CLOSED and err.status == 410

    _, stats = await cluster.client("router").get_cbor(f"sessions/{session_path_id(SESSION)}/stats")
    assert isinstance(stats, dict)
    assert stats["committed"] == 12 and stats["drafter"] == DRAFTER and stats["state"] == Action.FINISH
    assert stats["rounds"] == state.round and stats["accepted"] <= stats["proposed"]


@pytest.mark.pass_costs
async def test_m_cap_follows_the_pass_costs_and_the_acceptance(
    cluster: Cluster, target: TargetModel, greedy_reference: list[int]
) -> None:
    """SDCP 6.5.1: where each row costs as much as a pass, even proposals accepted in full are not
    worth a second token, and m_cap falls to 1; where rows cost little, it is restored a round at a
    time."""
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

    await assign(cluster, live.machine.contract, state)
    assert live.acceptance.alpha == lowered
    await assign(cluster, live.machine.contract, state, drafter="https://127.0.0.1:3")
    assert live.acceptance.alpha == AcceptanceEstimate().alpha


async def test_duplicate_proposal_gets_the_identical_verdict(cluster: Cluster, target: TargetModel) -> None:
    state = await open_and_assign(cluster, contract(target))
    drafter = cluster.client("drafter")
    message = proposal(state, (1, 2, 3)).to_obj()
    first, second = await asyncio.gather(
        drafter.post_cbor("proposals", message), drafter.post_cbor("proposals", message)
    )
    again = await drafter.post_cbor("proposals", message)
    assert first == second == again


async def test_problem_types_of_a_proposal(cluster: Cluster, target: TargetModel) -> None:
    state = await open_and_assign(cluster, contract(target))
    drafter = cluster.client("drafter")
    intruder = cluster.client("intruder")

    err = await problem_of(intruder.post_cbor("proposals", proposal(state, (1,)).to_obj()))
    assert err.problem is ProblemType.NOT_ASSIGNED and err.status == 403
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1,), epoch=2).to_obj()))
    assert err.problem is ProblemType.STALE_EPOCH
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1,), base=1).to_obj()))
    assert err.problem is ProblemType.STALE_BASE and err.state is not None
    assert err.state.committed == 0 and err.state.digest == state.digest
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1, 2, 3, 4, 5)).to_obj()))
    assert err.problem is ProblemType.LIMIT and err.status == 422


async def test_only_the_router_opens_sessions_and_contract_must_match(cluster: Cluster, target: TargetModel) -> None:
    drafter = cluster.client("drafter")
    c = contract(target)
    opened = SessionOpen(session=SESSION, epoch=1, contract=c, prompt=PROMPT, commit_log="mlc://local/-/log/x")
    with pytest.raises(Exception) as err:
        await drafter.post_cbor("sessions", opened.to_obj())
    assert getattr(err.value, "status", None) == 403
    wrong = contract(target, target=b"\x00" * 32)
    router = cluster.client("router")
    bad = SessionOpen(session=SESSION, epoch=1, contract=wrong, prompt=PROMPT, commit_log="mlc://local/-/log/x")
    problem = await problem_of(router.post_cbor("sessions", bad.to_obj()))
    assert problem.problem is ProblemType.BAD_CONTRACT and problem.status == 422
    too_long = SessionOpen(
        session=SESSION,
        epoch=1,
        contract=contract(target, max_new=10**6),
        prompt=PROMPT,
        commit_log="mlc://local/-/log/x",
    )
    problem = await problem_of(router.post_cbor("sessions", too_long.to_obj()))
    assert problem.problem is ProblemType.BAD_CONTRACT


async def test_rule2_reads_rows_from_the_mlc_or_reports_them_unavailable(cluster: Cluster, target: TargetModel) -> None:
    c = contract(target, rule=2, sampling={"temperature_milli": 1000, "seed": 7})
    state = await open_and_assign(cluster, c)
    drafter = cluster.client("drafter")
    missing = build_uri("local", None, "q-rows", "missing")
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1, 2), q_rows=missing).to_obj()))
    assert err.problem is ProblemType.Q_UNAVAILABLE and err.status == 409

    rows = np.full((2, 257), 1.0 / 257, dtype="<f4")
    uri = build_uri("local", None, "q-rows", "round-1")
    await cluster.mlc.put(uri, rows.tobytes())
    status, body = await drafter.post_cbor("proposals", proposal(state, (1, 2), q_rows=uri).to_obj())
    verdict = Verdict.from_obj(body)
    assert status == 200 and verdict.round == 1 and 1 <= len(verdict.emitted) <= 3

    zero = rows.copy()
    zero[0, 4] = 0.0
    await cluster.mlc.put(uri, zero.tobytes())
    state = advance(state, verdict)
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (4, 2), q_rows=uri).to_obj()))
    assert err.problem is ProblemType.BAD_PROPOSAL


async def test_output_long_poll_wakes_on_commit(cluster: Cluster, target: TargetModel) -> None:
    state = await open_and_assign(cluster, contract(target))
    reader = cluster.client("router")
    drafter = cluster.client("drafter")
    path = f"sessions/{session_path_id(SESSION)}/output"
    waiting = asyncio.create_task(reader.get_cbor(path, {"from": "0"}))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    _, body = await drafter.post_cbor("proposals", proposal(state, (1,)).to_obj())
    verdict = Verdict.from_obj(body)
    _, out = await asyncio.wait_for(waiting, 5)
    output = Output.from_obj(out)
    assert output.tokens == verdict.emitted and output.epoch == 1 and not output.final
    _, empty = await reader.get_cbor(path, {"from": str(len(verdict.emitted))})
    assert Output.from_obj(empty).tokens == ()


def output_reads(*reads: tuple[bytes, int]) -> dict[str, object]:
    return OutputReads(reads=tuple(OutputRead(session=session, from_=start) for session, start in reads)).to_obj()


async def test_post_outputs_answers_each_read_as_its_get_would(tmp_path: Path, target: TargetModel) -> None:
    """POST outputs (extension): a read that its GET would refuse (a caller who is no party of the
    session: 403; a session not held here: 404) is refused at once; the others wait until one has
    news, and only reads with news are answered; a list that names a session twice, or too many, is
    a bad message."""
    async with running_cluster(tmp_path, target, output_wait_s=60.0) as env:
        state = await open_and_assign(env, contract(target))
        intruder, drafter = env.client("intruder"), env.client("drafter")
        unknown = bytes(16)
        _, body = await intruder.post_cbor("outputs", output_reads((SESSION, 0)))
        batch = OutputBatch.from_obj(body)
        assert batch.outputs == () and [(r.session, r.status) for r in batch.refused] == [(SESSION, 403)]
        _, body = await drafter.post_cbor("outputs", output_reads((SESSION, 0), (unknown, 0)))
        batch = OutputBatch.from_obj(body)
        assert batch.outputs == () and [(r.session, r.status) for r in batch.refused] == [(unknown, 404)]
        assert ProtocolError.from_problem({"type": batch.refused[0].type, "status": 404}).status == 404

        waiting = asyncio.create_task(drafter.post_cbor("outputs", output_reads((SESSION, 0))))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        _, body = await drafter.post_cbor("proposals", proposal(state, (1,)).to_obj())
        verdict = Verdict.from_obj(body)
        _, answered = await asyncio.wait_for(waiting, 30)
        (output,) = OutputBatch.from_obj(answered).outputs
        assert (output.session, output.from_, output.tokens, output.epoch) == (SESSION, 0, verdict.emitted, 1)

        twice = {"reads": [{"session": SESSION, "from": 0}] * 2}
        too_many = {"reads": [{"session": i.to_bytes(16, "big"), "from": 0} for i in range(MAX_OUTPUT_READS + 1)]}
        for malformed in (twice, too_many, {"reads": []}):
            err = await problem_of(drafter.post_cbor("outputs", malformed))
            assert err.problem is None and err.status == 400


async def propose_one(drafter: SDCPClient, state: SessionState) -> tuple[Verdict, SessionState]:
    """A proposal of one token: its verdict, and the session's state after it."""
    _, body = await drafter.post_cbor("proposals", proposal(state, (1,)).to_obj())
    verdict = Verdict.from_obj(body)
    return verdict, advance(state, verdict)


async def commit_while_it_lingers(
    drafter: SDCPClient, state: SessionState, later: asyncio.Task[tuple[int, object | None]], committed: list[int]
) -> Output:
    """Rounds until ``committed`` (the tokens after the read ``later`` began) holds
    OUTPUT_LINGER_TOKENS, the read waiting all along; then its answer."""
    while len(committed) < OUTPUT_LINGER_TOKENS:
        assert not later.done()
        verdict, state = await propose_one(drafter, state)
        committed.extend(verdict.emitted)
    _, out = await asyncio.wait_for(later, 30)
    return Output.from_obj(out)


async def test_a_reader_past_the_first_tokens_gathers_the_next_ones_in_one_answer(
    tmp_path: Path, target: TargetModel
) -> None:
    """With output_linger_ms longer than the test, a read from 0 answers with the first tokens at
    once, and a later read waits until 16 tokens are committed (OUTPUT_LINGER_TOKENS)."""
    async with running_cluster(tmp_path, target, output_wait_s=60.0, output_linger_ms=60_000.0) as env:
        state = await open_and_assign(env, contract(target, max_new=64, low_rounds=64))
        reader, drafter = env.client("router"), env.client("drafter")
        path = f"sessions/{session_path_id(SESSION)}/output"
        first = asyncio.create_task(reader.get_cbor(path, {"from": "0"}))
        verdict, state = await propose_one(drafter, state)
        _, out = await asyncio.wait_for(first, 30)
        assert Output.from_obj(out).tokens == verdict.emitted
        start = len(verdict.emitted)
        later = asyncio.create_task(reader.get_cbor(path, {"from": str(start)}))
        committed: list[int] = []
        output = await commit_while_it_lingers(drafter, state, later, committed)
        assert output.from_ == start and output.tokens == tuple(committed) and not output.final


async def test_a_reader_that_comes_after_its_next_tokens_gathers_them_too(tmp_path: Path, target: TargetModel) -> None:
    """A read past the first tokens that finds new ones already released lingers as one that
    waited for them: a reader that keeps pace with the rounds, finding a round or two each time it
    asks, gathers up to 16 tokens an answer (one stream made a request per 2.7 tokens)."""
    async with running_cluster(tmp_path, target, output_wait_s=60.0, output_linger_ms=60_000.0) as env:
        state = await open_and_assign(env, contract(target, max_new=64, low_rounds=64))
        reader, drafter = env.client("router"), env.client("drafter")
        path = f"sessions/{session_path_id(SESSION)}/output"
        verdict, state = await propose_one(drafter, state)
        start = len(verdict.emitted)
        verdict, state = await propose_one(drafter, state)
        committed = list(verdict.emitted)
        later = asyncio.create_task(reader.get_cbor(path, {"from": str(start)}))
        output = await commit_while_it_lingers(drafter, state, later, committed)
        assert output.from_ == start and output.tokens == tuple(committed) and not output.final


async def test_a_read_with_tokens_is_answered_when_the_waiting_reads_are_at_their_limit(
    tmp_path: Path, target: TargetModel
) -> None:
    """max_long_polls refuses a read that would wait for tokens, not one that finds tokens
    released and would only linger for more: that one is answered at once."""
    async with running_cluster(
        tmp_path, target, output_wait_s=60.0, output_linger_ms=60_000.0, max_long_polls=2
    ) as env:
        state = await open_and_assign(env, contract(target, max_new=64, low_rounds=64))
        engine = env.node.engine
        reader, drafter = env.client("router"), env.client("drafter")
        path = f"sessions/{session_path_id(SESSION)}/output"
        _, state = await propose_one(drafter, state)
        start = state.committed
        waiting = [asyncio.create_task(reader.get_cbor(path, {"from": str(start)})) for _ in range(2)]
        await eventually(lambda: engine._long_polls == 2)
        with pytest.raises(PeerServerError) as refused:
            await reader.get_cbor(path, {"from": str(start)})
        assert refused.value.status == 503
        verdict, state = await propose_one(drafter, state)
        _, out = await asyncio.wait_for(reader.get_cbor(path, {"from": str(start)}), 30)
        assert Output.from_obj(out).tokens == verdict.emitted
        assert not any(task.done() for task in waiting)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)


async def test_a_waiting_read_of_a_forgotten_session_answers_and_the_next_is_not_found(
    tmp_path: Path, target: TargetModel
) -> None:
    """A session forgotten (idle, or reopened at a later epoch) wakes its waiting readers: they
    answer with what they have, and a read after that finds no session (404), not a timeout."""
    async with running_cluster(tmp_path, target, output_wait_s=60.0) as env:
        state = await open_and_assign(env, contract(target))
        reader = env.client("router")
        path = f"sessions/{session_path_id(SESSION)}/output"
        waiting = asyncio.create_task(reader.get_cbor(path, {"from": str(state.committed)}))
        await eventually(lambda: env.node.engine._long_polls == 1)
        await env.node.engine._sweeps.forget(SESSION)
        _, out = await asyncio.wait_for(waiting, 30)
        assert Output.from_obj(out).tokens == ()
        err = await problem_of(reader.get_cbor(path, {"from": str(state.committed)}))
        assert err.status == 404


async def test_fenced_log_stops_the_session_without_releasing_output(cluster: Cluster, target: TargetModel) -> None:
    state = await open_and_assign(cluster, contract(target))
    drafter = cluster.client("drafter")
    _, body = await drafter.post_cbor("proposals", proposal(state, (1,)).to_obj())
    state = advance(state, Verdict.from_obj(body))
    log_uri = build_uri("local", None, "log", SESSION.hex())
    await cluster.mlc.commit_log(log_uri).fence(2)
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1,)).to_obj()))
    assert err.problem is ProblemType.STALE_EPOCH
    err = await problem_of(drafter.get_cbor(f"sessions/{session_path_id(SESSION)}/output", {"from": "0"}))
    assert err.problem is ProblemType.STALE_EPOCH
    records = (await cluster.mlc.commit_log(log_uri).read()).records
    assert [r.get("round") for r in records] == [1, None]


async def test_commit_records_precede_verdicts(cluster: Cluster, target: TargetModel) -> None:
    state = await open_and_assign(cluster, contract(target))
    drafter = cluster.client("drafter")
    _, body = await drafter.post_cbor("proposals", proposal(state, (1, 2)).to_obj())
    verdict = Verdict.from_obj(body)
    records = (await cluster.mlc.commit_log(build_uri("local", None, "log", SESSION.hex())).read()).records
    # The first record of the epoch is signed and carries the verifier's certificate (#29).
    assert len(records) == 1 and isinstance(records[0].pop("sig"), bytes)
    assert isinstance(records[0].pop("cert"), bytes)
    assert records == [
        {
            "epoch": 1,
            "round": 1,
            "emitted": list(verdict.emitted),
            "committed": verdict.committed,
            "digest": verdict.digest,
            "writer": cluster.node.uri,
            # Bound to its place: this session, and its terms (no constraint, no min_new).
            "session": SESSION,
            "terms": session_terms(constraint=None, min_new=None),
        }
    ]
    assert cbor2.loads(cbor2.dumps(records[0])) == records[0]


async def test_a_policy_update_changes_sampling_from_its_round_on(cluster: Cluster, target: TargetModel) -> None:
    """SDCP 6.6: rounds before from_round sample at temperature 1; from it on, temperature 0 makes
    rule 2 emit exactly the target's greedy token after the committed prefix."""
    c = contract(target, rule=2, sampling={"temperature_milli": 1000, "seed": 3}, max_new=10)
    state = await open_and_assign(cluster, c)
    router = cluster.client("router")
    policy = Policy(session=SESSION, from_round=3, sampling=Sampling(temperature_milli=0))
    status, body = await router.post_cbor(f"sessions/{session_path_id(SESSION)}/policy", policy.to_obj())
    assert status == 200 and SessionState.from_obj(body).round == 0
    drafter = cluster.client("drafter")
    uniform = np.full((1, 257), 1.0 / 257, dtype="<f4")
    committed: list[int] = []
    while True:
        uri = build_uri("local", None, "q-rows", f"r{state.round + 1}")
        await cluster.mlc.put(uri, uniform.tobytes())
        _, body = await drafter.post_cbor("proposals", proposal(state, (7,), q_rows=uri).to_obj())
        verdict = Verdict.from_obj(body)
        if verdict.round >= 3:
            prefix = list(PROMPT) + committed
            for token in verdict.emitted:
                with torch.inference_mode():
                    logits = target.model(torch.tensor([prefix])).logits[0, -1]
                assert token == int(torch.argmax(logits))
                prefix.append(token)
        committed.extend(verdict.emitted)
        state = advance(state, verdict)
        if verdict.action == Action.FINISH:
            break
    assert len(committed) == 10
    err = await problem_of(router.post_cbor(f"sessions/{session_path_id(SESSION)}/policy", policy.to_obj()))
    assert err.problem is ProblemType.SESSION_CLOSED


async def test_output_offsets_that_are_not_ascii_digits_are_bad_messages(cluster: Cluster, target: TargetModel) -> None:
    await open_and_assign(cluster, contract(target))
    reader = cluster.client("router")
    for bad in ("²", "-1", "1e3", "9" * 20):
        err = await problem_of(reader.get_cbor(f"sessions/{session_path_id(SESSION)}/output", {"from": bad}))
        assert err.status == 400


@pytest.mark.slow
async def test_a_failed_append_releases_nothing_and_the_round_can_be_retried(
    tmp_path: Path, target: TargetModel
) -> None:
    """SDCP 6.3: only after the append succeeds are the verdict and output released. The shared
    store (a private Redis here) goes away mid-session: the round is refused with 503, nothing is
    released, and the same proposal succeeds once the log is reachable again."""
    verifier_uri = f"https://127.0.0.1:{free_port()}"
    identities = {"verifier": verifier_uri, "router": "https://127.0.0.1:1", "drafter": DRAFTER}
    issued = make_certs(tmp_path / "certs", list(identities.values()))
    certs = {name: (issued[uri].cert_path, issued[uri].key_path) for name, uri in identities.items()}
    ca = tmp_path / "certs" / "ca.pem"
    for session in list(target._sessions):
        target.close_session(session)
    with local_redis_server(tmp_path / "redis") as redis_url:
        config = ServiceConfig(
            instance=InstanceConfig(
                uri=verifier_uri,
                cert=certs["verifier"][0],
                key=certs["verifier"][1],
                ca=ca,
                router="https://127.0.0.1:1",
            ),
            mlc=MLCConfig(redis_url=redis_url, memory_bytes=0),
            verifier=VerifierConfig(model="tiny", output_wait_s=0.2),
        )
        node = VerifierNode(config, target=target)
        await node.start()
        env = Cluster(tmp_path, node, MLC.from_config(redis_url=redis_url), certs, ca)
        try:
            state = await open_and_assign(env, contract(target))
            drafter = env.client("drafter")
            message = proposal(state, (1, 2)).to_obj()
            pidfile = tmp_path / "redis" / "redis.pid"
            os.kill(int(pidfile.read_text()), signal.SIGSTOP)
            try:
                with pytest.raises(PeerServerError) as refused:
                    await drafter.post_cbor("proposals", message)
            finally:
                os.kill(int(pidfile.read_text()), signal.SIGCONT)
            assert refused.value.status == 503
            _, body = await env.client("router").get_cbor(f"sessions/{session_path_id(SESSION)}/output", {"from": "0"})
            assert Output.from_obj(body).tokens == ()
            status, body = await drafter.post_cbor("proposals", message)
            assert status == 200 and Verdict.from_obj(body).round == 1
        finally:
            await env.close()
            await node.stop()
            await env.mlc.close()


async def test_an_append_whose_answer_was_lost_is_found_in_the_log_on_the_retry(
    cluster: Cluster, target: TargetModel
) -> None:
    """A Redis restart after the record was written but before the answer: the first try is 503
    (the log cannot be read either), and the retried round finds its own record there instead of
    taking the changed ETag for another writer (which would fence the session)."""
    state = await open_and_assign(cluster, contract(target))
    live = cluster.node.engine.sessions[SESSION]
    log_append, log_read = live.log.append_all, live.log.read
    lost = {"append": 1, "read": 1}

    async def append_then_lose_the_answer(records: list[dict[str, object]], if_match: str) -> str:
        etag = await log_append(records, if_match)
        if lost["append"]:
            lost["append"] -= 1
            raise ConnectionError("Connection closed by server.")
        return etag

    async def read_once_unreachable() -> LogSnapshot:
        if lost["read"]:
            lost["read"] -= 1
            raise ConnectionError("Error 111 connecting")
        return await log_read()

    live.log.append_all = append_then_lose_the_answer  # type: ignore[method-assign]
    live.log.read = read_once_unreachable  # type: ignore[method-assign]
    drafter = cluster.client("drafter")
    message = proposal(state, (1, 2)).to_obj()
    with pytest.raises(PeerServerError) as unknown:
        await drafter.post_cbor("proposals", message)
    assert unknown.value.status == 503
    status, body = await drafter.post_cbor("proposals", message)
    verdict = Verdict.from_obj(body)
    assert status == 200 and verdict.round == 1 and not live.machine.fenced
    records = (await log_read()).records
    assert [(r["round"], r["committed"]) for r in records] == [(1, verdict.committed)]


async def test_an_ended_session_is_freed_after_its_retention(
    cluster: Cluster, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = cluster.node
    node.engine.settings = replace(node.engine.settings, ended_retention_s=0.2)
    # The retention starts once the test has read the ended session, however slowly it gets there.
    read = asyncio.Event()
    forget_later = node.engine._sweeps.forget_later

    async def after_the_read(live: object) -> None:
        await read.wait()
        await forget_later(live)  # type: ignore[arg-type]

    monkeypatch.setattr(node.engine._sweeps, "forget_later", after_the_read)
    state = await open_and_assign(cluster, contract(target, max_new=1))
    drafter = cluster.client("drafter")
    _, body = await drafter.post_cbor("proposals", proposal(state, (1, 2)).to_obj())
    assert Verdict.from_obj(body).action == Action.FINISH
    path = f"sessions/{session_path_id(SESSION)}/output"
    _, body = await drafter.get_cbor(path, {"from": "0"})
    assert Output.from_obj(body).final  # still readable right after the end
    read.set()
    await eventually(lambda: SESSION not in node.engine.sessions and not target.has_session(SESSION))
    err = await problem_of(drafter.get_cbor(path, {"from": "0"}))
    assert err.status == 404 and SESSION not in node.engine.sessions and not target.has_session(SESSION)


@pytest.mark.slow
async def test_a_session_nothing_drives_is_closed_after_the_idle_timeout(tmp_path: Path, target: TargetModel) -> None:
    async with running_cluster(tmp_path, target, idle_timeout_s=1.0) as env:
        node = env.node
        c = contract(target)
        state = await open_and_assign(env, c)
        drafter = env.client("drafter")
        _, body = await drafter.post_cbor("proposals", proposal(state, (1,)).to_obj())
        state = advance(state, Verdict.from_obj(body))
        # A router message drives it: its idle time starts again (checked on the session's clock
        # reading, not by racing the sweep with real pauses).
        live = node.engine.sessions[SESSION]
        before = time.monotonic()
        await assign(env, c, state)
        assert live.driven_at >= before and node.engine.sessions.get(SESSION) is live
        # Then nothing drives it, as after a takeover by another verifier.
        await eventually(lambda: SESSION not in node.engine.sessions and not target.has_session(SESSION))
        assert SESSION not in node.engine.sessions and not target.has_session(SESSION)
        err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1,)).to_obj()))
        assert err.status == 404
        # Its commit log still holds every committed token.
        snapshot = await env.mlc.commit_log(build_uri("local", None, "log", SESSION.hex())).read()
        assert sum(len(record["emitted"]) for record in snapshot.records) == state.committed >= 1


class _TorchOperators(TorchDispatchMode):
    """Records the torch operators dispatched on the thread that entered it (modes are per thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


async def test_the_event_loop_thread_runs_no_torch_operator(tmp_path: Path) -> None:
    # All model work runs on the scorer thread (docs/models.md, "One OpenMP team"): one torch
    # operator on the event loop's thread gives the process a second OpenMP team, and on 2 cores
    # every pass then runs at half speed. A fresh target packs its weights during the start.
    fresh = TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")
    operators = _TorchOperators()
    with operators:
        async with running_cluster(tmp_path, fresh) as env:
            c = contract(fresh, low_rounds=1, fallback=[Action.SELF_DECODE], self_load=100)
            state = await open_and_assign(env, c)
            _, body = await env.client("drafter").post_cbor("proposals", proposal(state, (1, 2)).to_obj())
            assert Verdict.from_obj(body).action in (Action.SELF_DECODE, Action.FINISH)
            outputs = await asyncio.wait_for(read_output(env.client("router"), SESSION), 60)
            assert outputs[-1].final and len(output_tokens(outputs)) == c.max_new
    assert operators.seen == []


async def test_only_the_router_asks_for_self_decoding_and_only_where_the_contract_permits_it(
    cluster: Cluster, target: TargetModel
) -> None:
    path = f"sessions/{session_path_id(SESSION)}/self-decode"
    request = {"session": SESSION, "epoch": 1}
    await open_and_assign(cluster, contract(target))
    with pytest.raises(Exception) as refused:
        await cluster.client("drafter").post_cbor(path, request)
    assert getattr(refused.value, "status", None) == 403
    # The contract has no self_load: SDCP 6.5.2 permits no self-decoding.
    not_permitted = await problem_of(cluster.client("router").post_cbor(path, request))
    assert not_permitted.status == 409 and not_permitted.problem is None


async def test_the_verifier_decodes_alone_at_the_routers_request(
    cluster: Cluster, target: TargetModel, greedy_reference: list[int]
) -> None:
    path = f"sessions/{session_path_id(SESSION)}/self-decode"
    await open_and_assign(cluster, contract(target, self_load=100, self_max=5))
    _, answer = await cluster.client("router").post_cbor(path, {"session": SESSION, "epoch": 1})
    assert SessionState.from_obj(answer).state == Action.SELF_DECODE
    outputs = await asyncio.wait_for(read_output(cluster.client("router"), SESSION, until=5), 60)
    assert output_tokens(outputs) == greedy_reference[:5]

    # The period ends after self_max tokens and waits for the router's next decision.
    async def period_ended() -> bool:
        nonlocal stats
        _, stats = await cluster.client("router").get_cbor(f"sessions/{session_path_id(SESSION)}/stats")
        return bool(stats["state"] == Action.CONTINUE)

    stats: object = None
    await eventually_async(period_ended)
    assert (
        isinstance(stats, dict)
        and stats["state"] == Action.CONTINUE
        and stats["self_decoded"] == 5
        and stats["committed"] == 5
    )


async def test_a_cancel_stops_self_decoding_at_a_round_boundary(cluster: Cluster, target: TargetModel) -> None:
    router = cluster.client("router")
    base = f"sessions/{session_path_id(SESSION)}"
    await open_and_assign(cluster, contract(target, self_load=100, max_new=4000))
    await router.post_cbor(f"{base}/self-decode", {"session": SESSION, "epoch": 1})
    await asyncio.wait_for(read_output(router, SESSION, until=5), 60)
    _, answer = await router.post_cbor(f"{base}/cancel", {"session": SESSION, "epoch": 1})
    state = SessionState.from_obj(answer)
    assert state.state == Action.FAIL and state.committed < 4000
    outputs = await asyncio.wait_for(read_output(router, SESSION), 60)
    # However many tokens self-decoding committed before the cancel landed.
    assert output_tokens(outputs) == transformers_greedy(target, state.committed) and outputs[-1].finish == Action.FAIL
    records = (await cluster.mlc.commit_log(build_uri("local", None, "log", SESSION.hex())).read()).records
    assert records[-1]["emitted"] == [] and records[-1]["committed"] == state.committed
    # The drafter's next proposal finds the session closed (SDCP Table 2).
    err = await problem_of(cluster.client("drafter").post_cbor("proposals", proposal(state, (1,)).to_obj()))
    assert err.status == 410


async def test_a_cancel_ends_a_greedy_run_at_the_scorers_next_pass(
    cluster: Cluster, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel that comes while self-decoding awaits a step of a greedy run, which hands its steps
    over RUN_DELIVERY_STEPS at a time where no guess pays, cuts the run there: the period ends
    after that step's round, not after the group the scorer would have held with it."""
    monkeypatch.setattr(selfdecode, "speculation_length", lambda *_, **__: 0)
    router = cluster.client("router")
    engine = cluster.node.engine
    base = f"sessions/{session_path_id(SESSION)}"
    await open_and_assign(cluster, contract(target, self_load=100, max_new=4000))
    await router.post_cbor(f"{base}/self-decode", {"session": SESSION, "epoch": 1})
    live = engine.sessions[SESSION]

    def awaiting_the_first_step_of_a_whole_group() -> bool:
        awaited = getattr(live.cut_run, "__self__", None)
        run = getattr(awaited, "run", None)
        return run is not None and awaited.step > 0 and len(run.steps) - awaited.step >= RUN_DELIVERY_STEPS

    await eventually(awaiting_the_first_step_of_a_whole_group)
    before = live.machine.committed
    state = await engine.cancel(CancelRequest(session=SESSION, epoch=1))
    assert state.state == Action.FAIL and state.committed - before == 1


async def test_token_ids_outside_the_vocabulary_are_bad_messages(cluster: Cluster, target: TargetModel) -> None:
    router, drafter = cluster.client("router"), cluster.client("drafter")
    outside = target.vocab_size
    message = SessionOpen(
        session=b"\x05" * 16, epoch=1, contract=contract(target), prompt=(1, outside), commit_log="mlc://local/-/log/v"
    )
    err = await problem_of(router.post_cbor("sessions", message.to_obj()))
    assert err.status == 400 and "vocabulary" in err.detail and b"\x05" * 16 not in cluster.node.engine.sessions
    state = await open_and_assign(cluster, contract(target))
    err = await problem_of(drafter.post_cbor("proposals", proposal(state, (1, outside)).to_obj()))
    assert err.status == 400 and "vocabulary" in err.detail
    # Nothing was committed, and the next proposal of the same round is verified as usual.
    _, body = await drafter.post_cbor("proposals", proposal(state, (1,)).to_obj())
    assert Verdict.from_obj(body).round == state.round + 1


FOREIGN_LOG = "mlc://conformance/log/7t0bxONvFsbjPaNb1aAvLg"


async def test_a_foreign_commit_log_uri_is_an_opaque_reference(cluster: Cluster, target: TargetModel) -> None:
    # Where configured ([mlc] unlisted = "own", as the cluster fixture does), a log of any authority
    # is kept in this verifier's MLC.
    state = await open_and_assign(cluster, contract(target), log_uri=FOREIGN_LOG)
    _, body = await cluster.client("drafter").post_cbor("proposals", proposal(state, (1, 2)).to_obj())
    verdict = Verdict.from_obj(body)
    records = (await cluster.mlc.commit_log(FOREIGN_LOG).read()).records
    assert [(r["round"], r["committed"]) for r in records] == [(1, verdict.committed)]


async def test_references_this_verifier_cannot_resolve_are_bad_messages(tmp_path: Path, target: TargetModel) -> None:
    # By default ([mlc] unlisted = "refuse"): a log kept here privately could never be fenced by a
    # router that uses another MLC (SDCP 6.9), so an authority not configured is the request's fault.
    assert MLCConfig().unlisted == "refuse"
    async with running_cluster(tmp_path, target, mlc_unlisted=None) as env:
        router = env.client("router")
        opened = SessionOpen(
            session=b"\x06" * 16, epoch=1, contract=contract(target), prompt=PROMPT, commit_log=FOREIGN_LOG
        )
        err = await problem_of(router.post_cbor("sessions", opened.to_obj()))
        assert err.status == 400 and "commit_log" in err.detail and "'conformance'" in err.detail
        by_reference = replace(opened, prompt="kvsp://elsewhere/prompt/1", commit_log="mlc://local/-/log/y")
        err = await problem_of(router.post_cbor("sessions", by_reference.to_obj()))
        assert err.status == 400 and "prompt" in err.detail
        not_a_uri = replace(opened, commit_log="log 7")
        err = await problem_of(router.post_cbor("sessions", not_a_uri.to_obj()))
        assert err.status == 400 and "commit_log" in err.detail
        assert b"\x06" * 16 not in env.node.engine.sessions
