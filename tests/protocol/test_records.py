"""Commit-log records and log replay (SDCP 6.8, 6.9)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from sdcp.protocol.problems import BadMessage
from sdcp.protocol.records import CommitRecord, FenceRecord, parse_log_record, replay_commit_log

CONTRACT_DIGEST = b"\x09" * 32
PROMPT = (5, 6)


def d0() -> bytes:
    return hashlib.sha256(
        b"SDCP-PREFIX-1\x00" + CONTRACT_DIGEST + struct.pack(">I", 2) + struct.pack(">II", *PROMPT)
    ).digest()


def step(digest: bytes, tokens: tuple[int, ...]) -> bytes:
    for token in tokens:
        digest = hashlib.sha256(digest + struct.pack(">I", token)).digest()
    return digest


def test_records_round_trip() -> None:
    record = CommitRecord(2, 7, (1, 2), 9, b"\x05" * 32)
    assert parse_log_record(record.to_obj()) == record
    assert parse_log_record(FenceRecord(3).to_obj()) == FenceRecord(3)


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"epoch": -1},
        {"epoch": True},
        {"epoch": 1, "round": 1},
        [1],
        {"epoch": 1, "round": 1, "emitted": [1], "committed": 1, "digest": b"x"},
        {"epoch": 1, "round": 1, "emitted": [-1], "committed": 1, "digest": b"x" * 32},
    ],
)
def test_malformed_records_are_rejected(bad: object) -> None:
    with pytest.raises(BadMessage):
        parse_log_record(bad)


def test_replay_across_a_fence() -> None:
    first = step(d0(), (1, 2))
    second = step(first, (3,))
    log = [
        CommitRecord(1, 1, (1, 2), 2, first).to_obj(),
        FenceRecord(2).to_obj(),
        CommitRecord(2, 2, (3,), 3, second).to_obj(),
    ]
    replay = replay_commit_log(log, CONTRACT_DIGEST, PROMPT)
    assert replay.tokens == (1, 2, 3) and replay.digest == second
    assert replay.round == 2 and replay.epoch == 2


def test_replay_of_an_empty_log_is_the_prompt() -> None:
    replay = replay_commit_log([], CONTRACT_DIGEST, PROMPT)
    assert replay.tokens == () and replay.digest == d0() and replay.round == 0


@pytest.mark.parametrize(
    "log",
    [
        [CommitRecord(1, 1, (1, 2), 3, b"\x00" * 32).to_obj()],
        [CommitRecord(1, 1, (1, 2), 2, b"\x00" * 32).to_obj()],
        [FenceRecord(3).to_obj(), FenceRecord(2).to_obj()],
    ],
)
def test_replay_refuses_a_log_that_does_not_chain(log: list[object]) -> None:
    with pytest.raises(BadMessage):
        replay_commit_log(log, CONTRACT_DIGEST, PROMPT)


def test_replay_refuses_repeated_round() -> None:
    first = step(d0(), (1,))
    second = step(first, (2,))
    log = [CommitRecord(1, 1, (1,), 1, first).to_obj(), CommitRecord(1, 1, (2,), 2, second).to_obj()]
    with pytest.raises(BadMessage):
        replay_commit_log(log, CONTRACT_DIGEST, PROMPT)


def test_token_list_objects_round_trip_and_reject_anything_else() -> None:
    from sdcp.protocol.records import decode_token_list, encode_token_list

    assert decode_token_list(encode_token_list([0, 5, 2**32 - 1]), "tokens") == (0, 5, 2**32 - 1)
    assert decode_token_list(encode_token_list([]), "tokens") == ()
    for bad in (
        b"\xff",
        encode_token_list([1])[:-1],
        b"\xa0",
        b"\x82\x01\xf5",
        b"\x81\x1b\x00\x00\x00\x01\x00\x00\x00\x00",
    ):
        with pytest.raises(BadMessage):
            decode_token_list(bad, "tokens")
