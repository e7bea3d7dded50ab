"""A verifier's session that no router holds is an orphan and ends within [verifier] orphan_timeout_s
(docs/reliability.md, "Orphans"), instead of waiting idle_timeout_s for nobody.

A real verifier engine (the tiny target) whose events go to a router that is gone (no answer) or
that knows no such session (404); no drafter proposes, so the engine reports the session with a
switch event after drafter_silence_s.
"""

from __future__ import annotations

import time

import pytest
from tests.waiting import eventually

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import LOG_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.errors import Unanswered
from sdcp.engines.verifier import VerifierEngine
from sdcp.models.hf.target import TargetModel
from sdcp.protocol.messages import Action, Contract, Event, SessionOpen
from sdcp.protocol.problems import ProtocolError

pytestmark = pytest.mark.timeout(60)

SESSION = bytes(range(16))
SILENCE_S, ORPHAN_S = 0.2, 0.8


async def _orphan_ends(target: TargetModel, answer: Exception) -> tuple[list[Event], float]:
    """Open a session whose events all get ``answer``; the events sent, and when the session ended
    (seconds after the first event)."""
    sent: list[Event] = []

    async def router_gone(event: Event) -> None:
        sent.append(event)
        raise answer

    mlc = MLC.from_config(authority="orphans.test")
    settings = VerifierConfig(drafter_silence_s=SILENCE_S, orphan_timeout_s=ORPHAN_S)
    engine = VerifierEngine(
        uri="https://verifier.test", settings=settings, target=target, mlc=mlc, ttl_ms=1000, events=router_gone
    )
    await engine.start()
    try:
        contract = Contract.from_obj(
            {
                "target": target.weights_digest,
                "tokenizer": target.tokenizer_digest,
                "rule": 1,
                "m_max": 4,
                "max_new": 32,
                "stop": [],
                "low_rounds": 2,
                "fallback": [int(Action.FAIL)],
            }
        )
        log = build_uri(mlc.authority, None, LOG_KIND, SESSION.hex())
        await engine.open_session(
            SessionOpen(session=SESSION, epoch=1, contract=contract, prompt=(5, 6, 7), commit_log=log)
        )
        machine = engine.sessions[SESSION].machine
        await eventually(lambda: bool(sent))
        first_event = time.monotonic()
        await eventually(lambda: machine.ended)
        ended_after = time.monotonic() - first_event
        output = await engine.output(SESSION, 0)
        assert output.final and output.finish == Action.FAIL
        return sent, ended_after
    finally:
        await engine.stop()
        await mlc.close()


async def test_a_session_whose_routers_are_gone_ends_after_the_orphan_timeout(target: TargetModel) -> None:
    sent, ended_after = await _orphan_ends(target, Unanswered("no router answers"))
    assert sent[0].kind == Action.SWITCH  # the drafter silence, asked of a router that is gone
    # Not before the timeout, and soon after it (the events' back-off is under a second here).
    assert ORPHAN_S * 0.9 <= ended_after < ORPHAN_S + 2.0


async def test_a_session_no_router_holds_ends_at_once(target: TargetModel) -> None:
    sent, ended_after = await _orphan_ends(target, ProtocolError(None, "no such session", status=404))
    assert sent[0].kind == Action.SWITCH
    assert ended_after < ORPHAN_S
