"""JSON schemas and regular expressions as the OpenAI front end reads them, before they become a
session's constraint (docs/interpretations.md, "Closed JSON objects" and "ASCII classes").

The constraint languages (SDCP's json_schema and regex kinds, llguidance's reading) stay as they
are; the front end writes out what the client libraries expect of vLLM's default engine
(xgrammar): an object schema that names its properties allows no others unless it says so, and
``\\d``, ``\\w``, ``\\s`` are ASCII classes. Tool parameters keep their ``$defs`` where the call's
schema nests them (``hoisted_parameters``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["SchemaError", "ascii_classes", "closed_schema", "hoisted_parameters"]


class SchemaError(ValueError):
    """A schema the front end cannot write out as asked (a strict schema that opens an object)."""


# Keywords whose value is a schema, a list of schemas or a map of names to schemas.
_SCHEMA_VALUED = frozenset(
    {"additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames"}
    | {"unevaluatedProperties", "unevaluatedItems", "additionalItems"}
)
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# What makes a schema an object with named properties: only these are closed (a bare
# {"type": "object"} stays any object, as a free-form dict field means).
_NAMES_PROPERTIES = ("properties", "required", "patternProperties")

_ASCII = {
    "d": "0-9",
    "w": "0-9A-Za-z_",
    "s": " \\t\\n\\r\\f\\v",
}


def closed_schema(schema: object, *, close: bool, strict: bool = False) -> object:
    """``schema`` with every object schema that names properties and says nothing of others
    closed (``"additionalProperties": false``) where ``close`` or ``strict``, and every
    ``pattern`` and ``patternProperties`` name read with ASCII classes (``ascii_classes``).
    ``strict`` (OpenAI's structured outputs) refuses an object opened explicitly. A member of a
    multi-part ``allOf`` is left open: closed, the parts could not both hold."""
    return _rewrite(schema, close=close or strict, strict=strict, in_all_of=False)


def _rewrite(schema: object, *, close: bool, strict: bool, in_all_of: bool) -> object:
    if isinstance(schema, list):
        return [_rewrite(item, close=close, strict=strict, in_all_of=False) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_VALUED:
            out[key] = _rewrite(value, close=close, strict=strict, in_all_of=False)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            parts = key == "allOf" and len(value) > 1
            out[key] = [_rewrite(item, close=close, strict=strict, in_all_of=parts) for item in value]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rename: Callable[[str], str] = ascii_classes if key == "patternProperties" else str
            out[key] = {
                rename(name): _rewrite(item, close=close, strict=strict, in_all_of=False)
                for name, item in value.items()
            }
        elif key == "pattern" and isinstance(value, str):
            out[key] = ascii_classes(value)
        else:
            out[key] = value
    names_properties = any(key in schema for key in _NAMES_PROPERTIES)
    if strict and schema.get("additionalProperties") is True:
        raise SchemaError("a strict schema allows no additional properties ('additionalProperties': true)")
    says_of_others = {"additionalProperties", "unevaluatedProperties"} & schema.keys()
    if close and names_properties and not in_all_of and not says_of_others:
        out["additionalProperties"] = False
    return out


def ascii_classes(pattern: str) -> str:
    r"""``pattern`` with ``\d``, ``\w``, ``\s`` and their negations written as the ASCII classes
    they are in xgrammar (and Python's ``re.ASCII``): llguidance reads them as Unicode classes. Inside
    a bracketed class a negated one (``[\D]``) is kept as written."""
    out: list[str] = []
    in_class = False
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\" and index + 1 < len(pattern):
            escaped = pattern[index + 1]
            index += 2
            lower = escaped.lower()
            if lower in _ASCII and not (in_class and escaped.isupper()):
                ranges = _ASCII[lower]
                if in_class:
                    out.append(ranges)
                else:
                    out.append(f"[{'^' if escaped.isupper() else ''}{ranges}]")
            else:
                out.append("\\" + escaped)
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            # A ']' first in a class (or after its '^') is a literal.
            if pattern[index + 1 : index + 2] == "^":
                out.append("^")
                index += 1
            if pattern[index + 1 : index + 2] == "]":
                out.append("]")
                index += 1
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        else:
            out.append(char)
        index += 1
    return "".join(out)


def hoisted_parameters(name: str, parameters: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A function's parameters for a schema that nests them (a call's ``arguments``): a ``$ref``
    to them and the definitions to put at that schema's root, where every ``$ref`` of theirs
    resolves (vLLM hoists ``$defs`` likewise). The parameters go in as ``<name>``, their
    ``$defs`` and ``definitions`` as ``<name>.<definition>``; a reference into them is rebased."""
    defs: dict[str, Any] = {}
    for keyword in ("$defs", "definitions"):
        inner = parameters.get(keyword)
        if isinstance(inner, dict):
            for definition, schema in inner.items():
                defs[f"{name}.{definition}"] = _rebased(schema, name)
    defs[name] = _rebased({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}, name)
    return {"$ref": f"#/$defs/{name}"}, defs


def _rebased(schema: object, name: str) -> object:
    if isinstance(schema, list):
        return [_rebased(item, name) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased(value, name) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = _rebased_ref(ref[1:], name)
    return out


def _rebased_ref(pointer: str, name: str) -> str:
    """A JSON pointer into the parameters, as a pointer into the hoisted definitions."""
    for keyword in ("/$defs/", "/definitions/"):
        if pointer.startswith(keyword):
            definition, _, rest = pointer[len(keyword) :].partition("/")
            return f"#/$defs/{name}.{definition}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{name}{pointer}"
