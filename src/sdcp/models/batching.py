"""A thread-safe batching front for a target's `score` (docs/design.md, "Performance and testing").

The target's model thread (``sdcp.models.worker.ModelThread``) also gathers scoring requests into
passes. Callers from any thread `submit` a request and get a future; asyncio callers await
`score_async`, so model work never runs on an event loop. The rows of one pass reach an event loop
in one callback, so that all its callers resume together, in one loop iteration, rather than one by
one between the loop's other work. The thread gathers requests for a short window after the first
one arrives (or until `max_batch`) and runs them as one pass: a packed sequence costs its rows,
whatever their widths (sdcp.models.hf.ragged). Every other use of the model (prefill, commit,
rollback, KV export) goes through the same thread with `run`/`run_async`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from sdcp.futures import Outcome, settle_soon
from sdcp.models.backend import SessionId, Target
from sdcp.models.errors import ModelError
from sdcp.models.worker import Call, ModelThread, ModelThreadClosed
from sdcp.protocol.constraint import DeadEnd
from sdcp.protocol.messages import Sampling
from sdcp.protocol.shaping import TargetLogits
from sdcp.threads import CoreGovernor

log = logging.getLogger("sdcp.models")

# The scorer's name for a closed model thread.
ScorerClosed = ModelThreadClosed

# A greedy run hands its steps' rows to the caller's loop this many at a time (by default), where it
# stops, or where the caller wants them at once (BatchingScorer's ``deliver_now``: a prompt waits for
# its prefill, and the loop holds the running sessions for it): the loop then decides, appends and
# releases them together, waking once for them. Sixteen is what a reader past its first tokens
# gathers in one answer (the verifier's OUTPUT_LINGER_TOKENS); against four, one stream's event loop
# took 0.47 ms of CPU a token instead of 0.82, and the appends' worker threads a fourth of theirs, on
# the two cores llama.cpp's threads share with them (docs/performance.md, session 29). A caller that
# may cut the run for tokens worth scoring together (a guess, a constraint's forced tokens) asks for
# fewer at a time: it hears of each step that much sooner. A caller may also ask for groups at
# least a span of time apart (ScoredRun.deliver_every): a run then holds more than ``every`` steps
# where its passes are quick, up to RUN_DELIVERY_STEPS_MOST, whose rows it keeps meanwhile (64 rows
# of SmolLM2's 49,152 float32 logits: 12.6 MB).
RUN_DELIVERY_STEPS = 16
RUN_DELIVERY_STEPS_FEW = 4
RUN_DELIVERY_STEPS_MOST = 64


class GreedyPicker(Protocol):
    """Which token a greedy run feeds next (on the scorer's thread)."""

    def follow(self, rows: np.ndarray, proposed: Sequence[int]) -> int | None:
        """The token after ``rows``, the rows of a pass over ``proposed`` (row j after
        ``proposed[:j]``), or None where the run stops: a proposed token that is not the one
        greedy decoding takes."""
        ...


def _most_probable(rows: np.ndarray) -> list[int]:
    """Each row's most probable token, ties to the smallest id (SDCP 6.4 rule 1). A run's step has
    one row: its argmax alone, without numpy's reduction along an axis (on the scorer's thread,
    between two passes)."""
    if len(rows) == 1:
        return [int(np.argmax(rows[0]))]
    return [int(token) for token in np.argmax(rows, axis=-1)]


class MostProbable:
    """The target's most probable token, ties to the smallest id (SDCP 6.4 rule 1)."""

    def follow(self, rows: np.ndarray, proposed: Sequence[int]) -> int | None:
        greedy = _most_probable(rows)
        return greedy[-1] if list(proposed) == greedy[: len(proposed)] else None


class TargetMostProbable:
    """The token the verifier decides under rule 1: the most probable of the session's shaped
    target logits (sdcp.protocol.shaping: min_new, the constraint, penalties and logit_bias under
    ``sampling``), from ``logits``, a copy of the session's that only the run advances."""

    def __init__(self, logits: TargetLogits, sampling: Sampling | None) -> None:
        self._logits = logits
        self._sampling = sampling

    def follow(self, rows: np.ndarray, proposed: Sequence[int]) -> int | None:
        if any(token in self._logits.stop for token in proposed):
            # The output ends at a proposed stop token (self-decoding scores one the constraint
            # forces where the output is complete): no token follows it.
            return None
        # A proposed token the constraint disallows is at -inf in its own row: never the argmax.
        try:
            shaped = self._logits.rows(rows, proposed, self._sampling)
        except DeadEnd:
            # No token may follow: the round that decides here ends the session; the run stops.
            return None
        greedy = _most_probable(shaped)
        if list(proposed) != greedy[: len(proposed)]:
            return None
        token = greedy[-1]
        if token not in self._logits.stop:
            # A stop token ends the run (and the output): nothing follows it to shape.
            self._logits.commit((*proposed, token))
        return token


@dataclass(frozen=True)
class ScoredRun:
    """A pass and the greedy run after it (`BatchingScorer.score_ahead_async`): ``rows`` are the
    pass's; step i's future gives the row after the token the run's picker took from the row before
    it (the pass's last row, then step i - 1's), ``fed[i]``, once the scorer fed that token, or None
    where the run stopped before it."""

    rows: asyncio.Future[np.ndarray]
    steps: tuple[asyncio.Future[np.ndarray | None], ...]
    # Shared with the scorer's run: what deliver_every sets, the scorer reads.
    delivery: _Delivery
    # Appended on the scorer's thread before the rows it follows reach the caller's loop.
    fed: list[int] = field(default_factory=list)

    def cancel(self, *, after: int = -1) -> None:
        """Withdraw the steps after step ``after`` (all by default) not computed yet: the run stops
        at the first of them."""
        for step in self.steps[after + 1 :]:
            step.cancel()

    def deliver_every(self, steps: int, *, apart_s: float = 0.0) -> None:
        """Hand the steps' rows over ``steps`` at a time from now on, or where the last hand-over
        is less than ``apart_s`` ago, once that long has passed (at most RUN_DELIVERY_STEPS_MOST
        at a time): a caller learns during a long run whether it may cut it for tokens worth
        scoring together (RUN_DELIVERY_STEPS_FEW), and the groups' span bounds what each costs its
        loop per token."""
        self.delivery.apart_s = max(0.0, apart_s)
        self.delivery.every = max(1, steps)


@dataclass
class _Delivery:
    """When a run hands its steps' rows to its loop: ``every`` steps at a time, once its last
    hand-over is ``apart_s`` ago; set by the loop, read by the scorer (each attribute's read and
    write is whole, and a hand-over that follows one of them and not yet the other is still one)."""

    every: int
    apart_s: float = 0.0

    def due(self, held: int, since_s: float) -> bool:
        """Whether ``held`` steps, the last hand-over ``since_s`` ago, go to the loop now."""
        return held >= RUN_DELIVERY_STEPS_MOST or (held >= self.every and since_s >= self.apart_s)


@dataclass
class _Run:
    """What is left of a greedy run: the futures of its steps (on ``loop``), the tokens that end it,
    how it picks its tokens and those it fed, how many steps' rows it hands to the loop at a time, and
    the rows of steps computed but not yet handed to it (RUN_DELIVERY_STEPS)."""

    loop: asyncio.AbstractEventLoop
    steps: deque[asyncio.Future[np.ndarray | None]]
    stop_tokens: frozenset[int]
    picker: GreedyPicker
    fed: list[int]
    delivery: _Delivery = field(default_factory=lambda: _Delivery(RUN_DELIVERY_STEPS))
    held: list[Outcome] = field(default_factory=list)
    # When the run last handed its rows over (the scorer's clock): at its pass, then at each group.
    # Set before the run's first step is taken; the loop never reads it.
    handed_at: float = 0.0


@dataclass(frozen=True)
class _Request:
    session: SessionId
    tokens: tuple[int, ...]
    future: Future[np.ndarray]
    # For `score_async`: the caller's loop and the future it awaits there.
    waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[np.ndarray]] | None = None
    # A greedy run goes on after this pass; ``extends``: a step of one, whose token follows the
    # session's scored proposal.
    run: _Run | None = None
    extends: bool = False
    # The positions its last row attends, as the caller counts them (PassInfo.reach).
    reach: int = 0


def _taken(request: _Request) -> bool:
    """Whether ``request`` is still wanted (its caller withdrew neither its waiter nor its future),
    marking it running: a pass is about to answer it."""
    withdrawn = request.waiter is not None and request.waiter[1].cancelled()
    return not withdrawn and request.future.set_running_or_notify_cancel()


class _Outcomes:
    """Completes requests; what goes to asyncio waiters is handed to each loop in one callback."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}

    def result(self, request: _Request, rows: np.ndarray) -> None:
        request.future.set_result(rows)
        self._add(request, rows)

    def exception(self, request: _Request, error: BaseException) -> None:
        request.future.set_exception(error)
        self._add(request, error)

    def end_run(self, run: _Run) -> None:
        """The steps held of ``run`` go out, and those left get None: the run stops."""
        self.hand_over(run)
        outcomes = self._by_loop.setdefault(run.loop, [])
        outcomes.extend((step, None) for step in run.steps)
        run.steps.clear()

    def hand_over(self, run: _Run) -> None:
        """The rows of the steps ``run`` held go out with this pass's outcomes."""
        if run.held:
            self._by_loop.setdefault(run.loop, []).extend(run.held)
            run.held.clear()

    def _add(self, request: _Request, outcome: np.ndarray | BaseException) -> None:
        if request.waiter is None:
            return
        loop, waiter = request.waiter
        if request.extends and request.run is not None and not isinstance(outcome, BaseException):
            # A step's rows wait for the run's next ones (BatchingScorer._score decides).
            request.run.held.append((waiter, outcome))
        else:
            self._by_loop.setdefault(loop, []).append((waiter, outcome))

    def deliver(self) -> None:
        for loop, outcomes in self._by_loop.items():
            settle_soon(loop, outcomes)
        self._by_loop.clear()


@dataclass(frozen=True)
class PassInfo:
    """The model pass that scored a session's latest request: its duration, batch size (sessions)
    and rows (every session's it computed: a row a prefill kept is none). The sessions of one pass
    share one PassInfo."""

    seconds: float
    batch_size: int
    rows: int
    # The most positions a row of the pass attends (its requests' ``reach``): a pass's cost grows
    # with its context too (sdcp.engines.verifier.observe.PassCurves).
    reach: int = 0


class BatchingScorer(ModelThread):
    def __init__(
        self,
        target: Target,
        *,
        window_s: float = 0.002,
        max_batch: int = 16,
        active_sessions: Callable[[], int] | None = None,
        window_share: float = 0.3,
        cores: CoreGovernor | None = None,
        deliver_now: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s < 0 or max_batch < 1 or not 0 <= window_share < 1:
            raise ValueError(
                "need window_s >= 0, max_batch >= 1, 0 <= window_share < 1; "
                f"got {window_s}, {max_batch}, {window_share}"
            )
        self.target = target
        self.window_s = window_s
        # While other sessions may still join, a batch waits up to this share of the last pass's
        # duration: a pass costs little more for another row, and a session that misses it waits a
        # whole pass.
        self.window_share = window_share
        self._last_pass_s = 0.0
        self.max_batch = max_batch
        # How many sessions may send requests now: a batch that holds them all has nothing left to
        # wait for, so a lone session never pays the window.
        self.active_sessions = active_sessions
        # Whether greedy runs hand the steps they hold to their loops after each pass rather than
        # RUN_DELIVERY_STEPS at a time (read on the scorer's thread).
        self._deliver_now = deliver_now or (lambda: False)
        # What a run's hand-overs are timed by (_Delivery.apart_s): a test's clock moves pass by
        # pass, so that what it asserts never depends on how fast the machine is.
        self._clock = clock
        self.batches_run = 0
        # The pass that scored each request, by the future its caller holds: written before the
        # future completes, so that its caller reads its own pass (a run's steps reach it later).
        self.passes: weakref.WeakKeyDictionary[object, PassInfo] = weakref.WeakKeyDictionary()
        super().__init__("sdcp-scorer", cores=cores)

    def submit(self, session: SessionId, tokens: Sequence[int]) -> Future[np.ndarray]:
        """Queue one scoring request; the future gives float32 logits (M + 1, V)."""
        return self._queue(session, tokens, None)

    def score_async(self, session: SessionId, tokens: Sequence[int], *, reach: int = 0) -> asyncio.Future[np.ndarray]:
        """Queue one scoring request now, from the running event loop; await the rows there.
        Cancelling the returned future withdraws a request that no pass has taken yet. ``reach``:
        the positions its last row attends (PassInfo.reach)."""
        loop = asyncio.get_running_loop()
        rows: asyncio.Future[np.ndarray] = loop.create_future()
        future = self._queue(session, tokens, (loop, rows), reach=reach)
        rows.add_done_callback(lambda done: future.cancel() if done.cancelled() else None)
        return rows

    def score_ahead_async(
        self,
        session: SessionId,
        tokens: Sequence[int],
        steps: int,
        stop_tokens: frozenset[int],
        picker: GreedyPicker | None = None,
        *,
        reach: int = 0,
        deliver_every: int = RUN_DELIVERY_STEPS,
    ) -> ScoredRun:
        """`score_async`, and then up to ``steps`` greedy steps (ScoredRun) while the tokens
        ``picker`` takes (default: the target's most probable) repeat ``tokens`` and are not
        ``stop_tokens``: the scorer feeds each next token itself, in the session's next pass,
        without waiting for the caller to decide it. Whoever decides otherwise cancels the run; a
        later `score` of the session drops the steps' tokens with the rest of its proposal
        (Target.score). The steps' rows reach the loop ``deliver_every`` at a time (until the caller
        says otherwise, ScoredRun.deliver_every)."""
        loop = asyncio.get_running_loop()
        fed: list[int] = []
        futures = deque(loop.create_future() for _ in range(steps))
        delivery = _Delivery(max(1, deliver_every))
        run = _Run(loop, futures, stop_tokens, picker or MostProbable(), fed, delivery)
        rows: asyncio.Future[np.ndarray] = loop.create_future()
        future = self._queue(session, tokens, (loop, rows), run, reach=reach)
        rows.add_done_callback(lambda done: future.cancel() if done.cancelled() else None)
        return ScoredRun(rows, tuple(run.steps), delivery, fed)

    def _queue(
        self,
        session: SessionId,
        tokens: Sequence[int],
        waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[np.ndarray]] | None,
        run: _Run | None = None,
        *,
        reach: int = 0,
    ) -> Future[np.ndarray]:
        future: Future[np.ndarray] = Future()
        self._put(_Request(session, tuple(tokens), future, waiter, run, reach=reach))
        return future

    def _serve(self) -> None:
        deferred: deque[_Request] = deque()
        stopping = False
        while not stopping or deferred:
            batch: list[_Request] = []
            if deferred:
                batch.append(deferred.popleft())
            else:
                item = self._take()
                if self._is_stop(item):
                    break
                if isinstance(item, Call):
                    with self._working():
                        item.run()
                    continue
                assert isinstance(item, _Request)
                batch.append(item)
            with self._working():
                stopping = self._gather(batch, deferred) or stopping
                try:
                    # A run's next step goes first into the next pass, as the pass's session would.
                    deferred.extendleft(reversed(self._score(batch, stopping=stopping)))
                except BaseException as exc:
                    # The thread dies of it (ModelThread): no request of the pass, nor a step
                    # deferred to the next, is left for a caller to wait on.
                    self._fail_requests([*batch, *deferred], exc)
                    raise
        self._refuse_pending()

    @staticmethod
    def _fail_requests(requests: list[_Request], error: BaseException) -> None:
        outcomes = _Outcomes()
        failure = ModelThreadClosed(f"the scorer failed: {error!r}")
        for request in requests:
            if request.future.done():
                continue
            if request.future.running() or request.future.set_running_or_notify_cancel():
                outcomes.exception(request, failure)
            if request.run is not None:
                outcomes.end_run(request.run)
        outcomes.deliver()

    def _gather(self, batch: list[_Request], deferred: deque[_Request]) -> bool:
        """Fill `batch` within the window; a second request of a session waits for a later pass."""
        sessions = {batch[0].session}
        while deferred and len(batch) < self.max_batch and deferred[0].session not in sessions:
            request = deferred.popleft()
            sessions.add(request.session)
            batch.append(request)
        deadline = time.monotonic() + max(self.window_s, self.window_share * self._last_pass_s)
        while len(batch) < self._batch_limit():
            remaining = deadline - time.monotonic()
            try:
                item = self._take(max(remaining, 0.0))
            except queue.Empty:
                return False
            if self._is_stop(item):
                return True
            if isinstance(item, Call):
                item.run()
                continue
            assert isinstance(item, _Request)
            request = item
            if request.session in sessions:
                deferred.append(request)
            else:
                sessions.add(request.session)
                batch.append(request)
        return False

    def _batch_limit(self) -> int:
        if self.active_sessions is None:
            return self.max_batch
        return max(1, min(self.max_batch, self.active_sessions()))

    def _score(self, batch: list[_Request], *, stopping: bool) -> list[_Request]:
        """Run the batch's pass; returns the next steps of its greedy runs."""
        outcomes = _Outcomes()
        steps: list[_Request] = []
        # Where the pass fails, whatever the runs hold goes out with it.
        deliver_now = True
        try:
            # In place: where the pass fails, the scorer fails what ``batch`` holds then.
            self._answer_without_pass(batch, stopping=stopping)
            for request, rows in self._score_into(batch, outcomes):
                step = None if request.run is None or stopping else self._next_step(request, rows)
                if step is not None:
                    steps.append(step)
            deliver_now = self._deliver_now()
        finally:
            # Every other run of the batch stops here: its pass failed, was withdrawn or ended it.
            going_on = {id(step.run) for step in steps}
            now = self._clock()
            for request in batch:
                run = request.run
                if run is None:
                    continue
                if id(run) not in going_on:
                    outcomes.end_run(run)
                elif not request.extends or deliver_now or run.delivery.due(len(run.held), now - run.handed_at):
                    outcomes.hand_over(run)
                    run.handed_at = now
            outcomes.deliver()
        return steps

    def _answer_without_pass(self, batch: list[_Request], *, stopping: bool) -> None:
        """Answer now the requests of ``batch`` that the target answers without a pass (a session's
        first request after its prefill, which kept its row: Target.answers_without_pass), rather
        than with the pass's other rows; a greedy run's next step takes such a request's place in
        ``batch``, so that it is computed in this pass rather than the next. A session that joins
        running ones thus gets its first token a pass sooner, and every later one too."""
        answered = _Outcomes()
        try:
            for index, request in enumerate(batch):
                if request.extends or not self.target.answers_without_pass(request.session, request.tokens):
                    continue
                if not _taken(request):
                    continue
                try:
                    (rows,) = self.target.score([(request.session, request.tokens)])
                except Exception as exc:  # noqa: BLE001 - its caller learns why, the pass goes on
                    answered.exception(request, exc)
                    continue
                answered.result(request, rows)
                if request.run is None or stopping:
                    continue
                # Its row goes out now: the run's first hand-over.
                request.run.handed_at = self._clock()
                step = self._next_step(request, rows)
                if step is not None:
                    batch[index] = step
        finally:
            # A request answered here, or withdrawn (its caller may cancel it at any moment: done()
            # is read once), leaves the batch; its run went on in it or stops now.
            going_on: list[_Request] = []
            for request in batch:
                if request.extends or not request.future.done():
                    going_on.append(request)
                elif request.run is not None:
                    answered.end_run(request.run)
            batch[:] = going_on
            answered.deliver()

    def _score_into(self, batch: list[_Request], outcomes: _Outcomes) -> list[tuple[_Request, np.ndarray]]:
        runnable: list[_Request] = []
        for request in batch:
            if not _taken(request):
                continue
            try:
                self.target.check_request(request.session, request.tokens, extending=request.extends)
            except ModelError as exc:
                outcomes.exception(request, exc)
                continue
            runnable.append(request)
        if not runnable:
            return []
        # Steps of runs that hold their last rows gave the loops nothing to run since.
        if self.target.on_host_cores and not all(request.run is not None and request.run.held for request in runnable):
            self._let_loops_settle(runnable)
        started = time.perf_counter()
        try:
            rows = self.target.score(
                [(request.session, request.tokens) for request in runnable],
                extending={request.session for request in runnable if request.extends},
            )
        except Exception as exc:  # noqa: BLE001 - every waiter must learn why its pass failed
            for request in runnable:
                outcomes.exception(request, exc)
            return []
        finally:
            self._last_pass_s = time.perf_counter() - started
        info = PassInfo(
            self._last_pass_s,
            len(runnable),
            self.target.scored_tokens,
            max(request.reach for request in runnable),
        )
        self.batches_run += 1
        for request, result in zip(runnable, rows, strict=True):
            self.passes[request.waiter[1] if request.waiter is not None else request.future] = info
            outcomes.result(request, result)
        return list(zip(runnable, rows, strict=True))

    def _let_loops_settle(self, requests: list[_Request]) -> None:
        """Wait until each event loop that awaits the pass has run what was ready on it, and what
        that made ready (the rounds of the last pass: deciding, appending, releasing, streaming).
        On the host's cores the model's threads wait for each other at every step of a pass, so
        Python work beside a pass lengthens it by more than the work costs before it
        (docs/performance.md, "Passes that wait for the event loop"). A hand-over's rows reach
        the loop as one callback that wakes the session's task, which decides and signs the rounds
        at the loop's next turn: waiting for that turn too moved that work from beside the next
        pass to before it (docs/performance.md, session 40). The wait is bounded by the last pass's
        time: a loop kept busy longer (a grammar compiled) delays a pass by no more than that."""
        limit_s = max(self.window_s, self._last_pass_s)
        for loop in {request.waiter[0] for request in requests if request.waiter is not None}:
            settled = threading.Event()
            try:
                loop.call_soon_threadsafe(loop.call_soon, settled.set)
            except RuntimeError:  # the loop is closed: nothing runs on it
                continue
            settled.wait(limit_s)

    @staticmethod
    def _next_step(request: _Request, rows: np.ndarray) -> _Request | None:
        """The run's next step after ``rows``, None where the run stops: a proposed token that is
        not the picker's, a stop token next, no step left or the next one withdrawn."""
        run = request.run
        assert run is not None
        if not run.steps or run.steps[0].cancelled():
            return None
        proposed = () if request.extends else request.tokens
        try:
            token = run.picker.follow(rows, proposed)
        except Exception as exc:  # noqa: BLE001 - a run only saves passes: the round decides anyway
            # A picker's failure (a grammar library's error on one session's constraint) stops that
            # session's run, never the scorer every session shares.
            log.warning("session %s: greedy run stopped: %r", request.session, exc)
            return None
        if token is None or token in run.stop_tokens:
            return None
        run.fed.append(token)
        waiter = run.steps.popleft()
        return _Request(
            request.session,
            (token,),
            Future(),
            (run.loop, waiter),  # type: ignore[arg-type]
            run,
            extends=True,
            reach=request.reach + 1,
        )

    def _refuse(self, item: object) -> None:
        if not isinstance(item, _Request):
            super()._refuse(item)
            return
        outcomes = _Outcomes()
        if item.future.set_running_or_notify_cancel():
            outcomes.exception(item, ScorerClosed("the batching scorer was closed"))
        if item.run is not None:
            outcomes.end_run(item.run)
        outcomes.deliver()
