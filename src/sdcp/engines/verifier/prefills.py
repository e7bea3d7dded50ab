"""Short prompts that wait together are prefilled together (issue 38: sixteen streams).

When sixteen streams ask their next questions at about the same time, a verifier that prefills one
prompt at a time runs sixteen prefills of a dozen or so tokens each, with the first passes of the
sessions already prefilled between them: on 2 cores about 1.6 s before the streams decode together
again, where llama-server, which puts every waiting prompt in one batch, took 0.7 s. So when the
verifier's prefill turn (one prefill at a time) comes to a short prompt (Admissions.short_tokens),
the short prompts waiting then are prefilled with it in one model call (`Target.open_sessions`), in
arrival order up to GROUP_TOKENS tokens to compute: a prompt's tokens past the prefix the target's
prefix cache holds of it when it arrives (sixteen chat questions of 40 tokens, 24 of them the
template's cached start, are one group, where counting whole prompts made two, the second a whole
prefill later). A short prompt that arrived after a long one may go before it, as short prompts go
first for the running sessions too (Admissions). A prompt whose opener went away before or during
its group's prefill is not opened (or is closed again). A group is taken once the model is ready for
it (``ready``: the pass under way, if any, has ended), so that the prompts that arrive meanwhile are
in it: the streams of a wave end over a few passes, and their next questions come in bursts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdcp.engines.errors import RequesterGone
from sdcp.models.backend import Opening, SessionId
from sdcp.models.errors import ModelError

__all__ = ["GROUP_TOKENS", "ShortPrefills"]

# The tokens one group computes at most: one llama.cpp call's batch (BATCH_TOKENS), about 1.5 s of
# prefill on 2 cores, within which the running sessions wait (Admissions.hold_s bounds each wait).
GROUP_TOKENS = 512

Prefill = Callable[[Sequence[Opening]], Awaitable[list[ModelError | None]]]
# The tokens an opening's prefill computes, as far as can be told when it arrives.
Cost = Callable[[Opening], int]
# Returns once the model could start a group's prefill now.
Ready = Callable[[], Awaitable[object]]


def _whole_prompt(opening: Opening) -> int:
    return len(opening.tokens)


async def _at_once() -> None:
    return None


@dataclass(eq=False)
class _Waiting:
    opening: Opening
    requester_gone: asyncio.Event | None
    cost: int
    done: asyncio.Future[float] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # In a group under way: its outcome comes with the group's.
    taken: bool = False
    # Its opener stopped waiting: a session opened for it is closed again.
    abandoned: bool = False


class ShortPrefills:
    """Groups of short prompts prefilled by ``prefill`` (one model call each), one group per turn
    of ``turn``, of at most ``group_tokens`` by ``cost``, taken once ``ready``; ``close`` forgets a
    session opened for an opener that went away."""

    def __init__(
        self,
        *,
        turn: asyncio.Lock,
        prefill: Prefill,
        close: Callable[[SessionId], None],
        group_tokens: int = GROUP_TOKENS,
        cost: Cost = _whole_prompt,
        ready: Ready = _at_once,
    ) -> None:
        if group_tokens < 1:
            raise ValueError(f"a group holds at least one token, got {group_tokens}")
        self._turn = turn
        self._prefill = prefill
        self._close = close
        self._group_tokens = group_tokens
        self._cost = cost
        self._ready = ready
        self._queue: deque[_Waiting] = deque()

    async def prefill(self, opening: Opening, requester_gone: asyncio.Event | None = None) -> float:
        """Open ``opening``'s session, prefilled with the short prompts waiting beside it; returns
        when (time.perf_counter) its group's prefill began. Raises its failure (ModelError), or
        RequesterGone where its opener went away before its session was open."""
        waiting = _Waiting(opening, requester_gone, self._cost(opening))
        self._queue.append(waiting)
        try:
            while not waiting.done.done():
                if waiting.taken:
                    await asyncio.wait([waiting.done])
                else:
                    await self._take_turn(waiting)
            return waiting.done.result()
        except BaseException:
            waiting.abandoned = True
            with contextlib.suppress(ValueError):
                self._queue.remove(waiting)
            if waiting.done.done() and not waiting.done.cancelled() and waiting.done.exception() is None:
                self._close(opening.session)
            raise

    async def _take_turn(self, waiting: _Waiting) -> None:
        """Wait for the turn, or for another's group to have opened ``waiting``'s session; with the
        turn, run the group at the head of the queue. The turn is held until the group's prefill
        ends, even if this opener goes away meanwhile."""
        acquire: asyncio.Future[bool] = asyncio.ensure_future(self._turn.acquire())
        either: list[asyncio.Future[Any]] = [acquire, waiting.done]
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._give_up(acquire)
            raise
        if not acquire.done() or waiting.done.done():
            self._give_up(acquire)
            return
        group = asyncio.ensure_future(self._run_when_ready())
        group.add_done_callback(lambda _: self._turn.release())
        await asyncio.shield(group)

    async def _run_when_ready(self) -> None:
        """Take the group at the head of the queue once the model is ready for it, and run it. A
        model that cannot say (its thread closed) fails the group's prefill instead."""
        with contextlib.suppress(Exception):
            await self._ready()
        await self._run(self._take_group())

    def _give_up(self, acquire: asyncio.Future[bool]) -> None:
        """Stop waiting for the turn; one granted meanwhile is handed on."""
        if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
            self._turn.release()
        else:
            acquire.cancel()

    def _take_group(self) -> list[_Waiting]:
        group: list[_Waiting] = []
        tokens = 0
        while self._queue and (not group or tokens + self._queue[0].cost <= self._group_tokens):
            waiting = self._queue.popleft()
            waiting.taken = True
            tokens += waiting.cost
            group.append(waiting)
        return group

    async def _run(self, group: list[_Waiting]) -> None:
        """Prefill the group's openings; every one of its openers still waiting learns its outcome."""
        members = [waiting for waiting in group if not waiting.abandoned and not _gone(waiting)]
        started = time.perf_counter()
        outcomes: list[Exception | None]
        try:
            try:
                outcomes = list(await self._prefill([waiting.opening for waiting in members])) if members else []
            except Exception as exc:  # noqa: BLE001 - every opener of the group learns why it failed
                outcomes = [exc] * len(members)
            for waiting, failure in zip(members, outcomes, strict=True):
                if failure is None and (waiting.abandoned or _gone(waiting)):
                    self._close(waiting.opening.session)
                elif failure is None:
                    waiting.done.set_result(started)
                elif not waiting.abandoned:
                    waiting.done.set_exception(failure)
        finally:
            for waiting in group:
                if not waiting.done.done() and not waiting.abandoned:
                    waiting.done.set_exception(_unopened(waiting))


def _gone(waiting: _Waiting) -> bool:
    return waiting.requester_gone is not None and waiting.requester_gone.is_set()


def _unopened(waiting: _Waiting) -> Exception:
    """Why a waiting opener's session was not opened, where its group gave no failure of its own."""
    session = waiting.opening.session.hex()
    if _gone(waiting):
        return RequesterGone(f"session {session}: its opener went away during its prefill")
    return ModelError(f"session {session}: its group's prefill did not complete")
