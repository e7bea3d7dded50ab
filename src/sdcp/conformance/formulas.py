"""The draft's formulas, written from its text: contract digest (SDCP 4.1), committed-prefix digest
chain (4.2), and the verifier's seeded randomness (6.4) over an HMAC-SHA-256 of RFC 2104."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from sdcp.conformance import cbor

__all__ = ["contract_digest", "extend", "hmac_sha256", "prefix_digest", "verifier_uniform"]

_BLOCK = 64  # SHA-256's block size in octets (RFC 2104 B)


def contract_digest(contract: Mapping[str, Any]) -> bytes:
    """SHA-256("SDCP-CONTRACT-1" || 0x00 || deterministic_cbor(contract))."""
    return hashlib.sha256(b"SDCP-CONTRACT-1\x00" + cbor.encode(dict(contract))).digest()


def _uint32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def prefix_digest(contract: bytes, prompt: Iterable[int]) -> bytes:
    """d[0] = SHA-256("SDCP-PREFIX-1" || 0x00 || contract_digest || uint32(P) || uint32(t[i])...)."""
    tokens = list(prompt)
    body = b"".join(_uint32(token) for token in tokens)
    return hashlib.sha256(b"SDCP-PREFIX-1\x00" + contract + _uint32(len(tokens)) + body).digest()


def extend(digest: bytes, tokens: Iterable[int]) -> bytes:
    """d[k] = SHA-256(d[k-1] || uint32(o[k])), once per token."""
    for token in tokens:
        digest = hashlib.sha256(digest + _uint32(token)).digest()
    return digest


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """RFC 2104: H((K ^ opad) || H((K ^ ipad) || text)), keys longer than B hashed first."""
    if len(key) > _BLOCK:
        key = hashlib.sha256(key).digest()
    key = key.ljust(_BLOCK, b"\x00")
    inner = hashlib.sha256(bytes(k ^ 0x36 for k in key) + message).digest()
    return hashlib.sha256(bytes(k ^ 0x5C for k in key) + inner).digest()


def verifier_uniform(seed: int, session: bytes, round_number: int, i: int, purpose: int) -> float:
    """SDCP 6.4: first 53 bits of HMAC-SHA-256(seed as 8 octets, "SDCP-VERIFY-1" || 0x00 ||
    session || uint32(round) || uint32(i) || uint8(purpose)), divided by 2^53."""
    message = b"SDCP-VERIFY-1\x00" + session + _uint32(round_number) + _uint32(i) + bytes([purpose])
    mac = hmac_sha256(seed.to_bytes(8, "big"), message)
    return (int.from_bytes(mac[:8], "big") >> 11) / 2.0**53
