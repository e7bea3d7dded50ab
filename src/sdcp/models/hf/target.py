"""The verifier's target model: per-session KV caches and batched scoring (SDCP 6.3 Scoring).

Invariant per session: the KV cache holds every committed token but the last. A scoring pass feeds
[last committed token] + proposed tokens x[1..M] and yields M+1 rows p[1..M+1]; `commit` then crops
the cache to the committed prefix again. A request with no proposed tokens yields the single row
that self-decoding needs (SDCP 6.5.2), batched like any other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from sdcp.cache.prefix import BLOCK_TOKENS, PrefixIndex
from sdcp.models.backend import (
    DEFAULT_KV_SLOTS,
    MAX_SLOT_CAPACITY,
    Opening,
    ScoreRequest,
    SessionId,
    TargetBackend,
    check_commit,
    check_contract_digests,
    checked_tokens,
    extended_proposal,
    lookup_session,
    open_each,
    proposal_rest,
)
from sdcp.models.errors import BadTokens, KVFormatError, ModelError, SessionExists
from sdcp.models.hf import kvcache
from sdcp.models.hf.kvblob import decode_kv, decode_kv_layers, encode_kv, encode_kv_layers
from sdcp.models.hf.packed import pack_weights, with_packed_linears
from sdcp.models.hf.ragged import RaggedBatchCache, SlotPass, supports_ragged_attention, use_ragged_attention
from sdcp.models.weights.digests import tokenizer_definition, tokenizer_digest, weights_digest
from sdcp.threads import CoreGovernor

log = logging.getLogger("sdcp.models")

# A prefill's chunk with the prefix cache on (open_session_steps): the cache keeps whole chunks.
PREFILL_CHUNK_TOKENS = 64


@dataclass
class _Session:
    tokens: list[int]
    cache: DynamicCache
    slot: int | None = None
    pending: tuple[int, ...] | None = None


class TargetModel:
    """A Hugging Face causal LM in fp32 inference mode, serving many sessions.

    Methods are thread-safe (one lock); model work must not run on an asyncio event loop, so
    async callers go through `BatchingScorer.score_async` or `asyncio.to_thread`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: object | None = None,
        *,
        name: str = "model",
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        kv_slots: int = DEFAULT_KV_SLOTS,
        kv_capacity: int | None = None,
        prefix_cache_bytes: int = 0,
    ) -> None:
        # Verification runs in fp32 by default: bf16 changes greedy outputs of SmolLM2 on a CPU, and
        # its weights digest differs (the dtype is part of it). The caller's model is left as it is;
        # ours shares its weights (sdcp.models.hf.packed). transformers wraps `to` in
        # functools.wraps(nn.Module.to), which mypy reads as the unbound method.
        placed = model.to(device=device or "cpu", dtype=dtype).eval()  # type: ignore[call-arg]
        self.model: PreTrainedModel = with_packed_linears(placed)
        if not supports_ragged_attention(self.model):
            raise ModelError(f"target {name}: sliding-window or soft-capped attention is not supported")
        use_ragged_attention(self.model)
        self.tokenizer = tokenizer
        self.name = name
        # kv_slots sessions keep their KV in a shared pool (sdcp.models.hf.kvcache.SlotPool), up to
        # kv_capacity positions each; 0 slots: every session has a cache of its own. A session
        # beyond the slots, or longer than a slot, has a cache of its own, and a pass that includes
        # one attends session by session (sdcp.models.hf.ragged) until a slot is free for it.
        context = getattr(self.model.config, "max_position_embeddings", None) or MAX_SLOT_CAPACITY
        capacity = kv_capacity if kv_capacity is not None else min(context, MAX_SLOT_CAPACITY)
        self._slots: kvcache.SlotPool | None = None
        if kv_slots:
            try:
                self._slots = kvcache.SlotPool(self.model, slots=kv_slots, capacity=capacity)
            except (OSError, MemoryError, RuntimeError) as exc:  # address space refused, device memory full
                log.warning("target %s: no KV slot pool (%s); every session gets a cache of its own", name, exc)
        self._sessions: dict[SessionId, _Session] = {}
        self._lock = threading.RLock()
        self.scored_tokens = 0
        self._prefix_cache_bytes = prefix_cache_bytes

    @property
    def on_host_cores(self) -> bool:
        return self.device.type == "cpu"

    @property
    def extra_rows_apart(self) -> bool:
        # A pass packs every session's rows into one forward (sdcp.models.hf.ragged).
        return False

    @property
    def keeps_prefill_row(self) -> bool:
        # A prefill here keeps no row: every request is a pass (answers_without_pass).
        return False

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    backend: TargetBackend = "torch"

    @cached_property
    def prefixes(self) -> PrefixIndex | None:
        """The prefix cache (docs/models.md, "Prefix cache"), None where it is off: the KV of the
        whole PREFILL_CHUNK_TOKENS chunks of each prompt prefilled, float32 safetensors on the host."""
        if self._prefix_cache_bytes <= 0:
            return None
        salt = self.weights_digest + self.tokenizer_digest
        return PrefixIndex(capacity_bytes=self._prefix_cache_bytes, block=BLOCK_TOKENS, salt=salt)

    def set_threads(self, threads: int) -> None:
        # OpenMP's team size is a setting of the calling thread: the scorer's, the model's own.
        torch.set_num_threads(threads)

    def follow_load(self, governor: CoreGovernor) -> None:
        """Nothing to follow: a prefill chunk is one call of the worker, which applies the
        governor before it."""

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int | None:
        context = getattr(self.model.config, "max_position_embeddings", None)
        return int(context) if context is not None else None

    @cached_property
    def weights_digest(self) -> bytes:
        with self._lock:
            return weights_digest(self.model)

    @cached_property
    def tokenizer_digest(self) -> bytes:
        if self.tokenizer is None:
            raise ModelError(f"target {self.name} was loaded without a tokenizer")
        return tokenizer_digest(self.tokenizer)

    @cached_property
    def tokenizer_definition(self) -> str:
        if self.tokenizer is None:
            raise ModelError(f"target {self.name} was loaded without a tokenizer")
        return tokenizer_definition(self.tokenizer)

    def prepare(self) -> None:
        """Work the first request would otherwise pay: hash the weights and the tokenizer, pack the
        weights (sdcp.models.hf.packed). On the thread that will run the model."""
        with self._lock:
            pack_weights(self.model)
        _ = self.weights_digest, self.tokenizer_digest

    def check_digests(self, target: bytes, tokenizer: bytes) -> None:
        """Refuse a contract naming other weights or another tokenizer (SDCP 6.1)."""
        check_contract_digests(self.name, (self.weights_digest, self.tokenizer_digest), (target, tokenizer))

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int], *, prefix_scope: bytes = b"") -> None:
        """Prefill the committed prefix (the prompt, or prompt + output when resuming), from the
        prefix cache where it is on (`open_session_steps`)."""
        for _ in self.open_session_steps(session, prompt_tokens, prefix_scope=prefix_scope):
            pass

    def open_sessions(self, openings: Sequence[Opening]) -> list[ModelError | None]:
        """One prefill after another: a packed pass of several prompts costs their rows here."""
        return open_each(self, openings)

    def open_session_steps(
        self, session: SessionId, prompt_tokens: Sequence[int], *, prefix_scope: bytes = b""
    ) -> Generator[int, None, None]:
        """`open_session` in steps (Target.open_session_steps). Without the prefix cache, one step:
        a one-pass prefill, as transformers' generate does. With it, the prefix is prefilled in
        chunks of PREFILL_CHUNK_TOKENS from position 0, a step each, cached or not, so that a chunk's
        KV is computed alike whether a later prompt restores it or computes it."""
        tokens = self._checked_tokens(prompt_tokens)
        if not tokens:
            raise BadTokens("a session needs at least one prompt token")
        index = self.prefixes
        if index is None:
            yield len(tokens) - 1
            self._open_in_one_pass(session, tokens)
            return
        prefix = tokens[:-1]
        with self._lock:
            restored, start = self._restore_prefix(index, prefix, prefix_scope)
            self._add_session(
                session,
                tokens,
                lambda buffers: (
                    kvcache.cache_from_tensors(self.model, restored, buffers)
                    if restored
                    else kvcache.new_cache(self.model, buffers)
                ),
            )
        opened = False
        try:
            position = start
            while position < len(prefix):
                yield len(prefix) - position
                end = min(position + PREFILL_CHUNK_TOKENS, len(prefix))
                with self._lock:
                    fed = torch.tensor([prefix[position:end]], device=self.device)
                    self._forward(fed, None, self._session(session).cache)
                position = end
            with self._lock:
                self._keep_prefix(index, self._session(session), prefix, start, prefix_scope)
            opened = True
        finally:
            if not opened:
                with self._lock:
                    if session in self._sessions:
                        self.close_session(session)

    def _open_in_one_pass(self, session: SessionId, tokens: list[int]) -> None:
        def prefilled(buffers: list[tuple[torch.Tensor, torch.Tensor]] | None) -> DynamicCache:
            cache = kvcache.new_cache(self.model, buffers)
            if len(tokens) > 1:
                self._forward(torch.tensor([tokens[:-1]], device=self.device), None, cache)
            return cache

        self._add_session(session, tokens, prefilled)

    def _restore_prefix(
        self, index: PrefixIndex, prefix: Sequence[int], scope: bytes
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """The cached KV of the longest whole-chunk prefix of ``prefix`` (on the model's device
        and dtype) and its length; ([], 0) where none is held or the blob does not fit this model."""
        found = index.lookup(prefix, scope)
        if found is None:
            return [], 0
        entry, served = found
        length = served - served % PREFILL_CHUNK_TOKENS
        index.hits -= served - length
        try:
            layers = decode_kv_layers(entry.data, self._kv_shapes(len(entry.tokens)))
        except KVFormatError as exc:
            log.warning("target %s: a cached prefix's KV is unusable: %s", self.name, exc)
            index.hits -= length
            index.discard(entry)
            return [], 0
        if length == 0:
            return [], 0
        dtype = next(self.model.parameters()).dtype
        return [
            (keys[:, :, :length].to(self.device, dtype), values[:, :, :length].to(self.device, dtype))
            for keys, values in layers
        ], length

    def _keep_prefix(
        self, index: PrefixIndex, state: _Session, prefix: Sequence[int], start: int, scope: bytes
    ) -> None:
        """Store the KV of the prefix's whole chunks where they reach past what was restored (a
        last partial chunk was computed at another width than a longer prompt computes it)."""
        length = len(prefix) - len(prefix) % PREFILL_CHUNK_TOKENS
        if length == 0 or length <= max(start, index.covered(prefix[:length], scope)):
            return
        layers = [
            (keys[:, :, :length].to("cpu", torch.float32), values[:, :, :length].to("cpu", torch.float32))
            for keys, values in kvcache.layer_tensors(state.cache)
        ]
        index.insert(prefix[:length], encode_kv_layers(layers), scope)

    def close_session(self, session: SessionId) -> None:
        with self._lock:
            state = self._session(session)
            del self._sessions[session]
            self._release_slot(state.slot)

    def kv_usage(self) -> float:
        """The share of the KV slot pool's positions that sessions hold (0 without a pool): vLLM's
        KV cache usage. Read without the lock: a metric needs no exact snapshot."""
        pool = self._slots
        if pool is None:
            return 0.0
        held = sum(len(state.tokens) for state in list(self._sessions.values()) if state.slot is not None)
        return min(1.0, held / (pool.slots * pool.capacity))

    def has_session(self, session: SessionId) -> bool:
        with self._lock:
            return session in self._sessions

    def committed_tokens(self, session: SessionId) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._session(session).tokens)

    def check_request(self, session: SessionId, tokens: Sequence[int], *, extending: bool = False) -> None:
        """Raise the error `score` would raise for this request, without running the model."""
        with self._lock:
            state = self._session(session)
            if extending:
                extended_proposal(session, state.tokens, state.pending, tuple(tokens))
        self._checked_tokens(tokens)

    def answers_without_pass(self, session: SessionId, tokens: Sequence[int]) -> bool:
        # A prefill here keeps no row: every request is a pass.
        return False

    def score(self, requests: Sequence[ScoreRequest], *, extending: Collection[SessionId] = ()) -> list[np.ndarray]:
        """Score proposals of many sessions in one padded forward pass.

        Returns per request float32 logits of shape (M_i + 1, V): row j is the target's
        distribution after the committed prefix and x[1..j]. A session with a scored but
        uncommitted proposal has it dropped first (its round was abandoned); one in ``extending``
        feeds its tokens after that proposal instead, a row each (Target.score).
        """
        if not requests:
            return []
        sessions_in_batch = [session for session, _ in requests]
        if len(set(sessions_in_batch)) != len(sessions_in_batch):
            raise BadTokens("a scoring batch names the same session twice")
        proposals = [tuple(self._checked_tokens(tokens)) for _, tokens in requests]
        with self._lock:
            states = [self._session(session) for session in sessions_in_batch]
            # The cache holds the committed tokens but the last, and a scored proposal's [last, *x].
            fed: list[tuple[int, ...]] = []
            made: list[tuple[int, ...]] = []
            for session, state, tokens in zip(sessions_in_batch, states, proposals, strict=True):
                if session in extending:
                    made.append(extended_proposal(session, state.tokens, state.pending, tokens)[1])
                    fed.append(tokens)
                else:
                    self._drop_pending(state)
                    made.append(tokens)
                    fed.append((state.tokens[-1], *tokens))
            rows = [self._score_one(states[0], fed[0])] if len(states) == 1 else self._score_batch(states, fed)
            self.scored_tokens = sum(len(tokens) for tokens in fed)
            for state, proposal in zip(states, made, strict=True):
                state.pending = proposal
            return rows

    def rollback(self, session: SessionId) -> None:
        """Forget a scored proposal without committing anything (e.g. sdcp-q-unavailable)."""
        with self._lock:
            self._drop_pending(self._session(session))

    def commit(self, session: SessionId, accepted: int, emitted: Sequence[int]) -> None:
        """Apply a verdict: keep x[1..accepted] and append `emitted`, cropping rejected KV (unless
        `emitted` begin the proposal: its rest stays scored)."""
        emitted_tokens = self._checked_tokens(emitted)
        with self._lock:
            state = self._session(session)
            check_commit(session, state.pending, accepted, emitted_tokens)
            rest = proposal_rest(state.pending, emitted_tokens)
            state.tokens.extend(emitted_tokens)
            if rest is None:
                kvcache.crop_to(state.cache, len(state.tokens) - 1)
            # Else the cache holds the committed tokens and the rest of the proposal, as after a score.
            state.pending = rest

    def session_kv(self, session: SessionId) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the committed KV, per layer (keys, values) of shape (1, H, n - 1, D)."""
        with self._lock:
            state = self._session(session)
            length = len(state.tokens) - 1
            if length == 0:
                return []
            return [
                (keys[:, :, :length].clone(), values[:, :, :length].clone())
                for keys, values in kvcache.layer_tensors(state.cache)
            ]

    def export_kv(self, session: SessionId) -> bytes:
        """The committed target KV as a versioned blob (docs/models.md), for the MLC."""
        with self._lock:
            tokens = self.committed_tokens(session)
            tensors = self.session_kv(session)
        # The blob format is float32 on the host, whatever the model's dtype and device.
        as_float32 = [(k.to("cpu", torch.float32), v.to("cpu", torch.float32)) for k, v in tensors]
        return encode_kv(self.weights_digest, tokens, as_float32)

    def import_kv(self, session: SessionId, data: bytes, committed_tokens: Sequence[int]) -> None:
        """Open `session` from an exported blob instead of a prefill (failover, SDCP 6.9)."""
        tokens = self._checked_tokens(committed_tokens)
        tensors = decode_kv(data, self.weights_digest, tokens, self._kv_shapes(len(tokens) - 1))
        dtype = next(self.model.parameters()).dtype
        on_device = [(k.to(self.device, dtype), v.to(self.device, dtype)) for k, v in tensors]
        self._add_session(session, tokens, lambda buffers: kvcache.cache_from_tensors(self.model, on_device, buffers))

    def _add_session(
        self,
        session: SessionId,
        tokens: list[int],
        build: Callable[[list[tuple[torch.Tensor, torch.Tensor]] | None], DynamicCache],
    ) -> None:
        """Open ``session`` on the cache ``build`` makes, on a free slot's buffers if there is one."""
        with self._lock:
            if session in self._sessions:
                raise SessionExists(f"session {session.hex()} is already open")
            slot = self._acquire_slot()
            try:
                cache = build(self._slot_buffers(slot))
            except BaseException:
                self._release_slot(slot)
                raise
            self._sessions[session] = _Session(tokens=tokens, cache=cache, slot=slot)

    def _kv_shapes(self, length: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        if length == 0:
            return []
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (1, heads, length, head_dim)
        return [(shape, shape) for _ in range(config.num_hidden_layers)]

    def _score_one(self, state: _Session, fed: tuple[int, ...]) -> np.ndarray:
        input_ids = torch.tensor([list(fed)], device=self.device)
        logits = self._forward(input_ids, None, state.cache)
        return logits[0].to(torch.float32).cpu().numpy()

    def _score_batch(self, states: list[_Session], fed: list[tuple[int, ...]]) -> list[np.ndarray]:
        # One packed sequence, session after session; attention runs per session against its own
        # cache, which the pass extends by that session's tokens (sdcp.models.hf.ragged).
        widths = [len(tokens) for tokens in fed]
        input_ids = torch.tensor([[token for tokens in fed for token in tokens]], device=self.device)
        starts = [kvcache.cache_length(state.cache) for state in states]
        positions = torch.cat([torch.arange(start, start + width) for start, width in zip(starts, widths, strict=True)])
        positions = positions.unsqueeze(0)
        slots = self._slot_pass(states, starts, widths)
        cache = RaggedBatchCache([state.cache for state in states], widths, slots)
        logits = self._forward(input_ids, positions.to(self.device), cache)[0].to(torch.float32).cpu()
        if slots is not None:
            for state, start, width in zip(states, starts, widths, strict=True):
                kvcache.set_length(state.cache, start + width)
        return [rows.numpy() for rows in torch.split(logits, widths)]

    def _slot_pass(self, states: list[_Session], starts: list[int], widths: list[int]) -> SlotPass | None:
        """A plan for scoring the pass through the slot pool, when every session's cache is in a
        slot with room for its rows. A session that outgrew its slot gives it back; one without a
        slot moves into a free one that has room for it."""
        pool = self._slots
        if pool is None:
            return None
        for state, start, width in zip(states, starts, widths, strict=True):
            if state.slot is not None and not pool.holds(state.slot, state.cache):
                self._release_slot(state.slot)
                state.slot = None
            if state.slot is None and start + width <= pool.capacity:
                state.slot = pool.acquire()
                if state.slot is not None:
                    kvcache.move_to(state.cache, pool.buffers(state.slot))
        held = [state.slot for state in states if state.slot is not None]
        if len(held) < len(states):
            return None
        if any(start + width > pool.capacity for start, width in zip(starts, widths, strict=True)):
            return None
        return SlotPass(pool, held, starts, widths)

    def _acquire_slot(self) -> int | None:
        return self._slots.acquire() if self._slots is not None else None

    def _slot_buffers(self, slot: int | None) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        return self._slots.buffers(slot) if self._slots is not None and slot is not None else None

    def _release_slot(self, slot: int | None) -> None:
        if self._slots is not None and slot is not None:
            self._slots.release(slot)

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        cache: DynamicCache | RaggedBatchCache,
    ) -> torch.Tensor:
        with torch.inference_mode():
            output = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        logits: torch.Tensor = output.logits
        return logits

    def _drop_pending(self, state: _Session) -> None:
        if state.pending is not None:
            kvcache.crop_to(state.cache, len(state.tokens) - 1)
            state.pending = None

    def _session(self, session: SessionId) -> _Session:
        return lookup_session(self._sessions, session, self.name)

    def _checked_tokens(self, tokens: Sequence[int]) -> list[int]:
        return checked_tokens(tokens, self.vocab_size)
