"""Short prompts that wait for the verifier's prefill turn together are prefilled together
(sdcp.engines.verifier.prefills), without a model: the prefill is a function the test controls."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from tests.waiting import eventually

from sdcp.engines.errors import RequesterGone
from sdcp.engines.verifier.prefills import ShortPrefills
from sdcp.models.backend import Opening
from sdcp.models.errors import BadTokens, ModelError

pytestmark = pytest.mark.timeout(60)


class Model:
    """Prefills that finish when the test says so; records each group and each close."""

    def __init__(self) -> None:
        self.groups: list[list[bytes]] = []
        self.closed: list[bytes] = []
        self.release = asyncio.Event()
        self.failing: set[bytes] = set()
        self.broken: Exception | None = None

    async def prefill(self, openings: Sequence[Opening]) -> list[ModelError | None]:
        self.groups.append([opening.session for opening in openings])
        await self.release.wait()
        if self.broken is not None:
            raise self.broken
        return [BadTokens("bad") if opening.session in self.failing else None for opening in openings]

    def close(self, session: bytes) -> None:
        self.closed.append(session)


def opening(name: str, tokens: int = 10) -> Opening:
    return Opening(name.encode(), tuple(range(tokens)))


async def under_way(model: Model, turn: asyncio.Lock, **limits: int) -> tuple[ShortPrefills, asyncio.Task[float]]:
    """Prefills whose first group, a's alone, runs until the test releases the model."""
    prefills = ShortPrefills(turn=turn, prefill=model.prefill, close=model.close, **limits)
    running = asyncio.create_task(prefills.prefill(opening("a")))
    await eventually(lambda: model.groups == [[b"a"]])
    return prefills, running


async def test_prompts_that_wait_together_are_prefilled_in_one_group() -> None:
    model = Model()
    turn = asyncio.Lock()
    prefills, first = await under_way(model, turn, group_tokens=30)
    # While a's prefill runs, four more arrive: the next turn takes as many as 30 tokens hold.
    rest = [asyncio.create_task(prefills.prefill(opening(name))) for name in "bcde"]
    await asyncio.sleep(0)
    model.release.set()
    await asyncio.gather(first, *rest)
    assert model.groups == [[b"a"], [b"b", b"c", b"d"], [b"e"]]
    assert not turn.locked() and model.closed == []


async def test_a_group_is_bounded_by_the_tokens_its_prefill_computes() -> None:
    """A prompt whose start the prefix cache holds costs its group only the rest (ShortPrefills'
    ``cost``): four prompts of 10 tokens, 6 of them cached, are one group within 30 tokens."""
    model = Model()
    turn = asyncio.Lock()
    prefills = ShortPrefills(
        turn=turn, prefill=model.prefill, close=model.close, group_tokens=30, cost=lambda o: len(o.tokens) - 6
    )
    first = asyncio.create_task(prefills.prefill(opening("a")))
    await eventually(lambda: model.groups == [[b"a"]])
    rest = [asyncio.create_task(prefills.prefill(opening(name))) for name in "bcde"]
    await asyncio.sleep(0)
    model.release.set()
    await asyncio.gather(first, *rest)
    assert model.groups == [[b"a"], [b"b", b"c", b"d", b"e"]]


async def test_a_group_is_taken_once_the_model_is_ready_for_it() -> None:
    """The prompts that arrive while the model ends the pass under way (``ready``) are in the group
    of the one whose turn it is, not in the next."""
    model = Model()
    model.release.set()
    ready = asyncio.Event()

    async def model_ready() -> None:
        await ready.wait()

    prefills = ShortPrefills(turn=asyncio.Lock(), prefill=model.prefill, close=model.close, ready=model_ready)
    first = asyncio.create_task(prefills.prefill(opening("a")))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(prefills.prefill(opening(name))) for name in "bc"]
    await asyncio.sleep(0)
    assert model.groups == []
    ready.set()
    await asyncio.gather(first, *rest)
    assert model.groups == [[b"a", b"b", b"c"]]


async def test_an_opener_whose_group_ran_returns_while_a_long_prefill_holds_the_turn() -> None:
    model = Model()
    turn = asyncio.Lock()
    prefills, holder = await under_way(model, turn)
    long_done = asyncio.Event()
    long_started = asyncio.Event()

    async def long_prefill() -> None:
        async with turn:
            long_started.set()
            await long_done.wait()

    # Waiting for the turn in this order: b, then a long prompt's steps, then c.
    second = asyncio.create_task(prefills.prefill(opening("b")))
    await asyncio.sleep(0)
    long = asyncio.create_task(long_prefill())
    await asyncio.sleep(0)
    third = asyncio.create_task(prefills.prefill(opening("c")))
    await asyncio.sleep(0)
    model.release.set()
    await asyncio.gather(holder, second)
    # b's turn prefilled c with it: c needs no turn of its own, and does not wait for the long one.
    await third
    await long_started.wait()
    assert not long.done()
    assert model.groups == [[b"a"], [b"b", b"c"]]
    long_done.set()
    await long
    assert not turn.locked()


async def test_a_failure_stays_with_its_opening_and_a_broken_model_fails_the_group() -> None:
    model = Model()
    prefills = ShortPrefills(turn=asyncio.Lock(), prefill=model.prefill, close=model.close)
    model.failing.add(b"bad")
    model.release.set()
    good, bad = await asyncio.gather(
        prefills.prefill(opening("good")), prefills.prefill(opening("bad")), return_exceptions=True
    )
    assert isinstance(good, float) and isinstance(bad, BadTokens)
    model.broken = RuntimeError("the model thread died")
    outcomes = await asyncio.gather(
        prefills.prefill(opening("x")), prefills.prefill(opening("y")), return_exceptions=True
    )
    assert all(outcome is model.broken for outcome in outcomes)
    assert model.groups[-1] == [b"x", b"y"]


async def test_an_opener_that_goes_away_is_not_prefilled_or_its_session_is_closed() -> None:
    model = Model()
    turn = asyncio.Lock()
    prefills, running = await under_way(model, turn)
    gone = asyncio.Event()
    left = asyncio.create_task(prefills.prefill(opening("left"), gone))
    cancelled = asyncio.create_task(prefills.prefill(opening("cancelled")))
    stays = asyncio.create_task(prefills.prefill(opening("stays")))
    await asyncio.sleep(0)
    gone.set()  # before its group begins: never prefilled
    cancelled.cancel()  # before its group begins: taken out of the queue
    model.release.set()
    await running
    assert await stays > 0
    with pytest.raises(RequesterGone):
        await left
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert model.groups == [[b"a"], [b"stays"]]
    # An opener that goes away while its group runs: its session, opened, is closed again.
    model.release.clear()
    going = asyncio.create_task(prefills.prefill(opening("going")))
    other = asyncio.create_task(prefills.prefill(opening("other")))
    await eventually(lambda: model.groups[-1] == [b"going", b"other"])
    going.cancel()
    await asyncio.sleep(0)
    # The opener that held the turn went away: the turn stays held until its group's prefill ends.
    assert turn.locked()
    model.release.set()
    assert await other > 0
    with pytest.raises(asyncio.CancelledError):
        await going
    await eventually(lambda: model.closed == [b"going"])
    assert not turn.locked()
    # A requester that goes away during its group's prefill: its session is closed, it learns why.
    model.release.clear()
    leaving = asyncio.Event()
    leaves = asyncio.create_task(prefills.prefill(opening("leaves"), leaving))
    await eventually(lambda: model.groups[-1] == [b"leaves"])
    leaving.set()
    model.release.set()
    with pytest.raises(RequesterGone):
        await leaves
    assert model.closed == [b"going", b"leaves"] and not turn.locked()
