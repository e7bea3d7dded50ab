"""The operator listener every role can open (``[admin] listen``): plain HTTP/1.1, no certificates.

- ``GET /health``: liveness; 200 while the process serves.
- ``GET /ready``: readiness; 200 when the role can do its work, else 503, with the reason.
- ``GET /metrics``: the Prometheus text format, for scrapers without a client certificate.
- ``GET /version``: the sdcp version and the role (a verifier's: also its model and backend).

and the role's own pages: a verifier's ``/sessions/{hex id}/trace`` (JSON), the router's
``/dashboard``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from sdcp import __version__
from sdcp.transport.metrics import metrics_route
from sdcp.transport.server import FrontEndServer, Listener, Server

__all__ = ["AdminServer", "Readiness"]

log = logging.getLogger("sdcp.admin")


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str


class AdminServer:
    """Serves /health, /ready, /metrics and /version for one role."""

    def __init__(
        self,
        role: str,
        listen: str,
        ready: Callable[[], Awaitable[Readiness]],
        routes: Sequence[BaseRoute] = (),
        *,
        build: Mapping[str, str] | None = None,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self.role = role
        # The role's own operator pages (the verifier's session traces, the router's dashboard).
        self.routes = list(routes)
        self.build = dict(build or {})
        self.listener = Listener.admin(host.strip("[]"), int(port))
        self._ready = ready
        self._server: Server | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return self._server.base_url

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                metrics_route(),
                Route("/version", self.version, methods=["GET"]),
                *self.routes,
            ]
        )

    async def start(self) -> None:
        self._server = FrontEndServer(self.app(), self.listener)
        await self._server.start()
        log.info("%s: admin endpoints on %s", self.role, self._server.base_url)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()

    async def health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": self.role})

    async def ready(self, _request: Request) -> Response:
        readiness = await self._ready()
        body = {"ready": readiness.ready, "role": self.role, "reason": readiness.reason}
        return JSONResponse(body, status_code=200 if readiness.ready else 503)

    async def version(self, _request: Request) -> Response:
        return JSONResponse({"version": __version__, "role": self.role, **self.build})
