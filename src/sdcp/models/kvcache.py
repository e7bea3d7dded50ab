"""Per-session KV caches: building, growing and cropping `DynamicCache` objects.

Every cache here holds one sequence (batch size 1); a batched pass extends each session's own
cache (sdcp.models.ragged).

Layers are `GrowableLayer`s: transformers' `DynamicLayer` copies a layer's whole cache on every
append (``torch.cat``); these write new columns in place into spare capacity.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

_MIN_CAPACITY = 64


class GrowableLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare columns.

    Appending writes into the buffers, which double when full; cropping shortens the views, and the
    next append overwrites the dropped columns. Views handed out earlier see those writes, so a
    caller that keeps keys or values across an append copies them first.
    """

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        # The keys view this layer handed out last: while ``keys`` is still it, the buffers are ours.
        self._keys_view: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Called once per layer and session in every pass: the common case takes few operations.
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        if torch.is_inference_mode_enabled():
            self._append(key_states, value_states, length, end)
        else:
            # Buffers made during a forward pass are inference tensors: written only in that mode.
            with torch.inference_mode():
                self._append(key_states, value_states, length, end)
        return self.keys, self.values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int, end: int) -> None:
        owned = self.keys is self._keys_view or self._owns_views(key_states)
        if not owned or end > self._key_buffer.shape[-2]:  # type: ignore[union-attr]
            self._reallocate(key_states, value_states, length, max(_MIN_CAPACITY, end, 2 * length))
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., length:end, :] = key_states
        self._value_buffer[..., length:end, :] = value_states
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]
        self._keys_view = self.keys

    def _owns_views(self, key_states: torch.Tensor) -> bool:
        """The current keys are a prefix view of the buffer (no other cache code replaced them)."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and self.keys is not None
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.stride() == buffer.stride()
            and buffer.shape[:-2] == key_states.shape[:-2]
        )

    def _reallocate(self, keys: torch.Tensor, values: torch.Tensor, length: int, capacity: int) -> None:
        key_buffer = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        value_buffer = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        if length:
            key_buffer[..., :length, :] = self.keys
            value_buffer[..., :length, :] = self.values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer


def new_cache(model: PreTrainedModel) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowableLayer() for _ in cache.layers]
    return cache


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


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions (transformers 5 crops by a negative count to remove)."""
    surplus = cache_length(cache) - length
    if surplus > 0:
        cache.crop(-surplus)
