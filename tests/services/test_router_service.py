"""The router service over real HTTP/2 + mTLS (SDCP Table 1, 6.1, 6.5.2 events, 6.6, 6.9).

Instances are real nodes on 127.0.0.1 with certificates from make_certs; where a test needs an
instance only to report status or send an event, it plays that instance with the instance's own
certificate, so every request the router sees comes from an authenticated peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import replace

import cbor2
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY
from starlette.requests import Request
from starlette.responses import Response
from tests.services.outputs import output_tokens, read_output
from tests.services.router_harness import (
    INSTANCE_TTL_MS,
    PAST_TTL_S,
    PROMPT,
    Deployment,
    deployment,
    greedy_reference,
    jump_clock,
    open_session,
    start_drafter,
    start_verifier,
    target,
    tiny_contract,
)
from tests.waiting import HANG_GUARD_S, eventually, eventually_async

import sdcp.protocol.router
from sdcp.cache import MLC, PreconditionFailed, build_uri
from sdcp.config import DrafterConfig, ServiceConfig
from sdcp.engines.router import TrackedSession
from sdcp.frontend.client import ClusterClient, OutputChunk, SessionHandle, SessionStalled
from sdcp.localhost import free_port
from sdcp.models.drafter import DraftResult
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model
from sdcp.models.lookup.ngram import NgramDrafter
from sdcp.models.worker import ModelThreadClosed
from sdcp.protocol.digest import extend_digest
from sdcp.protocol.messages import (
    Action,
    Assignment,
    CancelRequest,
    Event,
    Output,
    Policy,
    Role,
    Sampling,
    SessionOpen,
    SessionState,
    Status,
    instance_path_id,
    session_path_id,
)
from sdcp.protocol.problems import ProblemType, ProtocolError
from sdcp.services import node as node_module
from sdcp.services import router as router_module
from sdcp.services.drafter import DrafterNode
from sdcp.services.verifier import VerifierNode
from sdcp.transport.client import SDCPClient
from sdcp.transport.errors import ServiceUnavailable
from sdcp.transport.signing import RecordSigner

__all__ = ["deployment", "target"]  # fixtures, from the router service tests' harness

pytestmark = pytest.mark.timeout(120)

# A digest no real model has: the model of drafters played by the test.
PLAYED_MODEL = hashlib.sha256(b"played drafter").digest()


def drafter_status(uri: str, ttl_ms: int = 600, load: int = 0) -> Status:
    return Status(instance=uri, role=Role.DRAFTER, load=load, queue=0, ttl_ms=ttl_ms, model=PLAYED_MODEL)


async def report(client: SDCPClient, status: Status, path_uri: str | None = None) -> int:
    code, _ = await client.put_cbor(
        f"instances/{instance_path_id(path_uri or status.instance)}/status", status.to_obj()
    )
    return code


# -- PUT instances/{id}/status ----------------------------------------------------------------------


async def test_an_instance_reports_only_its_own_status(deployment: Deployment) -> None:
    router = deployment.router
    assert router is not None
    drafter1 = deployment.client("drafter1")
    uri1, uri2 = deployment.uris["drafter1"], deployment.uris["drafter2"]

    assert await report(drafter1, drafter_status(uri1)) == 204
    # Another instance's path, with that instance's status: refused.
    with pytest.raises(ProtocolError) as other_path:
        await report(drafter1, drafter_status(uri2))
    assert other_path.value.status == 403
    # Its own path, but a status naming someone else: refused too.
    with pytest.raises(ProtocolError) as other_body:
        await report(drafter1, drafter_status(uri2), path_uri=uri1)
    assert other_body.value.status == 403

    live = router.registry.live(Role.DRAFTER, router.clock())
    assert [view.uri for view in live] == [uri1]
    assert live[0].model == PLAYED_MODEL


async def test_verifiers_of_one_model_with_different_target_digests_are_shown(
    deployment: Deployment, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #41: backend "auto" chooses per host, so two verifiers of one model may advertise
    different target digests (torch digests the weights, llama.cpp the GGUF file), and a session
    cannot fail over between them. The router says so: a warning, a gauge, its targets and its
    dashboard state, each naming the verifiers and their backends."""
    router = deployment.router
    assert router is not None
    torch_digest, gguf_digest = hashlib.sha256(b"weights").digest(), hashlib.sha256(b"gguf").digest()

    def verifier_status(name: str, digest: bytes, backend: str) -> Status:
        return Status(
            instance=deployment.uris[name],
            role=Role.VERIFIER,
            load=0,
            queue=0,
            ttl_ms=INSTANCE_TTL_MS,
            model=digest,
            tokenizer=torch_digest,
            model_name="smollm2",
            backend=backend,
        )

    assert await report(deployment.client("verifier1"), verifier_status("verifier1", torch_digest, "torch")) == 204
    assert router.engine.target_splits() == {}
    assert await report(deployment.client("verifier2"), verifier_status("verifier2", gguf_digest, "llamacpp")) == 204
    split = router.engine.target_splits()["smollm2"]
    assert split == {
        torch_digest.hex(): [f"{deployment.uris['verifier1']} (torch)"],
        gguf_digest.hex(): [f"{deployment.uris['verifier2']} (llamacpp)"],
    }
    gauge = REGISTRY.get_sample_value(
        "sdcp_router_verifier_target_digests", {"instance": router.uri, "model": "smollm2"}
    )
    assert gauge == 2
    (warning,) = [r.getMessage() for r in caplog.records if "cannot take over each other's sessions" in r.getMessage()]
    assert "pin `backend`" in warning and deployment.uris["verifier2"] in warning
    targets = {t["instance"]: t for t in router.engine.targets()}
    assert targets[deployment.uris["verifier2"]]["backend"] == "llamacpp"
    assert targets[deployment.uris["verifier1"]]["model_name"] == "smollm2"


async def test_a_malformed_status_is_a_bad_message(deployment: Deployment) -> None:
    drafter1 = deployment.client("drafter1")
    path = f"instances/{instance_path_id(deployment.uris['drafter1'])}/status"
    with pytest.raises(ProtocolError) as refused:
        await drafter1.put_cbor(path, {"instance": deployment.uris["drafter1"], "role": 1, "load": 101})
    assert refused.value.status == 400 and refused.value.problem is None


async def test_an_instance_that_stops_reporting_is_not_picked(deployment: Deployment) -> None:
    router = deployment.router
    assert router is not None
    uri1, uri2 = deployment.uris["drafter1"], deployment.uris["drafter2"]
    drafter1, drafter2 = deployment.client("drafter1"), deployment.client("drafter2")
    await report(drafter1, drafter_status(uri1, ttl_ms=300, load=50))
    await report(drafter2, drafter_status(uri2, ttl_ms=300, load=0))
    assert {v.uri for v in router.registry.live(Role.DRAFTER, router.clock())} == {uri1, uri2}
    # drafter1 reports again within its TTL, drafter2 does not: only drafter1 is left.
    clock = jump_clock(router)
    clock.advance(0.2)
    await report(drafter1, drafter_status(uri1, ttl_ms=300, load=50))
    clock.advance(0.2)
    assert not router.registry.is_live(uri2, router.clock())
    assert [v.uri for v in router.registry.live(Role.DRAFTER, router.clock())] == [uri1]


# -- GET targets -------------------------------------------------------------------------------------


def verifier_status(uri: str, target: TargetModel, ttl_ms: int) -> Status:
    return Status(
        instance=uri,
        role=Role.VERIFIER,
        load=0,
        queue=0,
        ttl_ms=ttl_ms,
        model=target.weights_digest,
        tokenizer=target.tokenizer_digest,
    )


async def test_targets_lists_live_verifiers_with_their_digests(deployment: Deployment, target: TargetModel) -> None:
    uri1, uri2 = deployment.uris["verifier1"], deployment.uris["verifier2"]
    await report(deployment.client("verifier1"), verifier_status(uri1, target, ttl_ms=10_000))
    await report(deployment.client("verifier2"), verifier_status(uri2, target, ttl_ms=200))
    frontend = deployment.client("frontend")

    code, body = await frontend.get_cbor("targets")
    assert code == 200
    expected = {"model": target.weights_digest, "tokenizer": target.tokenizer_digest}
    assert body == sorted([{"instance": uri1, **expected}, {"instance": uri2, **expected}], key=lambda t: t["instance"])

    jump_clock(deployment.router).advance(0.3)
    _, body = await frontend.get_cbor("targets")
    assert body == [{"instance": uri1, **expected}]


async def test_a_session_for_a_target_nobody_serves_is_a_bad_contract(
    deployment: Deployment, target: TargetModel
) -> None:
    await report(deployment.client("verifier1"), verifier_status(deployment.uris["verifier1"], target, ttl_ms=10_000))
    unknown = tiny_contract(target, target=hashlib.sha256(b"another model").digest())
    with pytest.raises(ProtocolError) as refused:
        await deployment.client("frontend").post_cbor(
            "sessions", {"prompt": list(PROMPT), "contract": unknown.to_obj()}
        )
    assert refused.value.problem is ProblemType.BAD_CONTRACT


async def test_a_session_request_without_a_prompt_is_a_bad_message(deployment: Deployment, target: TargetModel) -> None:
    with pytest.raises(ProtocolError) as refused:
        await deployment.client("frontend").post_cbor(
            "sessions", {"prompt": [], "contract": tiny_contract(target).to_obj()}
        )
    assert refused.value.status == 400


# -- sessions and events with a real verifier --------------------------------------------------------


async def moved_to(env: Deployment, session: bytes, verifier: str) -> None:
    """Wait until the router describes ``session`` as running at ``verifier`` (a failover's end)."""
    frontend = env.client("frontend")

    async def moved() -> bool:
        _, described = await frontend.get_cbor(f"sessions/{session_path_id(session)}")
        return isinstance(described, dict) and described["verifier"] == verifier

    await eventually_async(moved)


async def test_events_are_admitted_only_from_the_serving_verifier_at_its_epoch(
    deployment: Deployment, target: TargetModel
) -> None:
    verifier = await start_verifier(deployment, "verifier1")
    contract = tiny_contract(target)
    opened = await open_session(deployment, contract)
    session = opened["session"]
    assert isinstance(session, bytes)
    assert opened["verifier"] == verifier.uri and opened["epoch"] == 1
    assert "drafter" not in opened  # no drafter is live: the session opens and waits for one
    state = verifier.engine.sessions[session].machine.state()

    def event(epoch: int, kind: int) -> dict[str, object]:
        obj = Event(session=session, epoch=epoch, kind=Action.FINISH, committed=0, digest=state.digest).to_obj()
        return {**obj, "kind": kind}

    with pytest.raises(ProtocolError) as not_the_verifier:
        await deployment.client("drafter1").post_cbor("events", event(1, Action.FINISH))
    assert not_the_verifier.value.status == 403
    with pytest.raises(ProtocolError) as stale:
        await deployment.client("verifier1").post_cbor("events", event(2, Action.FINISH))
    assert stale.value.problem is ProblemType.STALE_EPOCH

    frontend = deployment.client("frontend")
    _, described = await frontend.get_cbor(f"sessions/{session_path_id(session)}")
    assert described == {"session": session, "epoch": 1, "verifier": verifier.uri, "ended": False}
    # An unknown action value reads as fail (SDCP 5.2): the session ends.
    code, _ = await deployment.client("verifier1").post_cbor("events", event(1, 99))
    assert code == 204
    _, described = await frontend.get_cbor(f"sessions/{session_path_id(session)}")
    assert isinstance(described, dict) and described["ended"] is True


async def test_an_unknown_session_is_not_found(deployment: Deployment) -> None:
    with pytest.raises(ProtocolError) as missing:
        await deployment.client("frontend").get_cbor(f"sessions/{session_path_id(bytes(16))}")
    assert missing.value.status == 404


# -- whole sessions: router, verifiers and n-gram drafters --------------------------------------------


def counter(name: str, instance: str) -> float:
    """The sum of the samples of ``name`` for ``instance``, over their other labels."""
    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name and sample.labels.get("instance") == instance
    )


async def test_a_session_opened_through_the_router_reaches_finish(deployment: Deployment, target: TargetModel) -> None:
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    drafter = await start_drafter(deployment, "drafter1")
    opened = await open_session(deployment, tiny_contract(target, max_new=12))
    session = opened["session"]
    assert isinstance(session, bytes)
    assert (opened["verifier"], opened["drafter"], opened["epoch"]) == (verifier.uri, drafter.uri, 1)

    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    tokens = [t for output in outputs for t in output.tokens]
    assert tokens == greedy_reference(target, 12)  # SDCP 6.4 rule 1, whatever the drafter proposed
    assert outputs[-1].finish == Action.FINISH and {o.epoch for o in outputs} == {1}
    # The verifier's finish event ends the session at the router too.
    await eventually(lambda: router.sessions[session].ended)
    _, described = await deployment.client("frontend").get_cbor(f"sessions/{session_path_id(session)}")
    assert described == {
        "session": session,
        "epoch": 1,
        "verifier": verifier.uri,
        "ended": True,
        "served": [drafter.uri],
    }


async def test_instances_without_our_private_status_members_are_used(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another vendor's instances: an {id} of their own in the status path, and only the status
    # members of SDCP 5.2 (no `model`, `tokenizer` or cost terms).
    drafted_members = {"instance", "role", "load", "queue", "accept_milli", "cache_mbps", "ttl_ms"}
    to_obj = Status.to_obj
    monkeypatch.setattr(
        Status, "to_obj", lambda status: {k: v for k, v in to_obj(status).items() if k in drafted_members}
    )
    monkeypatch.setattr(
        node_module, "instance_path_id", lambda uri: "vendor-" + hashlib.sha256(uri.encode()).hexdigest()[:8]
    )
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    drafter = await start_drafter(deployment, "drafter1")
    assert router.registry.get(verifier.uri).status.model is None  # type: ignore[union-attr]

    opened = await open_session(deployment, tiny_contract(target, max_new=12))
    assert (opened["verifier"], opened["drafter"]) == (verifier.uri, drafter.uri)
    outputs = await read_output(deployment.client("frontend", peer="verifier1"), opened["session"])  # type: ignore[arg-type]
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 12)
    # Asked, the verifier refuses a target it does not serve (SDCP 6.1): the front end gets 422.
    unknown = tiny_contract(target, target=hashlib.sha256(b"another model").digest())
    with pytest.raises(ProtocolError) as refused:
        await open_session(deployment, unknown)
    assert refused.value.problem is ProblemType.BAD_CONTRACT


async def test_a_switch_event_moves_the_session_to_the_other_drafter(
    deployment: Deployment, target: TargetModel
) -> None:
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    drafters = [await start_drafter(deployment, "drafter1"), await start_drafter(deployment, "drafter2")]
    assignments_before = counter("sdcp_router_assignments_total", router.uri)
    # Every round short of full acceptance is low and escalates at once; the ladder starts with a
    # switch (again after each fully accepted round, which resets j), then only reduces, so the
    # session ends by finishing.
    contract = tiny_contract(
        target, max_new=24, low_rounds=1, low_ratio=100, fallback=[Action.SWITCH] + [Action.REDUCE] * 24
    )
    opened = await open_session(deployment, contract)
    session = opened["session"]
    assert isinstance(session, bytes)
    first = opened["drafter"]

    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 24)
    assert outputs[-1].finish == Action.FINISH
    assert counter("sdcp_router_assignments_total", router.uri) - assignments_before >= 2
    other = next(d.uri for d in drafters if d.uri != first)
    assert counter("sdcp_drafter_proposals_total", first) > 0
    assert counter("sdcp_drafter_proposals_total", other) > 0


async def running_on_first_of_two(
    env: Deployment, target: TargetModel, max_new: int
) -> tuple[VerifierNode, VerifierNode, bytes, list[Output]]:
    """A session of ``max_new`` tokens opened at verifier1, drafted by drafter1, with verifier2
    live beside it and the session's first 8 tokens out: (verifier1, verifier2, session, output)."""
    first = await start_verifier(env, "verifier1")
    await start_drafter(env, "drafter1")
    opened = await open_session(env, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] == first.uri
    second = await start_verifier(env, "verifier2")
    before = await read_output(env.client("frontend", peer="verifier1"), session, until=8)
    assert not before[-1].final, "the session finished before the fault"
    return first, second, session, before


async def test_failover_to_a_second_verifier_loses_and_repeats_no_token(
    deployment: Deployment, target: TargetModel
) -> None:
    max_new = 150
    first, second, session, before = await running_on_first_of_two(deployment, target, max_new)
    seen = [t for output in before for t in output.tokens]
    await deployment.stop(first)

    await moved_to(deployment, session, second.uri)
    _, described = await deployment.client("frontend").get_cbor(f"sessions/{session_path_id(session)}")
    assert isinstance(described, dict) and described["epoch"] == 2

    after = await read_output(deployment.client("frontend", peer="verifier2"), session)
    tokens = [t for output in after for t in output.tokens]
    assert {output.epoch for output in after} == {2}
    assert tokens[: len(seen)] == seen
    assert tokens == greedy_reference(target, max_new)
    assert after[-1].finish == Action.FINISH

    async with MLC.from_config(disk_dir=deployment.tmp / "mlc") as mlc:
        snapshot = await mlc.commit_log(build_uri("local", None, "log", session.hex())).read()
    epochs = [record["epoch"] for record in snapshot.records]
    # The fence names the verifier the router opened epoch 2 at (signed commit records).
    fence = snapshot.records.index({"epoch": 2, "verifier": second.uri})
    assert set(epochs[:fence]) == {1} and set(epochs[fence + 1 :]) == {2}
    commits = [record for record in snapshot.records if "emitted" in record]
    assert all(isinstance(record["sig"], bytes) for record in commits)
    emitted = [t for record in snapshot.records if "emitted" in record for t in record["emitted"]]
    assert emitted == tokens


async def test_a_record_forged_into_the_store_never_reaches_the_user(
    deployment: Deployment, target: TargetModel
) -> None:
    """Signed commit records (#29): a drafter with write access to the store appends a record in
    the verifier's name; the verifier dies; the failover replays only the verifier's signed records."""
    router = deployment.router
    assert router is not None
    first = await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    max_new = 150
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] == first.uri
    second = await start_verifier(deployment, "verifier2")
    reference = greedy_reference(target, max_new)
    before = await read_output(deployment.client("frontend", peer="verifier1"), session, until=8)
    assert not before[-1].final, "the session finished before the record could be forged"
    untrusted_before = counter("sdcp_router_untrusted_records_total", router.uri)

    async with MLC.from_config(disk_dir=deployment.tmp / "mlc") as mlc:
        commit_log = mlc.commit_log(build_uri("local", None, "log", session.hex()))
        while True:
            snapshot = await commit_log.read()
            last = [record for record in snapshot.records if "emitted" in record][-1]
            n = last["committed"]
            forged_tokens = [reference[n + i] ^ 1 for i in range(5)]
            forged = {
                "epoch": 1,
                "round": last["round"] + 1,
                "emitted": forged_tokens,
                "committed": n + len(forged_tokens),
                "digest": extend_digest(last["digest"], forged_tokens),
                "writer": first.uri,
            }
            try:
                await commit_log.append(forged, snapshot.etag)
                break
            except PreconditionFailed:
                continue  # the verifier committed a round meanwhile: forge after it
    await deployment.stop(first)

    await moved_to(deployment, session, second.uri)
    after = await read_output(deployment.client("frontend", peer="verifier2"), session)
    tokens = [t for output in after for t in output.tokens]
    # 0 forged tokens: the output is the greedy reference, which differs from the forgery at n..n+4.
    assert tokens == reference
    assert tokens[n : n + 5] != forged_tokens
    assert after[-1].finish == Action.FINISH
    assert counter("sdcp_router_untrusted_records_total", router.uri) > untrusted_before


async def append_intruding_record(env: Deployment, session: bytes, intruder: str, reference: list[int]) -> list[int]:
    """Append to the session's commit log, as another party with write access to the store, a
    record of 5 tokens that are not the reference's: ``forged``, unsigned in the session's
    verifier's name at its epoch; or ``second verifier``, validly signed by verifier2 at epoch + 1
    (no fence names it). Returns the intruding tokens."""
    async with MLC.from_config(disk_dir=env.tmp / "mlc") as mlc:
        commit_log = mlc.commit_log(build_uri("local", None, "log", session.hex()))
        while True:
            snapshot = await commit_log.read()
            last = [record for record in snapshot.records if "emitted" in record][-1]
            n = last["committed"]
            tokens = [reference[n + i] ^ 1 for i in range(5)]
            record = {
                "epoch": last["epoch"],
                "round": last["round"] + 1,
                "emitted": tokens,
                "committed": n + len(tokens),
                "digest": extend_digest(last["digest"], tokens),
                "writer": last["writer"],
            }
            if intruder == "second verifier":
                cert, key = env.certs["verifier2"]
                record = {**record, "epoch": last["epoch"] + 1, "writer": env.uris["verifier2"]}
                record = RecordSigner.load(cert, key).sign(record, with_cert=True)
            try:
                await commit_log.append(record, snapshot.etag)
                return tokens
            except PreconditionFailed:
                continue  # the verifier committed a round meanwhile: append after it


@pytest.mark.parametrize("intruder", ["forged", "second verifier"])
async def test_a_live_session_whose_log_another_party_appends_to_completes(
    deployment: Deployment, target: TargetModel, intruder: str
) -> None:
    """Issue #29: a record appended to a live session's log by someone else makes the verifier's
    next append fail its precondition, and the verifier stops the session as fenced while it stays
    live. The router, told by the verifier's event, fences above the log's highest epoch and opens
    the session again at that verifier, replaying only its signed records."""
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    max_new = 150
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] == verifier.uri
    reference = greedy_reference(target, max_new)
    reader = deployment.client("frontend", peer="verifier1")
    before = await read_output(reader, session, until=8)
    assert not before[-1].final, "the session finished before the record could be appended"
    untrusted_before = counter("sdcp_router_untrusted_records_total", router.uri)
    reopened_before = counter("sdcp_router_sessions_reopened_total", router.uri)
    intruding = await append_intruding_record(deployment, session, intruder, reference)

    # No front end asks meanwhile: the verifier's event is what has the session opened again.
    await eventually(lambda: counter("sdcp_router_sessions_reopened_total", router.uri) > reopened_before)
    outputs = await read_output(reader, session)
    tokens = [t for output in outputs for t in output.tokens]
    # 0 intruding tokens: the output is the greedy reference, which differs from them everywhere.
    assert tokens == reference and outputs[-1].finish == Action.FINISH
    assert not any(tokens[i : i + 5] == intruding for i in range(len(tokens)))
    assert counter("sdcp_router_untrusted_records_total", router.uri) > untrusted_before
    # Fenced above every epoch in the log, naming the same verifier, which alone writes after it.
    fenced_at = 2 if intruder == "forged" else 3
    assert outputs[-1].epoch == fenced_at and router.sessions[session].plan.verifier == verifier.uri
    async with MLC.from_config(disk_dir=deployment.tmp / "mlc") as mlc:
        records = (await mlc.commit_log(build_uri("local", None, "log", session.hex())).read()).records
    fence = records.index({"epoch": fenced_at, "verifier": verifier.uri})
    assert all(r["epoch"] == fenced_at and r["writer"] == verifier.uri for r in records[fence + 1 :])
    after = records[fence + 1 :]
    resumed = after[0]["committed"] - len(after[0]["emitted"])
    assert [t for r in after for t in r["emitted"]] == reference[resumed:]


SPLICED_TEXT = "(SPLICED )+"


@pytest.mark.parametrize("when", ["live", "across a failover"])
async def test_records_signed_for_another_session_are_never_spliced_into_this_one(
    deployment: Deployment, target: TargetModel, when: str
) -> None:
    """Issue #36 (failed before records named their session): an attacker opens a session with
    the victim's contract and prompt at the victim's verifier, under a constraint that forces its
    own text, and copies that session's genuinely signed records into the victim's log, whose
    digest chain starts where theirs does. The victim's verifier, appending next, stops as fenced
    (``live``), or is stopped and the session fails over; either way the router's replay refuses
    the records (they name another session and other terms) and the victim's output is the greedy
    reference."""
    router = deployment.router
    assert router is not None
    first = await start_verifier(deployment, "verifier1")
    max_new = 40
    # A constrained session needs a stop token: the tiny tokenizer's end of text.
    contract = tiny_contract(target, max_new=max_new, stop=[0])
    reference = greedy_reference(target, max_new)
    reference = reference[: reference.index(0) + 1] if 0 in reference else reference
    drafter = await start_drafter(deployment, "drafter1")
    attack = await open_session(deployment, contract, constraint={"kind": "regex", "text": SPLICED_TEXT})
    attacker = attack["session"]
    assert isinstance(attacker, bytes) and attack["verifier"] == first.uri
    reader = deployment.client("frontend", peer="verifier1")
    spliced_tokens = output_tokens(await read_output(reader, attacker))
    assert target.tokenizer.decode(spliced_tokens).startswith("SPLICED SPLICED")
    await deployment.stop(drafter)
    await eventually(lambda: router.registry.is_live(first.uri, router.clock()))
    # No drafter is live now: the victim's session opens and waits at committed 0 for one.
    opened = await open_session(deployment, contract)
    victim = opened["session"]
    assert isinstance(victim, bytes) and opened["verifier"] == first.uri
    untrusted_before = counter("sdcp_router_untrusted_records_total", router.uri)
    async with MLC.from_config(disk_dir=deployment.tmp / "mlc") as mlc:
        source = (await mlc.commit_log(build_uri("local", None, "log", attacker.hex())).read()).records
        signed = [record for record in source if "emitted" in record]
        assert all(record["writer"] == first.uri and "sig" in record for record in signed)
        log = mlc.commit_log(build_uri("local", None, "log", victim.hex()))
        etag = (await log.read()).etag
        for record in signed:
            etag = await log.append(record, etag)
    frontend = deployment.client("frontend")
    path = f"sessions/{session_path_id(victim)}"
    if when == "live":
        reopened_before = counter("sdcp_router_sessions_reopened_total", router.uri)
        await start_drafter(deployment, "drafter2")
        # The victim's verifier finds its log changed at its first append and stops as fenced.
        await eventually(lambda: counter("sdcp_router_sessions_reopened_total", router.uri) > reopened_before)
    else:
        second = await start_verifier(deployment, "verifier2")
        await deployment.stop(first)
        await moved_to(deployment, victim, second.uri)
        reader = deployment.client("frontend", peer="verifier2")
        await start_drafter(deployment, "drafter2")
    _, described = await frontend.get_cbor(path)
    assert isinstance(described, dict) and described["epoch"] >= 2
    outputs = await read_output(reader, victim)
    tokens = output_tokens(outputs)
    assert tokens == reference and outputs[-1].finish == Action.FINISH
    assert "SPLICED" not in target.tokenizer.decode(tokens)
    assert counter("sdcp_router_untrusted_records_total", router.uri) > untrusted_before


async def test_a_verifier_whose_scorer_thread_dies_goes_unready_and_its_session_fails_over(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #36: whatever kills the scorer's thread (here an error injected into its pass) leaves
    no caller waiting on it: calls fail at once (503 over HTTP), /ready goes false with the reason,
    the verifier stops reporting status and asks its process to exit; the router, its status
    expired, moves the session to the other verifier, and the output is the greedy reference."""
    router = deployment.router
    assert router is not None
    max_new = 150
    first, second, session, _ = await running_on_first_of_two(deployment, target, max_new)
    scorer = first.engine.scorer

    def broken(*_args: object, **_kwargs: object) -> list[object]:
        raise RuntimeError("injected: the scorer's pass failed outside any request")

    monkeypatch.setattr(scorer, "_score", broken)
    await eventually(lambda: not scorer.alive)
    assert isinstance(scorer.failure, RuntimeError) and first._model_died.is_set()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL] == [
        f"sdcp-scorer died: {scorer.failure!r}"
    ]
    caplog.clear()  # the death is logged as it must be; any other error still fails the test
    readiness = await first.readiness()
    assert not readiness.ready and "model thread died" in readiness.reason
    with pytest.raises(ModelThreadClosed):
        await scorer.run_async(lambda: None)
    reported = first._reported_at
    await first.report_status(router.uri)
    assert first._reported_at == reported
    # The router's clock passes the TTL of the report it holds; the verifier reports no other.
    jump_clock(router).advance(PAST_TTL_S)
    await moved_to(deployment, session, second.uri)
    after = await read_output(deployment.client("frontend", peer="verifier2"), session)
    assert output_tokens(after) == greedy_reference(target, max_new) and after[-1].finish == Action.FINISH


async def test_a_front_ends_read_reopens_a_session_whose_verifier_stopped_unheard(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the router never hears the verifier's event (lost, or a router that ignores
    its fenced member and answers it): the front end, reading nothing more, asks the router where
    the session runs, and the router finds the record in the log and opens the session again."""
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    handled = router.engine.event

    async def unheard_fence(tracked: TrackedSession, event: Event) -> None:
        if not event.fenced:
            await handled(tracked, event)

    monkeypatch.setattr(router.engine, "event", unheard_fence)
    max_new = 150
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] == verifier.uri
    reference = greedy_reference(target, max_new)
    before = await read_output(deployment.client("frontend", peer="verifier1"), session, until=8)
    assert not before[-1].final, "the session finished before the record could be appended"
    intruding = await append_intruding_record(deployment, session, "second verifier", reference)
    cert, key = deployment.certs["frontend"]
    # The client follows the session for as long as it takes (the test's guard bounds it), not
    # for its default number of tries, which a loaded machine might use up.
    async with ClusterClient(router.uri, cert=cert, key=key, ca=deployment.ca, follow_attempts=10_000) as client:
        chunks = [chunk async for chunk in client.stream(SessionHandle(session, 1, verifier.uri, None))]
    tokens = [t for chunk in chunks for t in chunk.tokens]
    assert tokens == reference and chunks[-1].finish == Action.FINISH
    assert not any(tokens[i : i + 5] == intruding for i in range(len(tokens)))
    assert chunks[-1].epoch == 3 and router.sessions[session].plan.verifier == verifier.uri


async def test_a_reader_stuck_at_a_silent_verifier_follows_the_failover(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    max_new = 60
    await start_verifier(deployment, "verifier2")
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes)
    first = next(node for node in deployment.nodes if getattr(node, "uri", None) == opened["verifier"])
    assert isinstance(first, VerifierNode)

    # The first verifier goes silent as a paused process does: no status, and neither proposals
    # nor output reads are answered.
    async def unanswered(*_args: object, **_kwargs: object) -> None:
        await asyncio.Event().wait()

    reading = asyncio.Event()

    async def unanswered_read(*_args: object, **_kwargs: object) -> None:
        reading.set()
        await unanswered()

    monkeypatch.setattr(first.engine, "output", unanswered_read)
    monkeypatch.setattr(first.engine, "outputs", unanswered_read)
    monkeypatch.setattr(first.engine, "propose", unanswered)
    monkeypatch.setattr(first, "status", lambda: None)

    def failed_over() -> bool:
        # The router's clock jumps past the silent verifier's TTL; again if a report it sent
        # before it fell silent arrived after the jump.
        if router.registry.is_live(first.uri, router.clock()):
            jump_clock(router).advance(PAST_TTL_S)
        return router.sessions[session].plan.verifier != first.uri

    cert, key = deployment.certs["frontend"]
    async with ClusterClient(deployment.uris["router"], cert=cert, key=key, ca=deployment.ca) as client:
        handle = await client.locate(SessionHandle(session, 1, first.uri, None))
        assert handle.verifier == first.uri

        async def read_all() -> list[OutputChunk]:
            return [chunk async for chunk in client.stream(handle)]

        reader = asyncio.create_task(read_all())
        # Once the reader waits at the silent verifier, the router fails the session over.
        await asyncio.wait_for(reading.wait(), HANG_GUARD_S)
        await eventually(failed_over)
        # Well within the 30 s a read waits for its answer: the router's new epoch is followed.
        async with asyncio.timeout(20):
            chunks = await reader
    assert [t for chunk in chunks for t in chunk.tokens] == greedy_reference(target, max_new)
    assert chunks[-1].epoch == 2 and chunks[-1].finish == Action.FINISH
    # Each chunk names the verifier it came from: a reader asks the new one for the statistics
    # (issue #36: `sdcp generate` asked the silent one and waited its 30 s).
    assert chunks[-1].verifier == router.sessions[session].plan.verifier != first.uri
    assert {chunk.verifier for chunk in chunks if chunk.epoch == 1} <= {first.uri}


async def test_a_stream_whose_verifier_commits_nothing_ends_with_a_clear_error(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #36: a session whose verifier stays live but can commit nothing (its store gone, say:
    every append fails) and that no router moves used to keep its stream open forever. After the
    client's stall bound the stream ends with SessionStalled, which the gateway sends as an error."""
    await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    opened = await open_session(deployment, tiny_contract(target, max_new=60))
    session = opened["session"]
    assert isinstance(session, bytes)
    first = next(node for node in deployment.nodes if getattr(node, "uri", None) == opened["verifier"])
    assert isinstance(first, VerifierNode)
    before = await read_output(deployment.client("frontend", peer="verifier1"), session, until=4)
    assert not before[-1].final, "the session finished before its commits could be stopped"
    committing = asyncio.Event()

    async def no_commit(*_args: object, **_kwargs: object) -> None:
        committing.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(first.engine, "propose", no_commit)
    cert, key = deployment.certs["frontend"]
    async with ClusterClient(deployment.uris["router"], cert=cert, key=key, ca=deployment.ca, stall_s=2.0) as client:
        handle = await client.locate(SessionHandle(session, 1, first.uri, None))
        await asyncio.wait_for(committing.wait(), HANG_GUARD_S)
        chunks: list[OutputChunk] = []
        with pytest.raises(SessionStalled, match="no output for 2 s"):
            async with asyncio.timeout(HANG_GUARD_S):
                async for chunk in client.stream(handle):
                    chunks.append(chunk)
    assert all(chunk.finish is None for chunk in chunks)


async def test_a_session_no_drafter_drives_is_assigned_again(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1", drafter_silence_s=1.0)
    drafter = await start_drafter(deployment, "drafter1")
    # The router fails the first two events it gets (503): the verifier must send them again.
    failures = [ServiceUnavailable("restarting"), ServiceUnavailable("restarting")]

    class FlakyEvent(Event):
        @classmethod
        def from_obj(cls, obj: object) -> Event:  # type: ignore[override]
            if failures:
                raise failures.pop()
            return Event.from_obj(obj)

    monkeypatch.setattr(router_module, "Event", FlakyEvent)
    max_new = 80
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes)
    # The drafter gives the session up without telling anyone (as after rounds without verdicts).
    await eventually(lambda: session in drafter.engine.runs)
    task = drafter.engine.runs[session].task
    assert task is not None
    task.cancel()
    outputs = await asyncio.wait_for(read_output(deployment.client("frontend", peer="verifier1"), session), 60)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, max_new)
    assert not failures and verifier.engine.sessions[session].machine.ended


async def test_the_front_end_cancels_its_session(deployment: Deployment, target: TargetModel) -> None:
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    max_new = 2000
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes)
    path = f"sessions/{session_path_id(session)}/cancel"
    request = CancelRequest(session=session, epoch=1).to_obj()
    await read_output(deployment.client("frontend", peer="verifier1"), session, until=5)
    # Only the session's front end (and, at the verifier, the router) may end it.
    with pytest.raises(ProtocolError) as refused:
        await deployment.client("drafter1").post_cbor(path, request)
    assert refused.value.status == 403
    _, body = await deployment.client("frontend").post_cbor(path, request)
    state = SessionState.from_obj(body)
    assert state.state == Action.FAIL and state.committed < max_new
    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    tokens = [t for output in outputs for t in output.tokens]
    assert tokens == greedy_reference(target, state.committed) and outputs[-1].finish == Action.FAIL
    assert router.sessions[session].ended
    machine = verifier.engine.sessions[session].machine
    async with MLC.from_config(disk_dir=deployment.tmp / "mlc") as mlc:
        records = (await mlc.commit_log(build_uri("local", None, "log", session.hex())).read()).records
    # The end is recorded: a last round that commits nothing, after which nothing was committed.
    assert records[-1]["emitted"] == [] and records[-1]["round"] == machine.round
    assert records[-1]["committed"] == state.committed == machine.committed
    # Cancelling again changes nothing.
    _, again = await deployment.client("frontend").post_cbor(path, request)
    assert SessionState.from_obj(again).committed == state.committed


async def test_a_session_open_that_times_out_is_cancelled_where_it_was_opened(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = deployment.router
    assert router is not None
    patient = router.config
    monkeypatch.setattr(router, "config", replace(patient, router=replace(patient.router, open_timeout_s=1.0)))
    verifiers = [await start_verifier(deployment, "verifier1"), await start_verifier(deployment, "verifier2")]
    await start_drafter(deployment, "drafter1")
    slow: list[VerifierNode] = []
    opened_elsewhere = asyncio.Event()
    for node in verifiers:
        opened_by = node.engine.open_session

        async def open_late(
            message: SessionOpen,
            requester_gone: asyncio.Event | None = None,
            node: VerifierNode = node,
            opened_by=opened_by,  # noqa: ANN001
        ) -> SessionState:
            state = await opened_by(message, requester_gone)
            if slow:
                opened_elsewhere.set()
                return state
            # The first verifier asked answers only after the router gave up on it and opened the
            # session at the other one, which the router waits for as long as it needs.
            slow.append(node)
            router.config = patient
            await opened_elsewhere.wait()
            return state

        monkeypatch.setattr(node.engine, "open_session", open_late)
    opened = await open_session(deployment, tiny_contract(target, max_new=12))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] != slow[0].uri
    # Where it was opened too late, the session is cancelled rather than left for nobody. It was a
    # session of its own, whose end is not in the commit log of the one opened elsewhere.
    (abandoned,) = slow[0].engine.sessions.values()
    assert abandoned.machine.session != session
    await eventually(lambda: abandoned.machine.ended)
    assert abandoned.machine.state().state == Action.FAIL
    peer = "verifier1" if opened["verifier"] == verifiers[0].uri else "verifier2"
    outputs = await read_output(deployment.client("frontend", peer=peer), session)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 12)


async def test_a_policy_is_forwarded_and_carried_by_later_assignments(
    deployment: Deployment, target: TargetModel
) -> None:
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    opened = await open_session(deployment, tiny_contract(target, max_new=8))
    session = opened["session"]
    assert isinstance(session, bytes) and "drafter" not in opened
    path = f"sessions/{session_path_id(session)}/policy"
    frontend = deployment.client("frontend")
    profile = Sampling(temperature_milli=0, top_k=5)

    with pytest.raises(ProtocolError) as elsewhere:
        await frontend.post_cbor(path, Policy(session=bytes(16), from_round=1, sampling=profile).to_obj())
    assert elsewhere.value.status == 400
    code, body = await frontend.post_cbor(path, Policy(session=session, from_round=1, sampling=profile).to_obj())
    assert code == 200 and SessionState.from_obj(body).round == 0
    assert verifier.engine.sessions[session].machine.sampling_for(1) == profile

    # The session waited for a drafter; the periodic task assigns the first that appears, with the
    # profile in the assignment (SDCP 6.6) and the contract unchanged.
    drafter = await start_drafter(deployment, "drafter1")
    await eventually(lambda: session in drafter.engine.runs)
    assignment = drafter.engine.runs[session].assignment
    assert assignment.sampling == profile and assignment.contract == tiny_contract(target, max_new=8)
    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 8)


async def test_a_failed_drafter_is_replaced_from_the_committed_prefix(
    deployment: Deployment, target: TargetModel
) -> None:
    await start_verifier(deployment, "verifier1")
    first = await start_drafter(deployment, "drafter1")
    max_new = 150
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["drafter"] == first.uri
    second = await start_drafter(deployment, "drafter2")
    reader = deployment.client("frontend", peer="verifier1")
    before = await read_output(reader, session, until=8)
    assert not before[-1].final, "the session finished before the drafter could be stopped"
    await deployment.stop(first)

    # SDCP 6.9: once drafter1's status expires, the router assigns drafter2 with the committed prefix.
    await eventually(lambda: session in second.engine.runs)
    assignment = second.engine.runs[session].assignment
    assert assignment.committed >= 8 and assignment.committed_tokens is not None
    after = await read_output(reader, session, before[-1].from_ + len(before[-1].tokens))
    tokens = [t for output in before + after for t in output.tokens]
    assert tokens == greedy_reference(target, max_new)


class WrongDrafter:
    """A real drafter that is always wrong: it proposes, at every position, a token other than the
    target's greedy choice for the first one (computed with its own copy of the tiny target)."""

    name = "always-wrong"
    runs_inline = False

    def set_threads(self, threads: int) -> None:
        return None  # one thread, the caller's

    def __init__(self) -> None:
        self.model = tiny_model()
        self.sessions: dict[bytes, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def weights_digest(self) -> bytes:
        return PLAYED_MODEL

    def prepare(self) -> None:
        return None

    @property
    def seconds_per_token(self) -> float:
        return 0.001

    def open_session(self, session: bytes, prompt_tokens: Sequence[int]) -> None:
        self.sessions[session] = list(prompt_tokens)

    def sync(self, session: bytes, committed_tokens: Sequence[int]) -> None:
        self.sessions[session] = list(committed_tokens)

    def draft(self, session: bytes, m: int, sampling: Sampling | None, rng: object = None) -> DraftResult:
        with torch.inference_mode():
            logits = self.model(torch.tensor([self.sessions[session]])).logits[0, -1]
        wrong = (int(torch.argmax(logits)) + 1) % self.vocab_size
        rows = np.zeros((m, self.vocab_size), dtype=np.float32)
        rows[:, wrong] = 1.0
        return DraftResult(tokens=(wrong,) * m, q_rows=rows, seconds=0.001)

    def close_session(self, session: bytes) -> None:
        self.sessions.pop(session, None)


async def test_escalation_reduce_switch_and_self_decode_end_to_end(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SDCP 6.5.2 through real services: persistent rejection reduces m_cap, switches the drafter and
    lets the verifier decode alone; the output is still the target's greedy decoding."""
    router = deployment.router
    assert router is not None
    # The escalations under test are the verifier's. Whether the router itself would rather have
    # the verifier decode alone depends on how fast this machine drafts and verifies: it is not
    # offered that option, so the session starts, and stays, with drafters.
    monkeypatch.setattr(sdcp.protocol.router, "self_decode_seconds", lambda contract, verifier: None)
    await start_verifier(deployment, "verifier1")
    wrong = DrafterNode(deployment.config("drafter1", drafter=DrafterConfig(target="tiny")), drafter=WrongDrafter())
    await deployment.start(wrong)
    await eventually(lambda: router.registry.is_live(wrong.uri, router.clock()))
    contract = tiny_contract(
        target,
        max_new=16,
        low_rounds=1,
        self_load=100,
        self_max=3,
        fallback=[Action.REDUCE, Action.SWITCH, Action.SELF_DECODE] + [Action.REDUCE] * 16,
    )
    opened = await open_session(deployment, contract)
    session = opened["session"]
    assert isinstance(session, bytes) and opened["drafter"] == wrong.uri
    # The second drafter joins only now, so that the switch has somewhere to go.
    good = await start_drafter(deployment, "drafter2")

    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 16)
    _, stats = await deployment.client("frontend", peer="verifier1").get_cbor(
        f"sessions/{session_path_id(session)}/stats"
    )
    assert isinstance(stats, dict)
    escalated = stats["escalated"]
    assert escalated["reduce"] >= 1 and escalated["switch"] >= 1 and escalated["self_decode"] >= 1
    assert stats["self_decoded"] >= 1
    assert counter("sdcp_drafter_proposals_total", wrong.uri) > 0
    assert counter("sdcp_drafter_proposals_total", good.uri) > 0


async def test_a_rule_2_session_with_a_model_drafter_reaches_max_new(
    deployment: Deployment, target: TargetModel
) -> None:
    """Speculative sampling (SDCP 6.4 rule 2, seeded) across router, two drafters and a verifier."""
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    model_drafter = DrafterNode(
        deployment.config("drafter1", drafter=DrafterConfig(model="hf:tiny-draft", target="tiny"))
    )
    await deployment.start(model_drafter)
    await eventually(lambda: router.registry.is_live(model_drafter.uri, router.clock()))
    await start_drafter(deployment, "drafter2")
    contract = tiny_contract(
        target,
        rule=2,
        sampling={"temperature_milli": 800, "seed": 5},
        max_new=16,
        drafters=[model_drafter.engine.drafter.weights_digest],
    )
    opened = await open_session(deployment, contract)
    session = opened["session"]
    assert isinstance(session, bytes) and opened["drafter"] == model_drafter.uri
    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    tokens = [t for output in outputs for t in output.tokens]
    assert len(tokens) == 16 and outputs[-1].finish == Action.FINISH
    live = verifier.engine.sessions[session]
    assert live.machine.stats.accepted > 0  # the model drafter's rows were used and some accepted


async def test_an_ended_session_is_forgotten_after_its_retention(deployment: Deployment, target: TargetModel) -> None:
    router = deployment.router
    assert router is not None
    router.config = replace(router.config, router=replace(router.config.router, ended_retention_s=0.2))
    await start_verifier(deployment, "verifier1")
    opened = await open_session(deployment, tiny_contract(target))
    session = opened["session"]
    assert isinstance(session, bytes)
    code, _ = await deployment.client("verifier1").post_cbor(
        "events", Event(session=session, epoch=1, kind=Action.FINISH, committed=0, digest=bytes(32)).to_obj()
    )
    assert code == 204 and router.sessions[session].ended
    await eventually(lambda: session not in router.sessions)
    with pytest.raises(ProtocolError) as gone:
        await deployment.client("frontend").get_cbor(f"sessions/{session_path_id(session)}")
    assert gone.value.status == 404


class _SlowNgram(NgramDrafter):
    """An n-gram drafter that reports drafting as costly as a second target model."""

    @property
    def seconds_per_token(self) -> float:
        return 1.0


async def test_a_drafter_slower_than_the_verifier_alone_is_not_assigned(
    deployment: Deployment, target: TargetModel
) -> None:
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    slow = DrafterNode(
        deployment.config("drafter1", drafter=DrafterConfig(model="ngram", target="tiny")),
        drafter=_SlowNgram(target.vocab_size),
    )
    await deployment.start(slow)
    await eventually(lambda: router.registry.is_live(slow.uri, router.clock()))
    contract = tiny_contract(
        target, max_new=12, self_load=100, self_max=5, fallback=[Action.REDUCE, Action.SELF_DECODE, Action.FAIL]
    )
    opened = await open_session(deployment, contract)
    session = opened["session"]
    assert isinstance(session, bytes) and "drafter" not in opened

    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 12)
    await eventually(lambda: router.sessions[session].ended)
    # Three self-decoding periods of at most 5 tokens, each ended by an event and decided again.
    assert router.sessions[session].served == ["self-decoding"]
    assert not slow.engine.runs and counter("sdcp_router_assignments_total", router.uri) == 0
    assert verifier.engine.sessions[session].machine.stats.self_decoded == 12


async def test_an_unmeasured_drafter_is_explored_until_its_status_reports_a_measurement(
    deployment: Deployment, target: TargetModel
) -> None:
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    drafter = await start_drafter(deployment, "drafter1")
    assert router.registry.get(drafter.uri).status.alpha_milli is None  # type: ignore[union-attr]
    contract = tiny_contract(
        target, max_new=12, self_load=100, fallback=[Action.REDUCE, Action.SELF_DECODE, Action.FAIL]
    )
    opened = await open_session(deployment, contract)
    session = opened["session"]
    assert isinstance(session, bytes)
    assert opened["drafter"] == drafter.uri and router.sessions[session].exploring == drafter.uri
    outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
    assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 12)
    # MEASURED_AFTER_VERDICTS verdicts in, the drafter reports its acceptance at once.
    await eventually(lambda: router.registry.get(drafter.uri).status.alpha_milli is not None, timeout_s=2.0)  # type: ignore[union-attr]


async def test_sessions_opened_together_explore_an_unmeasured_drafter_one_at_a_time(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session explores an unmeasured drafter once the drafter took its assignment: sessions
    that opened meanwhile found it unexplored, and a wave of them all explored it. While one
    exploration's assignment is on its way (held here until the other session is open, or has
    asked the drafter too), the other session decodes without it."""
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    drafter = await start_drafter(deployment, "drafter1")
    contract = tiny_contract(
        target, max_new=12, self_load=100, fallback=[Action.REDUCE, Action.SELF_DECODE, Action.FAIL]
    )
    asked: list[bytes] = []
    asked_twice, release = asyncio.Event(), asyncio.Event()
    assign = router_module.HTTPRouterLink.assign

    async def held(link: router_module.HTTPRouterLink, to: str, assignment: Assignment) -> None:
        asked.append(assignment.session)
        if len(asked) > 1:
            asked_twice.set()
        await release.wait()
        await assign(link, to, assignment)

    monkeypatch.setattr(router_module.HTTPRouterLink, "assign", held)
    opens = [asyncio.ensure_future(open_session(deployment, contract)) for _ in range(2)]
    await asyncio.wait([*opens, asyncio.ensure_future(asked_twice.wait())], return_when=asyncio.FIRST_COMPLETED)
    release.set()
    opened = await asyncio.gather(*opens)
    assert len(asked) == 1
    explorer = next(one for one in opened if one["session"] == asked[0])
    assert explorer["drafter"] == drafter.uri and router.sessions[asked[0]].exploring == drafter.uri
    for one in opened:
        session = one["session"]
        assert isinstance(session, bytes)
        outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
        assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 12)


class _ReportingDrafter(DrafterNode):
    """A real n-gram drafter whose status report the test sets: ``ours`` keeps our cost terms with
    a measured ``alpha_milli``; otherwise only the members of SDCP 5.2 are sent, with the test's
    ``accept_milli``, as by a drafter written from the draft alone."""

    def __init__(self, config: ServiceConfig, *, ours: bool, accept_milli: int) -> None:
        super().__init__(config)
        self.ours = ours
        self.accept_milli = accept_milli

    def status(self) -> Status:
        own = self.engine.status()
        if self.ours:
            # Measured at 90 %, drafting in 10 us, and verified as the verifier reports.
            return replace(own, alpha_milli=self.accept_milli, draft_us=10, verify_us=None)
        return Status(
            instance=own.instance,
            role=own.role,
            load=own.load,
            queue=own.queue,
            accept_milli=self.accept_milli,
            cache_mbps=own.cache_mbps,
            ttl_ms=own.ttl_ms,
        )


async def test_a_drafter_without_our_cost_terms_is_ranked_by_its_accept_milli(
    deployment: Deployment, target: TargetModel
) -> None:
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    settings = DrafterConfig(model="ngram", target="tiny")
    ours = _ReportingDrafter(deployment.config("drafter1", drafter=settings), ours=True, accept_milli=900)
    vendor = _ReportingDrafter(deployment.config("drafter2", drafter=settings), ours=False, accept_milli=400)
    for node in (ours, vendor):
        await deployment.start(node)
    await eventually(lambda: all(router.registry.is_live(node.uri, router.clock()) for node in (ours, vendor)))
    view = router.registry.get(vendor.uri)
    assert view is not None and view.status.alpha_milli is None and view.status.draft_us is None

    async def decode_one() -> str:
        """Open a session, read it to its end; the drafter it was first assigned to."""
        opened = await open_session(deployment, tiny_contract(target, max_new=12))
        session = opened["session"]
        assert isinstance(session, bytes) and isinstance(opened["drafter"], str)
        assert router.sessions[session].exploring is None  # measured: nothing to explore
        outputs = await read_output(deployment.client("frontend", peer="verifier1"), session)
        assert [t for output in outputs for t in output.tokens] == greedy_reference(target, 12)
        await eventually(lambda: router.sessions[session].ended)
        return opened["drafter"]

    # At 40 % it is expected to be slower than ours at 90 %: sessions go to ours, none explores it.
    assert [await decode_one() for _ in range(3)] == [ours.uri] * 3
    assert not vendor.engine.runs and counter("sdcp_router_assignments_total", router.uri) == 3
    # Reporting 95 % (and no drafting time), it is expected to be the faster, and is chosen.
    vendor.accept_milli = 950
    vendor.report_status_soon()
    await eventually(lambda: router.registry.get(vendor.uri).status.accept_milli == 950)  # type: ignore[union-attr]
    assert await decode_one() == vendor.uri


async def test_a_front_end_whose_first_router_is_gone_uses_the_next(
    deployment: Deployment, target: TargetModel
) -> None:
    """[instance] router as a list (#29): the client opens the session at the first router that
    answers, asks that one about it, and reads the greedy output; the first one answers nothing."""
    router = deployment.router
    assert router is not None
    await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    gone = f"https://127.0.0.1:{free_port()}"
    cert, key = deployment.certs["frontend"]
    async with ClusterClient([gone, router.uri], cert=cert, key=key, ca=deployment.ca) as client:
        assert await client.targets()
        handle = await client.open(PROMPT, tiny_contract(target, max_new=40))
        assert handle.router == router.uri
        tokens = [t async for chunk in client.stream(handle) for t in chunk.tokens]
        assert tokens == greedy_reference(target, 40)
        # Asked about the session, the router that answered it comes first (the gone one never does).
        assert (await client.describe(handle))["session"] == handle.session


@pytest.mark.parametrize("served", [True, False])
async def test_a_front_end_reads_its_sessions_output_together_or_one_get_each(
    deployment: Deployment, target: TargetModel, monkeypatch: pytest.MonkeyPatch, served: bool
) -> None:
    """Streams of one client at one verifier are read with POST outputs, the reads asked within one
    turn of the event loop in one request; a verifier without that extension (another
    implementation: 404) is read one GET a session. Either way each stream is the greedy output."""
    asked: list[int] = []
    gets: list[str] = []
    batched_reads, single_read = VerifierNode.outputs, VerifierNode.output

    async def counted_outputs(node: VerifierNode, request: Request) -> Response:
        asked.append(len(cbor2.loads(await request.body())["reads"]))
        return await batched_reads(node, request)

    async def counted_output(node: VerifierNode, request: Request) -> Response:
        gets.append(request.path_params["id"])
        return await single_read(node, request)

    monkeypatch.setattr(VerifierNode, "outputs", counted_outputs)
    monkeypatch.setattr(VerifierNode, "output", counted_output)
    if not served:
        routes = VerifierNode.routes
        monkeypatch.setattr(VerifierNode, "routes", lambda node: [r for r in routes(node) if r.path != "/outputs"])
    await start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    cert, key = deployment.certs["frontend"]
    async with ClusterClient(deployment.uris["router"], cert=cert, key=key, ca=deployment.ca) as client:
        handles = [await client.open(PROMPT, tiny_contract(target, max_new=24)) for _ in range(3)]

        async def tokens(handle: SessionHandle) -> list[int]:
            return [t async for chunk in client.stream(handle) for t in chunk.tokens]

        streamed = await asyncio.gather(*(tokens(handle) for handle in handles))
    assert streamed == [greedy_reference(target, 24)] * 3
    if served:
        assert asked[0] == 3 and not gets
    else:
        assert asked == [] and len(set(gets)) == 3


async def test_the_router_connects_to_an_instance_at_its_first_report(deployment: Deployment) -> None:
    """A verifier or drafter that reports is connected to at once, before any session needs it:
    the first session-open it gets skips the TLS handshake."""
    router = deployment.router
    assert router is not None
    verifier = await start_verifier(deployment, "verifier1")
    drafter = await start_drafter(deployment, "drafter1")
    await eventually(lambda: all(router.peers.get(node.uri).connected for node in (verifier, drafter)))
    assert not router.sessions
