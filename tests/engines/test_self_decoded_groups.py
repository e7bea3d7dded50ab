"""Self-decoded rounds in groups (issue 38, "Nothing added per token"): the rows of a pass and of the
greedy-run steps that reach the loop with it are decided together, their records appended in one
step and released together. Each token is still a round of its own with its own record (SDCP
6.5.2), the output is the target's greedy decoding, and an append that lands only partly loses no
token and repeats none."""

from __future__ import annotations

from typing import Any

import pytest
from tests.engines.verifier_pair import PROMPT, SESSION, Pair, decode, greedy_decoding, self_decoding_contract
from tests.waiting import eventually

from sdcp.cache.commitlog import MemoryCommitLog
from sdcp.models.batching import RUN_DELIVERY_STEPS
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.messages import SelfDecodeRequest
from sdcp.protocol.records import replay_commit_log
from sdcp.protocol.router import RouterSession

pytestmark = pytest.mark.timeout(180)

MAX_NEW = 48


async def open_plan(pair: Pair) -> RouterSession:
    assert isinstance(pair.first.target, TargetModel)
    plan = RouterSession(
        session=SESSION,
        epoch=1,
        contract=self_decoding_contract(pair.first.target, 1, max_new=MAX_NEW, self_max=12),
        prompt=PROMPT,
        commit_log=pair.commit_log,
        verifier=pair.first.uri,
    )
    await pair.first.open_session(plan.open_message())
    return plan


async def test_rounds_decided_together_are_rounds_of_their_own(
    pair: Pair, tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    appends: list[int] = []
    append_all = MemoryCommitLog.append_all

    async def counted(self: MemoryCommitLog, records: Any, if_match: str) -> str:
        appends.append(len(records))
        return await append_all(self, records, if_match)

    monkeypatch.setattr(MemoryCommitLog, "append_all", counted)
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
