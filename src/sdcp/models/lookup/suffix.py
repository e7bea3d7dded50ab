"""The suffix drafter (draft-li-sdcp, 6.2): proposals copied from where the session's latest tokens
occurred before, in its own prompt and output or in the committed outputs of earlier sessions.

The idea is SuffixDecoding's (Oliaro et al., NeurIPS 2025): a per-session structure over prompt and
output, a shared one over earlier sessions' outputs, continuations ranked by how often they followed
the match, and a proposal only as long as it is likely to be accepted. The structures are our own:

- ``SuffixIndex`` holds token texts with hash chains, as a compressor finds earlier matches: for a
  few window lengths (``_CHAIN_ORDERS``), each position points to the previous position whose last
  tokens hash alike. Appending a token costs one dictionary update per order; a lookup walks a
  bounded number of chain entries and checks each candidate backwards, so a hash collision costs a
  comparison, never a wrong match. A session's tail is undone exactly (``truncate``) and a shared
  index drops its oldest text whole (``evict_oldest_text``), each in time proportional to the tokens
  removed.
- ``SharedHistory`` keeps one index per history key within one token budget.
- ``find_draft`` finds the longest match and walks its most frequent continuation; ``plan_draft``
  takes as much of the walk as the match's length allows.

Proposals are deterministic, so their q rows are one-hot: the distribution each token was drawn
from (docs/interpretations.md, "Suffix drafter rows under rule 2").
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from sdcp.models.backend import SessionId, checked_tokens
from sdcp.models.drafter import DraftSession, SessionDrafter, one_hot_rows
from sdcp.protocol.messages import Contract, Sampling

__all__ = [
    "DEFAULT_HISTORY_TOKENS",
    "DEFAULT_MIN_PROBABILITY",
    "Draft",
    "DraftStep",
    "HistorySize",
    "Match",
    "SharedHistory",
    "SharesHistory",
    "SuffixDrafter",
    "SuffixIndex",
    "find_draft",
    "history_key",
    "plan_draft",
]

# Window lengths with a hash chain. A lookup starts at the longest that the context allows and
# extends each candidate backwards up to the pattern limit, so the longest match is found wherever
# one of its recent occurrences is reachable from some chain; each order costs 8 bytes a token.
_CHAIN_ORDERS = (1, 2, 4, 8, 16)
# Chain entries a lookup examines per order, most recent first. It bounds a lookup's time (the drafter
# runs on the service's event loop), and continuations are ranked by these most recent occurrences.
_OCCURRENCES_EXAMINED = 64
# Stands before each text of a shared index: no window crosses it and no continuation runs into it.
_SEPARATOR = -1
_BYTES_PER_ARRAY_ITEM = 8
# A dictionary entry's key and value objects (CPython ints of a hash and a position).
_BYTES_PER_CHAIN_HEAD = 64

DEFAULT_MAX_PATTERN = 32
# A drafted token pays when the probability that it is accepted exceeds what verifying its row costs,
# as a share of a verification pass: one accepted token saves about one pass. On the project's
# default backend (llama.cpp on a CPU) a row costs about a quarter of a one-token pass (3.5 of 14 ms,
# docs/models.md); on torch or a GPU far less, where a lower threshold drafts more.
DEFAULT_MIN_PROBABILITY = 0.25
# Tokens drafted per token of the match, at most (SuffixDecoding's max_spec_factor): the shares of a
# short match seen once say "certain" on little evidence, so a proposal grows with the match.
DEFAULT_SPEC_FACTOR = 1.0
# Tokens of earlier sessions' output kept for all history keys together: at about 360 bytes a token
# (docs/models.md, "Suffix drafter"), about 45 MiB.
DEFAULT_HISTORY_TOKENS = 1 << 17


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context found in an index: its length, and the positions where its
    most recent occurrences end (each followed by a token), most recent first."""

    length: int
    ends: tuple[int, ...]


class SuffixIndex:
    """Token texts with hash chains over their windows (see the module's docstring).

    Positions are absolute: they keep counting when the oldest texts are evicted. A session's index
    is one text that grows and has its tail undone; a shared index is a sequence of texts, each
    preceded by a separator, evicted oldest first.
    """

    def __init__(self) -> None:
        self._tokens = array("q")
        # Per order: the previous position whose window hashes alike (-1: none), and each hash's latest.
        self._previous = [array("q") for _ in _CHAIN_ORDERS]
        self._latest: list[dict[int, int]] = [{} for _ in _CHAIN_ORDERS]
        self._offset = 0  # the absolute position of self._tokens[0]
        self._live_from = 0  # positions before it were evicted
        self._text_start = 0  # where the last text began
        self._texts: deque[tuple[int, int]] = deque()  # (separator, end) of each added text

    @property
    def end(self) -> int:
        """The position after the last token."""
        return self._offset + len(self._tokens)

    @property
    def text_count(self) -> int:
        return len(self._texts)

    @property
    def approx_bytes(self) -> int:
        arrays = len(self._tokens) * (1 + len(_CHAIN_ORDERS)) * _BYTES_PER_ARRAY_ITEM
        heads = sum(sys.getsizeof(latest) + _BYTES_PER_CHAIN_HEAD * len(latest) for latest in self._latest)
        return arrays + heads

    def append(self, tokens: Iterable[int]) -> None:
        """Extend the last text (a session's committed prefix)."""
        for token in tokens:
            position = self.end
            self._tokens.append(token)
            for order_index, order in enumerate(_CHAIN_ORDERS):
                key = self._window_key(position, order, self._text_start)
                previous = -1
                if key is not None:
                    latest = self._latest[order_index]
                    previous = latest.get(key, -1)
                    latest[key] = position
                self._previous[order_index].append(previous)

    def add_text(self, tokens: Sequence[int]) -> None:
        """A text of its own (an earlier session's output): no match or continuation crosses into it."""
        separator = self.end
        self._tokens.append(_SEPARATOR)
        for previous in self._previous:
            previous.append(-1)
        self._text_start = separator + 1
        self.append(tokens)
        self._texts.append((separator, self.end))

    def truncate(self, length: int) -> None:
        """Forget the tokens from position ``length`` on, restoring the chains as they were before
        those tokens came (a session's rejected or replaced tail)."""
        for position in range(self.end - 1, length - 1, -1):
            for order_index, order in enumerate(_CHAIN_ORDERS):
                key = self._window_key(position, order, self._text_start)
                if key is None:
                    continue
                previous = self._previous[order_index][position - self._offset]
                if previous < 0:
                    del self._latest[order_index][key]
                else:
                    self._latest[order_index][key] = previous
        kept = max(0, length - self._offset)
        del self._tokens[kept:]
        for previous_positions in self._previous:
            del previous_positions[kept:]

    def evict_oldest_text(self) -> int:
        """Drop the oldest added text whole; how many tokens it held."""
        separator, end = self._texts.popleft()
        text_start = separator + 1
        for position in range(text_start, end):
            for order_index, order in enumerate(_CHAIN_ORDERS):
                key = self._window_key(position, order, text_start)
                # A later window with this hash keeps the key: its chain stops at evicted positions.
                if key is not None and self._latest[order_index].get(key) == position:
                    del self._latest[order_index][key]
        self._live_from = end
        dead = self._live_from - self._offset
        # Compacting once the dead part outweighs the live one keeps eviction amortised O(tokens).
        if dead > len(self._tokens) // 2:
            del self._tokens[:dead]
            for previous_positions in self._previous:
                del previous_positions[:dead]
            self._offset = self._live_from
        return end - text_start

    def next_token(self, position: int) -> int | None:
        """The token after ``position`` in the same text, if there is one."""
        index = position + 1 - self._offset
        if index >= len(self._tokens):
            return None
        token = self._tokens[index]
        return None if token == _SEPARATOR else token

    def longest_match(self, context: Sequence[int], max_length: int, min_length: int = 1) -> Match | None:
        """The longest suffix of ``context`` (at most ``max_length`` tokens) that occurs here followed
        by a token, with its most recent occurrences; None when not even its last token does, or
        may be None when none of ``min_length`` tokens does: the chains of orders below the longest
        one within ``min_length`` are not walked (each match of that length or more is in that
        chain, as recent there as in theirs)."""
        longest_order = min(max_length, len(context))
        shortest_order = max(order for order in _CHAIN_ORDERS if order <= max(1, min_length))
        for order_index in reversed(range(len(_CHAIN_ORDERS))):
            order = _CHAIN_ORDERS[order_index]
            if order > longest_order or order < shortest_order:
                continue
            found: list[tuple[int, int]] = []
            position = self._latest[order_index].get(hash(tuple(context[-order:])), -1)
            for _ in range(_OCCURRENCES_EXAMINED):
                if position < self._live_from:
                    break
                if self.next_token(position) is not None:
                    length = self._match_length(position, context, max_length)
                    if length >= order:  # shorter: another window with the same hash
                        found.append((position, length))
                position = self._previous[order_index][position - self._offset]
            if found:
                longest = max(length for _, length in found)
                return Match(longest, tuple(position for position, length in found if length == longest))
        return None

    def _match_length(self, position: int, context: Sequence[int], limit: int) -> int:
        """How many of the context's last tokens end at ``position`` (a separator stops the count)."""
        index = position - self._offset
        bound = min(limit, len(context), index + 1)
        length = 0
        while length < bound and self._tokens[index - length] == context[-1 - length]:
            length += 1
        return length

    def _window_key(self, position: int, order: int, text_start: int) -> int | None:
        """The hash of the ``order`` tokens ending at ``position``; None where they would reach
        before the text's start."""
        first = position - order + 1
        if first < text_start:
            return None
        index = first - self._offset
        return hash(tuple(self._tokens[index : index + order]))


@dataclass(frozen=True)
class HistorySize:
    """What a shared history holds, and its bound, for metrics, status reports and sizing."""

    tokens: int
    sessions: int
    approx_bytes: int
    max_tokens: int


class SharedHistory:
    """The committed outputs of earlier sessions: one index per history key, all within one token
    budget. A new output makes room by evicting the oldest outputs whole, whatever their key; an
    output longer than the whole budget is not kept."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must not be negative, got {max_tokens}")
        self.max_tokens = max_tokens
        self._indexes: dict[bytes, SuffixIndex] = {}
        self._arrivals: deque[tuple[bytes, int]] = deque()  # (key, tokens) of each output, oldest first
        self._tokens = 0

    def learn(self, key: bytes, output: Sequence[int]) -> None:
        if not output or len(output) > self.max_tokens:
            return
        while self._tokens + len(output) > self.max_tokens:
            self._evict_oldest()
        self._indexes.setdefault(key, SuffixIndex()).add_text(output)
        self._arrivals.append((key, len(output)))
        self._tokens += len(output)

    def index(self, key: bytes) -> SuffixIndex | None:
        return self._indexes.get(key)

    @property
    def size(self) -> HistorySize:
        return HistorySize(
            tokens=self._tokens,
            sessions=len(self._arrivals),
            approx_bytes=sum(index.approx_bytes for index in self._indexes.values()),
            max_tokens=self.max_tokens,
        )

    def _evict_oldest(self) -> None:
        key, tokens = self._arrivals.popleft()
        index = self._indexes[key]
        index.evict_oldest_text()
        self._tokens -= tokens
        if index.text_count == 0:
            del self._indexes[key]


@dataclass(frozen=True)
class DraftStep:
    """A drafted token and the estimated probability that it and every token before it are accepted."""

    token: int
    probability: float


@dataclass
class _Continuation:
    """How often ``token`` followed the match: in the session itself and in the shared history."""

    token: int
    own: int = 0
    shared: int = 0
    own_latest: int = -1
    shared_latest: int = -1

    @property
    def count(self) -> int:
        return self.own + self.shared

    def rank(self) -> tuple[int, int, int, int]:
        # Ties go to the session's own evidence, then to the continuation seen most recently.
        return (self.count, self.own, self.own_latest, self.shared_latest)


def plan_draft(
    context: Sequence[int],
    own: SuffixIndex,
    shared: SuffixIndex | None,
    m: int,
    *,
    max_pattern: int = DEFAULT_MAX_PATTERN,
    min_match: int = 1,
    min_probability: float = DEFAULT_MIN_PROBABILITY,
    spec_factor: float = DEFAULT_SPEC_FACTOR,
) -> list[DraftStep]:
    """Up to ``m`` tokens continuing ``context``, from the longest suffix of it (at most
    ``max_pattern`` tokens) found in the session's own index or the shared one (`find_draft`): at
    most ``spec_factor`` tokens per matched token. Empty without a match of ``min_match`` tokens.
    """
    draft = find_draft(
        context, own, shared, max_pattern=max_pattern, min_match=min_match, min_probability=min_probability
    )
    return draft.take(min(m, max(1, int(spec_factor * draft.match))))


@dataclass
class Draft:
    """The longest match of a context's suffix (``match`` tokens, 0 where none of the minimum was
    found; ``shared``: in the shared index, longer than any in the session's own) and the walk of
    its continuation, taken once (`take`)."""

    match: int
    shared: bool
    _walk: Iterator[DraftStep]

    def take(self, m: int) -> list[DraftStep]:
        """The walk's next ``m`` steps at most."""
        return list(itertools.islice(self._walk, max(0, m)))


def find_draft(
    context: Sequence[int],
    own: SuffixIndex,
    shared: SuffixIndex | None,
    *,
    max_pattern: int = DEFAULT_MAX_PATTERN,
    min_match: int = 1,
    min_probability: float = DEFAULT_MIN_PROBABILITY,
) -> Draft:
    """The longest suffix of ``context`` (at most ``max_pattern`` tokens) found in the session's own
    index or the shared one, and the walk after it, computed as it is taken: each step proposes the
    continuation that most often followed the match in both indexes together and narrows the match to
    the occurrences it continued. A token's estimated acceptance is its share of the step's
    continuations times the previous tokens'; the walk stops before a token whose estimate falls
    below ``min_probability`` (the first token always comes: a proposal has one at least)."""
    own_match = own.longest_match(context, max_pattern, min_match)
    # A shared match shorter than the session's own is not used: its lookup need not look for one.
    at_least = max(min_match, own_match.length if own_match is not None else 0)
    shared_match = shared.longest_match(context, max_pattern, at_least) if shared is not None else None
    length = max((match.length for match in (own_match, shared_match) if match is not None), default=0)
    if length < min_match:
        return Draft(0, False, iter(()))
    in_own = own_match is not None and own_match.length == length
    # Only occurrences of the longest match count: an index whose longest is shorter has none.
    walk = _walk(own, _ends_of(own_match, length), shared, _ends_of(shared_match, length), min_probability)
    return Draft(length, not in_own, walk)


def _walk(
    own: SuffixIndex,
    own_ends: list[int],
    shared: SuffixIndex | None,
    shared_ends: list[int],
    min_probability: float,
) -> Iterator[DraftStep]:
    probability = 1.0
    first = True
    while True:
        continuations = _continuations(own, own_ends, shared, shared_ends)
        if not continuations:
            return
        best = max(continuations, key=_Continuation.rank)
        probability *= best.count / sum(continuation.count for continuation in continuations)
        if not first and probability < min_probability:
            return
        first = False
        yield DraftStep(best.token, probability)
        own_ends = [end + 1 for end in own_ends if own.next_token(end) == best.token]
        if shared is not None:
            shared_ends = [end + 1 for end in shared_ends if shared.next_token(end) == best.token]


def _ends_of(match: Match | None, length: int) -> list[int]:
    return list(match.ends) if match is not None and match.length == length else []


def _continuations(
    own: SuffixIndex, own_ends: list[int], shared: SuffixIndex | None, shared_ends: list[int]
) -> list[_Continuation]:
    found: dict[int, _Continuation] = {}
    for end in own_ends:
        token = own.next_token(end)
        if token is not None:
            continuation = found.setdefault(token, _Continuation(token))
            continuation.own += 1
            continuation.own_latest = max(continuation.own_latest, end)
    if shared is not None:
        for end in shared_ends:
            token = shared.next_token(end)
            if token is not None:
                continuation = found.setdefault(token, _Continuation(token))
                continuation.shared += 1
                continuation.shared_latest = max(continuation.shared_latest, end)
    return list(found.values())


def history_key(contract: Contract) -> bytes:
    """Which sessions draft from each other's committed output: those whose contracts name the same
    target, tokenizer and KVSP scope (docs/interpretations.md, "Whose output a suffix drafter shares").
    """
    return contract.target + contract.tokenizer + (contract.scope or b"")


@runtime_checkable
class SharesHistory(Protocol):
    """A drafter that drafts from earlier sessions' committed output (the suffix drafter): the engine
    names each session's history key, and hands over finished sessions' outputs by key, whichever
    instance drafted them (sdcp.engines.history)."""

    def bind_history(self, session: SessionId, key: bytes) -> None: ...

    def learn(self, key: bytes, output: Sequence[int]) -> None: ...

    @property
    def history_size(self) -> HistorySize: ...


@dataclass
class _SuffixSession(DraftSession):
    # Over the synced tokens only: drafted ones are not evidence until a verdict commits them.
    index: SuffixIndex
    history: bytes = b""


class SuffixDrafter(SessionDrafter[_SuffixSession]):
    """Drafts from the session's own tokens and the committed outputs of earlier sessions that share
    its history key; no model, so it runs on the caller's thread (``runs_inline``)."""

    def __init__(
        self,
        vocab_size: int,
        *,
        max_pattern: int = DEFAULT_MAX_PATTERN,
        min_match: int = 1,
        min_probability: float = DEFAULT_MIN_PROBABILITY,
        spec_factor: float = DEFAULT_SPEC_FACTOR,
        history_tokens: int = DEFAULT_HISTORY_TOKENS,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if not 1 <= min_match <= max_pattern:
            raise ValueError(f"need 1 <= min_match <= max_pattern, got {min_match} and {max_pattern}")
        if not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"min_probability must lie in [0, 1], got {min_probability}")
        if spec_factor <= 0.0:
            raise ValueError(f"spec_factor must be positive, got {spec_factor}")
        super().__init__(name="suffix", runs_inline=True, seconds_per_token=1e-5)
        self._vocab_size = vocab_size
        self.max_pattern = max_pattern
        self.min_match = min_match
        self.min_probability = min_probability
        self.spec_factor = spec_factor
        self.history = SharedHistory(history_tokens)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def weights_digest(self) -> bytes:
        # No weights: the digest names the algorithm and the parameters that shape its proposals, so
        # that a contract's "drafters" list can permit or exclude it. The history budget sizes memory.
        label = (
            f"sdcp-suffix-drafter-1:max_pattern={self.max_pattern}:min_match={self.min_match}"
            f":min_probability={self.min_probability}:spec_factor={self.spec_factor}"
        )
        return hashlib.sha256(label.encode("ascii")).digest()

    @property
    def history_size(self) -> HistorySize:
        with self._lock:
            return self.history.size

    def prepare(self) -> None:
        return None  # no model: nothing to hash or pack

    def set_threads(self, threads: int) -> None:
        return None  # no model: it drafts on the calling thread alone

    def _new_session(self, tokens: list[int]) -> _SuffixSession:
        index = SuffixIndex()
        index.append(tokens)
        return _SuffixSession(tokens, index)

    def bind_history(self, session: SessionId, key: bytes) -> None:
        """Draft from the history of ``key`` (without a call: the empty key, shared by every such
        session of this drafter). The engine derives keys (sdcp.engines.history.history_scope_key,
        or ``history_key`` of the contract)."""
        with self._lock:
            self._session(session).history = key

    def learn(self, key: bytes, output: Sequence[int]) -> None:
        """Keep a finished session's output for later sessions of history ``key``."""
        tokens = checked_tokens(output, self._vocab_size)
        with self._lock:
            self.history.learn(key, tokens)

    def _resync(self, state: _SuffixSession, committed: list[int], common: int) -> None:
        state.tokens = committed
        if common < state.index.end:
            state.index.truncate(common)
        state.index.append(state.tokens[state.index.end :])

    def _draft(
        self,
        session: SessionId,
        state: _SuffixSession,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None,
    ) -> tuple[list[int], np.ndarray]:
        """The same proposal whatever the sampling profile, so no randomness is drawn."""
        steps = plan_draft(
            state.tokens,
            state.index,
            self.history.index(state.history),
            m,
            max_pattern=self.max_pattern,
            min_match=self.min_match,
            min_probability=self.min_probability,
            spec_factor=self.spec_factor,
        )
        # No match: repeat the last token, a deterministic proposal as prompt lookup's.
        proposed = [step.token for step in steps] or [state.tokens[-1]]
        # Drafted tokens stay tentative until `sync` confirms them.
        state.tokens.extend(proposed)
        return proposed, one_hot_rows(proposed, self._vocab_size)
