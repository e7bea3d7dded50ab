"""Received cache-refs (SDCP 5.2): any absolute URI, served by the MLC its authority is configured to."""

from __future__ import annotations

import pytest

from sdcp.cache import MLC, InvalidURI, ObjectNotFound, UnresolvableRef, check_ref
from sdcp.cache.uri import MAX_REF_LENGTH, authority_of

FOREIGN = "mlc://conformance/log/7t0bxONvFsbjPaNb1aAvLg"


@pytest.mark.parametrize(
    "uri",
    [
        FOREIGN,
        "kvsp://cache.example:7000/scope/0a1b?version=3",
        "urn:example:kv:42",
        "https://[2001:db8::1]:8443/objects/a%2Fb",
    ],
)
def test_any_absolute_uri_is_a_reference(uri: str) -> None:
    assert check_ref(uri) == uri


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "relative/path",
        "//no-scheme/x",
        "mlc://host/a b",
        "mlc://host/\x00",
        "1mlc://host/x",
        "x:" + "a" * MAX_REF_LENGTH,
    ],
)
def test_what_is_not_an_absolute_uri_is_invalid(uri: str) -> None:
    with pytest.raises(InvalidURI):
        check_ref(uri)


def test_authority_is_lowercased_and_empty_for_a_urn() -> None:
    assert authority_of("mlc://Cache.Example:7000/x") == "cache.example:7000"
    assert authority_of("urn:example:kv:42") == ""
    with pytest.raises(InvalidURI):
        authority_of("mlc://[::1/x")


async def test_a_foreign_name_is_stored_verbatim_with_its_commit_log() -> None:
    async with MLC.from_config(authority="local") as mlc:
        await mlc.put("kvsp://other/objects/1", b"payload")
        assert await mlc.get("kvsp://other/objects/1") == b"payload"
        log = mlc.commit_log(FOREIGN)
        etag = (await log.read()).etag
        await log.append({"epoch": 1, "round": 1}, if_match=etag)
        assert [record["round"] for record in (await log.read()).records] == [1]


async def test_routes_send_an_authority_to_its_mlc() -> None:
    async with MLC.from_config(authority="b") as other:
        mlc = MLC.from_config(authority="a", routes={"B": other})
        await mlc.put("mlc://b/-/tokens/x", b"for b")
        await mlc.put("mlc://a/-/tokens/x", b"for a")
        assert await other.get("mlc://b/-/tokens/x") == b"for b"
        with pytest.raises(ObjectNotFound):
            await other.get("mlc://a/-/tokens/x")
        assert mlc.commit_log("mlc://b/-/log/s") is other.commit_log("mlc://b/-/log/s")
        await mlc.lease("mlc://b/-/tokens/x", "drafter", 5.0)
        assert await other.lease_holders("mlc://b/-/tokens/x") == {"drafter"}


async def test_without_unlisted_authorities_only_configured_ones_resolve() -> None:
    async with MLC.from_config(authority="a", own_authorities=["alias"], serves_unlisted=False) as mlc:
        await mlc.put("mlc://a/-/tokens/x", b"1")
        await mlc.put("mlc://ALIAS/-/tokens/x", b"2")
        with pytest.raises(UnresolvableRef, match="'elsewhere'"):
            await mlc.get("mlc://elsewhere/-/tokens/x")
        with pytest.raises(UnresolvableRef):
            mlc.commit_log("urn:example:log")
        with pytest.raises(InvalidURI):  # UnresolvableRef is an InvalidURI: a 400 on the wire
            mlc.serving("kvsp://elsewhere/x")
