"""The llama.cpp verifier tests' target and prompt, shared by tests/services/test_verifier_llamacpp.py
and tests/services/test_penalties_llamacpp.py: the bundled GGUF as a llama.cpp target (the `target`
fixture, two sequences of CAPACITY tokens), a prompt that repeats itself so that prompt lookup
proposes the right continuation often but not always (the `prompt` fixture), and the sessions'
bounds."""

from __future__ import annotations

import pytest

from sdcp.models.llamacpp.target import LlamaCppTarget
from sdcp.models.registry import load_target, load_tokenizer

# Repeats itself, so that prompt lookup proposes the right continuation often but not always.
PROMPT_TEXT = (
    "Repeat this list exactly as it is written:\n\n1. Preheat the oven to 180 degrees.\n"
    "2. Mix the flour, sugar and butter in a large bowl.\n3. Add two eggs and stir until smooth.\n\n"
    "1. Preheat the oven to 180 degrees.\n2."
)
MAX_NEW = 40
M_MAX = 8
CAPACITY = 256


@pytest.fixture(scope="module")
def target() -> LlamaCppTarget:
    loaded = load_target("smollm2", backend="llamacpp", kv_slots=2, kv_capacity=CAPACITY, threads=2)
    assert isinstance(loaded, LlamaCppTarget)
    return loaded


@pytest.fixture(scope="module")
def prompt() -> tuple[int, ...]:
    return tuple(load_tokenizer("smollm2")(PROMPT_TEXT)["input_ids"])
