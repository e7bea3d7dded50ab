"""Structured output as the `openai` package asks for it, on a local SmolLM2 cluster (#30): every
answer to response_format json_schema, guided_choice and guided_regex is in its language, under
rule 1 (temperature 0) and rule 2 (sampling), whatever the drafters propose. A handful: they are
slow on two cores; tests/services/test_structured_output_service.py has many more on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from sdcp.cluster import LocalCluster

pytestmark = pytest.mark.timeout(600)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "sky": {"enum": ["sunny", "cloudy", "rainy"]},
        "celsius": {"type": "integer", "minimum": -40, "maximum": 50},
        "windy": {"type": "boolean"},
    },
    "required": ["sky", "celsius", "windy"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "required": ["tags"],
    "additionalProperties": False,
}
CASES = [
    ("Describe a person called Ada who lives in Paris, as JSON.", PERSON),
    ("What is the weather like today? Answer in JSON.", WEATHER),
    ("Give up to three tags for a post about cooking pasta, as JSON.", TAGS),
]


def client_of(home: Path) -> openai.OpenAI:
    gateway = LocalCluster(home).gateway
    assert gateway is not None
    return openai.OpenAI(base_url=gateway, api_key="unused", timeout=300, max_retries=0)


def sampling(rule: int) -> dict[str, Any]:
    return {"temperature": 0} if rule == 1 else {"temperature": 0.8, "seed": 30}


@pytest.mark.parametrize("rule", [1, 2])
def test_json_schema_answers_validate(home: Path, rule: int) -> None:
    client = client_of(home)
    for prompt, schema in CASES:
        reply = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
            **sampling(rule),
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_guided_choice_and_regex_answers_are_in_their_language(home: Path) -> None:
    client = client_of(home)
    choices = ["positive", "negative", "neutral"]
    reply = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Is 'I loved this film' positive or negative?"}],
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": choices},
    )
    assert reply.choices[0].message.content in choices
    completion = client.completions.create(
        model="smollm2",
        prompt="A US phone number:",
        max_tokens=20,
        temperature=0.8,
        seed=3,
        extra_body={"guided_regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", completion.choices[0].text), completion
