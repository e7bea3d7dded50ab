"""System 4: SDCP end to end on a local cluster (HTTP/2 + mTLS, embedded MLC, optionally Redis),
and system 5, what a user runs: the default `sdcp up` cluster through the OpenAI gateway.

Each cluster has its own SDCP home under the benchmark's output directory; its models directory is
a symbolic link to the fetched one, so nothing is converted again. ``sdcp_e2e`` runs the n-gram
drafter alone; ``sdcp_default`` whatever `sdcp up` starts by default (``DEFAULT_DRAFTERS``).

A prompt of the structured workload carries its constraint: ``sdcp_e2e`` opens the session with it,
``sdcp_default`` sends it as a user does, as the request's ``response_format`` (a JSON schema) or
vLLM's ``guided_*`` member (``gateway_request``).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcp.bench.streamed import fresh_cluster
from sdcp.bench.systems import RunResult, result_from_stats
from sdcp.bench.workloads import Prompt, chat_messages, plain_text
from sdcp.cluster import DEFAULT_DRAFTERS, LocalCluster, RedisSetup
from sdcp.frontend.client import ClusterClient, SessionHandle, build_contract
from sdcp.home import sdcp_home
from sdcp.protocol.messages import Constraint, Contract

__all__ = ["ClusterSystem", "GatewaySystem", "gateway_request"]

# A gateway request decodes at most max_new tokens; this bounds the wait for its answer.
_GATEWAY_TIMEOUT_S = 600.0


class ClusterSystem:
    """A running local cluster and a client of it; ``generate`` streams one session."""

    def __init__(
        self,
        home: Path,
        model: str,
        *,
        redis_url: str | None = None,
        name: str = "sdcp_e2e",
        drafters: tuple[str, ...] = ("ngram",),
    ) -> None:
        self.name = name
        self.home = home
        self.model = model
        self.redis_url = redis_url
        self.drafters = drafters
        self.cluster = LocalCluster(home)
        self.client: ClusterClient | None = None
        self.target: dict[str, Any] | None = None

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.cluster = fresh_cluster(self.home)
        models = self.home / "models"
        fetched = sdcp_home() / "models"
        if not models.exists() and fetched.is_dir() and fetched.resolve() != models.resolve():
            models.symlink_to(fetched.resolve(), target_is_directory=True)
        # The bench's own throwaway redis-server on loopback: its default user is open and it keeps no
        # users over a restart, which a user's Redis must not be (docs/security.md).
        redis = None if self.redis_url is None else RedisSetup(self.redis_url, insecure=True)
        self.cluster.up(model=self.model, drafters=self.drafters, redis_url=redis, gateway_port=0)

    def stop(self) -> None:
        self.cluster.down()

    async def connect(self) -> None:
        cert, key, ca = self.cluster.client_credentials()
        self.client = ClusterClient(self.cluster.router, cert=cert, key=key, ca=ca)
        deadline = time.monotonic() + 30.0
        while True:
            targets = await self.client.targets()
            if targets:
                self.target = targets[0]
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster under {self.home} reports no live verifier")
            await asyncio.sleep(0.2)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    def contract(self, max_new: int, stop: Sequence[int]) -> Contract:
        if self.target is None:
            raise RuntimeError("connect() first")
        return build_contract(
            target=self.target["model"], tokenizer=self.target["tokenizer"], max_new=max_new, stop=stop
        )

    async def generate(self, prompt: Prompt, max_new: int, stop: Sequence[int]) -> RunResult:
        if self.client is None:
            raise RuntimeError("connect() first")
        contract = self.contract(max_new, stop)
        started = time.perf_counter()
        handle = await self.client.open(list(prompt.tokens), contract, constraint=prompt.constraint)
        tokens: list[int] = []
        inter_token: list[float] = []
        first_token_ms: float | None = None
        previous: float | None = None
        async for chunk in self.client.stream(handle):
            now = time.perf_counter()
            if chunk.tokens and previous is not None:
                # Tokens of one chunk arrive together: the gap is shared among them.
                inter_token.extend([1000 * (now - previous) / len(chunk.tokens)] * len(chunk.tokens))
            elif chunk.tokens:
                first_token_ms = 1000 * (now - started)
            if chunk.tokens:
                previous = now
            tokens.extend(chunk.tokens)
        seconds = time.perf_counter() - started
        result = await self.session_result(handle, seconds)
        result.tokens, result.inter_token_ms, result.first_token_ms = tokens, inter_token, first_token_ms
        return result

    async def session_result(self, handle: SessionHandle, seconds: float) -> RunResult:
        """What the session's rounds did (the verifier's stats) and who served it (the router)."""
        if self.client is None:
            raise RuntimeError("connect() first")
        stats = await self.client.stats(handle)
        described = await self.client.describe(handle)
        names = {instance.uri: instance.name for instance in self.cluster.instances()}
        served = described.get("served", [])
        uris = [str(uri) for uri in served] if isinstance(served, list) else []
        result = result_from_stats(stats, seconds)
        result.served = [names.get(uri, uri) for uri in uris]
        return result


class GatewaySystem(ClusterSystem):
    """What a user runs: the default `sdcp up` cluster, asked through its OpenAI-compatible API with
    a streamed chat request (the gateway applies the chat template), timed by the client from
    sending the request to the first text (time to first token) and to the end of the stream. The
    tokens come afterwards from the verifier's output, untimed, to compare them with greedy decoding."""

    def __init__(self, home: Path, model: str, *, chat: bool = True) -> None:
        super().__init__(home, model, name="sdcp_default", drafters=DEFAULT_DRAFTERS)
        # As tokenize_prompt: the chat API where the model has a chat template, else completions.
        self.chat = chat

    async def generate(self, prompt: Prompt, max_new: int, stop: Sequence[int]) -> RunResult:
        if self.client is None or self.cluster.gateway is None:
            raise RuntimeError("start() and connect() first")
        request = gateway_request(self.model, prompt, max_new, chat=self.chat)
        endpoint = "chat/completions" if self.chat else "completions"
        started = time.perf_counter()
        answered = await asyncio.to_thread(_ask_gateway, f"{self.cluster.gateway}/{endpoint}", request, started)
        seconds = time.perf_counter() - started
        (session,) = answered.sessions
        handle = await self.client.locate(SessionHandle(session, 1, "", None))
        result = await self.session_result(handle, seconds)
        result.tokens = [token for chunk in [c async for c in self.client.stream(handle)] for token in chunk.tokens]
        result.first_token_ms = answered.first_text_ms
        return result


def gateway_request(model: str, prompt: Prompt, max_new: int, *, chat: bool) -> dict[str, Any]:
    """The streamed greedy request a user sends the gateway for ``prompt``: its chat messages (or
    completions prompt), a later turn of a conversation with the turns and answers before it, and
    its constraint as OpenAI's ``response_format`` (a JSON schema) or vLLM's ``guided_*`` member."""
    request: dict[str, Any] = {"model": model, "max_tokens": max_new, "temperature": 0, "stream": True}
    if chat:
        request["messages"] = chat_messages(prompt.text, prompt.history)
    else:
        request["prompt"] = plain_text(prompt.text, prompt.history)
    if prompt.constraint is not None:
        request.update(_constraint_members(prompt.constraint))
    return request


def _constraint_members(constraint: Constraint) -> dict[str, Any]:
    if constraint.kind == "json_schema":
        schema = json.loads(constraint.text)
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    if constraint.kind == "choice":
        return {"guided_choice": json.loads(constraint.text)}
    if constraint.kind == "regex":
        return {"guided_regex": constraint.text}
    if constraint.kind == "lark":
        return {"guided_grammar": constraint.text}
    raise ValueError(f"no request member carries a constraint of kind {constraint.kind!r}")


@dataclass(frozen=True)
class _Answered:
    sessions: list[bytes]
    # From sending the request to the first chunk that carries text; None if none did.
    first_text_ms: float | None


def _ask_gateway(url: str, body: dict[str, Any], started: float) -> _Answered:
    """POST a streamed request to the gateway and read it to its end: the sessions of its choices
    (the X-SDCP-Sessions header) and when the first text came."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    first_text_ms = None
    with urllib.request.urlopen(request, timeout=_GATEWAY_TIMEOUT_S) as response:  # noqa: S310 - loopback
        sessions = response.headers.get("X-SDCP-Sessions", "")
        for line in response:
            data = line.removeprefix(b"data: ").strip()
            if first_text_ms is None and data and data != b"[DONE]" and _carries_text(json.loads(data)):
                first_text_ms = 1000 * (time.perf_counter() - started)
    if not sessions:
        raise RuntimeError(f"the gateway at {url} answered without its sessions")
    return _Answered([bytes.fromhex(session) for session in sessions.split(",")], first_text_ms)


def _carries_text(chunk: dict[str, Any]) -> bool:
    """Whether a chat or completions stream chunk carries text of a choice."""
    return any(choice.get("text") or (choice.get("delta") or {}).get("content") for choice in chunk.get("choices", []))
