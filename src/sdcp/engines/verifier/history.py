"""The verifier publishes each finished session's output for the suffix drafters' shared history
(sdcp.engines.history; docs/models.md, "Suffix drafter").

The verifier is the one role that sees every session end: it commits every token, self-decoded or
drafted, and knows the session's owner. A session that ends with ``finish`` (not ``fail``, not
fenced) has its output stored in the MLC under its history scope, and the scope listed in its
owner's directory, in the background: a failure is logged and changes nothing for the session.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sdcp.cache import MLC
from sdcp.config import VerifierConfig
from sdcp.engines.history import directory_uri, history_scope_key, index_uri, list_scope, publish_output
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.live import LiveSession
from sdcp.engines.verifier.observe import VerifierMetrics
from sdcp.protocol.messages import Action

__all__ = ["HistoryPublisher"]

log = logging.getLogger("sdcp.verifier")


class HistoryPublisher:
    """Publishes finished sessions' output to ``mlc`` as ``settings()`` says (``history_scope``,
    ``history_entries``; 0 entries: nothing is published)."""

    def __init__(
        self,
        *,
        uri: str,
        mlc: MLC,
        settings: Callable[[], VerifierConfig],
        tasks: BackgroundTasks,
        metrics: VerifierMetrics,
    ) -> None:
        self._uri = uri
        self._mlc = mlc
        self._settings = settings
        self._tasks = tasks
        self._metrics = metrics

    def ended(self, live: LiveSession) -> None:
        """A session ended (or was fenced): its output is published if it finished here."""
        machine = live.machine
        settings = self._settings()
        if machine.control.ended is not Action.FINISH or machine.fenced or settings.history_entries == 0:
            return
        if not machine.tokens:
            return
        self._tasks.spawn(self._publish(live, settings))

    async def _publish(self, live: LiveSession, settings: VerifierConfig) -> None:
        machine = live.machine
        key = history_scope_key(machine.contract, live.owner, settings.history_scope, live.tenant)
        try:
            published = await publish_output(
                self._mlc,
                contract=machine.contract,
                key=key,
                session=machine.session,
                epoch=machine.epoch,
                output=tuple(machine.tokens),
                keep=settings.history_entries,
            )
        except Exception as exc:  # noqa: BLE001 - the history is an optimisation: the session is done
            log.warning("%s: session %s: output not published: %r", self._uri, machine.session.hex(), exc)
            published = False
        self._metrics.history_published(ok=published)
        if published:
            await self._list(live, settings, key)

    async def _list(self, live: LiveSession, settings: VerifierConfig, key: bytes) -> None:
        """List the scope in its owner's directory, where drafters look at their start."""
        directory = directory_uri(self._mlc.authority, live.owner, settings.history_scope)
        index = index_uri(self._mlc.authority, live.machine.contract, key)
        try:
            if not await list_scope(self._mlc, directory=directory, index=index):
                log.info("%s: history scope %s not listed: every try lost", self._uri, index)
        except Exception as exc:  # noqa: BLE001 - as above; the next publication lists it again
            log.warning("%s: history scope %s not listed: %r", self._uri, index, exc)
