"""The torch target's prefix cache (issue #37): with it on, a prefill runs in 64-token chunks from
position 0 and the cache keeps whole chunks, so a prefill that starts from cached KV computes what a
cold one computes: every row of every pass is the same, bit for bit (SDCP 6.4 rule 1 unchanged)."""

from __future__ import annotations

import numpy as np
import pytest
from tests.models.greedy_rows import assert_same, greedy_rows

from sdcp.models.hf.target import PREFILL_CHUNK_TOKENS, TargetModel
from sdcp.models.registry import LoadedModel

STEPS = 5
CHUNK = PREFILL_CHUNK_TOKENS


def target_of(loaded: LoadedModel, cache_bytes: int) -> TargetModel:
    return TargetModel(loaded.model, loaded.tokenizer, name="tiny", kv_slots=4, prefix_cache_bytes=cache_bytes)


def text(length: int, seed: int = 0) -> list[int]:
    return [(31 * i + 7 * seed) % 240 + 3 for i in range(length)]


def paired_rows(target: TargetModel, prompts: list[list[int]]) -> list[list[np.ndarray]]:
    sessions = [bytes([n + 1]) * 16 for n in range(len(prompts))]
    for session, prompt in zip(sessions, prompts, strict=True):
        target.open_session(session, prompt)
    rows: list[list[np.ndarray]] = [[] for _ in sessions]
    for _ in range(STEPS):
        scored = target.score([(session, ()) for session in sessions])
        for session, got, row in zip(sessions, rows, scored, strict=True):
            got.append(row[0].copy())
            target.commit(session, 0, [int(np.argmax(row[0]))])
    for session in sessions:
        target.close_session(session)
    return rows


def assert_same_passes(warm: TargetModel, cold: TargetModel, prompts: list[list[int]]) -> None:
    for got, expected in zip(paired_rows(warm, prompts), paired_rows(cold, prompts), strict=True):
        assert_same(got, expected)


@pytest.fixture
def cold(tiny_loaded: LoadedModel) -> TargetModel:
    # A cache that holds nothing: every prefill computes its prompt, in the same chunks.
    return target_of(tiny_loaded, 1)


def test_prompts_sharing_prefixes_of_every_length_decode_as_without_the_cache(
    tiny_loaded: LoadedModel, cold: TargetModel
) -> None:
    warm = target_of(tiny_loaded, 256 << 20)
    index = warm.prefixes
    assert index is not None
    first = text(3 * CHUNK + 20)
    assert_same(greedy_rows(warm, b"first", first, STEPS), greedy_rows(cold, b"first", first, STEPS))
    assert index.hits == 0 and len(index) == 1
    for shared in (CHUNK - 1, CHUNK, CHUNK + 17, 3 * CHUNK, 3 * CHUNK + 20):
        other = [*first[:shared], *text(30, seed=shared)]
        hits_before = index.hits
        assert_same(greedy_rows(warm, b"other", other, STEPS), greedy_rows(cold, b"other", other, STEPS))
        # Whole chunks only, of what the two share.
        assert index.hits - hits_before == min(shared, len(other) - 1) // CHUNK * CHUNK


def test_concurrent_sessions_share_a_prefix_and_eviction_changes_nothing(
    tiny_loaded: LoadedModel, cold: TargetModel
) -> None:
    warm = target_of(tiny_loaded, 256 << 20)
    system = text(2 * CHUNK)
    prompts = [[*system, *text(10 + n, seed=n)] for n in range(3)]
    warm.open_session(b"seed", prompts[0])
    warm.close_session(b"seed")
    # Two sessions on one cached prefix decoded in the same passes, as two cold ones are (torch's
    # rows depend on which sessions share a pass, by float rounding: docs/models.md).
    assert_same_passes(warm, cold, prompts[1:])
    index = warm.prefixes
    assert index is not None and index.hits >= 2 * 2 * CHUNK
    # Room for one prefix's KV: each new prompt evicts the last; every output stays the cold one.
    one = len(index._entries[next(iter(index._entries))].data)  # noqa: SLF001 - the size of one entry
    small = target_of(tiny_loaded, one + one // 2)
    for seed in range(3):
        prompt = text(2 * CHUNK + 5, seed=100 + seed)
        assert_same(greedy_rows(small, b"long", prompt, STEPS), greedy_rows(cold, b"long", prompt, STEPS))
        small_index = small.prefixes
        assert small_index is not None and small_index.held_bytes <= small_index.capacity_bytes
