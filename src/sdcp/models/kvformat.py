"""The target KV blobs that verifiers publish to the MLC (formats in docs/models.md).

blob = uint32 big-endian header length || header (deterministic CBOR map) || payload. The header
names the format, its version, the model digest, the committed tokens the KV covers and the SHA-256
of the payload (version 2), so that a blob damaged in the MLC is refused rather than imported:
SDCP 1.3 lets a cache fail without changing the committed output.

`sdcp-target-kv` (torch): a safetensors payload of `layer.<i>.keys` and `layer.<i>.values`, each
(kv_heads, cached, head_dim), where cached = committed - 1 (the cache never holds the last
committed token). `sdcp-target-kv-llamacpp`: llama.cpp's own state of one sequence
(`llama_state_seq_get_data`), whose layout only a cache of the same layout reads.

The framing is here, free of any runtime; the torch payload is sdcp.models.hf.kvblob's.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import cbor2

from sdcp.models.errors import DigestMismatch, KVFormatError

__all__ = [
    "KV_FORMAT",
    "KV_VERSION",
    "LLAMACPP_KV_FORMAT",
    "LLAMACPP_KV_VERSION",
    "blob",
    "blob_committed",
    "blob_header",
    "checked_split",
    "decode_llamacpp_kv",
    "encode_llamacpp_kv",
    "tokens_digest",
]

KV_FORMAT = "sdcp-target-kv"
KV_VERSION = 2
LLAMACPP_KV_FORMAT = "sdcp-target-kv-llamacpp"
LLAMACPP_KV_VERSION = 2
_LENGTH = struct.Struct(">I")


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """SHA-256 over the committed tokens, each as uint32 big-endian."""
    return hashlib.sha256(b"".join(struct.pack(">I", token) for token in tokens)).digest()


def encode_llamacpp_kv(model_digest: bytes, tokens: Sequence[int], layout: str, state: bytes) -> bytes:
    """A blob of one llama.cpp sequence's ``state``, from a cache of the ``layout`` named."""
    header = {**blob_header(LLAMACPP_KV_FORMAT, LLAMACPP_KV_VERSION, model_digest, tokens), "layout": layout}
    return blob(header, state)


def decode_llamacpp_kv(data: bytes, model_digest: bytes, tokens: Sequence[int], layout: str) -> bytes:
    """Check a llama.cpp blob against the loaded model, the committed tokens and this cache's
    ``layout`` (llama.cpp's state is its own, from one build and cache shape to another); return
    the state."""
    header, state = checked_split(data, LLAMACPP_KV_FORMAT, LLAMACPP_KV_VERSION, model_digest, tokens)
    if header.get("layout") != layout:
        raise KVFormatError(f"KV blob is of a cache {header.get('layout')!r}, this one is {layout!r}")
    return state


def blob_committed(data: bytes) -> int:
    """How many committed tokens a blob of either format covers (its header's ``committed``), read
    before the blob is checked against a model: a verifier resuming a session that has committed
    more imports the blob over that prefix and computes the rest (draft-li-sdcp 6.9)."""
    header, _ = _split(data)
    committed = header.get("committed")
    if header.get("format") not in (KV_FORMAT, LLAMACPP_KV_FORMAT):
        raise KVFormatError(f"unsupported KV blob {header.get('format')!r}")
    if not isinstance(committed, int) or isinstance(committed, bool) or committed < 1:
        raise KVFormatError(f"KV blob covers {committed!r} committed tokens")
    return committed


def blob_header(kv_format: str, version: int, model_digest: bytes, tokens: Sequence[int]) -> dict[str, object]:
    return {
        "format": kv_format,
        "version": version,
        "model": model_digest,
        "committed": len(tokens),
        "tokens": tokens_digest(tokens),
    }


def blob(header: dict[str, object], payload: bytes) -> bytes:
    encoded = cbor2.dumps({**header, "payload": hashlib.sha256(payload).digest()}, canonical=True)
    return _LENGTH.pack(len(encoded)) + encoded + payload


def checked_split(
    data: bytes, kv_format: str, version: int, model_digest: bytes, tokens: Sequence[int]
) -> tuple[dict[object, object], bytes]:
    """The header and payload of a blob of this format and version, by this model, over these tokens."""
    header, payload = _split(data)
    if header.get("format") != kv_format or header.get("version") != version:
        raise KVFormatError(f"unsupported KV blob {header.get('format')!r} version {header.get('version')!r}")
    if header.get("model") != model_digest:
        raise DigestMismatch("KV blob was produced by a model with another weights digest")
    if header.get("committed") != len(tokens) or header.get("tokens") != tokens_digest(tokens):
        raise KVFormatError("KV blob does not cover the given committed tokens")
    if header.get("payload") != hashlib.sha256(payload).digest():
        raise KVFormatError("KV blob payload does not match its digest")
    return header, payload


def _split(data: bytes) -> tuple[dict[object, object], bytes]:
    if len(data) < _LENGTH.size:
        raise KVFormatError("KV blob is shorter than its length prefix")
    (length,) = _LENGTH.unpack_from(data)
    if len(data) < _LENGTH.size + length:
        raise KVFormatError("KV blob header is truncated")
    try:
        header = cbor2.loads(data[_LENGTH.size : _LENGTH.size + length])
    except (cbor2.CBORDecodeError, ValueError) as exc:
        raise KVFormatError(f"KV blob header is not CBOR: {exc}") from exc
    if not isinstance(header, dict):
        raise KVFormatError("KV blob header is not a CBOR map")
    return header, data[_LENGTH.size + length :]
