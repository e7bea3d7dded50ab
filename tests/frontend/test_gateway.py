"""The gateway between its HTTP routes and a scripted cluster (no sockets, no models): which target
its contracts name as verifiers come and go, and the text of a choice as its tokens come in chunks.
tests/e2e/test_openai_api.py runs it on a real cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.frontend.scripted_cluster import MODEL_A, MODEL_B, MODEL_C, ROUTER, ScriptedCluster, chunked, streamed

from sdcp.config import GatewayConfig, InstanceConfig, ServiceConfig
from sdcp.frontend.gateway import GatewayNode

OTHER_TOKENIZER = b"\x01" * 32
TEXT = "Tea for two: ☕☕, crème brûlée, 日本語 and 🎉👩‍👩‍👧. STOP here, then more."


@pytest.fixture
def credentials(tmp_path: Path) -> dict[str, Path]:
    # The client is replaced before any use: the files only need to exist.
    files = {name: tmp_path / f"gateway.{name}" for name in ("cert", "key", "ca")}
    for path in files.values():
        path.touch()
    return files


@pytest.fixture
async def gateway(credentials: dict[str, Path]) -> AsyncIterator[tuple[GatewayNode, ScriptedCluster]]:
    instance = InstanceConfig(uri="https://127.0.0.1:9300", router=ROUTER, **credentials)  # type: ignore[arg-type]
    node = GatewayNode(ServiceConfig(instance=instance, gateway=GatewayConfig(model="smollm2")))
    cluster = ScriptedCluster(chunked(node.codec.encode(TEXT, add_special_tokens=False), [3]))
    node.client = cluster  # type: ignore[assignment]
    yield node, cluster
    await node.stop()


async def complete(node: GatewayNode, **body: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=node.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        payload = {"prompt": "Hi", "max_tokens": 100, "temperature": 0, **body}
        return await client.post("/v1/completions", json=payload)


# -- targets ---------------------------------------------------------------------------------------------


async def test_contracts_name_the_first_target_until_it_goes_away(gateway: tuple[GatewayNode, ScriptedCluster]) -> None:
    node, cluster = gateway
    own = node.codec.tokenizer_digest
    cluster.register(("https://v1", MODEL_A, own), ("https://v2", MODEL_B, own))
    assert (await complete(node)).status_code == 200
    assert (await complete(node)).status_code == 200
    assert [c.target for c in cluster.contracts] == [MODEL_A, MODEL_A]
    assert {c.tokenizer for c in cluster.contracts} == {own}
    assert cluster.target_reads == 1
    # The first verifier leaves: the router refuses its target, the gateway reads the list again.
    cluster.register(("https://v2", MODEL_B, own))
    assert (await complete(node)).status_code == 200
    assert [c.target for c in cluster.contracts[2:]] == [MODEL_A, MODEL_B]
    assert (await complete(node)).status_code == 200
    assert cluster.contracts[-1].target == MODEL_B and cluster.target_reads == 2
    # None is left: 503, until one is back.
    cluster.register()
    refused = await complete(node)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "server_error" and "no other target" in error["message"]
    cluster.register(("https://v1", MODEL_A, own))
    assert (await complete(node)).status_code == 200
    assert cluster.contracts[-1].target == MODEL_A


async def test_a_target_whose_verifiers_do_not_answer_is_left_for_another(
    gateway: tuple[GatewayNode, ScriptedCluster],
) -> None:
    node, cluster = gateway
    own = node.codec.tokenizer_digest
    # Still listed (its registration has not expired yet) but gone: the router answers 503.
    cluster.register(("https://v1", MODEL_A, own), ("https://v2", MODEL_B, own))
    cluster.silent.add("https://v1")
    assert (await complete(node)).status_code == 200
    assert [c.target for c in cluster.contracts] == [MODEL_A, MODEL_B]
    # With no other target, the router's answer reaches the client.
    cluster.silent.add("https://v2")
    refused = await complete(node)
    assert refused.status_code == 503 and "no verifier for this target answered" in refused.json()["error"]["message"]


async def test_a_choice_that_fails_to_open_is_retried_with_every_other_choice(
    gateway: tuple[GatewayNode, ScriptedCluster],
) -> None:
    node, cluster = gateway
    own = node.codec.tokenizer_digest
    cluster.register(("https://v1", MODEL_A, own))
    assert (await complete(node)).status_code == 200
    cluster.register(("https://v2", MODEL_B, own))
    answer = await complete(node, n=3)
    assert answer.status_code == 200 and [c["index"] for c in answer.json()["choices"]] == [0, 1, 2]
    assert [c.target for c in cluster.contracts[1:]] == [MODEL_A] * 3 + [MODEL_B] * 3


async def test_only_verifiers_of_the_gateways_tokenizer_are_targets(
    gateway: tuple[GatewayNode, ScriptedCluster],
) -> None:
    node, cluster = gateway
    own = node.codec.tokenizer_digest
    cluster.register(("https://v0", MODEL_C, OTHER_TOKENIZER))
    refused = await complete(node)
    assert refused.status_code == 503 and "smollm2's tokenizer" in refused.json()["error"]["message"]
    assert cluster.contracts == []
    readiness = await node.readiness()
    assert not readiness.ready and "smollm2's tokenizer" in readiness.reason
    # One that reports no tokenizer digest checks the contract's at session-open: it may serve.
    cluster.register(
        ("https://v0", MODEL_C, OTHER_TOKENIZER), ("https://v1", MODEL_A, None), ("https://v2", MODEL_B, own)
    )
    assert (await complete(node)).status_code == 200
    assert cluster.contracts[-1].target == MODEL_A
    assert (await node.readiness()).ready


# -- text ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1], [3], [2, 5, 1], [64]])
async def test_a_choices_text_is_the_decode_of_all_its_tokens(
    gateway: tuple[GatewayNode, ScriptedCluster], sizes: list[int]
) -> None:
    node, cluster = gateway
    cluster.register(("https://v1", MODEL_A, node.codec.tokenizer_digest))
    tokens = node.codec.encode(TEXT, add_special_tokens=False)
    cluster.chunks = chunked(tokens, sizes)
    whole = (await complete(node)).json()
    assert whole["choices"][0]["text"] == TEXT and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": 1 + len(tokens)}
    events = streamed(await complete(node, stream=True))
    assert "".join(event["choices"][0]["text"] for event in events) == TEXT
    assert all("\ufffd" not in event["choices"][0]["text"] for event in events)
    assert [event["choices"][0]["finish_reason"] for event in events][-1] == "length"


async def test_a_stop_string_across_chunks_ends_the_choice_and_its_session(
    gateway: tuple[GatewayNode, ScriptedCluster],
) -> None:
    node, cluster = gateway
    cluster.register(("https://v1", MODEL_A, node.codec.tokenizer_digest))
    tokens = node.codec.encode(TEXT, add_special_tokens=False)
    cluster.chunks = chunked(tokens, [1])
    for stream in (False, True):
        answer = await complete(node, stop=[" STOP"], stream=stream, logprobs=0)
        if stream:
            events = streamed(answer)
            choices = [event["choices"][0] for event in events]
            text = "".join(choice["text"] for choice in choices)
            logprobs = [t for choice in choices for t in choice["logprobs"]["tokens"]]
            finish, reason = choices[-1]["finish_reason"], choices[-1]["stop_reason"]
            assert all(choice["stop_reason"] is None for choice in choices[:-1])
        else:
            (choice,) = answer.json()["choices"]
            text, logprobs, finish = choice["text"], choice["logprobs"]["tokens"], choice["finish_reason"]
            reason = choice["stop_reason"]
        # vLLM's stop_reason: the stop string that ended the choice.
        assert text == TEXT[: TEXT.index(" STOP")] and (finish, reason) == ("stop", " STOP")
        # Every token up to the stop string's last has its entry; the session is cancelled.
        assert len(logprobs) == len(node.codec.encode(TEXT[: TEXT.index(" STOP") + 5], add_special_tokens=False))
    await node.stop()
    assert cluster.cancelled == [(1).to_bytes(16, "big"), (2).to_bytes(16, "big")]


async def test_the_last_token_says_whether_a_stop_token_ended_the_choice(
    gateway: tuple[GatewayNode, ScriptedCluster],
) -> None:
    node, cluster = gateway
    cluster.register(("https://v1", MODEL_A, node.codec.tokenizer_digest))
    end = node.codec.end_of_text_tokens()[0]
    # The final chunk commits no token: the one before it is the last.
    cluster.chunks = [node.codec.encode("Done.", add_special_tokens=False), [end], []]
    (choice,) = (await complete(node)).json()["choices"]
    # An end-of-text token has no stop_reason (vLLM's None).
    assert choice == {"index": 0, "finish_reason": "stop", "stop_reason": None, "logprobs": None, "text": "Done."}
    (period,) = node.codec.encode(".", add_special_tokens=False)
    cluster.chunks = [node.codec.encode("Done.", add_special_tokens=False)]
    for stop, reason in (({"stop_token_ids": [period]}), period), (({"stop": ["."]}), "."):
        (choice,) = (await complete(node, **stop)).json()["choices"]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", reason)
    echoed = (await complete(node, echo=True)).json()["choices"][0]
    assert echoed["text"] == "HiDone."
