"""The router service tests' deployment over real HTTP/2 + mTLS on 127.0.0.1, shared by
tests/services/test_router_service.py and the service tests that build on it: certificates,
configurations and clients for a router, two verifiers, two drafters and a front end (the
`deployment` fixture), the router's clock that stands still until a test moves it, the tiny target
(the `target` fixture) and its greedy decoding of PROMPT, and helpers that start verifiers and
n-gram drafters and open sessions through the router."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tests.services.identities import Identities, loopback_identities
from tests.services.verifier_harness import PROMPT, contract
from tests.waiting import eventually

from sdcp.config import (
    DrafterConfig,
    RouterConfig,
    ServiceConfig,
    TrustConfig,
    VerifierConfig,
)
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol.messages import Contract
from sdcp.services.drafter import DrafterNode
from sdcp.services.router import RouterNode
from sdcp.services.verifier import VerifierNode
from sdcp.transport.client import RetryPolicy, SDCPClient

ROUTER_TTL_MS = 300
# The status TTL of the deployment's instances: they report every third of it.
INSTANCE_TTL_MS = 600
# A jump of the router's clock past every status report it holds (and short of REDECIDE_AFTER_S,
# so that one jump alone does not make the router decide its sessions' drafters again).
PAST_TTL_S = 2 * INSTANCE_TTL_MS / 1000


class JumpClock:
    """The router's clock (status TTLs, decision ages), which stands still until the test moves it.

    A status expires only when the test jumps past its TTL, never because a loaded machine held
    an instance's report back: a test that waited for real TTLs to pass would race them (a
    verifier's status expiring mid-session fails the session over while that verifier runs).
    """

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Deployment:
    """Certificates, configurations and clients for one router and its instances."""

    identities: Identities
    router: RouterNode | None = None
    nodes: list[VerifierNode | RouterNode | DrafterNode] = field(default_factory=list)
    clients: list[SDCPClient] = field(default_factory=list)

    @property
    def uris(self) -> dict[str, str]:
        return self.identities.uris

    @property
    def certs(self) -> dict[str, tuple[Path, Path]]:
        return self.identities.certs

    @property
    def ca(self) -> Path:
        return self.identities.ca

    @property
    def tmp(self) -> Path:
        return self.identities.tmp

    def config(self, name: str, **sections: object) -> ServiceConfig:
        trust = TrustConfig(
            verifiers=(self.uris["verifier1"], self.uris["verifier2"]),
            drafters=(self.uris["drafter1"], self.uris["drafter2"]),
            front_ends=(self.uris["frontend"],),
            operators=(self.uris["frontend"],),
        )
        ttl_ms = ROUTER_TTL_MS if name == "router" else INSTANCE_TTL_MS
        return self.identities.config(name, trust=trust, ttl_ms=ttl_ms, **sections)

    def client(self, identity: str, peer: str = "router") -> SDCPClient:
        cert, key = self.certs[identity]
        retry = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.05)
        client = SDCPClient(self.uris[peer], cert, key, self.ca, retry=retry)
        self.clients.append(client)
        return client

    async def start(self, node: VerifierNode | RouterNode | DrafterNode) -> None:
        await node.start()
        self.nodes.append(node)

    async def stop(self, node: VerifierNode | RouterNode | DrafterNode) -> None:
        """Stop ``node``, and let the router see its status expire: the router's clock jumps past
        every TTL (the instances still running report again within a third of theirs)."""
        self.nodes.remove(node)
        await node.stop()
        # A report of the node's still in flight was cancelled with its connection (h2server).
        if self.router is not None and node is not self.router:
            jump_clock(self.router).advance(PAST_TTL_S)


@contextlib.asynccontextmanager
async def deployed(tmp_path: Path, **router_config: object) -> AsyncIterator[Deployment]:
    """A router on its own (``router_config``: more members of its ServiceConfig, an admin
    listener), and the identities of two verifiers, two drafters and a front end to start."""
    names = ["router", "verifier1", "verifier2", "drafter1", "drafter2", "frontend"]
    env = Deployment(loopback_identities(tmp_path, names))
    router = RouterNode(env.config("router", router=RouterConfig(m_init=3), **router_config), clock=JumpClock())
    env.router = router
    await env.start(router)
    try:
        yield env
    finally:
        async with asyncio.timeout(30):
            await asyncio.gather(*(c.aclose() for c in env.clients))
            for node in reversed(env.nodes):
                await node.stop()


@pytest.fixture
async def deployment(tmp_path: Path) -> AsyncIterator[Deployment]:
    async with deployed(tmp_path) as env:
        yield env


def tiny_contract(model: TargetModel, **overrides: object) -> Contract:
    # The n-gram drafter rarely agrees with a random model: only rounds this many in a row escalate,
    # so sessions run to max_new unless a test asks otherwise.
    return contract(model, **{"low_rounds": 1000, **overrides})


def jump_clock(router: RouterNode | None) -> JumpClock:
    assert router is not None and isinstance(router.clock, JumpClock)
    return router.clock


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")


async def start_verifier(env: Deployment, name: str, drafter_silence_s: float = 10.0) -> VerifierNode:
    settings = VerifierConfig(model="tiny", output_wait_s=0.5, drafter_silence_s=drafter_silence_s)
    node = VerifierNode(
        env.config(name, verifier=settings),
        target=TargetModel(tiny_model(), tiny_tokenizer(), name="tiny"),
    )
    await env.start(node)
    router = env.router
    assert router is not None
    await eventually(lambda: router.registry.is_live(node.uri, router.clock()))
    return node


async def open_session(env: Deployment, contract: Contract, **extra: object) -> dict[str, object]:
    code, body = await env.client("frontend").post_cbor(
        "sessions", {"prompt": list(PROMPT), "contract": contract.to_obj(), **extra}
    )
    assert code == 201 and isinstance(body, dict)
    return body


def greedy_reference(target: TargetModel, count: int) -> list[int]:
    generated = target.model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=count,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
    )
    return generated[0, len(PROMPT) :].tolist()


async def start_drafter(env: Deployment, name: str) -> DrafterNode:
    node = DrafterNode(env.config(name, drafter=DrafterConfig(model="ngram", target="tiny")))
    await env.start(node)
    router = env.router
    assert router is not None
    await eventually(lambda: router.registry.is_live(node.uri, router.clock()))
    return node
