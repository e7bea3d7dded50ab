"""Batched passes as one packed sequence, with attention over each session's own KV cache.

A batched scoring pass feeds the new tokens of all sessions as one sequence, session after
session, so that the linear layers run over exactly the rows requested (no padding to the widest
request), and computes attention session by session, against that session's own cache. The
previous layout left-padded every cache into one batch tensor: it copied each session's whole KV
per pass and back (21 of 58 ms for 16 one-token sessions of SmolLM2 on this project's CPU), made
every query attend over the longest context, and scored every request at the widest one's width
(12 one-token sessions and 4 of 9 tokens: 150 ms padded, 98 ms in two passes).

`RaggedBatchCache` stands in for the model's cache during such a pass: for each layer it appends
each session's new keys and values (its ``width`` columns of the packed sequence) to the session's
own cache and hands the attention function those caches' keys and values. `ragged_attention`,
registered with transformers as ``"sdcp_ragged"`` when a model first uses it, computes plain
causal softmax attention with torch's scaled_dot_product_attention: per session for a
`RaggedBatchCache`, and directly for an ordinary cache of one sequence (prefill and single-session
passes). The queries of a request are the last ``width`` positions of its keys.

When the sessions' caches sit in the slots of one `SlotPool` (sdcp.models.hf.kvcache), a `SlotPass`
does the same with a few operators per layer instead of a few per session and layer: one indexed
write appends every session's columns, and one attention call covers the slots' range, each query
masked to its own session's positions. Per session and layer, the Python and dispatch overhead was
about as costly as the attention itself (16 one-token sessions of SmolLM2: 48 ms per pass, of
which 21 ms in linear layers).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, PreTrainedModel

from sdcp.models.hf.kvcache import SlotPool

__all__ = [
    "ATTENTION",
    "RaggedBatchCache",
    "RaggedKV",
    "SlotKV",
    "SlotPass",
    "ragged_attention",
    "supports_ragged_attention",
    "use_ragged_attention",
]

ATTENTION = "sdcp_ragged"
_REGISTERING = threading.Lock()
# One-row requests attend as one batch over their slots' range while it holds at most this many
# slots per request; beyond it, reading the other slots' keys would cost more than it saves.
_SLOT_RANGE_PER_SESSION = 2


@dataclass
class RaggedKV:
    """One layer's keys (or values) for a packed pass: per session ``(1, kv_heads, length, dim)``."""

    per_session: list[torch.Tensor]
    widths: Sequence[int]


@dataclass(frozen=True)
class _SlotGroup:
    """Requests of one width that attend as one batch over the slots ``first..last``."""

    width: int
    first: int
    last: int
    rows: torch.Tensor  # (requests, width): their rows in the packed sequence
    batch: torch.Tensor  # (requests,): their slot - first
    length: int  # keys up to the longest request's last position
    mask: torch.Tensor  # (last - first + 1, 1, width, length)


class SlotPass:
    """Where a packed pass's rows go in a `SlotPool`: session i, in ``slots[i]``, holds ``starts[i]``
    positions and is extended by the next ``widths[i]`` rows of the packed sequence.

    Requests of the same width (a busy verifier's self-decoding passes are mostly one row each)
    attend as one batch over their slots' range, keys padded to the longest session; a slot in that
    range that is not in the group gets queries that see one key, and their output is dropped. A
    width only one request has, or a group spread over too many slots, attends request by request
    on the slot's rows.
    """

    def __init__(self, pool: SlotPool, slots: Sequence[int], starts: Sequence[int], widths: Sequence[int]) -> None:
        self.pool = pool
        # Indices and masks live where the pool does: built once per pass, used by every layer.
        device = pool.keys[0].device
        self.row_slot = torch.tensor(
            [slot for slot, width in zip(slots, widths, strict=True) for _ in range(width)], device=device
        )
        self.row_position = torch.tensor(
            [start + j for start, width in zip(starts, widths, strict=True) for j in range(width)], device=device
        )
        self.rows = int(self.row_position.shape[0])
        by_width: dict[int, list[tuple[int, int, int]]] = {}
        row = 0
        for slot, start, width in zip(slots, starts, widths, strict=True):
            by_width.setdefault(width, []).append((row, slot, start))
            row += width
        self.groups: list[_SlotGroup] = []
        self.single: list[tuple[int, int, int, int]] = []  # (row, width, slot, end)
        for width, requests in by_width.items():
            first = min(slot for _, slot, _ in requests)
            last = max(slot for _, slot, _ in requests)
            if len(requests) > 1 and last - first + 1 <= _SLOT_RANGE_PER_SESSION * len(requests):
                self.groups.append(_group(width, first, last, requests, device))
            else:
                self.single.extend((row, width, slot, start + width) for row, slot, start in requests)

    def append(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[SlotKV, SlotKV]:
        """Write the pass's (1, kv_heads, rows, dim) keys and values into the slots."""
        pool_keys, pool_values = self.pool.keys[layer], self.pool.values[layer]
        pool_keys[self.row_slot, :, self.row_position] = key_states[0].transpose(0, 1)
        pool_values[self.row_slot, :, self.row_position] = value_states[0].transpose(0, 1)
        return SlotKV(pool_keys, self), SlotKV(pool_values, self)

    def attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None
    ) -> torch.Tensor:
        """``query`` (1, heads, rows, dim) over the pool's ``keys`` and ``values`` -> (1, rows, heads, dim)."""
        heads, dim = query.shape[1], query.shape[3]
        gqa = heads != keys.shape[1]
        output = query.new_empty((self.rows, heads, dim))
        by_row = query[0].transpose(0, 1)  # (rows, heads, dim)
        for group in self.groups:
            window = slice(group.first, group.last + 1)
            batch = query.new_zeros((group.last - group.first + 1, group.width, heads, dim))
            batch[group.batch] = by_row[group.rows]
            attended = F.scaled_dot_product_attention(
                batch.transpose(1, 2),
                keys[window, :, : group.length],
                values[window, :, : group.length],
                attn_mask=group.mask,
                scale=scaling,
                enable_gqa=gqa,
            )
            output[group.rows] = attended.transpose(1, 2)[group.batch]
        for row, width, slot, end in self.single:
            attended = _attend(
                query[:, :, row : row + width],
                keys[slot : slot + 1, :, :end],
                values[slot : slot + 1, :, :end],
                scaling,
            )
            output[row : row + width] = attended[0].transpose(0, 1)
        return output.unsqueeze(0)


def _group(width: int, first: int, last: int, requests: list[tuple[int, int, int]], device: torch.device) -> _SlotGroup:
    """``requests``: (first row, slot, start) of each request of ``width`` rows."""
    rows = torch.tensor([[row + j for j in range(width)] for row, _, _ in requests], dtype=torch.long, device=device)
    batch = torch.tensor([slot - first for _, slot, _ in requests], dtype=torch.long, device=device)
    length = max(start for _, _, start in requests) + width
    # The last key each query may see: its own position; key 0 for a slot not in the group.
    last_key = torch.zeros((last - first + 1, width), dtype=torch.long, device=device)
    last_key[batch] = torch.tensor(
        [[start + j for j in range(width)] for _, _, start in requests], dtype=torch.long, device=device
    )
    mask = (torch.arange(length, device=device) <= last_key.unsqueeze(-1)).unsqueeze(1)
    return _SlotGroup(width, first, last, rows, batch, length, mask)


@dataclass
class SlotKV:
    """One layer's keys (or values) of a `SlotPass`: the pool's tensor for that layer."""

    pool: torch.Tensor
    plan: SlotPass


@dataclass
class RaggedBatchCache:
    """The cache a packed pass sees: the next ``widths[i]`` positions extend ``caches[i]``; with a
    ``slots`` plan, the caches' slot buffers are written through it instead."""

    caches: Sequence[DynamicCache]
    widths: Sequence[int]
    slots: SlotPass | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: Any
    ) -> tuple[RaggedKV, RaggedKV] | tuple[SlotKV, SlotKV]:
        if self.slots is not None:
            return self.slots.append(layer_idx, key_states, value_states)
        keys, values = [], []
        start = 0
        for cache, width in zip(self.caches, self.widths, strict=True):
            session_keys, session_values = cache.update(
                key_states[:, :, start : start + width], value_states[:, :, start : start + width], layer_idx
            )
            keys.append(session_keys)
            values.append(session_values)
            start += width
        return RaggedKV(keys, self.widths), RaggedKV(values, self.widths)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Causal attention of the last ``queries`` positions over all ``keys`` of one sequence."""
    queries, length = query.shape[2], keys.shape[2]
    mask = None
    if 1 < queries < length:
        # Query j sees the keys up to its own position; torch's is_causal would align the queries
        # with the first keys instead.
        mask = torch.ones((queries, length), dtype=torch.bool, device=query.device).tril(length - queries)
    return F.scaled_dot_product_attention(
        query,
        keys,
        values,
        attn_mask=mask,
        is_causal=1 < queries == length,
        scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | RaggedKV | SlotKV,
    value: torch.Tensor | RaggedKV | SlotKV,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface; returns ``(1, queries, heads, dim)``."""
    if attention_mask is not None or dropout:
        raise ValueError("sdcp_ragged attention takes no attention mask and no dropout")
    if query.shape[0] != 1:
        raise ValueError("sdcp_ragged attention takes one (packed) sequence")
    if isinstance(key, SlotKV) and isinstance(value, SlotKV):
        return key.plan.attend(query, key.pool, value.pool, scaling), None
    if not isinstance(key, RaggedKV) or not isinstance(value, RaggedKV):
        output = _attend(query, key, value, scaling)  # type: ignore[arg-type]
    else:
        parts, start = [], 0
        for width, keys, values in zip(key.widths, key.per_session, value.per_session, strict=True):
            parts.append(_attend(query[:, :, start : start + width], keys, values, scaling))
            start += width
        output = torch.cat(parts, dim=2)
    return output.transpose(1, 2).contiguous(), None


def supports_ragged_attention(model: PreTrainedModel) -> bool:
    """Plain causal attention, the only kind `ragged_attention` computes: no sliding window, no
    logit soft-capping."""
    config = model.config
    return all(
        getattr(config, name, None) in (None, False)
        for name in ("sliding_window", "attn_logit_softcapping", "use_sliding_window")
    )


def use_ragged_attention(model: PreTrainedModel) -> None:
    """Make ``model`` (a copy owned by the caller) compute attention with `ragged_attention`."""
    _register_attention()
    model.config._attn_implementation = ATTENTION


def _register_attention() -> None:
    """Add `ragged_attention` to transformers' attention functions, once. Done when a model is set
    up rather than at import, so that importing this module leaves transformers as it was."""
    with _REGISTERING:
        if ATTENTION not in AttentionInterface():
            AttentionInterface.register(ATTENTION, ragged_attention)
