"""Prefix KV shared through the MLC (issue #37): a prefix one verifier computed saves every other
verifier its prefill (another replica, a restarted one, a failover's), as LMCache and Mooncake share
vLLM's prefix blocks.

Publishing. Each new entry of the target's prefix cache (``sdcp.cache.prefix``) whose whole blocks
reach SHARE_TOKENS is written to the MLC as a target-KV object named by the chained block hash at its
longest multiple of SHARE_TOKENS: ``mlc://<authority>/-/prefix-kv/<hash hex>``, once no session runs
on the verifier (PUBLISH_WAIT_S after the prefill at the latest). The hash binds the
target's and tokenizer's digests and the tenant (the prefix cache's scope), so the name alone says
what the object must hold. Its content is a map in deterministic CBOR, signed as commit records are
(``sdcp.transport.signing``: the verifier's TLS key, its certificate inside):

    {"model": digest, "tokenizer": digest, "scope": bytes, "tokens": [...], "kv": runtime blob,
     "writer": verifier URI, "cert": DER, "sig": signature}

Using. Before a prefill, the verifier asks the MLC for the names of the prompt's multiples of
SHARE_TOKENS past what the local cache holds of it, longest first, at most MAX_PROBES of them. It
takes an object only if its writer is a verifier its ``[trust] verifiers`` names, the CA issued the
certificate to that writer, the signature holds, the digests are its own, and the tokens hash to
the name and begin the prompt; the blob then enters the local prefix cache and the prefill starts
from it. Anything else is counted as refused and costs the prefill only: a forged object never
reaches llama.cpp's state reader, and never changes a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from sdcp.cache import MLC, CacheError, ObjectNotFound, build_uri
from sdcp.cache.prefix import SHARE_TOKENS, PrefixEntry, share_points
from sdcp.cache.uri import PREFIX_KV_KIND
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.observe import VerifierMetrics
from sdcp.engines.verifier.rounds import RecordSign
from sdcp.models.backend import Target
from sdcp.protocol import codec
from sdcp.protocol.problems import BadMessage
from sdcp.protocol.records import CERT_MEMBER, RecordAuthority, UntrustedRecord

__all__ = ["MAX_PROBES", "PUBLISH_WAIT_S", "PrefixSharing", "prefix_object_uri"]

log = logging.getLogger("sdcp.verifier")

# Names a prefill probes at most (the longest first): prompts of up to 16 x 256 tokens find any.
MAX_PROBES = 16
# Names of objects this verifier published, remembered so that a prefix is written once.
_PUBLISHED_NAMES = 4096
# An object is made once no session runs, at most this long after its prefill: encoding, signing
# and writing tens of MB (2,200 tokens: 48 MB) took the cores from the first passes of the session
# that computed it (a 5-row pass of 485 ms); another verifier finds it that much later at most.
PUBLISH_WAIT_S = 10.0


def prefix_object_uri(authority: str, block_hash: bytes) -> str:
    return build_uri(authority, None, PREFIX_KV_KIND, block_hash.hex())


class PrefixSharing:
    """Publishes the target's new prefix-cache entries and fetches others' before a prefill.
    ``trusted`` says whether a URI is a verifier of ``[trust] verifiers``; ``authority`` checks
    certificates and signatures (None: no object is ever trusted, none is published); ``idle`` is
    set while no session runs (objects are made then, PUBLISH_WAIT_S at the latest)."""

    def __init__(
        self,
        *,
        uri: str,
        metrics: VerifierMetrics,
        target: Target,
        mlc: MLC,
        tasks: BackgroundTasks,
        sign: RecordSign | None,
        authority: RecordAuthority | None,
        trusted: Callable[[str], bool],
        idle: asyncio.Event,
    ) -> None:
        self._uri = uri
        self._idle = idle
        self._metrics = metrics
        self._target = target
        self._mlc = mlc
        self._tasks = tasks
        self._sign = sign
        self._authority = authority
        self._trusted = trusted
        self._published: OrderedDict[bytes, None] = OrderedDict()
        # Objects waiting for no session to run before they are made.
        self.waiting = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Hear of the prefix cache's new entries (told on the scorer's thread)."""
        index = self._target.prefixes
        if index is None or self._sign is None:
            return
        self._loop = asyncio.get_running_loop()
        index.on_insert = self._inserted

    # -- publishing --------------------------------------------------------------------------------

    def shares(self, prompt_tokens: int) -> int:
        """The leading tokens of a prompt of ``prompt_tokens`` whose KV this verifier shares: its
        whole multiples of SHARE_TOKENS where it publishes prefixes (the prefill that computes them
        stores and publishes them, or found them stored), else none."""
        if self._target.prefixes is None or self._sign is None:
            return 0
        return prompt_tokens // SHARE_TOKENS * SHARE_TOKENS

    def _inserted(self, entry: PrefixEntry) -> None:
        """On the scorer's thread: share the entry from the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(self._publish_soon, entry)

    def _publish_soon(self, entry: PrefixEntry) -> None:
        index = self._target.prefixes
        if index is None or self._sign is None:
            return
        points = share_points(entry.hashes, index.block)
        if not points:
            return
        _, name = points[-1]
        if name in self._published:
            self._published.move_to_end(name)
            return
        self._published[name] = None
        while len(self._published) > _PUBLISHED_NAMES:
            self._published.popitem(last=False)
        body = {
            "model": self._target.weights_digest,
            "tokenizer": self._target.tokenizer_digest,
            "scope": entry.scope,
            "tokens": list(entry.tokens),
            "kv": entry.data,
            "writer": self._uri,
        }
        self._tasks.spawn(self._put(prefix_object_uri(self._mlc.authority, name), body))

    async def _put(self, uri: str, body: dict[str, Any]) -> None:
        assert self._sign is not None  # checked before the task was spawned
        self.waiting += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), PUBLISH_WAIT_S)
        finally:
            self.waiting -= 1
        try:
            sign = self._sign
            data = await asyncio.to_thread(lambda: codec.encode(sign(body, True)))
            await self._mlc.put(uri, data)
        except CacheError as exc:
            log.info("%s: prefix KV %s not shared: %s", self._uri, uri, exc)
            return
        self._metrics.prefix_shared("published")

    # -- using -------------------------------------------------------------------------------------

    async def fetch(self, prefix: Sequence[int], scope: bytes) -> None:
        """Bring the longest shared prefix of ``prefix`` (the tokens a prefill computes) that
        reaches past the local cache into it; does nothing where none is usable."""
        index = self._target.prefixes
        if index is None or self._authority is None or len(prefix) < SHARE_TOKENS:
            # A prefix shorter than SHARE_TOKENS has no shared name.
            return
        hashes = index.hashes(prefix, scope)
        held = index.covered(prefix, scope, hashes=hashes)
        longer = [(length, name) for length, name in reversed(share_points(hashes, index.block)) if length > held]
        for length, name in longer[:MAX_PROBES]:
            uri = prefix_object_uri(self._mlc.authority, name)
            try:
                data = await self._mlc.get(uri)
            except ObjectNotFound:
                continue
            except CacheError as exc:
                log.info("%s: prefix KV %s not read: %s", self._uri, uri, exc)
                return
            try:
                tokens, kv = await asyncio.to_thread(self._checked, data, prefix, scope, length)
            except UntrustedRecord as exc:
                self._metrics.prefix_shared("refused")
                log.warning("%s: prefix KV %s refused: %s", self._uri, uri, exc)
                continue
            # The index has a lock of its own: no turn on the scorer's thread, behind the pass under
            # way, for the prefill that waits for this; its hashing stays off the event loop.
            await asyncio.to_thread(index.insert, tokens, kv, scope, told=False)
            self._metrics.prefix_shared("used")
            return

    def _checked(self, data: bytes, prefix: Sequence[int], scope: bytes, length: int) -> tuple[list[int], bytes]:
        """The object's tokens and blob, if it is what its name says, by a trusted verifier."""
        assert self._authority is not None  # checked by fetch
        try:
            body = codec.decode(data, max_size=len(data))
        except BadMessage as exc:
            raise UntrustedRecord(f"not CBOR: {exc}") from exc
        if not isinstance(body, dict):
            raise UntrustedRecord("not a map")
        writer = body.get("writer")
        if not isinstance(writer, str) or not self._trusted(writer):
            raise UntrustedRecord(f"written by {writer!r}, not a verifier of [trust] verifiers")
        self._authority.signature(body, self._authority.certificate(body.get(CERT_MEMBER), writer))
        if body.get("model") != self._target.weights_digest or body.get("tokenizer") != self._target.tokenizer_digest:
            raise UntrustedRecord("KV of another target or tokenizer")
        tokens, kv = body.get("tokens"), body.get("kv")
        if body.get("scope") != scope or not isinstance(tokens, list) or not isinstance(kv, bytes):
            raise UntrustedRecord("not a prefix KV object of this scope")
        # Equal tokens of one scope and target hash to the name the object was read under.
        if not all(isinstance(token, int) for token in tokens) or tokens[:length] != list(prefix[:length]):
            raise UntrustedRecord("its tokens do not begin the prompt")
        return tokens, kv
