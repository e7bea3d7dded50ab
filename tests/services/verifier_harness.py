"""A verifier service over real HTTP/2 + mTLS on 127.0.0.1 for tests that play its router and its
drafter, shared by tests/services/test_verifier_service.py and the llama.cpp verifier tests:
`running_cluster` starts a verifier on a given target with certificates for the router, the drafter
and an intruder, and the helpers write the contract, the proposals and the session state the test
sends as router and drafter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sdcp.cache import MLC, build_uri
from sdcp.config import InstanceConfig, MLCConfig, ServiceConfig, VerifierConfig
from sdcp.localhost import free_port
from sdcp.models.backend import Target
from sdcp.protocol.messages import (
    Action,
    Assignment,
    Contract,
    Proposal,
    Role,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
    session_path_id,
)
from sdcp.services.verifier import VerifierNode
from sdcp.transport.certs import make_certs
from sdcp.transport.client import SDCPClient


class Cluster:
    def __init__(self, tmp: Path, node: VerifierNode, mlc: MLC, certs: dict[str, tuple[Path, Path]], ca: Path):
        self.tmp, self.node, self.mlc, self.certs, self.ca = tmp, node, mlc, certs, ca
        self.router_uri = "https://127.0.0.1:1"
        self._clients: list[SDCPClient] = []

    def client(self, identity: str) -> SDCPClient:
        cert, key = self.certs[identity]
        client = SDCPClient(self.node.uri, cert, key, self.ca)
        self._clients.append(client)
        return client

    async def close(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients))


@asynccontextmanager
async def running_cluster(
    tmp_path: Path, target: Target, mlc_unlisted: str | None = "own", **verifier: float
) -> AsyncIterator[Cluster]:
    """A verifier; its MLC serves unlisted authorities ("own") unless ``mlc_unlisted`` says
    otherwise (None: the default of ``[mlc] unlisted``)."""
    verifier_uri = f"https://127.0.0.1:{free_port()}"
    router_uri = "https://127.0.0.1:1"
    identities = {
        "verifier": verifier_uri,
        "router": router_uri,
        "drafter": "https://127.0.0.1:2",
        "intruder": "https://127.0.0.1:3",
    }
    issued = make_certs(tmp_path / "certs", list(identities.values()))
    certs = {name: (issued[uri].cert_path, issued[uri].key_path) for name, uri in identities.items()}
    ca = tmp_path / "certs" / "ca.pem"
    config = ServiceConfig(
        instance=InstanceConfig(
            uri=verifier_uri, cert=certs["verifier"][0], key=certs["verifier"][1], ca=ca, router=router_uri
        ),
        mlc=MLCConfig(
            disk_dir=tmp_path / "mlc",
            **({} if mlc_unlisted is None else {"unlisted": mlc_unlisted}),  # type: ignore[arg-type]
        ),
        verifier=VerifierConfig(**{"model": "tiny", "output_wait_s": 0.5, **verifier}),  # type: ignore[arg-type]
    )
    for session in list(target._sessions):
        target.close_session(session)
    node = VerifierNode(config, target=target)
    mlc = MLC.from_config(disk_dir=tmp_path / "mlc")
    await node.start()
    env = Cluster(tmp_path, node, mlc, certs, ca)
    try:
        yield env
    finally:
        await env.close()
        await node.stop()
        await mlc.close()


def contract(model: Target, **overrides: object) -> Contract:
    obj: dict[str, object] = {
        "target": model.weights_digest,
        "tokenizer": model.tokenizer_digest,
        "rule": 1,
        "m_max": 4,
        "max_new": 12,
        "stop": [],
        "low_rounds": 3,
        "fallback": [Action.REDUCE, Action.FAIL],
    }
    obj.update(overrides)
    return Contract.from_obj(obj)


SESSION = bytes(range(16))
PROMPT = (5, 17, 42, 9, 100, 3)
DRAFTER = "https://127.0.0.1:2"


def proposal(state: SessionState, tokens: tuple[int, ...], **overrides: object) -> Proposal:
    fields: dict[str, object] = dict(
        session=SESSION,
        epoch=state.epoch,
        round=state.round + 1,
        drafter=DRAFTER,
        base=state.committed,
        base_digest=state.digest,
        tokens=tokens,
        status=Status(instance=DRAFTER, role=Role.DRAFTER, load=0, queue=0, ttl_ms=1000),
    )
    fields.update(overrides)
    return Proposal(**fields)  # type: ignore[arg-type]


def advance(state: SessionState, verdict: Verdict) -> SessionState:
    return SessionState(
        session=SESSION, epoch=state.epoch, round=verdict.round, committed=verdict.committed, digest=verdict.digest
    )


async def assign(env: Cluster, c: Contract, state: SessionState, *, drafter: str = DRAFTER, epoch: int = 1) -> None:
    """PUT sessions/{id}/drafter from the router: ``drafter`` drafts from ``state`` on."""
    assignment = Assignment(
        session=SESSION,
        epoch=epoch,
        contract=c,
        verifier=env.node.uri,
        drafter=drafter,
        prompt=PROMPT,
        round=state.round,
        committed=state.committed,
        digest=state.digest,
        m_init=4,
    )
    status, _ = await env.client("router").put_cbor(f"sessions/{session_path_id(SESSION)}/drafter", assignment.to_obj())
    assert status == 200


async def open_and_assign(env: Cluster, c: Contract, epoch: int = 1, log_uri: str | None = None) -> SessionState:
    router = env.client("router")
    log_uri = log_uri or build_uri("local", None, "log", SESSION.hex())
    opened = SessionOpen(session=SESSION, epoch=epoch, contract=c, prompt=PROMPT, commit_log=log_uri)
    status, body = await router.post_cbor("sessions", opened.to_obj())
    assert status == 201
    state = SessionState.from_obj(body)
    await assign(env, c, state, epoch=epoch)
    return state
