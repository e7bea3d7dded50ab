"""What self-decoding guesses the next tokens from (docs/interpretations.md, "Self-decoding with
lookahead"): the session's own tokens and the outputs of the sessions that finished here before it,
in the suffix drafter's structures (sdcp.models.suffix), co-located with the target.

The history is kept per contract key and owner, as a suffix drafter's is (docs/security.md): one
front end's outputs never shape another's guesses. A guess only decides how much a pass scores;
every token is still drawn from the target's own row.
"""

from __future__ import annotations

from sdcp.engines.verifier.live import LiveSession
from sdcp.models.suffix import DEFAULT_HISTORY_TOKENS, SharedHistory, SuffixIndex, history_key, plan_draft
from sdcp.protocol.messages import Action

__all__ = ["LOOKAHEAD_MIN_MATCH", "VerifierLookahead"]

# A match of fewer tokens rarely predicts the next one.
LOOKAHEAD_MIN_MATCH = 2


class VerifierLookahead:
    """Predictions for self-decoding sessions, and the history of the sessions that finished here
    (at most ``history_tokens`` tokens of output, the oldest outputs evicted first)."""

    def __init__(self, history_tokens: int = DEFAULT_HISTORY_TOKENS) -> None:
        self.history = SharedHistory(history_tokens)

    def predict(self, live: LiveSession, context: tuple[int, ...], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens after ``context`` (the session's prompt and decided tokens): the
        continuation that most often followed the longest suffix of it, in the session or in the
        history (sdcp.models.suffix.plan_draft)."""
        index = live.suffix_index
        if index is None or index.end > len(context):
            index = live.suffix_index = SuffixIndex()
        index.append(context[index.end :])
        steps = plan_draft(
            context,
            index,
            self.history.index(_history_key(live)),
            limit,
            min_match=LOOKAHEAD_MIN_MATCH,
            # As long as the match holds: how much of it a pass scores is the cost model's choice.
            spec_factor=float(limit),
        )
        return tuple(step.token for step in steps)

    def learn(self, live: LiveSession) -> None:
        """Keep the output of a session that finished (not one that failed or was fenced)."""
        machine = live.machine
        if machine.control.ended is Action.FINISH and not machine.fenced:
            self.history.learn(_history_key(live), machine.tokens)


def _history_key(live: LiveSession) -> bytes:
    owner = (live.owner or "").encode()
    return history_key(live.machine.contract) + len(owner).to_bytes(2, "big") + owner
