"""Plain llama-cpp-python greedy decoding: the reference of the llama.cpp target's tests.

`Llama.generate` at temperature 0 (argmax, the first of equal logits, as rule 1 takes it), one token
per pass after the prompt, on one thread, with the attention settings of `sdcp.models.llamacpp.target`
(flash attention, ubatches of at most 63 tokens: docs/models.md, "llama.cpp backend").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp

from sdcp.models.llamacpp.target import SEQUENCE_TOKENS_PER_CALL


def exact_llama(gguf: Path, n_ctx: int, **options: Any) -> llama_cpp.Llama:
    """Plain llama-cpp-python with the settings under which its rows are those of the llama.cpp
    target (flash attention, ubatches of at most 63 tokens, one thread); ``options`` add to them
    (``logits_all``, ``n_batch``)."""
    return llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_ubatch=SEQUENCE_TOKENS_PER_CALL,
        flash_attn=True,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
        **options,
    )


def llama_cpp_greedy(gguf: Path, prompts: Sequence[Sequence[int]], max_new: int, n_ctx: int) -> list[list[int]]:
    """``max_new`` tokens after each prompt (end-of-text tokens do not stop it)."""
    llama = exact_llama(gguf, n_ctx)
    return [_generate(llama, list(prompt), max_new) for prompt in prompts]


def _generate(llama: llama_cpp.Llama, prompt: list[int], max_new: int) -> list[int]:
    tokens: list[int] = []
    for token in llama.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(int(token))
        if len(tokens) == max_new:
            break
    return tokens
