"""The committed-prefix digest chain (SDCP 4.2).

d[0] = SHA-256("SDCP-PREFIX-1" || 0x00 || contract_digest || uint32(P) || uint32(t[0..P-1]))
d[k] = SHA-256(d[k-1] || uint32(o[k]))
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

from sdcp.protocol.problems import BadMessage

__all__ = ["DIGEST_SIZE", "PREFIX_DOMAIN", "extend_digest", "prefix_digest"]

PREFIX_DOMAIN = b"SDCP-PREFIX-1\x00"
DIGEST_SIZE = 32
_UINT32_MAX = 2**32 - 1
_UINT32 = struct.Struct(">I")


def _uint32(value: object, what: str) -> bytes:
    """Four octets in network byte order; anything that is not a uint32 raises BadMessage."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _UINT32_MAX:
        raise BadMessage(f"{what} = {value!r} is not an unsigned 32-bit integer")
    return _UINT32.pack(value)


def _check_digest(value: object, what: str) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != DIGEST_SIZE:
        raise BadMessage(f"{what} must be {DIGEST_SIZE} bytes")
    return bytes(value)


def prefix_digest(contract_digest: bytes, prompt: Sequence[int]) -> bytes:
    """d[0] over the prompt tokens (SDCP 4.2)."""
    hasher = hashlib.sha256(PREFIX_DOMAIN)
    hasher.update(_check_digest(contract_digest, "contract digest"))
    hasher.update(_uint32(len(prompt), "prompt length"))
    for index, token in enumerate(prompt):
        hasher.update(_uint32(token, f"prompt[{index}]"))
    return hasher.digest()


def extend_digest(digest: bytes, tokens: Iterable[int]) -> bytes:
    """d[n] from d[n-k] and the k tokens committed after it (SDCP 4.2); no tokens, same digest."""
    current = _check_digest(digest, "digest")
    for index, token in enumerate(tokens):
        current = hashlib.sha256(current + _uint32(token, f"token[{index}]")).digest()
    return current
