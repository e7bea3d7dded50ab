"""Router policy: TTL registry, selection, assignments and failover plans (SDCP 6.1, 6.9)."""

from __future__ import annotations

from tests.protocol.router_contracts import contract

from sdcp.protocol.digest import prefix_digest
from sdcp.protocol.messages import Role, Sampling, Status
from sdcp.protocol.records import FenceRecord, replay_commit_log
from sdcp.protocol.router import InstanceRegistry, RouterSession, drafter_permitted, prefer_idle_and_accepting

MODEL_A = b"\x0a" * 32
MODEL_B = b"\x0b" * 32


def status(
    uri: str,
    role: Role = Role.DRAFTER,
    load: int = 0,
    queue: int = 0,
    ttl_ms: int = 1000,
    accept_milli: int | None = None,
) -> Status:
    return Status(instance=uri, role=role, load=load, queue=queue, ttl_ms=ttl_ms, accept_milli=accept_milli)


def test_expired_instances_are_never_picked() -> None:
    registry = InstanceRegistry()
    registry.report(status("https://d1", ttl_ms=500), now=0.0)
    assert [v.uri for v in registry.live(Role.DRAFTER, 0.4)] == ["https://d1"]
    assert registry.live(Role.DRAFTER, 0.5) == []
    assert [v.uri for v in registry.expire(0.6)] == ["https://d1"]
    assert registry.expire(0.7) == []


def test_a_fresh_report_renews_the_ttl() -> None:
    registry = InstanceRegistry()
    registry.report(status("https://d1", ttl_ms=500), now=0.0)
    registry.report(status("https://d1", ttl_ms=500), now=0.4)
    assert registry.is_live("https://d1", 0.8)


def test_the_policy_prefers_low_load_queue_and_high_acceptance() -> None:
    registry = InstanceRegistry()
    registry.report(status("https://busy", load=80), 0)
    registry.report(status("https://queued", load=10, queue=3), 0)
    registry.report(status("https://idle-poor", load=10, accept_milli=100), 0)
    registry.report(status("https://idle-good", load=10, accept_milli=900), 0)
    registry.report(status("https://verifier", role=Role.VERIFIER), 0)
    assert prefer_idle_and_accepting(registry.live(Role.DRAFTER, 0)).uri == "https://idle-good"
    assert prefer_idle_and_accepting(registry.live(Role.VERIFIER, 0)).uri == "https://verifier"


def test_only_permitted_drafter_models() -> None:
    registry = InstanceRegistry()
    registry.report(status("https://a"), 0, model=MODEL_A)
    registry.report(status("https://b"), 0, model=MODEL_B)
    registry.report(status("https://unknown"), 0)
    only_b = contract([MODEL_B])
    permitted = [v.uri for v in registry.live(Role.DRAFTER, 0) if drafter_permitted(only_b, v.model)]
    assert permitted == ["https://b"]
    assert drafter_permitted(contract(), None)
    assert not drafter_permitted(only_b, None) and not drafter_permitted(only_b, MODEL_A)


def test_assignment_carries_state_and_current_sampling() -> None:
    c = contract()
    routed = RouterSession(
        session=b"\x00" * 16, epoch=1, contract=c, prompt=(1, 2), commit_log="mlc://h/-/log/s", verifier="https://v"
    )
    routed.sampling = Sampling(temperature_milli=0)
    digest = prefix_digest(c.digest, (1, 2))
    assignment = routed.assignment("https://d1", round=3, committed=5, digest=digest, m_init=4)
    assert assignment.sampling == Sampling(temperature_milli=0)
    assert assignment.contract.digest == c.digest
    assert (assignment.round, assignment.committed, assignment.digest) == (3, 5, digest)
    assert routed.open_message().epoch == 1 and routed.open_message().resume is None
    # The front end that opened the session goes to the drafter too (its history scope), on the wire.
    assert assignment.owner is None
    routed.owner = "https://gateway.example"
    owned = routed.assignment("https://d1", round=3, committed=5, digest=digest, m_init=4)
    assert type(owned).from_obj(owned.to_obj()).owner == routed.open_message().owner == "https://gateway.example"


def test_failover_fences_then_resumes_with_the_next_epoch() -> None:
    c = contract()
    routed = RouterSession(
        session=b"\x00" * 16, epoch=1, contract=c, prompt=(1, 2), commit_log="mlc://h/-/log/s", verifier="https://v1"
    )
    assert routed.fence_for_failover() == FenceRecord(2)
    replay = replay_commit_log([FenceRecord(2).to_obj()], c.digest, (1, 2))
    moved = routed.fail_over("https://v2", replay, committed_tokens="mlc://h/-/tokens/s")
    message = moved.open_message()
    assert message.epoch == 2 and moved.verifier == "https://v2"
    assert message.resume is not None and message.resume.committed == 0
    assert message.resume.digest == prefix_digest(c.digest, (1, 2))
