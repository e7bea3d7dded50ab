"""Several roles in one process (`sdcp together`; `sdcp up` on the CPU): each instance is the
service it is alone, with its own listener, identity, MLC and metrics, on one event loop; the
gateway reads the output of a verifier of this process by a call instead of over HTTP/2 + TLS, and
what the instances ask each other (opens, assignments, proposals, events, status reports) goes to
the peer's app by a call too (sdcp.transport.local): the same routes, authorization and problem
details as over mTLS, without the encryption, the framing and the socket.

Why (docs/performance.md, "Session 16's serving run" and session 38): at 16 streams every committed
token was an output read over HTTP/2 + TLS, which on 2 cores came out of the target's passes (a fifth
of the cluster's tokens/s); in one process the services' CPU a token fell by a third. Peers in
other processes (another host's instances, Redis, MLC nodes) are still asked over the network.
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
from sdcp.transport.local import serve_locally

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
    gateways = [node for node in nodes if isinstance(node, GatewayNode)]
    for gateway in gateways:
        for verifier in verifiers:
            gateway.client.local_outputs[verifier.uri] = local_output_reader(verifier.engine)
    served = [node for node in nodes if isinstance(node, Node)]
    apps = {node.uri: (node.served_app, node.local_gate) for node in served}
    for peers in [*(node.peers for node in served), *(gateway.client.peers for gateway in gateways)]:
        serve_locally(peers, apps)
    running = [asyncio.ensure_future(node.run_until(shutdown)) for node in nodes]
    try:
        await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
    finally:
        shutdown.set()
        outcomes = await asyncio.gather(*running, return_exceptions=True)
    failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
    if failure is not None:
        raise failure
