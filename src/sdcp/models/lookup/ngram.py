"""The prompt-lookup (n-gram) drafter (draft-li-sdcp, 6.2): no model, proposals copied from the
session's own tokens."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from sdcp.models.backend import SessionId
from sdcp.models.drafter import DraftSession, SessionDrafter, one_hot_rows
from sdcp.protocol.messages import Sampling


class NgramDrafter(SessionDrafter[DraftSession]):
    """Prompt-lookup drafting: continue the most recent earlier occurrence of the longest suffix.

    Proposals are deterministic and their q rows are one-hot (a point mass on the proposed token),
    which is the exact distribution the token was drawn from, so rule 2 stays exact.
    """

    def __init__(self, vocab_size: int, *, n_max: int = 3, n_min: int = 1) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        super().__init__(name="ngram", runs_inline=True, seconds_per_token=1e-5)
        self._vocab_size = vocab_size
        self.n_max = n_max
        self.n_min = n_min

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def weights_digest(self) -> bytes:
        # An n-gram drafter has no weights; its digest names the algorithm and its parameters so
        # that a contract's "drafters" list can permit or exclude it.
        label = f"sdcp-ngram-drafter-2:n_max={self.n_max}:n_min={self.n_min}"
        return hashlib.sha256(label.encode("ascii")).digest()

    def prepare(self) -> None:
        return None  # no model: nothing to hash or pack

    def set_threads(self, threads: int) -> None:
        return None  # no model: it drafts on the calling thread alone

    def _new_session(self, tokens: list[int]) -> DraftSession:
        return DraftSession(tokens)

    def _draft(
        self,
        session: SessionId,
        state: DraftSession,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None,
    ) -> tuple[list[int], np.ndarray]:
        # No match: repeat the last token once, a deterministic proposal with a one-hot row.
        proposed = prompt_lookup(state.tokens, m, n_max=self.n_max, n_min=self.n_min) or [state.tokens[-1]]
        # Drafted tokens stay tentative until `sync` confirms them.
        state.tokens.extend(proposed)
        return proposed, one_hot_rows(proposed, self._vocab_size)


def prompt_lookup(tokens: Sequence[int], m: int, *, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Up to m tokens that followed the most recent earlier occurrence of the longest suffix
    (n_max down to n_min tokens long); empty without such an occurrence.

    The continuation is copied as it stands, as transformers' prompt lookup does: text that repeats
    its context repeats whole runs, so one match predicts many tokens. Fewer than m come back when
    the occurrence is close to the end.
    """
    tokens = list(tokens)
    if len(tokens) < 2:
        return []
    last = tokens[-1]
    # Every occurrence ends where the last token occurs earlier: found in one pass, then the
    # longest suffix checked at each end, most recent first (the verifier does this per token).
    ends = [index for index, token in enumerate(tokens[:-1]) if token == last]
    ends.reverse()
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for end in ends:
            if end >= n - 1 and tokens[end - n + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + m]
    return []
