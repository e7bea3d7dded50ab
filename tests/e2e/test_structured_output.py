"""Structured output and tools as the `openai` package asks for them, on a local SmolLM2 cluster
(#30): every answer to response_format json_schema is in its language on 20 (schema, prompt) pairs
under rule 1 (temperature 0) and under rule 2 (sampling), whatever the drafters propose (about 1 s a
pair on two cores), so are guided_choice and guided_regex; a tool call round trip, and a named
tool_choice's arguments validate. tests/services/test_structured_output_service.py decodes more
constraints on a tiny model."""

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


def _object(**properties: object) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# Strings, numbers and arrays are bounded: every answer ends well within max_tokens.
TEXT = {"type": "string", "maxLength": 16}
PERSON = _object(name=TEXT, age={"type": "integer", "minimum": 0, "maximum": 120}, city=TEXT)
WEATHER = _object(
    sky={"enum": ["sunny", "cloudy", "rainy"]},
    celsius={"type": "integer", "minimum": -40, "maximum": 50},
    windy={"type": "boolean"},
)
TAGS = _object(tags={"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3})
BOOK = _object(title={"type": "string", "maxLength": 30}, year={"type": "integer", "minimum": 1000, "maximum": 2100})
SENTIMENT = _object(
    label={"enum": ["positive", "negative", "neutral"]}, score={"type": "integer", "minimum": 0, "maximum": 10}
)
ANSWER = _object(answer={"type": "integer", "minimum": -1000, "maximum": 1000})
COLOR = _object(name=TEXT, hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"})
YES_NO = _object(yes={"type": "boolean"})
NUMBERS = _object(numbers={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 5})
PRIMARY = {"enum": ["red", "yellow", "blue"]}
CASES = [
    ("Describe a person called Ada who lives in Paris, as JSON.", PERSON),
    ("Bob is 42 and lives in Lima. Give his details as JSON.", PERSON),
    ("What is the weather like today? Answer in JSON.", WEATHER),
    ("Describe a stormy winter day in Oslo as JSON.", WEATHER),
    ("Give up to three tags for a post about cooking pasta, as JSON.", TAGS),
    ("Tag a photo of a mountain hike, in JSON.", TAGS),
    ("Name a famous novel and the year it was published, as JSON.", BOOK),
    ("Describe the book 1984 by George Orwell as JSON.", BOOK),
    ("Classify the sentiment of 'I loved this film' as JSON.", SENTIMENT),
    ("Classify the sentiment of 'The service was slow and rude' as JSON.", SENTIMENT),
    ("What is 7 times 6? Answer in JSON.", ANSWER),
    ("How many legs does a spider have? Answer in JSON.", ANSWER),
    ("What color is the sky? Give its name and hex code as JSON.", COLOR),
    ("Give the name and hex code of the color of grass, as JSON.", COLOR),
    ("Is water wet? Answer in JSON.", YES_NO),
    ("Is the sun cold? Answer in JSON.", YES_NO),
    ("List the first five prime numbers as JSON.", NUMBERS),
    ("List some even numbers below 20, in JSON.", NUMBERS),
    ("Pick a primary color.", PRIMARY),
    ("Which primary color is a banana?", PRIMARY),
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
            max_tokens=64,
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


GET_WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
GET_TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {tool["function"]["name"]: tool for tool in (GET_WEATHER, GET_TIME)}


def test_a_tool_call_round_trip(home: Path) -> None:
    """tools with tool_choice required give a call whose arguments validate, the same streamed as
    deltas; the call and a tool message with its answer give a final answer in text."""
    client = client_of(home)
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    asked: dict[str, Any] = {"model": "smollm2", "tools": list(TOOLS.values()), "max_tokens": 48, "temperature": 0}
    reply = client.chat.completions.create(messages=messages, tool_choice="required", **asked)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name]["function"]["parameters"])
    # Streamed, the same call comes as deltas: its index, id and name first, then its arguments in parts.
    parts = [
        part
        for chunk in client.chat.completions.create(messages=messages, tool_choice="required", stream=True, **asked)
        for part in (chunk.choices[0].delta.tool_calls or [])
    ]
    assert {part.index for part in parts} == {0} and len(parts) > 1
    assert parts[0].id and parts[0].function and parts[0].function.name == call.function.name
    assert "".join(part.function.arguments or "" for part in parts if part.function) == call.function.arguments
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "sunny", "celsius": 21})},
    ]
    final = client.chat.completions.create(messages=messages, **asked).choices[0]
    assert final.finish_reason == "stop" and final.message.content and not final.message.tool_calls, final


@pytest.mark.parametrize("rule", [1, 2])
def test_a_named_tool_choice_gives_arguments_that_validate(home: Path, rule: int) -> None:
    client = client_of(home)
    for prompt, name in [("What time is it in Tokyo?", "get_time"), ("Is it raining in Oslo?", "get_weather")]:
        asked: dict[str, Any] = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": prompt}],
            "tools": list(TOOLS.values()),
            "tool_choice": {"type": "function", "function": {"name": name}},
            "max_tokens": 48,
            **sampling(rule),
        }
        reply = client.chat.completions.create(**asked)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert call.function.name == name
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[name]["function"]["parameters"])
