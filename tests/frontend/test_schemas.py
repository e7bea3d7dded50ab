"""The front end's reading of JSON schemas and regexes (sdcp.frontend.schemas, #39): objects closed
as xgrammar closes them, ASCII classes, tool parameters' $defs hoisted into the call's schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from sdcp.frontend.schemas import SchemaError, ascii_classes, closed_schema, hoisted_parameters
from sdcp.frontend.text import TextCodec, load_text_codec
from sdcp.grammar import GrammarConstraint, grammar_tokenizer
from sdcp.protocol.messages import Constraint


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_text_codec("smollm2")


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [
        (r"\d{4}-\d{2}", "[0-9]{4}-[0-9]{2}"),
        (r"\w+\s\S", "[0-9A-Za-z_]+[ \\t\\n\\r\\f\\v][^ \\t\\n\\r\\f\\v]"),
        (r"[\d.]+", "[0-9.]+"),
        (r"[^\w]", "[^0-9A-Za-z_]"),
        (r"[\D]", r"[\D]"),
        (r"\\d", r"\\d"),
        (r"[]\d]", "[]0-9]"),
        (r"\.\D", r"\.[^0-9]"),
        ("plain", "plain"),
    ],
)
def test_ascii_classes_write_out_what_xgrammar_reads(pattern: str, ascii: str) -> None:
    assert ascii_classes(pattern) == ascii


def test_a_digit_class_allows_ascii_digits_only(codec: TextCodec) -> None:
    tokenizer = grammar_tokenizer(codec.tokenizer.to_str(), codec.vocab_size)
    constraint = Constraint(kind="regex", text=ascii_classes(r"\d"))
    grammar = GrammarConstraint(tokenizer, constraint, codec.end_of_text_tokens(), codec.vocab_size)
    (allowed,) = grammar.allowed([])
    (seven,) = codec.encode("7", add_special_tokens=False)
    assert allowed[seven]
    for digit in ("\u0663", "\U0001fbf8"):  # ARABIC-INDIC THREE, SEGMENTED DIGIT EIGHT
        first = codec.encode(digit, add_special_tokens=False)[0]
        assert not allowed[first]


PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": r"^\w+$"},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "pet": {"anyOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}}, {"type": "null"}]},
        "extra": {"type": "object"},
        "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
    },
    "required": ["name"],
}


def test_closing_closes_every_object_that_names_properties_and_says_nothing_of_others() -> None:
    closed = closed_schema(PERSON, close=True)
    assert isinstance(closed, dict)
    jsonschema.validate({"name": "Ada", "tags": [{"k": "v"}], "pet": {"kind": "cat"}, "extra": {"any": 1}}, closed)
    for wrong in (
        {"name": "Ada", "age": 3},
        {"name": "Ada", "tags": [{"k": "v", "z": 1}]},
        {"name": "Ada", "pet": {"kind": "cat", "z": 1}},
        {"name": "Ada Lovelace"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, closed)
    # A free-form object and one opened explicitly stay open; nothing else is changed.
    jsonschema.validate({"name": "Ada", "open": {"x": 1, "y": 2}}, closed)
    assert closed["properties"]["name"]["pattern"] == "^[0-9A-Za-z_]+$"
    assert closed_schema(PERSON, close=False)["properties"]["tags"]["items"] == PERSON["properties"]["tags"]["items"]  # type: ignore[index]


def test_the_parts_of_an_all_of_stay_open_so_that_both_can_hold() -> None:
    schema = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "type": "object"}
    closed = closed_schema(schema, close=True)
    jsonschema.validate({"a": 1, "b": 2}, closed)


def test_strict_closes_and_refuses_an_object_opened_explicitly() -> None:
    closed = closed_schema({"type": "object", "properties": {"a": {}}}, close=False, strict=True)
    assert closed == {"type": "object", "properties": {"a": {}}, "additionalProperties": False}
    with pytest.raises(SchemaError):
        closed_schema(PERSON, close=False, strict=True)


def test_hoisted_parameters_resolve_their_references_from_a_schema_that_nests_them() -> None:
    parameters = {
        "$defs": {
            "Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}, "v": {"type": "integer"}}}
        },
        "definitions": {"Old": {"type": "string"}},
        "type": "object",
        "properties": {"head": {"$ref": "#/$defs/Node"}, "old": {"$ref": "#/definitions/Old"}, "me": {"$ref": "#"}},
    }
    reference, defs = hoisted_parameters("walk", parameters)
    assert reference == {"$ref": "#/$defs/walk"}
    assert set(defs) == {"walk", "walk.Node", "walk.Old"}
    call = {"type": "object", "properties": {"arguments": reference}, "$defs": defs}
    jsonschema.validate({"arguments": {"head": {"v": 1, "next": {"v": 2}}, "old": "x", "me": {}}}, call)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"arguments": {"head": {"next": {"v": "two"}}}}, call)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"arguments": {"old": 3}}, call)
    assert json.dumps(defs).count("#/$defs/walk") == 4
