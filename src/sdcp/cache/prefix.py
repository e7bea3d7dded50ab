"""The prefix cache's index: which stored KV covers the longest whole-block prefix of a prompt.

A prompt's tokens are cut into blocks of ``block`` tokens; block i's hash chains the previous one
(vLLM's automatic prefix caching):

    h[-1] = SHA-256("SDCP-PREFIX-KV-1" || 0x00 || salt || scope)
    h[i]  = SHA-256(h[i-1] || uint32(t[i*block]) || ... || uint32(t[(i+1)*block - 1]))

where ``salt`` binds what the KV depends on besides the tokens (the target's and tokenizer's
digests), so that one index never serves KV of another model, and ``scope`` whose prefixes they
are (a tenant: one tenant's prompts and outputs never speed up another's). An entry is an opaque
blob (the runtime's KV of its tokens) with the tokens it covers, found by the hashes of their whole
blocks; once found, it serves the prompt's tokens as far as the two agree, past the last whole
block too (the end of a system prompt, a chat template's turn header), which vLLM's paged blocks
cannot. The index holds entries up to ``capacity_bytes`` in all, the least recently used evicted
first. A lookup compares the entry's tokens with the prompt's, so a hash collision can never serve
another prefix's KV.

Safe from any thread: its own lock serialises calls, so that a verifier's event loop can ask what a
prompt would restore (``covered``) while the model's thread prefills and stores.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "BLOCK_TOKENS",
    "SHARE_TOKENS",
    "PrefixEntry",
    "PrefixIndex",
    "block_hashes",
    "share_points",
    "shared_hashes",
    "tenant_scope",
]

_DOMAIN = b"SDCP-PREFIX-KV-1\x00"
# A block (vLLM's default size): a prefill recomputes at most this many tokens less one of a prefix
# the cache holds.
BLOCK_TOKENS = 16
# Prefixes are shared (through the MLC, and in status reports to the router) at multiples of this
# many tokens: one name each.
SHARE_TOKENS = 256


def block_hashes(tokens: Sequence[int], *, block: int, salt: bytes, scope: bytes = b"") -> list[bytes]:
    """The chained hash of each whole block of ``tokens`` (module doc); ``salt`` has a fixed length."""
    if block < 1:
        raise ValueError(f"a block holds at least one token, got {block}")
    chained = hashlib.sha256(_DOMAIN + salt + scope).digest()
    hashes = []
    for start in range(0, len(tokens) - block + 1, block):
        digest = hashlib.sha256(chained)
        digest.update(b"".join(int(token).to_bytes(4, "big") for token in tokens[start : start + block]))
        chained = digest.digest()
        hashes.append(chained)
    return hashes


def tenant_scope(tenant: str | None) -> bytes:
    """The scope of a session's prefixes: its tenant's (docs/security.md, "Tenants")."""
    return b"" if tenant is None else tenant.encode()


def share_points(hashes: Sequence[bytes], block: int) -> list[tuple[int, bytes]]:
    """Of the chained hashes of a prefix's blocks of ``block`` tokens, the length and hash at each
    multiple of SHARE_TOKENS: the names under which verifiers share and report the prefix."""
    step = SHARE_TOKENS // block
    return [(index * SHARE_TOKENS, hashes[index * step - 1]) for index in range(1, len(hashes) // step + 1)]


def shared_hashes(tokens: Sequence[int], *, salt: bytes, scope: bytes = b"") -> list[bytes]:
    """The names of ``tokens``'s prefixes at each multiple of SHARE_TOKENS (`share_points`)."""
    hashes = block_hashes(tokens, block=BLOCK_TOKENS, salt=salt, scope=scope)
    return [name for _, name in share_points(hashes, BLOCK_TOKENS)]


@dataclass(frozen=True)
class PrefixEntry:
    """Stored KV: ``data`` holds the KV of ``tokens``, found by the hashes of their whole blocks."""

    tokens: tuple[int, ...]
    data: bytes
    # The chained hash of each of its blocks, in order.
    hashes: tuple[bytes, ...]
    scope: bytes = b""


class PrefixIndex:
    """Entries by the hash of their last block, and every block hash of theirs to the newest entry
    that covers it; bounded in bytes, least recently used evicted first."""

    def __init__(
        self,
        *,
        capacity_bytes: int,
        block: int,
        salt: bytes,
        on_insert: Callable[[PrefixEntry], None] | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"a prefix cache holds at least 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block = block
        self.salt = salt
        self._entries: OrderedDict[bytes, PrefixEntry] = OrderedDict()
        self._covering: dict[bytes, bytes] = {}
        self.held_bytes = 0
        # vLLM's counters, in tokens: prompt tokens looked up, and those served from the cache.
        self.queries = 0
        self.hits = 0
        # Told of each new entry (the verifier shares it through the MLC), on the inserting thread.
        self.on_insert = on_insert
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def whole_blocks(self, length: int) -> int:
        """The longest whole-block length within ``length`` tokens."""
        return length - length % self.block

    def hashes(self, tokens: Sequence[int], scope: bytes = b"") -> list[bytes]:
        return block_hashes(tokens, block=self.block, salt=self.salt, scope=scope)

    def lookup(self, tokens: Sequence[int], scope: bytes = b"") -> tuple[PrefixEntry, int] | None:
        """The entry covering the longest whole-block prefix of ``tokens``, and how many leading
        tokens of ``tokens`` it holds the KV of: those whole blocks, and as many of the tokens after
        them as the entry has too (the KV of a position depends on the tokens up to it alone).
        None where no whole block is held. Counts the query and the hit."""
        hashes = self.hashes(tokens, scope)
        with self._lock:
            self.queries += len(tokens)
            found = self._find(tokens, hashes)
            if found is None:
                return None
            entry, length = found
            self._entries.move_to_end(entry.hashes[-1])
            self.hits += length
            return entry, length

    def covered(self, tokens: Sequence[int], scope: bytes = b"", *, hashes: Sequence[bytes] | None = None) -> int:
        """How many leading tokens of ``tokens`` `lookup` would serve, without counting a query;
        ``hashes``: theirs (`hashes`), where the caller has them already."""
        hashes = self.hashes(tokens, scope) if hashes is None else hashes
        with self._lock:
            found = self._find(tokens, hashes)
        return 0 if found is None else found[1]

    def _find(self, tokens: Sequence[int], hashes: Sequence[bytes]) -> tuple[PrefixEntry, int] | None:
        found: tuple[bytes, int] | None = None
        for index, digest in enumerate(hashes):
            key = self._covering.get(digest)
            if key is None:
                break
            found = (key, (index + 1) * self.block)
        if found is None:
            return None
        key, length = found
        entry = self._entries[key]
        if tuple(tokens[:length]) != entry.tokens[:length]:
            return None  # a hash collision: never another prefix's KV
        limit = min(len(tokens), len(entry.tokens))
        while length < limit and tokens[length] == entry.tokens[length]:
            length += 1
        return entry, length

    def insert(self, tokens: Sequence[int], data: bytes, scope: bytes = b"", *, told: bool = True) -> bool:
        """Hold ``data`` as the KV of ``tokens``; False where it does not fit (larger than the
        capacity) or ``tokens`` hold no whole block. ``told``: `on_insert` hears of it."""
        hashes = self.hashes(tokens, scope)
        if not hashes or len(data) > self.capacity_bytes:
            return False
        key = hashes[-1]
        entry = PrefixEntry(tuple(tokens), data, tuple(hashes), scope)
        with self._lock:
            held = self._entries.get(key)
            if held is not None:
                if len(held.tokens) >= len(tokens):
                    self._entries.move_to_end(key)
                    return True
                # The same whole blocks, and more tokens after them: the newer entry replaces it.
                self.discard(held)
            while self._entries and self.held_bytes + len(data) > self.capacity_bytes:
                self._evict()
            self._entries[key] = entry
            self.held_bytes += len(data)
            for digest in hashes:
                self._covering[digest] = key
        if told and self.on_insert is not None:
            self.on_insert(entry)
        return True

    def reported(self, limit: int) -> list[bytes]:
        """The hashes at multiples of SHARE_TOKENS of the entries held, newest entry first, at most
        ``limit`` (what a verifier tells the router it holds)."""
        found: list[bytes] = []
        with self._lock:
            entries = list(self._entries.values())
        for entry in reversed(entries):
            for _, digest in reversed(share_points(entry.hashes, self.block)):
                if len(found) == limit:
                    return found
                if digest not in found:
                    found.append(digest)
        return found

    def discard(self, entry: PrefixEntry) -> None:
        """Forget ``entry`` (its blob would not restore)."""
        key = entry.hashes[-1]
        with self._lock:
            if self._entries.get(key) is entry:
                self._entries.move_to_end(key, last=False)
                self._evict()

    def _evict(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self.held_bytes -= len(entry.data)
        for digest in entry.hashes:
            if self._covering.get(digest) != key:
                continue
            # Another entry holding this block, the newest, takes it over where there is one.
            successor = next((other for other, held in reversed(self._entries.items()) if digest in held.hashes), None)
            if successor is None:
                del self._covering[digest]
            else:
                self._covering[digest] = successor
