"""A contract for the router policy's tests: fixed target and tokenizer digests, rule 1, switch on
escalation, and optionally the drafter models it permits; shared by tests/protocol/test_router.py and
tests/engines/test_self_decode_only_state.py and
tests/engines/test_router_sessions.py."""

from __future__ import annotations

from sdcp.protocol.messages import Action, Contract


def contract(drafters: list[bytes] | None = None) -> Contract:
    obj: dict[str, object] = {
        "target": b"\x01" * 32,
        "tokenizer": b"\x02" * 32,
        "rule": 1,
        "m_max": 8,
        "max_new": 16,
        "stop": [],
        "low_rounds": 2,
        "fallback": [Action.SWITCH],
    }
    if drafters is not None:
        obj["drafters"] = drafters
    return Contract.from_obj(obj)
