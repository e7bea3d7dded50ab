"""Peer identity: the authenticated client certificate, carried into the ASGI scope.

hypercorn 0.18 puts no TLS information in the ASGI scope. Each accepted connection runs as its own
asyncio task (``TCPServer.run``), and the tasks that run the application for that connection are
created from it, so they inherit its ``contextvars`` context. We wrap ``TCPServer.run`` to record
the connection's TLS details in a ContextVar, and ``TLSScopeMiddleware`` copies them into
``scope["extensions"]["tls"]`` (the ASGI TLS extension, plus ``peer_uri``).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from hypercorn.asyncio.tcp_server import TCPServer
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

from sdcp.transport.certs import uri_sans

__all__ = [
    "CONNECTIONS_ATTRIBUTE",
    "PeerTLS",
    "TLSScopeMiddleware",
    "install_hypercorn_tls_hook",
    "peer_tls",
    "peer_uri",
]

# ASGI TLS extension: tls_version is the TLS protocol number.
_TLS_VERSION_NUMBERS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}
_HOOK_MARKER = "__sdcp_tls_hook__"
CONNECTIONS_ATTRIBUTE = "sdcp_open_connections"


@dataclass(frozen=True)
class PeerTLS:
    """What one TLS connection tells about its peer."""

    tls_version: str | None
    alpn_protocol: str | None
    client_cert_der: bytes | None
    peer_uri: str | None

    @classmethod
    def from_ssl_object(cls, ssl_object: ssl.SSLObject) -> PeerTLS:
        # getpeercert(binary_form=True) returns a certificate only when the handshake verified it
        # (CERT_REQUIRED) or one was offered (CERT_OPTIONAL); on CERT_NONE listeners it is None.
        der = ssl_object.getpeercert(binary_form=True)
        uri: str | None = None
        if der is not None and ssl_object.context.verify_mode != ssl.CERT_NONE:
            uris = uri_sans(x509.load_der_x509_certificate(der))
            # An identity must be unambiguous: a certificate with several URI SANs names nobody.
            uri = uris[0] if len(uris) == 1 else None
        return cls(ssl_object.version(), ssl_object.selected_alpn_protocol(), der, uri)

    def asgi_extension(self) -> dict[str, Any]:
        chain = [ssl.DER_cert_to_PEM_cert(self.client_cert_der)] if self.client_cert_der else []
        return {
            "tls_version": _TLS_VERSION_NUMBERS.get(self.tls_version or ""),
            "cipher_suite": None,
            "client_cert_chain": chain,
            "client_cert_name": None,
            "client_cert_error": None,
            "server_cert": None,
            "alpn_protocol": self.alpn_protocol,
            "peer_uri": self.peer_uri,
        }


_connection_tls: contextvars.ContextVar[PeerTLS | None] = contextvars.ContextVar("sdcp_connection_tls", default=None)


def install_hypercorn_tls_hook() -> None:
    """Wrap ``TCPServer.run`` once so that each connection records its TLS details (and registers
    itself with its listener, when the listener's config asks for it).

    Fails loudly if hypercorn's connection class no longer looks like the one this was written for.
    """
    original = TCPServer.run
    if getattr(original, _HOOK_MARKER, False):
        return
    init_params = inspect.signature(TCPServer.__init__).parameters
    if "writer" not in init_params or not inspect.iscoroutinefunction(original):
        raise RuntimeError(
            "hypercorn.asyncio.tcp_server.TCPServer changed shape; the peer-certificate hook "
            "in sdcp.transport.peer must be updated (written for hypercorn 0.18.0)"
        )

    @functools.wraps(original)
    async def run_recording_tls(self: TCPServer) -> None:
        ssl_object = self.writer.get_extra_info("ssl_object")
        _connection_tls.set(PeerTLS.from_ssl_object(ssl_object) if ssl_object is not None else None)
        # Listeners of sdcp.transport.server keep a set of their open connections for shutdown.
        connections: set[TCPServer] | None = getattr(self.config, CONNECTIONS_ATTRIBUTE, None)
        if connections is not None:
            connections.add(self)
        try:
            await original(self)
        finally:
            if connections is not None:
                connections.discard(self)

    setattr(run_recording_tls, _HOOK_MARKER, True)
    TCPServer.run = run_recording_tls  # type: ignore[method-assign]


class TLSScopeMiddleware:
    """Copies the connection's TLS details into ``scope["extensions"]["tls"]``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            tls = _connection_tls.get()
            if tls is not None:
                extensions = dict(scope.get("extensions") or {})
                extensions["tls"] = tls.asgi_extension()
                scope = {**scope, "extensions": extensions}
        await self.app(scope, receive, send)


def peer_tls(request_or_scope: HTTPConnection | Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ASGI TLS extension of a request, or None on a connection without TLS."""
    scope = request_or_scope.scope if isinstance(request_or_scope, HTTPConnection) else request_or_scope
    extensions = scope.get("extensions") or {}
    tls = extensions.get("tls")
    return tls if isinstance(tls, Mapping) else None


def peer_uri(request_or_scope: HTTPConnection | Mapping[str, Any]) -> str | None:
    """The URI SAN of the authenticated client certificate (SDCP 6.3 identity), or None."""
    tls = peer_tls(request_or_scope)
    if tls is None:
        return None
    uri = tls.get("peer_uri")
    return uri if isinstance(uri, str) else None
