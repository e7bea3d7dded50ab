"""Peer identity: the authenticated client certificate, carried into the ASGI scope.

``sdcp.transport.h2server`` puts each connection's ``PeerTLS`` into ``scope["extensions"]["tls"]``
(the ASGI TLS extension, plus ``peer_uri``); ``peer_tls`` and ``peer_uri`` read it back.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from starlette.requests import HTTPConnection

from sdcp.transport.certs import uri_sans

__all__ = [
    "PeerTLS",
    "peer_tls",
    "peer_uri",
]

# ASGI TLS extension: tls_version is the TLS protocol number.
_TLS_VERSION_NUMBERS = {"TLSv1.2": 0x0303, "TLSv1.3": 0x0304}


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
        version, alpn = ssl_object.version(), ssl_object.selected_alpn_protocol()
        if der is None or ssl_object.context.verify_mode == ssl.CERT_NONE:
            return cls(version, alpn, der, None)
        return cls.from_certificate(der, version, alpn)

    @classmethod
    def from_certificate(cls, der: bytes, tls_version: str | None, alpn_protocol: str | None) -> PeerTLS:
        """A connection whose peer verifiably holds the certificate ``der``."""
        uris = uri_sans(x509.load_der_x509_certificate(der))
        # An identity must be unambiguous: a certificate with several URI SANs names nobody.
        return cls(tls_version, alpn_protocol, der, uris[0] if len(uris) == 1 else None)

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
