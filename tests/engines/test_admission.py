"""Admissions (sdcp.engines.verifier.admission): running sessions wait while short prompts wait
for their prefill, not while a long one does, and never longer than the hold."""

from __future__ import annotations

import asyncio

import pytest

from sdcp.engines.verifier.admission import Admissions


async def test_running_sessions_wait_until_the_short_prompts_are_in() -> None:
    admissions = Admissions(lambda: 3600, short_tokens=100)
    assert not admissions.first
    await admissions.held()  # nothing waits: no wait
    with admissions.prefilling(40):
        assert admissions.first and admissions.tokens == 40
        held = asyncio.ensure_future(admissions.held())
        with admissions.prefilling(60):
            await asyncio.sleep(0)
            assert not held.done() and admissions.tokens == 100
        await asyncio.sleep(0)
        assert not held.done(), "a short prompt still waits"
    await asyncio.wait_for(held, 60)
    assert not admissions.first and admissions.tokens == 0


async def test_a_long_prompt_lets_running_sessions_go_on() -> None:
    admissions = Admissions(lambda: 3600, short_tokens=100)
    with admissions.prefilling(10):
        held = asyncio.ensure_future(admissions.held())
        await asyncio.sleep(0)
        assert not held.done()
        with admissions.prefilling(101):
            # Prefilled in steps between the running sessions' passes (issue 37).
            assert not admissions.first
            await asyncio.wait_for(held, 60)
            await admissions.held()
        assert admissions.first
    assert admissions.tokens == 0


async def test_the_hold_is_bounded() -> None:
    admissions = Admissions(lambda: 0.01)
    with admissions.prefilling(1):
        # A flood of short prompts never stops a running session for longer than the hold.
        await asyncio.wait_for(admissions.held(), 60)
        assert admissions.first


async def test_a_failed_prefill_leaves_the_count() -> None:
    admissions = Admissions(lambda: 1.0)
    with pytest.raises(RuntimeError), admissions.prefilling(5):
        raise RuntimeError("the prefill failed")
    assert not admissions.first and admissions.tokens == 0


async def test_a_hold_of_zero_turns_it_off() -> None:
    hold = [0.0]
    admissions = Admissions(lambda: hold[0])
    with admissions.prefilling(1):
        assert not admissions.first
        await asyncio.wait_for(admissions.held(), 60)
        hold[0] = 3600.0  # the verifier's settings changed: read at each wait
        assert admissions.first


def test_a_negative_short_prompt_length_is_refused() -> None:
    with pytest.raises(ValueError, match="short_tokens"):
        Admissions(lambda: 1.0, short_tokens=-1)
