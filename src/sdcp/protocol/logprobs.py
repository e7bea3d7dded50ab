"""What a verifier tells a front end about its output besides the tokens, and holds back for it
(extensions of session-open and output, docs/interpretations.md): log-probabilities of the emitted
tokens, and stop tokens suppressed before a minimum output length."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sdcp.protocol.messages import Alternative, TokenLogprob

__all__ = ["LOGPROB_SCALE", "suppress_stops", "token_logprobs"]

# Log-probabilities travel as integers in millionths: SDCP bodies carry no floats.
LOGPROB_SCALE = 1_000_000


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
    """The log-probability of ``tokens[j]`` under the softmax of ``logits[j]``, unprocessed by
    temperature, top-k, top-p or suppression (as vLLM's default), and the ``top`` most probable
    tokens of each row, most probable first (ties to the smaller id)."""
    rows = np.asarray(logits, dtype=np.float64).reshape(-1, np.shape(logits)[-1])[: len(tokens)]
    shifted = rows - rows.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    entries = []
    for row, token in zip(logprobs, tokens, strict=True):
        entries.append(
            TokenLogprob(
                logprob=_scaled(row[token]),
                top=tuple(Alternative(token=t, logprob=_scaled(row[t])) for t in _most_probable(row, top)),
            )
        )
    return tuple(entries)


def suppress_stops(logits: np.ndarray, first_index: int, min_new: int, stop: Sequence[int]) -> np.ndarray:
    """``logits`` whose rows are for output indices ``first_index``, ``first_index + 1``, ...; the
    stop tokens get no probability in the rows before output index ``min_new``. The caller's array
    is never changed."""
    suppressed_rows = min(max(0, min_new - first_index), np.shape(logits)[0] if np.ndim(logits) > 1 else 1)
    if suppressed_rows == 0 or not stop:
        return logits
    rows = np.array(logits, dtype=np.float64)
    view = rows.reshape(-1, rows.shape[-1])
    view[:suppressed_rows, list(stop)] = -np.inf
    return rows


def _most_probable(row: np.ndarray, count: int) -> list[int]:
    if count == 0:
        return []
    candidates = np.argpartition(-row, count - 1)[:count] if count < row.size else np.arange(row.size)
    return sorted((int(t) for t in candidates), key=lambda t: (-row[t], t))


def _scaled(logprob: float) -> int:
    return max(-(2**63), min(0, round(float(logprob) * LOGPROB_SCALE)))
