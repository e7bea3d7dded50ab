"""Per-session KV caches: building, slicing and padding `DynamicCache` objects.

Every cache here holds one sequence (batch size 1). A batched pass left-pads the caches of many
sessions into one batch cache; rotary position embeddings are applied before keys are cached, so
moving a key to another column changes nothing as long as the attention mask hides the padding.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each shaped (batch, kv_heads, length, head_dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers if layer.is_initialized]


def cache_from_tensors(
    model: PreTrainedModel, tensors: list[tuple[torch.Tensor, torch.Tensor]]
) -> DynamicCache:
    cache = new_cache(model)
    for layer_index, (keys, values) in enumerate(tensors):
        cache.update(keys, values, layer_index)
    return cache


def left_padded_batch(
    model: PreTrainedModel, caches: list[DynamicCache], width: int
) -> DynamicCache:
    """One cache of batch len(caches) and `width` columns, each session right-aligned."""
    batch = new_cache(model)
    if width == 0:
        return batch
    per_session = [layer_tensors(cache) for cache in caches]
    template = next(tensors for tensors in per_session if tensors)
    for layer_index, (keys0, values0) in enumerate(template):
        heads, key_dim, value_dim = keys0.shape[1], keys0.shape[3], values0.shape[3]
        keys = keys0.new_zeros((len(caches), heads, width, key_dim))
        values = values0.new_zeros((len(caches), heads, width, value_dim))
        for row, tensors in enumerate(per_session):
            if not tensors:
                continue
            session_keys, session_values = tensors[layer_index]
            length = session_keys.shape[2]
            keys[row, :, width - length :] = session_keys[0]
            values[row, :, width - length :] = session_values[0]
        batch.update(keys, values, layer_index)
    return batch


def append_from_batch(
    cache: DynamicCache, batch: DynamicCache, row: int, start: int, count: int
) -> None:
    """Append columns start..start+count of batch row `row` to a single-session cache."""
    for layer_index, (keys, values) in enumerate(layer_tensors(batch)):
        cache.update(
            keys[row : row + 1, :, start : start + count].clone(),
            values[row : row + 1, :, start : start + count].clone(),
            layer_index,
        )


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions (transformers 5 crops by a negative count to remove)."""
    surplus = cache_length(cache) - length
    if surplus > 0:
        cache.crop(-surplus)
