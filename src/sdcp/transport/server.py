"""Serving an ASGI app: the SDCP listener and the front end's (SDCP 5.1).

``MTLSServer`` serves a ``Listener.mtls``, the listener every SDCP role uses: HTTP/2 over TLS 1.3
with client certificates, on ``sdcp.transport.h2server``. ``FrontEndServer`` serves a
``Listener.front_end``, for the OpenAI-compatible front end, which is not an SDCP role: TLS without
client certificates, or plain HTTP restricted to loopback, on hypercorn (HTTP/1.1 and HTTP/2).
``server_for`` picks the one a listener needs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import cast

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.config import Config
from hypercorn.typing import ASGIFramework
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sdcp.transport.asgi import DrainRequestBody
from sdcp.transport.h2fix import install_h2_closed_connection_fix, install_hypercorn_connection_tracking
from sdcp.transport.h2server import DEFAULT_MAX_BODY_BYTES, H2Listener
from sdcp.transport.tls import server_context

__all__ = ["FrontEndServer", "Listener", "MTLSServer", "Server", "ServerStartError", "server_for"]

# hypercorn's default (1000) ends every connection with GOAWAY after that many requests; SDCP peers
# keep one connection each and send a request per round, so the limit is set far higher.
DEFAULT_KEEP_ALIVE_MAX_REQUESTS = 1_000_000
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 75.0
DEFAULT_MAX_CONCURRENT_STREAMS = 256
DEFAULT_GRACEFUL_TIMEOUT_S = 5.0
_STARTUP_TIMEOUT_S = 30.0
_SHUTDOWN_POLL_S = 0.02


class ServerStartError(RuntimeError):
    """The server could not start (bind failure, application startup failure)."""


@dataclass(frozen=True)
class Listener:
    """Where and how a server listens. Build one with ``mtls`` or ``front_end``."""

    host: str
    port: int
    ssl_context: ssl.SSLContext | None
    require_http2: bool
    keep_alive_max_requests: int = DEFAULT_KEEP_ALIVE_MAX_REQUESTS
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS
    graceful_timeout_s: float = DEFAULT_GRACEFUL_TIMEOUT_S
    # Request bodies past this are answered 413 while they arrive (the mTLS listener).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    @classmethod
    def mtls(
        cls,
        host: str,
        port: int,
        *,
        cert: Path | str,
        key: Path | str,
        ca: Path | str,
        keep_alive_max_requests: int = DEFAULT_KEEP_ALIVE_MAX_REQUESTS,
        keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> Listener:
        """The SDCP listener: HTTP/2 over TLS 1.3, client certificate required (SDCP 5.1)."""
        return cls(
            host,
            port,
            server_context(cert, key, ca),
            require_http2=True,
            keep_alive_max_requests=keep_alive_max_requests,
            keep_alive_timeout_s=keep_alive_timeout_s,
            max_concurrent_streams=max_concurrent_streams,
            max_body_bytes=max_body_bytes,
        )

    @classmethod
    def front_end(
        cls, host: str, port: int, *, cert: Path | str | None = None, key: Path | str | None = None
    ) -> Listener:
        """A listener for non-SDCP clients: TLS 1.3 without client certificates when ``cert`` and
        ``key`` are given (HTTP/1.1 and HTTP/2), otherwise plain HTTP, allowed on loopback only."""
        if (cert is None) != (key is None):
            raise ValueError("give both a certificate and its key, or neither")
        if cert is not None and key is not None:
            context = server_context(cert, key, None, require_client_cert=False, allow_http1=True)
            return cls(host, port, context, require_http2=False)
        if not _is_loopback(host):
            raise ValueError(f"plain HTTP is only allowed on a loopback address, not {host!r}")
        return cls(host, port, None, require_http2=False)

    @classmethod
    def admin(cls, host: str, port: int) -> Listener:
        """The operator listener: plain HTTP/1.1 on any address, for probes and scrapers that carry
        no certificate (health, readiness, metrics; no session content)."""
        return cls(host, port, None, require_http2=False)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"


class Server(ABC):
    """One server for one listener, started and stopped from asyncio.

    Use ``async with server_for(app, listener) as server:`` (``server.port`` is the bound port,
    also when the listener asked for port 0), or ``await server.run_until(event)``.
    """

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server is not started")
        return self._port

    @property
    def base_url(self) -> str:
        host = self.listener.host
        if ":" in host:
            host = f"[{host}]"
        return f"{self.listener.scheme}://{host}:{self.port}/"

    async def start(self) -> None:
        if self._port is not None:
            raise RuntimeError("server already started")
        # We bind ourselves, so that port 0 yields a port we can report.
        try:
            family = socket.AF_INET6 if ":" in self.listener.host else socket.AF_INET
            sock = socket.create_server((self.listener.host, self.listener.port), family=family)
        except OSError as error:
            raise ServerStartError(f"cannot listen on {self.listener.host}:{self.listener.port}: {error}") from error
        self._port = sock.getsockname()[1]
        try:
            await self._serve(sock)
        except BaseException:
            self._port = None
            raise

    @abstractmethod
    async def _serve(self, sock: socket.socket) -> None:
        """Serve on the bound socket, which this call owns; return once the app has started."""

    @abstractmethod
    async def stop(self) -> None:
        """Graceful shutdown: stop accepting, let requests in flight finish (bounded), close."""

    async def run_until(self, shutdown: asyncio.Event) -> None:
        async with self:
            await shutdown.wait()

    async def __aenter__(self) -> Server:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


class MTLSServer(Server):
    """The SDCP listener of a role, on ``sdcp.transport.h2server`` (HTTP/2 only; HTTP/1.1 gets 505)."""

    def __init__(self, app: ASGIApp, listener: Listener) -> None:
        if not listener.require_http2 or listener.ssl_context is None:
            raise ValueError("an mTLS server serves a Listener.mtls")
        super().__init__(listener)
        self._h2 = H2Listener(
            app,
            listener.ssl_context,
            max_concurrent_streams=listener.max_concurrent_streams,
            keep_alive_max_requests=listener.keep_alive_max_requests,
            keep_alive_timeout_s=listener.keep_alive_timeout_s,
            max_body_bytes=listener.max_body_bytes,
        )
        self._running = False

    async def _serve(self, sock: socket.socket) -> None:
        failure = await self._h2.start(sock, startup_timeout_s=_STARTUP_TIMEOUT_S)
        if failure is not None:
            raise ServerStartError(f"application startup failed: {failure}")
        self._running = True

    async def stop(self) -> None:
        if self._running:
            self._running = False
            await self._h2.stop(self.listener.graceful_timeout_s, _SHUTDOWN_POLL_S)


class FrontEndServer(Server):
    """The front end's listener, on hypercorn."""

    def __init__(self, app: ASGIApp, listener: Listener) -> None:
        if listener.require_http2:
            raise ValueError("a front-end server serves a Listener.front_end")
        install_hypercorn_connection_tracking()
        install_h2_closed_connection_fix()
        super().__init__(listener)
        self._requests = _RequestsInFlight(DrainRequestBody(app))
        self._startup = _StartupSignal(self._requests)
        self._shutdown = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._config: _ListenerConfig

    async def _serve(self, sock: socket.socket) -> None:
        # hypercorn gets a duplicate of the descriptor (``fd://``), which it owns and closes.
        with sock:
            handed_over = sock.dup()
        self._config = _ListenerConfig(self.listener, handed_over.detach())
        # hypercorn types the scope and the messages as TypedDicts, starlette as MutableMappings:
        # the same dicts at run time, but neither type accepts the other.
        app = cast(ASGIFramework, self._startup)
        self._task = asyncio.create_task(
            hypercorn_serve(app, self._config, shutdown_trigger=self._shutdown.wait, mode="asgi"),
            name=f"sdcp-server-{self._port}",
        )
        await self._wait_started()

    async def stop(self) -> None:
        """hypercorn alone would wait for every peer to close its idle keep-alive connection, and a
        TLS connection closes only after the peer's close_notify; so after the requests in flight
        have finished and their answers have been written, the remaining connections are closed here.
        """
        if self._task is None:
            return
        task, self._task = self._task, None
        self._shutdown.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.listener.graceful_timeout_s
        # Repeated until hypercorn has finished: a connection accepted just before the listening
        # socket closed is registered only after the first pass.
        while not task.done():
            if loop.time() >= deadline:
                _abort(self._config.sdcp_open_connections)
            elif self._requests.idle:
                _abort(c for c in self._config.sdcp_open_connections if _flushed(c))
            await asyncio.wait({task}, timeout=_SHUTDOWN_POLL_S)
        await task

    async def _wait_started(self) -> None:
        assert self._task is not None
        started = asyncio.create_task(self._startup.started.wait())
        done, _ = await asyncio.wait(
            {started, self._task}, timeout=_STARTUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if started not in done:
            started.cancel()
            task, self._task = self._task, None
            if task.done():
                raise ServerStartError(f"server stopped during startup: {task.exception()!r}")
            task.cancel()
            raise ServerStartError(f"application did not start within {_STARTUP_TIMEOUT_S} s")
        if self._startup.failed is not None:
            task, self._task = self._task, None
            # hypercorn ends serve() with the lifespan failure; it is reported as ServerStartError.
            await asyncio.gather(task, return_exceptions=True)
            raise ServerStartError(f"application startup failed: {self._startup.failed}")


def server_for(app: ASGIApp, listener: Listener) -> Server:
    """The server a listener needs: ``MTLSServer`` for ``Listener.mtls``, else ``FrontEndServer``."""
    return MTLSServer(app, listener) if listener.require_http2 else FrontEndServer(app, listener)


class _ListenerConfig(Config):
    """hypercorn configuration with our own TLS 1.3 context instead of hypercorn's TLS 1.2+ one."""

    def __init__(self, listener: Listener, fd: int) -> None:
        super().__init__()
        self._listener_ssl_context = listener.ssl_context
        self.bind = [f"fd://{fd}"]
        self.keep_alive_max_requests = listener.keep_alive_max_requests
        self.keep_alive_timeout = listener.keep_alive_timeout_s
        self.h2_max_concurrent_streams = listener.max_concurrent_streams
        self.graceful_timeout = listener.graceful_timeout_s
        self.errorlog = logging.getLogger("sdcp.transport.hypercorn")
        self.accesslog = None
        self.sdcp_open_connections: set[TCPServer] = set()

    @property
    def ssl_enabled(self) -> bool:
        return self._listener_ssl_context is not None

    def create_ssl_context(self) -> ssl.SSLContext | None:
        return self._listener_ssl_context


class _StartupSignal:
    """Passes the app through and notes when its lifespan startup has finished."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.started = asyncio.Event()
        self.failed: str | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def watching_send(message: Message) -> None:
            # Noted before sending: hypercorn raises from send() on a startup failure.
            if message["type"] == "lifespan.startup.failed":
                self.failed = str(message.get("message", ""))
            if message["type"] in ("lifespan.startup.complete", "lifespan.startup.failed"):
                self.started.set()
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            # An app without lifespan support returns or raises at once; it is ready anyway.
            self.started.set()


class _RequestsInFlight:
    """Counts HTTP requests being handled, so that shutdown knows when they are all answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self._active -= 1

    @property
    def idle(self) -> bool:
        return self._active == 0


def _flushed(connection: TCPServer) -> bool:
    # A transport closed twice (the peer went first) has no buffer left to ask about.
    transport = connection.writer.transport
    return transport.is_closing() or transport.get_write_buffer_size() == 0


def _abort(connections: Iterable[TCPServer]) -> None:
    # abort(), not close(): close() on TLS waits for the peer's close_notify.
    for connection in list(connections):
        connection.writer.transport.abort()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
