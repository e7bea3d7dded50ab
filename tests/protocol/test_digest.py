"""Committed-prefix digest chain (SDCP 4.2), recomputed independently from the draft's formula."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcp.protocol import BadMessage, extend_digest, prefix_digest

CONTRACT_DIGEST = hashlib.sha256(b"any contract").digest()
TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


def _reference_chain(contract_digest: bytes, prompt: list[int], output: list[int]) -> list[bytes]:
    """d[0..n] written straight from SDCP 4.2."""
    d0 = hashlib.sha256(
        b"SDCP-PREFIX-1"
        + b"\x00"
        + contract_digest
        + struct.pack("!I", len(prompt))
        + b"".join(struct.pack("!I", t) for t in prompt)
    ).digest()
    chain = [d0]
    for token in output:
        chain.append(hashlib.sha256(chain[-1] + struct.pack("!I", token)).digest())
    return chain


def test_known_small_chain() -> None:
    prompt, output = [1, 2, 3], [70000, 0, 2**32 - 1]
    chain = _reference_chain(CONTRACT_DIGEST, prompt, output)
    assert prefix_digest(CONTRACT_DIGEST, prompt) == chain[0]
    assert extend_digest(chain[0], output) == chain[3]
    assert extend_digest(chain[1], output[1:]) == chain[3]


def test_empty_prompt_and_no_tokens() -> None:
    d0 = prefix_digest(CONTRACT_DIGEST, [])
    assert d0 == hashlib.sha256(b"SDCP-PREFIX-1\x00" + CONTRACT_DIGEST + b"\x00\x00\x00\x00").digest()
    assert extend_digest(d0, []) == d0


@settings(max_examples=100, deadline=None)
@given(prompt=TOKENS, output=TOKENS, split=st.integers(min_value=0, max_value=40))
def test_chain_matches_reference_and_is_incremental(prompt: list[int], output: list[int], split: int) -> None:
    chain = _reference_chain(CONTRACT_DIGEST, prompt, output)
    d0 = prefix_digest(CONTRACT_DIGEST, prompt)
    assert d0 == chain[0]
    cut = min(split, len(output))
    middle = extend_digest(d0, output[:cut])
    assert middle == chain[cut]
    assert extend_digest(middle, iter(output[cut:])) == chain[-1]


def test_digest_depends_on_contract_and_order() -> None:
    other = hashlib.sha256(b"other contract").digest()
    assert prefix_digest(CONTRACT_DIGEST, [1, 2]) != prefix_digest(other, [1, 2])
    assert prefix_digest(CONTRACT_DIGEST, [1, 2]) != prefix_digest(CONTRACT_DIGEST, [2, 1])
    d0 = prefix_digest(CONTRACT_DIGEST, [])
    assert extend_digest(d0, [1, 2]) != extend_digest(d0, [2, 1])


@pytest.mark.parametrize("token", [-1, 2**32, True, 1.0, "1", None])
def test_token_outside_uint32_is_bad_message(token: object) -> None:
    with pytest.raises(BadMessage, match="32-bit"):
        prefix_digest(CONTRACT_DIGEST, [0, token])  # type: ignore[list-item]
    with pytest.raises(BadMessage, match="32-bit"):
        extend_digest(CONTRACT_DIGEST, [token])  # type: ignore[list-item]


@pytest.mark.parametrize("digest", [b"", b"\x00" * 31, b"\x00" * 33, "0" * 32, None])
def test_digest_of_wrong_size_is_bad_message(digest: object) -> None:
    with pytest.raises(BadMessage, match="32 bytes"):
        prefix_digest(digest, [])  # type: ignore[arg-type]
    with pytest.raises(BadMessage, match="32 bytes"):
        extend_digest(digest, [1])  # type: ignore[arg-type]
