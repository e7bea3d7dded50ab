"""Per-request speculation through the gateway on a real cluster (router, a verifier of the tiny
target, an n-gram drafter; docs/services.md, "Per-request speculation"): ``speculative.enabled``
false has the verifier decode alone (no drafter proposes), ``max_tokens`` and ``drafters`` become the
contract's m_max and drafters, and ``report`` puts the session's acceptance in the usage, as the
verifier counted it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from tests.frontend.gateway_harness import Cluster, base, client_of, cluster
from tests.waiting import eventually

from sdcp.frontend.gateway import GatewayNode, api_tenant
from sdcp.protocol.verifier import SessionStats
from sdcp.services.drafter import DrafterNode
from sdcp.services.router import RouterNode

__all__ = ["cluster"]  # the fixture, from the gateway tests' harness

pytestmark = pytest.mark.timeout(120)

MAX_TOKENS = 24


def stats_of(cluster: Cluster, sessions: str) -> list[SessionStats]:
    """The verifier's figures for the sessions of an answer's X-SDCP-Sessions header."""
    return [cluster.verifier.engine.sessions[bytes.fromhex(s)].machine.stats for s in sessions.split(",")]


def reported(stats: list[SessionStats]) -> dict[str, Any]:
    rounds = sum(s.rounds for s in stats)
    accepted = sum(s.accepted for s in stats)
    return {
        "rounds": rounds,
        "drafted_tokens": sum(s.proposed for s in stats),
        "accepted_tokens": accepted,
        "mean_accepted_length": round(accepted / rounds, 3) if rounds else 0.0,
        "self_decoded_tokens": sum(s.self_decoded for s in stats),
    }


async def completion(gateway: GatewayNode, **body: Any) -> tuple[dict[str, Any], str]:
    client = client_of(gateway)
    raw = await client.completions.with_raw_response.create(
        model="tiny", prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0, extra_body=body
    )
    answer = json.loads(raw.text)
    return answer, raw.headers["x-sdcp-sessions"]


async def test_max_tokens_and_drafters_bound_the_proposals_and_the_usage_reports_them(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    drafter = next(node for node in cluster.nodes if isinstance(node, DrafterNode))
    digest = drafter.engine.drafter.weights_digest
    answer, sessions = await completion(
        gateway, speculative={"max_tokens": 2, "drafters": [digest.hex()], "report": True}
    )
    (session,) = (bytes.fromhex(s) for s in sessions.split(","))
    machine = cluster.verifier.engine.sessions[session].machine
    assert machine.contract.m_max == 2 and machine.contract.drafters == (digest,)
    (stats,) = stats_of(cluster, sessions)
    # The drafter proposed (an unmeasured drafter is explored), never more than 2 tokens a round.
    assert stats.rounds > 0 and len(stats.proposed_by_position) <= 2
    usage = answer["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["speculative"] == reported([stats])
    # Each committed token was an accepted draft token, a round's additional token or self-decoded.
    assert stats.accepted + stats.rounds + stats.self_decoded >= MAX_TOKENS


async def test_speculation_off_has_the_verifier_decode_alone(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    plain, _ = await completion(gateway)
    answer, sessions = await completion(gateway, speculative={"enabled": False, "report": True})
    (session,) = (bytes.fromhex(s) for s in sessions.split(","))
    (stats,) = stats_of(cluster, sessions)
    # No drafter proposed: every token was self-decoded, and the router says so.
    assert stats.rounds == 0 and stats.proposed == 0 and stats.self_decoded == MAX_TOKENS
    assert answer["usage"]["speculative"] == reported([stats]) | {"self_decoded_tokens": MAX_TOKENS}
    router = next(node for node in cluster.nodes if isinstance(node, RouterNode))
    tracked = router.sessions[session]
    await eventually(lambda: tracked.ended)
    assert set(tracked.served) == {"self-decoding"}
    # Greedy decoding is the same text whoever decodes (SDCP 6.4 rule 1).
    assert answer["choices"][0]["text"] == plain["choices"][0]["text"]
    # Without report the usage is OpenAI's alone.
    assert "speculative" not in plain["usage"]


async def test_a_stream_reports_the_acceptance_of_every_choice_in_its_usage_chunk(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "speculative": {"report": True},
    }
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(f"{base(gateway)}/v1/completions", json=body)
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 2 * MAX_TOKENS
    assert usage["speculative"] == reported(stats_of(cluster, answer.headers["x-sdcp-sessions"]))


async def test_a_request_with_stop_strings_takes_its_tokens_as_they_come(cluster: Cluster) -> None:
    """The gateway matches every stop string in the text, one of one token inside a longer token
    too: a request's sessions are opened with self_decode_group_ms 0 (the verifier's shortest
    groups), so that its stop is seen a group of 16 tokens after it at most; a request without stop
    strings leaves the verifier's grouping as it is."""
    gateway = await cluster.gateway()
    asked = []
    for stop in (["\n"], [" zzz qqq xxx"], None):
        body: dict[str, Any] = {"stop": stop} if stop is not None else {}
        _, sessions = await completion(gateway, **body)
        (session,) = (bytes.fromhex(s) for s in sessions.split(","))
        asked.append(cluster.verifier.engine.sessions[session].self_decode_group_ms)
    assert asked == [0, 0, None]


async def test_each_api_user_is_its_sessions_tenant(cluster: Cluster) -> None:
    """Issue #36: the gateway names the request's API user (its credential and OpenAI's ``user``,
    as a digest) as the session's tenant, which scopes the history its drafts come from."""
    gateway = await cluster.gateway()
    tenants = {}
    for user in ("alice", "bob", None):
        body: dict[str, Any] = {"user": user} if user is not None else {}
        _, sessions = await completion(gateway, **body)
        (session,) = (bytes.fromhex(s) for s in sessions.split(","))
        tenants[user] = cluster.verifier.engine.sessions[session].tenant
    # The openai client sends its (unused) key as a bearer credential.
    assert tenants == {user: api_tenant("Bearer unused", user) for user in ("alice", "bob", None)}
    assert len(set(tenants.values())) == 3 and all(t is not None and len(t) == 32 for t in tenants.values())
    assert api_tenant(None, None) is None and api_tenant("Bearer k", None) != api_tenant("Bearer k2", None)
