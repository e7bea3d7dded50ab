"""The target distribution p of a sampling profile, and drawing a token from a distribution.

SDCP 4.1: p is the target model's next-token distribution after applying temperature, top-k and
top-p, in that order; a temperature of zero selects the most probable token, ties to the smallest
token id. The precise reading of each step (documented in docs/interpretations.md):

- temperature: logits are divided by ``temperature_milli / 1000``; absent means 1.0.
- min-p (extension, docs/interpretations.md, "Penalties, logit_bias and min_p"): keep the tokens
  whose probability is at least ``min_p_milli / 1000`` times the most probable one's, as vLLM does
  after temperature; 0 or absent means "not applied". It commutes with top-k (both keep the most
  probable tokens, and renormalising keeps the ratios), so its place before top-k is vLLM's order.
- top-k: keep the ``top_k`` most probable tokens (ties by ascending token id); ``top_k`` of 0 or
  absent, or ``top_k >= V``, means "not applied".
- top-p: on the distribution left by top-k (renormalised), keep the smallest set of most probable
  tokens, taken in descending probability with ties by ascending token id, whose cumulative mass is
  at least ``top_p_milli / 1000``; ``top_p_milli`` of 0 keeps the single most probable token, 1000
  or absent means "not applied".

Rows are computed in float64 with a log-sum-exp softmax so that large logits neither overflow nor
lose the small probabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sdcp.protocol.messages import Sampling

__all__ = ["InvalidDistribution", "draw_token", "target_distribution"]

_MILLI = 1000


class InvalidDistribution(ValueError):
    """Logits or probabilities that no distribution can be made from (NaN, +inf, all masked, ...)."""


def target_distribution(logits: np.ndarray, sampling: Sampling | None) -> np.ndarray:
    """Return p (float64, same shape as ``logits``) for 1-D ``(V,)`` or 2-D ``(n, V)`` logits."""
    rows = _as_logit_rows(logits)
    temperature_milli = sampling.temperature_milli if sampling is not None else None
    top_k = sampling.top_k if sampling is not None else None
    top_p_milli = sampling.top_p_milli if sampling is not None else None
    min_p_milli = sampling.min_p_milli if sampling is not None else None
    _check_profile(temperature_milli, top_k, top_p_milli)

    if temperature_milli == 0:
        # SDCP 4.1: temperature zero selects the most probable token; np.argmax returns the first
        # maximum, i.e. ties go to the smallest token id. Top-k and top-p keep a one-hot row as is.
        probs = np.zeros_like(rows)
        probs[np.arange(rows.shape[0]), np.argmax(rows, axis=-1)] = 1.0
    else:
        temperature = 1.0 if temperature_milli is None else temperature_milli / _MILLI
        probs = _softmax(rows / temperature)
        if min_p_milli:
            probs = _apply_min_p(probs, min_p_milli / _MILLI)
        if top_k:
            probs = _apply_top_k(probs, top_k)
        if top_p_milli is not None and top_p_milli < _MILLI:
            probs = _apply_top_p(probs, top_p_milli / _MILLI)
    return probs.reshape(np.shape(logits))


def draw_token(probs: np.ndarray, r: float) -> int:
    """Draw one token from ``probs`` with the uniform value ``r`` in [0, 1), by inverse CDF.

    The token is the smallest id t with ``cumsum(probs)[t] > r * sum(probs)``, so the draw is a pure
    function of (probs, r) and two verifiers with the same seed emit the same token. ``probs`` need
    not be normalised. A zero-probability token is never returned.
    """
    row = np.asarray(probs, dtype=np.float64)
    if row.ndim != 1 or row.size == 0:
        raise InvalidDistribution(f"draw_token needs one non-empty row, got shape {row.shape}")
    if not np.all(np.isfinite(row)) or np.any(row < 0):
        raise InvalidDistribution("probabilities must be finite and non-negative")
    if not 0.0 <= r < 1.0:
        raise ValueError(f"r must lie in [0, 1), got {r!r}")
    cumulative = np.cumsum(row)
    total = cumulative[-1]
    if total <= 0.0:
        raise InvalidDistribution("probabilities sum to zero")
    # For r < 1, round-to-nearest keeps r * total strictly below total, so some cumulative sum
    # exceeds it; the first one that does is larger than its predecessor, so its token has mass.
    return int(np.searchsorted(cumulative, r * total, side="right"))


def _as_logit_rows(logits: np.ndarray) -> np.ndarray:
    array = np.asarray(logits, dtype=np.float64)
    if array.ndim not in (1, 2) or array.shape[-1] == 0:
        raise InvalidDistribution(f"logits must be (V,) or (n, V) with V >= 1, got {array.shape}")
    rows = array.reshape(-1, array.shape[-1])
    if np.any(np.isnan(rows)) or np.any(rows == np.inf):
        raise InvalidDistribution("logits must not contain NaN or +inf")
    if np.any(np.all(rows == -np.inf, axis=-1)):
        raise InvalidDistribution("a logit row is entirely -inf")
    return rows


def _check_profile(temperature_milli: int | None, top_k: int | None, top_p_milli: int | None) -> None:
    for name, value in (("temperature_milli", temperature_milli), ("top_k", top_k)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be a uint, got {value}")
    if top_p_milli is not None and not 0 <= top_p_milli <= _MILLI:
        raise ValueError(f"top_p_milli must lie in 0..1000, got {top_p_milli}")


def _softmax(rows: np.ndarray) -> np.ndarray:
    shifted = rows - np.max(rows, axis=-1, keepdims=True)
    weights = np.exp(shifted)
    normalised: np.ndarray = weights / np.sum(weights, axis=-1, keepdims=True)
    return normalised


def _descending_order(probs: np.ndarray) -> np.ndarray:
    # A stable sort of -p lists tokens by descending probability, ties by ascending token id.
    return np.argsort(-probs, axis=-1, kind="stable")


def _keep_first(probs: np.ndarray, order: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Keep, in each row, the first ``counts[row]`` tokens of ``order`` and renormalise."""
    ranks = np.arange(probs.shape[-1])[np.newaxis, :]
    keep_sorted = ranks < counts[:, np.newaxis]
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    kept = np.where(keep, probs, 0.0)
    normalised: np.ndarray = kept / np.sum(kept, axis=-1, keepdims=True)
    return normalised


def _apply_top_k(probs: np.ndarray, top_k: int) -> np.ndarray:
    if top_k >= probs.shape[-1]:
        return probs
    counts = np.full(probs.shape[0], top_k)
    return _keep_first(probs, _descending_order(probs), counts)


def _apply_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    kept = np.where(probs >= min_p * np.max(probs, axis=-1, keepdims=True), probs, 0.0)
    normalised: np.ndarray = kept / np.sum(kept, axis=-1, keepdims=True)
    return normalised


def _apply_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = _descending_order(probs)
    cumulative = np.cumsum(np.take_along_axis(probs, order, axis=-1), axis=-1)
    # The kept prefix ends at the first rank whose cumulative mass reaches top_p; a row whose float
    # sum falls a hair short of top_p keeps every token.
    reached = cumulative >= top_p
    counts = np.where(np.any(reached, axis=-1), np.argmax(reached, axis=-1) + 1, probs.shape[-1])
    return _keep_first(probs, order, np.maximum(counts, 1))
