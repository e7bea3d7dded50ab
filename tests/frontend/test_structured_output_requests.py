"""Structured output in OpenAI and vLLM requests (sdcp.frontend.openai_api): response_format and the
guided_* members become the session's constraint (docs/interpretations.md, "Structured output"), and
what names no language is a 400 naming its member. With the bundled model's tokenizer, no sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sdcp.frontend.openai_api import OpenAIError, parse_generation
from sdcp.frontend.text import TextCodec, load_text_codec
from sdcp.protocol.messages import Constraint

SERVED = ("smollm2",)
CHAT = [{"role": "user", "content": "Give me a JSON object."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
CLOSED = {**SCHEMA, "additionalProperties": False}


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_text_codec("smollm2")


def constraint_of(codec: TextCodec, **body: Any) -> Constraint | None:
    return parse_generation({"messages": CHAT, **body}, codec, served=SERVED, chat=True).constraint


def refused(codec: TextCodec, **body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as refusal:
        parse_generation({"messages": CHAT, **body}, codec, served=SERVED, chat=True)
    assert refusal.value.status == 400
    return refusal.value


@pytest.mark.parametrize(
    ("body", "kind", "text"),
    [
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
            "json_schema",
            json.dumps(CLOSED),
        ),
        ({"guided_json": SCHEMA}, "json_schema", json.dumps(CLOSED)),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema", json.dumps(CLOSED)),
        ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
        ({"guided_regex": r"\d{4}-\w"}, "regex", "[0-9]{4}-[0-9A-Za-z_]"),
        ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
        ({"guided_grammar": 'start: "a"+'}, "lark", 'start: "a"+'),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", '["x"]'),
        ({"structured_outputs": {"json_object": True}}, "json_schema", '{"type": "object"}'),
        ({"guided_regex": "a+", "guided_decoding_backend": "xgrammar"}, "regex", "a+"),
    ],
)
def test_each_spelling_becomes_the_constraint(codec: TextCodec, body: dict[str, Any], kind: str, text: str) -> None:
    assert constraint_of(codec, **body) == Constraint(kind=kind, text=text)


def test_objects_are_closed_unless_the_gateway_or_the_schema_opens_them(codec: TextCodec) -> None:
    opened = parse_generation(
        {"messages": CHAT, "guided_json": SCHEMA}, codec, served=SERVED, chat=True, close_json_objects=False
    )
    assert opened.constraint == Constraint(kind="json_schema", text=json.dumps(SCHEMA))
    explicit = {**SCHEMA, "additionalProperties": True}
    assert constraint_of(codec, guided_json=explicit) == Constraint(kind="json_schema", text=json.dumps(explicit))


def test_a_strict_schema_is_closed_even_where_the_gateway_leaves_objects_open(codec: TextCodec) -> None:
    described = {"name": "a", "schema": SCHEMA, "strict": True}
    strict = parse_generation(
        {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": described}},
        codec,
        served=SERVED,
        chat=True,
        close_json_objects=False,
    )
    assert strict.constraint == Constraint(kind="json_schema", text=json.dumps(CLOSED))
    opened = {**described, "schema": {**SCHEMA, "additionalProperties": True}}
    assert "additional properties" in str(
        refused(codec, response_format={"type": "json_schema", "json_schema": opened})
    )


def test_a_json_schema_response_format_needs_a_name(codec: TextCodec) -> None:
    error = refused(codec, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    assert error.param == "response_format" and "name" in str(error)


def test_gbnf_becomes_lark_and_text_is_no_constraint(codec: TextCodec) -> None:
    constraint = constraint_of(codec, guided_grammar='root ::= "yes" | "no"')
    assert constraint is not None and constraint.kind == "lark" and "start:" in constraint.text
    assert constraint_of(codec, response_format={"type": "text"}) is None
    assert constraint_of(codec) is None


def test_a_constrained_request_keeps_one_token_stop_strings_out_of_the_stop_tokens(codec: TextCodec) -> None:
    # "}" is one token; as a stop token it could never be text of the JSON output.
    plain = parse_generation({"messages": CHAT, "stop": ["}"]}, codec, served=SERVED, chat=True)
    constrained = parse_generation(
        {"messages": CHAT, "stop": ["}"], "guided_json": SCHEMA}, codec, served=SERVED, chat=True
    )
    (brace,) = codec.encode("}", add_special_tokens=False)
    assert brace in plain.stop_ids and brace not in constrained.stop_ids
    assert set(constrained.stop_ids) == set(codec.end_of_text_tokens())
    assert constrained.stop_texts == ("}",)


@pytest.mark.parametrize(
    ("body", "member"),
    [
        ({"guided_regex": "(["}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1, 2]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_grammar": "root ::= (("}, "guided_grammar"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "x", "yaml": "y"}}, "structured_outputs.yaml"),
        ({"guided_json": SCHEMA, "ignore_eos": True}, "ignore_eos"),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ],
)
def test_what_names_no_language_is_a_400_naming_its_member(codec: TextCodec, body: dict[str, Any], member: str) -> None:
    assert refused(codec, **body).param == member
