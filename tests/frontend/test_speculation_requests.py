"""Per-request speculation in OpenAI-style requests (sdcp.frontend.openai_api): the ``speculative``
member (docs/services.md, "Per-request speculation"), a boolean or an object of ``enabled``,
``max_tokens``, ``drafters`` and ``report``, and the 400s naming what is wrong in it. With the
bundled model's tokenizer, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from sdcp.frontend.client import DEFAULT_SELF_MAX, build_contract
from sdcp.frontend.openai_api import OpenAIError, Speculation, parse_generation
from sdcp.frontend.text import TextCodec, load_text_codec
from sdcp.protocol.messages import Action

SERVED = ("smollm2",)
DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_text_codec("smollm2")


def speculation(codec: TextCodec, value: object) -> Speculation:
    return parse_generation({"prompt": "Hi", "speculative": value}, codec, served=SERVED, chat=False).speculation


def test_absent_null_and_the_boolean_forms(codec: TextCodec) -> None:
    plain = parse_generation({"prompt": "Hi"}, codec, served=SERVED, chat=False)
    assert plain.speculation == Speculation() == speculation(codec, None) == speculation(codec, True)
    assert speculation(codec, False) == Speculation(enabled=False)
    # A chat request reads it too.
    chat = parse_generation(
        {"messages": [{"role": "user", "content": "Hi"}], "speculative": {"enabled": False, "report": True}},
        codec,
        served=SERVED,
        chat=True,
    )
    assert chat.speculation == Speculation(enabled=False, report=True)


def test_the_object_form(codec: TextCodec) -> None:
    assert speculation(codec, {"max_tokens": 4, "drafters": [DIGEST, "CD" * 32], "report": True}) == Speculation(
        enabled=True, max_tokens=4, drafters=(bytes.fromhex(DIGEST), bytes.fromhex("cd" * 32)), report=True
    )
    assert speculation(codec, {"max_tokens": 64}).max_tokens == 64
    assert speculation(codec, {}) == Speculation()


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ("yes", "speculative"),
        (1, "speculative"),
        ({"num_speculative_tokens": 3}, "speculative"),
        ({"max_tokens": 0}, "speculative.max_tokens"),
        ({"max_tokens": 65}, "speculative.max_tokens"),
        ({"max_tokens": 2.0}, "speculative.max_tokens"),
        ({"enabled": "no"}, "speculative.enabled"),
        ({"report": 1}, "speculative.report"),
        ({"drafters": []}, "speculative.drafters"),
        ({"drafters": "ab" * 32}, "speculative.drafters"),
        ({"drafters": ["ab" * 31]}, "speculative.drafters"),
        ({"drafters": ["zz" * 32]}, "speculative.drafters"),
        ({"drafters": [DIGEST] * 17}, "speculative.drafters"),
        ({"enabled": False, "max_tokens": 4}, "speculative.enabled"),
        ({"enabled": False, "drafters": [DIGEST]}, "speculative.enabled"),
    ],
)
def test_what_is_wrong_is_a_400_naming_it(codec: TextCodec, value: Any, param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        speculation(codec, value)
    assert refused.value.status == 400 and refused.value.param == param


def test_a_chat_answer_decoded_alone_is_one_self_decoding_period() -> None:
    """A period ends with an event the router answers before the verifier decodes on: the
    contracts the front ends build hold a usual answer (the bench's 96 tokens) in one period, and
    their ladder still has periods enough for any max_new."""
    digest = bytes.fromhex(DIGEST)
    assert build_contract(target=digest, tokenizer=digest, max_new=96).self_max == DEFAULT_SELF_MAX >= 96
    long = build_contract(target=digest, tokenizer=digest, max_new=4096)
    assert long.self_max is not None and long.fallback.count(Action.SELF_DECODE) * long.self_max >= 4096
