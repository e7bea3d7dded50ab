"""The target KV blob that verifiers publish to the MLC (format in docs/models.md).

blob = uint32 big-endian header length || header (deterministic CBOR map) || safetensors payload.
The payload holds `layer.<i>.keys` and `layer.<i>.values`, each (kv_heads, cached, head_dim),
where cached = committed - 1 (the cache never holds the last committed token).
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
KV_VERSION = 1
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
    tensors: dict[str, torch.Tensor] = {}
    for index, (keys, values) in enumerate(layers):
        tensors[f"layer.{index}.keys"] = keys[0].contiguous()
        tensors[f"layer.{index}.values"] = values[0].contiguous()
    header = {
        "format": KV_FORMAT,
        "version": KV_VERSION,
        "model": model_digest,
        "committed": len(tokens),
        "tokens": tokens_digest(tokens),
        "layers": len(layers),
        "dtype": "float32",
    }
    encoded = cbor2.dumps(header, canonical=True)
    return _LENGTH.pack(len(encoded)) + encoded + save_tensors(tensors)


def decode_kv(
    data: bytes, model_digest: bytes, tokens: Sequence[int], expected: LayerShapes
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Check a blob against the loaded model and the committed tokens; return (1, H, L, D) pairs."""
    header, payload = _split(data)
    if header.get("format") != KV_FORMAT or header.get("version") != KV_VERSION:
        raise KVFormatError(f"unsupported KV blob {header.get('format')!r} version {header.get('version')!r}")
    if header.get("model") != model_digest:
        raise DigestMismatch("KV blob was produced by a model with another weights digest")
    if header.get("committed") != len(tokens) or header.get("tokens") != tokens_digest(tokens):
        raise KVFormatError("KV blob does not cover the given committed tokens")
    if header.get("dtype") != "float32":
        raise KVFormatError(f"KV blob dtype {header.get('dtype')!r} is not float32")
    try:
        tensors = load_tensors(payload)
    except SafetensorError as exc:
        raise KVFormatError(f"KV blob payload is not valid safetensors: {exc}") from exc
    layers = header.get("layers")
    if layers != len(expected) or len(tensors) != 2 * len(expected):
        raise KVFormatError(f"KV blob has {layers} layers, the model needs {len(expected)}")
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
