"""The router's live dashboard on its admin listener: ``/dashboard`` (one HTML page with a small
script, no build step) and ``/dashboard/state`` (the JSON it polls every second).

The admin listener asks for no credentials (docs/security.md, "Admin listeners"), so the state holds
no session content and no identifier a client chose or could look up: no prompt, output, text or
token ids, no session or request id and no per-round trace, only counts (instances' load and rates;
per session its committed tokens, rounds, escalations and acceptance), each session under a key
that this router process alone can link to it. The instances' figures are the router's own; what a
session did it asks the session's verifier (its stats), as the router may (docs/security.md), at
most once per ``REFRESH_S`` whoever asks and however often: an anonymous request never makes the
router call a verifier beyond that refresh.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from sdcp.engines.router import SELF_DECODING_AT
from sdcp.protocol.messages import Role, session_path_id
from sdcp.protocol.router import InstanceRegistry, InstanceView, measured_acceptance
from sdcp.transport.client import PeerClients

__all__ = ["REFRESH_S", "Dashboard", "SessionView"]

log = logging.getLogger("sdcp.dashboard")

# Sessions the page shows: the live ones first, then the most recently ended, this many in all.
MAX_SESSIONS = 24
# How long the router waits for a verifier's answer about one session.
_ASK_TIMEOUT_S = 2.0
# The sessions' figures are asked of their verifiers at most this often (two requests a session,
# for at most MAX_SESSIONS sessions); requests in between are answered from the last refresh.
REFRESH_S = 2.0


class SessionView(Protocol):
    """What the dashboard reads of a router's tracked session."""

    @property
    def session(self) -> bytes: ...

    @property
    def verifier(self) -> str: ...

    @property
    def drafter(self) -> str | None: ...

    @property
    def ended(self) -> bool: ...

    @property
    def opened_at(self) -> float: ...

    @property
    def request(self) -> str | None: ...


class Dashboard:
    """The dashboard's two routes over a router's registry and sessions."""

    def __init__(
        self,
        *,
        registry: InstanceRegistry,
        sessions: Callable[[], Sequence[SessionView]],
        peers: PeerClients,
        clock: Callable[[], float],
        expected_rates: Callable[[], dict[str, float]],
        target_splits: Callable[[], dict[str, dict[str, list[str]]]] = dict,
    ) -> None:
        self.registry = registry
        # Models whose live verifiers advertise different target digests (no failover between them).
        self.target_splits = target_splits
        self.sessions = sessions
        self.peers = peers
        self.clock = clock
        # The router's cost model: expected tokens per second by option (a drafter's URI, or
        # "self-decoding at <verifier>").
        self.expected_rates = expected_rates
        # The sessions' figures of the last refresh, when it was (self.clock) and its wall time.
        self._sessions: list[dict[str, Any]] = []
        self._refreshed_at: float | None = None
        self._refreshed_wall = 0.0
        # One refresh at a time: requests that arrive during one wait for it instead of starting more.
        self._refreshing = asyncio.Lock()
        # Keys the page tells sessions apart by, which name nothing outside this process.
        self._key_salt = secrets.token_bytes(16)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/dashboard", self.page, methods=["GET"]),
            Route("/dashboard/state", self.state, methods=["GET"]),
        ]

    async def page(self, _request: Request) -> Response:
        return HTMLResponse(resources.files("sdcp.services").joinpath("dashboard.html").read_text(encoding="utf-8"))

    async def state(self, _request: Request) -> Response:
        sessions, sessions_time = await self._recent_sessions()
        now = self.clock()
        views = self.registry.live(Role.VERIFIER, now) + self.registry.live(Role.DRAFTER, now)
        rates = self.expected_rates()
        tracked = self.sessions()
        live = sum(1 for s in tracked if not s.ended)
        return JSONResponse(
            {
                "time": time.time(),
                "instances": [self._instance(view, now, rates) for view in sorted(views, key=lambda v: v.uri)],
                # Every session the router tracks, and the figures of the latest MAX_SESSIONS as of
                # sessions_time (the last refresh).
                "sessions_live": live,
                "sessions_ended": len(tracked) - live,
                "sessions_time": sessions_time,
                "sessions": sessions,
                "target_splits": self.target_splits(),
            }
        )

    async def _recent_sessions(self) -> tuple[list[dict[str, Any]], float]:
        """The latest sessions' figures, asked of their verifiers at most once per REFRESH_S."""
        async with self._refreshing:
            if self._refreshed_at is None or self.clock() - self._refreshed_at >= REFRESH_S:
                chosen = sorted(self.sessions(), key=lambda s: (s.ended, -s.opened_at))[:MAX_SESSIONS]
                self._sessions = list(await asyncio.gather(*(self._session(view) for view in chosen)))
                self._refreshed_at, self._refreshed_wall = self.clock(), time.time()
            return self._sessions, self._refreshed_wall

    def _instance(self, view: InstanceView, now: float, rates: dict[str, float]) -> dict[str, Any]:
        status = view.status
        key = view.uri if status.role == Role.DRAFTER else f"{SELF_DECODING_AT}{view.uri}"
        rate = rates.get(key)
        self_rates = [r for option, r in rates.items() if option.startswith(SELF_DECODING_AT)]
        best_alone = max(self_rates, default=None)
        return {
            "uri": view.uri,
            "role": status.role.name.lower(),
            "load": status.load,
            "queue": status.queue,
            "ttl_s": round(max(0.0, view.expires_at - now), 1),
            "acceptance": measured_acceptance(view) if status.role == Role.DRAFTER else None,
            "expected_tokens_per_s": None if rate is None else round(rate, 1),
            # A drafter's expected rate over the fastest verifier decoding alone.
            "expected_speedup": (
                round(rate / best_alone, 2) if rate is not None and best_alone and status.role == Role.DRAFTER else None
            ),
            # A verifier's model, runtime and the target digest its sessions' contracts name.
            "model": status.model_name,
            "backend": status.backend,
            "target": None if status.role == Role.DRAFTER or status.model is None else status.model.hex(),
        }

    async def _session(self, view: SessionView) -> dict[str, Any]:
        """A session's counts; never its prompt, output, text, token ids, id or trace."""
        entry: dict[str, Any] = {
            "key": hmac.new(self._key_salt, view.session, hashlib.sha256).hexdigest()[:8],
            "verifier": view.verifier,
            "drafter": view.drafter,
            "ended": view.ended,
            "opened_at": view.opened_at,
        }
        verifier = self.peers.get(view.verifier)
        path = f"sessions/{session_path_id(view.session)}"
        try:
            async with asyncio.timeout(_ASK_TIMEOUT_S):
                _, stats = await verifier.get_cbor(f"{path}/stats")
                if not isinstance(stats, dict):
                    raise TypeError("its stats are not a map")
                committed = int(stats.get("committed", 0))
                proposed, accepted = int(stats.get("proposed", 0)), int(stats.get("accepted", 0))
        except Exception as exc:  # noqa: BLE001 - a verifier that forgot or lost the session
            entry["error"] = f"the verifier did not describe the session: {exc}"
            return entry
        entry |= {
            "committed": committed,
            "m_cap": stats.get("m_cap"),
            "rounds": stats.get("rounds"),
            "self_decoded": stats.get("self_decoded"),
            "escalations": stats.get("escalations"),
            "escalated": stats.get("escalated"),
            "acceptance": round(accepted / proposed, 3) if proposed else None,
        }
        return entry
