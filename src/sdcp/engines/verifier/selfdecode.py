"""Self-decoding (SDCP 6.5.2 self_decode): the verifier draws the target's tokens itself, one per
round, scoring along with each pass the continuation that prompt lookup predicts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sdcp.engines.errors import Unavailable
from sdcp.engines.tasks import BackgroundTasks
from sdcp.engines.verifier.admission import Admissions
from sdcp.engines.verifier.events import RouterEvents
from sdcp.engines.verifier.kvsync import ModelSync
from sdcp.engines.verifier.live import LiveSession
from sdcp.engines.verifier.lookahead import Prediction, VerifierLookahead
from sdcp.engines.verifier.observe import PassCurves
from sdcp.engines.verifier.rounds import PartlyAppended, Rounds, Scoring
from sdcp.models.batching import RUN_DELIVERY_STEPS, RUN_DELIVERY_STEPS_FEW, ScoredRun, TargetMostProbable
from sdcp.models.drafter import TokenTimer
from sdcp.protocol.passcost import speculation_length
from sdcp.protocol.rules import GreedyRule
from sdcp.protocol.verifier import PendingCommit, VerifierSession

__all__ = [
    "SELF_DECODE_LOOKAHEAD",
    "SelfDecoding",
]

log = logging.getLogger("sdcp.verifier")

# Self-decoding scores up to this many predicted tokens per pass (VerifierLookahead's prediction).
SELF_DECODE_LOOKAHEAD = 16


@dataclass(frozen=True)
class _Held:
    """The period goes on after ``context`` (prompt and committed tokens) once the short prompts
    waiting for their prefill are in (Admissions)."""

    context: tuple[int, ...]


@dataclass(frozen=True)
class _Pass:
    """A queued self-decoding pass after ``context`` (prompt and decided tokens): the lookahead's
    prediction (after the ``forced`` tokens the session's constraint forces), the part of those
    scored, the rows (None: a run's step that the scorer did not reach), and the greedy run that
    goes on after it, ``step`` its next step."""

    context: tuple[int, ...]
    prediction: Prediction
    guess: tuple[int, ...]
    logits: asyncio.Future[np.ndarray] | asyncio.Future[np.ndarray | None]
    run: ScoredRun | None = None
    step: int = 0
    forced: int = 0

    def withdraw(self) -> None:
        self.logits.cancel()
        if self.run is not None:
            self.run.cancel()

    def cut(self) -> None:
        """Withdraw the run's steps after the one this pass awaits: the scorer ends the run at its
        next pass and hands over the steps it holds, rather than a group (up to
        RUN_DELIVERY_STEPS_MOST steps, self_decode_group_ms) later."""
        if self.run is not None:
            self.run.cancel(after=self.step - 1)


@dataclass(frozen=True)
class _Predicted:
    """_predict's answer: the lookahead's prediction, the tokens to score, how many of them the
    session's constraint forced (they come first), and whether the session may have tokens worth
    scoring together at its next positions (a constraint's, or a guess that pays at its hit rate)."""

    prediction: Prediction
    guess: tuple[int, ...]
    forced: int
    may_guess: bool

    @property
    def delivery_steps(self) -> int:
        """How many steps of a greedy run the loop hears of at a time: a few where it may cut the
        run for tokens worth scoring together, else larger groups (RUN_DELIVERY_STEPS)."""
        return RUN_DELIVERY_STEPS_FEW if self.may_guess else RUN_DELIVERY_STEPS


def _undecided(machine: VerifierSession, context: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens of ``context`` decided after the session's committed ones (not yet released)."""
    return context[len(machine.prompt) + machine.committed :]


class SelfDecoding:
    """Runs each session's self-decoding period as a task of its own; ``token_time`` learns the
    time per self-decoded token, ``active_sessions`` says how many sessions share the passes."""

    def __init__(
        self,
        *,
        uri: str,
        rounds: Rounds,
        scoring: Scoring,
        model_sync: ModelSync,
        events: RouterEvents,
        tasks: BackgroundTasks,
        pass_curves: PassCurves,
        token_time: TokenTimer,
        active_sessions: Callable[[], int],
        lookahead: VerifierLookahead,
        admissions: Admissions,
        group_apart_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self._uri = uri
        self._rounds = rounds
        self._scoring = scoring
        self._model_sync = model_sync
        self._events = events
        self._tasks = tasks
        self._pass_curves = pass_curves
        self._token_time = token_time
        self._active_sessions = active_sessions
        self._lookahead = lookahead
        self._admissions = admissions
        # Read at each group, not kept: a test or an operator may change the setting meanwhile
        # (VerifierConfig.self_decode_group_ms).
        self._group_apart_s = group_apart_s

    def start(self, live: LiveSession) -> None:
        # The task of the previous period may still be releasing its last round.
        live.self_decoder = self._tasks.spawn(self._self_decode(live, after=live.self_decoder))

    async def _self_decode(self, live: LiveSession, *, after: asyncio.Task[None] | None = None) -> None:
        """SDCP 6.5.2 self_decode: one target token per round until self_max, load or the end.

        A pass scores the continuation that the verifier's lookahead predicts after the committed
        tokens (VerifierLookahead: the session's tokens and the outputs of earlier finished
        sessions) along with the next position. Each round still draws its one token from its own row exactly as
        without the prediction; while the drawn tokens match the prediction, the rows that follow
        are the target's rows for the committed prefix, so the next rounds need no pass of their own
        (docs/interpretations.md). The next pass is queued as soon as a pass's tokens are decided,
        so that it runs while their records are appended and released.
        """
        machine = live.machine
        if after is not None:
            await asyncio.wait([after])
        try:
            scoring: _Pass | _Held | None = self._start_pass(live, (*machine.prompt, *machine.tokens))
            mark, committed = time.perf_counter(), machine.committed
            while scoring is not None:
                if isinstance(scoring, _Held):
                    await self._admissions.held()
                    # The wait is not decoding time: the router's figure leaves it out.
                    mark = time.perf_counter()
                    goes_on = machine.self_decoding and not (machine.ended or live.cancelling)
                    scoring = self._start_pass(live, scoring.context) if goes_on else None
                    continue
                scoring = await self._self_decode_pass(live, scoring)
                now = time.perf_counter()
                self._token_time.record(now - mark, machine.committed - committed)
                mark, committed = now, machine.committed
        except Exception as exc:  # noqa: BLE001 - the period ends, the router assigns a drafter again
            if machine.fenced or machine.ended:
                return
            event = machine.interrupt_self_decode()
            if live.cancelling:
                # A cancel that stopped waiting for this task took the session's next round (a busy
                # machine): its record ends the session, and no drafter is wanted.
                log.info("%s: self-decoding of session %s gave way to its cancel", self._uri, machine.session.hex())
                return
            # The period ends as it would at self_max: the router assigns a drafter again. An MLC
            # that cannot take the record is an operational failure, anything else a fault.
            level = logging.WARNING if isinstance(exc, Unavailable) else logging.ERROR
            log.log(level, "%s: self-decoding of session %s stopped: %r", self._uri, machine.session.hex(), exc)
            self._tasks.spawn(self._events.send(event))

    def _start_pass(
        self,
        live: LiveSession,
        context: tuple[int, ...],
        predicted: _Predicted | None = None,
    ) -> _Pass:
        """Queue the self-decoding pass that follows ``context`` (prompt and decided tokens), under
        rule 1 with the greedy run after it; ``predicted``: `_predict`'s answer, where known."""
        predicted = predicted if predicted is not None else self._predict(live, context)
        if live.prefill_row_kept and self._scoring.keeps_prefill_row and not predicted.forced:
            # The first token's row is the one the prefill kept: a guess with it would make a pass
            # of that request, and the first token wait for the pass. The guess is looked for again
            # after the first token, as at every delivery (_follow).
            predicted = dataclasses.replace(predicted, guess=())
        prediction, guess, forced = predicted.prediction, predicted.guess, predicted.forced
        machine = live.machine
        steps = self._run_ahead(machine, context, guess)
        if not steps:
            return _Pass(context, prediction, guess, self._scoring.submit(live, guess), forced=forced)
        # The run feeds the tokens rule 1 decides, the most probable of the shaped target logits
        # (the constraint's, the penalties'), from a copy of the session's shaping state that it
        # advances itself on the scorer's thread. A policy that changes the profile meanwhile only
        # makes a fed token differ from the decided one, which ends the run.
        logits = machine.target_logits.fork()
        logits.commit(_undecided(machine, context))
        picker = TargetMostProbable(logits, machine.sampling_for(machine.round + 1))
        run = self._scoring.submit_ahead(live, guess, steps, picker, predicted.delivery_steps)
        return _Pass(context, prediction, guess, run.rows, run, forced=forced)

    def _follow(self, live: LiveSession, scoring: _Pass, context: tuple[int, ...], greedy: bool) -> _Pass:
        """The pass after ``scoring``'s last round: the next step of its run where the scorer fed
        the token that round drew (``greedy``), else a new pass (the run is withdrawn). Where the
        lookahead has a guess worth scoring, the run ends after that step, which is on its way
        already, and the pass after it scores the guess."""
        run = scoring.run
        predicted = self._predict(live, context)
        if run is not None and greedy and scoring.step < len(run.steps) and not run.steps[scoring.step].cancelled():
            if predicted.guess:
                run.cancel(after=scoring.step)
            else:
                # A run lasts its period: what the lookahead may guess changes along it. Past its
                # first group of steps, a run that no guess may cut hands its rounds over at most
                # every self_decode_group_ms: each group costs the loop a wake, a decision, an
                # append and a release beside the passes (docs/performance.md, session 43).
                run.deliver_every(predicted.delivery_steps, apart_s=self._groups_apart_s(live, scoring, predicted))
            step = run.steps[scoring.step]
            return _Pass(context, predicted.prediction, (), step, run, scoring.step + 1, predicted.forced)
        if run is not None:
            run.cancel()
        return self._start_pass(live, context, predicted)

    def _predict(self, live: LiveSession, context: tuple[int, ...]) -> _Predicted:
        """The lookahead's prediction after ``context`` and the tokens the session's constraint
        forces there, the part worth scoring (the forced tokens, all scored, then the lookahead's
        guess after them), and how many were forced."""
        machine = live.machine
        forced: tuple[int, ...] = ()
        if machine.constraint is not None:
            forced = machine.constraint.forced(_undecided(machine, context), SELF_DECODE_LOOKAHEAD)
        budget = SELF_DECODE_LOOKAHEAD - len(forced)
        sessions = self._active_sessions()
        curve = self._pass_curves.curve(len(context))
        # Only what may be scored is predicted (a step each), and where no guess pays, what the
        # next group of rounds decides (a greedy run's delivery, else one round): a prediction
        # that is not scored still counts towards its class's hit rate, which must learn as fast
        # with runs handed over 16 steps at a time as with one round at a time. How many tokens
        # a guess of the prediction's class is worth is known before the lookahead walks them.
        judged = min(RUN_DELIVERY_STEPS if self._runs(machine) else 1, budget)
        apart = self._scoring.rows_apart
        prediction = self._lookahead.predict(
            live,
            context + forced,
            lambda hit_rate: max(judged, speculation_length(hit_rate, sessions, budget, curve, apart=apart)),
        )
        worth = speculation_length(prediction.hit_rate, sessions, budget, curve, apart=apart)
        # The walk may end before the guess would (the match runs out): the guess is then the
        # length worth most within it.
        guess = prediction.tokens[
            : speculation_length(prediction.hit_rate, sessions, len(prediction.tokens), curve, apart=apart)
        ]
        return _Predicted(prediction, forced + guess, len(forced), machine.constraint is not None or worth > 0)

    def _groups_apart_s(self, live: LiveSession, scoring: _Pass, predicted: _Predicted) -> float:
        """How far apart a run's next groups may come: past its first group of steps, where no
        guess may cut it and the class of the lookahead's match has been judged, the verifier's
        self_decode_group_ms, or less where the front end asked for less (session-open's member: it
        matches stop strings in the text); else 0, groups of ``predicted.delivery_steps``. An
        unjudged class learns its hit rate at the next group of RUN_DELIVERY_STEPS, and where it
        pays, the run is cut for a guess that much sooner."""
        if not scoring.step or predicted.may_guess or not self._lookahead.judged(predicted.prediction):
            return 0.0
        asked = live.self_decode_group_ms
        setting_s = self._group_apart_s()
        return setting_s if asked is None else min(setting_s, asked / 1000)

    def _predicted_within(self, live: LiveSession, scoring: _Pass, decided: list[int]) -> list[tuple[Prediction, int]]:
        """What the lookahead predicts after every RUN_DELIVERY_STEPS of a group's ``decided``
        tokens, each with where it starts in them: a group longer than that (a run handed over
        self_decode_group_ms apart) is judged at every RUN_DELIVERY_STEPS tokens as groups of that
        many were, so that a class of match learns its hit rate as fast per token decided. None
        where the group scored forced tokens: a constrained session's groups are short."""
        if scoring.forced:
            return []
        return [
            (self._lookahead.predict(live, (*scoring.context, *decided[:offset]), RUN_DELIVERY_STEPS), offset)
            for offset in range(RUN_DELIVERY_STEPS, len(decided), RUN_DELIVERY_STEPS)
        ]

    def _runs(self, machine: VerifierSession) -> bool:
        """Whether the session's passes go on as greedy runs (_run_ahead): under rule 1, while a
        pass holds every active session. The scorer then starts each pass without waiting for the
        loop to decide the last one, and the loop decides a session's rounds in groups
        (RUN_DELIVERY_STEPS, then self_decode_group_ms apart): at 16 streams a pass came every 70
        ms instead of every 76, its 68 ms of model work unchanged (docs/performance.md, session
        31). With more sessions than a pass holds, runs would take every pass from the sessions
        that wait for their first."""
        return isinstance(machine.rule, GreedyRule) and self._active_sessions() <= self._scoring.max_batch

    def _run_ahead(self, machine: VerifierSession, context: tuple[int, ...], guess: tuple[int, ...]) -> int:
        """Greedy steps the scorer takes after a pass, without waiting for the rounds to be decided
        (docs/design.md, "A verifier round"): under rule 1 the drawn token is the most probable one,
        which the scorer can feed itself. The run lasts until max_new or the period's self_max,
        unless a stop token, a guess or the loop ends it sooner: a run that stopped every 32 steps
        left the model idle while the loop decided the last group and queued the next pass, a
        restart every 33 tokens (docs/performance.md, session 39)."""
        if not self._runs(machine):
            return 0
        decided = len(context) - len(machine.prompt)
        room = machine.contract.max_new - decided
        period_room = machine.control.self_decode_room()
        if period_room is not None:
            room = min(room, period_room - (decided - machine.committed))
        # The pass itself decides one token, and the guess's tokens may be decided before the run.
        return max(0, room - len(guess) - 1)

    async def _self_decode_pass(self, live: LiveSession, scoring: _Pass) -> _Pass | _Held | None:
        """Commit the rounds of one pass, and of the steps of its greedy run that have come with it:
        decided together, appended in one step, released together. Returns the next pass, already
        queued, if there is one, or where short prompts wait for their prefill, what it follows
        (Admissions)."""
        machine = live.machine
        live.cut_run = scoring.cut
        if live.cancelling:
            scoring.cut()
        try:
            logits = await scoring.logits
        except BaseException:
            # The task is cancelled (the session forgotten, the verifier stopping): the scorer
            # stops the run too.
            scoring.withdraw()
            raise
        finally:
            live.cut_run = None
        if logits is None:
            return self._start_pass(live, scoring.context)
        released: list[PendingCommit] = []
        following: _Pass | _Held | None = None
        try:
            rows, fed, after = _ready_rows(scoring, logits)
            pending = machine.decide_self_decoded(rows, fed, self._scoring.load)
            try:
                decided = [token for one in pending for token in one.record.emitted]
                last = pending[-1]
                continues = last.control.self_decoding and last.control.ended is None and not live.cancelling
                # Judged before _follow predicts, whose hit rate then knows this group's tokens
                # (and the lookahead's index takes the session's tokens in order); a group whose
                # append then fails is decided and judged again, a skew of one group on an
                # operational failure. The forced tokens are the grammar's, not the lookahead's:
                # they are always right.
                self._lookahead.judge(scoring.prediction, decided[scoring.forced :])
                for prediction, offset in self._predicted_within(live, scoring, decided):
                    self._lookahead.judge(prediction, decided[offset:])
                # The rounds before the last are released: decided = their tokens + the last one's.
                committed = self._model_sync.sync_soon(machine, len(decided) - 1, decided)
                if continues and self._admissions.first:
                    if scoring.run is not None:
                        scoring.run.cancel()
                    following = _Held(committed)
                elif continues:
                    # The scorer fed the last decided token after every row decided here.
                    run = scoring.run
                    fed_next = run.fed[after] if run is not None and after < len(run.fed) else None
                    greedy = len(pending) == len(rows) and fed_next == decided[-1]
                    following = self._follow(live, dataclasses.replace(scoring, step=after), committed, greedy)
                elif scoring.run is not None:
                    scoring.run.cancel()
                await self._rounds.append_all(live, pending)
            except PartlyAppended as exc:
                # Those before the failed one are in the log: they are committed and released.
                for one in pending[: exc.appended]:
                    self._rounds.release(live, one)
                    released.append(one)
                machine.abandon(pending[exc.appended].ticket)
                raise
            except BaseException:
                machine.abandon(pending[0].ticket)
                raise
            for one in pending:
                self._rounds.release(live, one)
                released.append(one)
        except BaseException:
            scoring.withdraw()
            if isinstance(following, _Pass):
                following.withdraw()
                await asyncio.gather(following.logits, return_exceptions=True)
            self._model_sync.realign_after_failure(machine)
            raise
        finally:
            if released:
                # The pass's rows (its own and its guess's) served the first rounds, and each step
                # of its run after them was a pass of its own.
                machine.stats.self_decoding_passes(1 + max(0, len(released) - 1 - len(scoring.guess)))
            self._rounds.after_commit(live, released)
        return following


def _ready_rows(scoring: _Pass, logits: np.ndarray) -> tuple[list[np.ndarray], tuple[int, ...], int]:
    """The rows of ``scoring``'s pass and of the steps of its run that the scorer has handed over
    after it, one by one (views: sixteen rows copied into one array took 0.7 ms of the loop's time
    at every delivery), the tokens each row after the first follows (the pass's guess, then the
    run's fed tokens), and the index of the first step not among them."""
    rows = list(np.asarray(logits).reshape(-1, np.shape(logits)[-1]))
    fed = list(scoring.guess)
    run, step = scoring.run, scoring.step
    if run is not None:
        while step < len(run.steps) and step < len(run.fed):
            future = run.steps[step]
            if not future.done() or future.cancelled() or future.exception() is not None:
                break
            row = future.result()
            if row is None:
                break
            fed.append(run.fed[step])
            rows.extend(np.asarray(row).reshape(-1, np.shape(row)[-1]))
            step += 1
    return rows, tuple(fed), step
