"""Commit logs (SDCP 6.8): conditional append, one winner per version, fencing, on every backend."""

from __future__ import annotations

import asyncio

import pytest
from tests.cache.racing import race_appenders

from sdcp.cache import MLC, CommitLog, Fenced, InvalidRecord, PreconditionFailed, build_uri
from sdcp.cache.commitlog import EMPTY_LOG_ETAG, MemoryCommitLog

pytestmark = pytest.mark.timeout(60)

LOG = build_uri("localhost", bytes(16), "log", "session-1")


def commit(epoch: int, round_: int, emitted: list[int] | None = None) -> dict[str, object]:
    return {"epoch": epoch, "round": round_, "emitted": emitted or [round_], "committed": round_, "digest": bytes(32)}


async def test_append_read_and_if_match(make_mlc) -> None:
    log = make_mlc().commit_log(LOG)
    empty = await log.read()
    assert empty.records == [] and empty.etag == EMPTY_LOG_ETAG
    assert await log.last_commit() is None
    first = await log.append(commit(1, 1), if_match=empty.etag)
    second = await log.append(commit(1, 2), if_match=first)
    with pytest.raises(PreconditionFailed):
        await log.append(commit(1, 3), if_match=first)
    snapshot = await log.read()
    assert snapshot.records == [commit(1, 1), commit(1, 2)]
    assert snapshot.etag == second and len({EMPTY_LOG_ETAG, first, second}) == 3
    assert await log.last_commit() == commit(1, 2)


async def test_invalid_records_are_refused(make_mlc) -> None:
    log = make_mlc().commit_log(LOG)
    for bad in ([1, 2], {"round": 1}, {"epoch": -1}, {"epoch": True}, {"epoch": 1, "x": object()}):
        with pytest.raises(InvalidRecord):
            await log.append(bad, if_match=EMPTY_LOG_ETAG)  # type: ignore[arg-type]
    with pytest.raises(InvalidRecord):
        await log.fence(-2)
    assert (await log.read()).records == []


async def test_32_concurrent_appenders_one_winner_per_version(make_mlc) -> None:
    mlcs: list[MLC] = [make_mlc() for _ in range(4)]
    logs: list[CommitLog] = [mlcs[i % 4].commit_log(LOG) for i in range(32)]
    await race_appenders(logs, lambda writer: commit(1, writer))


async def test_same_etag_exactly_one_winner(make_mlc) -> None:
    logs = [make_mlc().commit_log(LOG) for _ in range(8)]
    etag = (await logs[0].read()).etag
    results = await asyncio.gather(
        *(log.append(commit(1, i), if_match=etag) for i, log in enumerate(logs)), return_exceptions=True
    )
    assert sum(isinstance(result, str) for result in results) == 1
    assert sum(isinstance(result, PreconditionFailed) for result in results) == 7


async def test_fence_stops_lower_epochs(make_mlc) -> None:
    log = make_mlc().commit_log(LOG)
    etag = await log.append(commit(1, 1), if_match=EMPTY_LOG_ETAG)
    fenced = await log.fence(2)
    with pytest.raises(Fenced):  # the old verifier raced the fence with the etag it had
        await log.append(commit(1, 2), if_match=etag)
    with pytest.raises(Fenced):  # and it cannot get in even with the current etag
        await log.append(commit(1, 2), if_match=fenced)
    after = await log.append(commit(2, 2), if_match=fenced)
    assert await log.fence(2) == after  # the router's retry of the same fence appends nothing
    snapshot = await log.read()
    assert snapshot.records == [commit(1, 1), {"epoch": 2}, commit(2, 2)]
    assert await log.last_commit() == commit(2, 2)


async def test_fence_is_idempotent_and_never_lowers(make_mlc) -> None:
    log = make_mlc().commit_log(LOG)
    first = await log.fence(3)
    assert await log.fence(3) == first  # a router's retry appends nothing
    with pytest.raises(Fenced):
        await log.fence(2)
    etag = await log.append(commit(3, 1), if_match=first)
    assert await log.fence(3) == etag
    assert (await log.read()).records == [{"epoch": 3}, commit(3, 1)]
    assert await log.fence(4) != etag


async def test_fence_racing_appenders_no_stale_record_after_it(make_mlc) -> None:
    logs = [make_mlc().commit_log(LOG) for _ in range(8)]
    outcomes: list[tuple[str, int]] = []
    first_append = asyncio.Event()

    async def old_verifier(writer: int) -> None:
        """Appends epoch-1 records until the fence stops it."""
        round_ = 0
        while True:
            etag = (await logs[writer].read()).etag
            try:
                await logs[writer].append(commit(1, writer * 1000 + round_), if_match=etag)
            except PreconditionFailed:
                continue
            except Fenced:
                outcomes.append(("fenced", writer))
                return
            outcomes.append(("ok", writer))
            first_append.set()
            round_ += 1
            await asyncio.sleep(0)  # the fence and the other writers get their turns between appends

    async def router() -> None:
        await first_append.wait()  # the fence races appenders that are already writing
        await logs[0].fence(2)

    await asyncio.gather(router(), *(old_verifier(i) for i in range(1, 8)))
    records = (await logs[0].read()).records
    fence_at = records.index({"epoch": 2})
    assert all(record["epoch"] == 1 for record in records[:fence_at])
    assert records[fence_at + 1 :] == []
    assert sum(kind == "ok" for kind, _ in outcomes) == fence_at > 0
    assert sorted(writer for kind, writer in outcomes if kind == "fenced") == list(range(1, 8))


async def test_a_log_read_from_a_record_on_is_the_whole_log_from_there(make_mlc) -> None:
    """A router's replay reads only what it has not read (CommitLog.read_from): from every index,
    the same records and ETag as the whole log's, fences in their places."""
    log = make_mlc().commit_log(LOG)
    etag = await log.append(commit(1, 1), if_match=EMPTY_LOG_ETAG)
    etag = await log.append(commit(1, 2), if_match=etag)
    etag = await log.fence(2)
    etag = await log.fence(3)
    etag = await log.append(commit(3, 3), if_match=etag)
    etag = await log.fence(4)
    whole = await log.read()
    assert len(whole.records) == 6
    for start in range(len(whole.records) + 2):
        tail = await log.read_from(start)
        assert (tail.records, tail.etag) == (whole.records[start:], whole.etag)


async def test_records_appended_together_follow_each_other(make_mlc) -> None:
    """append_all: each record conditional on the one before, the etag after the last; a stale
    If-Match or a fence below the records' epoch appends none of them."""
    log = make_mlc().commit_log(LOG)
    first = await log.append(commit(1, 1), if_match=EMPTY_LOG_ETAG)
    together = [commit(1, 2), commit(1, 3), commit(1, 4)]
    with pytest.raises(PreconditionFailed):
        await log.append_all(together, if_match=EMPTY_LOG_ETAG)
    assert (await log.read()).records == [commit(1, 1)]
    etag = await log.append_all(together, if_match=first)
    snapshot = await log.read()
    assert snapshot.records == [commit(1, 1), *together] and snapshot.etag == etag
    assert await log.append_all([], if_match=etag) == etag
    with pytest.raises(PreconditionFailed):
        await log.append(commit(1, 5), if_match=first)
    fenced = await log.fence(2)
    with pytest.raises(Fenced):
        await log.append_all([commit(1, 5), commit(1, 6)], if_match=fenced)
    assert (await log.read()).records == [commit(1, 1), *together, {"epoch": 2}]


async def test_records_appended_together_in_memory_follow_each_other() -> None:
    log = MemoryCommitLog(LOG)
    etag = await log.append_all([commit(1, 1), commit(1, 2)], if_match=EMPTY_LOG_ETAG)
    alone = MemoryCommitLog(LOG)
    sequential = await alone.append(commit(1, 2), if_match=await alone.append(commit(1, 1), if_match=EMPTY_LOG_ETAG))
    assert etag == sequential and (await log.read()).records == (await alone.read()).records
    await log.fence(2)
    with pytest.raises(Fenced):
        await log.append_all([commit(2, 3), commit(1, 4)], if_match=(await log.read()).etag)
    assert len((await log.read()).records) == 3
