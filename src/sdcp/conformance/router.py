"""Checks of a router (SDCP 5.2, 6.1, 6.5.2), the kit playing a verifier, two drafters and a front end.

The draft leaves the client-facing API out of scope (1.4), so the kit asks for a session the way
sdcp's router takes one, `POST sessions {prompt, contract}` from a front end (docs/services.md);
everything it checks after that is what the router sends to the verifier and drafters it plays.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcp.conformance import cbor, formulas
from sdcp.conformance.played import Exchange, PlayedInstance
from sdcp.conformance.report import Report, expect
from sdcp.conformance.wire import Identity, Peer

__all__ = ["RouterUnderTest", "check_router"]

PROMPT = [1, 2, 3, 4, 5]
_TTL_MS = 1500
_REPORT_EVERY_S = 0.4
_WAIT_S = 30.0
_QUIET_S = 2.0


@dataclass(frozen=True)
class RouterUnderTest:
    url: str
    ca: Path
    front_end: Identity
    verifier: Identity
    drafters: tuple[Identity, Identity]
    target: bytes
    tokenizer: bytes


def _status_path(identity: Identity) -> str:
    # Table 1 defines {id} for sessions only; the kit names its instances its own way.
    return f"instances/kit-{hashlib.sha256(identity.uri.encode()).hexdigest()[:16]}/status"


def _status(identity: Identity, role: int) -> dict[str, Any]:
    return {"instance": identity.uri, "role": role, "load": 0, "queue": 0, "ttl_ms": _TTL_MS}  # SDCP 5.2


class _Kit:
    def __init__(self, target: RouterUnderTest) -> None:
        self.target = target
        self.front_end = Peer(target.url, target.front_end, target.ca)
        self.verifier = PlayedInstance(target.verifier, target.ca)
        self.drafters = [PlayedInstance(identity, target.ca) for identity in target.drafters]
        self.reporters = {
            identity.uri: (Peer(target.url, identity, target.ca), _status(identity, role))
            for identity, role in ((target.verifier, 2), *((d, 1) for d in target.drafters))
        }
        self.reporting = set(self.reporters)
        self._reports: asyncio.Task[None] | None = None
        self.contract: dict[str, Any] = {
            "target": target.target,
            "tokenizer": target.tokenizer,
            "rule": 1,
            "m_max": 4,
            "max_new": 64,
            "stop": [],
            "low_rounds": 1000,
            "fallback": [1, 5],
        }
        self.d0 = formulas.prefix_digest(formulas.contract_digest(self.contract), PROMPT)

    async def start(self) -> None:
        for instance in (self.verifier, *self.drafters):
            await instance.start()

    async def report(self, uri: str) -> int:
        peer, status = self.reporters[uri]
        return (await peer.request("PUT", _status_path(peer.identity), status)).status

    def keep_reporting(self) -> None:
        async def forever() -> None:
            while True:
                for uri in list(self.reporting):
                    with contextlib.suppress(Exception):
                        await self.report(uri)
                await asyncio.sleep(_REPORT_EVERY_S)

        self._reports = asyncio.create_task(forever())

    async def event(self, session: bytes, kind: int) -> int:
        peer = self.reporters[self.target.verifier.uri][0]
        event = {"session": session, "epoch": 1, "kind": kind, "committed": 0, "digest": self.d0}
        return (await peer.request("POST", "events", event)).status

    async def assignment_exchange(self) -> tuple[Exchange, str]:
        """The verifier's PUT .../drafter, then the named drafter's POST assignments (6.1 order)."""
        put = await self.verifier.next(_WAIT_S, path_prefix="sessions/")
        expect(put is not None and put.method == "PUT", f"the verifier was not told of a drafter: {put}")
        assert put is not None
        named = put.value.get("drafter") if isinstance(put.value, dict) else None
        early = [d.identity.uri for d in self.drafters if not d.requests.empty()]
        expect(not early, f"{early} got an assignment before the verifier was told (6.1)")
        put.answer({"session": put.value["session"], "epoch": 1, "round": 0, "committed": 0, "digest": self.d0})
        drafter = next((d for d in self.drafters if d.identity.uri == named), None)
        expect(drafter is not None, f"the verifier was told of {named}, not a drafter the kit plays")
        assert drafter is not None
        posted = await drafter.next(_WAIT_S, path_prefix="assignments")
        expect(posted is not None, f"{named} got no assignment")
        assert posted is not None
        posted.answer()
        return posted, drafter.identity.uri

    async def quiet(self, seconds: float) -> list[str]:
        """What the played instances receive in `seconds`, answered 404."""
        await asyncio.sleep(seconds)
        seen = []
        for instance in (self.verifier, *self.drafters):
            while not instance.requests.empty():
                exchange = instance.requests.get_nowait()
                seen.append(f"{instance.identity.uri}: {exchange.method} {exchange.path}")
                exchange.answer_problem(404, "about:blank", "the kit expected nothing")
        return seen

    async def close(self) -> None:
        if self._reports is not None:
            self._reports.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reports
        await self.front_end.close()
        for peer, _ in self.reporters.values():
            await peer.close()
        for instance in (self.verifier, *self.drafters):
            await instance.stop()


async def check_router(target: RouterUnderTest, report: Report) -> Report:
    kit = _Kit(target)
    await kit.start()
    try:
        await _run(kit, report)
    finally:
        await kit.close()
    return report


async def _run(kit: _Kit, report: Report) -> None:
    with report.check("status reports of a verifier and drafters are taken", "6.1, 5.2, Table 1") as evidence:
        codes = [await kit.report(uri) for uri in kit.reporters]
        expect(all(200 <= code < 300 for code in codes), f"answered {codes}")
        evidence.append(f"{codes}")
    kit.keep_reporting()
    with report.check("a status that is not CBOR is answered 4xx", "5.2, 5.1") as evidence:
        peer = kit.reporters[kit.target.verifier.uri][0]
        answer = await peer.request("PUT", _status_path(peer.identity), raw=b"\xff not cbor")
        expect(400 <= answer.status < 500, f"answered {answer}")
        evidence.append(f"{answer.status}")
    opening = asyncio.create_task(
        kit.front_end.request("POST", "sessions", {"prompt": PROMPT, "contract": kit.contract})
    )
    session: bytes | None = None
    try:
        with report.check(
            "session-open carries epoch 1, the contract, the prompt and a commit_log", "6.1, 5.2"
        ) as evidence:
            opened = await kit.verifier.next(_WAIT_S, path_prefix="sessions")
            expect(opened is not None and opened.method == "POST", f"no session-open: {opened}")
            assert opened is not None
            message = opened.value
            session = message.get("session")
            expect(isinstance(session, bytes) and len(session) == 16, f"session {session!r}")
            expect(message.get("epoch") == 1 and "resume" not in message, f"epoch {message.get('epoch')}")
            expect(cbor.encode(message.get("contract")) == cbor.encode(kit.contract), "the contract differs")
            expect(message.get("prompt") == PROMPT, f"prompt {message.get('prompt')}")
            log = message.get("commit_log")
            expect(isinstance(log, str) and ":" in log, f"commit_log {log!r} is not a URI")
            opened.answer({"session": session, "epoch": 1, "round": 0, "committed": 0, "digest": kit.d0}, status=201)
            evidence.append(f"commit_log {log}")
        first = ""
        with report.check(
            "the verifier hears of the drafter first; the assignment carries d[0]", "6.1, 5.2"
        ) as evidence:
            assignment, first = await kit.assignment_exchange()
            got = assignment.value
            expected = {"session": session, "epoch": 1, "verifier": kit.target.verifier.uri, "drafter": first}
            expected |= {"round": 0, "committed": 0, "digest": kit.d0}
            expect({key: got.get(key) for key in expected} == expected, f"assignment {got}")
            expect(isinstance(got.get("m_init"), int) and got["m_init"] >= 1, f"m_init {got.get('m_init')!r}")
            expect(cbor.encode(got.get("contract")) == cbor.encode(kit.contract), "the contract differs")
            evidence.append(f"assigned to {first}")
        answer = await opening
        expect(200 <= answer.status < 300, f"the front end's session request answered {answer}")
        assert session is not None
        await _escalation(kit, report, session, first)
    finally:
        opening.cancel()


async def _escalation(kit: _Kit, report: Report, session: bytes, first: str) -> None:
    other = next(d.identity.uri for d in kit.drafters if d.identity.uri != first)
    with report.check("a switch event moves the session to the other drafter", "6.5.2") as evidence:
        pending = asyncio.create_task(kit.event(session, 2))
        _, second = await kit.assignment_exchange()
        expect(200 <= await pending < 300, "the switch event was refused")
        expect(second == other, f"assigned to {second} again")
        evidence.append(f"{first} -> {second}")
    with report.check("an instance whose status expired is not assigned", "6.1, 6.9") as evidence:
        kit.reporting.discard(first)
        await asyncio.sleep(2 * _TTL_MS / 1000)
        pending = asyncio.create_task(kit.event(session, 2))
        seen = []
        for _ in range(2):
            put = await kit.verifier.next(_QUIET_S, path_prefix="sessions/")
            if put is None:
                break
            named = put.value.get("drafter")
            seen.append(named)
            put.answer({"session": session, "epoch": 1, "round": 0, "committed": 0, "digest": kit.d0})
            drafter = next((d for d in kit.drafters if d.identity.uri == named), None)
            if drafter is not None and (posted := await drafter.next(_WAIT_S, path_prefix="assignments")):
                posted.answer()
        await pending
        expect(first not in seen, f"assigned to {first}, whose status expired")
        evidence.append(f"assigned to {seen or 'nobody'}")
        kit.reporting.add(first)
    with report.check("an unknown event kind is treated as fail", "5.2, 6.5.2") as evidence:
        code = await kit.event(session, 99)
        expect(200 <= code < 300 or 400 <= code < 500, f"answered {code}")
        await kit.event(session, 2)
        seen = await kit.quiet(_QUIET_S)
        expect(not seen, f"the failed session was still served: {seen}")
        evidence.append(f"{code}; nothing assigned afterwards")
