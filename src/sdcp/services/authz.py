"""Who may call what: the authorization table of every SDCP endpoint (docs/security.md).

A certificate from the deployment's CA is authentication, not permission. Each endpoint names the
parties that may call it; configured parties come from ``[trust]`` (``sdcp.config.TrustConfig``),
session parties from the session itself (its verifier, its assigned drafter, the front end that
opened it). ``Trust.admit`` is the one check every handler makes; docs/security.md prints ``TABLE``,
and a test keeps the two equal and every route covered.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from starlette.requests import Request

from sdcp.config import ServiceConfig
from sdcp.transport.errors import Forbidden
from sdcp.transport.peer import peer_uri

__all__ = ["TABLE", "Party", "SessionParties", "Trust", "markdown_table"]


class Party(StrEnum):
    """Who an endpoint admits; the value is how docs/security.md names the party."""

    ROUTER = "routers"
    VERIFIER = "verifiers"
    DRAFTER = "drafters"
    FRONT_END = "front ends"
    OPERATOR = "operators"
    INSTANCE = "the instance the path names"
    SESSION_VERIFIER = "the session's verifier"
    SESSION_DRAFTER = "the session's drafter"
    SESSION_OWNER = "the session's front end"


_P = Party

# role -> "METHOD path" -> the parties that may call it.
TABLE: dict[str, dict[str, frozenset[Party]]] = {
    "router": {
        # SDCP 6.1: an instance reports only its own status, and only in a role it is trusted with.
        "PUT instances/{id}/status": frozenset({_P.INSTANCE}),
        "POST events": frozenset({_P.SESSION_VERIFIER}),
        "GET targets": frozenset({_P.FRONT_END, _P.OPERATOR}),
        "POST sessions": frozenset({_P.FRONT_END}),
        "GET sessions/{id}": frozenset({_P.SESSION_OWNER, _P.OPERATOR}),
        "POST sessions/{id}/policy": frozenset({_P.SESSION_OWNER}),
        "POST sessions/{id}/cancel": frozenset({_P.SESSION_OWNER}),
        "GET metrics": frozenset({_P.OPERATOR}),
    },
    "verifier": {
        "POST sessions": frozenset({_P.ROUTER}),
        "PUT sessions/{id}/drafter": frozenset({_P.ROUTER}),
        # SDCP 6.3: otherwise 403 sdcp-not-assigned (the protocol core's check).
        "POST proposals": frozenset({_P.SESSION_DRAFTER}),
        "GET sessions/{id}/output": frozenset({_P.ROUTER, _P.SESSION_OWNER, _P.SESSION_DRAFTER, _P.OPERATOR}),
        # Each read as its GET sessions/{id}/output (docs/interpretations.md, "Output reads of many sessions").
        "POST outputs": frozenset({_P.ROUTER, _P.SESSION_OWNER, _P.SESSION_DRAFTER, _P.OPERATOR}),
        "POST sessions/{id}/policy": frozenset({_P.ROUTER}),
        "GET sessions/{id}/stats": frozenset({_P.ROUTER, _P.SESSION_OWNER, _P.OPERATOR}),
        "GET sessions/{id}/trace": frozenset({_P.ROUTER, _P.SESSION_OWNER, _P.OPERATOR}),
        "POST sessions/{id}/self-decode": frozenset({_P.ROUTER}),
        "POST sessions/{id}/cancel": frozenset({_P.ROUTER, _P.SESSION_OWNER}),
        "GET metrics": frozenset({_P.OPERATOR}),
    },
    "drafter": {
        "POST assignments": frozenset({_P.ROUTER}),
        "GET metrics": frozenset({_P.OPERATOR}),
    },
    "mlc": {
        "GET objects": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER, _P.OPERATOR}),
        "HEAD objects": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER, _P.OPERATOR}),
        # By kind besides: draft rows by drafters (the lease holder while leased), committed tokens
        # by routers, other objects by routers and verifiers, logs never (sdcp.services.mlc).
        "PUT objects": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER}),
        "DELETE objects": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER}),
        "GET leases": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER}),
        "POST leases": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER}),
        "POST leases/renew": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER}),
        "POST leases/release": frozenset({_P.ROUTER, _P.VERIFIER, _P.DRAFTER}),
        "GET logs": frozenset({_P.ROUTER, _P.VERIFIER, _P.OPERATOR}),
        # Only commit records naming the caller as writer, one verifier per epoch.
        "POST logs/append": frozenset({_P.VERIFIER}),
        "POST logs/fence": frozenset({_P.ROUTER}),
        "GET metrics": frozenset({_P.OPERATOR}),
    },
}


@dataclass(frozen=True)
class SessionParties:
    """The identities a session gives rights to; None where the session has none (yet)."""

    verifier: str | None = None
    drafter: str | None = None
    owner: str | None = None


class Trust:
    """The configured parties of one instance, and the check of ``TABLE``."""

    def __init__(
        self,
        role: str,
        *,
        routers: Iterable[str],
        verifiers: Iterable[str] = (),
        drafters: Iterable[str] = (),
        front_ends: Iterable[str] = (),
        operators: Iterable[str] = (),
    ) -> None:
        self.role = role
        listed = {
            Party.ROUTER: tuple(routers),
            Party.VERIFIER: tuple(verifiers),
            Party.DRAFTER: tuple(drafters),
            Party.FRONT_END: tuple(front_ends),
            Party.OPERATOR: tuple(operators),
        }
        self.members: dict[Party, frozenset[str]] = {
            party: frozenset(entry for entry in entries if "*" not in entry) for party, entries in listed.items()
        }
        # Entries with a * (sdcp.config's trust patterns): a new instance of a role joins with a
        # certificate from the CA alone, without an edit of every peer's list.
        self.patterns: dict[Party, tuple[re.Pattern[str], ...]] = {
            party: tuple(_pattern(entry) for entry in entries if "*" in entry) for party, entries in listed.items()
        }

    @classmethod
    def from_config(cls, config: ServiceConfig, role: str) -> Trust:
        """``[trust]``; routers default to the instance's own ``[instance] router`` (or itself)."""
        trust = config.trust
        routers = trust.routers or config.instance.routers
        if role == "router":
            routers = (config.instance.uri,)
        return cls(
            role,
            routers=routers,
            verifiers=trust.verifiers,
            drafters=trust.drafters,
            front_ends=trust.front_ends,
            operators=trust.operators,
        )

    def parties(self, endpoint: str) -> frozenset[Party]:
        try:
            return TABLE[self.role][endpoint]
        except KeyError:
            raise KeyError(f"{endpoint!r} of the {self.role} is not in the authorization table") from None

    def admits(
        self, peer: str, endpoint: str, session: SessionParties | None = None, *, instance: str | None = None
    ) -> bool:
        for party in self.parties(endpoint):
            if self.is_member(peer, party):
                return True
            if party is Party.INSTANCE and peer == instance:
                return True
            if session is not None and peer == _session_member(session, party):
                return True
        return False

    def admit(
        self, request: Request, endpoint: str, session: SessionParties | None = None, *, instance: str | None = None
    ) -> str:
        """The authenticated peer of ``request`` if ``endpoint`` admits it; otherwise 403."""
        peer = peer_uri(request)
        if peer is None:
            raise Forbidden("no authenticated client certificate with a URI SAN")
        if not self.admits(peer, endpoint, session, instance=instance):
            raise Forbidden(f"{peer} may not call {endpoint} here")
        return peer

    def is_member(self, peer: str, party: Party) -> bool:
        if peer in self.members.get(party, frozenset()):
            return True
        return any(pattern.fullmatch(peer) for pattern in self.patterns.get(party, ()))


def _pattern(entry: str) -> re.Pattern[str]:
    """A trust pattern as a regular expression: its * stands for one or more letters, digits or
    hyphens, so that it never reaches past its DNS label (no dot, colon or slash); the rest is literal."""
    before, _, after = entry.partition("*")
    return re.compile(re.escape(before) + "[A-Za-z0-9-]+" + re.escape(after))


def _session_member(session: SessionParties, party: Party) -> str | None:
    if party is Party.SESSION_VERIFIER:
        return session.verifier
    if party is Party.SESSION_DRAFTER:
        return session.drafter
    if party is Party.SESSION_OWNER:
        return session.owner
    return None


def markdown_table() -> str:
    """``TABLE`` as docs/security.md prints it."""
    lines = ["| role | endpoint | who may call it |", "|---|---|---|"]
    for role, endpoints in TABLE.items():
        for endpoint, parties in endpoints.items():
            names = ", ".join(party.value for party in Party if party in parties)
            lines.append(f"| {role} | `{endpoint}` | {names} |")
    return "\n".join(lines) + "\n"
