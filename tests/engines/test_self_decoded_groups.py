"""Self-decoded rounds in groups (issue 38, "Nothing added per token"): the rows of a pass and of the
greedy-run steps that reach the loop with it are decided together, their records appended in one
step and released together. Each token is still a round of its own with its own record (SDCP
6.5.2), the output is the target's greedy decoding, and an append that lands only partly loses no
token and repeats none."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from tests.engines.verifier_pair import PROMPT, SESSION, Pair, decode, greedy_decoding, self_decoding_contract
from tests.waiting import eventually

from sdcp.cache.commitlog import MemoryCommitLog
from sdcp.engines.verifier import selfdecode
from sdcp.engines.verifier.lookahead import LOOKAHEAD_PRIOR_HIT_RATE, Prediction
from sdcp.futures import settle_soon
from sdcp.models import batching
from sdcp.models.batching import RUN_DELIVERY_STEPS, RUN_DELIVERY_STEPS_MOST
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.messages import SelfDecodeRequest
from sdcp.protocol.records import replay_commit_log
from sdcp.protocol.router import RouterSession

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 48


async def open_plan(
    pair: Pair, *, max_new: int = MAX_NEW, self_max: int = 12, group_ms: int | None = None
) -> RouterSession:
    """The session opened at the first verifier under rule 1, its session-open's
    self_decode_group_ms ``group_ms``."""
    assert isinstance(pair.first.target, TargetModel)
    plan = RouterSession(
        session=SESSION,
        epoch=1,
        contract=self_decoding_contract(pair.first.target, 1, max_new=max_new, self_max=self_max),
        prompt=PROMPT,
        commit_log=pair.commit_log,
        verifier=pair.first.uri,
        self_decode_group_ms=group_ms,
    )
    await pair.first.open_session(plan.open_message())
    return plan


def _counted_appends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The records of each append to a host-memory commit log from now on, counted in order."""
    appends: list[int] = []
    append_all = MemoryCommitLog.append_all

    async def counted(self: MemoryCommitLog, records: Any, if_match: str) -> str:
        appends.append(len(records))
        return await append_all(self, records, if_match)

    monkeypatch.setattr(MemoryCommitLog, "append_all", counted)
    return appends


async def test_rounds_decided_together_are_rounds_of_their_own(
    pair: Pair, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    appends = _counted_appends(monkeypatch)
    plan = await open_plan(pair)
    await decode(pair.first, 1, MAX_NEW)
    output = await pair.first.output(SESSION, 0)
    assert (
        output.final
        and output.tokens == greedy_decoding(tiny_loaded, MAX_NEW)
        and len(output.tokens) > 2 * RUN_DELIVERY_STEPS
    )
    records = (await pair.mlc.commit_log(pair.commit_log).read()).records
    assert [record["round"] for record in records] == list(range(1, len(output.tokens) + 1))
    assert all(len(record["emitted"]) == 1 for record in records)
    replay = replay_commit_log(records, plan.contract.digest, plan.prompt)
    assert replay.tokens == output.tokens
    # The greedy run's steps came to the loop several at a time: fewer appends than rounds.
    assert sum(appends) == len(records) and max(appends) > 1 and len(appends) < len(records)


@pytest.mark.parametrize(
    ("group_ms", "asked_ms"), [(0.0, None), (3_600_000.0, 0), (3_600_000.0, None), (3_600_000.0, 2**64 - 1)]
)
async def test_a_greedy_runs_groups_past_its_first_come_self_decode_group_ms_apart(
    pair: Pair, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, group_ms: float, asked_ms: int | None
) -> None:
    """Where no guess pays, a greedy run's first group is RUN_DELIVERY_STEPS rounds and the later
    ones wait until the last is self_decode_group_ms ago (at most RUN_DELIVERY_STEPS_MOST rounds);
    0 keeps every group at RUN_DELIVERY_STEPS, and so does a session-open that asks for 0 (a front
    end that matches stop strings in the text); the largest a session-open can carry is the
    verifier's own setting. The output is the same. (The groups are counted
    as the scorer hands them over: a loop that lags behind may decide two of them together.)"""
    monkeypatch.setattr(selfdecode, "speculation_length", lambda *_, **__: 0)
    pair.first.settings = dataclasses.replace(pair.first.settings, self_decode_group_ms=group_ms)
    groups = _hand_overs(monkeypatch)
    await _decode_long(pair, tiny_loaded, group_ms=asked_ms)
    assert sum(groups) == LONG_MAX_NEW
    if group_ms and (asked_ms is None or asked_ms >= group_ms):
        assert groups[1] == RUN_DELIVERY_STEPS and max(groups) == RUN_DELIVERY_STEPS_MOST
    else:
        assert max(groups) == RUN_DELIVERY_STEPS


async def test_a_class_of_match_not_yet_judged_keeps_a_runs_groups_short(
    pair: Pair, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the lookahead's prediction continues a class of match whose hit rate it has not judged
    yet, a run's groups stay at RUN_DELIVERY_STEPS, whatever self_decode_group_ms says: the class
    learns at the next group, and where its guesses pay, the run is cut for them that much sooner."""
    monkeypatch.setattr(selfdecode, "speculation_length", lambda *_, **__: 0)
    pair.first.settings = dataclasses.replace(pair.first.settings, self_decode_group_ms=3_600_000.0)
    unjudged = Prediction(tokens=(0,) * RUN_DELIVERY_STEPS, match=(True, 6), hit_rate=LOOKAHEAD_PRIOR_HIT_RATE)
    monkeypatch.setattr(pair.first.lookahead, "predict", lambda *_, **__: unjudged)
    monkeypatch.setattr(pair.first.lookahead, "judge", lambda *_, **__: None)
    groups = _hand_overs(monkeypatch)
    await _decode_long(pair, tiny_loaded)
    assert sum(groups) == LONG_MAX_NEW and max(groups) == RUN_DELIVERY_STEPS


async def test_a_long_group_is_judged_every_so_many_tokens(
    pair: Pair, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group of RUN_DELIVERY_STEPS_MOST rounds is judged as that many groups of RUN_DELIVERY_STEPS
    were: the lookahead's prediction at its start against all its tokens, and what it predicts
    after every RUN_DELIVERY_STEPS of them against the tokens after those, so that a class of
    match learns its hit rate per token decided, however long the groups."""
    monkeypatch.setattr(selfdecode, "speculation_length", lambda *_, **__: 0)
    pair.first.settings = dataclasses.replace(pair.first.settings, self_decode_group_ms=3_600_000.0)
    judged: list[int] = []
    judge = pair.first.lookahead.judge

    def recorded(prediction: Prediction, decided: Sequence[int]) -> None:
        judged.append(len(decided))
        judge(prediction, decided)

    monkeypatch.setattr(pair.first.lookahead, "judge", recorded)
    await _decode_long(pair, tiny_loaded)
    # A group of at least RUN_DELIVERY_STEPS_MOST rounds (two, where the loop lagged behind the
    # scorer) judged at its start and after every RUN_DELIVERY_STEPS tokens.
    times = RUN_DELIVERY_STEPS_MOST // RUN_DELIVERY_STEPS
    assert any(
        judged[start] >= RUN_DELIVERY_STEPS_MOST
        and judged[start : start + times] == list(range(judged[start], 0, -RUN_DELIVERY_STEPS))[:times]
        for start in range(len(judged))
    )


LONG_MAX_NEW = 1 + RUN_DELIVERY_STEPS + RUN_DELIVERY_STEPS_MOST + 8


def _hand_overs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows the scorer hands to the loop at each hand-over from now on (a pass's rows, a run's
    group of steps), counted in order; the steps a run ends without rows are not counted."""
    groups: list[int] = []

    def recording(loop: asyncio.AbstractEventLoop, outcomes: list[tuple[object, object]]) -> None:
        rows = sum(1 for _, outcome in outcomes if isinstance(outcome, np.ndarray))
        if rows:
            groups.append(rows)
        settle_soon(loop, outcomes)

    monkeypatch.setattr(batching, "settle_soon", recording)
    return groups


async def _decode_long(pair: Pair, tiny_loaded: LoadedModel, *, group_ms: int | None = None) -> None:
    """A session of LONG_MAX_NEW tokens, self-decoded to its end in one period under rule 1 (its
    session-open's self_decode_group_ms ``group_ms``): its output is the target's greedy decoding."""
    await open_plan(pair, max_new=LONG_MAX_NEW, self_max=LONG_MAX_NEW, group_ms=group_ms)
    await decode(pair.first, 1, LONG_MAX_NEW)
    output = await pair.first.output(SESSION, 0)
    assert output.final and output.tokens == greedy_decoding(tiny_loaded, LONG_MAX_NEW)
    assert len(output.tokens) == LONG_MAX_NEW


async def test_a_group_appended_in_part_releases_what_landed_and_goes_on_from_there(
    pair: Pair, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log that appends record by record (Redis, a remote MLC node) may fail in the middle of a
    group: the records before the failure are committed and released, the period ends, and the
    next one goes on after them, with nothing lost or repeated."""
    append_all = MemoryCommitLog.append_all
    failures: list[int] = []

    async def failing_once(self: MemoryCommitLog, records: Any, if_match: str) -> str:
        if len(records) > 2 and not failures:
            failures.append(len(records))
            etag = await append_all(self, records[:2], if_match)
            raise ConnectionError(f"the store went away after 2 of {len(records)} records ({etag})")
        return await append_all(self, records, if_match)

    monkeypatch.setattr(MemoryCommitLog, "append_all", failing_once)
    plan = await open_plan(pair)
    await decode(pair.first, 1, MAX_NEW)
    assert failures, "no group of more than two rounds was appended"
    output = await pair.first.output(SESSION, 0)
    assert output.final and output.tokens == greedy_decoding(tiny_loaded, MAX_NEW)
    records = (await pair.mlc.commit_log(pair.commit_log).read()).records
    assert [record["round"] for record in records] == list(range(1, len(output.tokens) + 1))
    assert replay_commit_log(records, plan.contract.digest, plan.prompt).tokens == output.tokens


async def test_a_group_whose_append_is_fenced_releases_none_of_it(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDCP 6.3: an append refused by a fence discards the rounds, releases no output and stops
    serving the session, for every round of the group."""
    append_all = MemoryCommitLog.append_all
    fenced: list[int] = []

    async def fenced_before_a_group(self: MemoryCommitLog, records: Any, if_match: str) -> str:
        if len(records) > 1 and not fenced:
            fenced.append(len(records))
            await self.fence(2)
        return await append_all(self, records, if_match)

    monkeypatch.setattr(MemoryCommitLog, "append_all", fenced_before_a_group)
    await open_plan(pair)
    live = pair.first.sessions[SESSION]
    released = live.machine.committed
    await pair.first.self_decode(SelfDecodeRequest(session=SESSION, epoch=1))
    await eventually(lambda: live.machine.fenced)
    assert fenced, "no group of more than one round was appended"
    records = (await pair.mlc.commit_log(pair.commit_log).read()).records
    assert records[-1] == {"epoch": 2}
    # What was released is exactly what the log holds before the fence; nothing of the group.
    assert live.machine.committed - released == len(records) - 1
    assert not live.machine.self_decoding and not live.machine.verifying
