"""Drafters (SDCP 6.2): an HF causal-LM drafter and a prompt-lookup (n-gram) drafter.

Both keep per-session state of the committed prefix (prompt + committed output, as one token
list) plus any tentative tokens they drafted. `sync` brings that state to a committed prefix by
keeping the longest common prefix and appending the rest, which covers a verdict (drop rejected
positions, append the emitted extra token), pre-drafting that assumed full acceptance, and a
resync after reassignment alike.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from sdcp.models import kvcache
from sdcp.models.backend import checked_tokens, common_prefix_length, lookup_session
from sdcp.models.digests import weights_digest
from sdcp.models.errors import BadTokens, SessionExists
from sdcp.models.packed import pack_weights, with_packed_linears
from sdcp.protocol.messages import Sampling
from sdcp.protocol.sampling import draw_token, target_distribution

SessionId = bytes

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


@dataclass
class _LMSession:
    tokens: list[int]
    cache: DynamicCache
    draws: SeededDraws = field(default_factory=SeededDraws)


class HFDrafter:
    """A Hugging Face causal LM as drafter: samples each token from the row it publishes."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        name: str,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        # transformers wraps `to` in functools.wraps(nn.Module.to), which mypy reads as the unbound method.
        placed = model.to(device=device or "cpu", dtype=dtype).eval()  # type: ignore[call-arg]
        self.model: PreTrainedModel = with_packed_linears(placed)
        self.name = name
        self.runs_inline = False
        self._sessions: dict[SessionId, _LMSession] = {}
        self._timer = TokenTimer(initial=0.01)
        self._lock = threading.RLock()

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @cached_property
    def weights_digest(self) -> bytes:
        return weights_digest(self.model)

    def prepare(self) -> None:
        with self._lock:
            pack_weights(self.model)
        _ = self.weights_digest
        self._time_drafting()

    def set_threads(self, threads: int) -> None:
        # OpenMP's team size is a setting of the calling thread: the drafter's own.
        torch.set_num_threads(threads)

    def _time_drafting(self) -> None:
        with self._lock:
            self._timer.value = probe_seconds_per_token(self)

    @property
    def seconds_per_token(self) -> float:
        return self._timer.value

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int]) -> None:
        tokens = checked_tokens(prompt_tokens, self.vocab_size)
        if not tokens:
            raise BadTokens("a session needs at least one prompt token")
        with self._lock:
            if session in self._sessions:
                raise SessionExists(f"session {session.hex()} is already open on {self.name}")
            self._sessions[session] = _LMSession(tokens=tokens, cache=kvcache.new_cache(self.model))

    def close_session(self, session: SessionId) -> None:
        with self._lock:
            lookup_session(self._sessions, session, self.name)
            del self._sessions[session]

    def tokens(self, session: SessionId) -> tuple[int, ...]:
        """Committed prefix plus tentative drafted tokens of the session."""
        with self._lock:
            return tuple(lookup_session(self._sessions, session, self.name).tokens)

    def sync(self, session: SessionId, committed_tokens: Sequence[int]) -> None:
        committed = checked_tokens(committed_tokens, self.vocab_size)
        if not committed:
            raise BadTokens("a committed prefix holds at least the prompt")
        with self._lock:
            state = lookup_session(self._sessions, session, self.name)
            common = common_prefix_length(state.tokens, committed)
            # SDCP 6.3: discard draft state for positions beyond the accepted ones; the cache
            # keeps covering at most all tokens but the last, so the next pass feeds >= 1 token.
            kvcache.crop_to(state.cache, min(common, len(committed) - 1))
            state.tokens = committed

    def draft(
        self,
        session: SessionId,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None = None,
    ) -> DraftResult:
        """Draft m tokens after the session's tokens (committed, or tentative when pre-drafting)."""
        if m < 1:
            raise BadTokens(f"a draft has at least one token, got m={m}")
        started = time.perf_counter()
        with self._lock:
            state = lookup_session(self._sessions, session, self.name)
            generator = rng if rng is not None else state.draws.generator(session, sampling)
            proposed, rows = draw_tokens(state.tokens, m, sampling, generator, lambda: self._next_logits(state))
        seconds = time.perf_counter() - started
        self._timer.record(seconds, m)
        return DraftResult(tuple(proposed), np.stack(rows), seconds)

    def _next_logits(self, state: _LMSession) -> np.ndarray:
        """The float64 logits after the session's tokens, feeding those its cache lacks."""
        fed = state.tokens[kvcache.cache_length(state.cache) :]
        with torch.inference_mode():
            logits = self.model(
                input_ids=torch.tensor([fed], device=self.model.device),
                cache=state.cache,
                use_cache=True,
            ).logits[0, -1]
        row: np.ndarray = logits.to(torch.float64).cpu().numpy()
        return row


@dataclass
class _NgramSession:
    tokens: list[int]


class NgramDrafter:
    """Prompt-lookup drafting: continue the most recent earlier occurrence of the longest suffix.

    Proposals are deterministic and their q rows are one-hot (a point mass on the proposed token),
    which is the exact distribution the token was drawn from, so rule 2 stays exact.
    """

    def __init__(self, vocab_size: int, *, n_max: int = 3, n_min: int = 1) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.name = "ngram"
        self.runs_inline = True
        self._vocab_size = vocab_size
        self.n_max = n_max
        self.n_min = n_min
        self._sessions: dict[SessionId, _NgramSession] = {}
        self._timer = TokenTimer(initial=1e-5)
        self._lock = threading.RLock()

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

    @property
    def seconds_per_token(self) -> float:
        return self._timer.value

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int]) -> None:
        tokens = checked_tokens(prompt_tokens, self._vocab_size)
        if not tokens:
            raise BadTokens("a session needs at least one prompt token")
        with self._lock:
            if session in self._sessions:
                raise SessionExists(f"session {session.hex()} is already open on {self.name}")
            self._sessions[session] = _NgramSession(tokens=tokens)

    def close_session(self, session: SessionId) -> None:
        with self._lock:
            lookup_session(self._sessions, session, self.name)
            del self._sessions[session]

    def sync(self, session: SessionId, committed_tokens: Sequence[int]) -> None:
        committed = checked_tokens(committed_tokens, self._vocab_size)
        if not committed:
            raise BadTokens("a committed prefix holds at least the prompt")
        with self._lock:
            lookup_session(self._sessions, session, self.name).tokens = committed

    def draft(
        self,
        session: SessionId,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None = None,
    ) -> DraftResult:
        if m < 1:
            raise BadTokens(f"a draft has at least one token, got m={m}")
        started = time.perf_counter()
        with self._lock:
            state = lookup_session(self._sessions, session, self.name)
            proposed = self._continuation(state.tokens, m)
            # Drafted tokens stay tentative until `sync` confirms them, as for HFDrafter.
            state.tokens.extend(proposed)
        count = len(proposed)
        rows = np.zeros((count, self._vocab_size), dtype=np.float32)
        rows[np.arange(count), proposed] = 1.0
        seconds = time.perf_counter() - started
        self._timer.record(seconds, count)
        return DraftResult(tuple(proposed), rows, seconds)

    def _continuation(self, tokens: list[int], m: int) -> list[int]:
        # No match: repeat the last token once, a deterministic proposal with a one-hot row.
        return prompt_lookup(tokens, m, n_max=self.n_max, n_min=self.n_min) or [tokens[-1]]


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
