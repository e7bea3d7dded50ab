"""The gateway on a real cluster on 127.0.0.1 (router, a verifier of the tiny target, an n-gram
drafter), as an OpenAI or vLLM client meets it: unknown members, the completions default, the
bounds that hold under load (prompt size, body size, requests in flight), text that is no Unicode,
a client that goes away, and one access-log line per request (#30 items 3 and 5)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import openai
import pytest
from prometheus_client import REGISTRY
from tests.frontend.gateway_harness import Cluster, base, client_of, cluster
from tests.waiting import eventually

from sdcp.frontend.gateway import GatewayNode
from sdcp.services.router import RouterNode

__all__ = ["cluster"]  # the fixture, from the gateway tests' harness

pytestmark = pytest.mark.timeout(120)

# The tiny target's context and its longest token (<|endoftext|>, 13 bytes; the others are bytes).
CONTEXT, LONGEST_TOKEN = 4096, 13
ACCESS_LINE = re.compile(r"^\S+ (GET|POST) (\S+) (\d{3}) (answered|aborted|failed) request (\S+) ")


def access_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[re.Match[str]]:
    """The gateway's access-log lines for one request."""
    lines = [ACCESS_LINE.match(r.getMessage()) for r in caplog.records if r.name == "sdcp.gateway"]
    return [line for line in lines if line is not None and line.group(5) == request_id]


def sample(name: str, instance: str) -> float:
    value = REGISTRY.get_sample_value(name, {"instance": instance})
    assert value is not None, name
    return value


# -- vLLM's request handling ---------------------------------------------------------------------------------


async def test_unknown_members_are_ignored_and_named_unless_strict(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sdcp.gateway")
    gateway = await cluster.gateway()
    extra = {"no_such_parameter": 1, "vllm_only_knob": {"x": [1]}}
    raw = await client_of(gateway).completions.with_raw_response.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, extra_body=extra
    )
    assert raw.headers["x-sdcp-ignored-members"] == "no_such_parameter,vllm_only_knob"
    assert raw.parse().usage.completion_tokens == 4  # type: ignore[union-attr]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "sdcp.gateway"]
    assert any("no_such_parameter, vllm_only_knob" in line for line in warnings), warnings
    # A request with nothing to ignore has no such header.
    plain = await client_of(gateway).completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=2)
    assert "x-sdcp-ignored-members" not in plain.headers

    strict = await cluster.gateway(strict=True)
    with pytest.raises(openai.BadRequestError) as refused:
        await client_of(strict).completions.create(model="tiny", prompt="Hello", max_tokens=4, extra_body=extra)
    assert refused.value.body == {
        "message": "Unrecognized request argument supplied: no_such_parameter",
        "type": "invalid_request_error",
        "param": "no_such_parameter",
        "code": None,
    }


async def test_a_model_is_retrieved_by_its_id_and_another_is_a_404(cluster: Cluster) -> None:
    client = client_of(await cluster.gateway())
    model = await client.models.retrieve("tiny")
    assert (model.id, model.object) == ("tiny", "model")
    assert [listed.id async for listed in client.models.list()] == ["tiny"]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("org/other-model")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_a_completion_without_max_tokens_is_16_tokens(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    # ignore_eos: the tiny random model may emit its end-of-text token early.
    reply = await client_of(gateway).completions.create(
        model="tiny", prompt="Hello", temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


async def test_a_lone_surrogate_is_a_400_in_openais_shape(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        for path, body in [
            ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}'),
            ("/v1/completions", b'{"prompt": "Hi", "stop": ["\\udc00x"]}'),
            ("/tokenize", b'{"prompt": "\\udbff"}'),
        ]:
            answer = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 400, (path, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "invalid_request_error" and "surrogate" in error["message"]
        # A pair of escapes is one character, and text.
        pair = await http.post("/v1/completions", content=b'{"prompt": "\\ud83c\\udf89", "max_tokens": 2}')
        assert pair.status_code == 200, pair.text


# -- bounds under load -----------------------------------------------------------------------------------------------


async def connected_ahead(cluster: Cluster, gateway: GatewayNode) -> None:
    """Wait for the connections the gateway makes at start: their TLS handshakes allocate in this
    process, and a test that traces the allocations of one request must not count them."""
    peers = gateway.client.peers
    await eventually(lambda: peers.holds(cluster.verifier.uri) and peers.get(cluster.verifier.uri).connected)


async def test_a_prompt_too_large_for_the_context_is_refused_before_it_is_tokenized(cluster: Cluster) -> None:
    gateway = await cluster.gateway()
    await connected_ahead(cluster, gateway)
    # A legal body (under the 4 MiB limit) whose prompt is far more than 4096 tokens of the tiny
    # model can stand for: refused by its size. Tokenized, its ids alone would take 8 bytes each
    # (a list of 3.7 million), which tracemalloc would see; held, its body is about 3.7 MB twice.
    prompt = "x" * 3_700_000
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        tracemalloc.start()
        try:
            answer = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert f"at least {len(prompt) // LONGEST_TOKEN + 1} tokens" in error["message"]
    assert peak < 4 * len(body), f"{peak} bytes allocated at the peak for a body of {len(body)}"


async def test_a_body_over_the_limit_is_refused_while_it_is_read(cluster: Cluster) -> None:
    gateway = await cluster.gateway(max_body_bytes=64 * 1024)
    await connected_ahead(cluster, gateway)
    sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        # Without a length: the gateway learns the size only as the bytes come.
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(128):
            sent += 16 * 1024
            yield b"y" * (16 * 1024)
        yield b'"}'

    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        tracemalloc.start()
        try:
            answer = await http.post("/v1/completions", content=chunks())
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert answer.status_code == 413 and "exceeds 65536 bytes" in answer.json()["error"]["message"]
    # The rest of the 2 MiB was read and dropped, never held.
    assert sent == 128 * 16 * 1024 and peak < 1024 * 1024, peak


async def test_requests_past_the_cap_in_flight_are_429_with_retry_after(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sdcp.gateway")
    gateway = await cluster.gateway(max_requests_in_flight=1)
    refused_before = sample("sdcp_gateway_requests_refused_total", gateway.uri)
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:
        long_stream = {"prompt": "Hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=long_stream) as streaming:
            assert streaming.status_code == 200
            # The first event: the stream holds the one place until it ends. (The iterator is
            # kept: one dropped unfinished closes the stream.)
            lines = streaming.aiter_lines()
            await anext(lines)
            assert sample("sdcp_gateway_requests_in_flight", gateway.uri) == 1
            busy = await http.post(
                "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"x-request-id": "busy-1"}
            )
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_error"
            tokenize = await http.post("/tokenize", json={"prompt": "Hi"})
            assert tokenize.status_code == 429
            # What does not read a body is not capped.
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 200
        # The client left the stream: its place is free again.
        await eventually(lambda: sample("sdcp_gateway_requests_in_flight", gateway.uri) == 0)
        after = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert after.status_code == 200, after.text
    assert sample("sdcp_gateway_requests_refused_total", gateway.uri) == refused_before + 2
    (line,) = access_lines(caplog, "busy-1")
    assert line.group(3) == "429"


# -- a client that goes away; the access log ---------------------------------------------------------------


async def post_and_leave(
    gateway: GatewayNode, body: dict[str, object], request_id: str, left: Callable[[], Awaitable[None]]
) -> None:
    """POST ``body`` over a socket of our own and close it, without reading the answer, once
    ``left()`` has returned."""
    content = json.dumps(body).encode()
    host, port = base(gateway).removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(content)}\r\nx-request-id: {request_id}\r\n\r\n"
    )
    writer.write(head.encode() + content)
    await writer.drain()
    try:
        await left()
    finally:
        writer.close()
        await writer.wait_closed()
    del reader


async def test_a_non_streaming_client_that_goes_away_has_its_session_cancelled(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sdcp.gateway")
    gateway = await cluster.gateway()
    engine = cluster.verifier.engine
    max_tokens = 4000

    async def decoding() -> None:
        # The verifier has the session and commits its tokens: the client leaves then.
        await eventually(lambda: any(live.machine.state().committed > 0 for live in engine.sessions.values()))

    body = {"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    await post_and_leave(gateway, body, "leaves-1", decoding)
    (live,) = engine.sessions.values()
    # The gateway cancels the session: the verifier ends it at a round boundary, far before
    # max_tokens, and its committed count grows no more.
    await eventually(lambda: live.machine.ended)
    assert live.cancelling
    committed = live.machine.state().committed
    assert 0 < committed < max_tokens
    await eventually(lambda: len(access_lines(caplog, "leaves-1")) == 1)
    (line,) = access_lines(caplog, "leaves-1")
    assert line.group(3) == "499" and line.group(4) == "aborted"
    assert "cancelled" in line.string
    # A round in flight when the cancel came may still have been decided; none after that one.
    router = next(node for node in cluster.nodes if isinstance(node, RouterNode))
    await eventually(lambda: all(session.ended for session in router.sessions.values()))
    assert live.machine.state().committed == committed


async def test_every_request_gets_one_access_line_aborted_ones_included(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sdcp.gateway")
    gateway = await cluster.gateway()
    engine = cluster.verifier.engine
    async with httpx.AsyncClient(base_url=base(gateway), timeout=60) as http:

        async def post(request_id: str, path: str = "/v1/completions", **body: object) -> httpx.Response:
            return await http.post(path, json=body, headers={"x-request-id": request_id})

        assert (await post("ok-plain", prompt="Hi", max_tokens=2)).status_code == 200
        assert (await post("ok-stream", prompt="Hi", max_tokens=2, stream=True)).status_code == 200
        assert (await post("bad", prompt=5)).status_code == 400
        assert (await post("wrong-model", prompt="Hi", model="gpt-4")).status_code == 404
        assert (await post("tokens", "/tokenize", prompt="Hi")).status_code == 200
        assert (await http.get("/v1/models", headers={"x-request-id": "models"})).status_code == 200
        # A stream whose client leaves after its first event.
        long_stream = {"prompt": "Hi", "max_tokens": 3000, "stream": True, "ignore_eos": True}
        async with http.stream(
            "POST", "/v1/completions", json=long_stream, headers={"x-request-id": "left-stream"}
        ) as s:
            await anext(s.aiter_lines())

    async def committing() -> None:
        await eventually(
            lambda: any(not live.machine.ended and live.machine.state().committed for live in engine.sessions.values())
        )

    await post_and_leave(gateway, {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True}, "left-plain", committing)
    expected = {
        "ok-plain": ("200", "answered"),
        "ok-stream": ("200", "answered"),
        "bad": ("400", "answered"),
        "wrong-model": ("404", "answered"),
        "tokens": ("200", "answered"),
        "models": ("200", "answered"),
        "left-stream": ("200", "aborted"),
        "left-plain": ("499", "aborted"),
    }
    await eventually(lambda: all(access_lines(caplog, request_id) for request_id in expected))
    for request_id, (status, outcome) in expected.items():
        lines = access_lines(caplog, request_id)
        assert len(lines) == 1, (request_id, [line.string for line in lines])
        assert (lines[0].group(3), lines[0].group(4)) == (status, outcome), lines[0].string


async def test_a_gateway_connects_to_the_router_and_its_verifiers_before_its_first_request(cluster: Cluster) -> None:
    """At start the gateway warms what its first request would pay for: its codec, and connections
    to the router and the verifiers the router lists (each TLS handshake out of a first token's time)."""
    gateway = await cluster.gateway()
    peers = gateway.client.peers
    await eventually(lambda: peers.holds(cluster.verifier.uri) and peers.get(cluster.verifier.uri).connected)
    assert peers.get(cluster.uris["router"]).connected
    assert "tokenizer_digest" in gateway.codec.__dict__
