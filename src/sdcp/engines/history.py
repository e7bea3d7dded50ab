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

and, outside any KVSP scope, one directory per owner (under ``target``: one for every front end),
``dir-<hash of the policy and owner>``: a CBOR map ``{scopes}``, the index URIs of that owner's
scopes, at most ``DIRECTORY_SCOPES``, the most recently added last. A publisher adds its scope's
index when the directory lacks it. A drafter reads at its start the directories of the owners it is
configured for (``warm``), so that it drafts from their history from its first round; an owner it is
not configured for it finds only at an assignment of that owner's session, as before.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, TypeVar

from sdcp.cache import MLC, CacheError, InvalidURI, ObjectNotFound, PreconditionFailed, build_uri
from sdcp.cache.etags import ABSENT_ETAG
from sdcp.cache.uri import HISTORY_KIND, parse_uri
from sdcp.config import HistoryScope
from sdcp.protocol import codec
from sdcp.protocol.messages import Contract
from sdcp.protocol.problems import BadMessage
from sdcp.protocol.records import decode_token_list, encode_token_list

__all__ = [
    "DEFAULT_HISTORY_ENTRIES",
    "DIRECTORY_SCOPES",
    "HistoryDirectory",
    "HistoryIndex",
    "HistoryReader",
    "HistoryScope",
    "IndexEntry",
    "directory_uri",
    "entry_uri",
    "history_scope_key",
    "index_uri",
    "list_scope",
    "publish_output",
    "scope_key_of",
    "warm",
]

log = logging.getLogger("sdcp.history")

# Entries a scope's index keeps (the publisher's bound) and a reader takes per refresh (its own).
DEFAULT_HISTORY_ENTRIES = 256
# Scopes an owner's directory lists: what a drafter may warm from at its start.
DIRECTORY_SCOPES = 64
_KEY_BYTES = 16
_LABEL = b"sdcp-history-1"
_DIRECTORY_LABEL = b"sdcp-history-directory-1"
# A publisher that keeps losing the index's conditional put to other publishers gives up.
_PUBLISH_ATTEMPTS = 8
_PUBLISH_BACKOFF_S = 0.01
# History scopes a reader remembers where it stopped in (the least recently used are forgotten).
_MAX_SCOPES = 4096


def history_scope_key(contract: Contract, owner: str | None, policy: HistoryScope, tenant: str | None = None) -> bytes:
    """The 16 bytes naming whose finished output a session's drafts may come from: the contract's
    target, tokenizer and scope, and under ``owner`` the front end that opened the session and the
    tenant it named (its API user: a session without one shares with the front end's other
    tenant-less sessions only, one without an owner with the other owner-less sessions)."""
    digest = hashlib.sha256(_LABEL)
    owner_part = (owner or "").encode() if policy == "owner" else b""
    tenant_part = (tenant or "").encode() if policy == "owner" else b""
    for part in (policy.encode(), contract.target, contract.tokenizer, contract.scope or b"", owner_part, tenant_part):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return digest.digest()[:_KEY_BYTES]


def index_uri(authority: str, contract: Contract, key: bytes) -> str:
    return build_uri(authority, contract.scope, HISTORY_KIND, key.hex())


def scope_key_of(index: str) -> bytes | None:
    """The scope key an index URI of ours names; None for any other URI. A drafter files what it
    reads from an index under this key, so a directory that listed another owner's index would
    only warm that owner's history, never let it into this owner's drafts."""
    try:
        parsed = parse_uri(index)
        key = bytes.fromhex(parsed.name)
    except (InvalidURI, ValueError):
        return None
    return key if parsed.kind == HISTORY_KIND and len(key) == _KEY_BYTES else None


def directory_uri(authority: str, owner: str | None, policy: HistoryScope) -> str:
    """The directory of the history scopes of ``owner``'s sessions (under ``target``, of every
    front end's: the owner is left out, as in the scope key)."""
    digest = hashlib.sha256(_DIRECTORY_LABEL)
    owner_part = (owner or "").encode() if policy == "owner" else b""
    for part in (policy.encode(), owner_part):
        digest.update(len(part).to_bytes(4, "big"))
        digest.update(part)
    return build_uri(authority, None, HISTORY_KIND, f"dir-{digest.digest()[:_KEY_BYTES].hex()}")


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

    def holds(self, uri: str) -> bool:
        return any(entry.uri == uri for entry in self.entries)

    def with_entry(self, uri: str, tokens: int, keep: int) -> tuple[HistoryIndex, list[str]]:
        """This index with one more entry, and the URIs of the entries pushed out to keep ``keep``."""
        entries = [*self.entries, IndexEntry(self.next, uri, tokens)]
        dropped = entries[: max(0, len(entries) - keep)]
        index = HistoryIndex(self.generation, self.next + 1, tuple(entries[len(dropped) :]))
        return index, [entry.uri for entry in dropped]

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


@dataclass(frozen=True)
class HistoryDirectory:
    """The index URIs of one owner's history scopes, the most recently added last."""

    scopes: tuple[str, ...]

    def holds(self, uri: str) -> bool:
        return uri in self.scopes

    def with_scope(self, uri: str, keep: int) -> tuple[HistoryDirectory, list[str]]:
        scopes = (*self.scopes, uri)
        return HistoryDirectory(scopes[max(0, len(scopes) - keep) :]), []

    def encode(self) -> bytes:
        return codec.encode({"scopes": list(self.scopes)})

    @classmethod
    def decode(cls, data: bytes) -> HistoryDirectory:
        """Raises BadMessage for anything but what ``encode`` writes."""
        obj = codec.decode(data)
        scopes = obj.get("scopes") if isinstance(obj, dict) else None
        if not isinstance(scopes, list) or not all(isinstance(uri, str) for uri in scopes):
            raise BadMessage("a history directory is a map of its scopes' index URIs")
        return cls(tuple(scopes))


def _uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _Listing(Protocol):
    def holds(self, uri: str) -> bool: ...

    def encode(self) -> bytes: ...

    @classmethod
    def decode(cls, data: bytes) -> Self: ...


_L = TypeVar("_L", bound=_Listing)


async def _read(mlc: MLC, uri: str, kind: type[_L]) -> tuple[_L | None, str | None]:
    """The listing and its ETag; (None, None) where there is none, (None, etag) where it is unreadable."""
    try:
        data, info = await mlc.fetch(uri)
    except ObjectNotFound:
        return None, None
    try:
        return kind.decode(data), info.etag
    except BadMessage as exc:
        log.warning("history listing %s is unreadable, replacing it: %s", uri, exc.detail)
        return None, info.etag


async def _add(
    mlc: MLC, uri: str, kind: type[_L], item: str, add: Callable[[_L | None], tuple[_L, list[str]]]
) -> list[str] | None:
    """Put ``add(listing)`` at ``uri`` by a conditional put on the listing's ETag, re-read and retried
    while other writers win, until the listing holds ``item``: the URIs ``add`` pushed out (none
    where an earlier try had landed), or None where every try lost."""
    for attempt in range(_PUBLISH_ATTEMPTS):
        current, etag = await _read(mlc, uri, kind)
        if current is not None and current.holds(item):
            return []  # an earlier try landed
        updated, dropped = add(current)
        try:
            # A listing not there yet is created only if nobody created it meanwhile: a create
            # without that condition replaced another writer's fresh listing, entry and all.
            await mlc.put(uri, updated.encode(), if_match=ABSENT_ETAG if etag is None else etag)
        except PreconditionFailed:
            await asyncio.sleep(random.uniform(0, _PUBLISH_BACKOFF_S * 2**attempt))
            continue
        return dropped
    return None


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
    dropped = await _add(
        mlc,
        index,
        HistoryIndex,
        entry,
        lambda current: (current or HistoryIndex.new()).with_entry(entry, len(output), keep),
    )
    if dropped is None:
        await mlc.delete(entry)
        return False
    for old in dropped:
        try:
            await mlc.delete(old)
        except CacheError as exc:
            log.info("history entry %s not deleted: %s", old, exc)
    return True


async def list_scope(mlc: MLC, *, directory: str, index: str, keep: int = DIRECTORY_SCOPES) -> bool:
    """Add the scope of ``index`` to ``directory`` where it is not listed (the oldest listed scopes
    beyond ``keep`` are dropped from the list, not deleted); False when every try lost."""
    added = await _add(
        mlc,
        directory,
        HistoryDirectory,
        index,
        lambda current: (current or HistoryDirectory(())).with_scope(index, keep),
    )
    return added is not None


@dataclass
class _Scope:
    """Where a reader stands in one scope's index."""

    generation: bytes = b""
    seen: int = -1  # the last seq learned (or skipped)
    read_at: float | None = None
    reading: asyncio.Task[int] | None = None


class HistoryReader:
    """Reads the history scopes' new entries for one drafter instance, or a verifier's lookahead:
    per scope at most ``entries`` entries a refresh (the newest), and a scope at most once per
    ``refresh_s``."""

    def __init__(self, mlc: MLC, *, entries: int, refresh_s: float) -> None:
        self.mlc = mlc
        self.entries = entries
        self.refresh_s = refresh_s
        # By index URI, least recently used first.
        self._scopes: OrderedDict[str, _Scope] = OrderedDict()

    def due(self, uri: str) -> bool:
        scope = self._scopes.get(uri)
        read_at = scope.read_at if scope is not None else None
        return self.entries > 0 and (read_at is None or time.monotonic() - read_at >= self.refresh_s)

    async def refresh(
        self,
        uri: str,
        learn: Callable[[tuple[int, ...]], Awaitable[None]],
        held: Callable[[str], bool] = lambda _entry: False,
    ) -> int:
        """Hand the entries of index ``uri`` not learned yet to ``learn``, oldest first, unless the
        scope was read within ``refresh_s``; how many were learned. An entry whose URI ``held``
        names is passed over unread (the reader's owner learned it where it was made). A refresh of
        the scope already under way is waited for instead."""
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
        scope.reading = asyncio.ensure_future(self._learn_new(uri, scope, learn, held))
        return await scope.reading

    async def _learn_new(
        self,
        uri: str,
        scope: _Scope,
        learn: Callable[[tuple[int, ...]], Awaitable[None]],
        held: Callable[[str], bool],
    ) -> int:
        index, _ = await _read(self.mlc, uri, HistoryIndex)
        if index is None:
            return 0
        if scope.generation != index.generation:
            scope.generation, scope.seen = index.generation, -1
        fresh = [entry for entry in index.entries if entry.seq > scope.seen][-self.entries :]
        learned = 0
        for entry in fresh:
            if held(entry.uri):
                scope.seen = entry.seq
                continue
            try:
                tokens = decode_token_list(await self.mlc.get(entry.uri), "history entry")
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


async def warm(
    reader: HistoryReader,
    directories: Sequence[str],
    learn: Callable[[bytes, tuple[int, ...]], Awaitable[None]],
    full: Callable[[], bool],
) -> int:
    """Read the new entries of the scopes that ``directories`` list, each directory's most recently
    listed first, until ``full()`` says the history holds its budget (more would evict what was just
    read); ``learn(key, output)`` takes each output. How many were learned. A directory or scope
    that cannot be read costs its history only; the caller bounds the time."""
    learned = 0
    for directory in directories:
        try:
            listing, _ = await _read(reader.mlc, directory, HistoryDirectory)
        except Exception as exc:  # noqa: BLE001 - the history only makes drafts longer
            log.warning("history directory %s not read: %r", directory, exc)
            continue
        for index in reversed(listing.scopes if listing is not None else ()):
            key = scope_key_of(index)
            if key is None:
                continue
            if full():
                return learned
            try:
                learned += await reader.refresh(index, functools.partial(learn, key))
            except Exception as exc:  # noqa: BLE001 - as above
                log.warning("history %s not read: %r", index, exc)
    return learned
