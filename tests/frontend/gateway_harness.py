"""A real cluster on 127.0.0.1 for the gateway's tests (router, a verifier of the tiny target, an
n-gram drafter, over HTTP/2 + mTLS), shared by tests/frontend/test_gateway_service.py and the
gateway tests that build on it: the `cluster` fixture starts the cluster, `Cluster.gateway` starts a
gateway on it once the router lists the verifier, and `base` and `client_of` reach a gateway over
HTTP and through the openai package."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from tests.services.identities import Identities, loopback_identities
from tests.waiting import eventually, eventually_async

from sdcp.config import (
    DrafterConfig,
    GatewayConfig,
    RouterConfig,
    ServiceConfig,
    TrustConfig,
    VerifierConfig,
)
from sdcp.frontend.gateway import GatewayNode
from sdcp.localhost import free_port
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.services.drafter import DrafterNode
from sdcp.services.router import RouterNode
from sdcp.services.verifier import VerifierNode

# Statuses are reported every third of it (SDCP 6.1).
STATUS_TTL_MS = 10_000


@dataclass
class Cluster:
    """A router, a tiny verifier and an n-gram drafter; gateways are started by the test."""

    identities: Identities
    nodes: list[RouterNode | VerifierNode | DrafterNode | GatewayNode] = field(default_factory=list)

    @property
    def uris(self) -> dict[str, str]:
        return self.identities.uris

    def config(self, name: str, **sections: object) -> ServiceConfig:
        trust = TrustConfig(
            verifiers=(self.uris["verifier"],),
            drafters=(self.uris["drafter"],),
            front_ends=(self.uris["gateway"],),
        )
        # No test of this cluster lets a status expire; one of 600 ms expired when a busy machine held
        # the test's event loop longer than that, and the router then listed no verifier (503).
        return self.identities.config(name, trust=trust, ttl_ms=STATUS_TTL_MS, **sections)

    @property
    def verifier(self) -> VerifierNode:
        return next(node for node in self.nodes if isinstance(node, VerifierNode))

    async def gateway(self, **settings: Any) -> GatewayNode:
        listen = f"127.0.0.1:{free_port()}"
        node = GatewayNode(self.config("gateway", gateway=GatewayConfig(listen=listen, model="tiny", **settings)))
        await node.start()
        self.nodes.append(node)

        async def ready() -> bool:
            return (await node.readiness()).ready

        # Ready once the router lists the verifier (and so its target) to the gateway.
        await eventually_async(ready)
        return node


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    env = Cluster(loopback_identities(tmp_path, ["router", "verifier", "drafter", "gateway"]))
    router = RouterNode(env.config("router", router=RouterConfig()))
    verifier = VerifierNode(
        env.config("verifier", verifier=VerifierConfig(model="tiny", output_wait_s=0.5)),
        target=TargetModel(tiny_model(), tiny_tokenizer(), name="tiny"),
    )
    drafter = DrafterNode(env.config("drafter", drafter=DrafterConfig(model="ngram", target="tiny")))
    try:
        for node in (router, verifier, drafter):
            await node.start()
            env.nodes.append(node)
        await eventually(lambda: all(router.registry.is_live(n.uri, router.clock()) for n in (verifier, drafter)))
        yield env
    finally:
        async with asyncio.timeout(30):
            for running in reversed(env.nodes):
                await running.stop()


def base(gateway: GatewayNode) -> str:
    return gateway.base_url.rstrip("/")


def client_of(gateway: GatewayNode, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base(gateway)}/v1", api_key="unused", max_retries=0, timeout=60, **options)
