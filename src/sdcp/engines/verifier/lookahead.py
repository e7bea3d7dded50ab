"""What self-decoding guesses the next tokens from (docs/interpretations.md, "Self-decoding with
lookahead"): the session's own tokens and the outputs of earlier finished sessions, in the suffix
drafter's structures (sdcp.models.lookup.suffix), co-located with the target.

The earlier outputs are those of the sessions that finished here, learned at their end, and those
of the session's history scope in the MLC (sdcp.engines.history), which the verifiers publish and
the drafters read: read with the drafters' ``HistoryReader`` when a session of the scope opens here,
so that a restarted verifier, or a second one, guesses from what the others finished. The history is
kept per history scope, as the drafters' shared history is (docs/security.md): under the default
policy one front end's outputs never shape another's guesses. A guess only decides how much a pass
scores; every token is still drawn from the target's own row.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from sdcp.config import HistoryScope
from sdcp.engines.history import HistoryReader, entry_uri, history_scope_key, index_uri
from sdcp.engines.verifier.live import LiveSession
from sdcp.models.lookup.suffix import DEFAULT_HISTORY_TOKENS, SharedHistory, SuffixIndex, plan_draft
from sdcp.protocol.messages import Action, Contract

__all__ = ["LOOKAHEAD_MIN_MATCH", "VerifierLookahead"]

log = logging.getLogger("sdcp.verifier")

# A match of fewer tokens rarely predicts the next one.
LOOKAHEAD_MIN_MATCH = 2
# Entries of sessions that finished here, remembered so that the MLC's copy is not learned again:
# more than a reader takes from one scope at a time (sdcp.engines.history.DEFAULT_HISTORY_ENTRIES).
_HELD_ENTRIES = 4096


class VerifierLookahead:
    """Predictions for self-decoding sessions, and the history of earlier finished sessions (at
    most ``history_tokens`` tokens of output, the oldest outputs evicted first), kept per the scope
    ``policy`` names (the verifier's ``history_scope``); ``reader``, where given, reads the scopes'
    entries from the MLC, of which outputs with a token outside the target's ``vocab_size`` are
    not kept (a guess is fed to the target as it is)."""

    def __init__(
        self,
        policy: Callable[[], HistoryScope] = lambda: "owner",
        history_tokens: int = DEFAULT_HISTORY_TOKENS,
        *,
        reader: HistoryReader | None = None,
        vocab_size: int = 0,
    ) -> None:
        if reader is not None and vocab_size < 1:
            raise ValueError(f"a lookahead that reads the MLC needs the target's vocabulary size, got {vocab_size}")
        self.history = SharedHistory(history_tokens)
        self._policy = policy
        self._reader = reader
        self._vocab_size = vocab_size
        # The MLC entry URIs under which the sessions learned here are published, oldest first.
        self._held: OrderedDict[str, None] = OrderedDict()

    def predict(self, live: LiveSession, context: tuple[int, ...], limit: int) -> tuple[int, ...]:
        """Up to ``limit`` tokens after ``context`` (the session's prompt and decided tokens): the
        continuation that most often followed the longest suffix of it, in the session or in the
        history (sdcp.models.lookup.suffix.plan_draft)."""
        index = live.suffix_index
        if index is None or index.end > len(context):
            index = live.suffix_index = SuffixIndex()
        index.append(context[index.end :])
        steps = plan_draft(
            context,
            index,
            self.history.index(self._scope(live.machine.contract, live.owner, live.tenant)),
            limit,
            min_match=LOOKAHEAD_MIN_MATCH,
            # As long as the match holds: how much of it a pass scores is the cost model's choice.
            spec_factor=float(limit),
        )
        return tuple(step.token for step in steps)

    def learn(self, live: LiveSession) -> None:
        """Keep the output of a session that finished here (not one that failed or was fenced)."""
        machine = live.machine
        if machine.control.ended is not Action.FINISH or machine.fenced:
            return
        key = self._scope(machine.contract, live.owner, live.tenant)
        self.history.learn(key, machine.tokens)
        if self._reader is not None:
            # Where this verifier publishes it (sdcp.engines.verifier.history): not read back.
            held = entry_uri(self._reader.mlc.authority, machine.contract, key, machine.session, machine.epoch)
            self._held[held] = None
            while len(self._held) > _HELD_ENTRIES:
                self._held.popitem(last=False)

    async def refresh(self, contract: Contract, owner: str | None, tenant: str | None = None) -> None:
        """Learn the entries of the history scope of a session of ``contract``, ``owner`` and ``tenant`` that
        were published since the last look (at most once per the reader's ``refresh_s``), those
        of sessions learned here excepted. A store that does not answer costs the history only."""
        reader = self._reader
        if reader is None:
            return
        key = self._scope(contract, owner, tenant)
        index = index_uri(reader.mlc.authority, contract, key)
        if not reader.due(index):
            return

        async def learn(output: tuple[int, ...]) -> None:
            if max(output) < self._vocab_size:
                self.history.learn(key, output)

        try:
            await reader.refresh(index, learn, self._held.__contains__)
        except Exception as exc:  # noqa: BLE001 - the history only makes guesses longer
            log.warning("history %s not read for the lookahead: %r", index, exc)

    def _scope(self, contract: Contract, owner: str | None, tenant: str | None) -> bytes:
        return history_scope_key(contract, owner, self._policy(), tenant)
