"""Drafters: exact published rows, sync after verdicts, pre-drafting, n-gram lookup, registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdcp.models import (
    BadTokens,
    Drafter,
    HFDrafter,
    LoadedModel,
    NgramDrafter,
    UnknownModel,
    UnknownSession,
    load_drafter,
)
from sdcp.models.drafter import session_rng
from sdcp.models.lookup.ngram import prompt_lookup
from sdcp.protocol.messages import Sampling
from sdcp.protocol.sampling import target_distribution

pytestmark = pytest.mark.timeout(60)

WARM = Sampling(temperature_milli=800, top_k=50, seed=3)


@pytest.fixture
def hf_drafter(tiny_draft_loaded: LoadedModel) -> HFDrafter:
    return HFDrafter(tiny_draft_loaded.model, name="hf:tiny-draft")


def _full_logits(drafter: HFDrafter, tokens: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return drafter.model(torch.tensor([tokens])).logits[0].double().numpy()


def test_hf_drafter_publishes_the_rows_it_sampled_from(hf_drafter: HFDrafter, session_ids) -> None:
    session = next(session_ids)
    prompt = [10, 11, 12, 13]
    hf_drafter.open_session(session, prompt)
    result = hf_drafter.draft(session, 5, WARM)
    assert result.q_rows is not None and result.q_rows.dtype == np.float32
    assert result.q_rows.shape == (5, hf_drafter.vocab_size)
    assert len(result.q_rows_bytes()) == 5 * hf_drafter.vocab_size * 4
    # Each row is the sampling profile applied to the drafter's logits after the tokens before it.
    logits = _full_logits(hf_drafter, [*prompt, *result.tokens])
    expected = target_distribution(logits[len(prompt) - 1 : -1], WARM).astype(np.float32)
    np.testing.assert_allclose(result.q_rows, expected, atol=1e-5)
    assert all(result.q_rows[i, token] > 0 for i, token in enumerate(result.tokens))
    assert result.seconds > 0 and hf_drafter.seconds_per_token > 0


def test_hf_drafter_is_reproducible_from_session_and_seed(tiny_draft_loaded: LoadedModel, session_ids) -> None:
    session = next(session_ids)
    drafts = []
    for _ in range(2):
        drafter = HFDrafter(tiny_draft_loaded.model, name="hf:tiny-draft")
        drafter.open_session(session, [1, 2, 3])
        drafts.append(drafter.draft(session, 6, WARM).tokens)
    assert drafts[0] == drafts[1]
    explicit = HFDrafter(tiny_draft_loaded.model, name="hf:tiny-draft")
    explicit.open_session(session, [1, 2, 3])
    assert explicit.draft(session, 6, WARM, session_rng(session, WARM)).tokens == drafts[0]


def test_sync_discards_rejected_positions_and_appends_emitted(hf_drafter: HFDrafter, session_ids) -> None:
    greedy = Sampling(temperature_milli=0)
    session, reference = next(session_ids), next(session_ids)
    prompt = [30, 31, 32]
    hf_drafter.open_session(session, prompt)
    first = hf_drafter.draft(session, 4, greedy)
    committed = [*prompt, *first.tokens[:2], 250]
    hf_drafter.sync(session, committed)
    assert hf_drafter.tokens(session) == tuple(committed)
    hf_drafter.open_session(reference, committed)
    after_sync = hf_drafter.draft(session, 3, greedy)
    fresh = hf_drafter.draft(reference, 3, greedy)
    assert after_sync.tokens == fresh.tokens
    np.testing.assert_allclose(after_sync.q_rows, fresh.q_rows)


def test_pre_draft_continues_from_tentative_state(hf_drafter: HFDrafter, session_ids) -> None:
    greedy = Sampling(temperature_milli=0)
    session, reference = next(session_ids), next(session_ids)
    hf_drafter.open_session(session, [5, 6])
    hf_drafter.open_session(reference, [5, 6])
    first = hf_drafter.draft(session, 3, greedy)
    ahead = hf_drafter.draft(session, 2, greedy)
    assert first.tokens + ahead.tokens == hf_drafter.draft(reference, 5, greedy).tokens
    # The verdict confirms the first round and emits the pre-drafted guess as extra token.
    hf_drafter.sync(session, [5, 6, *first.tokens, ahead.tokens[0]])
    assert hf_drafter.tokens(session) == (5, 6, *first.tokens, ahead.tokens[0])


def test_ngram_proposes_most_recent_longest_match(session_ids) -> None:
    drafter = NgramDrafter(vocab_size=100, n_max=3, n_min=1)
    session = next(session_ids)
    # Suffix (1, 2) occurs twice; the most recent earlier occurrence continues with 7, then 1 2 7 ...
    drafter.open_session(session, [1, 2, 3, 9, 1, 2, 7, 5, 1, 2])
    result = drafter.draft(session, 4, None)
    assert result.tokens == (7, 5, 1, 2)
    assert result.q_rows is not None
    np.testing.assert_array_equal(result.q_rows.sum(axis=1), np.ones(4, dtype=np.float32))
    np.testing.assert_array_equal(result.q_rows.argmax(axis=1), result.tokens)


def test_ngram_without_match_proposes_the_last_token_once(session_ids) -> None:
    drafter = NgramDrafter(vocab_size=50)
    session = next(session_ids)
    drafter.open_session(session, [4, 8, 15, 16, 23, 42])
    assert drafter.draft(session, 2, None).tokens == (42,)
    drafter.sync(session, [3])
    assert drafter.draft(session, 3, None).tokens == (3,)


def test_ngram_continuation_stops_at_the_end_of_the_context(session_ids) -> None:
    drafter = NgramDrafter(vocab_size=50, n_max=2, n_min=1)
    session = next(session_ids)
    # Suffix (6, 7) last occurred just before (8, 6, 7): only three tokens follow it.
    drafter.open_session(session, [6, 7, 8, 6, 7])
    assert drafter.draft(session, 8, None).tokens == (8, 6, 7)


def _prompt_lookup_by_definition(tokens: list[int], m: int, n_max: int, n_min: int) -> list[int]:
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + m]
    return []


def test_prompt_lookup_follows_its_definition() -> None:
    generator = np.random.default_rng(7)
    for _ in range(2000):
        tokens = [int(t) for t in generator.integers(0, 4, size=int(generator.integers(0, 30)))]
        m, n_max = int(generator.integers(1, 9)), int(generator.integers(1, 5))
        n_min = int(generator.integers(1, n_max + 1))
        assert prompt_lookup(tokens, m, n_max=n_max, n_min=n_min) == _prompt_lookup_by_definition(
            tokens, m, n_max, n_min
        )


def test_drafters_satisfy_the_protocol_and_registry(tiny_loaded: LoadedModel) -> None:
    assert isinstance(load_drafter("ngram", vocab_size=257), Drafter)
    hf = load_drafter("hf:tiny-draft", vocab_size=257)
    assert isinstance(hf, HFDrafter) and hf.weights_digest != load_drafter("hf:tiny", vocab_size=257).weights_digest
    with pytest.raises(UnknownModel):
        load_drafter("hf:tiny", vocab_size=1000)
    with pytest.raises(UnknownModel):
        load_drafter("eagle", vocab_size=257)
    with pytest.raises(UnknownModel):
        load_drafter("hf:/nonexistent/model", vocab_size=257)


def test_drafter_errors(hf_drafter: HFDrafter, session_ids) -> None:
    session = next(session_ids)
    with pytest.raises(UnknownSession):
        hf_drafter.draft(session, 1, None)
    with pytest.raises(BadTokens):
        hf_drafter.open_session(session, [])
    hf_drafter.open_session(session, [1])
    with pytest.raises(BadTokens):
        hf_drafter.draft(session, 0, None)
    with pytest.raises(BadTokens):
        hf_drafter.sync(session, [hf_drafter.vocab_size])
    with pytest.raises(ValueError):
        NgramDrafter(vocab_size=10, n_max=1, n_min=2)
