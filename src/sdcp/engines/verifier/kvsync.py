"""The target model's state of each session (its KV cache) kept at the session's committed tokens.

A round's tokens reach the model optimistically: the commit is queued on the model thread before
the commit record is appended, so the session's next pass, queued after it, never waits for the
append. Whatever fails on the way is repaired from the tokens the session's state machine holds,
which are decided whatever the model holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Sequence

from sdcp.models.backend import Target
from sdcp.models.errors import KVFormatError
from sdcp.models.kvformat import blob_committed
from sdcp.models.worker import ModelThread, ModelThreadClosed
from sdcp.protocol.verifier import VerifierSession

__all__ = ["ModelSync"]

log = logging.getLogger("sdcp.verifier")

# Tokens past a KV blob's prefix go through the target in passes of at most this many, as scored
# proposals that are then committed whole: their rows are dropped, and a pass holds one per token.
_EXTEND_TOKENS = 32


class ModelSync:
    """Brings ``target``'s sessions to their committed tokens on ``thread``, the thread that owns the
    model; ``held`` tells which sessions the verifier still holds (a dropped one is not rebuilt)."""

    def __init__(self, uri: str, target: Target, thread: ModelThread, held: Container[bytes]) -> None:
        self._uri = uri
        self._target = target
        self._thread = thread
        self._held = held

    def sync_soon(self, machine: VerifierSession, accepted: int, emitted: Sequence[int]) -> tuple[int, ...]:
        """Queue bringing the model's KV cache to the tokens committed once ``emitted`` are (the
        tokens of the rounds decided after the committed ones), by keeping ``accepted`` scored
        tokens and ``emitted``; returns those tokens, prompt included.

        Not awaited: the model thread runs queued work in order, so the session's next pass sees it.
        """
        committed = (*machine.prompt, *machine.tokens, *emitted)
        self._thread.run(self._sync, machine.session, accepted, tuple(emitted), committed)
        return committed

    def realign_after_failure(self, machine: VerifierSession) -> None:
        """After a failed round, queue rebuilding the model state from the committed tokens alone:
        it may hold decided tokens whose records were not appended. A fenced session's model state
        is closed instead."""
        if machine.fenced:
            return
        try:
            self._thread.run(self._rebuild, machine.session, (*machine.prompt, *machine.tokens))
        except ModelThreadClosed:
            return  # the node is stopping: no model state to keep

    async def drop_scored(self, machine: VerifierSession) -> None:
        """After a proposal round that failed before its commit, forget the proposal the model
        scored; a fenced session's model state is closed instead."""
        if not machine.fenced:
            await self._on_thread(self._rollback_if_held, machine.session)

    async def resume_from_kv(self, session: bytes, blob: bytes, committed: Sequence[int]) -> int:
        """Open ``session`` at the ``committed`` tokens (prompt included) from a published KV blob
        instead of a prefill (draft-li-sdcp 6.9 resume.target_kv); returns how many of them the blob
        covered. A blob of a shorter prefix is imported over that prefix and the rest is computed
        as a proposal committed whole. Raises whatever the target finds wrong with the blob (another
        model, layout or format, other tokens, a corrupt payload); the session is then not open."""
        covered = blob_committed(blob)
        if covered > len(committed):
            raise KVFormatError(f"the KV blob covers {covered} tokens, the session has committed {len(committed)}")
        await self._thread.run_async(self._import, session, blob, tuple(committed), covered)
        return covered

    async def close(self, session: bytes) -> None:
        # The KV cache of an ended session is no longer needed; its output stays readable.
        await self._on_thread(self._close_if_held, session)

    async def _on_thread(self, work: Callable[[bytes], None], session: bytes) -> None:
        """Whether the model holds the session is asked on the model thread too: the target's
        lock is held for a whole pass there, and the event loop must not wait for it (at 16
        streams a session's close held the loop for up to a pass, and every other session's
        rounds with it)."""
        try:
            await self._thread.run_async(work, session)
        except ModelThreadClosed:
            return  # the node is stopping: no model state to keep

    # -- on the model thread -----------------------------------------------------------------------

    def _sync(self, session: bytes, accepted: int, emitted: tuple[int, ...], committed: tuple[int, ...]) -> None:
        try:
            if emitted:
                self._target.commit(session, accepted, emitted)
            else:
                self._target.rollback(session)
        except Exception as exc:  # noqa: BLE001 - the model state is rebuilt from the decided tokens
            # The tokens are decided whatever the model's state: rebuild it from them.
            log.error("%s: model state of session %s rebuilt after %r", self._uri, session.hex(), exc)
            self._rebuild(session, committed)

    def _rollback_if_held(self, session: bytes) -> None:
        if self._target.has_session(session):
            self._target.rollback(session)

    def _close_if_held(self, session: bytes) -> None:
        if self._target.has_session(session):
            self._target.close_session(session)

    def _import(self, session: bytes, blob: bytes, committed: tuple[int, ...], covered: int) -> None:
        self._target.import_kv(session, blob, committed[:covered])
        try:
            for start in range(covered, len(committed), _EXTEND_TOKENS):
                chunk = committed[start : start + _EXTEND_TOKENS]
                self._target.score([(session, chunk)])
                self._target.commit(session, len(chunk), chunk)
        except BaseException:
            self._target.close_session(session)
            raise

    def _rebuild(self, session: bytes, committed: tuple[int, ...]) -> None:
        """A session the verifier has dropped meanwhile is not opened again."""
        self._close_if_held(session)
        if session in self._held:
            self._target.open_session(session, committed)
