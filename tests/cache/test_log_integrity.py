"""Stored logs that are damaged: torn tails, bad checksums, undecodable or foreign records."""

from __future__ import annotations

import asyncio
import struct
import threading
import uuid
import zlib
from pathlib import Path

import cbor2
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcp.cache import MLC, CorruptRecord, FileCommitLog, PreconditionFailed, build_uri
from sdcp.cache.commitlog import EMPTY_LOG_ETAG

pytestmark = pytest.mark.timeout(30)

LOG = build_uri("localhost", None, "log", "integrity")


def frame(payload: bytes, checksum: int | None = None) -> bytes:
    return struct.pack(">II", len(payload), zlib.crc32(payload) if checksum is None else checksum) + payload


async def two_record_log(path: Path) -> tuple[FileCommitLog, str]:
    log = FileCommitLog(LOG, path)
    etag = await log.append({"epoch": 1, "round": 1}, if_match=EMPTY_LOG_ETAG)
    etag = await log.append({"epoch": 1, "round": 2}, if_match=etag)
    return log, etag


async def test_torn_tail_is_ignored_by_readers_and_cut_by_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "log"
    _, etag = await two_record_log(path)
    intact = path.stat().st_size
    with path.open("ab") as handle:  # a crash in the middle of writing a third frame
        handle.write(frame(cbor2.dumps({"epoch": 1, "round": 3}))[:7])
    fresh = FileCommitLog(LOG, path)
    snapshot = await fresh.read()
    assert [r["round"] for r in snapshot.records] == [1, 2] and snapshot.etag == etag
    await fresh.append({"epoch": 1, "round": 3}, if_match=etag)
    assert [r["round"] for r in (await FileCommitLog(LOG, path).read()).records] == [1, 2, 3]
    assert path.stat().st_size > intact


async def test_a_log_whose_directory_is_missing_makes_it_and_one_removed_starts_afresh(tmp_path: Path) -> None:
    path = tmp_path / "not" / "yet" / "log"
    log, etag = await two_record_log(path)
    assert [r["round"] for r in (await FileCommitLog(LOG, path).read()).records] == [1, 2]
    path.unlink()
    path.parent.rmdir()
    with pytest.raises(PreconditionFailed):
        await log.append({"epoch": 1, "round": 3}, if_match=etag)
    assert (await log.read()).records == [] and path.is_file()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[:-1] + bytes([data[-1] ^ 0xFF]), id="flipped-byte"),
        pytest.param(lambda data: data + frame(b"\xff\xff"), id="undecodable-cbor"),
        pytest.param(lambda data: data + frame(cbor2.dumps([1, 2])), id="not-a-map"),
        pytest.param(lambda data: data + frame(cbor2.dumps({"round": 3})), id="no-epoch"),
        pytest.param(lambda data: data + frame(b"\xa0", checksum=0), id="bad-checksum"),
    ],
)
async def test_damaged_records_raise_corrupt_record(tmp_path: Path, damage) -> None:
    path = tmp_path / "log"
    _, etag = await two_record_log(path)
    path.write_bytes(damage(path.read_bytes()))
    fresh = FileCommitLog(LOG, path)
    with pytest.raises(CorruptRecord, match="record"):
        await fresh.read()
    with pytest.raises(CorruptRecord):
        await fresh.append({"epoch": 1, "round": 3}, if_match=etag)


async def test_log_replaced_on_disk_is_reread(tmp_path: Path) -> None:
    path = tmp_path / "log"
    log, _ = await two_record_log(path)
    path.unlink()
    snapshot = await log.read()
    assert snapshot.records == [] and snapshot.etag == EMPTY_LOG_ETAG


@pytest.mark.parametrize("part", ["log:c", "log:f"])  # the commit records' list, the fences' list
async def test_foreign_bytes_in_a_redis_log_raise_corrupt_record(redis_url: str, part: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}:"
    async with MLC.from_config(redis_url=redis_url, redis_prefix=prefix) as mlc:
        log = mlc.commit_log(LOG)
        await log.append({"epoch": 1}, if_match=EMPTY_LOG_ETAG)
        client = aioredis.Redis.from_url(redis_url)
        await client.rpush(f"{prefix}{part}:{LOG}", b"\xff\x00")
        await client.aclose()
        with pytest.raises(CorruptRecord):
            await log.read()


@settings(max_examples=60, deadline=None)
@given(garbage=st.binary(min_size=1, max_size=40))
def test_trailing_garbage_never_loses_or_reorders_committed_records(tmp_path_factory, garbage: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "log"
    records = [{"epoch": 1, "round": r} for r in range(3)]
    with path.open("wb") as handle:
        for record in records:
            handle.write(frame(cbor2.dumps(record, canonical=True)))
        handle.write(garbage)
    try:
        snapshot = asyncio.run(FileCommitLog(LOG, path).read())
    except CorruptRecord:
        return
    assert snapshot.records[:3] == records


async def test_appends_of_one_loop_iteration_share_one_worker_job_and_fail_alone(tmp_path: Path, monkeypatch) -> None:
    threads: list[int] = []
    original = FileCommitLog._append_sync

    def recording(self: FileCommitLog, encoded: tuple[tuple[bytes, int, bool], ...], if_match: str) -> str:
        threads.append(threading.get_ident())
        return original(self, encoded, if_match)

    monkeypatch.setattr(FileCommitLog, "_append_sync", recording)
    logs = [
        FileCommitLog(build_uri("localhost", None, "log", f"batch-{index}"), tmp_path / f"log-{index}")
        for index in range(8)
    ]
    outcomes = await asyncio.gather(
        *(
            log.append({"epoch": 1, "round": 1}, if_match=EMPTY_LOG_ETAG if index != 3 else '"stale"')
            for index, log in enumerate(logs)
        ),
        return_exceptions=True,
    )
    assert len(threads) == 8 and len(set(threads)) == 1 and threading.get_ident() not in threads
    assert isinstance(outcomes[3], PreconditionFailed)
    for index, log in enumerate(logs):
        snapshot = await log.read()
        assert [r.get("round") for r in snapshot.records] == ([] if index == 3 else [1])
        if index != 3:
            assert outcomes[index] == snapshot.etag
