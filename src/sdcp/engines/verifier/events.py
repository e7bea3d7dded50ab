"""What the verifier tells the router unasked, and its care of sessions that nothing drives.

``RouterEvents`` sends events (SDCP 6.5.2) until a router answers, and ends a session no router
holds (an orphan) instead of keeping it for nobody. ``SessionSweeps`` looks over
the sessions now and then: a session no drafter proposes for gets a switch event, an idle one is
forgotten, and an ended or fenced one is freed once it has stayed readable long enough.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from sdcp.config import VerifierConfig
from sdcp.engines.errors import Unanswered
from sdcp.engines.ports import EventSink
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.history import HistoryPublisher
from sdcp.engines.verifier.kvpublish import KVPublisher
from sdcp.engines.verifier.kvsync import ModelSync
from sdcp.engines.verifier.live import LiveSession, RunningSessions
from sdcp.engines.verifier.lookahead import VerifierLookahead
from sdcp.protocol.messages import Action, Event
from sdcp.protocol.problems import ProtocolError

__all__ = ["RouterEvents", "SessionSweeps"]

log = logging.getLogger("sdcp.verifier")

# An event no router answered is sent again, after a growing wait ([verifier] orphan_timeout_s).
_EVENT_RETRY_S, _EVENT_RETRY_MAX_S = 0.2, 5.0
# What a router answers for a session it cannot find, neither in memory nor in the shared tier.
_NO_SUCH_SESSION = 404
# The longest wait between two looks for idle sessions.
_IDLE_CHECK_S = 30.0


class RouterEvents:
    """Sends the events of the sessions in ``sessions`` to ``sink``; without a sink, none.

    A session no router holds is an orphan: no router would fail it over, assign it a drafter or
    cancel it for its front end. ``orphaned`` ends it (epoch and session), once a router answers
    that it knows no such session, or once no router has answered its event for ``orphan_s()``
    seconds (docs/reliability.md, "Orphans")."""

    def __init__(
        self,
        uri: str,
        sink: EventSink | None,
        sessions: Mapping[bytes, LiveSession],
        *,
        orphan_s: Callable[[], float],
        orphaned: Callable[[bytes, int], Awaitable[object]],
    ) -> None:
        self._uri = uri
        self._sink = sink
        self._sessions = sessions
        self._orphan_s = orphan_s
        self._orphaned = orphaned

    @property
    def connected(self) -> bool:
        return self._sink is not None

    async def send(self, event: Event) -> None:
        """POST events at a router; one left unanswered is sent again (it is idempotent: the
        router acts on a switch or an end of self-decoding once per epoch and state) until a
        router answers or the session leaves this verifier; past ``orphan_s()`` the session ends."""
        if self._sink is None:
            return
        deadline = time.monotonic() + self._orphan_s()
        wait = _EVENT_RETRY_S
        while True:
            try:
                await self._sink(event)
                return
            except ProtocolError as exc:
                log.info("%s: the router refused event %s: %s", self._uri, event.kind.name, exc.detail)
                if exc.status == _NO_SUCH_SESSION and event.kind not in (Action.FINISH, Action.FAIL):
                    await self._end_orphan(event, "no router holds it")
                return
            except Unanswered as exc:
                live = self._sessions.get(event.session)
                # A fenced session's events are moot, except the one that tells of the fence.
                if live is None or live.machine.epoch != event.epoch or (live.machine.fenced and not event.fenced):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("%s: event %s unanswered: %s", self._uri, event.kind.name, exc)
                    if event.kind not in (Action.FINISH, Action.FAIL):
                        await self._end_orphan(event, f"no router answered for {self._orphan_s():.1f} s")
                    return
                log.info("%s: event %s unanswered, again in %.1f s: %s", self._uri, event.kind.name, wait, exc)
                await asyncio.sleep(min(wait, left))
                wait = min(2 * wait, _EVENT_RETRY_MAX_S)

    async def _end_orphan(self, event: Event, why: str) -> None:
        live = self._sessions.get(event.session)
        if live is None or live.machine.ended or live.machine.fenced or live.machine.epoch != event.epoch:
            return
        log.warning("%s: session %s ended: an orphan (%s)", self._uri, event.session.hex(), why)
        try:
            await self._orphaned(event.session, event.epoch)
        except Exception as exc:  # noqa: BLE001 - left to the idle sweep, which closes it later
            log.warning("%s: orphan session %s not ended: %r", self._uri, event.session.hex(), exc)


class SessionSweeps:
    """Forgets the sessions of ``sessions`` that are no longer needed, and asks the router for a
    drafter for those that no drafter drives; ``settings`` gives the engine's settings as they are
    at each look, since they may be replaced while the engine runs."""

    def __init__(
        self,
        *,
        uri: str,
        settings: Callable[[], VerifierConfig],
        sessions: dict[bytes, LiveSession],
        running: RunningSessions,
        events: RouterEvents,
        model_sync: ModelSync,
        kv_publisher: KVPublisher,
        tasks: BackgroundTasks,
        history: HistoryPublisher | None = None,
        lookahead: VerifierLookahead | None = None,
    ) -> None:
        self._uri = uri
        self._settings = settings
        self._sessions = sessions
        self._running = running
        self._events = events
        self._model_sync = model_sync
        self._kv_publisher = kv_publisher
        self._tasks = tasks
        self._history = history
        self._lookahead = lookahead

    def start(self) -> None:
        self._tasks.spawn(self._forget_idle_sessions())
        if self._settings().drafter_silence_s > 0 and self._events.connected:
            self._tasks.spawn(self._nudge_for_silent_drafters())

    async def forget(self, session: bytes) -> None:
        live = self._sessions.pop(session, None)
        self._running.recount()
        if live is not None:
            live.forgotten = True
            live.wake_readers()
            if live.self_decoder is not None:
                live.self_decoder.cancel()
        await self._model_sync.close(session)

    async def forget_later(self, live: LiveSession) -> None:
        """An ended or fenced session stays readable for a while, then its memory is freed; a
        finished one's output goes to the lookahead's history and the drafters' shared one first,
        in one step, so that the lookahead never reads its own session back from the MLC."""
        if self._lookahead is not None:
            self._lookahead.learn(live)
        if self._history is not None:
            self._history.ended(live)
        await asyncio.sleep(self._settings().ended_retention_s)
        if self._sessions.get(live.machine.session) is live:
            del self._sessions[live.machine.session]
            self._running.recount()

    async def _forget_idle_sessions(self) -> None:
        """Close the sessions that nothing has driven for ``idle_timeout_s``. After a takeover
        (SDCP 6.9) this verifier's copy of a session waits for proposals that now go to the new
        verifier; its commit log keeps every committed token, so forgetting it loses none."""
        while True:
            timeout = self._settings().idle_timeout_s
            await asyncio.sleep(min(timeout / 4, _IDLE_CHECK_S) if timeout > 0 else _IDLE_CHECK_S)
            if timeout <= 0:
                continue
            now = time.monotonic()
            for session, live in list(self._sessions.items()):
                machine = live.machine
                busy = live.rounds or (live.self_decoder is not None and not live.self_decoder.done())
                if machine.ended or machine.fenced or busy or now - live.driven_at < timeout:
                    continue
                if self._sessions.get(session) is not live:
                    continue
                log.info("%s: session %s idle for %.0f s, closed", self._uri, session.hex(), now - live.driven_at)
                self._kv_publisher.retire(live)
                try:
                    await self.forget(session)
                except Exception as exc:  # noqa: BLE001 - the sweep goes on for the other sessions
                    log.warning("%s: closing idle session %s failed: %r", self._uri, session.hex(), exc)

    async def _nudge_for_silent_drafters(self) -> None:
        """A session waiting for proposals that no drafter sends (a drafter that gave up, or a
        switch the router never got) is driven by nobody: after ``drafter_silence_s`` the router
        gets a switch event, on which it assigns a drafter again (SDCP 6.5.2, docs/interpretations.md)."""
        silence = self._settings().drafter_silence_s
        while True:
            await asyncio.sleep(silence / 4)
            now = time.monotonic()
            for live in list(self._sessions.values()):
                machine = live.machine
                if machine.ended or machine.fenced or machine.self_decoding or live.rounds:
                    continue
                if now - max(live.driven_at, live.nudged_at) < silence or (live.nudge and not live.nudge.done()):
                    continue
                live.nudged_at = now
                log.info(
                    "%s: session %s: no proposal for %.0f s, asking for a drafter",
                    self._uri,
                    machine.session.hex(),
                    silence,
                )
                event = Event(
                    session=machine.session,
                    epoch=machine.epoch,
                    kind=Action.SWITCH,
                    committed=machine.committed,
                    digest=machine.digest,
                )
                live.nudge = self._tasks.spawn(self._events.send(event))
