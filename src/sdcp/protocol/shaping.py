"""The logits a session's target distribution is computed from, at every position: the target's
rows as our session-open and sampling extensions shape them, before SDCP 4.1's temperature, top-k
and top-p (docs/interpretations.md, "Penalties, logit_bias and min_p", "Structured output").

At output index n, after the committed output o[1..n-1] and, while a proposal is verified, its
tokens x[1..i-1] before position i, the row is shaped in this order (vLLM's):

1. the contract's stop tokens at -inf before ``min_new``, and the constraint's disallowed tokens at
   -inf (``sdcp.protocol.constraint``);
2. ``logit_bias_milli``: each listed token's bias / 1000 added (ids beyond the row are ignored);
3. ``repetition_penalty_milli`` (r = value / 1000): every token in the prompt or in o and x before
   the position has its logit divided by r where it is positive, multiplied by r otherwise;
4. ``frequency_penalty_milli`` and ``presence_penalty_milli``: every token has
   ``frequency * c + presence * (c > 0)`` subtracted, c its count in o and x before the position
   (the output only, as OpenAI defines them; the prompt is not counted).

Each step is a function of the committed prefix and the proposal's tokens before the position, so
rule 1 takes the argmax of the shaped row and rule 2 computes p from it, exactly, whatever is
proposed: a proposal whose token repeats has that token counted once more at its second position.
min_p belongs to the distribution itself (``sdcp.protocol.sampling``): argmax-invariant, it does
not shape the logits.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence

import numpy as np

from sdcp.protocol.constraint import TokenConstraint, constrain_rows
from sdcp.protocol.logprobs import suppress_stops
from sdcp.protocol.messages import Sampling

__all__ = ["TargetLogits", "shapes_logits"]

_MILLI = 1000


def shapes_logits(sampling: Sampling | None) -> bool:
    """Whether ``sampling`` holds a member that changes the logits (a bias or a penalty)."""
    return sampling is not None and bool(
        sampling.logit_bias_milli
        or sampling.presence_penalty_milli
        or sampling.frequency_penalty_milli
        or (sampling.repetition_penalty_milli or _MILLI) != _MILLI
    )


class TargetLogits:
    """A session's shaping state at the verifier: the prompt's tokens, the committed output's counts
    and the constraint at the committed output; ``fork`` gives an independent copy that a greedy run
    advances on the scorer's thread."""

    def __init__(
        self,
        *,
        prompt: Sequence[int],
        stop: Sequence[int],
        min_new: int = 0,
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.constraint = constraint
        self.committed = 0
        self.stop = tuple(stop)
        self._min_new = min_new
        self._prompt = np.unique(np.asarray(prompt, dtype=np.int64))
        self._counts: Counter[int] = Counter()

    def fork(self) -> TargetLogits:
        copied = copy.copy(self)
        copied._counts = Counter(self._counts)
        copied.constraint = None if self.constraint is None else self.constraint.fork()
        return copied

    def commit(self, tokens: Sequence[int]) -> None:
        """Extend the committed output by ``tokens``; ValueError where the constraint refuses one
        (``TokenConstraint.commit``)."""
        if self.constraint is not None:
            self.constraint.commit(tokens)
        self._counts.update(tokens)
        self.committed += len(tokens)

    def rows(self, logits: np.ndarray, proposed: Sequence[int], sampling: Sampling | None) -> np.ndarray:
        """``logits`` (row j after the committed output and ``proposed[:j]``) shaped as the module
        says; rows after a token the constraint disallows are not defined. The caller's array is
        never changed."""
        if self.constraint is None:
            shaped = suppress_stops(logits, self.committed, self._min_new, self.stop)
        else:
            allowed = self.constraint.allowed(proposed)
            shaped = constrain_rows(logits, allowed, self.committed, self._min_new, self.stop)
        if not shapes_logits(sampling):
            return shaped
        assert sampling is not None
        rows = np.array(shaped, dtype=np.float64)
        view = rows.reshape(-1, rows.shape[-1])
        vocab = view.shape[-1]
        bias = [(token, value) for token, value in sampling.logit_bias_milli or () if token < vocab]
        bias_ids = np.array([token for token, _ in bias], dtype=np.int64)
        bias_values = np.array([value for _, value in bias], dtype=np.float64) / _MILLI
        repetition = (sampling.repetition_penalty_milli or _MILLI) / _MILLI
        frequency = (sampling.frequency_penalty_milli or 0) / _MILLI
        presence = (sampling.presence_penalty_milli or 0) / _MILLI
        prompt = self._prompt[self._prompt < vocab]
        counts = Counter(self._counts)
        for index, row in enumerate(view):
            if index > 0 and index <= len(proposed):
                # Row j counts the proposal's tokens before it: a repeat is penalised at its second place.
                counts[proposed[index - 1]] += 1
            row[bias_ids] += bias_values
            seen = np.array([token for token in counts if token < vocab], dtype=np.int64)
            if repetition != 1.0:
                repeated = np.union1d(prompt, seen)
                values = row[repeated]
                row[repeated] = np.where(values > 0, values / repetition, values * repetition)
            if seen.size and (frequency or presence):
                times = np.array([counts[token] for token in seen], dtype=np.float64)
                row[seen] -= frequency * times + presence
        return rows
