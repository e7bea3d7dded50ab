"""What the verifier needs of its target model, whatever runs it (SDCP 6.3 Scoring), and the rules
every target applies alike.

Two backends implement `Target`: `sdcp.models.hf.target.TargetModel` (torch + transformers, a Hugging
Face model directory) and `sdcp.models.llamacpp.target.LlamaCppTarget` (llama.cpp, a GGUF file). The
verifier engine and `sdcp.models.batching.BatchingScorer` are typed against the protocol only.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import numpy as np

from sdcp.cache.prefix import PrefixIndex
from sdcp.models.errors import BadTokens, DigestMismatch, InconsistentCommit, ModelError, UnknownSession
from sdcp.threads import CoreGovernor

__all__ = [
    "DEFAULT_KV_SLOTS",
    "LLAMACPP_KV_SLOTS",
    "MAX_SLOT_CAPACITY",
    "Opening",
    "ScoreRequest",
    "SessionId",
    "Target",
    "BackendSetting",
    "TargetBackend",
    "check_commit",
    "check_contract_digests",
    "checked_tokens",
    "common_prefix_length",
    "open_each",
    "lookup_session",
    "proposal_rest",
    "extended_proposal",
]

SessionId = bytes
ScoreRequest = tuple[SessionId, Sequence[int]]
# Who runs a target: torch + transformers (a Hugging Face directory) or llama.cpp (a GGUF file).
TargetBackend = Literal["torch", "llamacpp"]
# What a configuration may say: a backend, or "auto" (the faster on this host, sdcp.models.choice).
BackendSetting = Literal["auto", "torch", "llamacpp"]

# Sessions whose KV a target keeps in its pool (TargetModel's slots, LlamaCppTarget's sequences).
DEFAULT_KV_SLOTS = 32
# llama.cpp allocates and clears its whole KV cache at start: 16 sequences of 4096 positions of
# SmolLM2-135M are about 1.5 GB resident (32 would be 3.1 GB), where torch's unused slots cost
# address space only.
LLAMACPP_KV_SLOTS = 16
# Positions per session of the pool, at most, where the configuration leaves it to the model.
MAX_SLOT_CAPACITY = 4096


@dataclass(frozen=True)
class Opening:
    """A session to open by a prefill (Target.open_sessions): its committed prefix and the scope
    of the prefixes it may be served from (Target.open_session)."""

    session: SessionId
    tokens: tuple[int, ...]
    prefix_scope: bytes = b""


class Target(Protocol):
    """A target model serving many sessions. A session's state holds its committed tokens (prompt,
    then output); `score` rows are the target's distributions after them and the proposed tokens.
    Methods are called from one thread, the scorer's (docs/models.md)."""

    backend: TargetBackend
    # The tokens the last `score` fed the model: the rows it computed (a prefill's kept row is not
    # one; BatchingScorer's PassInfo counts these).
    scored_tokens: int

    @property
    def vocab_size(self) -> int: ...

    def set_threads(self, threads: int) -> None:
        """Run the next passes on this many threads (sdcp.threads.CoreGovernor sizes them)."""
        ...

    def follow_load(self, governor: CoreGovernor) -> None:
        """Apply ``governor`` between the model calls of one piece of work, so that a long
        prefill's team follows the load within it (and, while its team is provisional, make the
        first call short); a backend whose work is one call each may ignore it."""
        ...

    @property
    def extra_rows_apart(self) -> bool:
        """Whether a pass that several sessions share runs the rows a session scores after its
        first as a pass of their own (llama.cpp: a cache per sequence splits a call by the tokens
        each sequence feeds), so that they cost what such a pass costs (speculation_length)."""
        ...

    @property
    def keeps_prefill_row(self) -> bool:
        """Whether a session's first request after its prefill, without tokens, is answered from
        the row the prefill kept, with no pass (answers_without_pass; llama.cpp)."""
        ...

    @property
    def on_host_cores(self) -> bool:
        """Whether a pass runs on the host's cores (llama.cpp, torch on the CPU), where Python work
        beside it slows it down (BatchingScorer lets the event loops settle before each pass)."""
        ...

    @property
    def context_length(self) -> int | None:
        """Positions a session may hold (prompt plus output), None where the model names none."""
        ...

    @property
    def weights_digest(self) -> bytes:
        """The contract's target digest (SDCP 4.1)."""
        ...

    @property
    def tokenizer_digest(self) -> bytes: ...

    @property
    def tokenizer_definition(self) -> str:
        """The tokenizer's definition (a Hugging Face ``tokenizer.json``): what a constraint's token
        masks are computed over (sdcp.grammar)."""
        ...

    def prepare(self) -> None:
        """Work the first request would otherwise pay (digests, weight layouts)."""

    def check_digests(self, target: bytes, tokenizer: bytes) -> None:
        """Raise DigestMismatch for a contract naming another target or tokenizer (SDCP 6.1)."""

    def open_session(self, session: SessionId, prompt_tokens: Sequence[int], *, prefix_scope: bytes = b"") -> None:
        """Prefill the committed prefix (the prompt, or prompt + output when resuming), from the
        KV the prefix cache holds of ``prefix_scope``'s prompts (a tenant's) where it is on. A
        backend may compute the row after the prefix with it and return it from the session's
        first `score`, which then feeds only its proposal (llama.cpp)."""

    def open_session_steps(
        self, session: SessionId, prompt_tokens: Sequence[int], *, prefix_scope: bytes = b""
    ) -> Generator[int, None, None]:
        """`open_session` in steps, so that other sessions' passes run between them (chunked
        prefill): each ``next`` runs one step and yields how many tokens are still to prefill; the
        session is open once the iterator ends. Closing the iterator before its end forgets the
        session. Every step runs on the scorer's thread."""
        ...

    def open_sessions(self, openings: Sequence[Opening]) -> list[ModelError | None]:
        """`open_session` for each opening, their prefills run together where the backend can
        (llama.cpp: their tokens share its calls, as a pass's sessions do); each one's failure,
        None where the session is open. A session that failed is not open."""
        ...

    def import_kv(self, session: SessionId, data: bytes, committed_tokens: Sequence[int]) -> None:
        """Open ``session`` from a blob of `export_kv` instead of a prefill (SDCP 6.9)."""

    def export_kv(self, session: SessionId) -> bytes:
        """The committed KV of ``session`` as a versioned blob (docs/models.md)."""
        ...

    def close_session(self, session: SessionId) -> None: ...

    def has_session(self, session: SessionId) -> bool: ...

    def committed_tokens(self, session: SessionId) -> tuple[int, ...]: ...

    def check_request(self, session: SessionId, tokens: Sequence[int], *, extending: bool = False) -> None:
        """Raise the error `score` would raise for this request, without running the model."""

    def answers_without_pass(self, session: SessionId, tokens: Sequence[int]) -> bool:
        """Whether `score` answers this request (not extending) without running the model: the
        row a prefill kept and no proposal (llama.cpp; see `open_session`)."""
        ...

    def score(self, requests: Sequence[ScoreRequest], *, extending: Collection[SessionId] = ()) -> list[np.ndarray]:
        """One pass over every request: per request float32 logits (M_i + 1, V), row j after the
        committed prefix and x[1..j]. A scored proposal left uncommitted is dropped first.

        The tokens of a session in ``extending`` follow its scored proposal instead (which then
        holds them too): its rows, one per token, are those after the proposal and each of them.
        """
        ...

    def commit(self, session: SessionId, accepted: int, emitted: Sequence[int]) -> None:
        """Keep x[1..accepted] of the scored proposal and append ``emitted``. Where ``emitted``
        are the proposal's first tokens, the rest of it stays scored (`proposal_rest`)."""

    def rollback(self, session: SessionId) -> None:
        """Forget a scored proposal without committing anything."""

    def kv_usage(self) -> float:
        """The share of the KV pool that sessions hold, 0 to 1 (a metric, read without the lock)."""
        ...

    @property
    def prefixes(self) -> PrefixIndex | None:
        """The prefix cache `open_session` starts prefills from (sdcp.cache.prefix), None where off."""
        ...


def checked_tokens(tokens: Sequence[int], vocab_size: int) -> list[int]:
    """The tokens as ints, or BadTokens for an id outside the vocabulary."""
    checked = [int(token) for token in tokens]
    bad = [token for token in checked if not 0 <= token < vocab_size]
    if bad:
        raise BadTokens(f"token ids {bad[:5]} outside the vocabulary 0..{vocab_size - 1}")
    return checked


def common_prefix_length(held: Sequence[int], given: Sequence[int]) -> int:
    """The length of the longest common prefix, by slice comparisons (C speed) over halving ranges
    rather than a Python step per token: a long session's sync costs little beyond its new tokens.
    A list and a tuple are compared as tuples (a list's slice never equals a tuple's)."""
    if type(held) is not type(given):
        held, given = tuple(held), tuple(given)
    low, high = 0, min(len(held), len(given))
    if held[:high] == given[:high]:
        return high
    # held[:low] equals given[:low]; held[:high] does not equal given[:high].
    while high - low > 1:
        middle = (low + high) // 2
        if held[low:middle] == given[low:middle]:
            low = middle
        else:
            high = middle
    return low


def check_contract_digests(name: str, loaded: tuple[bytes, bytes], contract: tuple[bytes, bytes]) -> None:
    """Refuse a contract whose (target, tokenizer) digests are not those ``loaded`` (SDCP 6.1)."""
    # SDCP 6.1: the verifier MUST refuse a contract whose target digest does not match.
    (weights, tokenizer), (wanted_weights, wanted_tokenizer) = loaded, contract
    if wanted_weights != weights:
        raise DigestMismatch(
            f"contract target digest {wanted_weights.hex()} does not match the loaded model {name} ({weights.hex()})"
        )
    if wanted_tokenizer != tokenizer:
        raise DigestMismatch(
            f"contract tokenizer digest {wanted_tokenizer.hex()} does not match the loaded "
            f"tokenizer of {name} ({tokenizer.hex()})"
        )


def check_commit(session: SessionId, proposal: tuple[int, ...] | None, accepted: int, emitted: Sequence[int]) -> None:
    """Refuse a verdict that does not fit the scored ``proposal``: ``accepted`` of its tokens, then
    the emitted tokens, which repeat the accepted ones and add at most one."""
    if proposal is None:
        raise InconsistentCommit(f"session {session.hex()} has no scored proposal")
    if not 0 <= accepted <= len(proposal):
        raise InconsistentCommit(f"accepted={accepted} outside 0..{len(proposal)}")
    if len(emitted) > accepted + 1:
        raise InconsistentCommit(f"{len(emitted)} emitted tokens for {accepted} accepted ones")
    confirmed = min(len(emitted), accepted)
    if tuple(emitted[:confirmed]) != proposal[:confirmed]:
        raise InconsistentCommit("emitted tokens differ from the accepted proposal")


def extended_proposal(
    session: SessionId, committed: Sequence[int], proposal: tuple[int, ...] | None, tokens: tuple[int, ...]
) -> tuple[int, tuple[int, ...]]:
    """Where ``tokens`` that extend a session's scored proposal are fed (the position of the first)
    and the proposal they make. A commit may have taken the whole proposal and the token after it,
    which the target has not fed yet (the last committed one): the tokens then begin with it."""
    if proposal is not None:
        return len(committed) + len(proposal), (*proposal, *tokens)
    if tokens and committed and tokens[0] == committed[-1]:
        return len(committed) - 1, tokens[1:]
    raise InconsistentCommit(f"session {session.hex()} has no scored proposal that the tokens extend")


def proposal_rest(proposal: tuple[int, ...] | None, emitted: Sequence[int]) -> tuple[int, ...] | None:
    """What stays scored of ``proposal`` once ``emitted`` are committed: its rest where they are its
    first tokens (the rows of the rest are still the target's), else None (the proposal is dropped)."""
    if proposal is None or tuple(emitted) != proposal[: len(emitted)]:
        return None
    return proposal[len(emitted) :]


SessionState = TypeVar("SessionState")


def lookup_session(sessions: dict[SessionId, SessionState], session: SessionId, owner: str) -> SessionState:
    """A model's state of ``session``; UnknownSession naming ``owner`` where it holds none."""
    try:
        return sessions[session]
    except KeyError:
        raise UnknownSession(f"session {session.hex()} is not open on {owner}") from None


def open_each(target: Target, openings: Sequence[Opening]) -> list[ModelError | None]:
    """`Target.open_sessions` one prefill after another, for a backend that gains nothing from
    running them together."""
    failures: list[ModelError | None] = []
    try:
        for opening in openings:
            try:
                target.open_session(opening.session, opening.tokens, prefix_scope=opening.prefix_scope)
            except ModelError as exc:
                failures.append(exc)
            else:
                failures.append(None)
    except BaseException:
        # Not a failure of one opening: none of the group stays open.
        for opening, failure in zip(openings, failures, strict=False):
            if failure is None:
                target.close_session(opening.session)
        raise
    return failures
