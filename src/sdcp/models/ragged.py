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
registered with transformers as ``"sdcp_ragged"``, computes plain causal softmax attention with
torch's scaled_dot_product_attention: per session for a `RaggedBatchCache`, and directly for an
ordinary cache of one sequence (prefill and single-session passes). The queries of a request are
the last ``width`` positions of its keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, PreTrainedModel

__all__ = ["ATTENTION", "RaggedBatchCache", "RaggedKV", "ragged_attention", "supports_ragged_attention", "use_ragged_attention"]

ATTENTION = "sdcp_ragged"


@dataclass
class RaggedKV:
    """One layer's keys (or values) for a packed pass: per session ``(1, kv_heads, length, dim)``."""

    per_session: list[torch.Tensor]
    widths: Sequence[int]


@dataclass
class RaggedBatchCache:
    """The cache a packed pass sees: the next ``widths[i]`` positions extend ``caches[i]``."""

    caches: Sequence[DynamicCache]
    widths: Sequence[int]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: Any
    ) -> tuple[RaggedKV, RaggedKV]:
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
        query, keys, values, attn_mask=mask, is_causal=1 < queries == length, scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | RaggedKV,
    value: torch.Tensor | RaggedKV,
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
    if not isinstance(key, RaggedKV) or not isinstance(value, RaggedKV):
        output = _attend(query, key, value, scaling)  # type: ignore[arg-type]
    else:
        parts, start = [], 0
        for width, keys, values in zip(key.widths, key.per_session, value.per_session, strict=True):
            parts.append(_attend(query[:, :, start : start + width], keys, values, scaling))
            start += width
        output = torch.cat(parts, dim=2)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, ragged_attention)


def supports_ragged_attention(model: PreTrainedModel) -> bool:
    """Plain causal attention, the only kind `ragged_attention` computes: no sliding window, no
    logit soft-capping."""
    config = model.config
    return all(getattr(config, name, None) in (None, False) for name in ("sliding_window", "attn_logit_softcapping", "use_sliding_window"))


def use_ragged_attention(model: PreTrainedModel) -> None:
    """Make ``model`` (a copy owned by the caller) compute attention with `ragged_attention`."""
    model.config._attn_implementation = ATTENTION
