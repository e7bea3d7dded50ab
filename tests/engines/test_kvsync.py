"""The verifier's model sync (sdcp.engines.verifier.kvsync): after every round the tiny target's
state of the session holds exactly the tokens the session's state machine has committed, whether
the optimistic commit worked, failed, or the round's record never became durable."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import pytest

from sdcp.engines.verifier.kvsync import ModelSync
from sdcp.models.batching import BatchingScorer
from sdcp.models.errors import InconsistentCommit
from sdcp.models.hf.target import TargetModel
from sdcp.protocol.messages import Action, Assignment, Contract, Proposal, Role, Status
from sdcp.protocol.rules import GREEDY
from sdcp.protocol.verifier import PendingCommit, RoundTicket, VerifierSession

SESSION = bytes(range(16))
REFERENCE_SESSION = b"\xff" * 16
PROMPT = (72, 101, 108, 108, 111)
DRAFTER = "https://drafter.test"
URI = "https://verifier.test"


@pytest.fixture
async def scorer(target: TargetModel) -> AsyncIterator[BatchingScorer]:
    scorer = BatchingScorer(target, window_s=0)
    yield scorer
    scorer.close()


@pytest.fixture
async def reference(target: TargetModel, scorer: BatchingScorer) -> tuple[int, ...]:
    """The target's greedy continuation of the prompt, from a session of its own."""
    return await scorer.run_async(_greedy_continuation, target, 8)


def _greedy_continuation(target: TargetModel, length: int) -> tuple[int, ...]:
    target.open_session(REFERENCE_SESSION, PROMPT)
    tokens: list[int] = []
    for _ in range(length):
        (rows,) = target.score([(REFERENCE_SESSION, ())])
        tokens.append(int(rows[0].argmax()))
        target.commit(REFERENCE_SESSION, 0, tokens[-1:])
    target.close_session(REFERENCE_SESSION)
    return tuple(tokens)


async def _opened(target: TargetModel, scorer: BatchingScorer) -> VerifierSession:
    contract = Contract.from_obj(
        {
            "target": target.weights_digest,
            "tokenizer": b"\x02" * 32,
            "rule": GREEDY.id,
            "m_max": 4,
            "max_new": 64,
            "stop": [],
            "low_rounds": 64,
            "fallback": [Action.FAIL],
        }
    )
    machine = VerifierSession(session=SESSION, epoch=1, contract=contract, prompt=PROMPT)
    machine.assign(
        Assignment(
            session=SESSION,
            epoch=1,
            contract=contract,
            verifier=URI,
            drafter=DRAFTER,
            prompt=PROMPT,
            round=machine.round,
            committed=machine.committed,
            digest=machine.digest,
            m_init=4,
        )
    )
    await scorer.run_async(target.open_session, SESSION, PROMPT)
    return machine


async def _decided(machine: VerifierSession, scorer: BatchingScorer, tokens: tuple[int, ...]) -> PendingCommit:
    """A proposal round of ``tokens`` decided on the model's rows, not yet committed."""
    proposal = Proposal(
        session=SESSION,
        epoch=machine.epoch,
        round=machine.round + 1,
        drafter=DRAFTER,
        base=machine.committed,
        base_digest=machine.digest,
        tokens=tokens,
        status=Status(instance=DRAFTER, role=Role.DRAFTER, load=0, queue=0, ttl_ms=1000),
    )
    ticket = machine.begin_round(proposal, DRAFTER)
    assert isinstance(ticket, RoundTicket)
    rows = await scorer.score_async(SESSION, tokens)
    return machine.decide(ticket, rows, None, 0)


async def _committed_round(
    machine: VerifierSession, scorer: BatchingScorer, sync: ModelSync, tokens: tuple[int, ...]
) -> PendingCommit:
    """A round as the engine commits it: the model sync queued, then the record applied."""
    pending = await _decided(machine, scorer, tokens)
    sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)
    machine.apply(pending)
    return pending


async def _model_tokens(target: TargetModel, scorer: BatchingScorer) -> tuple[int, ...]:
    # Read on the model thread, after everything queued before.
    return await scorer.run_async(target.committed_tokens, SESSION)


async def test_a_verdict_keeps_the_accepted_tokens_and_the_correction(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...]
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    wrong = (reference[2] + 1) % target.vocab_size
    pending = await _decided(machine, scorer, (*reference[:2], wrong))
    assert (pending.verdict.accepted, pending.record.emitted) == (2, reference[:3])

    committed = sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)
    machine.apply(pending)

    assert committed == (*PROMPT, *reference[:3])
    assert await _model_tokens(target, scorer) == committed
    # The KV cache holds them too: the next tokens of the reference are all accepted.
    following = await _committed_round(machine, scorer, sync, reference[3:6])
    assert following.verdict.accepted == 3 and following.record.emitted == reference[3:7]
    assert await _model_tokens(target, scorer) == (*PROMPT, *reference[:7])


async def test_a_commit_the_model_refuses_is_rebuilt_from_the_decided_tokens(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...], caplog: pytest.LogCaptureFixture
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    pending = await _decided(machine, scorer, reference[:2])
    # The model forgets the scored proposal before the commit reaches it: the commit fails.
    scorer.run(target.rollback, SESSION)

    sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)
    machine.apply(pending)

    assert await _model_tokens(target, scorer) == (*PROMPT, *reference[:3])
    following = await _committed_round(machine, scorer, sync, reference[3:5])
    assert following.verdict.accepted == 2
    assert any("rebuilt" in record.getMessage() for record in caplog.records if record.levelno == logging.ERROR)
    caplog.clear()  # the error is this test's own


async def test_a_session_dropped_meanwhile_is_not_rebuilt(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...], caplog: pytest.LogCaptureFixture
) -> None:
    machine = await _opened(target, scorer)
    held = {SESSION}
    sync = ModelSync(URI, target, scorer, held)
    pending = await _decided(machine, scorer, reference[:2])
    scorer.run(target.rollback, SESSION)
    held.discard(SESSION)

    sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)

    assert not await scorer.run_async(target.has_session, SESSION)
    caplog.clear()  # the failed commit's error is this test's own


async def test_a_round_whose_record_failed_leaves_the_model_at_the_committed_tokens(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...]
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    await _committed_round(machine, scorer, sync, reference[:2])
    # The next round's tokens reach the model, then its record is never appended.
    pending = await _decided(machine, scorer, reference[3:6])
    sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)
    sync.realign_after_failure(machine)
    machine.abandon(pending.ticket)

    assert await _model_tokens(target, scorer) == (*PROMPT, *reference[:3])
    retried = await _committed_round(machine, scorer, sync, reference[3:6])
    assert retried.verdict.accepted == 3
    assert await _model_tokens(target, scorer) == (*PROMPT, *reference[:7])


async def test_a_fenced_sessions_model_state_is_left_for_closing(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...]
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    pending = await _decided(machine, scorer, reference[:2])
    sync.sync_soon(machine, pending.verdict.accepted, pending.record.emitted)
    machine.stop_serving()

    sync.realign_after_failure(machine)
    await sync.drop_scored(machine)

    assert await _model_tokens(target, scorer) == (*PROMPT, *reference[:3])
    await sync.close(SESSION)
    assert not target.has_session(SESSION)
    await sync.close(SESSION)  # closing twice changes nothing


async def test_a_failed_proposal_round_drops_the_scored_proposal(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...]
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    pending = await _decided(machine, scorer, reference[:2])
    machine.abandon(pending.ticket)

    await sync.drop_scored(machine)

    with pytest.raises(InconsistentCommit, match="no scored proposal"):
        await scorer.run_async(target.commit, SESSION, 2, reference[:3])
    assert await _model_tokens(target, scorer) == PROMPT


async def test_a_round_that_emits_nothing_drops_the_scored_proposal(
    target: TargetModel, scorer: BatchingScorer, reference: tuple[int, ...]
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    await scorer.score_async(SESSION, reference[:2])
    cancel = machine.cancel(machine.epoch)
    assert cancel.record.emitted == ()

    sync.sync_soon(machine, cancel.verdict.accepted, cancel.record.emitted)
    machine.apply(cancel)

    with pytest.raises(InconsistentCommit, match="no scored proposal"):
        await scorer.run_async(target.commit, SESSION, 2, reference[:3])
    assert await _model_tokens(target, scorer) == PROMPT


async def test_a_repair_queued_while_the_node_stops_is_dropped(target: TargetModel, scorer: BatchingScorer) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    scorer.close()

    sync.realign_after_failure(machine)  # no model state to keep: nothing raised

    assert target.committed_tokens(SESSION) == PROMPT


async def test_closing_a_session_leaves_the_loop_free_while_a_pass_holds_the_target(
    target: TargetModel, scorer: BatchingScorer
) -> None:
    await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    in_pass, pass_may_end = threading.Event(), threading.Event()
    timed_out: list[bool] = []

    def pass_in_progress() -> None:
        with target._lock:  # what a pass holds for its whole length
            in_pass.set()
            # A bound for the failure alone: a close that asks the target on the loop blocks the
            # loop here, and the pass ends by this timeout before the loop runs again.
            timed_out.append(not pass_may_end.wait(30))

    holder = threading.Thread(target=pass_in_progress)
    holder.start()
    await asyncio.to_thread(in_pass.wait)
    closing = asyncio.create_task(sync.close(SESSION))
    await asyncio.sleep(0)

    pass_may_end.set()
    await asyncio.to_thread(holder.join)
    await closing
    assert timed_out == [False]
    assert not await scorer.run_async(target.has_session, SESSION)


async def test_a_close_or_rollback_queued_while_the_node_stops_is_dropped(
    target: TargetModel, scorer: BatchingScorer
) -> None:
    machine = await _opened(target, scorer)
    sync = ModelSync(URI, target, scorer, {SESSION})
    scorer.close()

    await sync.drop_scored(machine)  # no model state to keep: nothing raised
    await sync.close(SESSION)

    assert target.committed_tokens(SESSION) == PROMPT
