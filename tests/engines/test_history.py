"""Finished sessions' output through the MLC (sdcp.engines.history): publications by several
verifiers land in one bounded index, a reader takes each entry once and at most N per refresh, and
scopes keep owners apart, and a drafter warms at its start from the directories of the owners it is
configured for only. Two MLC instances over one disk directory stand for two hosts."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sdcp.cache import MLC
from sdcp.engines.history import (
    HistoryDirectory,
    HistoryIndex,
    HistoryReader,
    directory_uri,
    entry_uri,
    history_scope_key,
    index_uri,
    list_scope,
    publish_output,
    scope_key_of,
    warm,
)
from sdcp.protocol.messages import Action, Contract

pytestmark = pytest.mark.timeout(60)

OWNER = "https://gateway-a.example"


def contract(scope: bytes | None = None) -> Contract:
    return Contract(
        target=bytes(32),
        tokenizer=bytes([1]) * 32,
        rule=1,
        m_max=8,
        max_new=64,
        stop=(),
        low_rounds=4,
        fallback=(Action.REDUCE,),
        scope=scope,
    )


@pytest.fixture
async def mlcs(tmp_path: Path) -> AsyncIterator[tuple[MLC, MLC]]:
    first = MLC.from_config(authority="local", disk_dir=tmp_path / "mlc")
    second = MLC.from_config(authority="local", disk_dir=tmp_path / "mlc")
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


async def publish(mlc: MLC, key: bytes, output: list[int], keep: int = 256) -> bool:
    return await publish_output(
        mlc, contract=contract(), key=key, session=os.urandom(16), epoch=1, output=output, keep=keep
    )


class Learned:
    def __init__(self) -> None:
        self.outputs: list[tuple[int, ...]] = []

    async def __call__(self, output: tuple[int, ...]) -> None:
        self.outputs.append(output)


def test_scopes_keep_owners_targets_and_kvsp_scopes_apart() -> None:
    key = history_scope_key(contract(), OWNER, "owner")
    assert len(key) == 16
    assert key == history_scope_key(contract(), OWNER, "owner")
    assert key != history_scope_key(contract(), "https://gateway-b.example", "owner")
    assert key != history_scope_key(contract(), None, "owner")
    assert key != history_scope_key(contract(scope=bytes(16)), OWNER, "owner")
    # Widened to the target, owners share; owner-less sessions under "owner" stay apart from them.
    widened = history_scope_key(contract(), OWNER, "target")
    assert widened == history_scope_key(contract(), "https://gateway-b.example", "target")
    assert widened != history_scope_key(contract(), None, "owner")


async def test_concurrent_publishers_all_land_in_the_index(mlcs: tuple[MLC, MLC]) -> None:
    first, second = mlcs
    key = history_scope_key(contract(), OWNER, "owner")
    # Conditional puts on the index's ETag: each lost race is retried on the new version.
    results = await asyncio.gather(*(publish(mlc, key, [n, n + 1]) for n in range(6) for mlc in (first, second)))
    assert all(results)
    index = HistoryIndex.decode(await first.get(index_uri("local", contract(), key)))
    assert [entry.seq for entry in index.entries] == list(range(12))
    learned = Learned()
    assert (
        await HistoryReader(second, entries=256, refresh_s=0).refresh(index_uri("local", contract(), key), learned)
        == 12
    )
    assert sorted(learned.outputs) == sorted((n, n + 1) for n in range(6) for _ in range(2))


async def test_the_index_and_the_reader_are_bounded(mlcs: tuple[MLC, MLC]) -> None:
    writer, reader_mlc = mlcs
    key = history_scope_key(contract(), OWNER, "owner")
    uri = index_uri("local", contract(), key)
    sessions = [os.urandom(16) for _ in range(7)]
    for n, session in enumerate(sessions):
        await publish_output(writer, contract=contract(), key=key, session=session, epoch=1, output=[n] * 3, keep=5)
    # The index keeps the newest five; the entries it pushed out are deleted.
    index = HistoryIndex.decode(await writer.get(uri))
    assert [entry.seq for entry in index.entries] == [2, 3, 4, 5, 6]
    for session in sessions[:2]:
        assert not await writer.exists(entry_uri("local", contract(), key, session, 1))
    # A reader takes the newest N of what it has not seen, oldest first, each entry once.
    reader = HistoryReader(reader_mlc, entries=3, refresh_s=0)
    learned = Learned()
    assert await reader.refresh(uri, learned) == 3
    assert learned.outputs == [(4,) * 3, (5,) * 3, (6,) * 3]
    assert await reader.refresh(uri, learned) == 0
    await publish_output(writer, contract=contract(), key=key, session=os.urandom(16), epoch=1, output=[9], keep=5)
    assert await reader.refresh(uri, learned) == 1
    assert learned.outputs[-1] == (9,)
    # Within refresh_s the scope is not read again.
    slow = HistoryReader(reader_mlc, entries=3, refresh_s=3600)
    assert await slow.refresh(uri, Learned()) == 3
    assert not slow.due(uri)
    assert await slow.refresh(uri, Learned()) == 0


async def test_another_owners_scope_is_not_read(mlcs: tuple[MLC, MLC]) -> None:
    writer, reader_mlc = mlcs
    await publish(writer, history_scope_key(contract(), OWNER, "owner"), [1, 2, 3])
    other = index_uri("local", contract(), history_scope_key(contract(), "https://gateway-b.example", "owner"))
    learned = Learned()
    assert await HistoryReader(reader_mlc, entries=256, refresh_s=0).refresh(other, learned) == 0
    assert learned.outputs == []


async def test_a_lost_index_starts_a_new_generation(mlcs: tuple[MLC, MLC]) -> None:
    writer, reader_mlc = mlcs
    key = history_scope_key(contract(), OWNER, "owner")
    uri = index_uri("local", contract(), key)
    reader = HistoryReader(reader_mlc, entries=256, refresh_s=0)
    await publish(writer, key, [1])
    await publish(writer, key, [2])
    assert await reader.refresh(uri, Learned()) == 2
    # The store lost the index (evicted, wiped): numbering starts again, and the reader with it.
    await writer.delete(uri)
    await publish(writer, key, [3])
    learned = Learned()
    assert await reader.refresh(uri, learned) == 1
    assert learned.outputs == [(3,)]
    # An index that is not ours is replaced by the next publication.
    await writer.put(uri, b"\x01")
    assert await reader.refresh(uri, Learned()) == 0
    await publish(writer, key, [4])
    assert HistoryIndex.decode(await writer.get(uri)).entries[-1].seq == 0


async def test_a_drafter_warms_from_the_directories_of_its_owners_only(mlcs: tuple[MLC, MLC]) -> None:
    writer, reader_mlc = mlcs
    other = "https://gateway-b.example"
    scopes = {
        (owner, scope): history_scope_key(contract(scope), owner, "owner")
        for owner in (OWNER, other)
        for scope in (None, bytes(16))
    }
    for (owner, scope), key in scopes.items():
        await publish_output(
            writer, contract=contract(scope), key=key, session=os.urandom(16), epoch=1, output=[7, len(owner)], keep=8
        )
        directory = directory_uri("local", owner, "owner")
        # Listing is idempotent: a scope appears once however often its sessions finish.
        for _ in range(2):
            assert await list_scope(writer, directory=directory, index=index_uri("local", contract(scope), key))
    listed = HistoryDirectory.decode(await writer.get(directory_uri("local", OWNER, "owner")))
    assert listed.scopes == tuple(
        index_uri("local", contract(scope), scopes[OWNER, scope]) for scope in (None, bytes(16))
    )

    learned: list[tuple[bytes, tuple[int, ...]]] = []

    async def learn(key: bytes, output: tuple[int, ...]) -> None:
        learned.append((key, output))

    reader = HistoryReader(reader_mlc, entries=256, refresh_s=3600)
    directories = [directory_uri("local", OWNER, "owner")]
    assert await warm(reader, directories, learn, lambda: False) == 2
    # Each output under its own scope's key, the most recently listed scope first; nothing of the other owner.
    assert learned == [(scopes[OWNER, bytes(16)], (7, len(OWNER))), (scopes[OWNER, None], (7, len(OWNER)))]
    # The reader now stands past them: an assignment within refresh_s reads nothing again.
    assert not reader.due(index_uri("local", contract(), scopes[OWNER, None]))
    # A full history stops the warming before the next scope.
    again: list[tuple[bytes, tuple[int, ...]]] = []

    async def keep(key: bytes, output: tuple[int, ...]) -> None:
        again.append((key, output))

    assert await warm(HistoryReader(reader_mlc, entries=256, refresh_s=0), directories, keep, lambda: bool(again)) == 1


async def test_directories_are_bounded_and_name_only_our_indexes(mlcs: tuple[MLC, MLC]) -> None:
    writer, _ = mlcs
    directory = directory_uri("local", OWNER, "owner")
    indexes = [index_uri("local", contract(), os.urandom(16)) for _ in range(5)]
    for index in indexes:
        assert await list_scope(writer, directory=directory, index=index, keep=3)
    assert HistoryDirectory.decode(await writer.get(directory)).scopes == tuple(indexes[2:])
    # Under "target" every owner shares one directory; under "owner" each has its own.
    assert directory_uri("local", OWNER, "target") == directory_uri("local", "https://gateway-b.example", "target")
    assert directory != directory_uri("local", "https://gateway-b.example", "owner")
    assert directory != directory_uri("local", OWNER, "target")
    # What a drafter files a listed index's outputs under is the key the index's own name carries.
    key = history_scope_key(contract(), OWNER, "owner")
    assert scope_key_of(index_uri("local", contract(), key)) == key
    for foreign in (directory, "mlc://local/-/log/" + key.hex(), "https://example/x", "mlc://local/-/history/zz"):
        assert scope_key_of(foreign) is None
