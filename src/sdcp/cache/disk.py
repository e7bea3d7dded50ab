"""Local-disk tier: object files in a directory plus an SQLite index, shared by processes on a host.

Each version of an object is an immutable file under `blobs/` with a fresh random name; the index
(`index.sqlite`, WAL mode) maps a URI to its current file, ETag, size and last access, and records
leases. Writers create the file first and then switch the index row in one `BEGIN IMMEDIATE`
transaction, which also checks If-Match and chooses eviction victims, so every process sees a put
complete or not at all. A reader that loses a race with a replacement (its file was unlinked after
it read the index) simply reads the index again.

As the shared store (no Redis configured) the tier respects leases when it evicts. As a cache in
front of Redis it does not, since Redis keeps every object.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from sdcp.cache.commitlog import CommitLog, FileCommitLog
from sdcp.cache.errors import CacheFull, LeaseNotHeld, ObjectNotFound, ObjectTooLarge, PreconditionFailed
from sdcp.cache.etags import ABSENT_ETAG
from sdcp.cache.tiers import CachedObject

log = logging.getLogger("sdcp.cache")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    uri TEXT PRIMARY KEY, etag TEXT NOT NULL, size INTEGER NOT NULL,
    file TEXT NOT NULL, atime REAL NOT NULL);
CREATE INDEX IF NOT EXISTS objects_by_atime ON objects (atime);
CREATE TABLE IF NOT EXISTS leases (
    uri TEXT NOT NULL, holder TEXT NOT NULL, expires REAL NOT NULL,
    PRIMARY KEY (uri, holder));
"""
# How long a database opened by several processes at once waits for the others (busy_timeout).
_BUSY_TIMEOUT_S = 30.0
# Between two tries to switch the database to WAL (_use_wal).
_WAL_RETRY_S = 0.02
_ATIME_RESOLUTION_S = 1.0  # recency is refreshed at most this often, to keep reads off the write lock
_READ_RETRIES = 5


def _use_wal(db: sqlite3.Connection, pause: Callable[[float], None] = time.sleep) -> None:
    """Switch ``db`` to write-ahead logging. The switch needs the database to itself: SQLite waits
    for a reader of another process (busy_timeout), but refuses at once while another process
    holds a lock it is waiting to raise, as when several switch together. A local cluster's roles
    start together on one MLC directory, and a router exited with "database is locked". The mode
    is kept in the file, so the first process to switch it switches it for all; the others try
    again, until _BUSY_TIMEOUT_S has passed (a try under way may wait its own busy timeout). A file
    system where WAL is unavailable keeps the mode SQLite names, as before."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            (mode,) = db.execute("PRAGMA journal_mode = WAL").fetchone()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        else:
            if str(mode).lower() != "wal":
                log.warning("the disk tier's database stays in %s journal mode: WAL is unavailable here", mode)
            return
        pause(_WAL_RETRY_S)


class DiskTier:
    """Bounded directory of objects; `leases_protect` makes it the shared store of the MLC."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, *, leases_protect: bool) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk capacity must be positive, got {capacity_bytes}")
        self.name = "disk"
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.leases_protect = leases_protect
        self._blobs = self.directory / "blobs"
        self._blobs.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            self.directory / "index.sqlite", timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        self._db_lock = threading.Lock()
        with self._db_lock:
            self._db.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
            _use_wal(self._db)
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.executescript(_SCHEMA)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._db_lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _row(self, uri: str) -> tuple[str, str, float] | None:
        with self._db_lock:
            row = self._db.execute("SELECT etag, file, atime FROM objects WHERE uri = ?", (uri,)).fetchone()
        return None if row is None else (row[0], row[1], row[2])

    # -- sync bodies, run in worker threads --------------------------------------------------

    def head_sync(self, uri: str) -> str | None:
        row = self._row(uri)
        return None if row is None else row[0]

    def holds(self, uri: str) -> bool:
        return self._row(uri) is not None

    def fetch_sync(self, uri: str) -> CachedObject | None:
        for _ in range(_READ_RETRIES):
            row = self._row(uri)
            if row is None:
                return None
            etag, file, atime = row
            try:
                data = (self._blobs / file).read_bytes()
            except FileNotFoundError:
                continue  # replaced or deleted between the index read and the file read
            now = time.time()
            if now - atime > _ATIME_RESOLUTION_S:
                with self._db_lock:
                    self._db.execute("UPDATE objects SET atime = ? WHERE uri = ? AND file = ?", (now, uri, file))
            return CachedObject(uri, data, etag)
        raise OSError(f"{uri}: object kept changing while being read from {self.directory}")

    def store_sync(self, obj: CachedObject, if_match: str | None) -> None:
        size = len(obj.data)
        if size > self.capacity_bytes:
            raise ObjectTooLarge(f"{size} bytes exceed the disk capacity {self.capacity_bytes}")
        file = uuid.uuid4().hex
        (self._blobs / file).write_bytes(obj.data)
        try:
            stale_files = self._commit_version(obj, file, size, if_match)
        except BaseException:
            (self._blobs / file).unlink(missing_ok=True)
            raise
        for stale in stale_files:
            (self._blobs / stale).unlink(missing_ok=True)

    def _commit_version(self, obj: CachedObject, file: str, size: int, if_match: str | None) -> list[str]:
        now = time.time()
        with self._transaction() as db:
            current = db.execute("SELECT etag, file, size FROM objects WHERE uri = ?", (obj.uri,)).fetchone()
            if if_match is not None and (ABSENT_ETAG if current is None else current[0]) != if_match:
                raise PreconditionFailed(f"{obj.uri}: If-Match {if_match} is not the current ETag")
            (used,) = db.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()
            need = used - (current[2] if current else 0) + size - self.capacity_bytes
            stale = [current[1]] if current else []
            if need > 0:
                victims = self._choose_victims(db, obj.uri, need, now)
                for victim_uri, victim_file in victims:
                    db.execute("DELETE FROM objects WHERE uri = ?", (victim_uri,))
                    db.execute("DELETE FROM leases WHERE uri = ?", (victim_uri,))
                    stale.append(victim_file)
            db.execute(
                "INSERT OR REPLACE INTO objects (uri, etag, size, file, atime) VALUES (?, ?, ?, ?, ?)",
                (obj.uri, obj.etag, size, file, now),
            )
        return stale

    def _choose_victims(self, db: sqlite3.Connection, uri: str, need: int, now: float) -> list[tuple[str, str]]:
        query = "SELECT o.uri, o.file, o.size FROM objects o WHERE o.uri != ?"
        if self.leases_protect:
            query += " AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.uri = o.uri AND l.expires > ?)"
        query += " ORDER BY o.atime"
        params: tuple[object, ...] = (uri, now) if self.leases_protect else (uri,)
        victims = []
        for victim_uri, victim_file, victim_size in db.execute(query, params):
            victims.append((victim_uri, victim_file))
            need -= victim_size
            if need <= 0:
                return victims
        raise CacheFull(f"disk {self.directory}: no room for {uri}, the remaining objects are leased")

    def remove_sync(self, uri: str) -> bool:
        with self._transaction() as db:
            row = db.execute("SELECT file FROM objects WHERE uri = ?", (uri,)).fetchone()
            db.execute("DELETE FROM objects WHERE uri = ?", (uri,))
            db.execute("DELETE FROM leases WHERE uri = ?", (uri,))
        if row is None:
            return False
        (self._blobs / row[0]).unlink(missing_ok=True)
        return True

    def lease_sync(self, uri: str, holder: str, ttl_s: float) -> float:
        expires = time.time() + ttl_s
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM objects WHERE uri = ?", (uri,)).fetchone() is None:
                raise ObjectNotFound(uri)
            db.execute("INSERT OR REPLACE INTO leases (uri, holder, expires) VALUES (?, ?, ?)", (uri, holder, expires))
        return expires

    def renew_sync(self, uri: str, holder: str, ttl_s: float) -> float:
        now = time.time()
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE leases SET expires = ? WHERE uri = ? AND holder = ? AND expires > ?",
                (now + ttl_s, uri, holder, now),
            )
            if cursor.rowcount == 0:
                raise LeaseNotHeld(f"{holder} holds no lease on {uri}")
        return now + ttl_s

    def release_sync(self, uri: str, holder: str) -> bool:
        with self._transaction() as db:
            cursor = db.execute(
                "DELETE FROM leases WHERE uri = ? AND holder = ? AND expires > ?", (uri, holder, time.time())
            )
            db.execute("DELETE FROM leases WHERE uri = ? AND holder = ?", (uri, holder))
        return cursor.rowcount > 0

    def lease_holders_sync(self, uri: str) -> frozenset[str]:
        with self._transaction() as db:
            rows = db.execute("SELECT holder FROM leases WHERE uri = ? AND expires > ?", (uri, time.time())).fetchall()
        return frozenset(row[0] for row in rows)

    # -- async API ------------------------------------------------------------------------------

    async def head(self, uri: str) -> str | None:
        return await asyncio.to_thread(self.head_sync, uri)

    async def fetch(self, uri: str) -> CachedObject | None:
        return await asyncio.to_thread(self.fetch_sync, uri)

    async def store(self, obj: CachedObject, if_match: str | None) -> None:
        await asyncio.to_thread(self.store_sync, obj, if_match)

    async def remove(self, uri: str) -> bool:
        return await asyncio.to_thread(self.remove_sync, uri)

    async def lease(self, uri: str, holder: str, ttl_s: float) -> float:
        return await asyncio.to_thread(self.lease_sync, uri, holder, ttl_s)

    async def renew(self, uri: str, holder: str, ttl_s: float) -> float:
        return await asyncio.to_thread(self.renew_sync, uri, holder, ttl_s)

    async def release(self, uri: str, holder: str) -> bool:
        return await asyncio.to_thread(self.release_sync, uri, holder)

    async def lease_holders(self, uri: str) -> frozenset[str]:
        return await asyncio.to_thread(self.lease_holders_sync, uri)

    def commit_log(self, uri: str) -> CommitLog:
        name = hashlib.sha256(uri.encode()).hexdigest()[:40]
        return FileCommitLog(uri, self.directory / "logs" / f"{name}.log")

    # Cache-tier role (in front of Redis): same operations, no precondition, too-large is a no-op.

    async def lookup(self, uri: str) -> CachedObject | None:
        return await self.fetch(uri)

    async def install(self, obj: CachedObject) -> list[CachedObject]:
        if len(obj.data) <= self.capacity_bytes and await self.head(obj.uri) != obj.etag:
            await self.store(obj, None)
        return []

    async def discard(self, uri: str) -> None:
        await self.remove(uri)

    async def close(self) -> None:
        with self._db_lock:
            self._db.close()
