"""Commit-log records and the replay of a log (SDCP 6.8, 6.9).

Records are CBOR maps in deterministic encoding. A commit record is
``{"epoch", "round", "emitted", "committed", "digest"}``, and ours carry ``writer``, ``session``,
``terms``, ``sig`` and on the first of an epoch ``cert`` besides (signed records,
``sdcp.transport.signing``; ``bind_record``: the place a record is valid in); a fence record is
``{"epoch"}`` alone, or ``{"epoch", "verifier"}`` naming the verifier the router opens that epoch
at (docs/interpretations.md, "Signed commit records").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sdcp.protocol import codec
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.messages import TOKEN_MAX, Constraint
from sdcp.protocol.problems import BadMessage

__all__ = [
    "CERT_MEMBER",
    "SIG_MEMBER",
    "CommitRecord",
    "FenceRecord",
    "LogReplay",
    "LogReplayer",
    "RecordAuthority",
    "UntrustedRecord",
    "bind_record",
    "decode_token_list",
    "encode_token_list",
    "parse_log_record",
    "replay_commit_log",
    "session_terms",
]


SIG_MEMBER = "sig"
CERT_MEMBER = "cert"
WRITER_MEMBER = "writer"
VERIFIER_MEMBER = "verifier"
SESSION_MEMBER = "session"
TERMS_MEMBER = "terms"
_TERMS_DOMAIN = b"SDCP-TERMS-1\x00"


def session_terms(*, constraint: Constraint | None, min_new: int | None) -> bytes:
    """What decides a session's tokens beyond its contract and prompt (which d[0] binds): the
    session-open extensions that change the target distribution (the output's language, min_new),
    as SHA-256("SDCP-TERMS-1" 0x00 || deterministic CBOR of those present). Two sessions with the
    same contract and prompt but another constraint have other terms (docs/interpretations.md,
    "Records bound to their place")."""
    terms: dict[str, object] = {}
    if constraint is not None:
        terms["constraint"] = constraint.to_obj()
    if min_new:
        terms["min_new"] = min_new
    return hashlib.sha256(_TERMS_DOMAIN + codec.encode(terms)).digest()


def bind_record(record: CommitRecord, *, writer: str, session: bytes, terms: bytes) -> dict[str, Any]:
    """A commit record as a verifier of ours appends it: naming its writer, its session and the
    session's terms, so that once signed it is valid in one place of one log only: the session
    (``session``, ``terms``), the epoch, the round and the committed length it states, after the
    digest it extends (SDCP 1.3, 6.8; extension, docs/interpretations.md)."""
    return {**record.to_obj(), WRITER_MEMBER: writer, SESSION_MEMBER: session, TERMS_MEMBER: terms}


class UntrustedRecord(ValueError):
    """A commit record whose signature, certificate or writer does not check out."""


class RecordAuthority(Protocol):
    """Who may have written a record (``sdcp.transport.signing.RecordCheck``); both raise
    UntrustedRecord."""

    def certificate(self, der: object, writer: str) -> Any:
        """The public key of a certificate (DER) the deployment's CA issued to ``writer``."""

    def signature(self, record: dict[str, Any], key: Any) -> None:
        """Passes only if the record's ``sig`` is ``key``'s signature over it."""


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
    """SDCP 6.8: a fence record carries only an epoch; ours may name the verifier the router opens
    that epoch at (extension: only that verifier's signed records count in the epoch)."""

    epoch: int
    verifier: str | None = None

    def to_obj(self) -> dict[str, object]:
        if self.verifier is None:
            return {"epoch": self.epoch}
        return {"epoch": self.epoch, VERIFIER_MEMBER: self.verifier}


def parse_log_record(obj: object) -> CommitRecord | FenceRecord:
    """A commit-log record from its CBOR data model; anything else raises BadMessage."""
    if not isinstance(obj, dict) or not _is_uint(obj.get("epoch")):
        raise BadMessage("a commit-log record is a map with an unsigned 'epoch'")
    if obj.keys() == {"epoch"}:
        return FenceRecord(epoch=obj["epoch"])
    if obj.keys() == {"epoch", VERIFIER_MEMBER}:
        if not isinstance(obj[VERIFIER_MEMBER], str):
            raise BadMessage("a fence record names its verifier by a text URI")
        return FenceRecord(obj["epoch"], obj[VERIFIER_MEMBER])
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
    """The committed state a commit log describes: what a new verifier resumes from (SDCP 6.9).

    ``faults`` says why records were left out (a checked replay only): each names a record that
    was not its epoch's verifier's signed record, after which that epoch counted no more records."""

    epoch: int
    round: int
    tokens: tuple[int, ...]
    digest: bytes
    faults: tuple[str, ...] = ()


def replay_commit_log(
    records: Iterable[object],
    contract_digest: bytes,
    prompt: Sequence[int],
    *,
    authority: RecordAuthority | None = None,
    first_verifier: str | None = None,
    session: bytes | None = None,
    terms: bytes | None = None,
) -> LogReplay:
    """Rebuild the committed prefix from a whole log (``LogReplayer``, fed once)."""
    replayer = LogReplayer(
        contract_digest, prompt, authority=authority, first_verifier=first_verifier, session=session, terms=terms
    )
    replayer.feed(records)
    return replayer.replay


class LogReplayer:
    """The committed prefix of a log, fed its records in order, as many at a time as have come.

    Every commit record must extend the last: a record whose length or digest does not follow from
    the previous ones means the log was corrupted; committed output is never guessed, so ``feed``
    raises BadMessage.

    With ``authority`` every commit record is checked before it counts (SDCP 1.3: the verifier is
    the sole commit authority): it must name as ``writer`` the verifier of its epoch (the last
    fence record of the epoch names it; ``first_verifier`` is epoch 1's, opened without a fence),
    and carry that verifier's valid signature, the key from the certificate of the epoch's first
    record, and be bound to this log's place (``bind_record``): ``session`` and ``terms`` are this
    session's, so that a record signed for another session with the same contract and prompt (a
    constraint that forced other text, say) is refused. A record that fails is a fault, never
    replayed: it and every later record of its epoch are left out, so the output up to the last
    good record stands and the next epoch (the router's next fence) resumes from it. An unsigned
    record fails too: older logs are not replayed.

    A router keeps one per session and feeds it only the records appended since the last read,
    so that each record is parsed and its signature checked once (``fed`` counts them).
    """

    def __init__(
        self,
        contract_digest: bytes,
        prompt: Sequence[int],
        *,
        authority: RecordAuthority | None = None,
        first_verifier: str | None = None,
        session: bytes | None = None,
        terms: bytes | None = None,
    ) -> None:
        self._authority = authority
        self._place = {SESSION_MEMBER: session, TERMS_MEMBER: terms}
        self._epoch = 0
        self._round = 0
        self._tokens: list[int] = []
        self._digest = prefix_digest(contract_digest, prompt)
        self._named: dict[int, str] = {} if first_verifier is None else {1: first_verifier}
        self._keys: dict[int, Any] = {}
        self._poisoned: set[int] = set()
        self._faults: list[str] = []
        self.fed = 0

    @property
    def replay(self) -> LogReplay:
        """The committed state the records fed so far describe."""
        return LogReplay(self._epoch, self._round, tuple(self._tokens), self._digest, tuple(self._faults))

    def epoch_to_fence(self, current: int, verifier: str) -> int:
        """The epoch a failover of a session at epoch ``current`` to ``verifier`` fences the log at,
        given the records fed so far: above every epoch in the log, not only above ``current``. A
        writer other than the router (a second verifier, or anyone with write access to the store)
        may have appended at ``current`` + 1 already; a fence of that epoch would come after its
        record, which would keep the epoch poisoned and every record of the new verifier in it left
        out of later replays. The one epoch above ``current`` kept is one a fence already opened
        at ``verifier`` with no fault in it: a retried failover, whose fence appends nothing again."""
        highest = max(current, self._epoch)
        if highest > current and self._named.get(highest) == verifier and highest not in self._poisoned:
            return highest
        return highest + 1

    def poisoned(self, epoch: int) -> bool:
        """Whether a record of ``epoch`` fed so far was not its verifier's signed record: nothing of
        that epoch counts from there on, and its verifier's next append fails (docs/reliability.md)."""
        return epoch in self._poisoned

    def feed(self, records: Iterable[object]) -> list[str]:
        """Take the next records of the log; returns the faults among them (see the class doc)."""
        faults_before = len(self._faults)
        for obj in records:
            self.fed += 1
            self._take(obj)
        return self._faults[faults_before:]

    def _take(self, obj: object) -> None:
        record = parse_log_record(obj)
        if record.epoch < self._epoch:
            raise BadMessage(f"record of epoch {record.epoch} follows epoch {self._epoch}")
        epoch = self._epoch = record.epoch
        if isinstance(record, FenceRecord):
            if record.verifier is not None and record.epoch not in self._keys:
                self._named[record.epoch] = record.verifier
            return
        if self._authority is not None:
            if epoch in self._poisoned:
                return
            assert isinstance(obj, dict)
            try:
                _check(obj, self._authority, self._named.get(epoch), self._keys, self._place)
            except UntrustedRecord as exc:
                self._poisoned.add(epoch)
                self._faults.append(f"epoch {epoch} round {record.round}: {exc}")
                return
        following = extend_digest(self._digest, record.emitted)
        if (
            record.committed != len(self._tokens) + len(record.emitted)
            or record.digest != following
            or record.round <= self._round
        ):
            raise BadMessage(f"commit record of round {record.round} does not extend the log before it")
        self._digest = following
        self._tokens.extend(record.emitted)
        self._round = record.round


def _check(
    record: dict[str, Any],
    authority: RecordAuthority,
    verifier: str | None,
    keys: dict[int, Any],
    place: dict[str, bytes | None],
) -> None:
    """SDCP 6.9 (extension): the record is the signed record of its epoch's verifier, bound to this
    session and its terms."""
    epoch = record["epoch"]
    writer = record.get(WRITER_MEMBER)
    if verifier is None:
        raise UntrustedRecord(f"no fence names the verifier of epoch {epoch}")
    if writer != verifier:
        raise UntrustedRecord(f"written by {writer!r}, not by {verifier}, the verifier of epoch {epoch}")
    if CERT_MEMBER in record:
        key = authority.certificate(record[CERT_MEMBER], verifier)
        if epoch in keys and keys[epoch] != key:
            raise UntrustedRecord(f"a second key for epoch {epoch}")
    elif epoch in keys:
        key = keys[epoch]
    else:
        raise UntrustedRecord(f"the first record of epoch {epoch} carries no certificate")
    authority.signature(record, key)
    for member, expected in place.items():
        if expected is not None and record.get(member) != expected:
            raise UntrustedRecord(f"the record's {member} is not this session's: it belongs in another log")
    keys[epoch] = key


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
