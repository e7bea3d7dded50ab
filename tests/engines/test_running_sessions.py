"""RunningSessions (sdcp.engines.verifier.live): the count the scorer and every pass read follows
sessions that open, end and are forgotten, and never walks the ended ones kept for their readers."""

from __future__ import annotations

from sdcp.cache.commitlog import MemoryCommitLog
from sdcp.engines.verifier.live import LiveSession, RunningSessions
from sdcp.protocol.messages import Action, Contract
from sdcp.protocol.verifier import VerifierSession

CONTRACT = Contract.from_obj(
    {
        "target": b"\x01" * 32,
        "tokenizer": b"\x02" * 32,
        "rule": 1,
        "m_max": 4,
        "max_new": 8,
        "stop": [7],
        "low_rounds": 2,
        "fallback": [Action.FAIL],
    }
)


def live_session(number: int) -> LiveSession:
    session = bytes([number]) * 16
    machine = VerifierSession(session=session, epoch=1, contract=CONTRACT, prompt=(1, 2, 3))
    return LiveSession(machine, MemoryCommitLog(f"mlc://local/-/log/{number}"), "", b"")


def test_the_count_follows_opens_ends_and_forgotten_sessions() -> None:
    sessions: dict[bytes, LiveSession] = {}
    running = RunningSessions(sessions)
    first, second, third = live_session(1), live_session(2), live_session(3)
    for live in (first, second, third):
        sessions[live.machine.session] = live
        running.add(live)
    assert running.count == 3
    first.machine.control.finish()
    # Kept for its readers, but ended: no longer running once a round that ended it is counted.
    running.recount()
    assert running.count == 2 and first.machine.session in sessions
    del sessions[second.machine.session]
    running.recount()
    assert running.count == 1
    # A later epoch of the third session replaces it: the old one no longer counts, the new one does.
    replacement = live_session(3)
    sessions[replacement.machine.session] = replacement
    running.add(replacement)
    assert running.count == 1
    replacement.machine.control.fail()
    running.recount()
    assert running.count == 0


def test_the_count_is_an_int_read_without_walking_the_sessions() -> None:
    sessions: dict[bytes, LiveSession] = {}
    running = RunningSessions(sessions)
    live = live_session(1)
    sessions[live.machine.session] = live
    running.add(live)
    # The scorer's thread reads the figure while the loop changes sessions: until the loop
    # recounts, it stays what was counted last.
    live.machine.control.finish()
    assert running.count == 1
    running.recount()
    assert running.count == 0
