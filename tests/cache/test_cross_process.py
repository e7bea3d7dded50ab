"""Separate OS processes sharing one disk directory: commit-log appends and object visibility."""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
from pathlib import Path
from types import ModuleType

import pytest

from sdcp.cache import MLC, ObjectNotFound, build_uri

pytestmark = pytest.mark.timeout(120)

LOG = build_uri("localhost", None, "log", "cross-process")
SPAWN = multiprocessing.get_context("spawn")  # no fork under a running event loop


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # Spawned children receive the parent's sys.path, so the worker module is importable there by name.
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    return importlib.import_module("cross_process_worker")


def _version(etag: str) -> int:
    return int(etag.strip('"').split("-")[0])


async def test_concurrent_appends_from_processes_are_each_logged_once_in_order(
    worker: ModuleType, tmp_path: Path
) -> None:
    processes, per_process = 4, 12
    with SPAWN.Pool(processes) as pool:
        results = await asyncio.to_thread(
            pool.starmap, worker.append_records, [(str(tmp_path), LOG, w, per_process) for w in range(processes)]
        )
    async with MLC.from_config(disk_dir=tmp_path) as mlc:
        snapshot = await mlc.commit_log(LOG).read()
    successes = [success for per_worker in results for success in per_worker]
    assert len(snapshot.records) == len(successes) == processes * per_process
    versions = sorted(_version(etag) for etag, _ in successes)
    assert versions == list(range(1, processes * per_process + 1))
    for etag, record in successes:
        assert snapshot.records[_version(etag) - 1] == record
    for writer in range(processes):  # each writer's records keep its own order
        seqs = [r["seq"] for r in snapshot.records if r["writer"] == writer]
        assert seqs == list(range(per_process))


async def test_objects_are_visible_across_processes(worker: ModuleType, tmp_path: Path) -> None:
    uris = {build_uri("localhost", bytes(16), "tokens", f"s{i}"): bytes([i]) * 1000 for i in range(3)}
    child = SPAWN.Process(target=worker.put_objects, args=(str(tmp_path), uris))
    child.start()
    await asyncio.to_thread(child.join, 60)
    assert child.exitcode == 0
    async with MLC.from_config(disk_dir=tmp_path) as mlc:
        for uri, data in uris.items():
            assert await mlc.get(uri) == data


async def test_updates_and_deletes_invalidate_other_processes_caches(worker: ModuleType, tmp_path: Path) -> None:
    updated = build_uri("localhost", None, "prompt", "updated")
    deleted = build_uri("localhost", None, "prompt", "deleted")
    async with MLC.from_config(disk_dir=tmp_path) as mlc:
        await mlc.put(updated, b"old")
        await mlc.put(deleted, b"doomed")
        watchers = []
        for uri in (updated, deleted):
            cached, changed, results = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
            process = SPAWN.Process(target=worker.watch_object, args=(str(tmp_path), uri, cached, changed, results))
            process.start()
            watchers.append((process, cached, changed, results))
        for _, cached, _, _ in watchers:
            assert await asyncio.to_thread(cached.wait, 60)
        await mlc.put(updated, b"new")
        await mlc.delete(deleted)
        with pytest.raises(ObjectNotFound):
            await mlc.get(deleted)
        seen = []
        for process, _, changed, results in watchers:
            changed.set()
            seen.append(
                (await asyncio.to_thread(results.get, True, 60), await asyncio.to_thread(results.get, True, 60))
            )
            await asyncio.to_thread(process.join, 60)
            assert process.exitcode == 0
    (before_u, after_u), (before_d, after_d) = seen
    assert before_u == ("before", b"old", ["memory", "disk"])
    assert after_u[:2] == ("after", b"new")
    assert before_d == ("before", b"doomed", ["memory", "disk"])
    assert after_d == ("after", None, [])
