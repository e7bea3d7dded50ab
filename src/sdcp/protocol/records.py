"""Commit-log records and the replay of a log (SDCP 6.8, 6.9).

Records are CBOR maps in deterministic encoding. A commit record is
``{"epoch", "round", "emitted", "committed", "digest"}``; a fence record is ``{"epoch"}`` alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sdcp.protocol import codec
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.messages import TOKEN_MAX
from sdcp.protocol.problems import BadMessage

__all__ = [
    "CommitRecord",
    "FenceRecord",
    "LogReplay",
    "decode_token_list",
    "encode_token_list",
    "parse_log_record",
    "replay_commit_log",
]


@dataclass(frozen=True)
class CommitRecord:
    """SDCP 6.8: a commit record carries epoch, round, emitted tokens, n and d[n]."""

    epoch: int
    round: int
    emitted: tuple[int, ...]
    committed: int
    digest: bytes

    def to_obj(self) -> dict[str, object]:
        return {
            "epoch": self.epoch,
            "round": self.round,
            "emitted": list(self.emitted),
            "committed": self.committed,
            "digest": self.digest,
        }


@dataclass(frozen=True)
class FenceRecord:
    """SDCP 6.8: a fence record carries only an epoch."""

    epoch: int

    def to_obj(self) -> dict[str, object]:
        return {"epoch": self.epoch}


def parse_log_record(obj: object) -> CommitRecord | FenceRecord:
    """A commit-log record from its CBOR data model; anything else raises BadMessage."""
    if not isinstance(obj, dict) or not _is_uint(obj.get("epoch")):
        raise BadMessage("a commit-log record is a map with an unsigned 'epoch'")
    if obj.keys() == {"epoch"}:
        return FenceRecord(epoch=obj["epoch"])
    emitted = obj.get("emitted")
    digest = obj.get("digest")
    if (
        not _is_uint(obj.get("round"))
        or not _is_uint(obj.get("committed"))
        or not isinstance(emitted, list)
        or not all(_is_uint(token) for token in emitted)
        or not isinstance(digest, bytes)
        or len(digest) != 32
    ):
        raise BadMessage(f"malformed commit record: {sorted(obj)}")
    return CommitRecord(obj["epoch"], obj["round"], tuple(emitted), obj["committed"], digest)


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class LogReplay:
    """The committed state a commit log describes: what a new verifier resumes from (SDCP 6.9)."""

    epoch: int
    round: int
    tokens: tuple[int, ...]
    digest: bytes


def replay_commit_log(records: Iterable[object], contract_digest: bytes, prompt: Sequence[int]) -> LogReplay:
    """Rebuild the committed prefix from a log, checking that every commit record extends the last.

    A record whose length or digest does not follow from the previous ones means the log was
    corrupted; committed output is never guessed, so it raises BadMessage.
    """
    epoch = 0
    round_number = 0
    tokens: list[int] = []
    digest = prefix_digest(contract_digest, prompt)
    for obj in records:
        record = parse_log_record(obj)
        if record.epoch < epoch:
            raise BadMessage(f"record of epoch {record.epoch} follows epoch {epoch}")
        epoch = record.epoch
        if isinstance(record, FenceRecord):
            continue
        digest = extend_digest(digest, record.emitted)
        tokens.extend(record.emitted)
        if record.committed != len(tokens) or record.digest != digest or record.round <= round_number:
            raise BadMessage(f"commit record of round {record.round} does not extend the log before it")
        round_number = record.round
    return LogReplay(epoch, round_number, tuple(tokens), digest)


def encode_token_list(tokens: Iterable[int]) -> bytes:
    """An MLC object holding token ids: a prompt or committed tokens given by reference
    (docs/interpretations.md: a CBOR array of uints)."""
    return codec.encode(list(tokens))


def decode_token_list(data: bytes, what: str) -> tuple[int, ...]:
    """The token ids of an object written by ``encode_token_list``; anything else is BadMessage."""
    try:
        tokens = codec.decode(data)
    except BadMessage as exc:
        raise BadMessage(f"{what}: {exc.detail}") from exc
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= TOKEN_MAX for t in tokens
    ):
        raise BadMessage(f"{what} is not an array of token ids")
    return tuple(tokens)
