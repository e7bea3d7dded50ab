"""Problem types of SDCP Table 2 and their RFC 9457 problem-details bodies.

A problem body is JSON (`application/problem+json`, RFC 9457's own media type) so that any HTTP
tooling can read it. `sdcp-stale-base` also carries the current session-state (SDCP 6.3) as the
unpadded base64url of its CBOR encoding, in the member `session_state`.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sdcp.protocol.messages import SessionState

__all__ = [
    "PROBLEM_MEDIA_TYPE",
    "PROBLEM_TYPE_PREFIX",
    "BadContract",
    "BadMessage",
    "ProblemType",
    "ProtocolError",
    "parse_problem_json",
    "problem_json",
]

log = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:ietf:params:sdcp:problem:"
GENERIC_TYPE = "about:blank"
GENERIC_TITLE = "Bad Request"
SESSION_STATE_MEMBER = "session_state"


class ProblemType(enum.Enum):
    """SDCP Table 2: type suffix, HTTP status and title of each problem type."""

    STALE_EPOCH = ("sdcp-stale-epoch", 409, "Epoch is not current")
    STALE_BASE = ("sdcp-stale-base", 409, "Proposal does not extend the committed prefix")
    Q_UNAVAILABLE = ("sdcp-q-unavailable", 409, "Draft probabilities required by the rule are unavailable")
    BAD_CONTRACT = ("sdcp-bad-contract", 422, "Contract invalid or not supported")
    LIMIT = ("sdcp-limit", 422, "Proposal violates m_cap or m_max")
    SESSION_CLOSED = ("sdcp-session-closed", 410, "Session has finished or failed")
    BAD_PROPOSAL = ("sdcp-bad-proposal", 422, "Proposal inconsistent with its draft distributions")
    NOT_ASSIGNED = ("sdcp-not-assigned", 403, "Drafter is not assigned to the session")

    def __init__(self, suffix: str, status: int, title: str) -> None:
        self.suffix = suffix
        self.status = status
        self.title = title

    @property
    def uri(self) -> str:
        return PROBLEM_TYPE_PREFIX + self.suffix

    @classmethod
    def from_type(cls, type_uri: str) -> ProblemType | None:
        """The problem type whose suffix ends `type_uri`, or None when no known suffix does.

        Any prefix is accepted because deployments may spell the type URI differently; the
        suffix is what Table 2 registers.
        """
        for member in cls:
            if type_uri == member.suffix or type_uri.endswith((":" + member.suffix, "/" + member.suffix)):
                return member
        return None


class ProtocolError(Exception):
    """An SDCP error that maps to one problem-details response.

    `problem` is None for a generic error (type "about:blank"), whose status defaults to 400.
    """

    def __init__(
        self,
        problem: ProblemType | None,
        detail: str,
        *,
        state: SessionState | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(detail)
        if problem is not None and status is not None and status != problem.status:
            raise ValueError(f"{problem.suffix} has status {problem.status}, not {status}")
        self.problem = problem
        self.detail = detail
        self.state = state
        self.status = problem.status if problem is not None else (status if status is not None else 400)

    @property
    def type_uri(self) -> str:
        return self.problem.uri if self.problem is not None else GENERIC_TYPE

    @property
    def title(self) -> str:
        return self.problem.title if self.problem is not None else GENERIC_TITLE

    def to_problem(self) -> dict[str, Any]:
        """The RFC 9457 problem-details body as a JSON-ready dict."""
        if self.problem is ProblemType.STALE_BASE and self.state is None:
            # SDCP 6.3: the sdcp-stale-base we send carries the current session-state; on receipt
            # its absence is accepted (another verifier need not use our member).
            raise ValueError("sdcp-stale-base requires the current session-state")
        body: dict[str, Any] = {
            "type": self.type_uri,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if self.state is not None:
            encoded = base64.urlsafe_b64encode(self.state.to_cbor()).rstrip(b"=")
            body[SESSION_STATE_MEMBER] = encoded.decode("ascii")
        return body

    @classmethod
    def from_problem(cls, body: object) -> ProtocolError:
        """The error a problem-details body describes; a malformed body raises BadMessage."""
        if not isinstance(body, dict):
            raise BadMessage("problem details must be a JSON object")
        type_uri = body.get("type", GENERIC_TYPE)
        status = body.get("status")
        detail = body.get("detail", "")
        if not isinstance(type_uri, str):
            raise BadMessage("problem 'type' must be a string")
        if not isinstance(detail, str):
            raise BadMessage("problem 'detail' must be a string")
        if status is not None and (type(status) is not int or not 100 <= status <= 599):
            raise BadMessage("problem 'status' must be an HTTP status code")
        problem = ProblemType.from_type(type_uri)
        state = _decode_state(body.get(SESSION_STATE_MEMBER))
        if problem is None:
            if status is None or status == 400:
                return BadMessage(detail)
            return ProtocolError(None, detail, status=status)
        if status is not None and status != problem.status:
            raise BadMessage(f"{problem.suffix} must have status {problem.status}, got {status}")
        if problem is ProblemType.BAD_CONTRACT:
            return BadContract(detail)
        return ProtocolError(problem, detail, state=state)


class BadMessage(ProtocolError):
    """A malformed SDCP message or body: 400 with type "about:blank"."""

    def __init__(self, detail: str) -> None:
        super().__init__(None, detail)


class BadContract(ProtocolError):
    """A contract that is invalid or not supported: `sdcp-bad-contract` (SDCP 4.1)."""

    def __init__(self, detail: str) -> None:
        super().__init__(ProblemType.BAD_CONTRACT, detail)


def _decode_state(value: object) -> SessionState | None:
    # Imported here because codec and messages raise the errors defined in this module.
    from sdcp.protocol.codec import b64url_decode
    from sdcp.protocol.messages import SessionState

    if value is None:
        return None
    # SDCP 6.3 asks for the session-state but the draft names no member or encoding for it in a
    # problem body: one we cannot read (another verifier's encoding) counts as absent, and the
    # drafter reads the committed prefix from the output (docs/interpretations.md).
    try:
        if not isinstance(value, str):
            raise BadMessage("not a base64url string")
        return SessionState.from_cbor(b64url_decode(value))
    except BadMessage as exc:
        log.info("problem member %r is not our session-state, read as absent: %s", SESSION_STATE_MEMBER, exc.detail)
        return None


def problem_json(error: ProtocolError) -> bytes:
    """The `application/problem+json` body for `error`."""
    return json.dumps(error.to_problem(), separators=(",", ":")).encode("utf-8")


def parse_problem_json(data: bytes) -> ProtocolError:
    """The error an `application/problem+json` body describes; malformed input raises BadMessage."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadMessage(f"problem details are not JSON: {exc}") from exc
    return ProtocolError.from_problem(body)
