"""A fix for hypercorn 0.18's HTTP/2 handling of a connection that closes under a response.

When a connection closes (peer gone, or the peer dropped it after GOAWAY) while a response is still
buffered, hypercorn stops its send task but leaves the stream's buffer open, so the application
task waiting for that buffer to drain never returns; the connection task waits for it, and
graceful shutdown waits for the connection. Releasing the buffers of a closed connection lets those
tasks finish (their data had nowhere to go anyway).
"""

from __future__ import annotations

import functools
import inspect

from hypercorn.events import Closed, Event
from hypercorn.protocol.h2 import H2Protocol, StreamBuffer

__all__ = ["install_h2_closed_connection_fix"]

_FIX_MARKER = "__sdcp_h2_fix__"


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
