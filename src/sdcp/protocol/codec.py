"""CBOR codec for SDCP messages (SDCP 5.1): deterministic encoding, bounded decoding.

SDCP's data model is what its CDDL can express: integers, byte strings, text strings, booleans,
arrays and maps with text keys. The decoder refuses everything else (floats, tags, null,
undefined, other simple values, non-text keys) so that a decoded message can always be
re-encoded deterministically, and every decoding failure surfaces as `BadMessage`.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Sequence
from typing import NoReturn

import cbor2

from sdcp.protocol.problems import BadMessage

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_SIZE",
    "MEDIA_TYPE",
    "EncodedMap",
    "b64url_decode",
    "b64url_encode",
    "decode",
    "decode_deterministic",
    "encode",
    "integers_within",
    "with_member",
]

MEDIA_TYPE = "application/sdcp+cbor"
# The largest SDCP message: a prompt of about 200,000 token ids inline (larger ones travel as MLC
# objects, SDCP 5.2 cache-ref). It bounds how long decoding one body holds the event loop (~0.1 s).
DEFAULT_MAX_SIZE = 1024 * 1024
# The deepest SDCP message (session-open > contract > sampling > value) nests 4 levels.
DEFAULT_MAX_DEPTH = 16

_INT_MIN = -(2**64)
_INT_MAX = 2**64 - 1
_B64URL = re.compile(r"[A-Za-z0-9_-]*")


class _KeepEveryTag(dict[int, object]):
    """A semantic-decoder table that claims every tag, so cbor2 applies none of its own: a tagged
    item stays a ``cbor2.CBORTag``, which no message member accepts and every unknown member may be."""

    def __contains__(self, tag: object) -> bool:
        return True

    def get(self, tag: object, default: object = None) -> object:
        return self[tag]

    def __getitem__(self, tag: object) -> object:
        def keep(value: object, *_: object) -> cbor2.CBORTag:
            # cbor2 (6.x) calls a semantic decoder with the decoded tagged item.
            return cbor2.CBORTag(int(tag), value)  # type: ignore[call-overload]

        return keep


_TAGS_AS_THEY_ARE = _KeepEveryTag()


def _keep_tag(_decoder: cbor2.CBORDecoder, tag: cbor2.CBORTag) -> cbor2.CBORTag:
    return tag


def integers_within(values: Sequence[object], low: int, high: int) -> bool:
    """Whether every one of ``values`` is a plain integer (not a bool) in [low, high]: a token
    array checked in one go, where a check item by item would be most of what encoding or parsing
    a message costs."""
    if not all(type(value) is int for value in values):
        return False
    integers: Sequence[int] = values  # type: ignore[assignment]
    return not integers or (min(integers) >= low and max(integers) <= high)


# Types whose values all lie inside the data model, checked by exact type first: a record's walk
# met them for most of its members, and the isinstance chain below cost a third of an encode.
_PLAIN_TYPES = frozenset({str, bytes, bytearray})


def _outside_data_model(obj: object) -> str | None:
    """Why `obj` lies outside SDCP's data model, or None when it lies inside."""
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind in _PLAIN_TYPES:
            continue
        if kind is int:
            if not _INT_MIN <= item <= _INT_MAX:  # type: ignore[operator]
                return f"integer {item} does not fit CBOR major types 0 and 1"
            continue
        if isinstance(item, (list, tuple)):
            if not integers_within(item, _INT_MIN, _INT_MAX):
                stack.extend(item)
        elif isinstance(item, dict):
            for key, value in item.items():
                if not isinstance(key, str):
                    return f"map key {key!r} is not a text string"
                stack.append(value)
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not _INT_MIN <= item <= _INT_MAX:
                return f"integer {item} does not fit CBOR major types 0 and 1"
        elif not isinstance(item, (str, bytes, bytearray)):
            return f"{type(item).__name__} value {item!r} is not part of SDCP"
    return None


def _innermost_bad_message(exc: BaseException) -> BadMessage | None:
    """Our own rejection (of a tag) when cbor2 wrapped it in its decode error."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, BadMessage):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class EncodedMap(dict[str, object]):
    """A map that carries its deterministic encoding (``with_member``): ``encode`` returns it rather
    than check and encode the map again. It refuses every change, which would leave the encoding
    stale (a copy, ``dict(m)``, may be changed)."""

    __slots__ = ("cbor",)

    def __init__(self, members: dict[str, object], cbor: bytes) -> None:
        super().__init__(members)
        self.cbor = cbor

    def _refuse(self, *_: object, **__: object) -> NoReturn:
        raise TypeError("an EncodedMap is not changed: change a copy (dict(m))")

    __setitem__ = __delitem__ = __ior__ = update = pop = popitem = clear = setdefault = _refuse


# A map of up to 23 members has its count in its first byte (RFC 8949 3.1: major type 5).
_SHORT_MAP = 0xA0
_SHORT_MAP_MOST = 23


def with_member(body: dict[str, object], encoded_body: bytes, key: str, value: bytes) -> EncodedMap:
    """``body`` with ``key``: ``value`` added, and its deterministic encoding made from
    ``encoded_body`` (``encode(body)``) without encoding ``body`` again where ``key`` comes first in
    the 4.2.1 order (the bytewise order of the encoded keys): the map's count, then ``key`` and
    ``value``, then ``body``'s members as they are. A verifier signs every commit record and the log
    stores it: the log encoded each signed record again, on the event loop, while the next pass
    waited for the group's hand-over (docs/performance.md, session 41)."""
    members: dict[str, object] = {key: value}
    members.update((other, member) for other, member in body.items() if other != key)
    first = cbor2.dumps(key)
    leads = all(first < cbor2.dumps(other) for other in body)
    if key in body or not leads or len(body) >= _SHORT_MAP_MOST or encoded_body[:1] != bytes([_SHORT_MAP + len(body)]):
        return EncodedMap(members, encode(members))
    return EncodedMap(members, bytes([_SHORT_MAP + len(members)]) + first + cbor2.dumps(value) + encoded_body[1:])


def encode(obj: object) -> bytes:
    """RFC 8949 4.2.1 core deterministic encoding of `obj`.

    cbor2's canonical mode sorts map keys length-first; for text keys that order equals the
    bytewise order of the encoded keys that 4.2.1 requires, which is why keys must be text.
    """
    if type(obj) is EncodedMap:
        return obj.cbor
    problem = _outside_data_model(obj)
    if problem is not None:
        raise ValueError(f"cannot encode: {problem}")
    return cbor2.dumps(obj, canonical=True)


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_size: int = DEFAULT_MAX_SIZE,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> object:
    """Decode exactly one well-formed CBOR data item; anything else raises BadMessage.

    SDCP 5.2: unknown members MUST be ignored, whatever they hold. So items outside SDCP's data model
    (floats, null, undefined, simple values, tags, keys that are not text) are decoded as they are;
    the message parsers (``sdcp.protocol.messages``) refuse them wherever a known member is expected,
    and ``encode`` never sends them.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"CBOR input must be bytes, not {type(data).__name__}")
    size = len(data)
    if size > max_size:
        raise BadMessage(f"message of {size} bytes exceeds the limit of {max_size} bytes")
    stream = io.BytesIO(data)
    decoder = cbor2.CBORDecoder(
        stream,
        # cbor2's decoder calls tag_hook(decoder, tag) and only looks tags up in semantic_decoders;
        # its type hints declare other signatures for both.
        tag_hook=_keep_tag,  # type: ignore[arg-type]
        semantic_decoders=_TAGS_AS_THEY_ARE,  # type: ignore[arg-type]
        max_depth=max_depth,
        allow_duplicate_keys=False,
        strict_hashable_types=False,
    )
    try:
        obj = decoder.decode()
    except Exception as exc:  # cbor2 raises several unrelated types; callers must see one.
        ours = _innermost_bad_message(exc)
        raise BadMessage(str(ours) if ours is not None else f"malformed CBOR: {exc}") from exc
    if stream.tell() != size:
        raise BadMessage(f"{size - stream.tell()} trailing bytes after the CBOR data item")
    return obj


def decode_deterministic(
    data: bytes | bytearray | memoryview,
    *,
    max_size: int = DEFAULT_MAX_SIZE,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> object:
    """Like `decode`, and also reject input that is not in core deterministic encoding.

    cbor2 accepts non-shortest integers, indefinite lengths and unsorted maps; re-encoding and
    comparing catches all of them at once.
    """
    obj = decode(data, max_size=max_size, max_depth=max_depth)
    problem = _outside_data_model(obj)
    if problem is not None:
        raise BadMessage(problem)
    if encode(obj) != bytes(data):
        raise BadMessage("CBOR input is not in core deterministic encoding (RFC 8949 4.2.1)")
    return obj


def b64url_encode(data: bytes) -> str:
    """Base64url without padding (RFC 4648 section 5)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Inverse of `b64url_encode`; refuses padding, foreign characters and non-canonical input."""
    if not isinstance(text, str) or _B64URL.fullmatch(text) is None:
        raise BadMessage(f"{text!r} is not unpadded base64url")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise BadMessage(f"{text!r} is not unpadded base64url: {exc}") from exc
    if b64url_encode(raw) != text:
        raise BadMessage(f"{text!r} is not canonical base64url")
    return raw
