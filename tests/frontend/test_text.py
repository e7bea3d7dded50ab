"""sdcp.frontend.text, the gateway's tokenizer without torch, gives transformers' tokens: plain text, chat
templates, the stop list and the tokenizer digest; its incremental decoding gives the whole text."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from sdcp.frontend.text import ChatTemplateError, IncrementalDecoder, load_text_codec
from sdcp.models.registry import end_of_text_tokens, load_tokenizer
from sdcp.models.weights.digests import tokenizer_digest

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


# Characters of two to four UTF-8 bytes, which SmolLM2 splits over several tokens, and ZWJ emoji.
MULTI_BYTE = [
    "Café ☕, naïve façade; Ωμέγα — «ça va?»",
    "日本語のテキストと한국어 텍스트",
    "🎉👩‍👩‍👧 🇫🇷🇯🇵 family, flags and 🤖 robots",
    "def f(x):\n\treturn x  # ünïcödé\u00a0nbsp\u200bzwsp",
]


def _pieces(decoder: IncrementalDecoder, tokens: list[int], sizes: list[int]) -> list[str]:
    pieces, start = [], 0
    for size in sizes:
        pieces.append(decoder.add(tokens[start : start + size]))
        start += size
    return [*pieces, decoder.finish()]


def _chunk_sizes(total: int, seed: int) -> list[int]:
    """Chunks of 1 to 5 tokens, as a round commits them."""
    rng, sizes = random.Random(seed), list[int]()
    while sum(sizes) < total:
        sizes.append(rng.randint(1, 5))
    return sizes


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decoding_joins_into_the_whole_decode(skip_special_tokens: bool) -> None:
    codec = load_text_codec("smollm2")
    chat = [{"role": "user", "content": MULTI_BYTE[0]}, {"role": "assistant", "content": " ".join(MULTI_BYTE)}]
    sequences = [
        *(codec.encode(text, add_special_tokens=False) for text in MULTI_BYTE),
        codec.encode_chat(chat, add_generation_prompt=False),
        # Any ids at all: bytes that are no UTF-8, characters cut anywhere.
        [random.Random(7).randrange(codec.vocab_size) for _ in range(2000)],
    ]
    for tokens in sequences:
        whole = codec.decode(tokens, skip_special_tokens=skip_special_tokens)
        for sizes in ([1] * len(tokens), [len(tokens)], *(_chunk_sizes(len(tokens), seed) for seed in range(10))):
            decoder = IncrementalDecoder(codec, skip_special_tokens=skip_special_tokens)
            assert "".join(_pieces(decoder, tokens, sizes)) == whole


def test_incremental_decoding_holds_a_character_back_until_its_last_token() -> None:
    codec = load_text_codec("smollm2")
    tokens = codec.encode("ok ☕", add_special_tokens=False)
    # The cup's three bytes come in more than one token: each piece before its last has none of it.
    first_of_cup = next(i for i in range(len(tokens)) if "\ufffd" in codec.decode(tokens[: i + 1]))
    assert codec.decode(tokens[: first_of_cup + 1]).endswith("\ufffd")
    decoder = IncrementalDecoder(codec)
    pieces = _pieces(decoder, tokens, [1] * len(tokens))
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces[: first_of_cup + 1]) == "ok "
    assert "".join(pieces) == "ok ☕" and pieces[-1] == ""
    # A character that never completes comes out as U+FFFD once the tokens end.
    cut = IncrementalDecoder(codec)
    assert "".join(_pieces(cut, tokens[: first_of_cup + 1], [first_of_cup + 1])) == "ok \ufffd"


def test_incremental_decoding_decodes_a_window_not_the_whole_text(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = load_text_codec("smollm2")
    tokens = codec.encode("word " * 400, add_special_tokens=False)
    decoder = IncrementalDecoder(codec)
    decoded: list[int] = []
    original = codec.decode

    def counting(ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        decoded.append(len(ids))
        return original(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(codec, "decode", counting)
    assert "".join(_pieces(decoder, tokens, [1] * len(tokens))) == original(tokens)
    # Each step decodes the previous step's tokens and the new ones, whatever came before.
    assert max(decoded) <= 2


@pytest.mark.parametrize("model", ["smollm2", "tiny"])
def test_the_tokenizer_digest_is_the_verifiers(model: str) -> None:
    assert load_text_codec(model).tokenizer_digest == tokenizer_digest(load_tokenizer(model))


def test_a_warmed_codec_has_done_what_a_first_request_would() -> None:
    """A gateway warms its codec at start: the tokenizer's digest (its whole definition as JSON)
    and the longest token are known before a request needs them."""
    codec = load_text_codec("smollm2")
    assert not {"tokenizer_digest", "max_token_bytes"} & codec.__dict__.keys()
    codec.warm()
    assert codec.__dict__["tokenizer_digest"] == tokenizer_digest(load_tokenizer("smollm2"))
    assert codec.__dict__["max_token_bytes"] >= 1
