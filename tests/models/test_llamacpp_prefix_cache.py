"""The llama.cpp target's prefix cache (issue #37): a prefill starts from the KV of the longest whole
block prefix an earlier prefill computed, and nothing changes: every row of every pass is the same,
bit for bit, as without the cache (SDCP 6.4 rule 1 gives the same tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tests.models.greedy_rows import assert_same, greedy_rows

from sdcp.cache.prefix import BLOCK_TOKENS, SHARE_TOKENS
from sdcp.models.backend import Opening
from sdcp.models.llamacpp.target import SEQUENCE_TOKENS_PER_CALL, LlamaCppTarget
from sdcp.models.registry import load_tokenizer
from sdcp.models.weights.fetch import FetchResult, smollm2_gguf

pytestmark = pytest.mark.timeout(600)

BLOCK = BLOCK_TOKENS
STEPS = 6
CAPACITY = 1024


@pytest.fixture(scope="module")
def gguf(smollm2_fetch: FetchResult) -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def text_tokens(smollm2_fetch: FetchResult) -> list[int]:
    tokenizer = load_tokenizer("smollm2")
    text = " ".join(f"Tool {n}: looks up the weather of city number {n} and answers in JSON." for n in range(60))
    tokens = list(tokenizer(text)["input_ids"])
    assert len(tokens) > 8 * SEQUENCE_TOKENS_PER_CALL
    return tokens


def target_of(gguf: Path, cache_bytes: int) -> LlamaCppTarget:
    return LlamaCppTarget(
        gguf,
        gguf.parent / "tokenizer.json",
        threads=2,
        kv_slots=4,
        kv_capacity=CAPACITY,
        prefix_cache_bytes=cache_bytes,
    )


@pytest.fixture(scope="module")
def cold(gguf: Path) -> LlamaCppTarget:
    return target_of(gguf, 0)


def test_prompts_sharing_prefixes_of_every_length_decode_as_without_the_cache(
    gguf: Path, cold: LlamaCppTarget, text_tokens: list[int]
) -> None:
    warm = target_of(gguf, 256 << 20)
    index = warm.prefixes
    assert index is not None
    first = text_tokens[: 5 * BLOCK + 17]
    assert_same(greedy_rows(warm, b"first", first, STEPS), greedy_rows(cold, b"first", first, STEPS))
    assert index.hits == 0 and len(index) == 1
    # Prompts that share with it a prefix ending inside a block, at a block's end, past its end,
    # and one that extends it (an agent's next turn): the shared whole blocks come from the cache.
    for shared in (BLOCK - 1, BLOCK, 2 * BLOCK + 5, 5 * BLOCK, 5 * BLOCK + 17):
        other = [*first[:shared], *text_tokens[6 * BLOCK : 6 * BLOCK + 40]]
        hits_before = index.hits
        assert_same(greedy_rows(warm, b"other", other, STEPS), greedy_rows(cold, b"other", other, STEPS))
        # The cached entry serves the whole blocks, and the shared tokens past them.
        if shared < BLOCK:
            assert index.hits == hits_before
        else:
            assert index.hits - hits_before >= min(shared, len(other) - 1)
    turn = [*first, *text_tokens[7 * BLOCK : 8 * BLOCK]]
    hits_before = index.hits
    assert_same(greedy_rows(warm, b"turn", turn, STEPS), greedy_rows(cold, b"turn", turn, STEPS))
    assert index.hits - hits_before >= len(first)


def test_concurrent_sessions_share_a_prefix_and_eviction_changes_nothing(
    gguf: Path, cold: LlamaCppTarget, text_tokens: list[int]
) -> None:
    # Room for about one prefix's KV (SmolLM2: about 23 KB a position): each new prefix evicts the last.
    warm = target_of(gguf, 6 << 20)
    index = warm.prefixes
    assert index is not None
    system = text_tokens[: 3 * BLOCK]
    prompts = [[*system, *text_tokens[4 * BLOCK + 9 * n : 4 * BLOCK + 9 * n + 20]] for n in range(3)]
    expected = [greedy_rows(cold, b"ref", prompt, STEPS) for prompt in prompts]
    # Two sessions open on one cached prefix at once, decoded in the same passes.
    warm.open_session(b"seed", prompts[0])
    warm.close_session(b"seed")
    for number, prompt in enumerate(prompts[1:], start=1):
        warm.open_session(bytes([number]), prompt)
    rows: dict[int, list[np.ndarray]] = {1: [], 2: []}
    for _ in range(STEPS):
        scored = warm.score([(bytes([n]), ()) for n in rows])
        for n, row in zip(rows, scored, strict=True):
            rows[n].append(row[0].copy())
            warm.commit(bytes([n]), 0, [int(np.argmax(row[0]))])
    for n in rows:
        warm.close_session(bytes([n]))
        assert_same(rows[n], expected[n])
    # Under pressure: long prompts push each other out; every output stays the cold one.
    for n in range(3):
        long_prompt = [*text_tokens[n * 60 : n * 60 + 200], 42]
        assert_same(greedy_rows(warm, b"long", long_prompt, STEPS), greedy_rows(cold, b"long", long_prompt, STEPS))
        assert index.held_bytes <= index.capacity_bytes
    assert len(index) <= 2


def test_a_conversations_next_turn_starts_from_the_ended_turn(
    gguf: Path, cold: LlamaCppTarget, text_tokens: list[int]
) -> None:
    """A session that ended leaves the KV of its prompt and output: the next turn, which repeats
    both, prefills only what is new, and decodes as without the cache."""
    warm = target_of(gguf, 256 << 20)
    index = warm.prefixes
    assert index is not None
    prompt = text_tokens[: 4 * BLOCK + 3]
    answer_steps = 2 * BLOCK + 5
    first_turn = greedy_rows(warm, b"turn-1", prompt, answer_steps)
    assert_same(first_turn, greedy_rows(cold, b"ref", prompt, answer_steps))
    answered = [int(np.argmax(row)) for row in first_turn]
    # The ended session's committed tokens: the prompt, then its answer (the last one not yet fed).
    history = [*prompt, *answered]
    assert len(history) % BLOCK != 1  # some of the history lies past its whole blocks
    assert index.covered(history[:-1]) == len(history) - 1
    next_turn = [*history, *text_tokens[5 * BLOCK : 5 * BLOCK + 11]]
    hits_before = index.hits
    assert_same(greedy_rows(warm, b"turn-2", next_turn, STEPS), greedy_rows(cold, b"turn-2", next_turn, STEPS))
    assert index.hits - hits_before == len(history) - 1


def test_a_prefix_cached_while_its_session_still_extends_it_serves_another_session(
    gguf: Path, cold: LlamaCppTarget, text_tokens: list[int]
) -> None:
    """A prompt whose prefill computed 256 tokens or more is kept at once: a second session opened
    on it while the first still decodes (its sequence growing past the prompt) starts from it, and
    both decode as without the cache."""
    warm = target_of(gguf, 256 << 20)
    index = warm.prefixes
    assert index is not None
    prompt = text_tokens[: SHARE_TOKENS + 30]
    warm.open_session(b"first", prompt)
    assert index.covered(prompt[:-1]) == len(prompt) - 1
    first_rows = []
    for _ in range(STEPS):
        (row,) = warm.score([(b"first", ())])
        first_rows.append(row[0].copy())
        warm.commit(b"first", 0, [int(np.argmax(row[0]))])
    second = [*prompt, *text_tokens[-9:]]
    hits_before = index.hits
    assert_same(greedy_rows(warm, b"second", second, STEPS), greedy_rows(cold, b"second", second, STEPS))
    assert index.hits - hits_before == len(prompt) - 1
    warm.close_session(b"first")
    assert_same(first_rows, greedy_rows(cold, b"first", prompt, STEPS))


def test_prompts_opened_together_decode_as_each_opened_alone(
    gguf: Path, cold: LlamaCppTarget, text_tokens: list[int]
) -> None:
    """Short prompts that wait together are prefilled in the same llama_decode calls
    (Target.open_sessions): every session's rows are those of its prompt opened alone, whether its
    prefix came from the cache, spanned several calls or was a token; an opening that fails (a
    token outside the vocabulary, a session already open) fails alone."""
    together = LlamaCppTarget(
        gguf, gguf.parent / "tokenizer.json", threads=2, kv_slots=8, kv_capacity=CAPACITY, prefix_cache_bytes=256 << 20
    )
    system = text_tokens[: 2 * BLOCK + 3]
    together.open_session(b"seed", [*system, 7])
    together.close_session(b"seed")
    prompts = {
        b"cached": [*system, *text_tokens[3 * BLOCK : 3 * BLOCK + 9]],
        b"long": text_tokens[100 : 100 + 2 * SEQUENCE_TOKENS_PER_CALL + 5],
        b"one": text_tokens[7:8],
        b"short": text_tokens[40:52],
    }
    bad = [*text_tokens[:5], 10**9]
    openings = [Opening(session, tuple(prompt)) for session, prompt in prompts.items()]
    index = together.prefixes
    assert index is not None
    hits = index.hits
    failures = together.open_sessions([*openings[:2], Opening(b"bad", tuple(bad)), *openings[2:], openings[0]])
    assert index.hits - hits >= len(system)  # the cached prompt's prefill started from the seed's KV
    assert [type(failure).__name__ for failure in failures] == ["NoneType"] * 2 + ["BadTokens"] + ["NoneType"] * 2 + [
        "SessionExists"
    ]
    assert not together.has_session(b"bad")
    rows: dict[bytes, list[np.ndarray]] = {session: [] for session in prompts}
    for _ in range(STEPS):
        for session in prompts:
            (row,) = together.score([(session, ())])
            rows[session].append(row[0].copy())
            together.commit(session, 0, [int(np.argmax(row[0]))])
    for session, prompt in prompts.items():
        assert_same(rows[session], greedy_rows(cold, session, prompt, STEPS))
