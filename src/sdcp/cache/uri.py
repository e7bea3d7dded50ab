"""Object names: any absolute URI on receipt; `mlc://<authority>/<scope-hex>/<kind>/<name>` when we create one.

A `cache-ref` is "URI of an MLC object" (SDCP 5.2) and nothing more: another implementation may
name its objects as it likes, so a received reference is only checked to be an absolute URI
(`check_ref`) and is used verbatim as the storage key; its authority decides which MLC serves it
(`authority_of`, `sdcp.cache.mlc.MLC.serving`).

The objects this implementation creates follow one grammar (`build_uri`, `parse_uri`). The scope
is the contract's 16-byte KVSP scope as 32 lowercase hex characters, or `-` when the contract has
none (SDCP 4.1, `scope`). Kind and name are restricted to URI unreserved characters so that a URI
is its own canonical form and can be used verbatim as a storage key and an HTTP path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from sdcp.cache.errors import InvalidURI

SCHEME = "mlc"
SCOPE_BYTES = 16
NO_SCOPE = "-"
# The kinds this implementation names its objects with: commit logs (the router), committed-token
# lists (the router, at failover), draft rows (drafters, SDCP 5.2 q_rows), a session's target KV
# (its verifier, for a failover: SDCP 6.9 resume.target_kv), finished sessions' output for the
# suffix drafters' shared history and its index (the verifiers: sdcp.engines.history), a router
# session's durable facts (the routers: sdcp.engines.router.store).
LOG_KIND = "log"
TOKENS_KIND = "tokens"
Q_ROWS_KIND = "q-rows"
TARGET_KV_KIND = "target-kv"
# A prompt prefix's target KV, named by its block hash (sdcp.engines.verifier.prefixshare).
PREFIX_KV_KIND = "prefix-kv"
HISTORY_KIND = "history"
ROUTER_SESSION_KIND = "router-session"

_AUTHORITY = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]{1,5})?")
_KIND = re.compile(r"[a-z0-9][a-z0-9_-]*")
_NAME = re.compile(r"[A-Za-z0-9._~-]+")
_SCOPE = re.compile(r"[0-9a-f]{32}")
# RFC 3986 3.1 scheme, then only characters a URI may hold (unreserved, reserved, '%').
_ABSOLUTE_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+")
MAX_REF_LENGTH = 2048


@dataclass(frozen=True, slots=True)
class ObjectURI:
    """A parsed MLC object name; `str()` gives the canonical URI."""

    authority: str
    scope: bytes | None
    kind: str
    name: str

    def __post_init__(self) -> None:
        if not _AUTHORITY.fullmatch(self.authority):
            raise InvalidURI(f"bad authority {self.authority!r}")
        if self.scope is not None and len(self.scope) != SCOPE_BYTES:
            raise InvalidURI(f"scope must be {SCOPE_BYTES} bytes, got {len(self.scope)}")
        if not _KIND.fullmatch(self.kind):
            raise InvalidURI(f"bad kind {self.kind!r}: lowercase letters, digits, '_' and '-'")
        if not _NAME.fullmatch(self.name) or self.name in (".", ".."):
            raise InvalidURI(f"bad name {self.name!r}: URI unreserved characters only")

    def __str__(self) -> str:
        scope = self.scope.hex() if self.scope is not None else NO_SCOPE
        return f"{SCHEME}://{self.authority}/{scope}/{self.kind}/{self.name}"


def build_uri(authority: str, scope: bytes | None, kind: str, name: str) -> str:
    """Canonical URI of an object; raises `InvalidURI` for a part outside the grammar."""
    return str(ObjectURI(authority, scope, kind, name))


def target_kv_uri(commit_log: str, session: bytes, epoch: int) -> str | None:
    """Where the verifier of ``epoch`` publishes the session's target KV, and where the router looks
    for it at a failover (draft-li-sdcp 6.9, docs/interpretations.md): beside the session's commit
    log, in the same MLC and scope, one object per epoch. None for a log named in another grammar,
    of which no name can be derived that its router would know."""
    try:
        log = parse_uri(commit_log)
    except InvalidURI:
        return None
    if log.kind != LOG_KIND:
        return None
    return build_uri(log.authority, log.scope, TARGET_KV_KIND, f"{session.hex()}-{epoch}")


def parse_uri(uri: str) -> ObjectURI:
    """Parse a canonical MLC URI; any other scheme or shape raises `InvalidURI`."""
    if not isinstance(uri, str):
        raise InvalidURI(f"URI must be a str, got {type(uri).__name__}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise InvalidURI(f"not a URI: {uri!r}")
    if scheme != SCHEME:
        raise InvalidURI(f"unknown URI scheme {scheme!r} (expected {SCHEME!r})")
    parts = rest.split("/")
    if len(parts) != 4:
        raise InvalidURI(f"expected mlc://<authority>/<scope>/<kind>/<name>, got {uri!r}")
    authority, scope_text, kind, name = parts
    if scope_text == NO_SCOPE:
        scope = None
    elif _SCOPE.fullmatch(scope_text):
        scope = bytes.fromhex(scope_text)
    else:
        raise InvalidURI(f"scope must be 32 lowercase hex characters or '-', got {scope_text!r}")
    return ObjectURI(authority, scope, kind, name)


def check_ref(uri: object) -> str:
    """A received object name: any absolute URI (RFC 3986) of at most MAX_REF_LENGTH characters.

    It is returned unchanged and used verbatim as the storage key: two spellings of one URI are
    two objects, since only the implementation that created a name knows its equivalences.
    """
    if not isinstance(uri, str):
        raise InvalidURI(f"an object name is a URI (text), got {type(uri).__name__}")
    if len(uri) > MAX_REF_LENGTH:
        raise InvalidURI(f"an object name is at most {MAX_REF_LENGTH} characters, got {len(uri)}")
    if not _ABSOLUTE_URI.fullmatch(uri):
        raise InvalidURI(f"not an absolute URI: {uri[:100]!r}")
    return uri


def authority_of(uri: str) -> str:
    """The authority of an absolute URI, lowercased; '' for a URI without one (e.g. a URN)."""
    try:
        return urlsplit(check_ref(uri)).netloc.lower()
    except ValueError as exc:  # urlsplit refuses a malformed IPv6 literal or port
        raise InvalidURI(f"not an absolute URI: {uri[:100]!r}: {exc}") from exc
