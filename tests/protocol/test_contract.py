"""Contract validation and contract digest (SDCP 4.1), digest recomputed independently."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdcp.protocol import Action, BadContract, Contract, ProblemType, Sampling, contract_digest

BASE: dict[str, Any] = {
    "target": b"\x11" * 32,
    "tokenizer": b"\x22" * 32,
    "rule": 1,
    "m_max": 8,
    "max_new": 256,
    "stop": [2],
    "low_rounds": 4,
    "fallback": [1, 2, 3, 5],
}
FULL: dict[str, Any] = {
    **BASE,
    "drafters": [b"\x33" * 32, b"\x44" * 32],
    "sampling": {"temperature_milli": 700, "top_k": 50, "top_p_milli": 950, "seed": 2**64 - 1},
    "low_ratio": 30,
    "self_load": 60,
    "self_max": 32,
    "scope": b"\x55" * 16,
}


def _reference_digest(contract: dict[str, Any]) -> bytes:
    """SHA-256("SDCP-CONTRACT-1" || 0x00 || deterministic CBOR), with keys sorted per RFC 8949 4.2.1."""

    def deterministic(value: Any) -> Any:
        if isinstance(value, dict):
            ordered = sorted(value.items(), key=lambda item: cbor2.dumps(item[0]))
            return {key: deterministic(item) for key, item in ordered}
        if isinstance(value, list):
            return [deterministic(item) for item in value]
        return value

    # cbor2's non-canonical mode keeps insertion order and uses shortest integer forms.
    return hashlib.sha256(b"SDCP-CONTRACT-1\x00" + cbor2.dumps(deterministic(contract))).digest()


@pytest.mark.parametrize("contract", [BASE, FULL], ids=["minimal", "full"])
def test_contract_digest_matches_reference(contract: dict[str, Any]) -> None:
    expected = _reference_digest(contract)
    assert contract_digest(contract) == expected
    assert Contract.from_obj(contract).digest == expected


def test_digest_of_directly_built_contract_equals_decoded_one() -> None:
    built = Contract(
        target=FULL["target"],
        tokenizer=FULL["tokenizer"],
        drafters=tuple(FULL["drafters"]),
        rule=1,
        sampling=Sampling(temperature_milli=700, top_k=50, top_p_milli=950, seed=2**64 - 1),
        m_max=8,
        max_new=256,
        stop=(2,),
        low_rounds=4,
        low_ratio=30,
        fallback=(Action.REDUCE, Action.SWITCH, Action.SELF_DECODE, Action.FAIL),
        self_load=60,
        self_max=32,
        scope=FULL["scope"],
    )
    assert built == Contract.from_obj(FULL)
    assert built.digest == _reference_digest(FULL)
    assert built.to_obj() == FULL


def test_digest_covers_contract_as_created() -> None:
    with_empty_sampling = {**BASE, "sampling": {}}
    assert contract_digest(with_empty_sampling) != contract_digest(BASE)
    assert Contract.from_obj(with_empty_sampling).to_obj() == with_empty_sampling


def test_unknown_fallback_value_is_kept_for_the_digest_and_reads_as_fail() -> None:
    contract = Contract.from_obj({**BASE, "fallback": [1, 99]})
    assert contract.ladder == (Action.REDUCE, Action.FAIL)
    assert contract.to_obj()["fallback"] == [1, 99]
    assert contract.digest == _reference_digest({**BASE, "fallback": [1, 99]})


def test_from_cbor_requires_deterministic_encoding() -> None:
    contract = Contract.from_obj(FULL)
    assert Contract.from_cbor(contract.to_cbor()) == contract
    assert contract.encoded == contract.to_cbor()
    unsorted = cbor2.dumps(FULL)
    with pytest.raises(BadContract, match="deterministic"):
        Contract.from_cbor(unsorted)


def test_digest_is_cached_and_contract_is_frozen() -> None:
    contract = Contract.from_obj(BASE)
    assert contract.digest is contract.digest
    with pytest.raises(AttributeError):
        contract.m_max = 4  # type: ignore[misc]


def test_digest_ignores_later_mutation_of_the_source_dict() -> None:
    source = {**BASE, "stop": [2]}
    contract = Contract.from_obj(source)
    source["stop"].append(3)
    assert contract.digest == _reference_digest(BASE)


BAD_CONTRACTS = [
    ({**BASE, "extra": 1}, "unknown"),
    ({**BASE, "sampling": {"temperature": 1}}, "unknown"),
    ({k: v for k, v in BASE.items() if k != "target"}, "target"),
    ({k: v for k, v in BASE.items() if k != "fallback"}, "fallback"),
    ({**BASE, "target": b"\x11" * 31}, "32 bytes"),
    ({**BASE, "tokenizer": "ab" * 16}, "byte string"),
    ({**BASE, "drafters": []}, "empty"),
    ({**BASE, "drafters": [b"\x00" * 33]}, "32 bytes"),
    ({**BASE, "rule": -1}, "outside"),
    ({**BASE, "rule": True}, "unsigned integer"),
    ({**BASE, "m_max": 65}, "outside"),
    ({**BASE, "m_max": 0}, "outside"),
    ({**BASE, "max_new": 2**64}, "outside"),
    ({**BASE, "stop": [2**32]}, "outside"),
    ({**BASE, "stop": 2}, "array"),
    ({**BASE, "low_rounds": 0}, "outside"),
    ({**BASE, "low_ratio": 101}, "outside"),
    ({**BASE, "fallback": []}, "empty"),
    ({**BASE, "fallback": [0]}, "continue"),
    ({**BASE, "fallback": [1, 4]}, "finish"),
    ({**BASE, "self_load": 101}, "outside"),
    ({**BASE, "self_max": "3"}, "unsigned integer"),
    ({**BASE, "scope": b"\x00" * 15}, "16 bytes"),
    ({**BASE, "sampling": {"top_p_milli": 1001}}, "outside"),
    ({**BASE, "sampling": {"seed": 2**64}}, "outside"),
    ({**BASE, "sampling": [1]}, "map"),
    ([BASE], "map"),
]


@pytest.mark.parametrize(("contract", "reason"), BAD_CONTRACTS)
def test_bad_contracts_raise_sdcp_bad_contract(contract: Any, reason: str) -> None:
    with pytest.raises(BadContract, match=reason) as caught:
        Contract.from_obj(contract)
    assert caught.value.problem is ProblemType.BAD_CONTRACT and caught.value.status == 422
    if isinstance(contract, dict):
        with pytest.raises(BadContract):
            contract_digest(contract)


def test_contract_digest_requires_a_mapping() -> None:
    with pytest.raises(TypeError):
        contract_digest([BASE])  # type: ignore[arg-type]


_UINT = st.integers(min_value=0, max_value=2**64 - 1)
_CONTRACTS = st.fixed_dictionaries(
    {
        "target": st.binary(min_size=32, max_size=32),
        "tokenizer": st.binary(min_size=32, max_size=32),
        "rule": _UINT,
        "m_max": st.integers(min_value=1, max_value=64),
        "max_new": _UINT,
        "stop": st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=4),
        "low_rounds": st.integers(min_value=1, max_value=2**64 - 1),
        "fallback": st.lists(st.sampled_from([1, 2, 3, 5]) | st.integers(min_value=6, max_value=2**64 - 1), min_size=1),
    },
    optional={
        "drafters": st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=3),
        "sampling": st.fixed_dictionaries(
            {},
            optional={
                "temperature_milli": _UINT,
                "top_k": _UINT,
                "top_p_milli": st.integers(min_value=0, max_value=1000),
                "seed": _UINT,
            },
        ),
        "low_ratio": st.integers(min_value=0, max_value=100),
        "self_load": st.integers(min_value=0, max_value=100),
        "self_max": _UINT,
        "scope": st.binary(min_size=16, max_size=16),
    },
)


@settings(max_examples=150, deadline=None)
@given(_CONTRACTS)
def test_valid_contracts_round_trip_and_digest(contract: dict[str, Any]) -> None:
    parsed = Contract.from_obj(contract)
    assert parsed.to_obj() == contract
    assert Contract.from_cbor(parsed.to_cbor()) == parsed
    assert parsed.digest == contract_digest(contract) == _reference_digest(contract)


def test_python_forms_of_contract_members_give_the_same_digest() -> None:
    python_forms = {**BASE, "target": bytearray(BASE["target"]), "stop": (2,), "fallback": [Action.REDUCE, 2, 3, 5]}
    assert Contract.from_obj(python_forms).digest == _reference_digest(BASE)
