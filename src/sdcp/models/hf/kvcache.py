"""Per-session KV caches: building, growing and cropping `DynamicCache` objects.

Every cache here holds one sequence (batch size 1); a batched pass extends each session's own
cache (sdcp.models.hf.ragged).

Layers are `GrowableLayer`s: transformers' `DynamicLayer` copies a layer's whole cache on every
append (``torch.cat``); these write new columns in place into spare capacity. A layer may start on
buffers it is given: a `SlotPool` slot, where a batched pass can reach every session's keys and
values as one tensor (sdcp.models.hf.ragged).
"""

from __future__ import annotations

import heapq
import math
import mmap

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

_MIN_CAPACITY = 64


class GrowableLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers with spare columns.

    Appending writes into the buffers, which double when full; cropping shortens the views, and the
    next append overwrites the dropped columns. Views handed out earlier see those writes, so a
    caller that keeps keys or values across an append copies them first.
    """

    def __init__(self, buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        # transformers leaves the layer's __init__ unannotated, and mypy's untyped_calls_exclude
        # does not reach a call through super().
        super().__init__()  # type: ignore[no-untyped-call]
        self._key_buffer: torch.Tensor | None
        self._value_buffer: torch.Tensor | None
        self._key_buffer, self._value_buffer = buffers if buffers is not None else (None, None)
        # The keys view this layer handed out last: while ``keys`` is still it, the buffers are ours.
        self._keys_view: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Called once per layer and session in every pass: the common case takes few operations.
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, _ = self._columns()
        length = keys.shape[-2] if keys.numel() else 0
        end = length + key_states.shape[-2]
        if torch.is_inference_mode_enabled():
            self._append(key_states, value_states, length, end)
        else:
            # Buffers made during a forward pass are inference tensors: written only in that mode.
            with torch.inference_mode():
                self._append(key_states, value_states, length, end)
        return self._columns()

    def _columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values, which an initialized layer always has."""
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, length: int, end: int) -> None:
        buffer = self._key_buffer
        fits = buffer is not None and end <= buffer.shape[-2] and buffer.shape[:-2] == key_states.shape[:-2]
        # With no columns yet, given buffers hold nothing to keep.
        if not (fits and (length == 0 or self.keys is self._keys_view or self._owns_views())):
            self._reallocate(key_states, value_states, length, max(_MIN_CAPACITY, end, 2 * length))
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., length:end, :] = key_states
        self._value_buffer[..., length:end, :] = value_states
        self.set_length(end)

    def set_length(self, length: int) -> None:
        """Make the first ``length`` buffer columns the keys and values; for a caller that wrote
        columns into the buffers directly."""
        assert self._key_buffer is not None and self._value_buffer is not None
        if not self.is_initialized:
            self.lazy_initialization(self._key_buffer, self._value_buffer)
        self.keys, self.values = self._key_buffer[..., :length, :], self._value_buffer[..., :length, :]
        self._keys_view = self.keys

    def move_to(self, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy the columns into ``buffers`` (a slot with room for them) and keep appending there."""
        key_buffer, value_buffer = buffers
        length = self.get_seq_length() if self.is_initialized else 0
        if length:
            keys, values = self._columns()
            with torch.inference_mode():
                key_buffer[..., :length, :] = keys
                value_buffer[..., :length, :] = values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self.set_length(length)

    def uses_buffers(self, key_buffer: torch.Tensor) -> bool:
        """The layer still stores its columns in ``key_buffer`` (it has not moved to its own)."""
        return self._key_buffer is key_buffer and (self.keys is self._keys_view or self._owns_views())

    def _owns_views(self) -> bool:
        """The current keys are a prefix view of the buffer (no other cache code replaced them)."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and self.keys is not None
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.stride() == buffer.stride()
        )

    def _reallocate(self, keys: torch.Tensor, values: torch.Tensor, length: int, capacity: int) -> None:
        key_buffer = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        value_buffer = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        if length:
            kept_keys, kept_values = self._columns()
            key_buffer[..., :length, :] = kept_keys
            value_buffer[..., :length, :] = kept_values
        self._key_buffer, self._value_buffer = key_buffer, value_buffer


class SlotPool:
    """KV buffers for up to ``slots`` sessions of up to ``capacity`` positions, one tensor per layer
    for keys and one for values, shaped (slots, kv_heads, capacity, head_dim).

    A session's `GrowableLayer`s start on its slot's rows; a session that outgrows ``capacity``
    moves to buffers of its own. A batched pass reads every slot up to its longest session, masked:
    a masked key still enters the arithmetic (a NaN there would spread), so the pool starts zeroed
    and holds only keys and values written since.
    """

    def __init__(self, model: PreTrainedModel, *, slots: int, capacity: int) -> None:
        if slots < 1 or capacity < 1:
            raise ValueError(f"a slot pool needs slots >= 1 and capacity >= 1, got {slots} and {capacity}")
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        parameter = next(model.parameters())
        shape = (slots, heads, capacity, head_dim)
        self.keys = [_zeros(shape, parameter) for _ in range(config.num_hidden_layers)]
        self.values = [_zeros(shape, parameter) for _ in range(config.num_hidden_layers)]
        self.slots = slots
        self.capacity = capacity
        self._buffers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [
            [
                (keys[slot : slot + 1], values[slot : slot + 1])
                for keys, values in zip(self.keys, self.values, strict=True)
            ]
            for slot in range(slots)
        ]
        self._free = list(range(slots))

    def acquire(self) -> int | None:
        """The lowest free slot (sessions then sit close together), or None when all are taken."""
        return heapq.heappop(self._free) if self._free else None

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def buffers(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the slot's (keys, values) rows, shaped (1, kv_heads, capacity, head_dim)."""
        return self._buffers[slot]

    def holds(self, slot: int, cache: DynamicCache) -> bool:
        """``cache`` still stores its columns in ``slot``. Its layers grow together and move to
        buffers of their own in the same pass, so the first and the last layer tell."""
        buffers = self._buffers[slot]
        return all(
            isinstance(layer := cache.layers[index], GrowableLayer) and layer.uses_buffers(buffers[index][0])
            for index in (0, len(buffers) - 1)
        )


def _zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if like.device.type != "cpu":
        return like.new_zeros(shape)
    # Anonymous memory reads as zeros and is committed page by page as it is first written, so a
    # column no session reached costs address space only (torch.zeros would write every page).
    # Transparent huge pages would commit 2 MiB for each slot's first column of each head.
    size = math.prod(shape) * like.element_size()
    memory = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=like.dtype, count=math.prod(shape)).view(shape)


def new_cache(model: PreTrainedModel, buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> DynamicCache:
    """An empty cache of `GrowableLayer`s, on the given per-layer buffers if any."""
    cache = DynamicCache(config=model.config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowableLayer(buffers[index] if buffers else None) for index in range(len(cache.layers))]
    return cache


def move_to(cache: DynamicCache, buffers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Move a cache of `GrowableLayer`s into per-layer buffers (a `SlotPool` slot)."""
    for layer, layer_buffers in zip(cache.layers, buffers, strict=True):
        assert isinstance(layer, GrowableLayer)
        layer.move_to(layer_buffers)


def set_length(cache: DynamicCache, length: int) -> None:
    """After a pass wrote ``length`` columns into a cache's slot buffers directly."""
    for layer in cache.layers:
        assert isinstance(layer, GrowableLayer)
        layer.set_length(length)


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def layer_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per initialized layer, each shaped (batch, kv_heads, length, head_dim)."""
    tensors = []
    for layer in cache.layers:
        if not isinstance(layer, CacheLayerMixin):
            raise TypeError(f"a {type(layer).__name__} holds no keys and values")
        # An attention layer has its keys and values exactly when it is initialized.
        if layer.keys is not None and layer.values is not None:
            tensors.append((layer.keys, layer.values))
    return tensors


def cache_from_tensors(
    model: PreTrainedModel,
    tensors: list[tuple[torch.Tensor, torch.Tensor]],
    buffers: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> DynamicCache:
    cache = new_cache(model, buffers)
    for layer_index, (keys, values) in enumerate(tensors):
        cache.update(keys, values, layer_index)
    return cache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions (transformers 5 crops by a negative count to remove)."""
    surplus = cache_length(cache) - length
    if surplus > 0:
        cache.crop(-surplus)
