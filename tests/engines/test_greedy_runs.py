"""Greedy runs (issue 38, "Add nothing per token"): under rule 1 the scorer feeds each session's
most probable token itself and goes on with its next pass, the loop deciding the rounds in groups,
as long as one pass holds every active session; with more sessions than a pass holds, runs would
keep the waiting sessions out of the passes, and none starts. A run lasts to max_new or the end of
the self-decoding period (self_max), whichever comes first."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.engines.verifier_pair import AUTHORITY, PROMPT, decode, greedy_decoding, self_decoding_contract

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import LOG_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.verifier import VerifierEngine
from sdcp.engines.verifier.rounds import Scoring
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.router import RouterSession

pytestmark = pytest.mark.timeout(180)

SESSIONS = 6
MAX_NEW = 24


async def _runs_asked(
    tiny_loaded: LoadedModel,
    monkeypatch: pytest.MonkeyPatch,
    *,
    sessions: int,
    max_batch: int = 16,
    max_new: int = MAX_NEW,
    self_max: int = MAX_NEW,
) -> list[tuple[bytes, int]]:
    """``sessions`` sessions open, then decoded alone at once by a verifier whose passes hold
    ``max_batch`` sessions; per greedy run asked for, its session and the tokens its first pass and
    its steps decide (the pass's guess, its own token and the run's steps). Each output is the
    target's greedy decoding whatever the passes were."""
    asked: list[tuple[bytes, int]] = []
    submit_ahead = Scoring.submit_ahead

    def counted(self: Scoring, live: Any, tokens: tuple[int, ...], steps: int, *args: Any) -> Any:
        asked.append((live.machine.session, len(tokens) + 1 + steps))
        return submit_ahead(self, live, tokens, steps, *args)

    monkeypatch.setattr(Scoring, "submit_ahead", counted)
    mlc = MLC.from_config(authority=AUTHORITY)
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    engine = VerifierEngine(
        uri="https://verifier1.test", settings=VerifierConfig(max_batch=max_batch), target=target, mlc=mlc, ttl_ms=1000
    )
    await engine.start()
    try:
        opened = [bytes([index]) * 16 for index in range(sessions)]
        for session in opened:
            plan = RouterSession(
                session=session,
                epoch=1,
                contract=self_decoding_contract(target, 1, max_new=max_new, self_max=self_max),
                prompt=PROMPT,
                commit_log=build_uri(AUTHORITY, None, LOG_KIND, session.hex()),
                verifier=engine.uri,
            )
            await engine.open_session(plan.open_message())

        await asyncio.gather(*(decode(engine, 1, max_new, session) for session in opened))
        outputs = [tuple(engine.sessions[session].machine.tokens) for session in opened]
    finally:
        await engine.stop()
        await mlc.close()
    greedy = greedy_decoding(tiny_loaded, max_new)
    assert all(output == greedy for output in outputs)
    return asked


async def test_sessions_that_one_pass_holds_run_ahead(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = await _runs_asked(tiny_loaded, monkeypatch, sessions=SESSIONS)
    assert len({session for session, _ in asked}) == SESSIONS


async def test_more_sessions_than_a_pass_holds_do_not_run_ahead(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not await _runs_asked(tiny_loaded, monkeypatch, sessions=SESSIONS, max_batch=SESSIONS - 1)


async def test_a_run_lasts_to_max_new(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = await _runs_asked(tiny_loaded, monkeypatch, sessions=1, max_new=48, self_max=100)
    assert asked[0][1] == 48


async def test_a_run_ends_with_its_self_decoding_period(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = await _runs_asked(tiny_loaded, monkeypatch, sessions=1, max_new=48, self_max=40)
    assert asked[0][1] == 40
