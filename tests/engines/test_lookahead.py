"""VerifierLookahead: self-decoding's guesses from the session's own tokens and from the outputs of
sessions that finished on this verifier or were published to the MLC by another (read with the
drafters' HistoryReader), kept apart per contract and owner."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.waiting import eventually, eventually_async

from sdcp.cache import MLC, build_uri
from sdcp.config import VerifierConfig
from sdcp.engines.history import HistoryReader, history_scope_key, index_uri, publish_output
from sdcp.engines.verifier import VerifierEngine
from sdcp.engines.verifier.live import LiveSession
from sdcp.engines.verifier.lookahead import LOOKAHEAD_PRIOR_HIT_RATE, Prediction, VerifierLookahead
from sdcp.models.backend import Target
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.messages import Action, Contract, SelfDecodeRequest, SessionOpen
from sdcp.protocol.passcost import FIRST_CURVE_MS
from sdcp.protocol.verifier import VerifierSession

pytestmark = pytest.mark.timeout(120)

VOCAB = 1000

PROMPT = (1, 2, 3)
ANSWER = (40, 41, 42, 43, 44, 45, 46, 47)
OWNER = "https://a.test"
# The prompt of the sessions the tests decode on a verifier engine.
ENGINE_PROMPT = tuple(range(10, 30))


def _contract(target: bytes = b"\x01" * 32) -> Contract:
    return Contract.from_obj(
        {
            "target": target,
            "tokenizer": b"\x02" * 32,
            "rule": 1,
            "m_max": 4,
            "max_new": 64,
            "stop": [],
            "low_rounds": 2,
            "fallback": [Action.REDUCE, Action.FAIL],
        }
    )


def _live(
    tokens: tuple[int, ...] = (),
    *,
    owner: str | None = OWNER,
    contract: Contract | None = None,
    session: bytes = bytes(16),
) -> LiveSession:
    machine = VerifierSession(session=session, epoch=1, contract=contract or _contract(), prompt=PROMPT)
    machine.tokens.extend(tokens)
    return LiveSession(machine=machine, log=None, etag="", terms=b"", owner=owner)  # type: ignore[arg-type]


def _context(live: LiveSession) -> tuple[int, ...]:
    return (*live.machine.prompt, *live.machine.tokens)


def test_a_session_that_repeats_itself_is_predicted_from_its_own_tokens() -> None:
    lookahead = VerifierLookahead()
    live = _live((*ANSWER, 9, 40, 41))
    assert lookahead.predict(live, _context(live), 4).tokens == (42, 43, 44, 45)
    live.machine.tokens.extend((42, 43))
    assert lookahead.predict(live, _context(live), 16).tokens == (44, 45, 46, 47, 9, 40, 41, 42, 43)


def test_a_finished_sessions_output_predicts_a_later_session_of_the_same_owner_only() -> None:
    lookahead = VerifierLookahead()
    finished = _live(ANSWER)
    finished.machine.control.finish()
    lookahead.learn(finished)
    # Its prompt's tail goes before it: a request sent again matches from its first token.
    assert lookahead.history.size.sessions == 1 and lookahead.history.size.tokens == len(PROMPT) + len(ANSWER)

    later = _live((5, 40, 41))
    assert lookahead.predict(later, _context(later), 3).tokens == (42, 43, 44)
    other_owner = _live((5, 40, 41), owner="https://b.test")
    assert lookahead.predict(other_owner, _context(other_owner), 3).tokens == ()
    other_target = _live((5, 40, 41), contract=_contract(b"\x03" * 32))
    assert lookahead.predict(other_target, _context(other_target), 3).tokens == ()


def test_a_failed_session_is_not_learned() -> None:
    lookahead = VerifierLookahead()
    failed = _live(ANSWER)
    failed.machine.control.fail()
    lookahead.learn(failed)
    assert lookahead.history.size.sessions == 0


def test_the_history_is_bounded_oldest_first() -> None:
    entry = len(PROMPT) + len(ANSWER)
    lookahead = VerifierLookahead(history_tokens=2 * entry)
    for first in (100, 200, 300):
        finished = _live(tuple(range(first, first + len(ANSWER))))
        finished.machine.control.finish()
        lookahead.learn(finished)
    assert lookahead.history.size.sessions == 2 and lookahead.history.size.tokens == 2 * entry
    oldest, newest = _live((100, 101)), _live((300, 301))
    assert lookahead.predict(oldest, _context(oldest), 2).tokens == ()
    assert lookahead.predict(newest, _context(newest), 2).tokens == (302, 303)


@pytest.fixture
async def mlcs(tmp_path: Path) -> AsyncIterator[tuple[MLC, MLC]]:
    """Two MLC instances over one shared directory: two verifiers' hosts."""
    first = MLC.from_config(authority="local", disk_dir=tmp_path / "mlc")
    second = MLC.from_config(authority="local", disk_dir=tmp_path / "mlc")
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


async def _publish(mlc: MLC, live: LiveSession) -> None:
    """What a verifier publishes at a finished session's end (sdcp.engines.verifier.history)."""
    machine = live.machine
    await publish_output(
        mlc,
        contract=machine.contract,
        key=history_scope_key(machine.contract, live.owner, "owner"),
        session=machine.session,
        epoch=machine.epoch,
        output=machine.tokens,
        keep=256,
    )


def _reading(mlc: MLC, refresh_s: float = 0.0) -> VerifierLookahead:
    return VerifierLookahead(reader=HistoryReader(mlc, entries=256, refresh_s=refresh_s), vocab_size=VOCAB)


async def test_a_second_verifier_guesses_from_the_outputs_another_published(mlcs: tuple[MLC, MLC]) -> None:
    first, second = mlcs
    finished = _live(ANSWER, session=os.urandom(16))
    finished.machine.control.finish()
    await _publish(first, finished)
    # Another tenant's output, and one with a token this target does not have.
    elsewhere = _live(tuple(range(60, 68)), owner="https://b.test", session=os.urandom(16))
    elsewhere.machine.control.finish()
    await _publish(first, elsewhere)
    foreign = _live((5, 40, 41, VOCAB), session=os.urandom(16))
    foreign.machine.control.finish()
    await _publish(first, foreign)

    lookahead = _reading(second)
    later = _live((5, 40, 41))
    assert lookahead.predict(later, _context(later), 3).tokens == ()
    await lookahead.refresh(later.machine.contract, later.owner)
    assert lookahead.predict(later, _context(later), 3).tokens == (42, 43, 44)
    assert lookahead.history.size.sessions == 1
    other_owner = _live((5, 60, 61), owner="https://b.test")
    assert lookahead.predict(other_owner, _context(other_owner), 2).tokens == ()


async def test_a_session_that_finished_here_is_not_read_back(mlcs: tuple[MLC, MLC]) -> None:
    mlc, _ = mlcs
    lookahead = _reading(mlc)
    finished = _live(ANSWER, session=os.urandom(16))
    finished.machine.control.finish()
    lookahead.learn(finished)
    await _publish(mlc, finished)
    await lookahead.refresh(finished.machine.contract, finished.owner)
    assert lookahead.history.size.sessions == 1
    # Another verifier's publication of the scope is read.
    other = _live(tuple(range(50, 58)), session=os.urandom(16))
    other.machine.control.finish()
    await _publish(mlc, other)
    await lookahead.refresh(other.machine.contract, other.owner)
    assert lookahead.history.size.sessions == 2


async def test_a_restarted_verifier_engine_reads_its_scopes_history_when_a_session_opens(
    mlcs: tuple[MLC, MLC], tiny_loaded: LoadedModel
) -> None:
    """Sessions finish on one verifier engine, which publishes them; a new engine on another host
    reads the scope's history at a session's open and guesses its continuation from it."""
    first_mlc, second_mlc = mlcs
    first = await _started_engine("https://verifier-1.test", tiny_loaded, first_mlc)
    contract = _self_decoding_contract(first.target, 24)
    try:
        answer = await _self_decode_to_the_end(first, first_mlc, contract, ENGINE_PROMPT, OWNER)
        published = index_uri("local", contract, history_scope_key(contract, OWNER, "owner"))
        await eventually_async(lambda: first_mlc.exists(published))
    finally:
        await first.stop()

    second = await _started_engine("https://verifier-2.test", tiny_loaded, second_mlc)
    try:
        # A later turn quoting the earlier answer's start.
        quoting = (*ENGINE_PROMPT, *answer[:6])
        session = await _open(second, contract, quoting, OWNER)
        await eventually(lambda: second.lookahead.history.size.sessions == 1)
        live = second.sessions[session]
        assert second.lookahead.predict(live, quoting, 8).tokens == tuple(answer[6:14])
    finally:
        await second.stop()


async def _started_engine(uri: str, loaded: LoadedModel, mlc: MLC) -> VerifierEngine:
    target = TargetModel(loaded.model, loaded.tokenizer, name="tiny")
    engine = VerifierEngine(uri=uri, settings=VerifierConfig(), target=target, mlc=mlc, ttl_ms=1000)
    await engine.start()
    return engine


def _self_decoding_contract(target: Target, max_new: int) -> Contract:
    """A contract under rule 1 that the verifier self-decodes from its open to its end."""
    return Contract.from_obj(
        {
            "target": target.weights_digest,
            "tokenizer": target.tokenizer_digest,
            "rule": 1,
            "m_max": 4,
            "max_new": max_new,
            "stop": [],
            "low_rounds": 1000,
            "fallback": [Action.REDUCE],
            "self_load": 100,
        }
    )


async def _open(engine: VerifierEngine, contract: Contract, prompt: tuple[int, ...], owner: str) -> bytes:
    session = os.urandom(16)
    log = build_uri("local", None, "log", session.hex())
    opened = SessionOpen(session=session, epoch=1, contract=contract, prompt=prompt, commit_log=log, owner=owner)
    await engine.open_session(opened)
    return session


async def _self_decode_to_the_end(
    engine: VerifierEngine, mlc: MLC, contract: Contract, prompt: tuple[int, ...], owner: str
) -> list[int]:
    session = await _open(engine, contract, prompt, owner)
    await engine.self_decode(SelfDecodeRequest(session=session, epoch=1))
    tokens: list[int] = []
    while True:
        output = await engine.output(session, len(tokens))
        tokens.extend(output.tokens)
        if output.final:
            return tokens


def _judged(lookahead: VerifierLookahead, prediction: Prediction, decided: list[int]) -> float:
    """The hit rate of the prediction's class after judging it against ``decided`` (a list, as the
    rounds' tokens come)."""
    lookahead.judge(prediction, decided)
    return lookahead.hit_rate(prediction)


def test_the_lookahead_is_judged_by_every_token_it_predicted_not_its_first() -> None:
    # A prediction right at its first token only, pass after pass, is a weak one: scoring its
    # tokens would waste rows (speculation_length reads the per-token hit rate).
    lookahead = VerifierLookahead()
    first_only = Prediction((1, 2, 3, 4, 5, 6, 7, 8), (True, 3), b"first only")
    for _ in range(12):
        lookahead.judge(first_only, [1, 9])
    assert lookahead.hit_rate(first_only) == pytest.approx(0.5, abs=0.05)
    whole = Prediction((1, 2, 3, 4), (True, 3), b"whole")
    for _ in range(12):
        lookahead.judge(whole, [1, 2, 3, 4, 5])
    assert lookahead.hit_rate(whole) > 0.99
    # What the rounds did not decide yet is not judged: a one-token decision that matched says
    # nothing about the prediction's second token.
    unjudged = Prediction((1, 2, 3), (True, 3), b"unjudged")
    before = lookahead.hit_rate(unjudged)
    after_hit = _judged(lookahead, unjudged, [1])
    assert after_hit > before
    assert _judged(lookahead, Prediction((), (True, 3), b"unjudged"), [1]) == after_hit
    assert _judged(lookahead, Prediction((7,), (True, 3), b"unjudged"), [1]) < after_hit


def test_hit_rates_are_kept_per_class_of_match_and_per_scope() -> None:
    """An earlier answer that a long match leads back to says more than two tokens that occurred
    elsewhere: each class of match learns its own hit rate, and one scope's never moves another's."""
    lookahead = VerifierLookahead()
    long_match = Prediction((1, 2, 3, 4), (True, 6), b"a")
    for _ in range(4):
        lookahead.judge(long_match, [1, 2, 3, 4])
    assert lookahead.hit_rate(long_match) > 0.9
    assert lookahead.hit_rate(Prediction((1,), (True, 2), b"a")) == LOOKAHEAD_PRIOR_HIT_RATE
    assert lookahead.hit_rate(Prediction((1,), (False, 6), b"a")) == LOOKAHEAD_PRIOR_HIT_RATE
    assert lookahead.hit_rate(Prediction((1,), (True, 6), b"b")) == LOOKAHEAD_PRIOR_HIT_RATE
    assert lookahead.hit_rate(Prediction()) == 0.0


def test_a_prediction_names_the_class_of_its_match() -> None:
    lookahead = VerifierLookahead()
    finished = _live(ANSWER)
    finished.machine.control.finish()
    lookahead.learn(finished)
    # The last five tokens of the context occurred in the history only: a match of 5 (2 ** 2 < 5 < 2 ** 3).
    later = _live((5, 40, 41, 42, 43, 44))
    prediction = lookahead.predict(later, _context(later), 2)
    assert prediction.tokens == (45, 46) and prediction.match == (True, 3)
    assert prediction.hit_rate == LOOKAHEAD_PRIOR_HIT_RATE
    # The session repeating itself: the match in its own tokens.
    repeating = _live((*ANSWER, 9, 40, 41))
    assert lookahead.predict(repeating, _context(repeating), 1).match == (False, 2)
    # How far the walk goes is the limit's answer to the class's hit rate.
    asked: list[float] = []
    walked = lookahead.predict(later, _context(later), lambda hit_rate: asked.append(hit_rate) or 1)
    assert asked == [LOOKAHEAD_PRIOR_HIT_RATE] and walked.tokens == (45,)
    unmatched = _live((700, 701))
    assert lookahead.predict(unmatched, _context(unmatched), 4) == Prediction(scope=prediction.scope)


async def test_a_request_sent_again_is_answered_in_passes_of_several_tokens(
    mlcs: tuple[MLC, MLC], tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under rule 1 the same prompt is answered with the same tokens: once the history's long
    matches have been right, the lookahead's guesses of them are scored several to a pass (the
    target's rows still decide every token)."""
    mlc, _ = mlcs
    engine = await _started_engine("https://verifier.test", tiny_loaded, mlc)
    # The pass costs of llama.cpp on 2 cores, whatever this machine measured: a second row costs
    # half a one-row pass, so a guess pays only where its class has been right (53 % for one session).
    engine.pass_curves.base.points_ms[:] = FIRST_CURVE_MS
    monkeypatch.setattr(engine.pass_curves, "record", lambda seconds, rows, context: None)
    contract = _self_decoding_contract(engine.target, 96)
    try:
        passes: list[int] = []
        answers: list[list[int]] = []
        for _ in range(3):
            before = engine.scorer.batches_run
            answers.append(await _self_decode_to_the_end(engine, mlc, contract, ENGINE_PROMPT, OWNER))
            passes.append(engine.scorer.batches_run - before)
            await eventually(lambda: engine.lookahead.history.size.sessions == len(answers))
    finally:
        await engine.stop()
    assert answers[0] == answers[1] == answers[2] and len(answers[0]) == 96
    # The first answer had no history to guess from: a pass a token.
    assert passes[0] == 96
    # The second answer's classes of match learn from its first groups; the third's have learned,
    # and its prompt's tail leads to the earlier answer from the first token on (27 passes where the
    # history held the outputs alone).
    assert passes[2] < passes[1] < passes[0] and passes[2] < passes[0] / 6
