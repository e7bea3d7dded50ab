"""How engines reach other roles, whatever carries the messages (HTTP/2 + mTLS, or memory)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from sdcp.protocol.messages import (
    Assignment,
    CancelRequest,
    Event,
    Output,
    Policy,
    Proposal,
    SelfDecodeRequest,
    SessionOpen,
    SessionState,
    Verdict,
)

__all__ = ["EventSink", "RouterLink", "VerifierLink"]

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


class RouterLink(Protocol):
    """A router's way to verifiers and drafters, named by base URI (SDCP Table 1, and the
    extensions of docs/interpretations.md).

    Each raises ``sdcp.protocol.problems.ProtocolError`` for a problem answer and
    ``sdcp.engines.errors.Unanswered`` when no usable answer came (the peer is unreachable, timed
    out, failed, or answered outside the protocol).
    """

    async def open_session(self, verifier: str, message: SessionOpen, *, timeout: float) -> SessionState:
        """POST sessions at a verifier (SDCP 6.1, 6.9 with ``resume``)."""
        ...

    async def inform_verifier(self, verifier: str, assignment: Assignment) -> SessionState:
        """PUT sessions/{id}/drafter (SDCP 6.1: the verifier hears of the drafter first)."""
        ...

    async def assign(self, drafter: str, assignment: Assignment) -> None:
        """POST assignments at a drafter (SDCP 6.1)."""
        ...

    async def policy(self, verifier: str, policy: Policy) -> SessionState:
        """POST sessions/{id}/policy (SDCP 6.6)."""
        ...

    async def self_decode(self, verifier: str, request: SelfDecodeRequest) -> SessionState:
        """POST sessions/{id}/self-decode (extension)."""
        ...

    async def cancel(self, verifier: str, request: CancelRequest) -> SessionState:
        """POST sessions/{id}/cancel (extension)."""
        ...
