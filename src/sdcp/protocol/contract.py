"""The contract digest (SDCP 4.1)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

__all__ = ["CONTRACT_DOMAIN", "contract_digest", "digest_of_encoded_contract", "tokenizer_definition_digest"]

CONTRACT_DOMAIN = b"SDCP-CONTRACT-1\x00"


def digest_of_encoded_contract(encoded: bytes) -> bytes:
    """SHA-256("SDCP-CONTRACT-1" || 0x00 || encoded), `encoded` being deterministic CBOR."""
    return hashlib.sha256(CONTRACT_DOMAIN + encoded).digest()


def contract_digest(contract: Mapping[str, object]) -> bytes:
    """contract_digest of a contract given in the CBOR data model (SDCP 4.1).

    The contract is validated first, so an invalid one raises BadContract instead of getting a
    digest that no verifier would ever agree to.
    """
    # Imported here because messages.Contract itself uses digest_of_encoded_contract.
    from sdcp.protocol.messages import Contract

    if not isinstance(contract, Mapping):
        raise TypeError(f"contract must be a mapping, not {type(contract).__name__}")
    return Contract.from_obj(dict(contract)).digest


def tokenizer_definition_digest(definition: str) -> bytes:
    """The contract's ``tokenizer`` member (SDCP 4.1) for a tokenizer definition (a Hugging Face
    ``tokenizer.json``): SHA-256 of it as canonical JSON (sorted keys, no whitespace, UTF-8), so
    that files differing only in formatting name the same tokenizer (docs/interpretations.md)."""
    canonical = json.dumps(json.loads(definition), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).digest()
