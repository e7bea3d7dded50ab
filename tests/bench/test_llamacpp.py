"""The llama.cpp anchors of the benchmark on the bundled model's GGUF: plain greedy decoding is
llama.cpp's own, and its prompt lookup decodes the same tokens except where a near tie rounds the
other way in a pass of several tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sdcp.bench.systems import LlamaCppPromptLookupSystem, LlamaCppTargetSystem
from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.home import sdcp_home
from sdcp.models.registry import end_of_text_tokens
from sdcp.models.weights.fetch import fetch_smollm2, smollm2_dir, smollm2_gguf

MAX_NEW = 24
# One thread: a team of every core spins on its barriers when the test machine's other work holds
# a core, which makes it slow there, not different.
THREADS = 1
# How close two tokens' logits are when a pass of several tokens picks the other one: rounding of
# the 8-bit activations, about a tenth of a logit here; a runner-up is usually whole logits below.
NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def gguf() -> Path:
    fetch_smollm2(sdcp_home())  # what `make test` did already: the model and its GGUF as shipped
    return smollm2_gguf()


@pytest.fixture(scope="module")
def tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def stop(tokenizer: Any) -> list[int]:
    return end_of_text_tokens(tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    workloads = {workload.name: workload.prompts for workload in load_workloads()}
    # Two that prompt lookup drafts for, one it mostly cannot; on the machine this was written on,
    # prompt lookup decoded the first as greedy decoding does and parted at a near tie in the others.
    chosen = [("copyedit", 0), ("copyedit", 1), ("open", 2)]
    return [tokenize_prompt(tokenizer, workloads[name][index]) for name, index in chosen]


def test_llamacpp_target_is_llama_cpp_greedy_decoding(gguf: Path, stop: list[int], prompts: list[list[int]]) -> None:
    system = LlamaCppTargetSystem(gguf, stop, context_tokens=max(map(len, prompts)) + MAX_NEW, threads=THREADS)
    for prompt in prompts:
        result = system.generate(prompt, MAX_NEW)
        assert 0 < len(result.tokens) <= MAX_NEW
        assert result.first_token_ms is not None and len(result.inter_token_ms) == len(result.tokens) - 1
        system.llama.reset()  # as the system does: no KV cache kept from the previous prompt
        completion = system.llama.create_completion(prompt, max_tokens=MAX_NEW, temperature=0)
        assert isinstance(completion, dict)  # not a stream
        # create_completion stops at llama.cpp's end-of-generation tokens and leaves them out.
        answer = [token for token in result.tokens if token not in stop]
        assert completion["choices"][0]["text"] == system.llama.detokenize(answer).decode("utf-8")
        assert completion["usage"]["completion_tokens"] == len(answer)


def test_llamacpp_prompt_lookup_parts_from_greedy_only_at_near_ties(
    gguf: Path, stop: list[int], prompts: list[list[int]]
) -> None:
    # Exactly what the longest generation needs, as the runner asks: the last round's drafts go past
    # it and must still fit llama-cpp-python's arrays.
    context_tokens = max(map(len, prompts)) + MAX_NEW
    target = LlamaCppTargetSystem(gguf, stop, context_tokens=context_tokens, threads=THREADS)
    lookup = LlamaCppPromptLookupSystem(gguf, stop, context_tokens=context_tokens, threads=THREADS)
    for prompt in prompts:
        expected = target.generate(prompt, MAX_NEW).tokens
        tokens = lookup.generate(prompt, MAX_NEW).tokens
        first = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)
        if first is None:
            assert tokens == expected
            continue
        # llama-cpp-python's speculative path is not greedy-exact: where it parts, the two tokens
        # are tied within rounding in llama.cpp's logits after the common prefix.
        lookup.llama.reset()
        lookup.llama.eval(prompt + expected[:first])
        logits = np.asarray(lookup.llama.scores[lookup.llama.n_tokens - 1])
        assert logits.max() - logits[tokens[first]] < NEAR_TIE
        assert logits.max() - logits[expected[first]] < NEAR_TIE
