"""Penalties, logit_bias and min_p in OpenAI and vLLM requests (sdcp.frontend.openai_api): each maps
to its member of the sampling profile in thousandths, left out at its neutral value, and a value out
of OpenAI's or vLLM's range is a 400 naming it (docs/services.md; docs/interpretations.md,
"Penalties, logit_bias and min_p"). With the bundled model's tokenizer, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from sdcp.frontend.client import build_contract
from sdcp.frontend.openai_api import Generation, OpenAIError, parse_generation
from sdcp.frontend.text import TextCodec, load_text_codec
from sdcp.protocol.messages import Sampling

SERVED = ("smollm2",)
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_text_codec("smollm2")


def chat(codec: TextCodec, **body: Any) -> Generation:
    return parse_generation({"messages": CHAT, **body}, codec, served=SERVED, chat=True)


def refused(codec: TextCodec, member: str, value: object) -> None:
    with pytest.raises(OpenAIError) as refusal:
        parse_generation({"prompt": "Hi", member: value}, codec, served=SERVED, chat=False)
    assert refusal.value.status == 400 and refusal.value.param == member, (member, value)


def test_each_member_maps_to_the_profile_in_thousandths(codec: TextCodec) -> None:
    generation = chat(
        codec,
        temperature=0.7,
        seed=4,
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias={"42": 10, "7": -100.0, "1000": 0.5},
    )
    assert generation.rule == 2
    assert generation.sampling == Sampling(
        temperature_milli=700,
        seed=4,
        presence_penalty_milli=500,
        frequency_penalty_milli=-1250,
        repetition_penalty_milli=1100,
        min_p_milli=50,
        logit_bias_milli=((7, -100_000), (42, 10_000), (1000, 500)),
    )
    # The contract the gateway builds carries them: every verifier of a failover gets them.
    contract = build_contract(
        target=b"\x01" * 32, tokenizer=codec.tokenizer_digest, rule=2, sampling=generation.sampling
    )
    assert contract.sampling == generation.sampling


def test_greedy_decoding_carries_what_changes_the_argmax(codec: TextCodec) -> None:
    generation = chat(codec, temperature=0, frequency_penalty=1.0, logit_bias={"5": 3}, min_p=0.5)
    assert generation.rule == 1
    # min_p keeps the most probable token: under rule 1 it changes nothing and is left out.
    assert generation.sampling == Sampling(frequency_penalty_milli=1000, logit_bias_milli=((5, 3000),))
    assert chat(codec, temperature=0, min_p=0.5).sampling is None


def test_neutral_values_are_left_out(codec: TextCodec) -> None:
    plain = chat(codec, temperature=0.5)
    assert plain.sampling == Sampling(temperature_milli=500)
    neutral = chat(
        codec,
        temperature=0.5,
        presence_penalty=0,
        frequency_penalty=0.0,
        repetition_penalty=1,
        min_p=0,
        logit_bias={},
    )
    assert neutral == plain
    assert chat(codec, temperature=0, repetition_penalty=1.0).sampling is None


@pytest.mark.parametrize(
    ("member", "value"),
    [
        ("presence_penalty", 2.01),
        ("presence_penalty", -3),
        ("presence_penalty", "1"),
        ("frequency_penalty", -2.5),
        ("frequency_penalty", True),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", 1e9),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("logit_bias", {"42": 101}),
        ("logit_bias", {"42": -100.5}),
        ("logit_bias", {"42": "10"}),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"49152": 1}),
        ("logit_bias", {"42": 1, "042": 2}),
        ("logit_bias", {str(token): 1 for token in range(301)}),
        ("logit_bias", [[42, 1]]),
    ],
)
def test_a_value_out_of_range_is_a_400_naming_its_member(codec: TextCodec, member: str, value: object) -> None:
    refused(codec, member, value)


def test_the_most_tokens_a_bias_may_name(codec: TextCodec) -> None:
    bias = {str(token): 1 for token in range(300)}
    sampling = chat(codec, temperature=1, logit_bias=bias).sampling
    assert sampling is not None and sampling.logit_bias_milli is not None
    assert len(sampling.logit_bias_milli) == 300
