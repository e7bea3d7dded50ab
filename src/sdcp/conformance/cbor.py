"""CBOR as RFC 8949 defines it, enough for SDCP's messages, independent of cbor2.

`encode` writes the core deterministic encoding (RFC 8949 4.2.1: shortest heads, definite lengths,
map keys sorted by their encoded bytes), which the contract digest needs (SDCP 4.1). `decode` reads
any well-formed item: floats, tags (as `Tagged`), null and undefined included, since a message may
carry unknown members of any type (SDCP 5.2).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["CBORError", "Tagged", "Undefined", "decode", "encode"]

_MAX_DEPTH = 64


class CBORError(ValueError):
    """Bytes that are not one well-formed CBOR item, or a value the encoder does not cover."""


@dataclass(frozen=True)
class Tagged:
    tag: int
    value: Any


class _UndefinedType:
    def __repr__(self) -> str:
        return "undefined"


Undefined = _UndefinedType()


def _head(major: int, argument: int) -> bytes:
    if argument < 24:
        return bytes([major << 5 | argument])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if argument < 1 << (8 * size):
            return bytes([major << 5 | extra]) + argument.to_bytes(size, "big")
    raise CBORError(f"argument {argument} does not fit in 64 bits")


def encode(value: Any) -> bytes:
    """The deterministic encoding of ints, bytes, text, bools, None, floats, lists, dicts, Tagged."""
    if value is True:
        return b"\xf5"
    if value is False:
        return b"\xf4"
    if value is None:
        return b"\xf6"
    if value is Undefined:
        return b"\xf7"
    if isinstance(value, int):
        return _head(0, value) if value >= 0 else _head(1, -1 - value)
    if isinstance(value, (bytes, bytearray)):
        return _head(2, len(value)) + bytes(value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _head(3, len(data)) + data
    if isinstance(value, (list, tuple)):
        return _head(4, len(value)) + b"".join(encode(item) for item in value)
    if isinstance(value, dict):
        pairs = sorted((encode(key), encode(item)) for key, item in value.items())
        return _head(5, len(pairs)) + b"".join(key + item for key, item in pairs)
    if isinstance(value, Tagged):
        return _head(6, value.tag) + encode(value.value)
    if isinstance(value, float):
        return b"\xfb" + struct.pack(">d", value)
    raise CBORError(f"cannot encode {type(value).__name__}")


def decode(data: bytes) -> Any:
    """The single item `data` holds; trailing bytes or a malformed item raise CBORError."""
    value, end = _Reader(bytes(data)).item(0, 0)
    if end != len(data):
        raise CBORError(f"{len(data) - end} bytes after the item")
    return value


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def _take(self, at: int, size: int) -> bytes:
        if at + size > len(self.data):
            raise CBORError("truncated item")
        return self.data[at : at + size]

    def _argument(self, info: int, at: int) -> tuple[int | None, int]:
        if info < 24:
            return info, at
        if info in (24, 25, 26, 27):
            size = 1 << (info - 24)
            return int.from_bytes(self._take(at, size), "big"), at + size
        if info == 31:
            return None, at  # indefinite length
        raise CBORError(f"reserved additional information {info}")

    def item(self, at: int, depth: int) -> tuple[Any, int]:
        if depth > _MAX_DEPTH:
            raise CBORError("nested too deeply")
        initial = self._take(at, 1)[0]
        major, info = initial >> 5, initial & 31
        at += 1
        if major == 7:
            return self._simple(info, at)
        argument, at = self._argument(info, at)
        if major in (0, 1, 6) and argument is None:
            raise CBORError(f"major type {major} cannot be indefinite")
        if major == 0:
            return argument, at
        if major == 1:
            return -1 - argument, at  # type: ignore[operator]
        if major in (2, 3):
            raw, at = self._string(major, argument, at)
            if major == 3:
                try:
                    return raw.decode("utf-8"), at
                except UnicodeDecodeError as exc:
                    raise CBORError("text string is not UTF-8") from exc
            return raw, at
        if major == 4:
            items: list[Any] = []
            while argument is None or len(items) < argument:
                if argument is None and self._take(at, 1) == b"\xff":
                    return items, at + 1
                value, at = self.item(at, depth + 1)
                items.append(value)
            return items, at
        if major == 5:
            mapping: dict[Any, Any] = {}
            count = 0
            while argument is None or count < argument:
                if argument is None and self._take(at, 1) == b"\xff":
                    return mapping, at + 1
                key, at = self.item(at, depth + 1)
                value, at = self.item(at, depth + 1)
                try:
                    if key in mapping:
                        raise CBORError(f"duplicate map key {key!r}")
                    mapping[key] = value
                except TypeError:  # an array or map as a key: kept out of the dict, still well-formed
                    pass
                count += 1
            return mapping, at
        value, at = self.item(at, depth + 1)
        return Tagged(argument, value), at  # type: ignore[arg-type]

    def _string(self, major: int, argument: int | None, at: int) -> tuple[bytes, int]:
        if argument is not None:
            return self._take(at, argument), at + argument
        chunks = []
        while self._take(at, 1) != b"\xff":
            head = self._take(at, 1)[0]
            if head >> 5 != major or head & 31 == 31:
                raise CBORError("an indefinite string holds a chunk of another type")
            size, at = self._argument(head & 31, at + 1)
            assert size is not None
            chunks.append(self._take(at, size))
            at += size
        return b"".join(chunks), at + 1

    def _simple(self, info: int, at: int) -> tuple[Any, int]:
        if info == 20:
            return False, at
        if info == 21:
            return True, at
        if info == 22:
            return None, at
        if info == 23:
            return Undefined, at
        if info == 24:
            return ("simple", self._take(at, 1)[0]), at + 1
        if info == 25:
            return _half(self._take(at, 2)), at + 2
        if info == 26:
            return struct.unpack(">f", self._take(at, 4))[0], at + 4
        if info == 27:
            return struct.unpack(">d", self._take(at, 8))[0], at + 8
        if info < 20:
            return ("simple", info), at
        raise CBORError(f"unexpected major type 7 value {info}")


def _half(raw: bytes) -> float:
    bits = int.from_bytes(raw, "big")
    sign = -1.0 if bits & 0x8000 else 1.0
    exponent, mantissa = (bits >> 10) & 0x1F, bits & 0x3FF
    if exponent == 0:
        return sign * mantissa * 2.0**-24
    if exponent == 31:
        return sign * float("inf") if mantissa == 0 else float("nan")
    return sign * (1 + mantissa / 1024) * 2.0 ** (exponent - 15)
