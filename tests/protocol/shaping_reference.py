"""The reference for penalties, logit_bias and min_p (docs/interpretations.md, "Penalties, logit_bias
and min_p"), written from the definitions (vLLM's sampler and OpenAI's penalties) rather than from
sdcp.protocol.shaping: one position's shaped logits, and the distribution that temperature and min_p
make of them. tests/protocol/test_shaping.py checks the verifier session against it; the engine and
service tests of penalties shape their reference decoding with it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from sdcp.protocol.messages import Sampling


def reference_logits(row: np.ndarray, prompt: Sequence[int], before: Sequence[int], sampling: Sampling) -> np.ndarray:
    """One position's shaped logits, written from vLLM's sampler: logit_bias, then the repetition
    penalty over the prompt and the output so far, then OpenAI's frequency and presence penalties
    over the output so far."""
    out = np.array(row, dtype=np.float64)
    for token, bias in sampling.logit_bias_milli or ():
        if token < len(out):
            out[token] += bias / 1000
    repetition = (sampling.repetition_penalty_milli or 1000) / 1000
    for token in set(prompt) | set(before):
        out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in Counter(before).items():
        out[token] -= (sampling.frequency_penalty_milli or 0) / 1000 * count
        out[token] -= (sampling.presence_penalty_milli or 0) / 1000
    return out


def reference_p(logits: np.ndarray, temperature: float, min_p: float) -> np.ndarray:
    """softmax(logits / temperature), then the tokens below min_p times the most probable dropped."""
    weights = np.exp((logits - logits.max()) / temperature)
    p = weights / weights.sum()
    kept = np.where(p >= min_p * p.max(), p, 0.0)
    normalised: np.ndarray = kept / kept.sum()
    return normalised
