"""Rule 1 through these backends equals greedy decoding, whatever the drafter proposes (SDCP 6.4)."""

from __future__ import annotations

import pytest
from tests.models.speculative import RandomDrafter, reference_greedy, speculative_greedy

from sdcp.models import HFDrafter, LoadedModel, NgramDrafter, TargetModel

TINY_PROMPTS = ["The quick brown fox", "hello world, hello world, hello", "a"]
SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "One, two, three, four, five, six,",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drafter_kind", ["random", "ngram", "tiny-draft"])
def test_tiny_speculative_greedy_equals_generate(
    drafter_kind: str, tiny_loaded: LoadedModel, tiny_draft_loaded: LoadedModel, session_ids
) -> None:
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer)
    drafters = {
        "random": lambda: RandomDrafter(target.vocab_size, seed=7),
        "ngram": lambda: NgramDrafter(target.vocab_size),
        "tiny-draft": lambda: HFDrafter(tiny_draft_loaded.model, name="hf:tiny-draft"),
    }
    drafter = drafters[drafter_kind]()
    proposed = accepted = 0
    for text in TINY_PROMPTS:
        prompt = tiny_loaded.tokenizer(text).input_ids
        expected = reference_greedy(tiny_loaded.model, prompt, 40)
        stats = speculative_greedy(target, drafter, next(session_ids), prompt, len(expected), m=4)
        assert stats.tokens == expected
        proposed += stats.proposed
        accepted += stats.accepted
    if drafter_kind == "tiny-draft":
        # The perturbed drafter agrees often but not always: partial acceptance is exercised.
        assert 0 < accepted < proposed


@pytest.mark.timeout(240)
@pytest.mark.parametrize("drafter_kind", ["random", "ngram"])
def test_smollm2_speculative_greedy_equals_generate(
    drafter_kind: str, smollm2_loaded: LoadedModel, session_ids
) -> None:
    target = TargetModel(smollm2_loaded.model, smollm2_loaded.tokenizer, name="smollm2")
    drafter = RandomDrafter(target.vocab_size, seed=11) if drafter_kind == "random" else NgramDrafter(target.vocab_size)
    for text in SMOL_PROMPTS:
        prompt = smollm2_loaded.tokenizer(text).input_ids
        expected = reference_greedy(smollm2_loaded.model, prompt, 24)
        stats = speculative_greedy(target, drafter, next(session_ids), prompt, len(expected), m=5)
        assert stats.tokens == expected
