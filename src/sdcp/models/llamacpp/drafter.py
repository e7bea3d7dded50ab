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

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import llama_cpp
import numpy as np

from sdcp.models.backend import LLAMACPP_KV_SLOTS, SessionId
from sdcp.models.drafter import DraftSession, SeededDraws, SessionDrafter, draw_tokens, probe_seconds_per_token
from sdcp.models.errors import BadTokens, ModelError, SessionLimit
from sdcp.models.llamacpp.native import PROPOSAL_ROOM, SEQUENCE_TOKENS_PER_CALL, load_native
from sdcp.models.weights.digests import gguf_digest
from sdcp.protocol.messages import Sampling
from sdcp.threads import usable_cores

__all__ = ["LlamaCppDrafter"]


@dataclass
class _DraftSequence(DraftSession):
    seq_id: int
    # The sequence holds the KV of tokens[:cached]; always fewer than len(tokens), so a draft feeds
    # at least one token and reads the row after it.
    cached: int = 0
    draws: SeededDraws = field(default_factory=SeededDraws)


class LlamaCppDrafter(SessionDrafter[_DraftSequence]):
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
        super().__init__(name=name or gguf.name, runs_inline=False, seconds_per_token=0.01, capacity=native.capacity)
        self._vocab_size = native.vocab_size
        self._positions = native.capacity
        self._context = native.context
        self._memory = native.memory
        self._batch = native.batch
        self._free_ids = list(range(kv_slots - 1, -1, -1))  # popped lowest first

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @cached_property
    def weights_digest(self) -> bytes:
        """SHA-256 of the GGUF file, as a GGUF target's (docs/models.md, "Digests")."""
        return gguf_digest(self.gguf)

    def prepare(self) -> None:
        _ = self.weights_digest
        with self._lock:
            self._timer.value = probe_seconds_per_token(self)

    def set_threads(self, threads: int) -> None:
        with self._lock:
            llama_cpp.llama_set_n_threads(self._context, threads, threads)

    # -- on the lock ---------------------------------------------------------------------------------

    def _new_session(self, tokens: list[int]) -> _DraftSequence:
        if not self._free_ids:
            raise SessionLimit(f"{self.name} holds {len(self._sessions)} sessions, its kv_slots")
        return _DraftSequence(tokens, self._free_ids.pop())

    def _release(self, state: _DraftSequence) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, -1, -1)
        self._free_ids.append(state.seq_id)
        self._free_ids.sort(reverse=True)

    def _resync(self, state: _DraftSequence, committed: list[int], common: int) -> None:
        # SDCP 6.3: discard draft state for positions beyond the accepted ones.
        keep = min(state.cached, common, len(committed) - 1)
        if keep < state.cached:
            if not llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, keep, -1):
                raise ModelError(f"llama.cpp could not remove the tail of sequence {state.seq_id}")
            state.cached = keep
        state.tokens = committed

    def _draft(
        self,
        session: SessionId,
        state: _DraftSequence,
        m: int,
        sampling: Sampling | None,
        rng: np.random.Generator | None,
    ) -> tuple[list[int], np.ndarray]:
        if len(state.tokens) + m - 1 > self._positions + PROPOSAL_ROOM:
            raise BadTokens(
                f"{len(state.tokens)} tokens and a draft of {m} exceed the "
                f"{self._positions} + {PROPOSAL_ROOM} positions of a sequence"
            )
        generator = rng if rng is not None else state.draws.generator(session, sampling)
        proposed, rows = draw_tokens(state.tokens, m, sampling, generator, lambda: self._feed(state))
        return proposed, np.stack(rows)

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
