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


async def _decode_together(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, max_batch: int) -> set[bytes]:
    """Six sessions open, then decoded alone at once by a verifier whose passes hold ``max_batch``
    sessions; the sessions whose passes went on as greedy runs. Each output is the target's greedy
    decoding whatever the passes were."""
    runs: set[bytes] = set()
    submit_ahead = Scoring.submit_ahead

    def counted(self: Scoring, live: Any, *args: Any) -> Any:
        runs.add(live.machine.session)
        return submit_ahead(self, live, *args)

    monkeypatch.setattr(Scoring, "submit_ahead", counted)
    mlc = MLC.from_config(authority=AUTHORITY)
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    engine = VerifierEngine(
        uri="https://verifier1.test", settings=VerifierConfig(max_batch=max_batch), target=target, mlc=mlc, ttl_ms=1000
    )
    await engine.start()
    try:
        sessions = [bytes([index]) * 16 for index in range(SESSIONS)]
        for session in sessions:
            plan = RouterSession(
                session=session,
                epoch=1,
                contract=self_decoding_contract(target, 1, max_new=MAX_NEW, self_max=MAX_NEW),
                prompt=PROMPT,
                commit_log=build_uri(AUTHORITY, None, LOG_KIND, session.hex()),
                verifier=engine.uri,
            )
            await engine.open_session(plan.open_message())

        await asyncio.gather(*(decode(engine, 1, MAX_NEW, session) for session in sessions))
        outputs = [tuple(engine.sessions[session].machine.tokens) for session in sessions]
    finally:
        await engine.stop()
        await mlc.close()
    greedy = greedy_decoding(tiny_loaded, MAX_NEW)
    assert all(output == greedy for output in outputs)
    return runs


async def test_sessions_that_one_pass_holds_run_ahead(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(await _decode_together(tiny_loaded, monkeypatch, max_batch=16)) == SESSIONS


async def test_more_sessions_than_a_pass_holds_do_not_run_ahead(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not await _decode_together(tiny_loaded, monkeypatch, max_batch=SESSIONS - 1)


async def _first_run(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, *, max_new: int, self_max: int) -> int:
    """The tokens that the first pass of a lone session's self-decoding period and the greedy run
    after it decide (its guess, its own token and the run's steps); the output stays the target's
    greedy decoding."""
    asked: list[int] = []
    submit_ahead = Scoring.submit_ahead

    def counted(self: Scoring, live: Any, tokens: tuple[int, ...], steps: int, *args: Any) -> Any:
        asked.append(len(tokens) + 1 + steps)
        return submit_ahead(self, live, tokens, steps, *args)

    monkeypatch.setattr(Scoring, "submit_ahead", counted)
    mlc = MLC.from_config(authority=AUTHORITY)
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    engine = VerifierEngine(
        uri="https://verifier1.test", settings=VerifierConfig(), target=target, mlc=mlc, ttl_ms=1000
    )
    await engine.start()
    session = bytes(16)
    try:
        plan = RouterSession(
            session=session,
            epoch=1,
            contract=self_decoding_contract(target, 1, max_new=max_new, self_max=self_max),
            prompt=PROMPT,
            commit_log=build_uri(AUTHORITY, None, LOG_KIND, session.hex()),
            verifier=engine.uri,
        )
        await engine.open_session(plan.open_message())
        await decode(engine, 1, max_new, session)
        output = tuple(engine.sessions[session].machine.tokens)
    finally:
        await engine.stop()
        await mlc.close()
    assert output == greedy_decoding(tiny_loaded, max_new)
    return asked[0]


async def test_a_run_lasts_to_max_new(tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    assert await _first_run(tiny_loaded, monkeypatch, max_new=48, self_max=100) == 48


async def test_a_run_ends_with_its_self_decoding_period(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert await _first_run(tiny_loaded, monkeypatch, max_new=48, self_max=40) == 40
