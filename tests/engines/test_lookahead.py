"""VerifierLookahead: self-decoding's guesses from the session's own tokens and from the outputs of
sessions that finished on this verifier, kept apart per contract and owner."""

from __future__ import annotations

from sdcp.engines.verifier.live import LiveSession
from sdcp.engines.verifier.lookahead import VerifierLookahead
from sdcp.protocol.messages import Action, Contract
from sdcp.protocol.verifier import VerifierSession

PROMPT = (1, 2, 3)
ANSWER = (40, 41, 42, 43, 44, 45, 46, 47)


def _contract(target: bytes = b"\x01" * 32) -> Contract:
    return Contract.from_obj(
        {
            "target": target,
            "tokenizer": b"\x02" * 32,
            "rule": 1,
            "m_max": 4,
            "max_new": 64,
            "stop": [],
            "low_rounds": 2,
            "fallback": [Action.REDUCE, Action.FAIL],
        }
    )


def _live(
    tokens: tuple[int, ...] = (), *, owner: str | None = "https://a.test", contract: Contract | None = None
) -> LiveSession:
    machine = VerifierSession(session=bytes(16), epoch=1, contract=contract or _contract(), prompt=PROMPT)
    machine.tokens.extend(tokens)
    return LiveSession(machine=machine, log=None, etag="", owner=owner)  # type: ignore[arg-type]


def _context(live: LiveSession) -> tuple[int, ...]:
    return (*live.machine.prompt, *live.machine.tokens)


def test_a_session_that_repeats_itself_is_predicted_from_its_own_tokens() -> None:
    lookahead = VerifierLookahead()
    live = _live((*ANSWER, 9, 40, 41))
    assert lookahead.predict(live, _context(live), 4) == (42, 43, 44, 45)
    live.machine.tokens.extend((42, 43))
    assert lookahead.predict(live, _context(live), 16) == (44, 45, 46, 47, 9, 40, 41, 42, 43)


def test_a_finished_sessions_output_predicts_a_later_session_of_the_same_owner_only() -> None:
    lookahead = VerifierLookahead()
    finished = _live(ANSWER)
    finished.machine.control.finish()
    lookahead.learn(finished)
    assert lookahead.history.size.sessions == 1 and lookahead.history.size.tokens == len(ANSWER)

    later = _live((5, 40, 41))
    assert lookahead.predict(later, _context(later), 3) == (42, 43, 44)
    other_owner = _live((5, 40, 41), owner="https://b.test")
    assert lookahead.predict(other_owner, _context(other_owner), 3) == ()
    other_target = _live((5, 40, 41), contract=_contract(b"\x03" * 32))
    assert lookahead.predict(other_target, _context(other_target), 3) == ()


def test_a_failed_session_is_not_learned() -> None:
    lookahead = VerifierLookahead()
    failed = _live(ANSWER)
    failed.machine.control.fail()
    lookahead.learn(failed)
    assert lookahead.history.size.sessions == 0


def test_the_history_is_bounded_oldest_first() -> None:
    lookahead = VerifierLookahead(history_tokens=2 * len(ANSWER))
    for first in (100, 200, 300):
        finished = _live(tuple(range(first, first + len(ANSWER))))
        finished.machine.control.finish()
        lookahead.learn(finished)
    assert lookahead.history.size.sessions == 2 and lookahead.history.size.tokens == 2 * len(ANSWER)
    oldest, newest = _live((100, 101)), _live((300, 301))
    assert lookahead.predict(oldest, _context(oldest), 2) == ()
    assert lookahead.predict(newest, _context(newest), 2) == (302, 303)
