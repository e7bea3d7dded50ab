"""What self-decoding guesses the next tokens from (docs/interpretations.md, "Self-decoding with
lookahead"): the session's own tokens and the outputs of the sessions that finished here before it,
in the suffix drafter's structures (sdcp.models.suffix), co-located with the target.

The history is kept per history scope, as the drafters' shared history is (sdcp.engines.history,
docs/security.md): under the default policy one front end's outputs never shape another's guesses.
A guess only decides how much a pass scores; every token is still drawn from the target's own row.
"""

from __future__ import annotations

from collections.abc import Callable

from sdcp.config import HistoryScope
from sdcp.engines.history import history_scope_key
from sdcp.engines.verifier.live import LiveSession
from sdcp.models.suffix import DEFAULT_HISTORY_TOKENS, SharedHistory, SuffixIndex, plan_draft
from sdcp.protocol.messages import Action

__all__ = ["LOOKAHEAD_MIN_MATCH", "VerifierLookahead"]

# A match of fewer tokens rarely predicts the next one.
LOOKAHEAD_MIN_MATCH = 2


class VerifierLookahead:
    """Predictions for self-decoding sessions, and the history of the sessions that finished here
    (at most ``history_tokens`` tokens of output, the oldest outputs evicted first), kept per the
    scope ``policy`` names (the verifier's ``history_scope``)."""

    def __init__(
        self, policy: Callable[[], HistoryScope] = lambda: "owner", history_tokens: int = DEFAULT_HISTORY_TOKENS
    ) -> None:
        self.history = SharedHistory(history_tokens)
        self._policy = policy

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
            self.history.index(self._scope(live)),
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
            self.history.learn(self._scope(live), machine.tokens)

    def _scope(self, live: LiveSession) -> bytes:
        return history_scope_key(live.machine.contract, live.owner, self._policy())
