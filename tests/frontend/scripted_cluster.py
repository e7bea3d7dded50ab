"""The router and verifiers as the gateway's ClusterClient sees them, scripted (no sockets, no models),
shared by tests/frontend/test_gateway.py and tests/frontend/test_tool_calls.py: `ScriptedCluster`
lists the verifiers a test registers and opens sessions that commit the tokens it is given, `chunked`
splits tokens into the chunks rounds commit, and `streamed` reads the events of an SSE answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from sdcp.frontend.client import OutputChunk, SessionHandle
from sdcp.protocol.messages import Action, Contract, TokenLogprob
from sdcp.protocol.problems import BadContract
from sdcp.transport.errors import PeerServerError

ROUTER = "https://127.0.0.1:9100"
MODEL_A, MODEL_B, MODEL_C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32


class ScriptedCluster:
    """The router and verifiers as the gateway's ClusterClient sees them: the verifiers listed (and
    those listed that do not answer), and sessions that commit ``chunks`` of tokens."""

    def __init__(self, chunks: Sequence[Sequence[int]]) -> None:
        self.listed: list[dict[str, object]] = []
        self.silent: set[str] = set()
        self.chunks = chunks
        self.target_reads = 0
        self.contracts: list[Contract] = []
        self.cancelled: list[bytes] = []
        self.opened = 0

    def register(self, *verifiers: tuple[str, bytes, bytes | None]) -> None:
        """The live verifiers from now on: instance, target digest, tokenizer digest if it reports one."""
        self.listed = []
        for instance, model, tokenizer in verifiers:
            target: dict[str, object] = {"instance": instance, "model": model}
            if tokenizer is not None:
                target["tokenizer"] = tokenizer
            self.listed.append(target)

    async def targets(self) -> list[dict[str, object]]:
        self.target_reads += 1
        return list(self.listed)

    async def open(self, prompt: Sequence[int], contract: Contract, **_options: Any) -> SessionHandle:
        # The router's choice of a verifier: the contract's target and tokenizer, then who answers.
        self.contracts.append(contract)
        serving = [
            str(t["instance"])
            for t in self.listed
            if t["model"] == contract.target and t.get("tokenizer", contract.tokenizer) == contract.tokenizer
        ]
        if not serving:
            raise BadContract("no live verifier serves the contract's target and tokenizer")
        answering = [instance for instance in serving if instance not in self.silent]
        if not answering:
            raise PeerServerError(503, None, f"no verifier for this target answered (tried {', '.join(serving)})")
        self.opened += 1
        return SessionHandle(self.opened.to_bytes(16, "big"), 1, answering[0], None)

    async def stream(self, handle: SessionHandle) -> AsyncIterator[OutputChunk]:
        start = 0
        for number, tokens in enumerate(self.chunks):
            last = number == len(self.chunks) - 1
            logprobs = tuple(TokenLogprob(logprob=-1000) for _ in tokens)
            yield OutputChunk(start, tuple(tokens), 1, Action.FINISH if last else None, logprobs)
            start += len(tokens)

    async def cancel(self, handle: SessionHandle) -> None:
        self.cancelled.append(handle.session)

    async def aclose(self) -> None:
        pass


def chunked(tokens: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """The tokens in chunks of these sizes, over and over, as rounds commit them."""
    chunks, start, turn = [], 0, 0
    while start < len(tokens):
        size = sizes[turn % len(sizes)]
        chunks.append(list(tokens[start : start + size]))
        start, turn = start + size, turn + 1
    return chunks


def streamed(answer: httpx.Response) -> list[dict[str, Any]]:
    events = [line.removeprefix("data: ") for line in answer.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]
