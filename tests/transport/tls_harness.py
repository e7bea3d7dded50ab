"""The transport tests' identities and servers on 127.0.0.1: the URIs and certificate files of the
test PKI (built once per session by the `pki` fixture of tests/transport/conftest.py), an mTLS
listener on an ephemeral port under the server's certificate, a server running an ASGI app for the
length of a block, and a client presenting one of the identities with fast retries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp

from sdcp.transport import Listener, SDCPClient, Server, server_for
from sdcp.transport.client import RetryPolicy

SERVER_URI = "https://127.0.0.1:9443/verifier/"
DRAFTER_A = "https://127.0.0.1:9444/drafter-a/"
DRAFTER_B = "https://drafter-b.example:9445/"
ROGUE_URI = "https://127.0.0.1:9446/rogue/"


@dataclass(frozen=True)
class Identity:
    uri: str
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    directory: Path
    ca: Path
    server: Identity
    drafter_a: Identity
    drafter_b: Identity
    rogue: Identity  # issued by other_ca
    other_ca: Path


def mtls_listener(pki: PKI, **options: int | float) -> Listener:
    return Listener.mtls(
        "127.0.0.1",
        0,
        cert=pki.server.cert,
        key=pki.server.key,
        ca=pki.ca,
        **options,  # type: ignore[arg-type]
    )


@contextlib.asynccontextmanager
async def serving(app: ASGIApp, listener: Listener) -> AsyncIterator[Server]:
    async with asyncio.timeout(20):
        server = server_for(app, listener)
        await server.start()
    try:
        yield server
    finally:
        async with asyncio.timeout(20):
            await server.stop()


def client_for(server: Server, pki: PKI, identity: Identity, **options: object) -> SDCPClient:
    """A client presenting ``identity`` that trusts the server's CA; fast retries for tests. The test
    server listens on an ephemeral port under the certificate of ``SERVER_URI``, its identity."""
    options.setdefault("retry", RetryPolicy(attempts=4, backoff_s=0.01, max_backoff_s=0.05))
    options.setdefault("server_identity", pki.server.uri)
    return SDCPClient(server.base_url, identity.cert, identity.key, pki.ca, **options)  # type: ignore[arg-type]
