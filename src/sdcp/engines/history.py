"""Finished sessions' output shared through the MLC, for the suffix drafters' global history
(docs/models.md, "Suffix drafter"; docs/cache.md, "Shared history").

The verifier, which commits every token of its sessions and knows each session's owner, publishes
the output of a session that ends with ``finish`` (sdcp.engines.verifier.history); every drafter
instance reads the entries of the history scopes it drafts for (``HistoryReader``). A scope is a
hash of the contract's target, tokenizer and KVSP scope and, under the default policy ``owner``,
of the front end that opened the session (docs/security.md: one tenant's output never reaches
another tenant's drafts).

Two kinds of object, both of kind ``history`` in the contract's scope:

- an entry, ``<scope-key>-<session>-<epoch>``: the session's output tokens (``encode_token_list``);
- the scope's index, ``<scope-key>``: a CBOR map ``{generation, next, entries}``, the newest
  ``entries`` entries as ``[seq, uri, tokens]``, oldest first. A publisher appends by a conditional
  put on the index's ETag (retried on a conflict) and deletes the entries it pushes out, so the
  scope holds at most that many entries; a reader learns the entries whose ``seq`` it has not seen.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from sdcp.cache import MLC, CacheError, ObjectNotFound, PreconditionFailed, build_uri
from sdcp.cache.uri import HISTORY_KIND
from sdcp.config import HistoryScope
from sdcp.protocol import codec
from sdcp.protocol.messages import Contract
from sdcp.protocol.problems import BadMessage
from sdcp.protocol.records import decode_token_list, encode_token_list

__all__ = [
    "DEFAULT_HISTORY_ENTRIES",
    "HistoryIndex",
    "HistoryReader",
    "HistoryScope",
    "IndexEntry",
    "entry_uri",
    "history_scope_key",
    "index_uri",
    "publish_output",
]

log = logging.getLogger("sdcp.history")

# Entries a scope's index keeps (the publisher's bound) and a reader takes per refresh (its own).
DEFAULT_HISTORY_ENTRIES = 256
_KEY_BYTES = 16
_LABEL = b"sdcp-history-1"
# A publisher that keeps losing the index's conditional put to other publishers gives up.
_PUBLISH_ATTEMPTS = 8
_PUBLISH_BACKOFF_S = 0.01
# History scopes a reader remembers where it stopped in (the least recently used are forgotten).
_MAX_SCOPES = 4096


def history_scope_key(contract: Contract, owner: str | None, policy: HistoryScope) -> bytes:
    """The 16 bytes naming whose finished output a session's drafts may come from: the contract's
    target, tokenizer and scope, and under ``owner`` the front end that opened the session (a
    session without one shares with the other owner-less sessions only)."""
    digest = hashlib.sha256(_LABEL)
    owner_part = (owner or "").encode() if policy == "owner" else b""
    for part in (policy.encode(), contract.target, contract.tokenizer, contract.scope or b"", owner_part):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return digest.digest()[:_KEY_BYTES]


def index_uri(authority: str, contract: Contract, key: bytes) -> str:
    return build_uri(authority, contract.scope, HISTORY_KIND, key.hex())


def entry_uri(authority: str, contract: Contract, key: bytes, session: bytes, epoch: int) -> str:
    return build_uri(authority, contract.scope, HISTORY_KIND, f"{key.hex()}-{session.hex()}-{epoch}")


@dataclass(frozen=True)
class IndexEntry:
    seq: int
    uri: str
    tokens: int


@dataclass(frozen=True)
class HistoryIndex:
    """A scope's newest entries, oldest first. ``generation`` changes when the index is created
    anew (its object was lost), so that a reader's position in an older one does not apply."""

    generation: bytes
    next: int
    entries: tuple[IndexEntry, ...]

    @classmethod
    def new(cls) -> HistoryIndex:
        return cls(os.urandom(8), 0, ())

    def with_entry(self, uri: str, tokens: int, keep: int) -> tuple[HistoryIndex, list[IndexEntry]]:
        """This index with one more entry, and the entries pushed out to keep ``keep``."""
        entries = [*self.entries, IndexEntry(self.next, uri, tokens)]
        dropped = entries[: max(0, len(entries) - keep)]
        return HistoryIndex(self.generation, self.next + 1, tuple(entries[len(dropped) :])), dropped

    def encode(self) -> bytes:
        entries = [[entry.seq, entry.uri, entry.tokens] for entry in self.entries]
        return codec.encode({"generation": self.generation, "next": self.next, "entries": entries})

    @classmethod
    def decode(cls, data: bytes) -> HistoryIndex:
        """Raises BadMessage for anything but what ``encode`` writes."""
        obj = codec.decode(data)
        if not isinstance(obj, dict):
            raise BadMessage("a history index is a map")
        generation, next_seq, raw = obj.get("generation"), obj.get("next"), obj.get("entries")
        if not isinstance(generation, bytes) or not isinstance(next_seq, int) or not _uint(next_seq):
            raise BadMessage("a history index holds generation, next and entries")
        if not isinstance(raw, list):
            raise BadMessage("a history index lists its entries")
        entries = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and _uint(item[0]) and _uint(item[2])):
                raise BadMessage("a history entry is [seq, uri, tokens]")
            if not isinstance(item[1], str):
                raise BadMessage("a history entry names its object")
            entries.append(IndexEntry(item[0], item[1], item[2]))
        return cls(generation, next_seq, tuple(entries))


def _uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def _read_index(mlc: MLC, uri: str) -> tuple[HistoryIndex | None, str | None]:
    """The index and its ETag; (None, None) where there is none, (None, etag) where it is unreadable."""
    try:
        data, info = await mlc.fetch(uri)
    except ObjectNotFound:
        return None, None
    try:
        return HistoryIndex.decode(data), info.etag
    except BadMessage as exc:
        log.warning("history index %s is unreadable, replacing it: %s", uri, exc.detail)
        return None, info.etag


async def publish_output(
    mlc: MLC,
    *,
    contract: Contract,
    key: bytes,
    session: bytes,
    epoch: int,
    output: Sequence[int],
    keep: int,
) -> bool:
    """Store a finished session's output as an entry of scope ``key`` and append it to the scope's
    index, which keeps the newest ``keep`` entries (the entries it drops are deleted). False when
    the index could not be updated (every try lost to another publisher): the entry is removed."""
    entry = entry_uri(mlc.authority, contract, key, session, epoch)
    index = index_uri(mlc.authority, contract, key)
    await mlc.put(entry, encode_token_list(output))
    for attempt in range(_PUBLISH_ATTEMPTS):
        current, etag = await _read_index(mlc, index)
        if current is not None and any(held.uri == entry for held in current.entries):
            return True  # an earlier try landed
        updated, dropped = (current or HistoryIndex.new()).with_entry(entry, len(output), keep)
        try:
            await mlc.put(index, updated.encode(), if_match=etag)
        except PreconditionFailed:
            await asyncio.sleep(random.uniform(0, _PUBLISH_BACKOFF_S * 2**attempt))
            continue
        if etag is None:
            # Created without a precondition: a publisher creating it at the same moment may have
            # replaced it. The entry counts once the index holds it.
            again, _ = await _read_index(mlc, index)
            if again is None or all(held.uri != entry for held in again.entries):
                continue
        for old in dropped:
            try:
                await mlc.delete(old.uri)
            except CacheError as exc:
                log.info("history entry %s not deleted: %s", old.uri, exc)
        return True
    await mlc.delete(entry)
    return False


@dataclass
class _Scope:
    """Where a reader stands in one scope's index."""

    generation: bytes = b""
    seen: int = -1  # the last seq learned (or skipped)
    read_at: float | None = None
    reading: asyncio.Task[int] | None = None


class HistoryReader:
    """Reads the history scopes' new entries for one drafter instance: per scope at most
    ``entries`` entries a refresh (the newest), and a scope at most once per ``refresh_s``."""

    def __init__(self, mlc: MLC, *, entries: int, refresh_s: float) -> None:
        self._mlc = mlc
        self.entries = entries
        self.refresh_s = refresh_s
        # By index URI, least recently used first.
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()

    def due(self, uri: str) -> bool:
        scope = self._scopes.get(uri)
        read_at = scope.read_at if scope is not None else None
        return self.entries > 0 and (read_at is None or time.monotonic() - read_at >= self.refresh_s)

    async def refresh(self, uri: str, learn: Callable[[tuple[int, ...]], Awaitable[None]]) -> int:
        """Hand the entries of index ``uri`` not learned yet to ``learn``, oldest first, unless the
        scope was read within ``refresh_s``; how many were learned. A refresh of the scope already
        under way is waited for instead."""
        scope = self._scopes.get(uri)
        if scope is None:
            scope = self._scopes[uri] = _Scope()
            while len(self._scopes) > _MAX_SCOPES:
                self._scopes.popitem(last=False)
        self._scopes.move_to_end(uri)
        if scope.reading is not None and not scope.reading.done():
            await asyncio.wait([scope.reading])
            return 0
        if not self.due(uri):
            return 0
        scope.read_at = time.monotonic()
        scope.reading = asyncio.ensure_future(self._learn_new(uri, scope, learn))
        return await scope.reading

    async def _learn_new(self, uri: str, scope: _Scope, learn: Callable[[tuple[int, ...]], Awaitable[None]]) -> int:
        index, _ = await _read_index(self._mlc, uri)
        if index is None:
            return 0
        if scope.generation != index.generation:
            scope.generation, scope.seen = index.generation, -1
        fresh = [entry for entry in index.entries if entry.seq > scope.seen][-self.entries :]
        learned = 0
        for entry in fresh:
            try:
                tokens = decode_token_list(await self._mlc.get(entry.uri), "history entry")
            except ObjectNotFound:
                tokens = ()  # pushed out or evicted since the index was read
            except BadMessage as exc:
                log.warning("history entry %s is unreadable: %s", entry.uri, exc.detail)
                tokens = ()
            if tokens:
                await learn(tokens)
                learned += 1
            # Past it whatever became of it: an entry is learned once at most.
            scope.seen = entry.seq
        return learned
