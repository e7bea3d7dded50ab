"""The verifier's target on llama.cpp: a GGUF model run as shipped, through llama-cpp-python's
low-level API (SDCP 6.3 Scoring; docs/models.md, "llama.cpp backend").

Each open session holds one sequence id of one llama.cpp context. A scoring call feeds every
session's [last committed token] + proposed tokens into one `llama_batch`, each token at its own
position of its own sequence, and reads a row per token (`llama_get_logits`). The invariant of
`sdcp.models.hf.target` holds: a session's sequence holds the KV of every committed token but the last,
and `commit` and `rollback` remove the positions past it (`llama_memory_seq_rm`). One exception
saves a new session a pass: its prefill feeds the prompt's last token too and keeps that token's row
(the row after the committed prefix), as if a pass had scored an empty proposal; the session's first
`score` then feeds only its proposal and returns the kept row first.

A row is a function of the session's tokens alone, whatever else its pass holds, so that rule 1's
output does not depend on what drafters propose or on which sessions share a pass (SDCP 6.4). On
llama.cpp's CPU kernels that holds, bit for bit, only with flash attention, a KV cache of its own
per sequence, fewer than 64 tokens of a sequence per llama_decode call and one thread for a ubatch
of one token (docs/models.md, where the deviations are measured); this module keeps to that.

With ``prefix_cache_bytes``, a prefill starts from the KV of the longest prefix of the prompt that
the target holds (``sdcp.cache.prefix``, found by blocks of BLOCK_TOKENS): the KV an earlier
prefill computed, or the committed tokens of a session that ended (an agent's next turn repeats its
conversation so far). The sequence's state is restored from the stored blob, cut where the prompt
and the stored tokens part, and the rest is decoded. A cell's KV is a function of the tokens up to
its position alone under the settings above, whatever calls computed it (each of fewer than 64
tokens of the sequence), so the restored cells are those a cold prefill computes, bit for bit, and
rule 1's output is the same with and without the cache.
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import llama_cpp
import numpy as np

from sdcp.cache.prefix import BLOCK_TOKENS, SHARE_TOKENS, PrefixIndex
from sdcp.models.backend import (
    LLAMACPP_KV_SLOTS,
    Opening,
    ScoreRequest,
    SessionId,
    TargetBackend,
    check_commit,
    check_contract_digests,
    checked_tokens,
    extended_proposal,
    lookup_session,
    proposal_rest,
)
from sdcp.models.errors import (
    BadTokens,
    KVFormatError,
    ModelError,
    SessionExists,
    SessionLimit,
)
from sdcp.models.kvformat import decode_llamacpp_kv, encode_llamacpp_kv
from sdcp.models.llamacpp.native import PROPOSAL_ROOM, SEQUENCE_TOKENS_PER_CALL, load_native
from sdcp.models.weights.digests import gguf_digest, tokenizer_file_digest
from sdcp.threads import CoreGovernor, usable_cores

__all__ = [
    "BATCH_TOKENS",
    "COMPANION_POSITIONS",
    "PREFILL_STEP_TOKENS",
    "SEQUENCE_TOKENS_PER_CALL",
    "SPLIT_FREE_POSITIONS",
    "UBATCH_ROWS",
    "LlamaCppTarget",
]

# Tokens per llama_decode call, at most. It also bounds the logits buffer llama.cpp keeps (a row of
# the vocabulary per token of a call).
BATCH_TOKENS = 512
# llama.cpp splits a lone query's attention over the KV among the threads (and its row then differs
# from a wider ubatch's) only where the ubatch attends 512 cells or more: it pads the cells a
# sequence uses to a multiple of at most 256, so a token at a position below this attends fewer.
SPLIT_FREE_POSITIONS = 256
# From this position on a one-token pass goes with a token of an empty neighbouring sequence
# (_companion), on every thread: at 2,400 positions 35 ms against 45 on one thread; at 1,200 both
# about 23 ms, below it the extra token costs more than the thread gains (docs/models.md, item 3).
COMPANION_POSITIONS = 1536
# Views of the logits buffer kept (_copy_rows): a call reads 1 to BATCH_TOKENS rows, and the
# buffer moves only as it grows.
_LOGITS_VIEWS = 64
# What one more ubatch of a call costs beyond its rows, in rows (_pads): a pass of 14 sessions on
# 2 threads took 95 ms in three ubatches and 73 in one (docs/performance.md, session 34).
UBATCH_ROWS = 4
# Tokens of a prefill between two other passes (two llama_decode calls): a long prompt's prefill
# delays other sessions' next pass by about this much work, not by all of it.
PREFILL_STEP_TOKENS = 2 * SEQUENCE_TOKENS_PER_CALL
# Tokens of a call per thread of the team, in all, while the team is provisional
# (CoreGovernor.provisional, _paced): about 50 ms of work, when the governor measures it again. 63
# tokens took 0.42 s on one thread, where the cores were free, and a group's first call holds up to
# 512 (docs/performance.md, session 28). A rest shorter than two such calls goes whole: each cut
# costs a pass's fixed cost (about 7 ms on two threads), and an 18-token chat prompt cut 8 + 8 + 2
# took 80 ms where one call takes about 60 (docs/performance.md, session 33).
PROVISIONAL_CALL_TOKENS = 8
# Short calls of one piece of work, at most: the governor should have measured the work long before.
PROVISIONAL_CALLS = 16
_DECODE_FAILURES = {
    1: "no room in the KV cache for the pass",
    2: "the pass was aborted",
    -1: "llama.cpp refused the batch",
}


@dataclass
class _Sequence:
    seq_id: int
    tokens: list[int]
    pending: tuple[int, ...] | None = None
    # Whose prefixes its KV may serve (Target.open_session).
    prefix_scope: bytes = b""
    # The row after the committed tokens, which the prefill computed with the last of them (pending
    # is then the empty proposal); the first `score` returns it instead of feeding that token again.
    first_row: np.ndarray | None = None


@dataclass(frozen=True)
class _Feed:
    """Tokens to decode at consecutive positions of one sequence, from ``start`` on; a row is read
    after each token from offset ``rows_from`` on (0: every token's; ``len(tokens)``: none)."""

    seq_id: int
    start: int
    tokens: Sequence[int]
    rows_from: int = 0

    @staticmethod
    def prefill(seq_id: int, start: int, tokens: Sequence[int], *, last_row: bool) -> _Feed:
        """A prefill's tokens, with the row after the last of them where ``last_row``."""
        return _Feed(seq_id, start, tokens, len(tokens) - 1 if last_row else len(tokens))


@dataclass(frozen=True)
class _Pad:
    """``count`` tokens fed from position ``start`` of sequence ``seq_id`` without a row, and
    removed after the call (LlamaCppTarget._pads)."""

    seq_id: int
    start: int
    count: int


class LlamaCppTarget:
    """A GGUF model in llama.cpp on the CPU, serving up to ``kv_slots`` sessions, each of at most
    ``kv_capacity`` positions (default: the model's training context, at most 4096).
    ``companion_positions``: where a one-token pass starts to run on every thread beside a token of
    an empty neighbouring sequence (`_companion`; the crossover on the host, COMPANION_POSITIONS here).

    The KV cache, kv_slots x (kv_capacity + PROPOSAL_ROOM) positions, is allocated (and cleared)
    up front. ``threads`` (default: every usable core) run the ubatches of two tokens or more; a
    ubatch of one token runs on one thread (module docstring). llama.cpp's log lines go to this
    module's logger at debug level; ``native_log`` lets llama.cpp print them to stderr itself.
    Methods are thread-safe (one lock); model work must not run on an asyncio event loop.
    """

    def __init__(
        self,
        gguf: Path,
        tokenizer_json: Path | None = None,
        *,
        name: str | None = None,
        threads: int | None = None,
        kv_slots: int = LLAMACPP_KV_SLOTS,
        kv_capacity: int | None = None,
        native_log: bool = False,
        prefix_cache_bytes: int = 0,
        companion_positions: int = COMPANION_POSITIONS,
    ) -> None:
        self.gguf = gguf
        self.tokenizer_json = tokenizer_json
        self.name = name or gguf.name
        threads = threads if threads is not None else usable_cores()
        # llama.cpp runs a ubatch of one token on n_threads, and on more than one its logits differ
        # from those of any wider ubatch from about 300 positions of context on (by up to 1.3; it
        # splits the attention over the KV among the threads). On one thread they are equal; below
        # SPLIT_FREE_POSITIONS such a ubatch runs on all threads (_decode).
        native = load_native(
            gguf,
            owner=self,
            kv_slots=kv_slots,
            kv_capacity=kv_capacity,
            threads=threads,
            one_token_threads=1,
            batch_tokens=BATCH_TOKENS,
            native_log=native_log,
        )
        self._threads = threads
        self._one_token_threads = 1
        self._vocab_size = native.vocab_size
        self._capacity = native.capacity
        self._context = native.context
        self._memory = native.memory
        self._batch = native.batch
        # numpy's views of llama.cpp's logits buffer, by its address and the rows a call read
        # (_copy_rows).
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}
        self._kv_slots = kv_slots
        # llama.cpp's state of a sequence is laid out by its build and its cache's sequence count
        # (one cache each): only a cache of the same layout reads it back.
        self._kv_layout = f"llama-cpp-python {llama_cpp.__version__}, {kv_slots} sequences"
        self._free_ids = list(range(kv_slots - 1, -1, -1))  # popped lowest first
        self._sessions: dict[SessionId, _Sequence] = {}
        self._lock = threading.RLock()
        self.scored_tokens = 0
        self._prefix_cache_bytes = prefix_cache_bytes
        self._companion_positions = companion_positions
        # Applied between the llama_decode calls of one piece of work: a group's prefill of 512
        # tokens is one piece, seconds long on one thread (follow_load).
        self._governor: CoreGovernor | None = None

    backend: TargetBackend = "llamacpp"
    on_host_cores = True
    extra_rows_apart = True
    keeps_prefill_row = True

    def set_threads(self, threads: int) -> None:
        """Threads of the ubatches of two tokens or more; a one-token ubatch keeps one (__init__)."""
        with self._lock:
            self._threads = threads
            llama_cpp.llama_set_n_threads(self._context, self._one_token_threads, threads)

    def follow_load(self, governor: CoreGovernor) -> None:
        self._governor = governor

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def context_length(self) -> int:
        return self._capacity

    @cached_property
    def weights_digest(self) -> bytes:
        """SHA-256 of the GGUF file (docs/interpretations.md): verifiers of one file agree on it."""
        return gguf_digest(self.gguf)

    @cached_property
    def tokenizer_digest(self) -> bytes:
        if self.tokenizer_json is None:
            raise ModelError(f"target {self.name} was loaded without a tokenizer.json")
        return tokenizer_file_digest(self.tokenizer_json)

    @cached_property
    def tokenizer_definition(self) -> str:
        if self.tokenizer_json is None:
            raise ModelError(f"target {self.name} was loaded without a tokenizer.json")
        return self.tokenizer_json.read_text(encoding="utf-8")

    def prepare(self) -> None:
        """Hash the GGUF file and the tokenizer before the first contract is checked."""
        _ = self.weights_digest, self.tokenizer_digest

    def check_digests(self, target: bytes, tokenizer: bytes) -> None:
        check_contract_digests(self.name, (self.weights_digest, self.tokenizer_digest), (target, tokenizer))

    def kv_usage(self) -> float:
        """The share of the sessions' positions held (kv_slots x kv_capacity). Read without the lock."""
        held = sum(len(state.tokens) - 1 for state in list(self._sessions.values()))
        return min(1.0, held / (self._kv_slots * self._capacity))

    @cached_property
    def prefixes(self) -> PrefixIndex | None:
        """The prefix cache (module doc), None where it is off; its hashes bind the GGUF and the
        tokenizer (the contract's digests), and its blobs are this cache layout's state."""
        if self._prefix_cache_bytes <= 0:
            return None
        salt = self.weights_digest + self.tokenizer_digest
        return PrefixIndex(capacity_bytes=self._prefix_cache_bytes, block=BLOCK_TOKENS, salt=salt)

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int], *, prefix_scope: bytes = b"") -> None:
        """Prefill the committed prefix, from a cached prefix's KV of ``prefix_scope`` where one is
        held, keeping the row after it for the session's first `score` (module doc)."""
        for _ in self.open_session_steps(session, prompt_tokens, prefix_scope=prefix_scope):
            pass

    def open_session_steps(
        self, session: SessionId, prompt_tokens: Sequence[int], *, prefix_scope: bytes = b""
    ) -> Generator[int, None, None]:
        """`open_session` in steps (Target.open_session_steps): the session is added and restored
        from the prefix cache, then each step prefills up to PREFILL_STEP_TOKENS more, the last with
        the row after the prompt."""
        tokens = self._checked_prefix(prompt_tokens)
        with self._lock:
            state = self._add_session(session, tokens)
            state.prefix_scope = prefix_scope
        opened = False
        try:
            with self._lock:
                start = self._restore_prefix(state, tokens[:-1])
            position = start
            rows = np.empty((0, self._vocab_size), np.float32)
            while position < len(tokens):
                yield len(tokens) - position
                end = min(position + PREFILL_STEP_TOKENS, len(tokens))
                feed = _Feed.prefill(state.seq_id, position, tokens[position:end], last_row=end == len(tokens))
                with self._lock:
                    (rows,) = self._decode([feed])
                position = end
            with self._lock:
                self._kept_first_row(state, rows)
                self._keep_prefilled(state, start)
            opened = True
        finally:
            if not opened:
                with self._lock:
                    if self._sessions.get(session) is state:
                        self._remove_session(session)

    def open_sessions(self, openings: Sequence[Opening]) -> list[ModelError | None]:
        """`open_session` for each opening, their prefills in the same llama_decode calls: a call
        takes each sequence's next tokens as a pass does (fewer than 64 of one sequence, so that a
        cell's KV is what a prefill of its own computes), and short prompts that wait together pay
        one prefill's fixed costs, not one each. A failed call fails every opening it held."""
        failures: list[ModelError | None] = [None] * len(openings)
        # Each session this call added, with where its prefill starts (after the restored prefix).
        added: list[tuple[int, _Sequence]] = []
        starts: list[int] = []
        with self._lock:
            try:
                for index, opening in enumerate(openings):
                    try:
                        state = self._add_session(opening.session, self._checked_prefix(opening.tokens))
                    except ModelError as exc:
                        failures[index] = exc
                        continue
                    state.prefix_scope = opening.prefix_scope
                    added.append((index, state))
                    starts.append(self._restore_prefix(state, state.tokens[:-1]))
                feeds = [
                    _Feed.prefill(state.seq_id, start, state.tokens[start:], last_row=True)
                    for (_, state), start in zip(added, starts, strict=True)
                ]
                rows = self._decode(feeds)
                for (_, state), start, first in zip(added, starts, rows, strict=True):
                    self._kept_first_row(state, first)
                    self._keep_prefilled(state, start)
            except BaseException as exc:
                for index, _ in added:
                    self._remove_session(openings[index].session)
                    if isinstance(exc, ModelError):
                        failures[index] = exc
                if not isinstance(exc, ModelError):
                    raise
        return failures

    def import_kv(self, session: SessionId, data: bytes, committed_tokens: Sequence[int]) -> None:
        """Open ``session`` from a blob of `export_kv` by a target of this GGUF, llama.cpp build
        and kv_slots."""
        tokens = self._checked_prefix(committed_tokens)
        state_bytes = decode_llamacpp_kv(data, self.weights_digest, tokens, self._kv_layout)
        with self._lock:
            state = self._add_session(session, tokens)
            read = llama_cpp.llama_state_seq_set_data(
                self._context, _read_only(state_bytes), len(state_bytes), state.seq_id
            )
            # A blob of a session that had a scored proposal holds its positions too.
            llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, len(tokens) - 1, -1)
            cached = llama_cpp.llama_memory_seq_pos_max(self._memory, state.seq_id) + 1
            if not read or cached != len(tokens) - 1:
                self._remove_session(session)
                raise KVFormatError(f"llama.cpp read no KV of {len(tokens) - 1} positions from the blob")

    def export_kv(self, session: SessionId) -> bytes:
        """The KV of ``session``'s sequence as a blob for `import_kv`. llama.cpp writes a sequence
        whole: a scored proposal's positions go with it, and `import_kv` drops them."""
        with self._lock:
            state = self._session(session)
            return encode_llamacpp_kv(self.weights_digest, state.tokens, self._kv_layout, self._state_of(state))

    def close_session(self, session: SessionId) -> None:
        """Forget ``session``; the prefix cache keeps the KV of its committed tokens but the last
        (the next turn of a conversation starts from it)."""
        with self._lock:
            state = self._session(session)
            self._keep_prefix(state, state.tokens[:-1], 0)
            self._remove_session(session)

    def has_session(self, session: SessionId) -> bool:
        with self._lock:
            return session in self._sessions

    def committed_tokens(self, session: SessionId) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._session(session).tokens)

    def check_request(self, session: SessionId, tokens: Sequence[int], *, extending: bool = False) -> None:
        with self._lock:
            state = self._session(session)
            proposal = tuple(tokens)
            if extending:
                _, proposal = extended_proposal(session, state.tokens, state.pending, proposal)
            self._check_room(state, len(proposal))
        checked_tokens(tokens, self._vocab_size)

    def answers_without_pass(self, session: SessionId, tokens: Sequence[int]) -> bool:
        with self._lock:
            state = self._sessions.get(session)
            return not tokens and state is not None and state.first_row is not None

    def score(self, requests: Sequence[ScoreRequest], *, extending: Collection[SessionId] = ()) -> list[np.ndarray]:
        """Every request's [last committed token] + proposal in one batch; per request float32
        logits (M_i + 1, V), row j after the committed prefix and x[1..j]. A session in
        ``extending`` feeds its tokens after its scored proposal, a row each (Target.score)."""
        if not requests:
            return []
        sessions_in_batch = [session for session, _ in requests]
        if len(set(sessions_in_batch)) != len(sessions_in_batch):
            raise BadTokens("a scoring batch names the same session twice")
        proposals = [tuple(checked_tokens(tokens, self._vocab_size)) for _, tokens in requests]
        with self._lock:
            states = [self._session(session) for session in sessions_in_batch]
            feeds: list[_Feed] = []
            made: list[tuple[int, ...]] = []
            # Per request, the row its prefill kept, returned before the rows its tokens get.
            kept: list[np.ndarray | None] = []
            for session, state, tokens in zip(sessions_in_batch, states, proposals, strict=True):
                first_row = None if session in extending else state.first_row
                if session in extending or first_row is not None:
                    start, proposal = extended_proposal(session, state.tokens, state.pending, tokens)
                    self._check_room(state, len(proposal))
                    feeds.append(_Feed(state.seq_id, start, tokens))
                else:
                    self._check_room(state, len(tokens))
                    proposal = tokens
                    feeds.append(_Feed(state.seq_id, len(state.tokens) - 1, (state.tokens[-1], *tokens)))
                made.append(proposal)
                kept.append(first_row)
            for session, state, first_row in zip(sessions_in_batch, states, kept, strict=True):
                if session not in extending and first_row is None:
                    self._drop_pending(state)
            computed = iter(self._decode([feed for feed in feeds if feed.tokens]))
            self.scored_tokens = sum(len(feed.tokens) for feed in feeds)
            rows = []
            for feed, first_row in zip(feeds, kept, strict=True):
                if first_row is None:
                    rows.append(next(computed))
                else:
                    rows.append(np.concatenate((first_row[None], next(computed))) if feed.tokens else first_row[None])
            for state, proposal in zip(states, made, strict=True):
                state.pending = proposal
                state.first_row = None
            return rows

    def commit(self, session: SessionId, accepted: int, emitted: Sequence[int]) -> None:
        """Keep x[1..accepted] and append ``emitted``: the sequence drops the positions past the
        committed prefix but its last token, unless ``emitted`` begin the proposal (its rest stays)."""
        emitted_tokens = checked_tokens(emitted, self._vocab_size)
        with self._lock:
            state = self._session(session)
            # A row a prefill kept was scored for no one yet: the session has no scored proposal.
            check_commit(session, state.pending if state.first_row is None else None, accepted, emitted_tokens)
            rest = proposal_rest(state.pending, emitted_tokens)
            state.tokens.extend(emitted_tokens)
            if rest is None:
                self._drop_pending(state)
            else:
                # The sequence holds the committed tokens and the rest of the proposal, as after a score.
                state.pending = rest

    def rollback(self, session: SessionId) -> None:
        with self._lock:
            self._drop_pending(self._session(session))

    # -- on the lock ---------------------------------------------------------------------------------

    def _restore_prefix(self, state: _Sequence, prefix: Sequence[int]) -> int:
        """Restore the KV of the longest cached whole-block prefix into the (empty) sequence;
        returns its length (0: none held, or the blob did not restore: the prefill computes it all)."""
        index = self.prefixes
        found = None if index is None else index.lookup(prefix, state.prefix_scope)
        if index is None or found is None:
            return 0
        entry, length = found
        read = llama_cpp.llama_state_seq_set_data(self._context, _read_only(entry.data), len(entry.data), state.seq_id)
        llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, length, -1)
        if read and llama_cpp.llama_memory_seq_pos_max(self._memory, state.seq_id) + 1 == length:
            return length
        llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, -1, -1)
        index.hits -= length
        index.discard(entry)
        return 0

    def _keep_prefix(self, state: _Sequence, prefix: Sequence[int], restored: int) -> None:
        """Store the sequence's KV of ``prefix`` where it reaches past what was restored and what
        the cache holds."""
        index = self.prefixes
        scope = state.prefix_scope
        if (
            index is None
            or index.whole_blocks(len(prefix)) == 0
            or len(prefix) <= max(restored, index.covered(prefix, scope))
        ):
            return
        index.insert(prefix, self._state_of(state), scope)

    def _keep_prefilled(self, state: _Sequence, start: int) -> None:
        """Store the KV of a prefill that computed at least SHARE_TOKENS from ``start`` on. One that
        computed little leaves its storing to the session's end (close_session): copying the
        sequence's state (tens of MB) would delay the session's first token."""
        if len(state.tokens) - 1 - start >= SHARE_TOKENS:
            self._keep_prefix(state, state.tokens[:-1], start)

    def _state_of(self, state: _Sequence) -> bytes:
        """llama.cpp's state of the sequence, all its positions (`llama_state_seq_get_data`)."""
        size = llama_cpp.llama_state_seq_get_size(self._context, state.seq_id)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._context, buffer, size, state.seq_id)
        # string_at copies the C buffer at once; slicing it makes a list of ints first (1 s at 1800 tokens).
        return ctypes.string_at(buffer, written)

    def _add_session(self, session: SessionId, tokens: list[int]) -> _Sequence:
        if session in self._sessions:
            raise SessionExists(f"session {session.hex()} is already open")
        if not self._free_ids:
            raise SessionLimit(f"{self.name} holds {len(self._sessions)} sessions, its kv_slots")
        state = _Sequence(self._free_ids.pop(), tokens)
        self._sessions[session] = state
        return state

    def _remove_session(self, session: SessionId) -> None:
        state = self._sessions.pop(session)
        llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, -1, -1)
        self._free_ids.append(state.seq_id)
        self._free_ids.sort(reverse=True)

    def _drop_pending(self, state: _Sequence) -> None:
        """Back to the invariant: the sequence holds the committed prefix but its last token."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, state.seq_id, len(state.tokens) - 1, -1):
            raise ModelError(f"llama.cpp could not remove the tail of sequence {state.seq_id}")
        state.pending = None
        state.first_row = None

    @staticmethod
    def _kept_first_row(state: _Sequence, rows: np.ndarray) -> None:
        """The prefill fed the prompt's last token too: its row is the first `score`'s first."""
        state.first_row = rows[-1]
        state.pending = ()

    def _check_room(self, state: _Sequence, proposed: int) -> None:
        if len(state.tokens) + proposed > self._capacity + PROPOSAL_ROOM:
            raise BadTokens(
                f"{len(state.tokens)} committed and {proposed} proposed tokens exceed the "
                f"{self._capacity} + {PROPOSAL_ROOM} positions of a sequence"
            )

    def _decode(self, feeds: Sequence[_Feed]) -> list[np.ndarray]:
        """Decode the feeds; per feed, the logits after each of its tokens from ``rows_from`` on. On
        a failure every feed's sequence is cut back to where it started and ModelError raised."""
        out = [np.empty((len(feed.tokens) - feed.rows_from, self._vocab_size), np.float32) for feed in feeds]
        batch = self._batch
        pads: list[_Pad] = []
        try:
            for call in _paced(_calls(feeds), self._governor):
                # Each token's slot (sequence, position, token, whether its row is read), and where
                # the rows read go: [feed index, its first row in ``out``, how many], in the call's
                # order (a feed's tokens are consecutive in a call).
                slots: list[tuple[int, int, int, bool]] = []
                copies: list[list[int]] = []
                for index, offset in call:
                    feed = feeds[index]
                    wanted = offset >= feed.rows_from
                    slots.append((feed.seq_id, feed.start + offset, feed.tokens[offset], wanted))
                    if wanted:
                        if copies and copies[-1][0] == index:
                            copies[-1][2] += 1
                        else:
                            copies.append([index, offset - feed.rows_from, 1])
                pads = self._pads(call, feeds)
                if pads:
                    # Tokens without a row, removed after the call: they only join the call's
                    # sequences into fewer, wider ubatches (_pads).
                    slots.extend(
                        (pad.seq_id, pad.start + step, slots[0][2], False) for pad in pads for step in range(pad.count)
                    )
                    slots.sort(key=lambda slot: slot[0])
                for slot, (seq_id, position, token, wanted) in enumerate(slots):
                    batch.token[slot] = token
                    batch.pos[slot] = position
                    batch.n_seq_id[slot] = 1
                    batch.seq_id[slot][0] = seq_id
                    batch.logits[slot] = wanted
                batch.n_tokens = len(slots)
                self._thread_one_token_ubatches(call, feeds)
                status = llama_cpp.llama_decode(self._context, batch)
                self._remove(pads)
                pads = []
                if status != 0:
                    raise ModelError(f"llama_decode returned {status}: {_DECODE_FAILURES.get(status, 'it failed')}")
                self._copy_rows(copies, out)
        except BaseException:
            for feed in feeds:
                llama_cpp.llama_memory_seq_rm(self._memory, feed.seq_id, feed.start, -1)
            self._remove(pads)
            raise
        return out

    def _pads(self, call: list[tuple[int, int]], feeds: Sequence[_Feed]) -> list[_Pad]:
        """Tokens to feed beside the call without a row, so that llama.cpp runs it as fewer
        ubatches. It runs a call as ubatches of consecutive sequence ids feeding as many tokens
        each (split_equal over a cache per sequence): sessions with another sequence's id between
        them take a ubatch each side of the gap, and in a pass a ubatch costs about UBATCH_ROWS
        rows more than its rows (docs/performance.md, session 34). Where the call's sessions feed
        as many tokens each, a gap that costs fewer rows than that is filled with as many tokens of
        each sequence in it: from position 0 of a free one, after the last cell of a session not in
        the call. (Prompts of different lengths padded to the longest took longer than the
        ubatches it saved, measured.) A lone token past ``companion_positions`` gets its free
        neighbour (_companion). Every row stays exact: a row depends on its own sequence's cells
        before it alone, in ubatches of fewer than 64 tokens of a sequence (the module doc), and
        what a pad writes is removed after the call."""
        companion = self._companion(call, feeds)
        if companion is not None:
            return [_Pad(companion, 0, 1)]
        if len(feeds) < 2:
            return []
        counts = Counter(index for index, _ in call)
        if len(counts) < 2 or len(set(counts.values())) != 1:
            return []
        width = len(call) // len(counts)
        ids = sorted(feeds[index].seq_id for index in counts)
        free = set(self._free_ids)
        pads = [
            pad
            for low, high in zip(ids, ids[1:], strict=False)
            if high - low > 1 and (high - low - 1) * width < UBATCH_ROWS
            for pad in self._gap_pads(range(low + 1, high), width, free)
        ]
        if len(call) + sum(pad.count for pad in pads) > BATCH_TOKENS:
            return []
        return pads

    def _gap_pads(self, gap: range, width: int, free: set[int]) -> list[_Pad]:
        """``width`` tokens for each sequence of ``gap``: from position 0 of a ``free`` one, after
        the last cell of a session's; none where a session's would not fit in its sequence."""
        pads = []
        for seq_id in gap:
            start = 0 if seq_id in free else int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id)) + 1
            if start + width > self._capacity + PROPOSAL_ROOM:
                return []
            pads.append(_Pad(seq_id, start, width))
        return pads

    def _remove(self, pads: Iterable[_Pad]) -> None:
        for pad in pads:
            llama_cpp.llama_memory_seq_rm(self._memory, pad.seq_id, pad.start, -1)

    def _companion(self, call: list[tuple[int, int]], feeds: Sequence[_Feed]) -> int | None:
        """A free sequence next to a lone token's, from ``companion_positions`` on (default
        COMPANION_POSITIONS), else None. llama.cpp splits a one-token ubatch's attention among
        threads (its row then differs) only where the ubatch is one stream wide; beside a token of a
        neighbouring sequence (llama.cpp puts consecutive sequences in one ubatch) each head's
        attention runs whole on one thread and the pass uses every thread, with the row the
        one-thread pass gives."""
        if len(call) != 1 or self._threads < 2:
            return None
        ((index, offset),) = call
        feed = feeds[index]
        if feed.start + offset < self._companion_positions:
            return None
        return next((seq_id for seq_id in (feed.seq_id + 1, feed.seq_id - 1) if seq_id in self._free_ids), None)

    def _thread_one_token_ubatches(self, call: list[tuple[int, int]], feeds: Sequence[_Feed]) -> None:
        """A one-token ubatch runs on every thread where its attention is not split among them
        (SPLIT_FREE_POSITIONS), else on one. Not only a call of one token makes one: llama.cpp
        splits a call into ubatches of consecutive sequence ids feeding as many tokens each, so
        the last token of a longer feed can run alone (session A feeding 2 tokens beside B feeding
        1). The thread count is set per call, before llama.cpp splits it: one thread as soon as any
        sequence of the call reaches the split region, whatever ubatch its token lands in."""
        reach = max(feeds[index].start + offset + 1 for index, offset in call)
        threads = self._threads if reach <= SPLIT_FREE_POSITIONS else 1
        if threads != self._one_token_threads:
            self._one_token_threads = threads
            llama_cpp.llama_set_n_threads(self._context, threads, self._threads)

    def _copy_rows(self, copies: list[list[int]], out: list[np.ndarray]) -> None:
        """A call's rows into ``out``: ``copies`` name, in the call's order, each feed's rows (feed
        index, its first row in ``out``, how many). llama.cpp keeps them contiguous in the order of
        the batch (`llama_get_logits`): one view of its buffer and a copy per feed. The view is made
        from the address alone (numpy's conversion of a ctypes pointer builds an array type at
        every call, in caches the pass's weights have just swept: docs/performance.md, session 34)
        and kept for the next call that reads as many rows there: the buffer moves only as it grows.
        With the address read as an integer, not cast from a pointer (and a step's greedy pick
        without numpy's reduction along an axis), the scorer's Python between two one-token passes
        went from 0.35 to 0.32 ms (docs/performance.md, session 36)."""
        if not copies:
            return
        address = _logits_address(self._context)
        if not address:
            raise ModelError("llama.cpp has no logits for the pass")
        where = (address, sum(count for _, _, count in copies))
        logits = self._logits_views.get(where)
        if logits is None:
            if len(self._logits_views) >= _LOGITS_VIEWS:
                self._logits_views.clear()
            logits = self._logits_views[where] = np.asarray(_RowsAt(*where, self._vocab_size))
        row = 0
        for index, first, count in copies:
            out[index][first : first + count] = logits[row : row + count]
            row += count

    def _session(self, session: SessionId) -> _Sequence:
        return lookup_session(self._sessions, session, self.name)

    def _checked_prefix(self, tokens: Sequence[int]) -> list[int]:
        checked = checked_tokens(tokens, self._vocab_size)
        if not checked:
            raise BadTokens("a session needs at least one prompt token")
        if len(checked) > self._capacity:
            raise BadTokens(f"{len(checked)} tokens exceed the {self._capacity} positions of a session")
        return checked


def _logits_address_function() -> Callable[[object], int | None]:
    """`llama_get_logits` answering the buffer's address as an integer: llama-cpp-python's binding
    answers a float pointer, which takes a cast to give its address."""
    entry = ctypes.cast(llama_cpp.llama_get_logits, ctypes.c_void_p).value
    if entry is None:
        raise ImportError("llama-cpp-python's library has no llama_get_logits")
    function: Callable[[object], int | None] = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(entry)
    return function


_logits_address = _logits_address_function()


class _RowsAt:
    """``rows`` float32 rows of ``vocab`` at ``address``, for numpy to view (its array interface)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, rows: int, vocab: int) -> None:
        self.__array_interface__ = {"data": (address, True), "shape": (rows, vocab), "typestr": "<f4", "version": 3}


def _read_only(data: bytes) -> ctypes._Pointer[ctypes.c_uint8]:
    """A pointer to ``data``'s own buffer, for llama.cpp's readers of state (which never write it):
    a copy of a prefix's state (tens of MB) costs more than restoring it."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))


def _calls(feeds: Sequence[_Feed]) -> Iterator[list[tuple[int, int]]]:
    """The llama_decode calls of a pass, as (feed index, token offset) pairs: the k-th call round
    takes the k-th SEQUENCE_TOKENS_PER_CALL tokens of every feed, in sequence-id order, in calls of
    up to BATCH_TOKENS tokens."""
    order = sorted(range(len(feeds)), key=lambda index: feeds[index].seq_id)
    longest = max((len(feed.tokens) for feed in feeds), default=0)
    for first in range(0, longest, SEQUENCE_TOKENS_PER_CALL):
        call: list[tuple[int, int]] = []
        for index in order:
            piece = range(first, min(first + SEQUENCE_TOKENS_PER_CALL, len(feeds[index].tokens)))
            if len(call) + len(piece) > BATCH_TOKENS:
                yield call
                call = []
            call.extend((index, offset) for offset in piece)
        if call:
            yield call


def _paced(calls: Iterable[list[tuple[int, int]]], governor: CoreGovernor | None) -> Iterator[list[tuple[int, int]]]:
    """``calls``, the core governor applied before each. While its team is provisional (sized by
    the wait before this work, not yet measured at it), a call holds PROVISIONAL_CALL_TOKENS tokens
    per thread (a shorter rest whole), at most PROVISIONAL_CALLS times, so that the team is sized
    again soon: the governor measures the work 50 ms into it. Exact: each piece still holds a
    sequence's tokens in order, fewer than 64."""
    short = 0
    for call in calls:
        rest = call
        while rest:
            threads = governor.apply() if governor is not None else 0
            cut = len(rest)
            if governor is not None and governor.provisional and short < PROVISIONAL_CALLS:
                most = PROVISIONAL_CALL_TOKENS * threads
                if cut >= 2 * most:
                    cut, short = most, short + 1
            yield rest[:cut]
            rest = rest[cut:]
