"""Commit logs (SDCP 6.8): conditional append on the current entity tag, fence records.

A log is a sequence of CBOR maps. Every record carries the `epoch` of its writer; a record that holds
nothing but an epoch (and, as ours do, the `verifier` the router opens that epoch at: signed commit
records, docs/interpretations.md) is a fence record. The rules, identical in every backend:

- `append(record, if_match)` succeeds only if `if_match` is the log's current ETag, so that of
  concurrent appenders that read the same version exactly one wins (SDCP 6.8).
- After a fence record with epoch F, an append carrying an epoch lower than F raises `Fenced`; the
  epoch check and the append are one atomic step, so a writer that raced the fence loses too. When
  both apply, `Fenced` is reported rather than `PreconditionFailed`: it tells the verifier to stop
  serving the session instead of re-reading and retrying (SDCP 6.3).
- `fence(E)` needs no ETag (the router does not race the verifier for a version, it overrules it).
  It raises `Fenced` if the log already carries a higher epoch, and is a no-op returning the current
  ETag if a fence with epoch E is already there, so a router can retry it.

This module holds the rules, the record encoding, an in-process backend and the embedded file
backend; the Redis backend applies the same rules in one Lua script (`sdcp.cache.redis`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import hashlib
import os
import struct
import threading
import weakref
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2

from sdcp.cache.errors import CorruptRecord, Fenced, InvalidRecord, PreconditionFailed
from sdcp.futures import Outcome, settle, settle_soon
from sdcp.protocol import codec

EMPTY_LOG_ETAG = '"0"'
_FRAME_HEADER = struct.Struct(">II")  # payload length, CRC-32 of the payload


@dataclass(frozen=True, slots=True)
class LogSnapshot:
    """The records of a log and the ETag of exactly that version."""

    records: list[dict[str, Any]]
    etag: str


def encode_record(record: object) -> tuple[bytes, int, bool]:
    """Deterministic CBOR of a record, its epoch, and whether it is a fence record."""
    if not isinstance(record, dict):
        raise InvalidRecord(f"a record is a map, got {type(record).__name__}")
    epoch = record.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise InvalidRecord(f"a record carries a non-negative integer epoch, got {epoch!r}")
    try:
        # Deterministic, and within SDCP's data model: a record goes back out as it came in.
        payload = codec.encode(record)
    except ValueError as exc:
        raise InvalidRecord(f"record is outside SDCP's data model: {exc}") from exc
    return payload, epoch, is_fence(record)


def decode_record(payload: bytes, where: str) -> dict[str, Any]:
    """Decode a stored record; anything but a map with an integer epoch is `CorruptRecord`."""
    try:
        record = cbor2.loads(payload)
    except (cbor2.CBORDecodeError, ValueError, TypeError, EOFError) as exc:
        raise CorruptRecord(f"{where}: undecodable CBOR: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("epoch"), int):
        raise CorruptRecord(f"{where}: not a map with an integer epoch")
    return record


def is_fence(record: dict[str, Any]) -> bool:
    return set(record) == {"epoch"} or set(record) == {"epoch", "verifier"}


def fence_record(epoch: int, verifier: str | None) -> dict[str, Any]:
    """A fence record, naming the verifier of the new epoch when one is given."""
    validate_fence_epoch(epoch)
    if verifier is None:
        return {"epoch": epoch}
    if not isinstance(verifier, str) or not verifier:
        raise InvalidRecord(f"a fence names its verifier by a non-empty text, got {verifier!r}")
    return {"epoch": epoch, "verifier": verifier}


@dataclass(slots=True)
class LogState:
    """Records of a log plus what the rules need: a hash chain for the ETag and epoch bounds."""

    records: list[dict[str, Any]] = field(default_factory=list)
    chain: bytes = b""
    fence_epoch: int = -1
    max_epoch: int = -1

    @property
    def etag(self) -> str:
        # The count orders versions; the hash chain over every payload makes a tag of one log's
        # history useless against a log that was deleted and rewritten to the same length.
        if not self.records:
            return EMPTY_LOG_ETAG
        return f'"{len(self.records)}-{self.chain.hex()[:32]}"'

    def add(self, payload: bytes, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.chain = hashlib.sha256(self.chain + payload).digest()
        epoch = record["epoch"]
        self.max_epoch = max(self.max_epoch, epoch)
        if is_fence(record):
            self.fence_epoch = max(self.fence_epoch, epoch)

    def check_appends(self, records: Sequence[tuple[int, bool]], if_match: str) -> None:
        """Whether records appended one after another from ``if_match``, each given by its epoch
        and whether it is fence-shaped, may be appended: all of them, or none (raises)."""
        fence_epoch = self.fence_epoch
        for index, (epoch, fence_shaped) in enumerate(records):
            if epoch < fence_epoch:  # SDCP 6.8: appends below the fence epoch MUST fail
                raise Fenced(f"log is fenced at epoch {fence_epoch}; record has epoch {epoch}")
            if index == 0 and if_match != self.etag:
                raise PreconditionFailed(f"If-Match {if_match} is not the current ETag {self.etag}")
            if fence_shaped:
                fence_epoch = max(fence_epoch, epoch)

    def fence_needed(self, epoch: int) -> bool:
        """False when an identical fence is already the highest one; raises when overruled."""
        if epoch < self.max_epoch:
            raise Fenced(f"log already carries epoch {self.max_epoch}; cannot fence at {epoch}")
        return epoch != self.fence_epoch


class CommitLog(abc.ABC):
    """One session's commit log (SDCP 6.8)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    @abc.abstractmethod
    async def read(self) -> LogSnapshot:
        """All records and the ETag of that version."""

    async def read_from(self, start: int) -> LogSnapshot:
        """The records from index `start` on and the ETag of that version, for a reader that keeps
        what it read before (a router's replay); a backend that can do better reads only those."""
        snapshot = await self.read()
        return LogSnapshot(snapshot.records[start:], snapshot.etag)

    @abc.abstractmethod
    async def append(self, record: dict[str, Any], if_match: str) -> str:
        """Append if `if_match` is the current ETag; returns the new ETag."""

    async def append_all(self, records: Sequence[dict[str, Any]], if_match: str) -> str:
        """Append ``records`` in order, each conditional on the one before, the first on
        ``if_match``; returns the ETag after the last. A backend that can appends them in one
        step, all or none; otherwise, where this raises, the records before the failed one are
        appended (the log says which)."""
        etag = if_match
        for record in records:
            etag = await self.append(record, etag)
        return etag

    @abc.abstractmethod
    async def fence(self, epoch: int, verifier: str | None = None) -> str:
        """Append a fence record `{"epoch": epoch}` (with `verifier` when given); returns the new
        ETag. A fence of the highest fence's epoch appends nothing, whichever verifier it names."""

    async def last_commit(self) -> dict[str, Any] | None:
        """The last record that is not a fence record, or None."""
        records: list[dict[str, Any]] = (await self.read()).records
        return next((record for record in reversed(records) if not is_fence(record)), None)


def validate_fence_epoch(epoch: int) -> int:
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise InvalidRecord(f"a fence epoch is a non-negative integer, got {epoch!r}")
    return epoch


class MemoryCommitLog(CommitLog):
    """In-process log for a memory-only MLC: atomic within the process, gone when it exits."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri)
        self._state = LogState()
        self._lock = threading.Lock()

    async def read(self) -> LogSnapshot:
        return await self.read_from(0)

    async def read_from(self, start: int) -> LogSnapshot:
        with self._lock:
            return LogSnapshot(self._state.records[start:], self._state.etag)

    async def append(self, record: dict[str, Any], if_match: str) -> str:
        return await self.append_all((record,), if_match)

    async def append_all(self, records: Sequence[dict[str, Any]], if_match: str) -> str:
        encoded = [encode_record(record) for record in records]
        with self._lock:
            self._state.check_appends([(epoch, fence_shaped) for _, epoch, fence_shaped in encoded], if_match)
            for payload, _, _ in encoded:
                self._state.add(payload, cbor2.loads(payload))
            return self._state.etag

    async def fence(self, epoch: int, verifier: str | None = None) -> str:
        record = fence_record(epoch, verifier)
        payload, _, _ = encode_record(record)
        with self._lock:
            if self._state.fence_needed(epoch):
                self._state.add(payload, record)
            return self._state.etag


class FileCommitLog(CommitLog):
    """Embedded backend: an append-only file of frames `uint32 length | uint32 CRC-32 | CBOR`.

    Every operation holds `flock` on the file (shared to read, exclusive to append), which makes
    check-and-append atomic across threads and processes of one host. An append is acknowledged
    only after `fsync`, so a frame cut short by a crash was never acknowledged: readers ignore such
    a torn tail and the next appender truncates it. A complete frame whose checksum or content is
    wrong is never skipped: it raises `CorruptRecord`, because skipping it could lose a commit.
    """

    def __init__(self, uri: str, path: Path) -> None:
        super().__init__(uri)
        self.path = path
        self._state = LogState()
        self._offset = 0
        self._inode: int | None = None
        self._mutex = threading.Lock()  # guards the cached state shared by worker threads

    async def read(self) -> LogSnapshot:
        return await self.read_from(0)

    async def read_from(self, start: int) -> LogSnapshot:
        return await asyncio.to_thread(self._read_sync, start)

    async def append(self, record: dict[str, Any], if_match: str) -> str:
        return await self.append_all((record,), if_match)

    async def append_all(self, records: Sequence[dict[str, Any]], if_match: str) -> str:
        encoded = tuple(encode_record(record) for record in records)
        return await _FileAppends.of_running_loop().add(self, encoded, if_match)

    async def fence(self, epoch: int, verifier: str | None = None) -> str:
        payload, _, _ = encode_record(fence_record(epoch, verifier))
        return await asyncio.to_thread(self._fence_sync, payload, epoch)

    def _read_sync(self, start: int) -> LogSnapshot:
        with self._mutex, self._locked(fcntl.LOCK_SH) as fd:
            self._catch_up(fd, repair=False)
            return LogSnapshot(self._state.records[start:], self._state.etag)

    def _append_sync(self, encoded: Sequence[tuple[bytes, int, bool]], if_match: str) -> str:
        with self._mutex, self._locked(fcntl.LOCK_EX) as fd:
            self._catch_up(fd, repair=True)
            self._state.check_appends([(epoch, fence_shaped) for _, epoch, fence_shaped in encoded], if_match)
            self._write_frames(fd, [payload for payload, _, _ in encoded])
            return self._state.etag

    def _fence_sync(self, payload: bytes, epoch: int) -> str:
        with self._mutex, self._locked(fcntl.LOCK_EX) as fd:
            self._catch_up(fd, repair=True)
            if self._state.fence_needed(epoch):
                self._write_frames(fd, [payload])
            return self._state.etag

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[int]:
        """The log file's descriptor under ``flock``. An append runs on a worker thread beside the
        model's passes, and each system call gives the GIL away and waits to take it back: the
        file is handled through its descriptor alone, its directory made only when missing
        (docs/performance.md, session 42). The lock is let go before the descriptor closes, so
        that a copy of it in a process forked meanwhile cannot hold it."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _catch_up(self, fd: int, *, repair: bool) -> None:
        """Read frames appended since the cached offset (by this or any other process)."""
        info = os.fstat(fd)
        if info.st_ino != self._inode or info.st_size < self._offset:
            self._state, self._offset, self._inode = LogState(), 0, info.st_ino
        if info.st_size == self._offset:
            return
        tail = os.pread(fd, info.st_size - self._offset, self._offset)
        position = 0
        while position < len(tail):
            where = f"{self.path} record {len(self._state.records)} at offset {self._offset + position}"
            if len(tail) - position < _FRAME_HEADER.size:
                break
            length, checksum = _FRAME_HEADER.unpack_from(tail, position)
            end = position + _FRAME_HEADER.size + length
            if end > len(tail):
                break
            payload = tail[position + _FRAME_HEADER.size : end]
            if zlib.crc32(payload) != checksum:
                raise CorruptRecord(f"{where}: checksum mismatch")
            self._state.add(payload, decode_record(payload, where))
            position = end
        self._offset += position
        if repair and self._offset < info.st_size:
            os.ftruncate(fd, self._offset)
            os.fsync(fd)

    def _write_frames(self, fd: int, payloads: Sequence[bytes]) -> None:
        # One write and one fsync for all of them: a crash leaves a prefix of complete frames and
        # at most one torn one, which readers ignore (none of them was acknowledged).
        data = b"".join(_FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload for payload in payloads)
        written = 0
        while written < len(data):
            count = os.pwrite(fd, memoryview(data)[written:], self._offset + written)
            if count == 0:
                raise OSError(f"{self.path}: nothing written at offset {self._offset + written}")
            written += count
        os.fsync(fd)
        for payload in payloads:
            self._state.add(payload, cbor2.loads(payload))
        self._offset += len(data)


_PendingAppend = tuple[FileCommitLog, tuple[tuple[bytes, int, bool], ...], str, "asyncio.Future[str]"]


class _FileAppends:
    """The file appends an event loop asks for in one iteration, made by one worker-thread job.

    A busy verifier appends a record per session and pass, all in the iteration that decides the
    pass's tokens. Handing each to a worker thread of its own (`asyncio.to_thread`) cost the event
    loop more than the append: an executor future, a thread woken, each thread taking the GIL back
    and forth with the loop and the model's thread. Each append is still its own atomic step on its
    own file (`FileCommitLog._append_sync`); a failed one fails alone. The appenders of a job learn
    their outcomes together, when the job is done.
    """

    _by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _FileAppends] = weakref.WeakKeyDictionary()

    def __init__(self) -> None:
        self.pending: list[_PendingAppend] = []

    @classmethod
    def of_running_loop(cls) -> _FileAppends:
        # Keyed weakly by the loop and holding no reference to it, so that a closed loop is freed.
        loop = asyncio.get_running_loop()
        appends = cls._by_loop.get(loop)
        if appends is None:
            appends = cls._by_loop[loop] = cls()
        return appends

    def add(
        self, log: FileCommitLog, encoded: tuple[tuple[bytes, int, bool], ...], if_match: str
    ) -> asyncio.Future[str]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str] = loop.create_future()
        if not self.pending:
            loop.call_soon(self._start, loop)
        self.pending.append((log, encoded, if_match, done))
        return done

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self.pending = self.pending, []
        try:
            loop.run_in_executor(None, _append_all, loop, batch)
        except RuntimeError as exc:  # the default executor is shut down: the loop is closing
            settle([(done, exc) for *_, done in batch])


def _append_all(loop: asyncio.AbstractEventLoop, batch: list[_PendingAppend]) -> None:
    outcomes: list[Outcome] = []
    for log, encoded, if_match, done in batch:
        try:
            outcomes.append((done, log._append_sync(encoded, if_match)))
        except Exception as exc:  # noqa: BLE001 - the appender learns it from its future
            outcomes.append((done, exc))
    settle_soon(loop, outcomes)
