"""TLS 1.3 contexts for SDCP listeners and clients (SDCP 5.1: TLS 1.3 with mutual authentication)."""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["ALPN_H2", "ALPN_HTTP1", "client_context", "server_context"]

ALPN_H2 = "h2"
ALPN_HTTP1 = "http/1.1"

PathLike = Path | str


def server_context(
    cert: PathLike,
    key: PathLike,
    ca: PathLike | None,
    *,
    require_client_cert: bool = True,
    allow_http1: bool = False,
) -> ssl.SSLContext:
    """A server context: TLS 1.3 only, client certificate required and verified against ``ca``.

    ``require_client_cert=False`` (with ``ca=None`` allowed) is for the OpenAI-compatible front
    end, which is not an SDCP role; SDCP listeners keep the default. ``allow_http1`` adds
    ``http/1.1`` to ALPN for such front ends; SDCP listeners offer ``h2`` only.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # SDCP 5.1: TLS 1.3 is REQUIRED; refusing 1.2 also rules out renegotiation and compression.
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.options |= ssl.OP_NO_COMPRESSION
    context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    if require_client_cert:
        if ca is None:
            raise ValueError("a CA is needed to verify client certificates")
        # SDCP 5.1: mutual certificate authentication is REQUIRED.
        context.verify_mode = ssl.CERT_REQUIRED
    else:
        context.verify_mode = ssl.CERT_NONE
    if ca is not None:
        context.load_verify_locations(cafile=str(ca))
    context.set_alpn_protocols([ALPN_H2, ALPN_HTTP1] if allow_http1 else [ALPN_H2])
    return context


def client_context(cert: PathLike | None, key: PathLike | None, ca: PathLike) -> ssl.SSLContext:
    """A client context: TLS 1.3 only, ALPN ``h2``, server verified against ``ca`` (hostname too).

    ``cert``/``key`` are the client's own certificate; both or neither must be given.
    """
    if (cert is None) != (key is None):
        raise ValueError("give both a client certificate and its key, or neither")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if cert is not None and key is not None:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key))
    context.set_alpn_protocols([ALPN_H2])
    return context
