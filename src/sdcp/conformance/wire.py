"""HTTP/2 over TLS 1.3 with client certificates (SDCP 5.1), bodies in the kit's own CBOR.

The transport is the project's (`sdcp.transport`): it moves bytes and checks no SDCP value. What
the kit checks it decodes itself: CBOR with `sdcp.conformance.cbor`, problem details as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from cryptography import x509

from sdcp.conformance import cbor
from sdcp.transport.certs import uri_sans
from sdcp.transport.h2conn import H2Connection
from sdcp.transport.tls import client_context

__all__ = ["SDCP_CBOR", "Answer", "Identity", "Peer"]

SDCP_CBOR = "application/sdcp+cbor"  # SDCP 5.1
_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Identity:
    """A played role: its certificate, key, and the base URI its certificate names (URI SAN)."""

    cert: Path
    key: Path
    uri: str

    @classmethod
    def from_files(cls, cert: Path, key: Path) -> Identity:
        names = uri_sans(x509.load_pem_x509_certificate(Path(cert).read_bytes()))
        if len(names) != 1:
            raise ValueError(f"{cert}: a played identity's certificate names one URI, it names {names}")
        return cls(Path(cert), Path(key), names[0].rstrip("/"))


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def value(self) -> Any:
        """The CBOR body; raises `cbor.CBORError` when it is not one CBOR item."""
        return cbor.decode(self.body)

    def problem(self) -> dict[str, Any] | None:
        """The RFC 9457 body when it is JSON with a `type`, else None."""
        try:
            body = json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return body if isinstance(body, dict) else None

    def problem_type(self) -> str | None:
        """The problem type's suffix (`sdcp-stale-base`), or the whole type when it has none."""
        problem = self.problem()
        kind = problem.get("type") if problem is not None else None
        if not isinstance(kind, str):
            return None
        return kind.replace("/", ":").rsplit(":", 1)[-1] if "sdcp-" in kind else kind

    def __str__(self) -> str:
        if self.content_type.startswith(SDCP_CBOR):
            try:
                shown = repr(self.value())
            except cbor.CBORError:
                shown = f"{len(self.body)} bytes that are not CBOR"
        else:
            shown = self.body[:300].decode("utf-8", "replace")
        return f"{self.status} {self.content_type or '(no content-type)'} {shown[:400]}"


class Peer:
    """One connection to an SDCP role's base URI, authenticated as `identity`."""

    def __init__(self, base: str, identity: Identity, ca: Path) -> None:
        self.base = base.rstrip("/")
        self.identity = identity
        self.ca = ca
        self._connection: H2Connection | None = None

    async def _open(self) -> H2Connection:
        if self._connection is None or not self._connection.usable:
            parts = urlsplit(self.base)
            context = client_context(self.identity.cert, self.identity.key, self.ca)
            self._connection = await H2Connection.open(
                parts.hostname or "", parts.port or 443, context, timeout=_TIMEOUT_S, identity=self.base
            )
        return self._connection

    async def request(
        self,
        method: str,
        path: str,
        value: Any = None,
        *,
        raw: bytes | None = None,
        content_type: str = SDCP_CBOR,
        query: dict[str, Any] | None = None,
        timeout: float = _TIMEOUT_S,
    ) -> Answer:
        body = raw if raw is not None else (cbor.encode(value) if value is not None else None)
        headers = [(b"accept", f"{SDCP_CBOR}, application/problem+json".encode())]
        if body is not None:
            headers.append((b"content-type", content_type.encode()))
        target = urlsplit(self.base).path + "/" + path + (f"?{urlencode(query)}" if query else "")
        response = await (await self._open()).request(method, target, headers, body, timeout=timeout)
        return Answer(response.status, response.headers.get("content-type", ""), response.content)

    async def close(self) -> None:
        if self._connection is not None:
            await self._connection.close()
            self._connection = None
