"""Typed errors of the transport layer.

Client side: everything that is not a problem response carrying an SDCP problem type is a
``TransportError``. Server side: ``HTTPProblem`` is a problem (RFC 9457) raised by the transport
helpers themselves (415, 413, 403, 505, 500); protocol problems are ``sdcp.protocol.problems.ProtocolError``.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

__all__ = [
    "ClientCertificateRejected",
    "ConnectionLost",
    "Forbidden",
    "HTTPProblem",
    "HTTPVersionNotSupported",
    "InternalServerError",
    "PayloadTooLarge",
    "PeerClientError",
    "PeerServerError",
    "PeerTimeout",
    "StatusError",
    "TooManyRequests",
    "TLSFailure",
    "TransportError",
    "UnexpectedResponse",
    "UnsupportedMediaType",
]


class TransportError(Exception):
    """A peer could not be reached or answered outside the protocol."""


class ConnectionLost(TransportError):
    """The connection failed and the request was not (or could not safely be) retried."""


class PeerTimeout(TransportError):
    """The peer did not answer within the configured timeout."""


class TLSFailure(TransportError):
    """The TLS handshake failed (certificate not trusted, version or ALPN mismatch)."""


class ClientCertificateRejected(TLSFailure):
    """The server refused our client certificate.

    In TLS 1.3 the client finishes its handshake before the server checks the client certificate,
    so the refusal arrives as an alert on the first read rather than at connect.
    """


class UnexpectedResponse(TransportError):
    """A 2xx answer whose body is not what SDCP allows (wrong media type, undecodable body)."""


class StatusError(TransportError):
    """A non-2xx answer handled by its status class (RFC 9110 section 15)."""

    def __init__(self, status: int, problem: dict[str, Any] | None, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.problem = problem
        self.detail = detail


class PeerClientError(StatusError):
    """A 4xx answer that carries no SDCP problem: our request was wrong."""


class PeerServerError(StatusError):
    """A 5xx answer: the peer failed."""


class HTTPProblem(Exception):
    """A problem answer produced by the transport helpers (RFC 9457, type ``about:blank``).

    ``retry_after_s``, when set, goes out as the Retry-After header (RFC 9110 10.2.3): a limit that
    will free up.
    """

    status = 500
    title = "Internal Server Error"

    def __init__(self, detail: str | None = None, *, retry_after_s: int | None = None) -> None:
        super().__init__(detail or self.title)
        self.detail = detail
        self.retry_after_s = retry_after_s

    @classmethod
    def for_status(cls, status: int, detail: str | None = None) -> HTTPProblem:
        """A problem for any status, titled with its reason phrase."""
        problem = cls(detail)
        problem.status = status
        try:
            problem.title = HTTPStatus(status).phrase
        except ValueError:
            problem.title = "Error"
        return problem

    def to_problem(self) -> dict[str, Any]:
        # RFC 9457 section 4.2.1: with "about:blank" the title is the status phrase.
        body: dict[str, Any] = {"type": "about:blank", "title": self.title, "status": self.status}
        if self.detail:
            body["detail"] = self.detail
        return body


class Forbidden(HTTPProblem):
    status = 403
    title = "Forbidden"


class NotFound(HTTPProblem):
    status = 404
    title = "Not Found"


class ServiceUnavailable(HTTPProblem):
    """The server cannot answer now; nothing was changed, and the request may be repeated."""

    status = 503
    title = "Service Unavailable"


class TooManyRequests(HTTPProblem):
    """The caller holds as much as its quota allows (docs/security.md)."""

    status = 429
    title = "Too Many Requests"


class PayloadTooLarge(HTTPProblem):
    status = 413
    title = "Content Too Large"


class UnsupportedMediaType(HTTPProblem):
    status = 415
    title = "Unsupported Media Type"


class InternalServerError(HTTPProblem):
    status = 500
    title = "Internal Server Error"


class HTTPVersionNotSupported(HTTPProblem):
    status = 505
    title = "HTTP Version Not Supported"
