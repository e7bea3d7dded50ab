"""Checks of a drafter (SDCP 5.2, 6.2-6.5, 6.9), the kit playing its router and its verifier."""

from __future__ import annotations

import base64
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcp.conformance import formulas
from sdcp.conformance.played import Exchange, PlayedInstance
from sdcp.conformance.report import Report, expect
from sdcp.conformance.wire import Identity, Peer

__all__ = ["DrafterUnderTest", "check_drafter"]

PROMPT = [1, 2, 3, 4, 5]
M_MAX = 4
_FIRST_PROPOSAL_S = 60.0
_PROPOSAL_S = 30.0
# How long a drafter that must stop proposing is watched.
_QUIET_S = 1.5
# Attempts a drafter may take to resynchronise after sdcp-stale-base.
_RESYNC_ATTEMPTS = 8


@dataclass(frozen=True)
class DrafterUnderTest:
    url: str
    ca: Path
    router: Identity
    verifier: Identity
    target: bytes
    tokenizer: bytes
    # Rule-2 checks read the drafter's rows from this MLC node (docs/cache.md), as the verifier.
    mlc: str | None = None
    vocab: int | None = None


def _path_id(session: bytes) -> str:
    return base64.urlsafe_b64encode(session).rstrip(b"=").decode("ascii")


class _PlayedSession:
    """A session at the kit's verifier: the committed output and digest the kit keeps."""

    def __init__(self, kit: _Kit, **contract_changes: Any) -> None:
        self.kit = kit
        self.id = os.urandom(16)
        self.contract: dict[str, Any] = {
            "target": kit.target.target,
            "tokenizer": kit.target.tokenizer,
            "rule": 1,
            "m_max": M_MAX,
            "max_new": 64,
            "stop": [],
            "low_rounds": 1000,
            "fallback": [1, 5],
            **contract_changes,
        }
        self.digest = formulas.prefix_digest(formulas.contract_digest(self.contract), PROMPT)
        self.committed: list[int] = []
        self.round = 0
        kit.sessions[_path_id(self.id)] = self

    def assignment(self) -> dict[str, Any]:
        return {
            "session": self.id,
            "epoch": 1,
            "contract": self.contract,
            "verifier": self.kit.target.verifier.uri,
            "drafter": self.kit.target.url,
            "prompt": PROMPT,
            "round": self.round,
            "committed": len(self.committed),
            "digest": self.digest,
            "m_init": M_MAX,
        }

    def commit(self, tokens: list[int]) -> None:
        self.committed.extend(tokens)
        self.digest = formulas.extend(self.digest, tokens)

    def verdict(self, proposal: dict[str, Any], accepted: int, action: int = 0, m_cap: int = M_MAX) -> dict[str, Any]:
        """Commit `accepted` proposed tokens and one more; the verdict of SDCP 5.2."""
        extra = next(t for t in (3, 4) if t not in proposal["tokens"][accepted : accepted + 1])
        emitted = list(proposal["tokens"][:accepted]) + [extra]
        self.commit(emitted)
        self.round = proposal["round"]
        return {
            "session": self.id,
            "epoch": 1,
            "round": self.round,
            "accepted": accepted,
            "emitted": emitted,
            "committed": len(self.committed),
            "digest": self.digest,
            "action": action,
            "m_cap": m_cap,
            "low": 0,
            "load": 0,
        }

    def output(self, start: int) -> dict[str, Any]:
        return {"session": self.id, "epoch": 1, "from": start, "tokens": self.committed[start:], "final": False}


class _Kit:
    def __init__(self, target: DrafterUnderTest) -> None:
        self.target = target
        self.router = Peer(target.url, target.router, target.ca)
        self.verifier = PlayedInstance(target.verifier, target.ca)
        self.verifier.automatic = self._answer_output
        self.mlc = Peer(target.mlc, target.verifier, target.ca) if target.mlc else None
        self.sessions: dict[str, _PlayedSession] = {}

    def _answer_output(self, exchange: Exchange) -> bool:
        # SDCP 6.7: GET sessions/{id}/output?from=n, answered at once from what the kit committed.
        parts = exchange.path.split("/")
        if exchange.method != "GET" or len(parts) != 3 or parts[0] != "sessions" or parts[2] != "output":
            return False
        session = self.sessions.get(parts[1])
        start = exchange.query.get("from", "")
        if session is None or not start.isdigit() or int(start) > len(session.committed):
            exchange.answer_problem(404, "about:blank", "no such session or index at the kit's verifier")
        else:
            exchange.answer(session.output(int(start)))
        return True

    async def assign(self, session: _PlayedSession) -> None:
        answer = await self.router.request("POST", "assignments", session.assignment())
        expect(200 <= answer.status < 300, f"POST assignments answered {answer}")

    async def proposal(self, session: _PlayedSession, timeout: float = _PROPOSAL_S) -> Exchange:
        exchange = await self.verifier.next(timeout, path_prefix="proposals")
        expect(exchange is not None, f"no proposal within {timeout:.0f} s")
        assert exchange is not None
        proposal = exchange.value
        expect(isinstance(proposal, dict) and proposal.get("session") == session.id, f"a proposal {proposal!r}")
        return exchange

    async def quiet(self, seconds: float) -> Exchange | None:
        return await self.verifier.next(seconds, path_prefix="proposals")

    async def close(self) -> None:
        await self.router.close()
        if self.mlc is not None:
            await self.mlc.close()
        await self.verifier.stop()


async def check_drafter(target: DrafterUnderTest, report: Report) -> Report:
    kit = _Kit(target)
    await kit.verifier.start()
    try:
        await _session_checks(kit, report)
        await _unknown_action(kit, report)
        if target.mlc is not None and target.vocab is not None:
            await _rule_2_rows(kit, report)
    finally:
        await kit.close()
    return report


def _check_proposal(kit: _Kit, session: _PlayedSession, exchange: Exchange, limit: int) -> dict[str, Any]:
    proposal: dict[str, Any] = exchange.value
    expect(exchange.peer == kit.target.url, f"sent by {exchange.peer}, not by the drafter {kit.target.url} (6.3)")
    expect(proposal.get("epoch") == 1 and proposal.get("drafter") == kit.target.url, f"proposal {proposal}")
    expect(proposal.get("round") == session.round + 1, f"round {proposal.get('round')}, last verdict {session.round}")
    base, digest = proposal.get("base"), proposal.get("base_digest")
    expect(base == len(session.committed), f"base {base}, committed {len(session.committed)}")
    expect(digest == session.digest, f"base_digest is not the kit's d[{len(session.committed)}]")
    tokens = proposal.get("tokens")
    expect(isinstance(tokens, list) and 1 <= len(tokens) <= limit, f"M = {len(tokens or [])}, allowed 1..{limit}")
    status = proposal.get("status")
    expect(
        isinstance(status, dict) and status.get("instance") == kit.target.url and status.get("role") == 1,
        f"status {status}",
    )
    return proposal


async def _session_checks(kit: _Kit, report: Report) -> None:
    session = _PlayedSession(kit)
    with report.check("the router's assignment is taken", "6.1, Table 1") as evidence:
        await kit.assign(session)
        evidence.append("2xx")
    exchange: Exchange | None = None
    with report.check("the first proposal extends the assigned prefix within m_init", "6.2, 5.2, 4.2") as evidence:
        exchange = await kit.proposal(session, _FIRST_PROPOSAL_S)
        proposal = _check_proposal(kit, session, exchange, M_MAX)
        evidence.append(f"round 1, {len(proposal['tokens'])} tokens on d[0]")
    if exchange is None:
        return
    with report.check("no second proposal while one is outstanding", "6.2") as evidence:
        second = await kit.quiet(_QUIET_S)
        expect(second is None, f"another proposal arrived: {second.value if second else None}")
        evidence.append(f"none in {_QUIET_S} s")
    exchange.answer(session.verdict(exchange.value, accepted=0, m_cap=1))
    with report.check("the next proposal follows the verdict: round, base, digest and m_cap", "6.2, 6.5.1") as evidence:
        exchange = await kit.proposal(session)
        _check_proposal(kit, session, exchange, 1)
        evidence.append("round 2 on d[1], M = 1")
    first_try = exchange.value
    exchange.answer_problem(503, "about:blank", "the kit lost this verdict")
    with report.check("a proposal without a verdict is sent again unchanged", "6.9, 6.3") as evidence:
        exchange = await kit.proposal(session)
        same = {k: v for k, v in exchange.value.items() if k != "status"} == {
            k: v for k, v in first_try.items() if k != "status"
        }
        expect(same, f"the retry differs: {exchange.value} after {first_try}")
        evidence.append("the same round, base and tokens")
    exchange.answer(session.verdict(exchange.value, accepted=len(exchange.value["tokens"])))
    await _stale_base(kit, report, session)


async def _stale_base(kit: _Kit, report: Report, session: _PlayedSession) -> None:
    with report.check(
        "after sdcp-stale-base the drafter resynchronises from the output", "6.3, 6.7, 6.5.2"
    ) as evidence:
        exchange = await kit.proposal(session)
        # Meanwhile the verifier decoded two tokens itself, two rounds without proposals (6.5.2).
        session.commit([5, 6])
        session.round += 2
        exchange.answer_problem(409, "sdcp-stale-base", "the verifier decoded two tokens itself")
        for attempt in range(1, _RESYNC_ATTEMPTS + 1):
            exchange = await kit.proposal(session)
            proposal = exchange.value
            if proposal.get("base") == len(session.committed) and proposal.get("round") == session.round + 1:
                expect(proposal.get("base_digest") == session.digest, "the resynchronised base_digest is wrong")
                evidence.append(f"round {session.round + 1} on d[{len(session.committed)}] after {attempt} tries")
                break
            exchange.answer_problem(409, "sdcp-stale-base", "not the committed prefix and round")
        else:
            expect(False, f"no proposal on the committed prefix in {_RESYNC_ATTEMPTS} tries")
    with report.check("after a switch the drafter stops proposing", "6.5.2") as evidence:
        exchange.answer(session.verdict(exchange.value, accepted=0, action=2))
        late = await kit.quiet(_QUIET_S)
        expect(late is None, f"a proposal after switch: {late.value if late else None}")
        evidence.append(f"none in {_QUIET_S} s")


async def _unknown_action(kit: _Kit, report: Report) -> None:
    with report.check("an unknown action in a verdict is treated as fail", "5.2") as evidence:
        session = _PlayedSession(kit)
        await kit.assign(session)
        exchange = await kit.proposal(session, _FIRST_PROPOSAL_S)
        exchange.answer(session.verdict(exchange.value, accepted=0, action=77))
        late = await kit.quiet(_QUIET_S)
        expect(late is None, f"a proposal after action 77: {late.value if late else None}")
        evidence.append(f"none in {_QUIET_S} s")


async def _rule_2_rows(kit: _Kit, report: Report) -> None:
    vocab = kit.target.vocab
    assert vocab is not None and kit.mlc is not None
    with report.check(
        "under rule 2 each proposed token has q > 0 in the row the drafter published", "6.4, 5.2"
    ) as evidence:
        session = _PlayedSession(kit, rule=2, sampling={"seed": 7})
        await kit.assign(session)
        exchange = await kit.proposal(session, _FIRST_PROPOSAL_S)
        proposal = _check_proposal(kit, session, exchange, M_MAX)
        uri = proposal.get("q_rows")
        try:
            expect(isinstance(uri, str), f"no q_rows in {proposal}")
            answer = await kit.mlc.request("GET", "objects", query={"uri": uri})
            expect(answer.status == 200, f"the rows {uri}: {answer}")
            tokens = proposal["tokens"]
            expect(
                len(answer.body) == 4 * vocab * len(tokens),
                f"{len(answer.body)} octets for {len(tokens)} rows of {vocab}",
            )
            for i, token in enumerate(tokens):
                row = struct.unpack_from(f"<{vocab}f", answer.body, 4 * vocab * i)
                expect(row[token] > 0, f"q[{i + 1}]({token}) = {row[token]}")
                expect(abs(sum(row) - 1) < 1e-3, f"row {i + 1} sums to {sum(row)}")
            evidence.append(f"{len(tokens)} rows of {vocab}")
        finally:
            exchange.answer(session.verdict(proposal, accepted=0, action=4))
