"""A drafter on llama.cpp: a GGUF model proposes tokens (draft-li-sdcp, 6.2) through llama-cpp-python's
low-level API, as `LlamaCppTarget` scores them (docs/models.md, "llama.cpp drafters").

Each open session holds one sequence id of one llama.cpp context, and the sequence holds the KV of
the session's first ``cached`` tokens. A draft feeds what the sequence lacks (the prompt on the first
draft, then the tokens a verdict appended), then each drafted token but the last, and reads the row
after the last token fed. `sync` removes the positions past the longest common prefix of the
drafter's tokens and the committed prefix (`llama_memory_seq_rm`), so that the next round reuses the
KV of every token the verdict kept. Rows are drawn from as `HFDrafter` draws them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import llama_cpp
import numpy as np

from sdcp.models.backend import LLAMACPP_KV_SLOTS, SessionId, checked_tokens, common_prefix_length, lookup_session
from sdcp.models.digests import gguf_digest
from sdcp.models.draft import (
    DraftResult,
    SeededDraws,
    TokenTimer,
    draw_tokens,
    probe_seconds_per_token,
)
from sdcp.models.errors import BadTokens, ModelError, SessionExists, SessionLimit
from sdcp.models.llamacpp_native import PROPOSAL_ROOM, SEQUENCE_TOKENS_PER_CALL, load_native
from sdcp.protocol.messages import Sampling
from sdcp.threads import usable_cores

__all__ = ["LlamaCppDrafter"]


@dataclass
class _DraftSequence:
    seq_id: int
    # The committed prefix, then the tokens drafted since the last sync.
    tokens: list[int]
    # The sequence holds the KV of tokens[:cached]; always fewer than len(tokens), so a draft feeds
    # at least one token and reads the row after it.
    cached: int = 0
    draws: SeededDraws = field(default_factory=SeededDraws)


class LlamaCppDrafter:
    """A GGUF model in llama.cpp on the CPU as drafter, for up to ``kv_slots`` sessions of at most
    ``kv_capacity`` tokens each (default: the model's training context, at most 4096) and a draft's;
    the KV cache is allocated up front, as a `LlamaCppTarget`'s. A ``vocab_size`` (the target's) that
    the model's is not is refused before the cache is made.

    Like `LlamaCppTarget` it runs with flash attention, a KV cache per sequence and at most 63 tokens
    of a sequence per `llama_decode` call, so that a row does not depend on how a session's tokens
    were fed; ``threads`` (default: every usable core) run every call. On one thread a session's
    proposals are a function of its tokens alone; on more, llama.cpp splits a one-token call's
    attention among them, and past about 300 positions a row may differ slightly from the one a
    wider call computes (docs/models.md, "Rows that do not depend on the pass").
    """

    def __init__(
        self,
        gguf: Path,
        *,
        name: str | None = None,
        vocab_size: int | None = None,
        threads: int | None = None,
        kv_slots: int = LLAMACPP_KV_SLOTS,
        kv_capacity: int | None = None,
        native_log: bool = False,
    ) -> None:
        self.gguf = gguf
        self.name = name or gguf.name
        self.runs_inline = False
        threads = threads if threads is not None else usable_cores()
        # Every call feeds one sequence, so no call needs room for more than its tokens.
        native = load_native(
            gguf,
            owner=self,
            kv_slots=kv_slots,
            kv_capacity=kv_capacity,
            threads=threads,
            one_token_threads=threads,
            batch_tokens=SEQUENCE_TOKENS_PER_CALL,
            native_log=native_log,
            vocab_size=vocab_size,
        )
        self._vocab_size = native.vocab_size
        self._capacity = native.capacity
        self._context = native.context
        self._memory = native.memory
        self._batch = native.batch
        self._free_ids = list(range(kv_slots - 1, -1, -1))  # popped lowest first
        self._sessions: dict[SessionId, _DraftSequence] = {}
        self._timer = TokenTimer(initial=0.01)
        self._lock = threading.RLock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @cached_property
    def weights_digest(self) -> bytes:
        """SHA-256 of the GGUF file, as a GGUF target's (docs/models.md, "Digests")."""
        return gguf_digest(self.gguf)

    @property
    def seconds_per_token(self) -> float:
        return self._timer.value

    def prepare(self) -> None:
        _ = self.weights_digest
        with self._lock:
            self._timer.value = probe_seconds_per_token(self)

    def set_threads(self, threads: int) -> None:
        with self._lock:
            llama_cpp.llama_set_n_threads(self._context, threads, threads)

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int]) -> None:
        tokens = self._checked_prefix(prompt_tokens)
        with self._lock:
            if session in self._sessions:
                raise SessionExists(f"session {session.hex()} is already open on {self.name}")
            if not self._free_ids:
                raise SessionLimit(f"{self.name} holds {len(self._sessions)} sessions, its kv_slots")
            self._sessions[session] = _DraftSequence(self._free_ids.pop(), tokens)

    def close_session(self, session: SessionId) -> None:
        with self._lock:
            state = self._session(session)
            del self._sessions[session]
            llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, -1, -1)
            self._free_ids.append(state.seq_id)
            self._free_ids.sort(reverse=True)

    def tokens(self, session: SessionId) -> tuple[int, ...]:
        """Committed prefix plus tentative drafted tokens of the session."""
        with self._lock:
            return tuple(self._session(session).tokens)

    def sync(self, session: SessionId, committed_tokens: Sequence[int]) -> None:
        committed = self._checked_prefix(committed_tokens)
        with self._lock:
            state = self._session(session)
            # SDCP 6.3: discard draft state for positions beyond the accepted ones.
            keep = min(state.cached, common_prefix_length(state.tokens, committed), len(committed) - 1)
            if keep < state.cached:
                if not llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, keep, -1):
                    raise ModelError(f"llama.cpp could not remove the tail of sequence {state.seq_id}")
                state.cached = keep
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
            state = self._session(session)
            if len(state.tokens) + m - 1 > self._capacity + PROPOSAL_ROOM:
                raise BadTokens(
                    f"{len(state.tokens)} tokens and a draft of {m} exceed the "
                    f"{self._capacity} + {PROPOSAL_ROOM} positions of a sequence"
                )
            generator = rng if rng is not None else state.draws.generator(session, sampling)
            proposed, rows = draw_tokens(state.tokens, m, sampling, generator, lambda: self._feed(state))
        seconds = time.perf_counter() - started
        self._timer.record(seconds, m)
        return DraftResult(tuple(proposed), np.stack(rows), seconds)

    # -- on the lock ---------------------------------------------------------------------------------

    def _feed(self, state: _DraftSequence) -> np.ndarray:
        """Decode the tokens the sequence lacks; the float64 logits after the last of them."""
        fed = state.tokens[state.cached :]
        batch = self._batch
        try:
            for first in range(0, len(fed), SEQUENCE_TOKENS_PER_CALL):
                call = fed[first : first + SEQUENCE_TOKENS_PER_CALL]
                for slot, token in enumerate(call):
                    batch.token[slot] = token
                    batch.pos[slot] = state.cached + first + slot
                    batch.n_seq_id[slot] = 1
                    batch.seq_id[slot][0] = state.seq_id
                    batch.logits[slot] = first + slot == len(fed) - 1
                batch.n_tokens = len(call)
                status = llama_cpp.llama_decode(self._context, batch)
                if status != 0:
                    raise ModelError(f"llama_decode returned {status} drafting on {self.name}")
        except BaseException:
            llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, state.cached, -1)
            raise
        state.cached = len(state.tokens)
        pointer = llama_cpp.llama_get_logits_ith(self._context, -1)
        if not pointer:
            raise ModelError(f"llama.cpp has no logits after the draft's last token on {self.name}")
        return np.ctypeslib.as_array(pointer, shape=(self._vocab_size,)).astype(np.float64)

    def _session(self, session: SessionId) -> _DraftSequence:
        return lookup_session(self._sessions, session, self.name)

    def _checked_prefix(self, tokens: Sequence[int]) -> list[int]:
        checked = checked_tokens(tokens, self._vocab_size)
        if not checked:
            raise BadTokens("a committed prefix holds at least one prompt token")
        if len(checked) > self._capacity:
            raise BadTokens(f"{len(checked)} tokens exceed the {self._capacity} positions of a session")
        return checked
