"""The router resumes a failed-over session from the target KV its verifier published (SDCP 6.9),
over real HTTP/2 + mTLS, and the published objects go when nobody needs them."""

from __future__ import annotations

import pytest
from tests.services import router_harness
from tests.services.outputs import read_output
from tests.services.router_harness import (
    Deployment,
    greedy_reference,
    open_session,
    start_drafter,
    tiny_contract,
)
from tests.waiting import eventually, eventually_async

from sdcp.cache import MLC, build_uri, target_kv_uri
from sdcp.cache.uri import LOG_KIND
from sdcp.config import VerifierConfig
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol.messages import Action, session_path_id
from sdcp.services.verifier import VerifierNode

pytestmark = pytest.mark.timeout(120)

# The router's test deployment and the tiny target, as the router's tests have them.
deployment = router_harness.deployment
target = router_harness.target


async def _start_verifier(env: Deployment, name: str) -> VerifierNode:
    # The tiny prompt is long enough: the KV is published at the first commit, and never again.
    settings = VerifierConfig(model="tiny", output_wait_s=0.5, kv_publish_min_tokens=1, kv_publish_every=0)
    node = VerifierNode(env.config(name, verifier=settings), target=TargetModel(tiny_model(), tiny_tokenizer()))
    await env.start(node)
    router = env.router
    assert router is not None
    await eventually(lambda: router.registry.is_live(node.uri, router.clock()))
    return node


async def test_a_failover_resumes_from_the_published_kv_and_the_objects_are_deleted(
    deployment: Deployment, target: TargetModel
) -> None:
    first = await _start_verifier(deployment, "verifier1")
    await start_drafter(deployment, "drafter1")
    max_new = 150
    opened = await open_session(deployment, tiny_contract(target, max_new=max_new))
    session = opened["session"]
    assert isinstance(session, bytes) and opened["verifier"] == first.uri
    second = await _start_verifier(deployment, "verifier2")
    commit_log = build_uri("local", None, LOG_KIND, session.hex())
    published, republished = (target_kv_uri(commit_log, session, epoch) for epoch in (1, 2))
    assert published is not None and republished is not None

    before = await read_output(deployment.client("frontend", peer="verifier1"), session, until=8)
    assert not before[-1].final, "the session finished before the verifier could be stopped"
    async with MLC.from_config(disk_dir=deployment.tmp / "mlc") as mlc:

        async def exists(uri: str) -> bool:
            return await mlc.exists(uri)

        await eventually_async(lambda: exists(published))
        await deployment.stop(first)

        frontend = deployment.client("frontend")

        async def moved() -> bool:
            _, described = await frontend.get_cbor(f"sessions/{session_path_id(session)}")
            return isinstance(described, dict) and described["verifier"] == second.uri

        await eventually_async(moved)
        resumed = second.engine.sessions[session]
        assert resumed.kv_imported > 0  # the open imported the blob: no full prefill
        after = await read_output(deployment.client("frontend", peer="verifier2"), session)
        assert [t for output in after for t in output.tokens] == greedy_reference(target, max_new)
        assert after[-1].finish == Action.FINISH and {output.epoch for output in after} == {2}

        # The router deleted the failed epoch's blob; the new verifier its own at the session's end.
        async def deleted() -> bool:
            return not await exists(published) and not await exists(republished)

        await eventually_async(deleted)
        assert resumed.kv_published > 0
