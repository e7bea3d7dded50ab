"""Message dataclasses (SDCP 5.2): validation, unknown keys, actions, round trips, fuzzing."""

from __future__ import annotations

import dataclasses
from typing import Any

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdcp.protocol import (
    Action,
    Assignment,
    BadContract,
    BadMessage,
    Contract,
    Event,
    Output,
    Policy,
    Proposal,
    Resume,
    Role,
    Sampling,
    SessionOpen,
    SessionState,
    Status,
    Verdict,
    parse_session_path_id,
    session_path_id,
)
from sdcp.protocol.messages import HistoryStatus, OutputRead, OutputReads, PassCost

SESSION = bytes(range(16))
DIGEST = b"\xd0" * 32
CONTRACT: dict[str, Any] = {
    "target": b"\x11" * 32,
    "tokenizer": b"\x22" * 32,
    "rule": 2,
    "sampling": {"temperature_milli": 800},
    "m_max": 8,
    "max_new": 64,
    "stop": [2],
    "low_rounds": 3,
    "fallback": [1, 2, 5],
}
STATUS: dict[str, Any] = {
    "instance": "https://d1.example",
    "role": 1,
    "load": 40,
    "queue": 2,
    "accept_milli": 700,
    "cache_mbps": 9000,
    "ttl_ms": 5000,
}
RESUME: dict[str, Any] = {
    "round": 9,
    "committed": 20,
    "digest": DIGEST,
    "committed_tokens": "mlc://s/out",
    "target_kv": "mlc://s/kv",
}
VALID: dict[type, dict[str, Any]] = {
    Sampling: {"temperature_milli": 0, "top_k": 40, "top_p_milli": 1000, "seed": 7},
    Contract: CONTRACT,
    Resume: RESUME,
    SessionOpen: {
        "session": SESSION,
        "epoch": 1,
        "contract": CONTRACT,
        "prompt": [1, 2, 3],
        "prompt_kv": "mlc://s/prompt-kv",
        "commit_log": "mlc://s/log",
        "resume": RESUME,
    },
    SessionState: {"session": SESSION, "epoch": 1, "round": 0, "committed": 0, "digest": DIGEST, "state": 1},
    Assignment: {
        "session": SESSION,
        "epoch": 2,
        "contract": CONTRACT,
        "verifier": "https://v.example",
        "drafter": "https://d1.example",
        "prompt": "mlc://s/prompt",
        "round": 4,
        "sampling": {"top_k": 10},
        "committed": 12,
        "digest": DIGEST,
        "committed_tokens": "mlc://s/out",
        "m_init": 4,
    },
    Proposal: {
        "session": SESSION,
        "epoch": 2,
        "round": 5,
        "drafter": "https://d1.example",
        "base": 12,
        "base_digest": DIGEST,
        "tokens": [5, 6, 2**32 - 1],
        "q_rows": "mlc://s/q/5",
        "draft_kv": "mlc://s/dkv/5",
        "status": STATUS,
    },
    Verdict: {
        "session": SESSION,
        "epoch": 2,
        "round": 5,
        "accepted": 2,
        "emitted": [5, 6, 9],
        "committed": 15,
        "digest": DIGEST,
        "action": 1,
        "m_cap": 4,
        "low": 0,
        "load": 100,
    },
    Output: {"session": SESSION, "epoch": 2, "from": 0, "tokens": [], "final": True, "finish": 4},
    Status: STATUS,
    Event: {"session": SESSION, "epoch": 2, "kind": 2, "committed": 15, "digest": DIGEST},
    Policy: {"session": SESSION, "from_round": 6, "sampling": {}},
}
MESSAGE_TYPES = list(VALID)


def _without(obj: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != key}


_REQUIRED: dict[type, set[str]] = {
    Sampling: set(),
    Contract: {"target", "tokenizer", "rule", "m_max", "max_new", "stop", "low_rounds", "fallback"},
    Resume: {"round", "committed", "digest", "committed_tokens"},
    SessionOpen: {"session", "epoch", "contract", "prompt", "commit_log"},
    SessionState: {"session", "epoch", "round", "committed", "digest"},
    Assignment: {
        "session",
        "epoch",
        "contract",
        "verifier",
        "drafter",
        "prompt",
        "round",
        "committed",
        "digest",
        "m_init",
    },
    Proposal: {"session", "epoch", "round", "drafter", "base", "base_digest", "tokens", "status"},
    Verdict: {
        "session",
        "epoch",
        "round",
        "accepted",
        "emitted",
        "committed",
        "digest",
        "action",
        "m_cap",
        "low",
        "load",
    },
    Output: {"session", "epoch", "from", "tokens", "final"},
    Status: {"instance", "role", "load", "queue", "ttl_ms"},
    Event: {"session", "epoch", "kind", "committed", "digest"},
    Policy: {"session", "from_round", "sampling"},
}


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_valid_message_round_trips(cls: type) -> None:
    obj = VALID[cls]
    message = cls.from_obj(obj)
    assert message.to_obj() == obj
    assert cls.from_cbor(message.to_cbor()) == message
    assert cbor2.loads(message.to_cbor()) == obj


@pytest.mark.parametrize("cls", [c for c in MESSAGE_TYPES if _REQUIRED[c]], ids=lambda c: c.__name__)
def test_every_required_member_is_required(cls: type) -> None:
    for key in sorted(_REQUIRED[cls]):
        expected = BadContract if cls is Contract else BadMessage
        with pytest.raises(expected, match=key):
            cls.from_obj(_without(VALID[cls], key))


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_optional_members_may_be_absent(cls: type) -> None:
    minimal = {k: v for k, v in VALID[cls].items() if k in _REQUIRED[cls]}
    message = cls.from_obj(minimal)
    assert message.to_obj() == minimal
    for key in set(VALID[cls]) - _REQUIRED[cls]:
        assert getattr(message, key) is None


@pytest.mark.parametrize("cls", [c for c in MESSAGE_TYPES if c is not Contract], ids=lambda c: c.__name__)
def test_unknown_keys_are_ignored_outside_contracts(cls: type) -> None:
    obj = {**VALID[cls], "future_member": [1, {"x": b"y"}], "zz": "text"}
    assert cls.from_obj(obj) == cls.from_obj(VALID[cls])


def test_unknown_keys_are_ignored_in_nested_non_contract_maps() -> None:
    proposal = {**VALID[Proposal], "status": {**STATUS, "gpu": "h200"}}
    assert Proposal.from_obj(proposal).status == Status.from_obj(STATUS)
    opened = {**VALID[SessionOpen], "resume": {**RESUME, "hint": 1}}
    assert SessionOpen.from_obj(opened).resume == Resume.from_obj(RESUME)
    policy = {**VALID[Policy], "sampling": {"top_k": 3, "typical_p_milli": 50}}
    assert Policy.from_obj(policy).sampling == Sampling(top_k=3)


def test_a_drafters_history_member_is_read_as_absent_in_another_form() -> None:
    history = {"sessions": 3, "tokens": 120, "max_tokens": 131072}
    status = Status.from_obj({**STATUS, "history": history})
    assert status.history == HistoryStatus(sessions=3, tokens=120, max_tokens=131072)
    assert status.to_obj()["history"] == history
    # Not defined by the draft: another implementation's member of that name is ignored (SDCP 5.2).
    for other in (5, "full", {"sessions": 3}, {**history, "tokens": -1}, [3, 120, 131072]):
        assert Status.from_obj({**STATUS, "history": other}) == Status.from_obj(STATUS)


@pytest.mark.parametrize("cls", [SessionOpen, Assignment], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "contract",
    [
        {**CONTRACT, "extra": 1},
        {**CONTRACT, "sampling": {"temperature_milli": 800, "min_p": 1}},
        {**CONTRACT, "fallback": [0]},
        {**CONTRACT, "m_max": 65},
        _without(CONTRACT, "rule"),
        "not a map",
    ],
)
def test_anything_wrong_inside_a_contract_is_bad_contract(cls: type, contract: Any) -> None:
    with pytest.raises(BadContract):
        cls.from_obj({**VALID[cls], "contract": contract})


def test_assignment_sampling_outside_contract_is_bad_message_not_bad_contract() -> None:
    with pytest.raises(BadMessage) as caught:
        Assignment.from_obj({**VALID[Assignment], "sampling": {"top_p_milli": 1001}})
    assert not isinstance(caught.value, BadContract)


def test_nested_contract_digest_is_that_of_the_contract() -> None:
    opened = SessionOpen.from_obj(VALID[SessionOpen])
    assert opened.contract.digest == Contract.from_obj(CONTRACT).digest


BAD_MEMBERS: list[tuple[type, str, Any, str]] = [
    (SessionState, "session", b"\x00" * 15, "16 bytes"),
    (SessionState, "session", b"\x00" * 17, "16 bytes"),
    (SessionState, "session", "0" * 16, "byte string"),
    (SessionState, "digest", b"\x00" * 31, "32 bytes"),
    (SessionState, "epoch", -1, "outside"),
    (SessionState, "epoch", 2**64, "outside"),
    (SessionState, "epoch", True, "unsigned integer"),
    (SessionState, "round", "1", "unsigned integer"),
    (SessionState, "state", False, "unsigned integer"),
    (Sampling, "top_p_milli", 1001, "outside"),
    (Sampling, "temperature_milli", -5, "outside"),
    (Sampling, "seed", 2**64, "outside"),
    (Sampling, "top_k", b"\x01", "unsigned integer"),
    (Status, "role", 0, "not one of"),
    (Status, "role", 3, "not one of"),
    (Status, "role", True, "unsigned integer"),
    (Status, "load", 101, "outside"),
    (Status, "accept_milli", 1001, "outside"),
    (Status, "instance", b"x", "text string"),
    (Status, "ttl_ms", -1, "outside"),
    (Proposal, "tokens", [], "empty"),
    (Proposal, "tokens", [2**32], "outside"),
    (Proposal, "tokens", [1, -1], "outside"),
    (Proposal, "tokens", [*range(50), 2**32, 1], r"tokens\[50\] = 4294967296 is outside"),
    (Proposal, "tokens", [*range(50), "1"], r"tokens\[50\] must be an unsigned integer"),
    (Proposal, "tokens", {"0": 1}, "array"),
    (Proposal, "base_digest", b"", "32 bytes"),
    (Proposal, "status", [], "map"),
    (Proposal, "status", {**STATUS, "load": 101}, "outside"),
    (Proposal, "q_rows", 5, "text string"),
    (Proposal, "drafter", None, "text string"),
    (Verdict, "load", 101, "outside"),
    (Verdict, "action", -1, "outside"),
    (Verdict, "action", "fail", "unsigned integer"),
    (Verdict, "emitted", [True], "unsigned integer"),
    (Verdict, "m_cap", 2**64, "outside"),
    (Output, "final", 1, "boolean"),
    (Output, "finish", True, "unsigned integer"),
    (Output, "from", -1, "outside"),
    (Event, "kind", b"\x02", "unsigned integer"),
    (Policy, "sampling", 3, "map"),
    (Policy, "from_round", 2**64, "outside"),
    (SessionOpen, "prompt", 5, "token array or a cache-ref"),
    (SessionOpen, "prompt", [2**32], "outside"),
    (SessionOpen, "commit_log", b"log", "text string"),
    (SessionOpen, "resume", {**RESUME, "digest": b"\x00"}, "32 bytes"),
    (SessionOpen, "resume", _without(RESUME, "committed_tokens"), "committed_tokens"),
    (Assignment, "m_init", -1, "outside"),
    (Assignment, "committed_tokens", [1], "text string"),
]


@pytest.mark.parametrize(
    ("cls", "key", "value", "reason"), BAD_MEMBERS, ids=[f"{c.__name__}.{k}={v!r:.20}" for c, k, v, _ in BAD_MEMBERS]
)
def test_invalid_member_raises_bad_message(cls: type, key: str, value: Any, reason: str) -> None:
    with pytest.raises(BadMessage, match=reason) as caught:
        cls.from_obj({**VALID[cls], key: value})
    assert caught.value.status == 400


@pytest.mark.parametrize("obj", [[], "x", 5, None, b"\xa0"])
def test_non_map_message_is_bad_message(obj: Any) -> None:
    with pytest.raises(BadMessage, match="map"):
        Proposal.from_obj(obj)


def test_boundaries_are_inclusive() -> None:
    Status.from_obj({**STATUS, "load": 100, "accept_milli": 1000, "role": 2})
    Sampling.from_obj({"top_p_milli": 1000, "seed": 2**64 - 1})
    Contract.from_obj({**CONTRACT, "m_max": 64, "low_ratio": 100, "self_load": 100, "low_rounds": 1})
    Proposal.from_obj({**VALID[Proposal], "tokens": [0, 2**32 - 1]})


def test_direct_construction_is_validated_and_normalised() -> None:
    with pytest.raises(BadMessage, match="outside"):
        Sampling(top_p_milli=1001)
    with pytest.raises(BadMessage, match="unsigned integer"):
        SessionState(session=SESSION, epoch=True, round=0, committed=0, digest=DIGEST)
    with pytest.raises(BadMessage, match="lacks"):
        SessionState(session=SESSION, epoch=1, round=None, committed=0, digest=DIGEST)  # type: ignore[arg-type]
    with pytest.raises(BadContract, match="empty"):
        dataclasses.replace(Contract.from_obj(CONTRACT), fallback=())
    output = Output(session=bytearray(SESSION), epoch=1, from_=0, tokens=[1, 2], final=False)  # type: ignore[arg-type]
    assert output.tokens == (1, 2) and type(output.session) is bytes
    status = Status(instance="i", role=2, load=1, queue=0, ttl_ms=1)  # type: ignore[arg-type]
    assert status.role is Role.VERIFIER


def test_a_message_its_maker_computed_is_built_unjudged_and_equals_the_judged_one() -> None:
    members = {"session": SESSION, "epoch": 1, "kind": Action.FINISH, "committed": 3, "digest": DIGEST}
    assert Event.computed(**members) == Event(**members)
    # Unjudged: what is given stays as it is (a verifier builds only what it decided itself) ...
    assert Event.computed(**{**members, "epoch": True}).epoch is True
    # ... and the judged construction still refuses it, also after a computed one.
    with pytest.raises(BadMessage, match="unsigned integer"):
        Event(**{**members, "epoch": True})
    # A contract keeps its encoding when built: it cannot be built unjudged.
    with pytest.raises(TypeError, match="Contract"):
        Contract.computed(**dataclasses.asdict(Contract.from_obj(CONTRACT)))


@pytest.mark.parametrize(
    ("value", "action"),
    [(0, Action.CONTINUE), (3, Action.SELF_DECODE), (5, Action.FAIL), (6, Action.FAIL), (2**64 - 1, Action.FAIL)],
)
def test_action_parse_maps_unknown_values_to_fail(value: int, action: Action) -> None:
    assert Action.parse(value) is action


@pytest.mark.parametrize("unknown", [6, 77, 2**64 - 1])
def test_unknown_action_values_read_as_fail(unknown: int) -> None:
    assert Verdict.from_obj({**VALID[Verdict], "action": unknown}).action is Action.FAIL
    assert Event.from_obj({**VALID[Event], "kind": unknown}).kind is Action.FAIL
    assert Output.from_obj({**VALID[Output], "finish": unknown}).finish is Action.FAIL
    assert Contract.from_obj({**CONTRACT, "fallback": [unknown]}).ladder == (Action.FAIL,)


def test_prompt_is_tokens_or_cache_ref() -> None:
    assert SessionOpen.from_obj(VALID[SessionOpen]).prompt == (1, 2, 3)
    assert SessionOpen.from_obj({**VALID[SessionOpen], "prompt": "mlc://p"}).prompt == "mlc://p"
    assert SessionOpen.from_obj({**VALID[SessionOpen], "prompt": []}).prompt == ()


def test_output_from_member_is_named_from_on_the_wire() -> None:
    output = Output.from_obj({**VALID[Output], "from": 17})
    assert output.from_ == 17 and output.to_obj()["from"] == 17 and "from_" not in output.to_obj()


def test_messages_are_frozen_and_hashable() -> None:
    proposal = Proposal.from_obj(VALID[Proposal])
    with pytest.raises(AttributeError):
        proposal.round = 6  # type: ignore[misc]
    assert hash(proposal) == hash(Proposal.from_obj(VALID[Proposal]))


def test_from_cbor_rejects_duplicate_keys_and_trailing_bytes() -> None:
    body = SessionState.from_obj(VALID[SessionState]).to_cbor()
    duplicated = bytes([body[0] + 1]) + body[1:] + cbor2.dumps("epoch") + cbor2.dumps(9)
    with pytest.raises(BadMessage, match="Duplicate"):
        SessionState.from_cbor(duplicated)
    with pytest.raises(BadMessage, match="trailing"):
        SessionState.from_cbor(body + b"\x00")


def test_session_path_id_round_trip() -> None:
    assert session_path_id(SESSION) == "AAECAwQFBgcICQoLDA0ODw"
    assert parse_session_path_id("AAECAwQFBgcICQoLDA0ODw") == SESSION


@pytest.mark.parametrize(
    "path_id",
    ["AAECAwQFBgcICQoLDA0ODw==", "AAECAwQFBgcICQoLDA0OD", "AAECAwQFBgcICQoLDA0ODx", "AAECAwQF+gcICQoLDA0ODw", ""],
)
def test_bad_session_path_id_is_bad_message(path_id: str) -> None:
    with pytest.raises(BadMessage):
        parse_session_path_id(path_id)


@pytest.mark.parametrize("session", [b"", b"\x00" * 15, "0" * 16])
def test_session_path_id_of_bad_session(session: Any) -> None:
    with pytest.raises(BadMessage, match="16 bytes|byte string"):
        session_path_id(session)


# -- fuzzing: every decoder yields a valid message or our typed error, nothing else --------------

_DATA_MODEL = st.recursive(
    st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.integers(min_value=0, max_value=10)
    | st.binary(max_size=40)
    | st.text(max_size=10)
    | st.booleans(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _check_outcome(cls: type, decode: Any) -> None:
    try:
        message = decode()
    except (BadMessage, BadContract):
        return
    assert isinstance(message, cls)
    assert cls.from_obj(message.to_obj()) == message
    assert cls.from_cbor(message.to_cbor()) == message


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(MESSAGE_TYPES), data=st.binary(max_size=200))
def test_fuzz_random_bytes(cls: type, data: bytes) -> None:
    _check_outcome(cls, lambda: cls.from_cbor(data))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(MESSAGE_TYPES), data=st.data())
def test_fuzz_mutated_members(cls: type, data: st.DataObject) -> None:
    obj = dict(VALID[cls])
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        operation = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if operation == "add" or not obj:
            obj[data.draw(st.text(max_size=12))] = data.draw(_DATA_MODEL)
            continue
        key = data.draw(st.sampled_from(sorted(obj)))
        if operation == "delete":
            del obj[key]
        else:
            obj[key] = data.draw(_DATA_MODEL)
    _check_outcome(cls, lambda: cls.from_cbor(cbor2.dumps(obj)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cls=st.sampled_from(MESSAGE_TYPES), data=st.data())
def test_fuzz_single_byte_corruption(cls: type, data: st.DataObject) -> None:
    encoded = bytearray(cls.from_obj(VALID[cls]).to_cbor())
    position = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    encoded[position] = data.draw(st.integers(min_value=0, max_value=255))
    _check_outcome(cls, lambda: cls.from_cbor(bytes(encoded)))


# -- round trips of generated valid messages ---------------------------------------------------

_U64 = st.integers(min_value=0, max_value=2**64 - 1)
_TOKEN_LISTS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=8)
_HASHES = st.binary(min_size=32, max_size=32)
_SESSIONS = st.binary(min_size=16, max_size=16)
_PERCENT = st.integers(min_value=0, max_value=100)
_SAMPLING_OBJS = st.fixed_dictionaries(
    {},
    optional={"temperature_milli": _U64, "top_k": _U64, "top_p_milli": st.integers(0, 1000), "seed": _U64},
)
_STATUS_OBJS = st.fixed_dictionaries(
    {"instance": st.text(), "role": st.sampled_from([1, 2]), "load": _PERCENT, "queue": _U64, "ttl_ms": _U64},
    optional={"accept_milli": st.integers(0, 1000), "cache_mbps": _U64},
)
_GENERATED: dict[type, st.SearchStrategy[dict[str, Any]]] = {
    Sampling: _SAMPLING_OBJS,
    Status: _STATUS_OBJS,
    Proposal: st.fixed_dictionaries(
        {
            "session": _SESSIONS,
            "epoch": _U64,
            "round": _U64,
            "drafter": st.text(),
            "base": _U64,
            "base_digest": _HASHES,
            "tokens": _TOKEN_LISTS.filter(bool),
            "status": _STATUS_OBJS,
        },
        optional={"q_rows": st.text(), "draft_kv": st.text()},
    ),
    Verdict: st.fixed_dictionaries(
        {
            "session": _SESSIONS,
            "epoch": _U64,
            "round": _U64,
            "accepted": _U64,
            "emitted": _TOKEN_LISTS,
            "committed": _U64,
            "digest": _HASHES,
            "action": st.integers(0, 5),
            "m_cap": _U64,
            "low": _U64,
            "load": _PERCENT,
        }
    ),
    Output: st.fixed_dictionaries(
        {"session": _SESSIONS, "epoch": _U64, "from": _U64, "tokens": _TOKEN_LISTS, "final": st.booleans()},
        optional={"finish": st.integers(0, 5)},
    ),
    SessionState: st.fixed_dictionaries(
        {"session": _SESSIONS, "epoch": _U64, "round": _U64, "committed": _U64, "digest": _HASHES},
        optional={"state": _U64},
    ),
    Event: st.fixed_dictionaries(
        {"session": _SESSIONS, "epoch": _U64, "kind": st.integers(0, 5), "committed": _U64, "digest": _HASHES}
    ),
    Policy: st.fixed_dictionaries({"session": _SESSIONS, "from_round": _U64, "sampling": _SAMPLING_OBJS}),
    SessionOpen: st.fixed_dictionaries(
        {
            "session": _SESSIONS,
            "epoch": _U64,
            "contract": st.just(CONTRACT),
            "prompt": _TOKEN_LISTS | st.text(),
            "commit_log": st.text(),
        },
        optional={
            "prompt_kv": st.text(),
            "resume": st.fixed_dictionaries(
                {"round": _U64, "committed": _U64, "digest": _HASHES, "committed_tokens": st.text()},
                optional={"target_kv": st.text()},
            ),
        },
    ),
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cls=st.sampled_from(sorted(_GENERATED, key=lambda c: c.__name__)))
def test_generated_messages_round_trip(data: st.DataObject, cls: type) -> None:
    obj = data.draw(_GENERATED[cls])
    message = cls.from_obj(obj)
    assert message.to_obj() == obj
    assert cls.from_cbor(message.to_cbor()) == message


def test_instance_path_id_round_trip() -> None:
    from sdcp.protocol.messages import instance_path_id, parse_instance_path_id

    uri = "https://drafter-1.example:8443/sdcp"
    assert "=" not in instance_path_id(uri) and "/" not in instance_path_id(uri)
    assert parse_instance_path_id(instance_path_id(uri)) == uri
    # Another implementation's ids name nobody: the status and the certificate tell who reports.
    assert parse_instance_path_id("_w") is None
    assert parse_instance_path_id("drafter-7") is None
    assert parse_instance_path_id(instance_path_id("drafter-7")) is None


def test_a_verifiers_pass_costs_are_read_as_absent_in_another_form() -> None:
    points = [{"rows": 1, "us": 6600}, {"rows": 2, "us": 13500}]
    status = Status.from_obj({**STATUS, "pass_us": points, "pass_sessions": 4})
    assert status.pass_us == (PassCost(rows=1, us=6600), PassCost(rows=2, us=13500)) and status.pass_sessions == 4
    assert status.to_obj()["pass_us"] == points
    for other in (5, [], [{"rows": 0, "us": 1}], [[1, 6600]], [{"rows": 1}], [{"rows": 1, "us": 1}] * 17):
        assert Status.from_obj({**STATUS, "pass_us": other}).pass_us is None
    assert Status.from_obj({**STATUS, "pass_sessions": -1}).pass_sessions is None
    assert Status.from_obj({**STATUS, "pass_apart": True}).pass_apart is True
    assert Status.from_obj({**STATUS, "pass_apart": 1}).pass_apart is None


def test_a_parsed_message_is_checked_once_and_one_made_in_code_still_is() -> None:
    """`from_obj` parses each member once (its dataclass does not parse them again), keeps the
    checks across members, and leaves a message made in code checked as before, even after a
    parse that failed half way."""
    read = {"session": SESSION, "from": 3}
    assert OutputReads.from_obj({"reads": [read]}).reads == (OutputRead(session=SESSION, from_=3),)
    with pytest.raises(BadMessage, match="more than once"):
        OutputReads.from_obj({"reads": [read, read]})
    with pytest.raises(BadMessage):
        OutputRead(session=SESSION[:3], from_=3)
    output = {"session": SESSION, "epoch": 1, "from": 0, "tokens": [1, 2], "final": False}
    assert Output.from_obj(output).tokens == (1, 2)
    with pytest.raises(BadMessage, match="tokens"):
        Output.from_obj({**output, "tokens": [1, -2]})
