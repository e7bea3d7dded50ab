"""The prefix cache's index (sdcp.cache.prefix): chained block hashes bound to a salt, whole blocks
only, the longest prefix found, LRU eviction by bytes, and tokens compared on every hit."""

from __future__ import annotations

import sys
import threading

from sdcp.cache.prefix import BLOCK_TOKENS, SHARE_TOKENS, PrefixIndex, block_hashes, shared_hashes
from sdcp.protocol.messages import MAX_REPORTED_PREFIXES, Role, Status

BLOCK = 4


def index(capacity: int = 1000) -> PrefixIndex:
    return PrefixIndex(capacity_bytes=capacity, block=BLOCK, salt=b"target")


def test_block_hashes_chain_and_bind_the_salt() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, block=BLOCK, salt=b"a")
    assert len(hashes) == 2  # whole blocks only
    assert hashes[0] != block_hashes(tokens, block=BLOCK, salt=b"b")[0]
    # A block's hash depends on every block before it.
    changed = block_hashes([99, *tokens[1:]], block=BLOCK, salt=b"a")
    assert changed[1] != hashes[1]
    assert block_hashes(tokens[:8], block=BLOCK, salt=b"a") == hashes


def test_the_longest_whole_block_prefix_is_found_and_serves_as_far_as_the_tokens_agree() -> None:
    cache = index()
    assert cache.insert(list(range(11)), b"kv-of-11")
    assert cache.lookup([0, 1, 2]) is None  # no whole block
    # Found by its first whole block, the entry serves the agreeing tokens past it too.
    found = cache.lookup([0, 1, 2, 3, 4, 5, 6, 99, 100])
    assert found is not None and found[1] == 7 and found[0].data == b"kv-of-11"
    found = cache.lookup(list(range(20)))
    assert found is not None and found[1] == 11
    assert (cache.queries, cache.hits) == (3 + 9 + 20, 18)
    assert cache.covered(list(range(9))) == 9 and cache.whole_blocks(11) == 8


def test_eviction_is_by_bytes_least_recently_used_first_and_hands_blocks_on() -> None:
    cache = index(capacity=10)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], b"aaaa")  # two blocks
    assert cache.insert([1, 2, 3, 4, 9, 9, 9, 9], b"bbbb")  # shares the first block
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8]) is not None  # "a" is now the most recent
    assert cache.insert([7, 7, 7, 7], b"cccc")  # evicts "b"
    assert cache.held_bytes == 8 and len(cache) == 2
    assert cache.lookup([1, 2, 3, 4, 9, 9, 9, 9]) is not None  # its first block is "a"'s
    assert cache.lookup([1, 2, 3, 4, 9, 9, 9, 9])[1] == 4  # type: ignore[index]
    assert not cache.insert([5, 5, 5, 5], b"x" * 11)  # larger than the whole cache


def test_a_hash_collision_never_serves_another_prefix() -> None:
    cache = index()
    cache.insert([1, 2, 3, 4], b"kv")
    (digest,) = block_hashes([1, 2, 3, 4], block=BLOCK, salt=b"target")
    # Forge the collision: another block's hash points at this entry.
    (other,) = block_hashes([5, 6, 7, 8], block=BLOCK, salt=b"target")
    cache._covering[other] = cache._covering[digest]
    assert cache.lookup([5, 6, 7, 8]) is None


def test_the_reported_prefixes_are_the_shared_names_of_held_entries_newest_first() -> None:
    salt = bytes(64)
    cache = PrefixIndex(capacity_bytes=1 << 20, block=BLOCK_TOKENS, salt=salt)
    older = list(range(2 * SHARE_TOKENS + 5))
    newer = [7, *range(SHARE_TOKENS)]
    cache.insert(older, b"older")
    cache.insert(newer, b"newer", b"tenant")
    assert cache.reported(10) == [
        *shared_hashes(newer, salt=salt, scope=b"tenant"),
        *reversed(shared_hashes(older, salt=salt)),
    ]
    assert len(cache.reported(2)) == 2
    # A status report carries them, bounded: a longer list reads as absent.
    status = Status(
        instance="https://v.test", role=Role.VERIFIER, load=0, queue=0, ttl_ms=1, prefixes=tuple(cache.reported(10))
    )
    assert Status.from_obj(status.to_obj()).prefixes == status.prefixes
    too_many = {**status.to_obj(), "prefixes": [bytes(32)] * (MAX_REPORTED_PREFIXES + 1)}
    assert Status.from_obj(too_many).prefixes is None


def test_what_a_prompt_would_restore_is_asked_from_another_thread_while_entries_come_and_go() -> None:
    """The verifier's event loop asks ``covered`` while the model's thread stores and evicts
    (the cache's own lock): every answer is one the index could give at some moment, never an
    error from an entry evicted between finding its block and reading it."""
    cache = index(capacity=40)
    stored = list(range(12))
    stop = threading.Event()
    failures: list[BaseException] = []

    def churn() -> None:
        try:
            for round_ in range(2000):
                cache.insert(stored, b"x" * 8)
                cache.insert([100 + round_ % 7, 1, 2, 3, 4, 5, 6, 7], b"y" * 16)
                if round_ % 3 == 0:
                    found = cache.lookup(stored)
                    if found is not None:
                        cache.discard(found[0])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            stop.set()

    # Threads take turns every microsecond, so that the race has its chances.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        worker = threading.Thread(target=churn)
        worker.start()
        answers: set[int] = set()
        while not stop.is_set():
            answers.add(cache.covered(stored))
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == [] and answers <= {0, 12}
