"""Entity tags of objects.

An object's ETag is its content digest: the first 32 hex characters (128 bits) of its SHA-256,
in double quotes as an HTTP strong entity tag (RFC 9110 8.8.3). Equal content gives an equal tag,
which is what a strong validator means, and lets per-process caches check their copy against the
shared tier without moving the bytes.
"""

from __future__ import annotations

import hashlib

ETAG_HEX_CHARS = 32


# An If-Match value that holds only where no object is (RFC 9110's If-None-Match: *): a create that
# fails where another writer created the object first. No ETag is this (they are quoted hex).
ABSENT_ETAG = "absent"


def content_etag(data: bytes) -> str:
    """Quoted hex SHA-256 prefix of `data`."""
    return '"' + hashlib.sha256(data).hexdigest()[:ETAG_HEX_CHARS] + '"'
