"""Patches of hypercorn 0.18, which serves the front end (``sdcp.transport.server.FrontEndServer``).

Connection tracking: hypercorn gives no handle on its open connections, and its graceful shutdown
waits for every peer to close an idle keep-alive connection. Each accepted connection runs as its
own ``TCPServer.run`` task; wrapped, it registers itself in its listener's config
(``sdcp_open_connections``), so that the server can close the idle ones itself.

A fix for hypercorn's HTTP/2 handling of a connection that closes under a response:

When a connection closes (peer gone, or the peer dropped it after GOAWAY) while a response is still
buffered, hypercorn stops its send task but leaves the stream's buffer open, so the application
task waiting for that buffer to drain never returns; the connection task waits for it, and
graceful shutdown waits for the connection. Releasing the buffers of a closed connection lets those
tasks finish (their data had nowhere to go anyway).
"""

from __future__ import annotations

import functools
import inspect

from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.events import Closed, Event
from hypercorn.protocol.h2 import H2Protocol, StreamBuffer

__all__ = ["CONNECTIONS_ATTRIBUTE", "install_h2_closed_connection_fix", "install_hypercorn_connection_tracking"]

_FIX_MARKER = "__sdcp_h2_fix__"
_TRACKING_MARKER = "__sdcp_connection_tracking__"
CONNECTIONS_ATTRIBUTE = "sdcp_open_connections"


def install_hypercorn_connection_tracking() -> None:
    """Wrap ``TCPServer.run`` once so that each connection registers itself with its listener's
    config while it runs. Fails loudly if hypercorn's connection class changed shape."""
    original = TCPServer.run
    if getattr(original, _TRACKING_MARKER, False):
        return
    if "writer" not in inspect.signature(TCPServer.__init__).parameters or not inspect.iscoroutinefunction(original):
        raise RuntimeError(
            "hypercorn.asyncio.tcp_server.TCPServer changed shape; the connection tracking in "
            "sdcp.transport.h2fix must be updated (written for hypercorn 0.18.0)"
        )

    @functools.wraps(original)
    async def run_tracked(self: TCPServer) -> None:
        connections: set[TCPServer] | None = getattr(self.config, CONNECTIONS_ATTRIBUTE, None)
        if connections is not None:
            connections.add(self)
        try:
            await original(self)
        finally:
            if connections is not None:
                connections.discard(self)

    setattr(run_tracked, _TRACKING_MARKER, True)
    TCPServer.run = run_tracked  # type: ignore[method-assign]


def install_h2_closed_connection_fix() -> None:
    """Wrap ``H2Protocol.handle`` once; fails loudly if hypercorn's class changed shape."""
    original = H2Protocol.handle
    if getattr(original, _FIX_MARKER, False):
        return
    if not inspect.iscoroutinefunction(original) or not hasattr(StreamBuffer, "close"):
        raise RuntimeError(
            "hypercorn.protocol.h2.H2Protocol changed shape; sdcp.transport.h2fix must be "
            "re-checked (written for hypercorn 0.18.0)"
        )

    @functools.wraps(original)
    async def handle_releasing_buffers(self: H2Protocol, event: Event) -> None:
        await original(self, event)
        if isinstance(event, Closed):
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()

    setattr(handle_releasing_buffers, _FIX_MARKER, True)
    H2Protocol.handle = handle_releasing_buffers  # type: ignore[method-assign]
