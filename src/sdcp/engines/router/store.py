"""Router sessions in the shared tier: one MLC object per session, under the routers' authority.

The object (kind ``router-session``, no scope: a router that has only a session id can find it) holds
``TrackedSession.durable`` in deterministic CBOR. Every write is conditional on the version the
writer last read (If-Match on its ETag, as the commit log's appends, SDCP 6.8), so that of two
routers that change one session, the second learns that the first did (``Superseded``) instead of
overwriting it. The object is deleted when the session ends.
"""

from __future__ import annotations

from sdcp.cache import MLC, build_uri
from sdcp.cache.errors import ObjectNotFound, PreconditionFailed
from sdcp.cache.uri import ROUTER_SESSION_KIND
from sdcp.engines.router.sessions import TrackedSession
from sdcp.protocol import codec
from sdcp.protocol.problems import BadMessage

__all__ = ["MAX_STATE_BYTES", "SessionStore", "Superseded"]

# The largest state a router loads: a session-open's worth (its prompt dominates), as on the wire.
MAX_STATE_BYTES = codec.DEFAULT_MAX_SIZE


class Superseded(Exception):
    """Another router changed the session's state since this one last read it."""


class SessionStore:
    """Each router session's durable facts in ``mlc``, written in ``router``'s name."""

    def __init__(self, mlc: MLC, router: str) -> None:
        self._mlc = mlc
        self._router = router

    def uri(self, session: bytes) -> str:
        return build_uri(self._mlc.authority, None, ROUTER_SESSION_KIND, session.hex())

    async def load(self, session: bytes) -> TrackedSession | None:
        """The session as the shared tier holds it, with the ETag of that version; None if it
        holds none (never opened by a router of this tier, or ended)."""
        try:
            data, info = await self._mlc.fetch(self.uri(session))
        except ObjectNotFound:
            return None
        tracked = TrackedSession.from_durable(codec.decode(data, max_size=MAX_STATE_BYTES))
        if tracked.session != session:
            raise BadMessage(f"the state stored for session {session.hex()} is another session's")
        tracked.etag, tracked.saved = info.etag, data
        return tracked

    async def save(self, tracked: TrackedSession, *, force: bool = False) -> None:
        """Write the session's facts on the version last read or written (a new session's without
        condition); unless ``force``, only if they changed. Raises ``Superseded``."""
        data = codec.encode(tracked.durable(self._router))
        if data == tracked.saved and not force:
            return
        try:
            info = await self._mlc.put(self.uri(tracked.session), data, if_match=tracked.etag)
        except PreconditionFailed as exc:
            raise Superseded(str(exc)) from exc
        tracked.etag, tracked.saved = info.etag, data

    async def delete(self, session: bytes) -> None:
        await self._mlc.delete(self.uri(session))
