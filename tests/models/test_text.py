"""sdcp.text, the gateway's tokenizer without torch, gives transformers' tokens: plain text, chat
templates and the stop list."""

from __future__ import annotations

import pytest

from sdcp.models.registry import end_of_text_tokens, load_tokenizer
from sdcp.text import ChatTemplateError, load_text_codec

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Correct the spelling: 'teh cat sat'"},
        {"role": "assistant", "content": "The cat sat."},
        {"role": "user", "content": "Now in French, with accents: é à ç"},
    ],
]
TEXTS = ["The capital of France is", "def f(x):\n    return x  # tabs\tand ünïcödé", "  leading spaces"]


@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_text_encodes_and_decodes_as_transformers(model: str) -> None:
    codec, tokenizer = load_text_codec(model), load_tokenizer(model)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert codec.encode(text) == list(ids)
        assert codec.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert codec.end_of_text_tokens() == end_of_text_tokens(tokenizer)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_templates_render_as_transformers(messages: list[dict[str, str]]) -> None:
    codec, tokenizer = load_text_codec("smollm2"), load_tokenizer("smollm2")
    for generation_prompt in (True, False):
        expected = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=generation_prompt, tokenize=True
        )
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert codec.encode_chat(messages, add_generation_prompt=generation_prompt) == expected


def test_a_model_without_a_chat_template_says_so() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_text_codec("tiny").encode_chat(CONVERSATIONS[0])
