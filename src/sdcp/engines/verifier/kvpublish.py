"""The target KV of long sessions, published to the MLC so that a failover can resume from it
instead of prefilling (draft-li-sdcp 6.3: the verifier MAY publish it; 6.9: resume.target_kv).

Policy (docs/reliability.md): after the first commit that finds the session's committed prefix
holding ``kv_publish_min_tokens`` tokens past those whose KV the verifier shares as a prefix object
(the prompt's whole multiples of SHARE_TOKENS, sdcp.engines.verifier.prefixshare: a failover's
prefill fetches them), and again every ``kv_publish_every`` tokens committed since; never at the
open, so that the first token of a session, or of a failover, waits for no export. The export runs
on the scorer's thread, the only one that touches the target, queued behind the commit that it
follows and before the session's next pass; the write to the MLC runs as a task of its own, so no
round waits for either. Only tokens whose commit record is durable are published, so a blob
always covers a prefix of what any later epoch resumes from.

Each epoch publishes under its own name, beside the commit log (``sdcp.cache.uri.target_kv_uri``),
so that a fenced verifier never overwrites or deletes what its successor published. The verifier
deletes its blob when the session ends here or is forgotten idle; the router deletes the failed
epoch's once the session is open at the new verifier. No lease is taken: the blob only saves a
prefill, and the store may evict it under pressure rather than refuse the draft rows that rounds
need (SDCP 6.3).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future

from sdcp.cache import MLC, CacheError, ObjectTooLarge
from sdcp.config import VerifierConfig
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.live import LiveSession
from sdcp.models.backend import Target
from sdcp.models.worker import ModelThread, ModelThreadClosed

__all__ = ["KVPublisher"]

log = logging.getLogger("sdcp.verifier")


class KVPublisher:
    """Publishes and retires the target KV of the sessions given to it; ``settings`` gives the
    engine's settings as they are at each decision."""

    def __init__(
        self,
        *,
        uri: str,
        target: Target,
        thread: ModelThread,
        mlc: MLC,
        settings: Callable[[], VerifierConfig],
        tasks: BackgroundTasks,
        shared: Callable[[int], int],
    ) -> None:
        self._uri = uri
        # How many leading tokens of a prompt of so many tokens are in the MLC as a shared prefix
        # (PrefixSharing.shares).
        self._shared = shared
        self._target = target
        self._thread = thread
        self._mlc = mlc
        self._settings = settings
        self._tasks = tasks

    def committed(self, live: LiveSession) -> None:
        """After a commit (its model sync queued already): publish if the policy says so. Queues
        the export at once, so that it follows the commit on the thread."""
        machine = live.machine
        settings = self._settings()
        length = len(machine.prompt) + machine.committed
        if live.kv_uri is None or live.kv_too_large or live.kv_retired or machine.ended or machine.fenced:
            return
        if settings.kv_publish_min_tokens == 0:
            return
        if length - self._shared(len(machine.prompt)) < settings.kv_publish_min_tokens:
            return
        every = settings.kv_publish_every
        if live.kv_tried_at and (every == 0 or length - live.kv_tried_at < every):
            return
        if live.kv_publishing is not None and not live.kv_publishing.done():
            return  # a later commit tries again
        tokens = (*machine.prompt, *machine.tokens)
        try:
            exported = self._thread.run(self._export, machine.session, tokens)
        except ModelThreadClosed:
            return  # the engine is stopping
        live.kv_tried_at = length
        live.kv_publishing = self._tasks.spawn(self._publish(live, exported, length))

    def retire(self, live: LiveSession) -> None:
        """The session ended here or was forgotten: its blob goes, after any write in flight."""
        if live.kv_uri is None or live.kv_retired:
            return
        live.kv_retired = True
        if live.kv_tried_at:
            self._tasks.spawn(self._delete(live, live.kv_uri))

    # -- on the scorer's thread --------------------------------------------------------------------

    def _export(self, session: bytes, tokens: tuple[int, ...]) -> bytes | None:
        """The KV over exactly ``tokens``; None where the model holds other tokens by now (a round
        whose record failed is being realigned, the session was closed)."""
        if not self._target.has_session(session) or self._target.committed_tokens(session) != tokens:
            return None
        return self._target.export_kv(session)

    # -- on the event loop -------------------------------------------------------------------------

    async def _publish(self, live: LiveSession, exported: Future[bytes | None], length: int) -> None:
        uri = live.kv_uri
        assert uri is not None  # checked before the export was queued
        session = live.machine.session.hex()
        try:
            blob = await asyncio.wrap_future(exported)
        except Exception as exc:  # noqa: BLE001 - a failed export costs a later failover a prefill only
            log.warning("%s: target KV of session %s not exported: %r", self._uri, session, exc)
            return
        if blob is None or live.kv_retired or live.machine.fenced:
            return
        try:
            await self._mlc.put(uri, blob)
        except ObjectTooLarge as exc:
            # It only grows: the session's failover will prefill.
            live.kv_too_large = True
            log.info("%s: target KV of session %s not published: %s", self._uri, session, exc)
        except CacheError as exc:
            log.warning("%s: target KV of session %s not published: %s", self._uri, session, exc)
        else:
            live.kv_published = length
            log.debug("%s: target KV of session %s published over %d tokens", self._uri, session, length)

    async def _delete(self, live: LiveSession, uri: str) -> None:
        if live.kv_publishing is not None:
            await asyncio.wait([live.kv_publishing])
        try:
            await self._mlc.delete(uri)
        except CacheError as exc:
            log.info("%s: target KV %s not deleted: %s", self._uri, uri, exc)
