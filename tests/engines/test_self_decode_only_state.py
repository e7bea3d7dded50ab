"""A session without speculation (session-open ``self_decode_only``, docs/interpretations.md,
"Per-request speculation") stays one wherever it goes: in every session-open of its plan, after a
failover, and in the state another router takes the session over from."""

from __future__ import annotations

from tests.protocol.router_contracts import contract

from sdcp.engines.router.sessions import TrackedSession
from sdcp.protocol import codec
from sdcp.protocol.messages import SessionOpen
from sdcp.protocol.records import LogReplay
from sdcp.protocol.router import RouterSession


def test_the_plan_carries_self_decode_only_through_a_failover_and_the_shared_state() -> None:
    plan = RouterSession(
        session=bytes(16),
        epoch=1,
        contract=contract(),
        prompt=(1, 2, 3),
        commit_log="mlc://mlc.test/log/00",
        verifier="https://verifier1.test",
        self_decode_only=True,
    )
    assert SessionOpen.from_obj(plan.open_message().to_obj()).self_decode_only is True
    replay = LogReplay(epoch=1, round=0, tokens=(), digest=bytes(32))
    moved = plan.fail_over("https://verifier2.test", replay, "mlc://mlc.test/tokens/00")
    assert moved.open_message().self_decode_only is True
    stored = codec.decode(codec.encode(TrackedSession(moved, (1, 2, 3)).durable("https://router.test")))
    assert TrackedSession.from_durable(stored).plan.self_decode_only is True
