"""System 4: SDCP end to end on a local cluster (HTTP/2 + mTLS, embedded MLC, optionally Redis).

The cluster has its own SDCP home under the benchmark's output directory; its models directory is
a symbolic link to the fetched one, so nothing is converted again. Only the n-gram drafter runs:
on this machine the model drafter is the target itself (docs/models.md), which cannot speed it up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sdcp.bench.systems import RunResult
from sdcp.client import ClusterClient, build_contract
from sdcp.cluster import LocalCluster
from sdcp.models.fetch import sdcp_home
from sdcp.protocol.messages import Contract

__all__ = ["ClusterSystem", "non_model_ms"]


def non_model_ms(stats: dict[str, Any]) -> list[float]:
    """Per round after the first: time between commits minus the model's time in the round."""
    gaps = stats.get("round_gap_us", [])
    model = stats.get("round_model_us", [])
    return [(gap - used) / 1000 for gap, used in list(zip(gaps, model, strict=False))[1:]]


class ClusterSystem:
    """A running local cluster and a client of it; ``generate`` streams one session."""

    def __init__(self, home: Path, model: str, *, redis_url: str | None = None, name: str = "sdcp_e2e") -> None:
        self.name = name
        self.home = home
        self.model = model
        self.redis_url = redis_url
        self.cluster = LocalCluster(home)
        self.client: ClusterClient | None = None
        self.target: dict[str, Any] | None = None

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        models = self.home / "models"
        fetched = sdcp_home() / "models"
        if not models.exists() and fetched.is_dir() and fetched.resolve() != models.resolve():
            models.symlink_to(fetched.resolve(), target_is_directory=True)
        self.cluster.up(model=self.model, drafters=("ngram",), redis_url=self.redis_url, gateway_port=0)

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
        return build_contract(target=self.target["model"], tokenizer=self.target["tokenizer"], max_new=max_new, stop=stop)

    async def generate(self, prompt: Sequence[int], max_new: int, stop: Sequence[int]) -> RunResult:
        if self.client is None:
            raise RuntimeError("connect() first")
        contract = self.contract(max_new, stop)
        started = time.perf_counter()
        handle = await self.client.open(list(prompt), contract)
        tokens: list[int] = []
        inter_token: list[float] = []
        previous: float | None = None
        async for chunk in self.client.stream(handle):
            now = time.perf_counter()
            if chunk.tokens and previous is not None:
                # Tokens of one chunk arrive together: the gap is shared among them.
                inter_token.extend([1000 * (now - previous) / len(chunk.tokens)] * len(chunk.tokens))
            if chunk.tokens:
                previous = now
            tokens.extend(chunk.tokens)
        seconds = time.perf_counter() - started
        stats = await self.client.stats(handle)
        return RunResult(
            tokens=tokens,
            seconds=seconds,
            rounds=int(stats.get("rounds", 0)),
            self_decoded=int(stats.get("self_decoded", 0)),
            accepted=int(stats.get("accepted", 0)),
            proposed=int(stats.get("proposed", 0)),
            accepted_by_position=list(stats.get("accepted_by_position", [])),
            proposed_by_position=list(stats.get("proposed_by_position", [])),
            overhead_ms=non_model_ms(stats),
            inter_token_ms=inter_token,
            # Rounds committed from rows of an earlier pass (self-decoding lookahead) report 0.
            batch_sizes=[size for size in stats.get("round_batch", []) if size > 0],
        )
