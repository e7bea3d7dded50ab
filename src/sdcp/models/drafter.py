"""What every drafter is and does alike (draft-li-sdcp, 6.2), whatever runs it.

The drafters by runtime: `sdcp.models.hf.drafter.HFDrafter` (torch + transformers),
`sdcp.models.llamacpp.drafter.LlamaCppDrafter` (a GGUF file), and the model-free lookup drafters
`sdcp.models.lookup.ngram.NgramDrafter` and `sdcp.models.lookup.suffix.SuffixDrafter`.

Each keeps per-session state of the committed prefix (prompt + committed output, as one token
list) plus any tentative tokens it drafted. `sync` brings that state to a committed prefix by
keeping the longest common prefix and appending the rest, which covers a verdict (drop rejected
positions, append the emitted extra token), pre-drafting that assumed full acceptance, and a
resync after reassignment alike. `SessionDrafter` does this bookkeeping once for all of them.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from sdcp.models.backend import SessionId, checked_tokens, common_prefix_length, lookup_session
from sdcp.models.errors import BadTokens, SessionExists
from sdcp.protocol.messages import Sampling
from sdcp.protocol.sampling import draw_token, target_distribution

# Drafter randomness is derived under its own label; SDCP 6.4 forbids drafters the verifier's
# HMAC derivation ("SDCP-VERIFY-1"), so the two streams stay independent.
DRAFTER_RNG_DOMAIN = b"SDCP-DRAFTER-RNG-1\x00"
# The scratch session with which a model drafter times itself before serving.
_PROBE_SESSION = b"sdcp-draft-probe"
_PROBE_PROMPT_TOKENS = 32
_PROBE_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class DraftResult:
    """M proposed tokens, the rows they were sampled from, and the drafting time."""

    tokens: tuple[int, ...]
    q_rows: np.ndarray | None
    seconds: float

    def q_rows_bytes(self) -> bytes:
        """The q_rows object of SDCP 5.2: M rows of V little-endian binary32 values."""
        if self.q_rows is None:
            raise ValueError("this draft has no q rows")
        return self.q_rows.astype("<f4").tobytes()


@runtime_checkable
class Drafter(Protocol):
    name: str
    # Calls take microseconds and hold no model: a service makes them on its event loop rather
    # than on a worker thread, whose hand-offs would cost more than the calls.
    runs_inline: bool

    @property
    def vocab_size(self) -> int: ...

    @property
    def weights_digest(self) -> bytes: ...

    @property
    def seconds_per_token(self) -> float: ...

    def prepare(self) -> None:
        """Work the first draft would otherwise pay (hashing, packing weights), on the thread
        that will run the drafter."""

    def set_threads(self, threads: int) -> None:
        """Draft on this many threads from now on (sdcp.threads.CoreGovernor sizes them)."""

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int]) -> None: ...

    def sync(self, session: SessionId, committed_tokens: Sequence[int]) -> None: ...

    def draft(
        self,
        session: SessionId,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None = None,
    ) -> DraftResult: ...

    def close_session(self, session: SessionId) -> None: ...


def probe_seconds_per_token(drafter: Drafter) -> float:
    """Draft a few tokens of a scratch session, so that the first status report already carries a
    measured time per token (the router's t_d, SDCP 6.2), not a guess."""
    drafter.open_session(_PROBE_SESSION, list(range(min(_PROBE_PROMPT_TOKENS, drafter.vocab_size))))
    try:
        drafter.draft(_PROBE_SESSION, 1, None)  # the first call pays one-off costs
        timed = drafter.draft(_PROBE_SESSION, _PROBE_DRAFT_TOKENS, None)
        return timed.seconds / _PROBE_DRAFT_TOKENS
    finally:
        drafter.close_session(_PROBE_SESSION)


def session_rng(session: SessionId, sampling: Sampling | None) -> np.random.Generator:
    """The drafter's own generator for a session: seeded from the session and the profile seed."""
    seed = sampling.seed if sampling is not None and sampling.seed is not None else 0
    material = hashlib.sha256(DRAFTER_RNG_DOMAIN + session + struct.pack(">Q", seed)).digest()
    return np.random.default_rng(int.from_bytes(material, "big"))


@dataclass
class SeededDraws:
    """A model drafter session's draws: a generator seeded from the session and its sampling
    profile's seed (``session_rng``), made anew when that seed changes."""

    rng: np.random.Generator | None = None
    seed: int | None = None

    def generator(self, session: SessionId, sampling: Sampling | None) -> np.random.Generator:
        seed = sampling.seed if sampling is not None else None
        if self.rng is None or self.seed != seed:
            self.rng = session_rng(session, sampling)
            self.seed = seed
        return self.rng


def draw_tokens(
    tokens: list[int],
    m: int,
    sampling: Sampling | None,
    generator: np.random.Generator,
    next_logits: Callable[[], np.ndarray],
) -> tuple[list[int], list[np.ndarray]]:
    """``m`` tokens drawn one after another, each from the row of ``next_logits`` (the model's
    logits after ``tokens``, to which each drawn token is appended), and those rows."""
    proposed: list[int] = []
    rows: list[np.ndarray] = []
    for _ in range(m):
        # The published row is the float32 row the token is drawn from (SDCP 5.2).
        row = target_distribution(next_logits(), sampling).astype(np.float32)
        token = draw_token(row, float(generator.random()))
        tokens.append(token)
        proposed.append(token)
        rows.append(row)
    return proposed, rows


class TokenTimer:
    """Exponentially weighted seconds per token: drafted (t_d of the SDCP 6.2 cost model) or
    self-decoded by a verifier."""

    def __init__(self, initial: float, weight: float = 0.2) -> None:
        self.value = initial
        self._weight = weight

    def record(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            self.value += self._weight * (seconds / tokens - self.value)


def one_hot_rows(proposed: Sequence[int], vocab_size: int) -> np.ndarray:
    """The q rows of a deterministic proposal: a point mass on each proposed token, the exact
    distribution it was drawn from, so that rule 2 stays exact (SDCP 5.2)."""
    rows = np.zeros((len(proposed), vocab_size), dtype=np.float32)
    rows[np.arange(len(proposed)), list(proposed)] = 1.0
    return rows


@dataclass
class DraftSession:
    """A drafter's state of one session: the committed prefix as last synced, then any tokens
    drafted since (tentative until a sync confirms them)."""

    tokens: list[int]


SessionState = TypeVar("SessionState", bound=DraftSession)


class SessionDrafter(ABC, Generic[SessionState]):
    """The bookkeeping every drafter shares: its sessions under one lock, token lists checked
    against the vocabulary (and a session's ``capacity``, where it has one) before they reach a
    model, `sync` by the longest common prefix, and each draft timed. A drafter supplies what
    differs: a new session's state, what closing or syncing one releases, and the draft itself."""

    def __init__(self, *, name: str, runs_inline: bool, seconds_per_token: float, capacity: int | None = None) -> None:
        self.name = name
        # Calls take microseconds and hold no model: a service makes them on its event loop
        # rather than on a worker thread.
        self.runs_inline = runs_inline
        self._capacity = capacity
        self._sessions: dict[SessionId, SessionState] = {}
        self._timer = TokenTimer(initial=seconds_per_token)
        self._lock = threading.RLock()

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def seconds_per_token(self) -> float:
        return self._timer.value

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int]) -> None:
        tokens = self._checked_length(checked_tokens(prompt_tokens, self.vocab_size))
        with self._lock:
            if session in self._sessions:
                raise SessionExists(f"session {session.hex()} is already open on {self.name}")
            self._sessions[session] = self._new_session(tokens)

    def close_session(self, session: SessionId) -> None:
        with self._lock:
            state = self._session(session)
            del self._sessions[session]
            self._release(state)

    def tokens(self, session: SessionId) -> tuple[int, ...]:
        """Committed prefix plus tentative drafted tokens of the session."""
        with self._lock:
            return tuple(self._session(session).tokens)

    def sync(self, session: SessionId, committed_tokens: Sequence[int]) -> None:
        given = list(committed_tokens)
        with self._lock:
            state = self._session(session)
            common = common_prefix_length(state.tokens, given)
            # Only the tokens past the common prefix are new: the held ones were checked before.
            committed = state.tokens[:common] + checked_tokens(given[common:], self.vocab_size)
            self._resync(state, self._checked_length(committed), common)

    def draft(
        self,
        session: SessionId,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None = None,
    ) -> DraftResult:
        """Up to m tokens after the session's tokens (committed, or tentative when pre-drafting)."""
        if m < 1:
            raise BadTokens(f"a draft has at least one token, got m={m}")
        started = time.perf_counter()
        with self._lock:
            state = self._session(session)
            proposed, rows = self._draft(session, state, m, sampling, rng)
        seconds = time.perf_counter() - started
        self._timer.record(seconds, len(proposed))
        return DraftResult(tuple(proposed), rows, seconds)

    def _checked_length(self, tokens: list[int]) -> list[int]:
        if not tokens:
            raise BadTokens("a committed prefix holds at least one prompt token")
        if self._capacity is not None and len(tokens) > self._capacity:
            raise BadTokens(f"{len(tokens)} tokens exceed the {self._capacity} positions of a session")
        return tokens

    def _session(self, session: SessionId) -> SessionState:
        return lookup_session(self._sessions, session, self.name)

    # -- what a drafter supplies, called on the lock -------------------------------------------------

    @abstractmethod
    def _new_session(self, tokens: list[int]) -> SessionState: ...

    def _release(self, state: SessionState) -> None:
        """What a closed session held besides its state (a KV sequence)."""

    def _resync(self, state: SessionState, committed: list[int], common: int) -> None:
        """Bring the session to ``committed``, of which the first ``common`` tokens are held."""
        state.tokens = committed

    @abstractmethod
    def _draft(
        self,
        session: SessionId,
        state: SessionState,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None,
    ) -> tuple[list[int], np.ndarray]: ...
