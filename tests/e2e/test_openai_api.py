"""The OpenAI-compatible gateway as the `openai` package meets it, on a local SmolLM2 cluster:
each parameter vLLM accepts is implemented or refused with a 400 naming it (#19)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import ssl
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from tests.e2e.support import (
    MAX_NEW,
    PROMPTS,
    backend_digests,
    cluster_backend,
    reference_log_probs,
    stats_when_ended,
)
from tests.waiting import wait_until

import sdcp
from sdcp.cluster import LocalCluster
from sdcp.frontend.text import load_text_codec
from sdcp.localhost import accepts, free_port
from sdcp.protocol.messages import Action

pytestmark = pytest.mark.timeout(600)

CHAT = [{"role": "user", "content": "Say hi."}]


def client_of(home: Path) -> openai.OpenAI:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    return openai.OpenAI(base_url=gateway, api_key="unused", timeout=120, max_retries=0)


def post(home: Path, path: str, content: bytes, *, root: bool = False) -> httpx.Response:
    """POST to the gateway's /v1/``path``, or its /``path`` with ``root``."""
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    base = gateway.removesuffix("/v1") if root else gateway
    headers = {"content-type": "application/json"}
    return httpx.post(f"{base}/{path}", content=content, headers=headers, timeout=120)


def test_n_choices_are_sessions_of_their_own(home: Path, reference: dict[str, list[int]]) -> None:
    prompt = PROMPTS[0]
    codec = load_text_codec("smollm2")
    reply = client_of(home).completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0, n=3)
    expected = codec.decode(reference[prompt])
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.text for c in reply.choices] == [expected] * 3
    assert reply.usage is not None and reply.usage.prompt_tokens == len(codec.encode(prompt))
    assert reply.usage.completion_tokens == 3 * MAX_NEW


def test_a_list_of_prompts_gives_n_choices_each(home: Path, reference: dict[str, list[int]]) -> None:
    codec = load_text_codec("smollm2")
    reply = client_of(home).completions.create(model="smollm2", prompt=PROMPTS, max_tokens=8, temperature=0, n=2)
    texts = {c.index: c.text for c in reply.choices}
    assert texts == {i * 2 + j: codec.decode(reference[p][:8]) for i, p in enumerate(PROMPTS) for j in range(2)}
    # Usage counts each prompt of the list once, however many choices continue it; a repeated one twice.
    twice = client_of(home).completions.create(model="smollm2", prompt=[PROMPTS[0]] * 2, max_tokens=1, n=2)
    assert twice.usage is not None and twice.usage.prompt_tokens == 2 * len(codec.encode(PROMPTS[0]))


def test_logprobs_are_the_targets(home: Path, reference: dict[str, list[int]]) -> None:
    prompt = PROMPTS[0]
    reply = client_of(home).completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    # The log-softmax of the target's logits at each position of the greedy continuation.
    expected = reference_log_probs(prompt, reference[prompt])
    chosen = [expected[i][t] for i, t in enumerate(reference[prompt])]
    assert logprobs.token_logprobs == pytest.approx(chosen, abs=2e-3)
    codec = load_text_codec("smollm2")
    assert logprobs.tokens == [codec.token_text(t) for t in reference[prompt]]
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    for position, alternatives in enumerate(logprobs.top_logprobs):
        assert len(alternatives) == 3
        # Greedy decoding: the chosen token is the most probable one.
        best = max(alternatives, key=alternatives.__getitem__)
        assert best == logprobs.tokens[position] and alternatives[best] == pytest.approx(chosen[position], abs=2e-3)


def test_chat_logprobs_streamed_with_usage(home: Path) -> None:
    client = client_of(home)
    whole = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model="smollm2",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *pieces, last = chunks
    assert last.choices == [] and last.usage is not None
    assert whole.usage is not None and last.usage.completion_tokens == whole.usage.completion_tokens
    assert all(chunk.usage is None for chunk in pieces)
    assert pieces[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in pieces)
    assert text == whole.choices[0].message.content
    entries = [e for c in pieces if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert len(entries) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_default_max_tokens_fills_the_context(home: Path) -> None:
    reply = client_of(home).chat.completions.create(model="smollm2", messages=CHAT, temperature=0)
    # The model ends its answer itself, well after OpenAI's old default of 16 tokens.
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens > 16


def test_the_context_is_what_the_verifier_holds(home: Path) -> None:
    # A llama.cpp verifier holds kv_capacity positions per session (4096 by default), fewer than
    # the model's 8192: the gateway advertises, fills and enforces that.
    held = 4096 if cluster_backend() == "llamacpp" else 8192
    gateway = LocalCluster(home).gateway
    listed = httpx.get(f"{gateway}/models", timeout=10).json()["data"][0]
    assert listed["max_model_len"] == held
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {held} tokens"):
        client_of(home).completions.create(model="smollm2", prompt="hi", max_tokens=held)


def test_min_tokens_and_ignore_eos_keep_the_session_going(home: Path) -> None:
    client = client_of(home)
    natural = client.chat.completions.create(model="smollm2", messages=CHAT, temperature=0, max_tokens=200)
    assert natural.choices[0].finish_reason == "stop" and natural.usage is not None
    ended_at = natural.usage.completion_tokens
    longer = client.chat.completions.create(
        model="smollm2", messages=CHAT, temperature=0, max_tokens=200, extra_body={"min_tokens": ended_at + 10}
    )
    assert longer.usage is not None and longer.usage.completion_tokens >= ended_at + 10
    ignoring = client.chat.completions.create(
        model="smollm2", messages=CHAT, temperature=0, max_tokens=ended_at + 10, extra_body={"ignore_eos": True}
    )
    assert ignoring.choices[0].finish_reason == "length"
    assert ignoring.usage is not None and ignoring.usage.completion_tokens == ended_at + 10


def test_top_k_one_samples_the_greedy_continuation(home: Path, reference: dict[str, list[int]]) -> None:
    prompt = PROMPTS[1]
    reply = client_of(home).completions.create(
        model="smollm2", prompt=prompt, max_tokens=MAX_NEW, temperature=1.0, extra_body={"top_k": 1}
    )
    assert reply.choices[0].text == load_text_codec("smollm2").decode(reference[prompt])


def test_echo_returns_the_prompt_first(home: Path) -> None:
    reply = client_of(home).completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True
    )
    assert reply.choices[0].text.startswith(PROMPTS[0]) and len(reply.choices[0].text) > len(PROMPTS[0])


def test_an_unknown_model_is_a_404(home: Path) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client_of(home).completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert refused.value.body["code"] == "model_not_found"  # type: ignore[index]


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
        # Tools are served (tests/e2e/test_structured_output.py); a tool of another type is not.
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"n": 2, "extra_body": {"best_of": 3}}, "best_of"),
        ({"max_tokens": 300_000_000}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_it(home: Path, params: dict[str, object], named: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(home).chat.completions.create(model="smollm2", messages=CHAT, **params)  # type: ignore[call-overload]
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == named and error["type"] == "invalid_request_error"
    assert named in error["message"] or "context length" in error["message"]


def test_unknown_members_are_ignored_as_vllm_ignores_them(home: Path) -> None:
    raw = client_of(home).completions.with_raw_response.create(
        model="smollm2", prompt="Hi", max_tokens=2, temperature=0, extra_body={"no_such_parameter": 1}
    )
    assert raw.headers["x-sdcp-ignored-members"] == "no_such_parameter"
    assert raw.parse().usage.completion_tokens == 2  # type: ignore[union-attr]


def test_a_completion_without_max_tokens_is_16_tokens(home: Path) -> None:
    reply = client_of(home).completions.create(
        model="smollm2", prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 16
    assert reply.choices[0].finish_reason == "length"


def test_a_non_streaming_client_that_goes_away_cancels_its_session(home: Path) -> None:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    host, port = gateway.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    request_id = f"leaves-{uuid.uuid4().hex}"
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}).encode()
    log = home / "cluster" / "logs" / "gateway.log"

    def opened() -> str | None:
        line = next((x for x in log.read_text().splitlines() if f"request {request_id} " in x and "opened" in x), None)
        return None if line is None else line.rsplit(" ", 1)[-1]

    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {request_id}\r\n\r\n".encode()
            + body
        )
        # The session is open: the client leaves without its answer.
        wait_until(lambda: opened() is not None, what="the session opened")
    session = opened()
    assert session is not None
    # The verifier ends the session at a round boundary (a cancel ends it as fail), long before
    # max_tokens; its committed count grows no more.
    stats = asyncio.run(stats_when_ended(home, bytes.fromhex(session)))
    assert stats["state"] == Action.FAIL and int(stats["committed"]) < 3000  # type: ignore[call-overload]
    wait_until(
        lambda: any(f"request {request_id} " in x and " 499 aborted " in x for x in log.read_text().splitlines())
    )


def test_a_prompt_longer_than_the_context_is_a_400(home: Path) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(home).completions.create(model="smollm2", prompt="word " * 9000, max_tokens=4)
    assert "maximum context length" in str(refused.value)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[1, 2]",
        b"\xff\xfe",
        b'{"prompt": 5}',
        b'{"prompt": [[]]}',
        b'{"prompt": [1e400]}',
        b'{"prompt": "hi", "max_tokens": "ten"}',
        b'{"prompt": "hi", "stream_options": {"include_usage": true}}',
        b'{"prompt": "hi", "n": 100}',
        b'{"prompt": [99999999]}',
        b"[" * 100_000 + b"]" * 100_000,
        # A lone surrogate escape: a string that is no Unicode text (once a plain-text 500).
        b'{"prompt": "\\ud800", "max_tokens": 1}',
    ],
)
def test_malformed_completions_are_4xx_and_the_gateway_serves_on(home: Path, body: bytes) -> None:
    answer = post(home, "completions", body)
    assert 400 <= answer.status_code < 500 and "error" in answer.json()
    ok = client_of(home).completions.create(model="smollm2", prompt="hi", max_tokens=1, temperature=0)
    assert len(ok.choices) == 1


@pytest.mark.parametrize(
    "messages",
    [[], [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]],
)
def test_malformed_messages_are_a_400(home: Path, messages: list[object]) -> None:
    answer = post(home, "chat/completions", json.dumps({"messages": messages}).encode())
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"


def test_a_body_over_the_limit_is_refused_while_read(home: Path) -> None:
    body = json.dumps({"prompt": "x" * (5 * 1024 * 1024), "max_tokens": 1}).encode()
    answer = post(home, "completions", body)
    assert answer.status_code == 413 and "exceeds" in answer.json()["error"]["message"]


# -- operating the gateway (#19 item 4) -----------------------------------------------------------------


def _ready_answer(url: str) -> httpx.Response:
    """The first 200 of a /ready endpoint."""
    answers: list[httpx.Response] = []
    wait_until(lambda: answers.append(httpx.get(url, timeout=10)) or answers[-1].status_code == 200, what=url)
    return answers[-1]


def test_every_role_serves_health_readiness_metrics_and_version(home: Path) -> None:
    for instance in LocalCluster(home).instances():
        assert instance.admin is not None
        health = httpx.get(f"{instance.admin}/health", timeout=10)
        assert health.status_code == 200 and health.json()["role"] == instance.role
        # Ready once every role has reported in: on a busy machine a drafter's status report can be
        # late, and the router is unready (correctly) until the next one comes.
        ready = _ready_answer(f"{instance.admin}/ready")
        assert ready.json()["ready"] is True, ready.text
        version = httpx.get(f"{instance.admin}/version", timeout=10)
        # A verifier also says which model it runs, on which backend (the one "auto" chose), and
        # the digests a contract must name there (issue #41: those `sdcp models digest` prints).
        built: dict[str, str] = {}
        if instance.role == "verifier":
            built = {"model": "smollm2", "backend": cluster_backend()} | backend_digests(cluster_backend())
        assert version.json() == {"version": sdcp.__version__, "role": instance.role, **built}
        # A Prometheus scrape over plain HTTP/1.1, without a client certificate.
        metrics = httpx.get(f"{instance.admin}/metrics", timeout=10)
        assert metrics.status_code == 200 and "process_cpu_seconds_total" in metrics.text


def test_one_request_id_in_the_gateways_routers_and_verifiers_logs(home: Path) -> None:
    request_id = f"test-{uuid.uuid4().hex}"
    client_of(home).completions.create(
        model="smollm2", prompt="Hi", max_tokens=2, temperature=0, extra_headers={"X-Request-Id": request_id}
    )
    logs = home / "cluster" / "logs"

    def named(name: str) -> list[str]:
        return [line for line in (logs / f"{name}.log").read_text().splitlines() if request_id in line]

    for name in ("gateway", "router", "verifier"):
        assert named(name), f"{name}.log does not name {request_id}"
    # The access line is written once the response has gone, which the client may see first.
    wait_until(lambda: "POST /v1/completions 200" in named("gateway")[-1], what="the gateway's access line")


def test_an_api_key_tls_and_json_logs(home: Path, tmp_path: Path) -> None:
    # A second gateway of the cluster, on TLS (the certificate of its SDCP identity names localhost).
    root = home / "cluster"
    config = (root / "gateway.toml").read_text()
    port, admin = free_port(), free_port()
    config = re.sub(r'listen = "127.0.0.1:\d+"\n(model)', f'listen = "127.0.0.1:{port}"\n\\1', config)
    config = re.sub(r'\[admin\]\nlisten = "[^"]+"', f'[admin]\nlisten = "127.0.0.1:{admin}"', config)
    cert = re.search(r'^cert = "([^"]+)"', config, re.MULTILINE).group(1)  # type: ignore[union-attr]
    key = re.search(r'^key = "([^"]+)"', config, re.MULTILINE).group(1)  # type: ignore[union-attr]
    # [gateway] is the file's last section: the lines go into it.
    assert config.rindex("[gateway]") > max(config.rindex("[admin]"), config.rindex("[trust]"))
    config += f'cert = "{cert}"\nkey = "{key}"\n'
    path = root / "gateway-with-key.toml"
    path.write_text(config)
    log = tmp_path / "gateway.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "sdcp", "gateway", "--config", str(path), "--api-key", "s3cret", "--log-json"],
            stdout=output,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
    try:
        wait_until(lambda: process.poll() is not None or accepts(port), what="the gateway listening")
        assert process.poll() is None, log.read_text()
        base = f"https://localhost:{port}/v1"
        trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(root / "certs" / "ca.pem")))
        refused = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0, http_client=trusted)
        with pytest.raises(openai.AuthenticationError):
            refused.completions.create(model="smollm2", prompt="Hi", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            refused.models.list()
        allowed = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0, timeout=120, http_client=trusted)
        assert allowed.completions.create(model="smollm2", prompt="Hi", max_tokens=1).choices
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"https://localhost:{port}/health", timeout=10)  # the CA is not a public one
        assert httpx.get(f"http://127.0.0.1:{admin}/health", timeout=10).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert {"time", "level", "logger", "message"} <= set(entries[0])
    assert any(" 401 " in entry["message"] for entry in entries)


def test_tokenize_and_detokenize_as_vllm(home: Path) -> None:
    codec = load_text_codec("smollm2")
    answer = post(home, "tokenize", json.dumps({"model": "smollm2", "prompt": PROMPTS[0]}).encode(), root=True)
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["tokens"]
    assert tokens == codec.encode(PROMPTS[0]) and answer.json()["count"] == len(tokens)
    # What the verifier holds per session: at most the model's context.
    assert answer.json()["max_model_len"] == (4096 if cluster_backend() == "llamacpp" else codec.context_length)
    chat = post(home, "tokenize", json.dumps({"messages": CHAT}).encode(), root=True).json()["tokens"]
    assert chat == codec.encode_chat(CHAT)
    text = post(home, "detokenize", json.dumps({"tokens": tokens}).encode(), root=True)
    assert text.json() == {"prompt": PROMPTS[0]}
    refused = post(home, "tokenize", json.dumps({"prompt": "x", "foo": 1}).encode(), root=True)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "foo"
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    assert httpx.get(gateway.removesuffix("/v1") + "/health", timeout=10).status_code == 200
