"""Problem types of SDCP Table 2 and their RFC 9457 bodies."""

from __future__ import annotations

import base64
import json

import cbor2
import pytest

from sdcp.protocol import BadContract, BadMessage, ProblemType, ProtocolError, SessionState
from sdcp.protocol.problems import PROBLEM_MEDIA_TYPE, parse_problem_json, problem_json

STATE = SessionState(session=bytes(range(16)), epoch=3, round=7, committed=12, digest=b"\xab" * 32)

TABLE_2 = [
    ("sdcp-stale-epoch", 409, "Epoch is not current"),
    ("sdcp-stale-base", 409, "Proposal does not extend the committed prefix"),
    ("sdcp-q-unavailable", 409, "Draft probabilities required by the rule are unavailable"),
    ("sdcp-bad-contract", 422, "Contract invalid or not supported"),
    ("sdcp-limit", 422, "Proposal violates m_cap or m_max"),
    ("sdcp-session-closed", 410, "Session has finished or failed"),
    ("sdcp-bad-proposal", 422, "Proposal inconsistent with its draft distributions"),
    ("sdcp-not-assigned", 403, "Drafter is not assigned to the session"),
]


def test_problem_types_match_table_2() -> None:
    assert [(p.suffix, p.status, p.title) for p in ProblemType] == TABLE_2


def test_problem_media_type_is_rfc9457() -> None:
    assert PROBLEM_MEDIA_TYPE == "application/problem+json"


@pytest.mark.parametrize("problem", list(ProblemType))
def test_type_uri_and_suffix_lookup(problem: ProblemType) -> None:
    assert problem.uri == "urn:ietf:params:sdcp:problem:" + problem.suffix
    assert ProblemType.from_type(problem.uri) is problem
    assert ProblemType.from_type("https://example.com/problems/" + problem.suffix) is problem
    assert ProblemType.from_type(problem.suffix) is problem


@pytest.mark.parametrize("type_uri", ["about:blank", "urn:x:sdcp-unknown", "urn:x:not-sdcp-limit-x", "xsdcp-limit"])
def test_unknown_type_uris(type_uri: str) -> None:
    assert ProblemType.from_type(type_uri) is None


def _error_for(problem: ProblemType) -> ProtocolError:
    state = STATE if problem is ProblemType.STALE_BASE else None
    return ProtocolError(problem, f"detail of {problem.suffix}", state=state)


@pytest.mark.parametrize("problem", list(ProblemType))
def test_body_round_trip_through_json(problem: ProblemType) -> None:
    error = _error_for(problem)
    body = json.loads(problem_json(error))
    assert body["type"] == problem.uri
    assert body["title"] == problem.title
    assert body["status"] == problem.status == error.status
    assert body["detail"] == error.detail
    parsed = parse_problem_json(problem_json(error))
    assert (parsed.problem, parsed.status, parsed.detail, parsed.state) == (
        problem,
        problem.status,
        error.detail,
        error.state,
    )


def test_stale_base_carries_session_state_as_base64url_cbor() -> None:
    body = _error_for(ProblemType.STALE_BASE).to_problem()
    encoded = body["session_state"]
    assert "=" not in encoded and "+" not in encoded and "/" not in encoded
    raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    assert cbor2.loads(raw) == {
        "session": bytes(range(16)),
        "epoch": 3,
        "round": 7,
        "committed": 12,
        "digest": b"\xab" * 32,
    }


def test_stale_base_is_sent_only_with_state() -> None:
    with pytest.raises(ValueError, match="session-state"):
        ProtocolError(ProblemType.STALE_BASE, "no state").to_problem()


def test_status_must_agree_with_problem_type() -> None:
    with pytest.raises(ValueError, match="409"):
        ProtocolError(ProblemType.STALE_EPOCH, "x", status=400)


def test_bad_message_is_generic_400() -> None:
    error = BadMessage("broken")
    assert error.problem is None and error.status == 400
    assert error.to_problem() == {"type": "about:blank", "title": "Bad Request", "status": 400, "detail": "broken"}
    assert isinstance(parse_problem_json(problem_json(error)), BadMessage)


def test_bad_contract_is_422() -> None:
    error = BadContract("nope")
    assert error.problem is ProblemType.BAD_CONTRACT and error.status == 422
    assert isinstance(ProtocolError.from_problem(error.to_problem()), BadContract)


def test_from_problem_accepts_foreign_prefix() -> None:
    error = ProtocolError.from_problem({"type": "tag:example.org,2026:sdcp-limit", "status": 422, "detail": "M"})
    assert error.problem is ProblemType.LIMIT and error.detail == "M"


def test_unknown_type_with_other_status_is_generic_error_of_that_status() -> None:
    error = ProtocolError.from_problem({"type": "about:blank", "status": 503, "title": "Unavailable"})
    assert type(error) is ProtocolError and error.problem is None and error.status == 503


@pytest.mark.parametrize(
    "body",
    [
        [],
        "x",
        {"type": 5},
        {"type": "about:blank", "detail": 5},
        {"type": "about:blank", "status": "400"},
        {"type": "about:blank", "status": True},
        {"type": "about:blank", "status": 42},
        {"type": ProblemType.LIMIT.uri, "status": 409},
    ],
)
def test_malformed_problem_bodies_raise_bad_message(body: object) -> None:
    with pytest.raises(BadMessage):
        ProtocolError.from_problem(body)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@pytest.mark.parametrize(
    "session_state",
    [
        7,
        [],
        {"round": 7},
        "***",
        "oA",
        "",
        # Another verifier's encodings of the same state: padded or plain base64, JSON, a CBOR
        # array, a CBOR map with its own member names.
        base64.b64encode(STATE.to_cbor()).decode("ascii"),
        _b64(json.dumps({"round": 7, "committed": 12}).encode()),
        _b64(cbor2.dumps([STATE.session, 3, 7, 12, STATE.digest])),
        _b64(cbor2.dumps({"sid": STATE.session, "epoch": 3, "round": 7, "n": 12, "d": STATE.digest})),
    ],
)
def test_a_session_state_in_another_encoding_reads_as_absent(session_state: object) -> None:
    # SDCP 6.3 names no member or encoding for the session-state of sdcp-stale-base: one we cannot
    # read leaves the drafter to resynchronise from the output, as when the member is absent.
    body = {"type": ProblemType.STALE_BASE.uri, "status": 409, "detail": "stale", "session_state": session_state}
    error = ProtocolError.from_problem(body)
    assert type(error) is ProtocolError
    assert error.problem is ProblemType.STALE_BASE and error.state is None and error.detail == "stale"
    assert parse_problem_json(json.dumps(body).encode()).state is None


def test_stale_base_without_session_state_is_accepted() -> None:
    # Our session_state member is a private extension: another verifier need not send it.
    error = ProtocolError.from_problem({"type": "urn:ietf:params:sdcp:problem:sdcp-stale-base", "status": 409})
    assert error.problem is ProblemType.STALE_BASE and error.state is None


@pytest.mark.parametrize("data", [b"\xff", b"{", b"not json"])
def test_non_json_problem_raises_bad_message(data: bytes) -> None:
    with pytest.raises(BadMessage, match="not JSON"):
        parse_problem_json(data)
