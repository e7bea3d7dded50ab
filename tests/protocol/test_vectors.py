"""Known answers for the draft's formulas (SDCP 4.1, 4.2, 6.4), computed once by the conformance
kit's independent code (scripts/make-sdcp-vectors), checked against sdcp.protocol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.vectors import from_json

from sdcp.conformance import cbor, formulas
from sdcp.protocol.digest import extend_digest, prefix_digest
from sdcp.protocol.messages import Contract
from sdcp.protocol.rules import verifier_random

VECTORS = json.loads((Path(__file__).parent / "vectors" / "sdcp_formulas.json").read_text())


@pytest.mark.parametrize("case", VECTORS["contracts"], ids=[c["name"] for c in VECTORS["contracts"]])
def test_contract_encoding_and_digest(case: dict[str, Any]) -> None:
    obj = from_json(case["contract"])
    contract = Contract.from_obj(obj)
    assert contract.to_cbor().hex() == case["deterministic_cbor"]
    assert contract.digest.hex() == case["contract_digest"]
    assert formulas.contract_digest(obj).hex() == case["contract_digest"]  # the kit still agrees


@pytest.mark.parametrize("case", VECTORS["chains"], ids=[c["name"] for c in VECTORS["chains"]])
def test_prefix_digest_chain(case: dict[str, Any]) -> None:
    contract = next(c for c in VECTORS["contracts"] if c["name"] == case["contract"])
    digest = prefix_digest(bytes.fromhex(contract["contract_digest"]), case["prompt"])
    chain = [digest]
    for token in case["output"]:
        chain.append(extend_digest(chain[-1], [token]))
    assert [d.hex() for d in chain] == case["d"]
    assert extend_digest(chain[0], case["output"]).hex() == case["d"][-1]


@pytest.mark.parametrize(
    "case", VECTORS["randomness"], ids=lambda c: f"seed{c['seed']}-r{c['round']}-i{c['i']}-p{c['purpose']}"
)
def test_seeded_verifier_randomness(case: dict[str, Any]) -> None:
    r = verifier_random(case["seed"], bytes.fromhex(case["session"]), case["round"], case["i"], case["purpose"])
    assert r.hex() == case["r"] and 0.0 <= r < 1.0


def test_the_kit_and_the_core_encode_contracts_alike() -> None:
    for case in VECTORS["contracts"]:
        assert cbor.encode(from_json(case["contract"])).hex() == case["deterministic_cbor"]
