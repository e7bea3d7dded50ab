"""Several roles in one process (`sdcp together`, `sdcp up --one-process`): each instance is the
service it is alone, with its own listener, identity, MLC and metrics, on one event loop; the
gateway reads the output of a verifier of this process by a call instead of over HTTP/2 + TLS.

Why (docs/performance.md, "Session 16's serving run"): at 16 streams every committed token was an
output read over HTTP/2 + TLS, which on 2 cores came out of the target's passes (a fifth of the
cluster's tokens/s). Everything else (opens, assignments, proposals, events, status reports) still
travels over HTTP, so that the instances stay the ones a deployment runs on separate hosts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from sdcp.engines.errors import SessionNotFound, Unavailable
from sdcp.engines.verifier import VerifierEngine
from sdcp.frontend.client import OutputReader
from sdcp.frontend.gateway import GatewayNode
from sdcp.protocol.messages import Output
from sdcp.services.node import Node
from sdcp.services.verifier import VerifierNode
from sdcp.transport.errors import PeerClientError, PeerServerError

__all__ = ["local_output_reader", "run_together"]


def local_output_reader(engine: VerifierEngine) -> OutputReader:
    """The verifier engine's output read, raising what the HTTP client raises for the answers its
    service gives (404 for a session it does not hold, 503 when it cannot answer now)."""

    async def read(session: bytes, start: int) -> Output:
        try:
            return await engine.output(session, start)
        except SessionNotFound as exc:
            raise PeerClientError(404, None, str(exc)) from exc
        except Unavailable as exc:
            raise PeerServerError(503, None, str(exc)) from exc

    return read


async def run_together(nodes: Sequence[Node], shutdown: asyncio.Event) -> None:
    """Serve every node until ``shutdown`` is set or one of them stops (a model thread that died):
    then every other one stops too, and the first failure is raised."""
    verifiers = [node for node in nodes if isinstance(node, VerifierNode)]
    for gateway in (node for node in nodes if isinstance(node, GatewayNode)):
        for verifier in verifiers:
            gateway.client.local_outputs[verifier.uri] = local_output_reader(verifier.engine)
    running = [asyncio.ensure_future(node.run_until(shutdown)) for node in nodes]
    try:
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    finally:
        shutdown.set()
        outcomes = await asyncio.gather(*running, return_exceptions=True)
    failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
    if failure is not None:
        raise failure
