"""The torch target's KV blobs (`sdcp-target-kv`, framed by sdcp.models.kvformat): a safetensors
payload of `layer.<i>.keys` and `layer.<i>.values`, each (kv_heads, cached, head_dim)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from sdcp.models.errors import KVFormatError
from sdcp.models.kvformat import KV_FORMAT, KV_VERSION, blob, blob_header, checked_split

__all__ = ["LayerShapes", "decode_kv", "decode_kv_layers", "encode_kv", "encode_kv_layers"]

LayerShapes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def encode_kv(
    model_digest: bytes,
    tokens: Sequence[int],
    layers: list[tuple[torch.Tensor, torch.Tensor]],
) -> bytes:
    header = {**blob_header(KV_FORMAT, KV_VERSION, model_digest, tokens), "layers": len(layers), "dtype": "float32"}
    return blob(header, encode_kv_layers(layers))


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
    header, payload = checked_split(data, KV_FORMAT, KV_VERSION, model_digest, tokens)
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
