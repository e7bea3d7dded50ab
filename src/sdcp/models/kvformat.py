"""The target KV blobs that verifiers publish to the MLC (formats in docs/models.md).

blob = uint32 big-endian header length || header (deterministic CBOR map) || payload. The header
names the format, its version, the model digest, the committed tokens the KV covers and the SHA-256
of the payload (version 2), so that a blob damaged in the MLC is refused rather than imported:
SDCP 1.3 lets a cache fail without changing the committed output.

`sdcp-target-kv` (torch): a safetensors payload of `layer.<i>.keys` and `layer.<i>.values`, each
(kv_heads, cached, head_dim), where cached = committed - 1 (the cache never holds the last
committed token). `sdcp-target-kv-llamacpp`: llama.cpp's own state of one sequence
(`llama_state_seq_get_data`), whose layout only a cache of the same layout reads.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import cbor2
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from sdcp.models.errors import DigestMismatch, KVFormatError

KV_FORMAT = "sdcp-target-kv"
KV_VERSION = 2
LLAMACPP_KV_FORMAT = "sdcp-target-kv-llamacpp"
LLAMACPP_KV_VERSION = 2
_LENGTH = struct.Struct(">I")

LayerShapes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def tokens_digest(tokens: Sequence[int]) -> bytes:
    """SHA-256 over the committed tokens, each as uint32 big-endian."""
    return hashlib.sha256(b"".join(struct.pack(">I", token) for token in tokens)).digest()


def encode_kv(
    model_digest: bytes,
    tokens: Sequence[int],
    layers: list[tuple[torch.Tensor, torch.Tensor]],
) -> bytes:
    header = {**_header(KV_FORMAT, KV_VERSION, model_digest, tokens), "layers": len(layers), "dtype": "float32"}
    return _blob(header, encode_kv_layers(layers))


def encode_kv_layers(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> bytes:
    """The payload of `sdcp-target-kv`: float32 (1, H, L, D) keys and values per layer as
    safetensors; also the torch prefix cache's entries (sdcp.models.hf.target)."""
    tensors: dict[str, torch.Tensor] = {}
    for index, (keys, values) in enumerate(layers):
        tensors[f"layer.{index}.keys"] = keys[0].contiguous()
        tensors[f"layer.{index}.values"] = values[0].contiguous()
    return save_tensors(tensors)


def decode_kv(
    data: bytes, model_digest: bytes, tokens: Sequence[int], expected: LayerShapes
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Check a blob against the loaded model and the committed tokens; return (1, H, L, D) pairs."""
    header, payload = _checked_split(data, KV_FORMAT, KV_VERSION, model_digest, tokens)
    if header.get("dtype") != "float32":
        raise KVFormatError(f"KV blob dtype {header.get('dtype')!r} is not float32")
    layers = header.get("layers")
    if layers != len(expected):
        raise KVFormatError(f"KV blob has {layers} layers, the model needs {len(expected)}")
    return decode_kv_layers(payload, expected)


def decode_kv_layers(payload: bytes, expected: LayerShapes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (1, H, L, D) pairs of an `encode_kv_layers` payload, checked against ``expected``."""
    try:
        tensors = load_tensors(payload)
    except SafetensorError as exc:
        raise KVFormatError(f"KV blob payload is not valid safetensors: {exc}") from exc
    if len(tensors) != 2 * len(expected):
        raise KVFormatError(f"KV blob has {len(tensors)} tensors, the model needs {2 * len(expected)}")
    result = []
    for index, (key_shape, value_shape) in enumerate(expected):
        keys = tensors.get(f"layer.{index}.keys")
        values = tensors.get(f"layer.{index}.values")
        if keys is None or values is None:
            raise KVFormatError(f"KV blob lacks layer {index}")
        if (1, *keys.shape) != key_shape or (1, *values.shape) != value_shape:
            raise KVFormatError(f"KV blob layer {index} has shapes {keys.shape}, {values.shape}")
        if keys.dtype != torch.float32 or values.dtype != torch.float32:
            raise KVFormatError(f"KV blob layer {index} is not float32")
        result.append((keys.unsqueeze(0), values.unsqueeze(0)))
    return result


def encode_llamacpp_kv(model_digest: bytes, tokens: Sequence[int], layout: str, state: bytes) -> bytes:
    """A blob of one llama.cpp sequence's ``state``, from a cache of the ``layout`` named."""
    header = {**_header(LLAMACPP_KV_FORMAT, LLAMACPP_KV_VERSION, model_digest, tokens), "layout": layout}
    return _blob(header, state)


def decode_llamacpp_kv(data: bytes, model_digest: bytes, tokens: Sequence[int], layout: str) -> bytes:
    """Check a llama.cpp blob against the loaded model, the committed tokens and this cache's
    ``layout`` (llama.cpp's state is its own, from one build and cache shape to another); return
    the state."""
    header, state = _checked_split(data, LLAMACPP_KV_FORMAT, LLAMACPP_KV_VERSION, model_digest, tokens)
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


def _header(kv_format: str, version: int, model_digest: bytes, tokens: Sequence[int]) -> dict[str, object]:
    return {
        "format": kv_format,
        "version": version,
        "model": model_digest,
        "committed": len(tokens),
        "tokens": tokens_digest(tokens),
    }


def _blob(header: dict[str, object], payload: bytes) -> bytes:
    encoded = cbor2.dumps({**header, "payload": hashlib.sha256(payload).digest()}, canonical=True)
    return _LENGTH.pack(len(encoded)) + encoded + payload


def _checked_split(
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
