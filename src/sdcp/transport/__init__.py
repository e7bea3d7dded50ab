"""Transport for every SDCP role: HTTP/2 over TLS 1.3 with mutual certificate authentication (SDCP 5.1).

- ``certs``: development CA and per-instance certificates (URI SAN = instance base URI)
- ``tls``: TLS 1.3 server and client contexts
- ``server``: listeners (``Listener.mtls``, ``Listener.front_end``) and their servers (``MTLSServer``,
  ``FrontEndServer``, ``server_for``)
- ``h2server``: the HTTP/2 server of mTLS listeners (the front end's is hypercorn)
- ``peer``: the authenticated peer URI of a request (``peer_uri``)
- ``asgi``: CBOR and problem responses, the body reader, error handlers, ``require_peer``
- ``client``: ``SDCPClient`` (one HTTP/2 connection per peer) and ``PeerClients``
- ``h2conn``: that connection, on the ``h2`` protocol library and asyncio's TLS transport
- ``metrics``: the ``/metrics`` route
"""

from sdcp.transport.asgi import cbor_response, exception_handlers, problem_response, read_cbor_body, require_peer
from sdcp.transport.certs import create_ca, instance_name, issue, make_certs
from sdcp.transport.client import PeerClients, RetryPolicy, SDCPClient
from sdcp.transport.errors import (
    ClientCertificateRejected,
    ConnectionLost,
    Forbidden,
    HTTPProblem,
    PayloadTooLarge,
    PeerClientError,
    PeerServerError,
    PeerTimeout,
    StatusError,
    TLSFailure,
    TransportError,
    UnexpectedResponse,
    UnsupportedMediaType,
)
from sdcp.transport.metrics import metrics_route
from sdcp.transport.peer import peer_uri
from sdcp.transport.server import FrontEndServer, Listener, MTLSServer, Server, ServerStartError, server_for
from sdcp.transport.tls import client_context, server_context

__all__ = [
    "ClientCertificateRejected",
    "ConnectionLost",
    "Forbidden",
    "HTTPProblem",
    "FrontEndServer",
    "Listener",
    "MTLSServer",
    "PayloadTooLarge",
    "PeerClientError",
    "PeerClients",
    "PeerServerError",
    "PeerTimeout",
    "RetryPolicy",
    "SDCPClient",
    "Server",
    "ServerStartError",
    "server_for",
    "StatusError",
    "TLSFailure",
    "TransportError",
    "UnexpectedResponse",
    "UnsupportedMediaType",
    "cbor_response",
    "client_context",
    "create_ca",
    "exception_handlers",
    "instance_name",
    "issue",
    "make_certs",
    "metrics_route",
    "peer_uri",
    "problem_response",
    "read_cbor_body",
    "require_peer",
    "server_context",
]
