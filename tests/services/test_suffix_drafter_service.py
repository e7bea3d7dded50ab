"""The suffix drafter through the drafter service, against the real verifier service on the tiny
target (SDCP 6.2, 6.4 rule 1): the output is the target's greedy decoding, and a session that
repeats a finished one's task gets most of its tokens from the drafter, whichever drafter instance
drafted the finished one: the verifier publishes finished sessions' output to the MLC, and every
instance reads its history scope's entries from there (sdcp.engines.history)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from tests.services.drafter_harness import (
    PROMPT,
    ROUTER,
    STRANGER,
    Env,
    greedy,
    make_assignment,
    make_contract,
    read_all_output,
    verifier_node,
)
from tests.services.drafter_harness import target as target  # noqa: PLC0414 - the harness's fixture
from tests.waiting import eventually

from sdcp.cache import MLC, build_uri
from sdcp.config import DrafterConfig, MLCConfig, VerifierConfig
from sdcp.engines.history import history_scope_key
from sdcp.localhost import free_port
from sdcp.models.hf.target import TargetModel
from sdcp.models.lookup.suffix import SuffixDrafter
from sdcp.protocol.digest import prefix_digest
from sdcp.protocol.messages import Contract, HistoryStatus, SessionOpen, session_path_id
from sdcp.services.drafter import DrafterNode
from sdcp.services.verifier import VerifierNode
from sdcp.transport.certs import make_certs

pytestmark = pytest.mark.timeout(120)

TENANT = "https://tenant-a.example"
OTHER_TENANT = "https://tenant-b.example"


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    """The drafter service tests' environment, with a certificate for a second drafter instance."""
    verifier_uri = f"https://127.0.0.1:{free_port()}"
    drafter_uris = [f"https://127.0.0.1:{free_port()}/drafter" for _ in range(2)]
    uris = [verifier_uri, *drafter_uris, ROUTER, STRANGER]
    issued = make_certs(tmp_path / "certs", uris)
    certs = {uri: (issued[uri].cert_path, issued[uri].key_path) for uri in uris}
    mlc = MLC.from_config(authority=MLCConfig().authority, disk_dir=tmp_path / "mlc")
    environment = Env(tmp_path, tmp_path / "certs" / "ca.pem", certs, verifier_uri, drafter_uris[0], mlc, [])
    environment.second_drafter_uri = drafter_uris[1]  # type: ignore[attr-defined]
    try:
        yield environment
    finally:
        await asyncio.gather(*(client.aclose() for client in environment.clients))
        await mlc.close()


async def suffix_node(env: Env, uri: str) -> DrafterNode:
    """A suffix drafter instance with its own MLC over the shared directory; it looks for new
    history entries at every assignment."""
    settings = DrafterConfig(model="suffix", target="tiny", history_refresh_s=0.0)
    node = DrafterNode(env.config(uri, drafter=settings))
    await node.start()
    return node


def published(verifier: str) -> float:
    labels = {"instance": verifier, "outcome": "published"}
    return REGISTRY.get_sample_value("sdcp_verifier_history_published_total", labels) or 0.0


async def run_session(
    env: Env,
    contract: Contract,
    drafter: str,
    owner: str,
    prompt: tuple[int, ...] = PROMPT,
    tenant: str | None = None,
) -> tuple[list[int], int]:
    """As the router: a session of ``owner`` (and its ``tenant``) drafted by ``drafter``, to its
    end, and once its output is published; the output and how many drafted tokens the verifier
    accepted."""
    output, stats = await run_session_stats(env, contract, drafter, owner, prompt, tenant)
    return output, stats["accepted"]


async def run_session_stats(
    env: Env, contract: Contract, drafter: str, owner: str, prompt: tuple[int, ...], tenant: str | None = None
) -> tuple[list[int], dict[str, Any]]:
    """``run_session``, with the session's id and its stats (GET sessions/{id}/stats)."""
    session = os.urandom(16)
    router = env.client(env.verifier_uri, ROUTER)
    log_uri = build_uri("local", None, "log", session.hex())
    opened = SessionOpen(
        session=session, epoch=1, contract=contract, prompt=prompt, commit_log=log_uri, owner=owner, tenant=tenant
    )
    status, _ = await router.post_cbor("sessions", opened.to_obj())
    assert status == 201
    digest = prefix_digest(contract.digest, prompt)
    assignment = make_assignment(
        env, contract, session, drafter=drafter, owner=owner, prompt=prompt, digest=digest, tenant=tenant
    )
    await router.put_cbor(f"sessions/{session_path_id(session)}/drafter", assignment.to_obj())
    before = published(env.verifier_uri)
    await env.client(drafter, ROUTER).post_cbor("assignments", assignment.to_obj())
    output = await asyncio.wait_for(read_all_output(env, session), 60)
    await eventually(lambda: published(env.verifier_uri) > before)
    _, stats = await env.client(env.verifier_uri, STRANGER).get_cbor(f"sessions/{session_path_id(session)}/stats")
    assert isinstance(stats, dict)
    return output, {**stats, "session": session}


async def test_drafter_instances_draft_from_each_others_finished_sessions(env: Env, target: TargetModel) -> None:
    verifier = await verifier_node(env, target)
    first_uri, second_uri = env.drafter_uri, env.second_drafter_uri  # type: ignore[attr-defined]
    first, second = await suffix_node(env, first_uri), await suffix_node(env, second_uri)
    first_suffix, second_suffix = first.engine.drafter, second.engine.drafter
    assert isinstance(first_suffix, SuffixDrafter) and isinstance(second_suffix, SuffixDrafter)
    contract = make_contract(target, max_new=32)
    expected = greedy(target, PROMPT, contract.max_new)
    try:
        output, accepted_alone = await run_session(env, contract, first_uri, TENANT)
        assert output == expected
        # The drafter keeps nothing itself: the verifier's publication is the one source.
        assert first_suffix.history_size.sessions == 0
        # The second instance never saw that session: it reads it from the MLC at its assignment.
        output, accepted = await run_session(env, contract, second_uri, TENANT)
        assert output == expected  # SDCP 6.4 rule 1: whatever is proposed
        assert second_suffix.history_size.sessions == 1
        assert 2 * accepted > contract.max_new and accepted > accepted_alone
        # And the first instance reads both, its own once (not again from its own end).
        await run_session(env, contract, first_uri, TENANT)
        assert (first_suffix.history_size.sessions, first_suffix.history_size.tokens) == (2, 2 * contract.max_new)

        # Another owner's history is not used: its scope holds nothing yet.
        output, accepted_other = await run_session(env, contract, second_uri, OTHER_TENANT)
        assert output == expected
        other_key = history_scope_key(contract, OTHER_TENANT, "owner")
        assert second_suffix.history.index(other_key) is None
        assert second_suffix.history_size.sessions == 1
        assert accepted_other < accepted
    finally:
        await first.stop()
        await second.stop()
    # A new instance warms from the shared store at its first assignment of the scope, before it
    # drafts: the three finished sessions of the tenant.
    fresh = await suffix_node(env, first_uri)
    fresh_suffix = fresh.engine.drafter
    assert isinstance(fresh_suffix, SuffixDrafter)
    try:
        output, accepted = await run_session(env, contract, first_uri, TENANT)
        assert output == expected
        tenant_key = history_scope_key(contract, TENANT, "owner")
        assert fresh_suffix.history.index(tenant_key) is not None
        assert fresh_suffix.history_size.sessions == 3
        assert 2 * accepted > contract.max_new
        labels = {"instance": first_uri}
        assert REGISTRY.get_sample_value("sdcp_drafter_history_sessions", labels) == 3
        assert REGISTRY.get_sample_value("sdcp_drafter_history_tokens", labels) == 3 * contract.max_new
        bound = fresh_suffix.history.max_tokens
        assert REGISTRY.get_sample_value("sdcp_drafter_history_max_tokens", labels) == bound
        # The router hears it too, in the status extension member `history`.
        reported = HistoryStatus.from_obj(fresh.status().to_obj()["history"])
        assert reported == HistoryStatus(sessions=3, tokens=3 * contract.max_new, max_tokens=bound)
    finally:
        await fresh.stop()
        await verifier.stop()


async def test_one_api_users_output_is_never_drafted_for_another(env: Env, target: TargetModel) -> None:
    """Issue #36, the history oracle: every API user of one gateway shares its certificate (the
    sessions' owner), so a user's output drafted another's session of the same prompt, and the
    accepted count (usage.speculative) told whether someone had received that output: 157 of 160
    against 3-4. The gateway now names the user as the session's tenant (failed before: the second
    tenant drafted from the first's output): a tenant drafts from its own outputs only."""
    verifier = await verifier_node(env, target)
    drafter = await suffix_node(env, env.drafter_uri)
    contract = make_contract(target, max_new=32)
    expected = greedy(target, PROMPT, contract.max_new)
    try:
        output, alone = await run_session(env, contract, env.drafter_uri, TENANT, tenant="alice")
        assert output == expected
        output, other = await run_session(env, contract, env.drafter_uri, TENANT, tenant="bob")
        assert output == expected
        output, again = await run_session(env, contract, env.drafter_uri, TENANT, tenant="alice")
        assert output == expected
        # Alice's second session drafts from her first; Bob's, from nothing but his prompt.
        assert 2 * again > contract.max_new and other <= alone < again
        for tenant in ("alice", "bob"):
            assert history_scope_key(contract, TENANT, "owner", tenant) != history_scope_key(contract, TENANT, "owner")
    finally:
        await drafter.stop()
        await verifier.stop()


async def test_a_new_drafter_instance_warms_from_redis_at_start(env: Env, target: TargetModel, redis_url: str) -> None:
    """Sessions finish while one drafter instance serves; a second instance started afterwards
    reads its configured owners' history from the shared tier before it reports status, and
    drafts from it on its very first round, without reading the store at that assignment."""
    prefix = f"sdcp:warm-{os.urandom(4).hex()}:"

    def shared() -> MLC:
        return MLC.from_config(authority=MLCConfig().authority, redis_url=redis_url, redis_prefix=prefix)

    for session in list(target._sessions):
        target.close_session(session)
    verifier_config = env.config(env.verifier_uri, verifier=VerifierConfig(model="tiny", output_wait_s=0.5))
    verifier = VerifierNode(verifier_config, target=target, mlc=shared())
    await verifier.start()
    first_uri, second_uri = env.drafter_uri, env.second_drafter_uri  # type: ignore[attr-defined]
    first = DrafterNode(env.config(first_uri, drafter=DrafterConfig(model="suffix", target="tiny")), mlc=shared())
    await first.start()
    running: list[DrafterNode | VerifierNode] = [verifier, first]
    contract = make_contract(target, max_new=32)
    try:
        answer, _ = await run_session(env, contract, first_uri, TENANT)
        await run_session(env, contract, first_uri, OTHER_TENANT)
        await running.pop().stop()
        # A later turn that quotes the earlier answer: its prompt ends with the answer's start.
        quoting = (*PROMPT, *answer[:6])
        settings = DrafterConfig(model="suffix", target="tiny", history_warm_owners=(TENANT,), history_refresh_s=3600.0)
        second = DrafterNode(env.config(second_uri, drafter=settings), mlc=shared())
        await second.start()
        running.append(second)
        suffix = second.engine.drafter
        assert isinstance(suffix, SuffixDrafter)
        # Warmed before its first status report: the tenant's session, not the other tenant's.
        assert second.status().history == HistoryStatus(
            sessions=1, tokens=contract.max_new, max_tokens=suffix.history.max_tokens
        )
        assert suffix.history.index(history_scope_key(contract, TENANT, "owner")) is not None
        assert suffix.history.index(history_scope_key(contract, OTHER_TENANT, "owner")) is None
        learned = REGISTRY.get_sample_value("sdcp_drafter_history_learned_total", {"instance": second_uri})

        output, stats = await run_session_stats(env, contract, second_uri, TENANT, quoting)
        assert output == greedy(target, quoting, contract.max_new)  # SDCP 6.4 rule 1
        # Nothing was read at the assignment (refresh_s): what it drafted from came at start.
        assert REGISTRY.get_sample_value("sdcp_drafter_history_learned_total", {"instance": second_uri}) == learned
        first_round = verifier.engine.trace(stats["session"])[0]
        assert first_round["kind"] == "proposal" and first_round["drafter"] == second_uri
        assert first_round["accepted"] == first_round["proposed"] >= 3
    finally:
        for node in reversed(running):
            await node.stop()
