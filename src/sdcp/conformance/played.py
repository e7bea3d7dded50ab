"""Instances the kit plays as servers: a verifier for a drafter under test, drafters and a verifier
for a router under test. Each listens on its identity's base URI (HTTP/2, TLS 1.3, client
certificates, SDCP 5.1) and hands every request to the running check, which answers it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sdcp.conformance import cbor
from sdcp.conformance.wire import SDCP_CBOR, Identity
from sdcp.transport.peer import peer_uri
from sdcp.transport.server import Listener, MTLSServer

__all__ = ["Exchange", "PlayedInstance", "problem"]


def problem(status: int, suffix: str, detail: str = "") -> tuple[int, str, bytes]:
    """An RFC 9457 answer with an SDCP problem type (Table 2)."""
    body = {"type": f"urn:ietf:params:sdcp:problem:{suffix}", "status": status, "detail": detail}
    return status, "application/problem+json", json.dumps(body).encode()


@dataclass
class Exchange:
    """One request to a played instance, waiting for the check's answer."""

    method: str
    path: str
    query: dict[str, str]
    peer: str | None
    value: Any
    answered: asyncio.Future[tuple[int, str, bytes]] = field(repr=False)

    def answer(self, value: Any = None, status: int = 200) -> None:
        if value is None:
            self.answered.set_result((204 if status == 200 else status, "", b""))
        else:
            self.answered.set_result((status, SDCP_CBOR, cbor.encode(value)))

    def answer_problem(self, status: int, suffix: str, detail: str = "") -> None:
        self.answered.set_result(problem(status, suffix, detail))


class PlayedInstance:
    """A server for `identity` whose requests queue up in `requests` until a check answers them;
    `automatic`, when set, answers what it can (output reads) and returns True for those."""

    def __init__(self, identity: Identity, ca: Path) -> None:
        self.identity = identity
        self.requests: asyncio.Queue[Exchange] = asyncio.Queue()
        self.automatic: Callable[[Exchange], bool] | None = None
        parts = urlsplit(identity.uri)
        listener = Listener.mtls(parts.hostname or "", parts.port or 443, cert=identity.cert, key=identity.key, ca=ca)
        routes = [Route("/{path:path}", self._handle, methods=["GET", "POST", "PUT"])]
        self._server = MTLSServer(Starlette(routes=routes), listener)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()

    async def _handle(self, request: Request) -> Response:
        data = await request.body()
        try:
            value = cbor.decode(data) if data else None
        except cbor.CBORError:
            value = data
        answered: asyncio.Future[tuple[int, str, bytes]] = asyncio.get_running_loop().create_future()
        exchange = Exchange(
            request.method,
            request.url.path.lstrip("/"),
            dict(request.query_params),
            peer_uri(request),
            value,
            answered,
        )
        if self.automatic is None or not self.automatic(exchange):
            await self.requests.put(exchange)
        status, media_type, body = await answered
        return Response(body, status_code=status, media_type=media_type or None)

    async def next(self, timeout: float, *, path_prefix: str = "") -> Exchange | None:
        """The next request whose path starts with `path_prefix`, or None after `timeout` seconds;
        others are answered 404."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (left := deadline - loop.time()) > 0:
            try:
                exchange = await asyncio.wait_for(self.requests.get(), left)
            except TimeoutError:
                return None
            if exchange.path.startswith(path_prefix):
                return exchange
            exchange.answered.set_result(problem(404, "about:blank", f"the kit expects {path_prefix} now"))
        return None
