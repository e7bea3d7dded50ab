"""The kit's own CBOR and HMAC against the RFCs' published vectors, and its independence."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import pytest
from tests.vectors import from_json

from sdcp.conformance import cbor, formulas

VECTORS = Path(__file__).parent.parent / "protocol" / "vectors"
APPENDIX_A = json.loads((VECTORS / "rfc8949_appendix_a.json").read_text())
RFC4231 = json.loads((VECTORS / "rfc4231_hmac_sha256.json").read_text())
KIT = Path(__file__).parent.parent.parent / "src" / "sdcp" / "conformance"


@pytest.mark.parametrize("case", APPENDIX_A["deterministic"], ids=lambda c: c["encoded"])
def test_deterministic_items_round_trip(case: dict[str, Any]) -> None:
    value = from_json(case["value"])
    assert cbor.decode(bytes.fromhex(case["encoded"])) == value
    assert cbor.encode(value).hex() == case["encoded"]


@pytest.mark.parametrize("case", APPENDIX_A["indefinite"], ids=lambda c: c["encoded"])
def test_indefinite_items_decode(case: dict[str, Any]) -> None:
    assert cbor.decode(bytes.fromhex(case["encoded"])) == from_json(case["value"])


@pytest.mark.parametrize("case", APPENDIX_A["rejected"], ids=lambda c: c["diagnostic"])
def test_items_outside_sdcps_data_model_still_decode(case: dict[str, Any]) -> None:
    cbor.decode(bytes.fromhex(case["encoded"]))  # well-formed: the kit must read unknown members


def test_floats_tags_and_simple_values() -> None:
    assert cbor.decode(bytes.fromhex("f93e00")) == 1.5
    assert math.isinf(cbor.decode(bytes.fromhex("f97c00")))
    assert cbor.decode(bytes.fromhex("c11a514b67b0")) == cbor.Tagged(1, 1363896240)
    assert cbor.decode(bytes.fromhex("f7")) is cbor.Undefined
    for bad in ("", "18", "a16161", "0000", "ff", "7f6161ff6161", "a2616101616102"):
        with pytest.raises(cbor.CBORError):
            cbor.decode(bytes.fromhex(bad))


@pytest.mark.parametrize("case", RFC4231["cases"], ids=lambda c: str(c["case"]))
def test_hmac_matches_rfc4231(case: dict[str, Any]) -> None:
    mac = formulas.hmac_sha256(bytes.fromhex(case["key"]), bytes.fromhex(case["data"]))
    assert mac.hex().startswith(case["mac"])


def test_the_kit_imports_nothing_of_sdcp_protocol() -> None:
    # A shared misreading of the draft must not be able to pass the kit's checks.
    for path in KIT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "sdcp.protocol" or n.startswith("sdcp.protocol.") for n in names), path
