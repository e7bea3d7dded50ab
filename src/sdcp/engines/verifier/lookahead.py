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

How much of a prediction is worth scoring depends on how often such predictions were right, and
that depends on the match they continue (SuffixDecoding's insight): two tokens of the session that
also occurred elsewhere say little of what follows, while an earlier answer whose last 32 tokens
equal this one's is likely to go on as this one will (under rule 1 the target's tokens are a
function of the session's tokens alone: a request sent again is answered again token for token).
The hit rate is therefore kept per class of match, by where the match was found (the session's own
tokens or the history) and its length's power of two, and per history scope, as the history is.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sdcp.config import HistoryScope
from sdcp.engines.history import HistoryReader, entry_uri, history_scope_key, index_uri
from sdcp.engines.verifier.live import LiveSession
from sdcp.models.backend import common_prefix_length
from sdcp.models.lookup.suffix import (
    DEFAULT_HISTORY_TOKENS,
    DEFAULT_MAX_PATTERN,
    SharedHistory,
    SuffixIndex,
    find_draft,
)
from sdcp.protocol.drafter import AcceptanceEstimate
from sdcp.protocol.messages import Action, Contract

__all__ = [
    "LOOKAHEAD_MIN_MATCH",
    "LOOKAHEAD_PRIOR_HIT_RATE",
    "LOOKAHEAD_PROMPT_TAIL",
    "Prediction",
    "VerifierLookahead",
]

log = logging.getLogger("sdcp.verifier")

# A match of fewer tokens rarely predicts the next one.
LOOKAHEAD_MIN_MATCH = 2
# Prompt tokens kept before a finished session's output in the history (VerifierLookahead.learn):
# the longest match a lookup looks for (sdcp.models.lookup.suffix.DEFAULT_MAX_PATTERN).
LOOKAHEAD_PROMPT_TAIL = DEFAULT_MAX_PATTERN
# A class of match never judged guesses as if 40 % of its predicted tokens had been right: below
# what a lone session's guess needs to pay on a 2-core CPU (docs/performance.md), so that nothing is
# scored on a guess before its class has been right.
LOOKAHEAD_PRIOR_HIT_RATE = 0.4
# History scopes whose hit rates are kept, the least recently judged forgotten first.
_HELD_SCOPES = 1024
# Entries of sessions that finished here, remembered so that the MLC's copy is not learned again:
# more than a reader takes from one scope at a time (sdcp.engines.history.DEFAULT_HISTORY_ENTRIES).
_HELD_ENTRIES = 4096


MatchClass = tuple[bool, int]


@dataclass(frozen=True)
class Prediction:
    """The lookahead's tokens after a context; ``match``: the class of the match they continue (in
    the history or the session's own tokens, its length's power of two), None where nothing was
    predicted; ``scope``: the history scope whose hit rates judge it."""

    tokens: tuple[int, ...] = ()
    match: MatchClass | None = None
    scope: bytes = b""
    # The share of the tokens of earlier predictions of its class and scope that were right.
    hit_rate: float = 0.0


def _match_class(shared: bool, length: int) -> MatchClass:
    return shared, length.bit_length()


class VerifierLookahead:
    """Predictions for self-decoding sessions, and the history of earlier finished sessions (at
    most ``history_tokens`` tokens of output, each after its prompt's last tokens, the oldest
    evicted first), kept per the scope
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
        # Per history scope, the per-token hit rate of each class of match (module doc).
        self._hit_rates: OrderedDict[bytes, dict[MatchClass, AcceptanceEstimate]] = OrderedDict()

    def predict(self, live: LiveSession, context: tuple[int, ...], limit: Callable[[float], int] | int) -> Prediction:
        """Tokens after ``context`` (the session's prompt and decided tokens): the continuation
        that most often followed the longest suffix of it, in the session or in the history
        (sdcp.models.lookup.suffix.find_draft), as long as the match holds, up to ``limit``: a
        number, or what it says of the hit rate of the prediction's class of match, before any
        token is walked (the cost model's choice)."""
        index = live.suffix_index
        if index is None or index.end > len(context):
            index = live.suffix_index = SuffixIndex()
        index.append(context[index.end :])
        scope = self._scope(live.machine.contract, live.owner, live.tenant)
        draft = find_draft(context, index, self.history.index(scope), min_match=LOOKAHEAD_MIN_MATCH)
        if draft.match == 0:
            return Prediction(scope=scope)
        match = _match_class(draft.shared, draft.match)
        hit_rate = self._rate(scope, match)
        steps = draft.take(limit if isinstance(limit, int) else limit(hit_rate))
        return Prediction(tuple(step.token for step in steps), match, scope, hit_rate)

    def hit_rate(self, prediction: Prediction) -> float:
        """The share of the tokens of earlier predictions of its class and scope that were right
        (LOOKAHEAD_PRIOR_HIT_RATE before the first is judged; 0 for no prediction)."""
        return 0.0 if prediction.match is None else self._rate(prediction.scope, prediction.match)

    def judged(self, prediction: Prediction) -> bool:
        """Whether predictions of its class and scope have been judged (its hit rate is not the
        prior); True for no prediction, which has nothing to learn."""
        if prediction.match is None:
            return True
        rates = self._hit_rates.get(prediction.scope)
        return rates is not None and prediction.match in rates

    def _rate(self, scope: bytes, match: MatchClass) -> float:
        rates = self._hit_rates.get(scope)
        estimate = None if rates is None else rates.get(match)
        return LOOKAHEAD_PRIOR_HIT_RATE if estimate is None else estimate.alpha

    def judge(self, prediction: Prediction, decided: Sequence[int]) -> None:
        """The tokens a pass's rounds decided against the prediction for them, judged as a drafter's
        proposal is: the tokens right up to the first wrong one, if any (a prediction longer than
        what was decided is judged on its first tokens). Not by its first token alone: at 16
        streams that hit rate stood at 0.99 to 1.00, every session scored 16-token guesses, and
        passes of 272 rows took 2.3 s where 16 rows take 90 ms (docs/performance.md, session 26)."""
        compared = min(len(prediction.tokens), len(decided))
        if prediction.match is None or not compared:
            return
        rates = self._hit_rates.get(prediction.scope)
        if rates is None:
            rates = self._hit_rates[prediction.scope] = {}
            while len(self._hit_rates) > _HELD_SCOPES:
                self._hit_rates.popitem(last=False)
        else:
            self._hit_rates.move_to_end(prediction.scope)
        estimate = rates.get(prediction.match)
        if estimate is None:
            estimate = rates[prediction.match] = AcceptanceEstimate(prior_alpha=LOOKAHEAD_PRIOR_HIT_RATE)
        estimate.update(common_prefix_length(prediction.tokens, decided), compared)

    def learn(self, live: LiveSession) -> None:
        """Keep the output of a session that finished here (not one that failed or was fenced),
        after the last LOOKAHEAD_PROMPT_TAIL tokens of its prompt: a request sent again then
        matches its earlier answer from its first token on (the output alone matches only once a
        few tokens of it have been decided)."""
        machine = live.machine
        if machine.control.ended is not Action.FINISH or machine.fenced:
            return
        key = self._scope(machine.contract, live.owner, live.tenant)
        self.history.learn(key, (*machine.prompt[-LOOKAHEAD_PROMPT_TAIL:], *machine.tokens))
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
