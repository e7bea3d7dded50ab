"""Object names: building, parsing, and typed errors for malformed URIs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sdcp.cache import CacheError, InvalidURI, ObjectURI, build_uri, content_etag, parse_uri

SCOPE = bytes(range(16))


def test_build_and_parse_round_trip() -> None:
    uri = build_uri("mlc.local:7000", SCOPE, "q_rows", "abc-12.r3")
    assert uri == "mlc://mlc.local:7000/000102030405060708090a0b0c0d0e0f/q_rows/abc-12.r3"
    assert parse_uri(uri) == ObjectURI("mlc.local:7000", SCOPE, "q_rows", "abc-12.r3")


def test_absent_scope_is_a_dash() -> None:
    uri = build_uri("localhost", None, "log", "s1")
    assert uri == "mlc://localhost/-/log/s1"
    assert parse_uri(uri).scope is None


@pytest.mark.parametrize(
    "uri",
    [
        "http://localhost/-/log/s1",  # unknown scheme
        "MLC://localhost/-/log/s1",  # schemes are matched exactly, lowercase
        "localhost/-/log/s1",  # no scheme
        "mlc://localhost/-/log",  # missing name
        "mlc://localhost/-/log/s1/extra",  # too many segments
        "mlc:///-/log/s1",  # empty authority
        "mlc://localhost/0011/log/s1",  # short scope
        "mlc://localhost/000102030405060708090A0B0C0D0E0F/log/s1",  # uppercase scope hex
        "mlc://localhost/-/Log/s1",  # kind is lowercase
        "mlc://localhost/-/log/a b",  # space in name
        "mlc://localhost/-/log/..",  # dot segment
        "mlc://localhost/-/log/",  # empty name
    ],
)
def test_malformed_uris_raise_invalid_uri(uri: str) -> None:
    with pytest.raises(InvalidURI):
        parse_uri(uri)


def test_unknown_scheme_message_names_the_scheme() -> None:
    with pytest.raises(InvalidURI, match="'kvsp'"):
        parse_uri("kvsp://x/-/log/s")


def test_invalid_uri_is_a_cache_error_and_build_validates() -> None:
    with pytest.raises(CacheError):
        build_uri("localhost", b"short", "log", "s")
    with pytest.raises(InvalidURI):
        parse_uri(b"mlc://localhost/-/log/s1")  # type: ignore[arg-type]


def test_etag_is_quoted_sha256_prefix() -> None:
    assert content_etag(b"abc") == '"ba7816bf8f01cfea414140de5dae2223"'


@given(
    scope=st.none() | st.binary(min_size=16, max_size=16),
    kind=st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True),
    name=st.from_regex(r"[A-Za-z0-9._~-]{1,20}", fullmatch=True).filter(lambda n: n not in (".", "..")),
)
def test_round_trip_property(scope: bytes | None, kind: str, name: str) -> None:
    uri = build_uri("host-1.example:443", scope, kind, name)
    assert str(parse_uri(uri)) == uri
