"""Long prompts never fail (issue #37): prompts near the context length, sent at once to a cluster
whose verifier shares the machine with a busy core and whose router gives a session-open little time
per token, all succeed (the verifier prefills them one at a time, and the router waits for its queue),
with the same output as sent alone; short ones sent at once are prefilled together, with the same
output as alone (issue 38); and a client that goes away while its prompt prefills stops that prefill
at its next step."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import openai
import pytest
from tests.e2e.homes import fresh_home
from tests.waiting import wait_until

from sdcp.cluster import LocalCluster
from sdcp.models.registry import load_tokenizer

pytestmark = pytest.mark.timeout(900)

CAPACITY = 1024
PROMPT_TOKENS = 900
REQUESTS = 6
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(fresh_home(tmp_path_factory.mktemp("long-prompts")))
    # A session-open may take 5 s plus 60 ms per token: six times what one 900-token prefill takes
    # beside a busy core alone (about 10 ms a token; 5 quiet), and above what it took with the
    # suite's other workers on the same two cores (over 30 ms a token), but not enough for the
    # sixth of six sent at once on a busy machine unless the router counts the queue before it.
    # (The counting itself is proven without timing by the router engine's unit test.)
    made.up(
        gateway_port=0,
        role_settings={
            "verifier": {"kv_capacity": CAPACITY},
            "router": {"open_timeout_s": 5, "open_timeout_per_token_ms": 60},
        },
    )
    try:
        yield made
    finally:
        made.down()


@pytest.fixture
def busy_core() -> Iterator[None]:
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


def long_prompt(number: int) -> str:
    """A user message of about PROMPT_TOKENS tokens, its own from the first words on."""
    tokenizer = load_tokenizer("smollm2")
    lines = [
        f"Ticket {number}-{line}: the export of report {line * number} failed at step {line}." for line in range(200)
    ]
    text = f"Summarise the tickets of queue {number}.\n" + "\n".join(lines)
    ids = tokenizer(text)["input_ids"][: PROMPT_TOKENS - 40]
    return str(tokenizer.decode(ids))


async def answer(client: openai.AsyncOpenAI, prompt: str, request_id: str | None = None) -> str:
    completion = await client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"x-request-id": request_id} if request_id else None,
    )
    return completion.choices[0].message.content or ""


def test_prompts_near_the_context_length_sent_at_once_to_a_busy_verifier_all_succeed(
    cluster: LocalCluster, busy_core: None
) -> None:
    at_once, alone = at_once_and_alone(cluster, [long_prompt(number) for number in range(REQUESTS)])
    assert at_once == alone
    assert all(at_once)


def test_short_prompts_that_wait_together_are_prefilled_together_and_answer_as_alone(cluster: LocalCluster) -> None:
    """Short questions that wait for the verifier's prefill turn (a long prompt holds it) are
    prefilled together in one call (sdcp.engines.verifier.prefills): each answer is the one it
    gets alone (SDCP 6.4 rule 1)."""
    questions = [f"Name {count} fruits that are {colour}." for count, colour in zip(range(2, 10), COLOURS, strict=True)]
    grouped = len(logged(cluster, "verifier", "short prompts prefilled together"))
    at_once, alone = at_once_and_alone(cluster, questions, behind=long_prompt(42))
    assert at_once == alone
    assert all(at_once)
    assert len(logged(cluster, "verifier", "short prompts prefilled together")) > grouped


COLOURS = ("red", "yellow", "green", "blue", "orange", "purple", "brown", "white")


def at_once_and_alone(
    cluster: LocalCluster, prompts: list[str], behind: str | None = None
) -> tuple[list[str], list[str]]:
    """The answers to ``prompts`` sent at once, then one after another. With ``behind``, that
    prompt is sent first and the others once its open reached the verifier: they wait behind its
    prefill."""

    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=cluster.gateway, api_key="unused", max_retries=0, timeout=600)
        first = None
        if behind is not None:
            request_id = f"first-{uuid.uuid4().hex}"
            first = asyncio.create_task(answer(client, behind, request_id))
            await asyncio.to_thread(
                wait_until,
                lambda: bool(logged(cluster, "verifier", f"request {request_id}", "opening")),
                what="the first prompt's open reached the verifier",
            )
        at_once = await asyncio.gather(*(answer(client, prompt) for prompt in prompts))
        if first is not None:
            await first
        alone = [await answer(client, prompt) for prompt in prompts]
        await client.close()
        return list(at_once), alone

    return asyncio.run(run())


def logged(cluster: LocalCluster, name: str, *needles: str) -> list[str]:
    """The lines of instance ``name``'s log that hold every one of ``needles``."""
    log = (cluster.root / "logs" / f"{name}.log").read_text()
    return [line for line in log.splitlines() if all(needle in line for needle in needles)]


def test_a_client_that_leaves_during_its_prefill_stops_it(cluster: LocalCluster) -> None:
    gateway = cluster.gateway
    assert gateway is not None
    host, port = gateway.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    request_id = f"leaves-{uuid.uuid4().hex}"
    body = json.dumps(
        {"model": "smollm2", "messages": [{"role": "user", "content": long_prompt(99)}], "max_tokens": 8}
    ).encode()

    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-request-id: {request_id}\r\n\r\n".encode()
            + body
        )
        # The prompt is being prefilled (its open is at the verifier): the client leaves.
        wait_until(
            lambda: bool(logged(cluster, "verifier", f"request {request_id}", "opening")),
            what="the open reached the verifier",
        )
    wait_until(
        lambda: bool(logged(cluster, "verifier", "prefill stopped, its opener went away")), what="the prefill stopped"
    )
    wait_until(
        lambda: bool(logged(cluster, "gateway", f"request {request_id} ", " 499 aborted ")), what="the gateway's 499"
    )
    assert not logged(cluster, "verifier", f"request {request_id})", "open at epoch")
