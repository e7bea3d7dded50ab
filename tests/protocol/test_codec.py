"""Codec: RFC 8949 Appendix A vectors, deterministic encoding, bounded typed decoding (SDCP 5.1)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.vectors import from_json

from sdcp.protocol import codec
from sdcp.protocol.messages import Output
from sdcp.protocol.problems import BadMessage

VECTORS = json.loads((Path(__file__).parent / "vectors" / "rfc8949_appendix_a.json").read_text())


def _ids(cases: list[dict[str, Any]]) -> list[str]:
    return [case["encoded"][:24] for case in cases]


@pytest.mark.parametrize("case", VECTORS["deterministic"], ids=_ids(VECTORS["deterministic"]))
def test_appendix_a_deterministic_items_decode_and_reencode(case: dict[str, Any]) -> None:
    encoded = bytes.fromhex(case["encoded"])
    value = from_json(case["value"])
    assert codec.decode(encoded) == value
    assert codec.decode_deterministic(encoded) == value
    assert codec.encode(value) == encoded


@pytest.mark.parametrize("case", VECTORS["indefinite"], ids=_ids(VECTORS["indefinite"]))
def test_appendix_a_indefinite_items_decode_but_are_not_deterministic(case: dict[str, Any]) -> None:
    encoded = bytes.fromhex(case["encoded"])
    assert codec.decode(encoded) == from_json(case["value"])
    with pytest.raises(BadMessage, match="deterministic"):
        codec.decode_deterministic(encoded)


@pytest.mark.parametrize("case", VECTORS["rejected"], ids=[c["diagnostic"] for c in VECTORS["rejected"]])
def test_appendix_a_items_outside_sdcp_data_model_decode_but_are_never_sdcp_values(case: dict[str, Any]) -> None:
    # SDCP 5.2: an unknown member is ignored whatever it holds, so decoding keeps such items; a
    # deterministic decode (contracts), a known member and the encoder refuse them.
    encoded = bytes.fromhex(case["encoded"])
    item = codec.decode(encoded)
    with pytest.raises(BadMessage):
        codec.decode_deterministic(encoded)
    with pytest.raises(ValueError, match="cannot encode"):
        codec.encode(item)
    with pytest.raises(BadMessage):
        Output.from_obj({"session": bytes(16), "epoch": item, "from": 0, "tokens": [], "final": False})


@pytest.mark.parametrize("case", VECTORS["rejected"], ids=[c["diagnostic"] for c in VECTORS["rejected"]])
def test_unknown_members_of_any_cbor_type_are_ignored(case: dict[str, Any]) -> None:
    item = cbor2.loads(bytes.fromhex(case["encoded"]))
    known = {"session": bytes(16), "epoch": 3, "from": 0, "tokens": [7], "final": False}
    body = cbor2.dumps({**known, "vendor-extension": item, 7: "int key", b"k": "byte key"})
    assert Output.from_cbor(body) == Output.from_obj(known)


def test_media_type() -> None:
    assert codec.MEDIA_TYPE == "application/sdcp+cbor"


@pytest.mark.parametrize(
    ("hex_input", "reason"),
    [
        ("0102", "trailing"),
        ("", "premature"),
        ("83 01 02", "premature"),
        ("62 c3 28", "text string"),
        ("a2 6161 01 6161 02", "Duplicate"),
        ("1c", "malformed"),
        ("ff", "malformed"),
    ],
)
def test_malformed_input_raises_bad_message(hex_input: str, reason: str) -> None:
    with pytest.raises(BadMessage, match=reason):
        codec.decode(bytes.fromhex(hex_input.replace(" ", "")))


def test_duplicate_keys_rejected_in_nested_maps() -> None:
    data = bytes.fromhex("a1 6161 a2 6162 01 6162 02".replace(" ", ""))
    with pytest.raises(BadMessage, match="Duplicate"):
        codec.decode(data)


def test_size_limit() -> None:
    data = codec.encode(b"x" * 100)
    assert codec.decode(data, max_size=len(data)) == b"x" * 100
    with pytest.raises(BadMessage, match="exceeds"):
        codec.decode(data, max_size=len(data) - 1)


def test_default_size_limit_is_1_mib() -> None:
    assert codec.DEFAULT_MAX_SIZE == 1024 * 1024
    with pytest.raises(BadMessage, match="exceeds"):
        codec.decode(b"\x00" * (codec.DEFAULT_MAX_SIZE + 1))


def test_nesting_depth_limit() -> None:
    nested: object = 0
    for _ in range(codec.DEFAULT_MAX_DEPTH + 1):
        nested = [nested]
    with pytest.raises(BadMessage, match="depth"):
        codec.decode(cbor2.dumps(nested))
    assert codec.decode(cbor2.dumps([[[0]]]), max_depth=3) == [[[0]]]
    with pytest.raises(BadMessage, match="depth"):
        codec.decode(cbor2.dumps([[[0]]]), max_depth=2)


def test_deeply_nested_hostile_input_is_bad_message() -> None:
    with pytest.raises(BadMessage):
        codec.decode(b"\x81" * 100_000 + b"\x00")


@pytest.mark.parametrize(
    "hex_input",
    ["1801", "190001", "1a00000001", "1b0000000000000001", "5801 61".replace(" ", ""), "a2 6162 01 6161 02"],
)
def test_decode_deterministic_rejects_non_shortest_and_unsorted(hex_input: str) -> None:
    data = bytes.fromhex(hex_input.replace(" ", ""))
    codec.decode(data)
    with pytest.raises(BadMessage, match="deterministic"):
        codec.decode_deterministic(data)


def test_decode_accepts_bytearray_and_memoryview_but_not_str() -> None:
    assert codec.decode(bytearray(b"\x01")) == 1
    assert codec.decode(memoryview(b"\x01")) == 1
    with pytest.raises(TypeError):
        codec.decode("01")  # type: ignore[arg-type]


class _Pair(tuple[object, ...]):
    """A tuple subclass: still an array, checked item by item."""


@pytest.mark.parametrize(
    "value",
    [
        1.5,
        None,
        {1: 2},
        {b"k": 1},
        2**64,
        -(2**64) - 1,
        {"a": [object()]},
        [*range(100), 2**64],
        [*range(100), -(2**64) - 1],
        [1, 2, 2.5],
        (1, (2, None)),
        _Pair((1, 1.5)),
        {"tokens": [1, 2], "inner": {"x": [3, {4: 5}]}},
    ],
)
def test_encode_refuses_values_outside_data_model(value: object) -> None:
    with pytest.raises(ValueError, match="cannot encode"):
        codec.encode(value)


def test_encode_takes_integer_arrays_up_to_the_bounds_and_nested_values() -> None:
    value = {"tokens": [0, 2**64 - 1, -(2**64)], "flags": [True, False, 3], "pair": _Pair((1, b"x", "y"))}
    assert codec.decode(codec.encode(value)) == {
        "tokens": [0, 2**64 - 1, -(2**64)],
        "flags": [True, False, 3],
        "pair": [1, b"x", "y"],
    }


def test_encode_tuples_as_arrays() -> None:
    assert codec.encode((1, 2)) == codec.encode([1, 2]) == bytes.fromhex("820102")


def _head(major: int, argument: int) -> bytes:
    """RFC 8949 3.1 initial byte plus shortest argument, written from the RFC, not from cbor2."""
    if argument < 24:
        return bytes([major << 5 | argument])
    for additional, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if argument < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | additional]) + struct.pack(fmt, argument)
    raise AssertionError("argument too large")


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _head(3, len(raw)) + raw


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=40), st.integers(min_value=0, max_value=2**64 - 1), max_size=12))
def test_canonical_order_is_rfc8949_bytewise_order_for_text_keys(mapping: dict[str, int]) -> None:
    # RFC 8949 4.2.1: keys sorted by the bytewise lexicographic order of their encodings.
    items = sorted(mapping.items(), key=lambda item: _text(item[0]))
    expected = _head(5, len(items)) + b"".join(_text(k) + _head(0, v) for k, v in items)
    assert codec.encode(mapping) == expected


_SDCP_VALUES = st.recursive(
    st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.binary(max_size=20)
    | st.text(max_size=20)
    | st.booleans(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_SDCP_VALUES)
def test_round_trip_of_data_model_values(value: object) -> None:
    encoded = codec.encode(value)
    assert codec.decode(encoded) == value
    assert codec.decode_deterministic(encoded) == value


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_bad_message(data: bytes) -> None:
    try:
        value = codec.decode(data)
    except BadMessage:
        return
    try:
        codec.encode(value)
    except ValueError as refused:  # outside SDCP's data model: never sent
        assert "cannot encode" in str(refused)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(max_size=12), _SDCP_VALUES, max_size=30),
    st.text(max_size=12),
    st.binary(max_size=300),
)
def test_a_member_added_to_an_encoded_map_gives_the_maps_own_encoding(
    body: dict[str, object], key: str, value: bytes
) -> None:
    """``with_member`` reuses the body's encoding where the new key comes first (a signature's
    ``sig`` before a record's members) and encodes the whole map otherwise (a key that sorts
    later, one the body holds already, a body of 23 members or more): the bytes are always the
    map's deterministic encoding, and ``encode`` hands them back."""
    added = codec.with_member(body, codec.encode(body), key, value)
    assert added == {**body, key: value}
    assert added.cbor == codec.encode(dict(added)) == codec.encode(added)
    assert codec.decode_deterministic(added.cbor) == {**body, key: value}


def test_an_encoded_map_refuses_every_change_and_its_copy_takes_them() -> None:
    record = {"epoch": 1, "round": 2, "emitted": [7], "committed": 1, "digest": bytes(32)}
    signed = codec.with_member(record, codec.encode(record), "sig", b"s")
    for change in (
        lambda: signed.__setitem__("round", 3),
        lambda: signed.update(round=3),
        lambda: signed.pop("round"),
        lambda: signed.setdefault("other", 1),
        lambda: signed.clear(),
        lambda: signed.popitem(),
        lambda: signed.__delitem__("round"),
    ):
        with pytest.raises(TypeError):
            change()
    assert codec.encode(signed) == codec.encode({**record, "sig": b"s"})
    copy = dict(signed)
    copy["round"] = 3
    assert codec.encode(copy) == codec.encode({**record, "sig": b"s", "round": 3})
