"""Acceptance rules (SDCP 6.4) and the verifier's random values.

A rule turns the target distributions p[1..M+1] of a round, the proposed tokens x[1..M] and (for
rule 2) the draft rows q[1..M] into the number a of accepted tokens and one additional token.
Positions are numbered from 1 as in the draft; the additional token has position index a + 1,
which is also the ``i`` its random value is derived with (purpose 1).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sdcp.protocol.problems import BadContract, ProblemType, ProtocolError
from sdcp.protocol.sampling import draw_token

__all__ = [
    "Acceptance",
    "GREEDY",
    "PURPOSE_ACCEPT",
    "PURPOSE_EXTRA_TOKEN",
    "RULES",
    "RandomSource",
    "Rule",
    "SPECULATIVE_SAMPLING",
    "SecureRandom",
    "SeededRandom",
    "check_draft_rows",
    "get_rule",
    "hmac_sha256",
    "parse_q_rows",
    "verifier_random",
]

PURPOSE_ACCEPT = 0
PURPOSE_EXTRA_TOKEN = 1

_VERIFY_LABEL = b"SDCP-VERIFY-1\x00"
_UINT32_MAX = 0xFFFF_FFFF
_UINT64_MAX = 0xFFFF_FFFF_FFFF_FFFF
_SESSION_ID_SIZE = 16
_RANDOM_BITS = 53
_RANDOM_SCALE = float(2**_RANDOM_BITS)
_Q_ROW_DTYPE = np.dtype("<f4")


def hmac_sha256(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA-256 (RFC 2104 with SHA-256); the one primitive behind seeded verifier randomness."""
    return hmac.digest(key, message, hashlib.sha256)


def verifier_random(seed: int, session: bytes, round: int, i: int, purpose: int) -> float:
    """The seeded verifier random value in [0, 1) for position ``i`` of ``round`` (SDCP 6.4)."""
    if not 0 <= seed <= _UINT64_MAX:
        raise ValueError(f"seed must fit in eight octets, got {seed}")
    if len(session) != _SESSION_ID_SIZE:
        raise ValueError(f"session id must be {_SESSION_ID_SIZE} octets, got {len(session)}")
    if not 0 <= round <= _UINT32_MAX or not 0 <= i <= _UINT32_MAX:
        raise ValueError(f"round and i must be uint32, got round={round} i={i}")
    if purpose not in (PURPOSE_ACCEPT, PURPOSE_EXTRA_TOKEN):
        raise ValueError(f"purpose must be 0 or 1, got {purpose}")
    # SDCP 6.4: key = seed as eight octets in network byte order; message = label || session ||
    # uint32(round) || uint32(i) || uint8(purpose); value = first 53 bits / 2^53.
    message = _VERIFY_LABEL + session + struct.pack(">IIB", round, i, purpose)
    mac = hmac_sha256(seed.to_bytes(8, "big"), message)
    return (int.from_bytes(mac[:8], "big") >> (64 - _RANDOM_BITS)) / _RANDOM_SCALE


class RandomSource(Protocol):
    """Where a rule takes its uniform values from: one value per (position, purpose)."""

    def uniform(self, i: int, purpose: int) -> float: ...


@dataclass(frozen=True)
class SeededRandom:
    """Verifier randomness for a round whose sampling profile has a seed (SDCP 6.4)."""

    seed: int
    session: bytes
    round: int

    def uniform(self, i: int, purpose: int) -> float:
        return verifier_random(self.seed, self.session, self.round, i, purpose)


class SecureRandom:
    """Verifier randomness without a seed: a cryptographically secure generator (SDCP 6.4)."""

    def uniform(self, i: int, purpose: int) -> float:
        return secrets.randbits(_RANDOM_BITS) / _RANDOM_SCALE


@dataclass(frozen=True)
class Acceptance:
    """Outcome of a rule: ``accepted`` proposed tokens (a) and the additional token."""

    accepted: int
    extra_token: int


class Rule(Protocol):
    """A registered acceptance rule (SDCP 6.4, registry of 10.2.2)."""

    @property
    def id(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def needs_q(self) -> bool:
        """Whether the rule needs the draft rows q (then the verifier checks them first, SDCP 6.3)."""
        ...

    def accept(
        self,
        p_rows: np.ndarray,
        q_rows: np.ndarray | None,
        tokens: tuple[int, ...],
        rng: RandomSource,
    ) -> Acceptance: ...


def parse_q_rows(data: bytes, proposed: int, vocab_size: int) -> np.ndarray:
    """Read a q_rows object (SDCP 5.2: M rows of V little-endian binary32) as an (M, V) array."""
    expected = proposed * vocab_size * _Q_ROW_DTYPE.itemsize
    if len(data) != expected:
        raise ProtocolError(
            ProblemType.BAD_PROPOSAL,
            f"q_rows holds {len(data)} octets; {proposed} rows of {vocab_size} binary32 need {expected}",
        )
    return np.frombuffer(data, dtype=_Q_ROW_DTYPE).reshape(proposed, vocab_size)


def check_draft_rows(q_rows: np.ndarray | None, tokens: tuple[int, ...], vocab_size: int | None = None) -> np.ndarray:
    """Validate the draft rows of a proposal and return them as normalised float64 rows.

    SDCP 6.3 and 6.4: the verifier checks that q[i](x[i]) is not zero for every position before it
    draws any random value, and rejects the proposal with sdcp-bad-proposal otherwise. Rows must
    also be finite and non-negative, one per proposed token, of the target's vocabulary size.
    Rows are normalised because the drafter samples from a row with the same inverse CDF as
    ``draw_token``, which draws from the row divided by its sum.
    """
    if q_rows is None:
        raise ProtocolError(ProblemType.BAD_PROPOSAL, "the acceptance rule needs q_rows")
    rows = np.asarray(q_rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[0] != len(tokens) or rows.shape[1] == 0:
        raise ProtocolError(
            ProblemType.BAD_PROPOSAL,
            f"q_rows has shape {rows.shape}; expected one row per proposed token ({len(tokens)})",
        )
    if vocab_size is not None and rows.shape[1] != vocab_size:
        raise ProtocolError(
            ProblemType.BAD_PROPOSAL, f"q rows have {rows.shape[1]} entries, vocabulary has {vocab_size}"
        )
    _check_tokens(tokens, rows.shape[1])
    if not np.all(np.isfinite(rows)) or np.any(rows < 0):
        raise ProtocolError(ProblemType.BAD_PROPOSAL, "q rows must be finite and non-negative")
    proposed_mass = rows[np.arange(len(tokens)), list(tokens)]
    zero_positions = np.flatnonzero(proposed_mass == 0.0)
    if zero_positions.size:
        raise ProtocolError(
            ProblemType.BAD_PROPOSAL,
            f"q[i](x[i]) is zero at position {int(zero_positions[0]) + 1}",
        )
    normalised: np.ndarray = rows / np.sum(rows, axis=-1, keepdims=True)
    return normalised


def _check_tokens(tokens: tuple[int, ...], vocab_size: int) -> None:
    if not tokens:
        raise ProtocolError(ProblemType.BAD_PROPOSAL, "a proposal carries at least one token")
    for position, token in enumerate(tokens, start=1):
        if not 0 <= token < vocab_size:
            raise ProtocolError(
                ProblemType.BAD_PROPOSAL,
                f"token {token} at position {position} is outside the vocabulary (size {vocab_size})",
            )


def _check_target_rows(p_rows: np.ndarray, tokens: tuple[int, ...]) -> np.ndarray:
    # Floating rows keep their precision: rule 1 only compares them (float32 logits, ~7 MB in
    # float64 per 17-token round), rule 2 computes in the float64 of target_distribution.
    rows = np.asarray(p_rows)
    if not np.issubdtype(rows.dtype, np.floating):
        rows = rows.astype(np.float64)
    if rows.ndim != 2 or rows.shape[0] != len(tokens) + 1:
        raise ValueError(f"p_rows has shape {rows.shape}; expected ({len(tokens) + 1}, V)")
    _check_tokens(tokens, rows.shape[1])
    return rows


def _argmax(row: np.ndarray) -> int:
    # np.argmax returns the first maximum: ties go to the smallest token id (SDCP 6.4, rule 1).
    return int(np.argmax(row))


@dataclass(frozen=True)
class GreedyRule:
    """Rule 1: accept while x[i] is argmax p[i]; the additional token is argmax p[a+1]."""

    id: int = 1
    name: str = "greedy"
    needs_q: bool = False

    def accept(
        self,
        p_rows: np.ndarray,
        q_rows: np.ndarray | None,
        tokens: tuple[int, ...],
        rng: RandomSource,
    ) -> Acceptance:
        rows = _check_target_rows(p_rows, tokens)
        accepted = 0
        for position, token in enumerate(tokens):
            if token != _argmax(rows[position]):
                break
            accepted += 1
        return Acceptance(accepted=accepted, extra_token=_argmax(rows[accepted]))


@dataclass(frozen=True)
class SpeculativeSamplingRule:
    """Rule 2: speculative sampling [LEVIATHAN] [CHEN]; output follows the target distribution."""

    id: int = 2
    name: str = "speculative-sampling"
    needs_q: bool = True

    def accept(
        self,
        p_rows: np.ndarray,
        q_rows: np.ndarray | None,
        tokens: tuple[int, ...],
        rng: RandomSource,
    ) -> Acceptance:
        rows = _check_target_rows(p_rows, tokens)
        # SDCP 6.3: every q row is checked before the first random value is drawn.
        draft = check_draft_rows(q_rows, tokens, rows.shape[1])
        for index, token in enumerate(tokens):
            position = index + 1
            r = rng.uniform(position, PURPOSE_ACCEPT)
            if not r < min(1.0, rows[index, token] / draft[index, token]):
                residual = np.maximum(0.0, rows[index] - draft[index])
                # p == q makes every token acceptable, so a rejection with an all-zero residual is
                # only floating-point dust; p itself is then the exact residual's limit.
                source = residual if np.any(residual > 0.0) else rows[index]
                return Acceptance(index, draw_token(source, rng.uniform(position, PURPOSE_EXTRA_TOKEN)))
        extra_position = len(tokens) + 1
        extra = draw_token(rows[len(tokens)], rng.uniform(extra_position, PURPOSE_EXTRA_TOKEN))
        return Acceptance(len(tokens), extra)


GREEDY = GreedyRule()
SPECULATIVE_SAMPLING = SpeculativeSamplingRule()

RULES: dict[int, Rule] = {GREEDY.id: GREEDY, SPECULATIVE_SAMPLING.id: SPECULATIVE_SAMPLING}


def get_rule(rule_id: int) -> Rule:
    """The registered rule ``rule_id``; an unregistered rule makes the contract unsupported."""
    try:
        return RULES[rule_id]
    except KeyError:
        raise BadContract(f"acceptance rule {rule_id} is not registered") from None
