"""The drafter service tests' mTLS environment on 127.0.0.1, shared by
tests/services/test_drafter_service.py, the suffix drafter's service tests and the llama.cpp
drafter's: certificates and configurations for a verifier and a drafter, with the test playing the
router (the `env` fixture), the MLC they share, the tiny target (the `target` fixture) and its greedy
decoding, the contracts and assignments the test sends as router, a real verifier service, and the
output of a finished session read back as an operator would."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tests.services.outputs import output_tokens, read_output

from sdcp.cache import MLC
from sdcp.config import InstanceConfig, MLCConfig, ServiceConfig, TrustConfig, VerifierConfig
from sdcp.localhost import free_port
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.protocol.digest import prefix_digest
from sdcp.protocol.messages import Action, Assignment, Contract
from sdcp.services.verifier import VerifierNode
from sdcp.transport.certs import make_certs
from sdcp.transport.client import SDCPClient

# Refuses connections: status reports to the router fail quietly in the background.
ROUTER = "https://127.0.0.1:1"
STRANGER = "https://127.0.0.1:3"
# Repetitive text, so that prompt lookup finds continuations.
PROMPT = tuple(tiny_tokenizer()("the cat sat on the mat and the cat sat on the hat")["input_ids"])


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")


def greedy(target: TargetModel, prompt: tuple[int, ...], count: int) -> list[int]:
    """Greedy decoding by full forward passes; argmax ties go to the smallest id, as in rule 1."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            logits = target.model(input_ids=torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :]


@dataclass
class Env:
    tmp: Path
    ca: Path
    certs: dict[str, tuple[Path, Path]]
    verifier_uri: str
    drafter_uri: str
    mlc: MLC
    clients: list[SDCPClient]

    def config(self, uri: str, **sections: object) -> ServiceConfig:
        cert, key = self.certs[uri]
        return ServiceConfig(
            instance=InstanceConfig(uri=uri, cert=cert, key=key, ca=self.ca, router=ROUTER, ttl_ms=60_000),
            mlc=MLCConfig(disk_dir=self.tmp / "mlc"),
            # The test reads output as an operator would.
            trust=TrustConfig(operators=(STRANGER,)),
            **sections,  # type: ignore[arg-type]
        )

    def client(self, peer: str, identity: str) -> SDCPClient:
        cert, key = self.certs[identity]
        client = SDCPClient(peer, cert, key, self.ca)
        self.clients.append(client)
        return client


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    verifier_uri = f"https://127.0.0.1:{free_port()}"
    drafter_uri = f"https://127.0.0.1:{free_port()}/drafter"
    uris = [verifier_uri, drafter_uri, ROUTER, STRANGER]
    issued = make_certs(tmp_path / "certs", uris)
    certs = {uri: (issued[uri].cert_path, issued[uri].key_path) for uri in uris}
    # The same authority as the nodes' MLCConfig, so that URIs built here name their objects.
    mlc = MLC.from_config(authority=MLCConfig().authority, disk_dir=tmp_path / "mlc")
    environment = Env(tmp_path, tmp_path / "certs" / "ca.pem", certs, verifier_uri, drafter_uri, mlc, [])
    try:
        yield environment
    finally:
        await asyncio.gather(*(client.aclose() for client in environment.clients))
        await mlc.close()


def make_contract(target: TargetModel, **overrides: object) -> Contract:
    obj: dict[str, object] = {
        "target": target.weights_digest,
        "tokenizer": target.tokenizer_digest,
        "rule": 1,
        "m_max": 6,
        "max_new": 24,
        "stop": [],
        # Escalation would end the session before max_new on a random-weight model.
        "low_rounds": 1000,
        "fallback": [Action.REDUCE],
    }
    obj.update(overrides)
    return Contract.from_obj(obj)


def make_assignment(env: Env, contract: Contract, session: bytes, **overrides: object) -> Assignment:
    fields: dict[str, object] = {
        "session": session,
        "epoch": 1,
        "contract": contract,
        "verifier": env.verifier_uri,
        "drafter": env.drafter_uri,
        "prompt": PROMPT,
        "round": 0,
        "committed": 0,
        "digest": prefix_digest(contract.digest, PROMPT),
        "m_init": 4,
    }
    fields.update(overrides)
    return Assignment(**fields)  # type: ignore[arg-type]


async def verifier_node(env: Env, target: TargetModel) -> VerifierNode:
    for session in list(target._sessions):
        target.close_session(session)
    config = env.config(env.verifier_uri, verifier=VerifierConfig(model="tiny", output_wait_s=0.5))
    node = VerifierNode(config, target=target)
    await node.start()
    return node


async def read_all_output(env: Env, session: bytes) -> list[int]:
    outputs = await read_output(env.client(env.verifier_uri, STRANGER), session)
    assert outputs[-1].finish == Action.FINISH
    return output_tokens(outputs)
