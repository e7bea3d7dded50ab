"""A long prompt's prefill runs in steps between other sessions' passes (chunked prefill, issue #37):
running sessions keep decoding meanwhile, opens wait their turn one prefill at a time, and a prefill
whose opener went away stops at its next step, its sequence freed. A short prompt goes first: running
sessions wait for its prefill (issue #38). The first token comes from the row the prefill kept, with
no pass: the lookahead's guess waits for the pass after it (issue #38)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from tests.waiting import HANG_GUARD_S, eventually

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import LOG_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.errors import RequesterGone
from sdcp.engines.verifier import VerifierEngine
from sdcp.engines.verifier.admission import SHORT_PROMPT_TOKENS
from sdcp.engines.verifier.lookahead import VerifierLookahead
from sdcp.engines.verifier.prefills import GROUP_TOKENS
from sdcp.engines.verifier.rounds import Scoring
from sdcp.engines.verifier.selfdecode import SelfDecoding
from sdcp.frontend.client import build_contract
from sdcp.home import sdcp_home
from sdcp.models.backend import Opening
from sdcp.models.errors import ModelError
from sdcp.models.llamacpp.target import PREFILL_STEP_TOKENS, LlamaCppTarget
from sdcp.models.registry import load_target, load_tokenizer
from sdcp.models.weights.fetch import fetch_smollm2
from sdcp.protocol.messages import SelfDecodeRequest, SessionOpen

pytestmark = pytest.mark.timeout(600)

AUTHORITY = "mlc.test"
CAPACITY = 2048
LONG = 8 * PREFILL_STEP_TOKENS


def llama_target() -> LlamaCppTarget:
    target = load_target("smollm2", backend="llamacpp", kv_slots=3, kv_capacity=CAPACITY, threads=2)
    assert isinstance(target, LlamaCppTarget)
    return target


@pytest.fixture(scope="module")
def text() -> list[int]:
    fetch_smollm2(sdcp_home())
    words = " ".join(f"Step {n}: copy file {n * 3} to the archive and log its size." for n in range(200))
    tokens = list(load_tokenizer("smollm2")(words)["input_ids"])
    assert len(tokens) > LONG + 100
    return tokens


@pytest.fixture
async def engine() -> AsyncIterator[VerifierEngine]:
    mlc = MLC.from_config(authority=AUTHORITY)
    made = VerifierEngine(
        uri="https://verifier.test", settings=VerifierConfig(), target=llama_target(), mlc=mlc, ttl_ms=1000
    )
    await made.start()
    yield made
    await made.stop()
    await mlc.close()


def open_message(engine: VerifierEngine, session: bytes, prompt: list[int], max_new: int = 400) -> SessionOpen:
    contract = build_contract(
        target=engine.target.weights_digest, tokenizer=engine.target.tokenizer_digest, max_new=max_new, stop=[]
    )
    log = build_uri(AUTHORITY, None, LOG_KIND, session.hex())
    return SessionOpen(session=session, epoch=1, contract=contract, prompt=tuple(prompt), commit_log=log)


async def test_running_sessions_decode_while_a_long_prompt_prefills(engine: VerifierEngine, text: list[int]) -> None:
    running = b"r" * 16
    await engine.open_session(open_message(engine, running, text[:20]))
    await engine.self_decode(SelfDecodeRequest(session=running, epoch=1))
    machine = engine.sessions[running].machine
    await eventually(lambda: machine.committed >= 1)
    opening = asyncio.ensure_future(engine.open_session(open_message(engine, b"l" * 16, text[:LONG])))
    await eventually(lambda: engine.status().prefill_tokens == LONG)
    at_start = machine.committed
    # The long prefill takes eight steps; between them the running session's passes go on.
    await eventually(lambda: machine.committed >= at_start + 3 or opening.done())
    assert not opening.done(), "the running session did not decode during the long prefill"
    await opening
    assert engine.status().prefill_tokens == 0


async def test_a_prefill_whose_opener_went_away_stops_and_frees_its_sequence(
    engine: VerifierEngine, text: list[int]
) -> None:
    target = engine.target
    assert isinstance(target, LlamaCppTarget)
    gone = asyncio.Event()
    session = b"g" * 16
    opening = asyncio.ensure_future(engine.open_session(open_message(engine, session, text[:LONG]), gone))
    await eventually(lambda: target.has_session(session))
    gone.set()
    with pytest.raises(RequesterGone):
        await opening
    await engine.scorer.run_async(lambda: None)
    assert not target.has_session(session) and session not in engine.sessions
    assert engine.status().prefill_tokens == 0
    # Its sequence is free again: as many sessions open as before, and decode as on a fresh target.
    prompt = text[:50]
    for number in range(3):
        await engine.open_session(open_message(engine, bytes([number]) * 16, prompt))
    (rows,) = await engine.scorer.run_async(target.score, [(bytes([0]) * 16, ())])
    fresh = llama_target()
    fresh.open_session(b"f" * 16, prompt)
    (expected,) = fresh.score([(b"f" * 16, ())])
    assert np.array_equal(rows, expected)


async def test_running_sessions_wait_while_a_short_prompt_prefills(
    engine: VerifierEngine, text: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short prompts go first (sdcp.engines.verifier.admission): a self-decoding session that has
    its tokens waits before its next pass until the short prompt's prefill is done, then goes on."""
    running = b"r" * 16
    await engine.open_session(open_message(engine, running, text[:20]))
    await engine.self_decode(SelfDecodeRequest(session=running, epoch=1))
    machine = engine.sessions[running].machine
    await eventually(lambda: machine.committed >= 1)
    admissions = engine.admissions
    # Only the prefill's end may release the running session here, not the hold's bound.
    monkeypatch.setattr(engine, "settings", replace(engine.settings, admission_hold_ms=3.6e6))
    waiting: list[asyncio.Future[None]] = []
    hold = admissions.held

    async def watched_hold() -> None:
        waiting.append(asyncio.get_running_loop().create_future())
        try:
            await hold()
        finally:
            waiting[-1].set_result(None)

    monkeypatch.setattr(admissions, "held", watched_hold)
    # The short prompt's prefill stops before its first step until the test lets it go on.
    gate = threading.Event()
    steps = engine.target.open_session_steps

    def gated_steps(*args: object, **kwargs: object) -> Iterator[int]:
        for left in steps(*args, **kwargs):  # type: ignore[arg-type]
            assert gate.wait(HANG_GUARD_S)
            yield left

    monkeypatch.setattr(engine.target, "open_session_steps", gated_steps)
    short = text[: SHORT_PROMPT_TOKENS - 10]
    opening = asyncio.ensure_future(engine.open_session(open_message(engine, b"s" * 16, short)))
    await eventually(lambda: engine.status().prefill_tokens == len(short))
    assert admissions.first
    await eventually(lambda: bool(waiting))
    assert not waiting[0].done(), "the running session went on while the short prompt waited"
    held_at = machine.committed
    gate.set()
    await opening
    await asyncio.wait_for(waiting[0], HANG_GUARD_S)
    await eventually(lambda: machine.committed > held_at)
    assert not admissions.first and engine.status().prefill_tokens == 0


async def test_short_prompts_are_grouped_by_the_tokens_they_compute(
    text: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short prompts that wait together are prefilled in one group up to GROUP_TOKENS tokens to
    compute, their starts that the prefix cache holds left out: three prompts of 240 tokens (720 in
    all) that share a cached 224-token start are one group, not two."""
    mlc = MLC.from_config(authority=AUTHORITY)
    target = load_target(
        "smollm2", backend="llamacpp", kv_slots=4, kv_capacity=CAPACITY, threads=2, prefix_cache_bytes=1 << 28
    )
    engine = VerifierEngine(uri="https://verifier.test", settings=VerifierConfig(), target=target, mlc=mlc, ttl_ms=1000)
    await engine.start()
    try:
        start = text[:224]
        await engine.scorer.run_async(target.open_session, b"c" * 16, [*start, text[300]])
        await engine.scorer.run_async(target.close_session, b"c" * 16)
        prompts = [[*start, *text[400 + 16 * n : 416 + 16 * n]] for n in range(3)]
        assert 3 * len(prompts[0]) > GROUP_TOKENS and all(len(p) <= SHORT_PROMPT_TOKENS for p in prompts)
        groups: list[int] = []
        opened = target.open_sessions

        def recorded(openings: Sequence[Opening]) -> list[ModelError | None]:
            groups.append(len(openings))
            return opened(openings)

        monkeypatch.setattr(target, "open_sessions", recorded)
        # The three wait together for the prefill turn, which the test holds.
        async with engine._prefill_turn:
            opens = [
                asyncio.ensure_future(engine.open_session(open_message(engine, bytes([n]) * 16, prompt)))
                for n, prompt in enumerate(prompts)
            ]
            await eventually(lambda: engine.status().prefill_tokens == sum(map(len, prompts)))
        await asyncio.gather(*opens)
        assert groups == [3]
    finally:
        await engine.stop()
        await mlc.close()


async def test_the_first_token_takes_the_kept_row_and_a_guess_waits_for_the_next_pass(
    engine: VerifierEngine, text: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt asked again, its earlier answer in the lookahead's history and every class of
    match counted as always right (so that a guess pays whatever the hit rates learned so far): the
    lookahead predicts the earlier answer from the first token on, but the first request after the
    prefill scores no guess (the row the prefill kept answers it, no pass: a guess would make the
    first token wait for one); the guess goes with a later pass, and the answer is the earlier one."""
    asked: dict[bytes, list[tuple[int, ...]]] = {}
    predicted: dict[bytes, list[tuple[int, ...]]] = {}
    learned = asyncio.Event()
    submit_ahead, predict, learn = Scoring.submit_ahead, SelfDecoding._predict, VerifierLookahead.learn

    def recorded(self: Scoring, live: Any, tokens: tuple[int, ...], *args: Any) -> Any:
        asked.setdefault(live.machine.session, []).append(tokens)
        return submit_ahead(self, live, tokens, *args)

    def recorded_prediction(self: SelfDecoding, live: Any, context: tuple[int, ...]) -> Any:
        answer = predict(self, live, context)
        predicted.setdefault(live.machine.session, []).append(answer.guess)
        return answer

    def learned_once(self: VerifierLookahead, live: Any) -> None:
        learn(self, live)
        learned.set()

    monkeypatch.setattr(Scoring, "submit_ahead", recorded)
    monkeypatch.setattr(SelfDecoding, "_predict", recorded_prediction)
    monkeypatch.setattr(VerifierLookahead, "learn", learned_once)
    monkeypatch.setattr(VerifierLookahead, "_rate", lambda self, scope, match: 1.0)
    prompt = text[:40]
    outputs = []
    for session in (b"a" * 16, b"b" * 16):
        await engine.open_session(open_message(engine, session, prompt, max_new=32))
        await engine.self_decode(SelfDecodeRequest(session=session, epoch=1))
        machine = engine.sessions[session].machine
        await eventually(lambda machine=machine: machine.ended)
        outputs.append(machine.tokens)
        await asyncio.wait_for(learned.wait(), HANG_GUARD_S)
    assert outputs[1] == outputs[0]
    again = asked[b"b" * 16]
    assert predicted[b"b" * 16][0]
    assert again[0] == ()
    assert any(again[1:])
