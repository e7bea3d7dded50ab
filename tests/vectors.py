"""Reading the JSON vector files of tests/protocol/vectors: a byte string is written {"bstr": hex}."""

from __future__ import annotations

from typing import Any


def from_json(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"bstr"}:
        return bytes.fromhex(value["bstr"])
    if isinstance(value, dict):
        return {key: from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [from_json(item) for item in value]
    return value
