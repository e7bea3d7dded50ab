"""How engines reach other roles, whatever carries the messages (HTTP/2 + mTLS, or memory)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from sdcp.protocol.messages import Event, Output, Proposal, Verdict

__all__ = ["EventSink", "VerifierLink"]

# Where a verifier's events go (SDCP 6.5.2: POST events at the router). It raises
# ``sdcp.protocol.problems.ProtocolError`` when the router refuses the event and
# ``sdcp.engines.errors.Unanswered`` when no answer came; the engine sends an unanswered one again.
EventSink = Callable[[Event], Awaitable[None]]


class VerifierLink(Protocol):
    """A drafter's way to its sessions' verifiers, named by base URI.

    Both raise ``sdcp.protocol.problems.ProtocolError`` for a problem answer and
    ``sdcp.engines.errors.Unanswered`` when no answer came (the request may be sent again).
    """

    async def propose(self, verifier: str, proposal: Proposal) -> Verdict:
        """POST proposals (SDCP 6.3)."""
        ...

    async def output(self, verifier: str, session: bytes, start: int) -> Output:
        """GET sessions/{id}/output?from=start (SDCP 6.7)."""
        ...
