"""BatchingScorer: many callers, one pass; errors stay with their request; asyncio front."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

from sdcp.futures import settle_soon
from sdcp.models import BatchingScorer, ScorerClosed, TargetModel, UnknownSession, batching
from sdcp.models.batching import RUN_DELIVERY_STEPS, RUN_DELIVERY_STEPS_MOST, ScoredRun
from sdcp.models.errors import ModelError

pytestmark = pytest.mark.timeout(60)


def _open(target: TargetModel, session_ids, count: int) -> list[bytes]:
    sessions = [next(session_ids) for _ in range(count)]
    for index, session in enumerate(sessions):
        target.open_session(session, list(range(1, 3 + index)))
    return sessions


def test_concurrent_callers_share_passes(tiny_target: TargetModel, session_ids) -> None:
    sessions = _open(tiny_target, session_ids, 8)
    expected = []
    for session in sessions:
        expected.append(tiny_target.score([(session, [5, 6])])[0])
        tiny_target.rollback(session)
    with BatchingScorer(tiny_target, window_s=0.05, max_batch=8) as scorer:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda s: scorer.submit(s, [5, 6]).result(timeout=30), sessions))
        assert scorer.batches_run < len(sessions)
    for got, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_bad_request_fails_alone(tiny_target: TargetModel, session_ids) -> None:
    (good,) = _open(tiny_target, session_ids, 1)
    with BatchingScorer(tiny_target, window_s=0.05) as scorer:
        unknown = scorer.submit(next(session_ids), [1])
        ok = scorer.submit(good, [1, 2])
        assert ok.result(timeout=30).shape == (3, tiny_target.vocab_size)
        with pytest.raises(UnknownSession):
            unknown.result(timeout=30)


def test_same_session_twice_is_scored_in_order(tiny_target: TargetModel, session_ids) -> None:
    (session,) = _open(tiny_target, session_ids, 1)
    with BatchingScorer(tiny_target, window_s=0.05) as scorer:
        first = scorer.submit(session, [1])
        second = scorer.submit(session, [1, 2, 3])
        assert first.result(timeout=30).shape[0] == 2
        assert second.result(timeout=30).shape[0] == 4


async def test_score_async_from_event_loop(tiny_target: TargetModel, session_ids) -> None:
    sessions = _open(tiny_target, session_ids, 4)
    with BatchingScorer(tiny_target, window_s=0.02) as scorer:
        rows = await asyncio.wait_for(asyncio.gather(*(scorer.score_async(s, [7]) for s in sessions)), timeout=30)
    assert [r.shape for r in rows] == [(2, tiny_target.vocab_size)] * 4


async def test_callers_of_one_pass_continue_together(tiny_target: TargetModel, session_ids) -> None:
    sessions = _open(tiny_target, session_ids, 6)
    with BatchingScorer(tiny_target, window_s=1.0, max_batch=6) as scorer:
        waiters = [scorer.score_async(s, [7]) for s in sessions]
        seen_done: list[int] = []
        waiters[0].add_done_callback(lambda _: seen_done.append(sum(w.done() for w in waiters)))
        await asyncio.wait_for(asyncio.gather(*waiters), timeout=30)
        assert scorer.batches_run == 1
    # When the first caller of the pass learns its rows, every other caller has them as well.
    assert seen_done == [6]


async def _loop_work_seen_by_the_pass(
    target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch, schedule: Callable[[list[str]], None]
) -> list[list[str]]:
    """What the event loop had done when the scorer's pass began: ``schedule`` queues the loop's
    work (appending to the list it is given) before the loop stays busy while the scorer holds the
    request (a round being decided): a pass that did not wait would run then, before that work."""
    (session,) = _open(target, session_ids, 1)
    assert target.on_host_cores
    loop_work: list[str] = []
    loop_work_seen_by_pass: list[list[str]] = []
    score = target.score

    def observed_score(requests, **kwargs):
        loop_work_seen_by_pass.append(list(loop_work))
        return score(requests, **kwargs)

    monkeypatch.setattr(target, "score", observed_score)
    # A long window: the wait for the loop is bounded by it, never reached here.
    with BatchingScorer(target, window_s=30.0, active_sessions=lambda: 1) as scorer:
        rows = scorer.score_async(session, [7])
        schedule(loop_work)
        time.sleep(0.2)
        await asyncio.wait_for(rows, timeout=30)
    return loop_work_seen_by_pass


async def test_a_pass_on_the_host_cores_starts_once_the_loop_ran_what_was_ready(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    def release(loop_work: list[str]) -> None:
        asyncio.get_running_loop().call_soon(loop_work.append, "released")

    assert await _loop_work_seen_by_the_pass(tiny_target, session_ids, monkeypatch, release) == [["released"]]


async def test_a_pass_on_the_host_cores_also_waits_for_what_the_ready_work_made_ready(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    def hand_over(loop_work: list[str]) -> None:
        def decide() -> None:
            # The session's task deciding a handed-over group of rounds: long enough that a pass
            # which started as soon as the hand-over's own callback ran would not see it.
            time.sleep(0.2)
            loop_work.append("decided")

        # The hand-over's callback: it wakes the task, whose step runs at the loop's next turn.
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, decide)

    assert await _loop_work_seen_by_the_pass(tiny_target, session_ids, monkeypatch, hand_over) == [["decided"]]


async def test_a_cancelled_async_request_is_not_scored(tiny_target: TargetModel, session_ids) -> None:
    first, second = _open(tiny_target, session_ids, 2)
    with BatchingScorer(tiny_target, window_s=0.2, max_batch=2) as scorer:
        withdrawn = scorer.score_async(first, [7])
        withdrawn.cancel()
        await asyncio.sleep(0)  # the cancellation reaches the scorer's future in a done callback
        scored = scorer.score_async(second, [7])
        rows = await asyncio.wait_for(scored, timeout=30)
        assert rows.shape == (2, tiny_target.vocab_size)
        await asyncio.sleep(0)
    assert scorer.passes[scored].batch_size == 1
    assert withdrawn not in scorer.passes


def test_closed_scorer_refuses_requests(tiny_target: TargetModel, session_ids) -> None:
    scorer = BatchingScorer(tiny_target)
    scorer.close()
    with pytest.raises(ScorerClosed):
        scorer.submit(next(session_ids), [1])


def test_requests_of_any_widths_share_one_pass(tiny_target: TargetModel, session_ids) -> None:
    sessions = _open(tiny_target, session_ids, 8)
    requests = {session: [5] for session in sessions[:7]} | {sessions[7]: list(range(3, 19))}
    expected = {}
    for session, tokens in requests.items():
        expected[session] = tiny_target.score([(session, tokens)])[0]
        tiny_target.rollback(session)
    with BatchingScorer(tiny_target, window_s=0.5, max_batch=8) as scorer:
        futures = {session: scorer.submit(session, tokens) for session, tokens in requests.items()}
        results = {session: future.result(timeout=30) for session, future in futures.items()}
        assert scorer.batches_run == 1
        assert {scorer.passes[future].batch_size for future in futures.values()} == {8}
    for session, rows in results.items():
        np.testing.assert_allclose(rows, expected[session], rtol=1e-4, atol=1e-4)


def _greedy_rows(target: TargetModel, session: bytes, steps: int) -> list[np.ndarray]:
    """The target's row after each of its next ``steps`` + 1 greedy tokens, committed one by one."""
    rows = []
    for _ in range(steps + 1):
        row = target.score([(session, ())])[0]
        rows.append(row[-1])
        target.commit(session, 0, [int(row[-1].argmax())])
    return rows


async def test_a_greedy_run_scores_the_most_probable_tokens_ahead(tiny_target: TargetModel, session_ids) -> None:
    """Each step's row is the row after the most probable token of the row before, as decoding the
    session one committed token at a time gives; the session's decided tokens are committed while
    the run goes on (before or after the scorer feeds the next), and a later pass goes on from them."""
    alone, ahead = _open(tiny_target, session_ids, 1)[0], next(session_ids)
    tiny_target.open_session(ahead, list(range(1, 3)))
    expected = _greedy_rows(tiny_target, alone, 5)
    with BatchingScorer(tiny_target, window_s=0.0) as scorer:
        run = scorer.score_ahead_async(ahead, (), 5, frozenset(), reach=2)
        rows = [(await asyncio.wait_for(run.rows, timeout=30))[-1]]
        for step in run.steps:
            rows.append((await asyncio.wait_for(step, timeout=30))[-1])
            token = int(rows[-2].argmax())
            await scorer.run_async(tiny_target.commit, ahead, 0, [token])
        tail = await asyncio.wait_for(scorer.score_async(ahead, ()), timeout=30)
        await asyncio.sleep(0)
        # Each step attends one position more than the one before (PassInfo.reach).
        assert [scorer.passes[future].reach for future in (run.rows, *run.steps)] == [2, 3, 4, 5, 6, 7]
    for got, want in zip(rows, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(tail[-1], expected[-1], rtol=1e-4, atol=1e-4)


async def test_a_greedy_run_stops_at_a_wrong_guess_a_stop_token_or_a_cancel(
    tiny_target: TargetModel, session_ids
) -> None:
    (session,) = _open(tiny_target, session_ids, 1)
    first = int(tiny_target.score([(session, ())])[0][-1].argmax())
    tiny_target.rollback(session)
    with BatchingScorer(tiny_target, window_s=0.0) as scorer:
        wrong = (first + 1) % tiny_target.vocab_size
        missed = scorer.score_ahead_async(session, (wrong,), 3, frozenset())
        assert (await asyncio.wait_for(missed.rows, timeout=30)).shape[0] == 2
        assert [await step for step in missed.steps] == [None, None, None]

        stopped = scorer.score_ahead_async(session, (), 3, frozenset({first}))
        await asyncio.wait_for(stopped.rows, timeout=30)
        assert [await step for step in stopped.steps] == [None, None, None]

        cancelled = scorer.score_ahead_async(session, (), 3, frozenset())
        cancelled.steps[1].cancel()
        await asyncio.wait_for(cancelled.rows, timeout=30)
        assert (await asyncio.wait_for(cancelled.steps[0], timeout=30)).shape == (1, tiny_target.vocab_size)
        assert await asyncio.wait_for(cancelled.steps[2], timeout=30) is None


def _record_hand_overs(monkeypatch: pytest.MonkeyPatch) -> list[list[object]]:
    """The futures the scorer hands to the caller's loop, one list a hand-over."""
    handed: list[list[object]] = []

    def recording(loop: asyncio.AbstractEventLoop, outcomes: list[tuple[object, object]]) -> None:
        handed.append([future for future, _ in outcomes])
        settle_soon(loop, outcomes)

    monkeypatch.setattr(batching, "settle_soon", recording)
    return handed


async def test_a_greedy_run_hands_its_steps_over_a_few_at_a_time_and_all_where_it_stops(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller's loop wakes once for RUN_DELIVERY_STEPS steps (it decides, appends and releases
    them together), and gets the rest of the run's rows where the run stops."""
    handed = _record_hand_overs(monkeypatch)
    (session,) = _open(tiny_target, session_ids, 1)
    steps = RUN_DELIVERY_STEPS + 2
    with BatchingScorer(tiny_target, window_s=0.0) as scorer:
        run = scorer.score_ahead_async(session, (), steps, frozenset())
        rows = await asyncio.wait_for(asyncio.gather(*run.steps), timeout=30)
    assert all(row is not None and row.shape == (1, tiny_target.vocab_size) for row in rows)
    assert len(run.fed) == steps
    assert handed == [[run.rows], list(run.steps[:RUN_DELIVERY_STEPS]), list(run.steps[RUN_DELIVERY_STEPS:])]


async def test_a_greedy_runs_caller_changes_how_many_steps_it_hears_of_at_a_time(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run that started with hand-overs of two steps hands them over four at a time once its
    caller says so (ScoredRun.deliver_every: a long run's caller learns on the way whether it may
    cut the run for a guess); the picker, on the scorer's thread, says it after the second step."""
    handed = _record_hand_overs(monkeypatch)
    (session,) = _open(tiny_target, session_ids, 1)
    greedy = batching.MostProbable()
    known = threading.Event()
    runs: list[ScoredRun] = []
    follows = [0]

    class ChangesTheDelivery:
        def follow(self, rows: np.ndarray, proposed: tuple[int, ...]) -> int | None:
            follows[0] += 1
            if follows[0] == 1:
                assert known.wait(timeout=30)
            if follows[0] == 3:
                runs[0].deliver_every(4)
            return greedy.follow(rows, proposed)

    with BatchingScorer(tiny_target, window_s=0.0) as scorer:
        run = scorer.score_ahead_async(session, (), 8, frozenset(), ChangesTheDelivery(), deliver_every=2)
        runs.append(run)
        known.set()
        rows = await asyncio.wait_for(asyncio.gather(*run.steps), timeout=30)
    assert all(row is not None for row in rows)
    assert handed == [[run.rows], list(run.steps[:4]), list(run.steps[4:])]


async def test_a_greedy_run_hands_its_groups_over_a_span_of_time_apart_when_its_caller_asks(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``apart_s`` (ScoredRun.deliver_every) a run holds its steps until the last hand-over is
    that long ago, ``every`` of them at least: on a clock that moves 0.1 s a pass, two steps at a
    time at least 0.35 s apart are four at a time, and the rest goes where the run stops."""
    handed = _record_hand_overs(monkeypatch)
    (session,) = _open(tiny_target, session_ids, 1)
    greedy = batching.MostProbable()
    known = threading.Event()
    passes = [0]

    class CountsThePasses:
        def follow(self, rows: np.ndarray, proposed: tuple[int, ...]) -> int | None:
            if passes[0] == 0:
                assert known.wait(timeout=30)
            passes[0] += 1
            return greedy.follow(rows, proposed)

    def clock() -> float:
        return passes[0] / 10

    with BatchingScorer(tiny_target, window_s=0.0, clock=clock) as scorer:
        run = scorer.score_ahead_async(session, (), 10, frozenset(), CountsThePasses(), deliver_every=2)
        run.deliver_every(2, apart_s=0.35)
        known.set()
        rows = await asyncio.wait_for(asyncio.gather(*run.steps), timeout=30)
    assert all(row is not None for row in rows)
    assert handed == [[run.rows], list(run.steps[:4]), list(run.steps[4:8]), list(run.steps[8:])]


async def test_a_greedy_run_hands_over_at_most_so_many_steps_at_a_time(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However far apart its caller wants the groups, a run holds at most RUN_DELIVERY_STEPS_MOST
    steps' rows: it hands them over there (the clock never moves here)."""
    handed = _record_hand_overs(monkeypatch)
    (session,) = _open(tiny_target, session_ids, 1)
    steps = RUN_DELIVERY_STEPS_MOST + 2
    greedy = batching.MostProbable()
    known = threading.Event()

    class WaitsForTheCaller:
        def follow(self, rows: np.ndarray, proposed: tuple[int, ...]) -> int | None:
            assert known.wait(timeout=30)
            return greedy.follow(rows, proposed)

    with BatchingScorer(tiny_target, window_s=0.0, clock=lambda: 0.0) as scorer:
        run = scorer.score_ahead_async(session, (), steps, frozenset(), WaitsForTheCaller())
        run.deliver_every(RUN_DELIVERY_STEPS, apart_s=3600.0)
        known.set()
        rows = await asyncio.wait_for(asyncio.gather(*run.steps), timeout=60)
    assert all(row is not None for row in rows)
    assert handed == [[run.rows], list(run.steps[:RUN_DELIVERY_STEPS_MOST]), list(run.steps[RUN_DELIVERY_STEPS_MOST:])]


async def test_a_greedy_run_hands_its_steps_over_after_each_pass_while_its_caller_wants_them(
    tiny_target: TargetModel, session_ids, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While ``deliver_now`` says so (the verifier: a prompt waits for its prefill), the run hands
    over the steps it holds after each pass, so that the loop hears of them before
    RUN_DELIVERY_STEPS are held; then it goes back to groups."""
    handed = _record_hand_overs(monkeypatch)
    (session,) = _open(tiny_target, session_ids, 1)
    steps = RUN_DELIVERY_STEPS + 3
    greedy = batching.MostProbable()
    follows = [0]

    class CountsItsTokens:
        def follow(self, rows: np.ndarray, proposed: tuple[int, ...]) -> int | None:
            follows[0] += 1
            return greedy.follow(rows, proposed)

    # The picker runs once a pass (the run's pass, then each step's): steps 0 and 1 go at once.
    with BatchingScorer(tiny_target, window_s=0.0, deliver_now=lambda: 2 <= follows[0] <= 3) as scorer:
        run = scorer.score_ahead_async(session, (), steps, frozenset(), CountsItsTokens())
        rows = await asyncio.wait_for(asyncio.gather(*run.steps), timeout=30)
    assert all(row is not None for row in rows)
    assert handed == [
        [run.rows],
        [run.steps[0]],
        [run.steps[1]],
        list(run.steps[2 : 2 + RUN_DELIVERY_STEPS]),
        list(run.steps[2 + RUN_DELIVERY_STEPS :]),
    ]


async def test_a_closing_scorer_leaves_no_step_of_a_run_waiting(tiny_target: TargetModel, session_ids) -> None:
    (session,) = _open(tiny_target, session_ids, 1)
    scorer = BatchingScorer(tiny_target, window_s=0.0)
    try:
        run = scorer.score_ahead_async(session, (), 30, frozenset())
        await asyncio.wait_for(run.steps[0], timeout=30)
    finally:
        scorer.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*run.steps, return_exceptions=True), timeout=30)
    assert all(outcome is None or isinstance(outcome, (np.ndarray, ScorerClosed)) for outcome in outcomes)


class _KeptRows:
    """The tiny target, as if the prefill of each session in ``kept`` had kept its row (llama.cpp):
    that session's first request is answered without a pass (Target.answers_without_pass); a
    session in ``failing`` makes `score` fail."""

    def __init__(self, target: TargetModel, kept: set[bytes], failing: frozenset[bytes] = frozenset()) -> None:
        self._target = target
        self.kept = kept
        self.failing = failing

    def __getattr__(self, name: str) -> object:
        return getattr(self._target, name)

    def answers_without_pass(self, session: bytes, tokens: tuple[int, ...]) -> bool:
        return session in self.kept and not tokens

    def score(self, requests, *, extending=()):  # noqa: ANN001, ANN201 - Target.score's
        for session, _ in requests:
            if session in self.failing:
                raise ModelError(f"session {session.hex()} cannot be scored")
            self.kept.discard(session)
        return self._target.score(requests, extending=extending)


async def test_a_request_answered_without_a_pass_lets_its_run_join_the_pass(
    tiny_target: TargetModel, session_ids
) -> None:
    running, joining = _open(tiny_target, session_ids, 2)
    # The first pass waits for both requests; the later ones, the run's alone (it has fed a token), for nobody.
    runs: list[ScoredRun] = []

    def active() -> int:
        return 1 if runs and runs[0].fed else 2

    with BatchingScorer(_KeptRows(tiny_target, {joining}), window_s=5.0, max_batch=2, active_sessions=active) as scorer:
        run = scorer.score_ahead_async(joining, (), 2, frozenset(), deliver_every=1)
        runs.append(run)
        other = scorer.score_async(running, (7,))
        first_step = await asyncio.wait_for(run.steps[0], timeout=30)
        # Its first step came with the pass it was gathered with (the scorer may be in the next
        # one by now: the run goes on without waiting for this loop).
        assert other.done() and run.rows.done()
        assert scorer.passes[run.steps[0]] is scorer.passes[other]
        assert first_step is not None
        assert await asyncio.wait_for(run.steps[1], timeout=30) is not None


async def test_a_request_answered_without_a_pass_fails_or_is_withdrawn_alone(
    tiny_target: TargetModel, session_ids
) -> None:
    """Its caller learns the failure, its run stops, and the pass of the others goes on; one
    withdrawn before the pass stops its run too."""
    running, failing, withdrawn = _open(tiny_target, session_ids, 3)
    target = _KeptRows(tiny_target, {failing, withdrawn}, failing=frozenset({failing}))
    with BatchingScorer(target, window_s=5.0, max_batch=3) as scorer:
        fails = scorer.score_ahead_async(failing, (), 2, frozenset())
        gone = scorer.score_ahead_async(withdrawn, (), 2, frozenset())
        gone.rows.cancel()
        other = scorer.score_async(running, (7,))
        assert (await asyncio.wait_for(other, timeout=30)).shape == (2, tiny_target.vocab_size)
        with pytest.raises(ModelError, match="cannot be scored"):
            await asyncio.wait_for(fails.rows, timeout=30)
        assert [await asyncio.wait_for(step, timeout=30) for step in (*fails.steps, *gone.steps)] == [None] * 4
        assert scorer.batches_run == 1


class _CancelledWhileLookedAt(Future[np.ndarray]):
    """A request its caller withdraws just after the scorer first asks whether it is done."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def done(self) -> bool:
        self.asked += 1
        return self.asked > 1


async def test_a_request_leaves_the_pass_only_with_its_run_ended(tiny_target: TargetModel, session_ids) -> None:
    """A caller may withdraw its request at any moment while the scorer answers those that need no
    pass: a request that leaves the batch there has its run ended (its steps get None), else it
    stays for the pass, which ends the run of one withdrawn."""
    (session,) = _open(tiny_target, session_ids, 1)
    loop = asyncio.get_running_loop()
    run = batching._Run(loop, deque(loop.create_future() for _ in range(2)), frozenset(), batching.MostProbable(), [])
    request = batching._Request(session, (7,), _CancelledWhileLookedAt(), (loop, loop.create_future()), run)
    batch = [request]
    with BatchingScorer(tiny_target, window_s=0.0) as scorer:
        scorer._answer_without_pass(batch, stopping=False)
    await asyncio.sleep(0)
    assert batch == [request] or all(step.done() for step in run.steps)
