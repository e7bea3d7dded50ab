"""Checks of a verifier (SDCP 4, 5, 6.1-6.7), the kit playing its router and its drafter."""

from __future__ import annotations

import base64
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdcp.conformance import cbor, formulas
from sdcp.conformance.report import Report, expect
from sdcp.conformance.wire import Answer, Identity, Peer

__all__ = ["VerifierUnderTest", "check_verifier"]

PROMPT = [1, 2, 3, 4, 5]
M_MAX = 4
MAX_NEW = 8
# Rule-2 sessions whose seeded acceptance decisions must agree with the kit's own randomness, and
# the r below (above) which p(x) near 1/2 must accept (reject).
RANDOMNESS_SESSIONS = 12
_LOW_R, _HIGH_R = 0.4, 0.6


@dataclass(frozen=True)
class VerifierUnderTest:
    url: str
    ca: Path
    router: Identity
    drafter: Identity
    target: bytes
    tokenizer: bytes
    # Rule-2 checks place draft rows in the verifier's MLC: the base URI of an MLC node speaking
    # docs/cache.md's HTTP API, written as the drafter, and the vocabulary size of the rows.
    mlc: str | None = None
    vocab: int | None = None


def _path_id(session: bytes) -> str:
    return base64.urlsafe_b64encode(session).rstrip(b"=").decode("ascii")  # SDCP 5.1


def _is_problem(answer: Answer, status: int, suffix: str | None = None) -> bool:
    return answer.status == status and (suffix is None or answer.problem_type() == suffix)


class _Session:
    """One session as the kit's router and drafter see it, with the digests the kit computes."""

    def __init__(self, kit: _Kit, contract: dict[str, Any], prompt: list[int] = PROMPT) -> None:
        self.kit = kit
        self.id = os.urandom(16)
        self.contract = contract
        self.prompt = prompt
        self.contract_digest = formulas.contract_digest(contract)
        self.digest = formulas.prefix_digest(self.contract_digest, prompt)
        self.round = 0
        self.committed: list[int] = []

    @property
    def path(self) -> str:
        return f"sessions/{_path_id(self.id)}"

    def open_message(self, **extra: Any) -> dict[str, Any]:
        log = f"mlc://conformance-kit/log/{_path_id(self.id)}"
        return {
            "session": self.id,
            "epoch": 1,
            "contract": self.contract,
            "prompt": self.prompt,
            "commit_log": log,
            **extra,
        }

    def assignment(self) -> dict[str, Any]:
        return {
            "session": self.id,
            "epoch": 1,
            "contract": self.contract,
            "verifier": self.kit.target.url,
            "drafter": self.kit.target.drafter.uri,
            "prompt": self.prompt,
            "round": self.round,
            "committed": len(self.committed),
            "digest": self.digest,
            "m_init": M_MAX,
        }

    def proposal(self, tokens: list[int], **changes: Any) -> dict[str, Any]:
        status = {"instance": self.kit.target.drafter.uri, "role": 1, "load": 0, "queue": 0, "ttl_ms": 5000}
        return {
            "session": self.id,
            "epoch": 1,
            "round": self.round + 1,
            "drafter": self.kit.target.drafter.uri,
            "base": len(self.committed),
            "base_digest": self.digest,
            "tokens": tokens,
            "status": status,
            **changes,
        }

    async def open_and_assign(self) -> None:
        answer = await self.kit.router.request("POST", "sessions", self.open_message())
        expect(200 <= answer.status < 300, f"session-open answered {answer}")
        answer = await self.kit.router.request("PUT", f"{self.path}/drafter", self.assignment())
        expect(200 <= answer.status < 300, f"PUT {self.path}/drafter answered {answer}")

    def take_verdict(self, proposal: dict[str, Any], answer: Answer) -> dict[str, Any]:
        """Check a verdict against the proposal (SDCP 5.2, 6.3, 6.5.1) and advance the session."""
        expect(answer.status == 200, f"proposal answered {answer}")
        verdict: dict[str, Any] = answer.value()
        expect(isinstance(verdict, dict), f"a verdict is a map, got {verdict!r}")
        emitted: list[int] = verdict.get("emitted", [])
        accepted = verdict.get("accepted")
        expect(verdict.get("session") == self.id and verdict.get("epoch") == 1, f"verdict names {verdict}")
        expect(
            verdict.get("round") == proposal["round"],
            f"verdict round {verdict.get('round')}, proposal {proposal['round']}",
        )
        expect(isinstance(accepted, int) and 0 <= accepted <= len(proposal["tokens"]), f"accepted {accepted!r}")
        expect(
            isinstance(emitted, list) and emitted[:accepted] == proposal["tokens"][:accepted], f"emitted {emitted!r}"
        )
        self.committed.extend(emitted)
        self.digest = formulas.extend(self.digest, emitted)
        self.round = proposal["round"]
        expect(
            verdict.get("committed") == len(self.committed),
            f"committed {verdict.get('committed')}, expected {len(self.committed)}",
        )
        expect(
            verdict.get("digest") == self.digest,
            f"digest {_hex(verdict.get('digest'))}, the kit computes {self.digest.hex()}",
        )
        m_cap = verdict.get("m_cap")
        expect(isinstance(m_cap, int) and 1 <= m_cap <= self.contract["m_max"], f"m_cap {m_cap!r} outside 1..m_max")
        load = verdict.get("load")
        expect(isinstance(load, int) and 0 <= load <= 100, f"load {load!r}")
        expect(verdict.get("action") in range(6), f"action {verdict.get('action')!r}")
        return verdict


def _hex(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else repr(value)


class _Kit:
    def __init__(self, target: VerifierUnderTest) -> None:
        self.target = target
        self.router = Peer(target.url, target.router, target.ca)
        self.drafter = Peer(target.url, target.drafter, target.ca)
        self.mlc = Peer(target.mlc, target.drafter, target.ca) if target.mlc else None

    def contract(self, **changes: Any) -> dict[str, Any]:
        contract: dict[str, Any] = {
            "target": self.target.target,
            "tokenizer": self.target.tokenizer,
            "rule": 1,
            "m_max": M_MAX,
            "max_new": MAX_NEW,
            "stop": [],
            "low_rounds": 1000,
            "fallback": [1, 5],
        }
        contract.update(changes)
        return contract

    async def close(self) -> None:
        for peer in (self.router, self.drafter, self.mlc):
            if peer is not None:
                await peer.close()

    async def put_rows(self, name: str, rows: list[list[float]]) -> str:
        assert self.mlc is not None
        uri = f"mlc://conformance-kit/q/{name}"
        data = b"".join(struct.pack(f"<{len(row)}f", *row) for row in rows)  # SDCP 5.2 q_rows
        answer = await self.mlc.request(
            "PUT", "objects", raw=data, content_type="application/octet-stream", query={"uri": uri}
        )
        expect(200 <= answer.status < 300, f"the MLC node refused the draft rows: {answer}")
        return uri


async def check_verifier(target: VerifierUnderTest, report: Report) -> Report:
    """Run every verifier check; the report holds one result per check."""
    kit = _Kit(target)
    try:
        await _contract_checks(kit, report)
        main = await _round_checks(kit, report)
        if main is not None:
            await _greedy_agreement(kit, report, main)
            await _run_to_the_end(kit, report, main)
        if target.mlc is not None and target.vocab is not None and main is not None:
            await _rule_2_checks(kit, report, greedy_first=main.committed[0])
    finally:
        await kit.close()
    return report


async def _contract_checks(kit: _Kit, report: Report) -> None:
    with report.check("a contract for another target model is refused", "6.1, 4.1") as evidence:
        session = _Session(kit, kit.contract(target=hashlib.sha256(b"not this verifier's model").digest()))
        answer = await kit.router.request("POST", "sessions", session.open_message())
        expect(_is_problem(answer, 422, "sdcp-bad-contract"), f"answered {answer}")
        evidence.append("422 sdcp-bad-contract")
    with report.check("a contract with a key the draft does not define is refused", "4.1") as evidence:
        session = _Session(kit, kit.contract(x_kit_extension=1))
        answer = await kit.router.request("POST", "sessions", session.open_message())
        expect(_is_problem(answer, 422, "sdcp-bad-contract"), f"answered {answer}")
        evidence.append("422 sdcp-bad-contract")
    with report.check("a body that is not CBOR is answered 4xx, not 5xx", "5.1, 5.2") as evidence:
        answer = await kit.router.request("POST", "sessions", raw=b"\xff\x00 not cbor")
        expect(400 <= answer.status < 500, f"answered {answer}")
        evidence.append(f"{answer.status}")
    with report.check("unknown members of any CBOR type are ignored", "5.2") as evidence:
        session = _Session(kit, kit.contract())
        extra = {
            "x_kit_float": 1.5,
            "x_kit_tag": cbor.Tagged(1, 0),
            "x_kit_null": None,
            "x_kit_undefined": cbor.Undefined,
        }
        answer = await kit.router.request("POST", "sessions", session.open_message(**extra))
        expect(200 <= answer.status < 300, f"a session-open with floats, tags, null and undefined answered {answer}")
        evidence.append(f"{answer.status}")


async def _round_checks(kit: _Kit, report: Report) -> _Session | None:
    session = _Session(kit, kit.contract())
    with report.check("session-open answers the session-state of round 0 with d[0]", "6.1, 4.2") as evidence:
        answer = await kit.router.request("POST", "sessions", session.open_message())
        expect(200 <= answer.status < 300, f"answered {answer}")
        state = answer.value()
        expected = {"session": session.id, "epoch": 1, "round": 0, "committed": 0, "digest": session.digest}
        got = {key: state.get(key) for key in expected} if isinstance(state, dict) else state
        expect(got == expected, f"session-state {got!r}; the kit computes d[0] = {session.digest.hex()}")
        evidence.append(f"d[0] = {session.digest.hex()[:16]}...")
    with report.check("the assignment is taken and answered with the session-state", "6.1, 5.2") as evidence:
        answer = await kit.router.request("PUT", f"{session.path}/drafter", session.assignment())
        expect(200 <= answer.status < 300, f"answered {answer}")
        state = answer.value()
        expect(isinstance(state, dict) and state.get("round") == 0, f"session-state {state!r}")
        evidence.append(f"{answer.status}")
    with report.check("a proposal from anyone but the assigned drafter is refused", "6.3") as evidence:
        answer = await kit.router.request("POST", "proposals", session.proposal([7]))
        expect(
            _is_problem(answer, 403, "sdcp-not-assigned"), f"a proposal from {kit.target.router.uri} answered {answer}"
        )
        evidence.append("403 sdcp-not-assigned")
    with report.check("a proposal for another epoch is refused", "6.3") as evidence:
        answer = await kit.drafter.request("POST", "proposals", session.proposal([7], epoch=2))
        expect(_is_problem(answer, 409, "sdcp-stale-epoch"), f"answered {answer}")
        evidence.append("409 sdcp-stale-epoch")
    with report.check("a proposal on another prefix is refused", "6.3, 4.2") as evidence:
        answer = await kit.drafter.request("POST", "proposals", session.proposal([7], base_digest=bytes(32)))
        expect(_is_problem(answer, 409, "sdcp-stale-base"), f"answered {answer}")
        evidence.append("409 sdcp-stale-base")
    with report.check("a proposal for a round other than the last plus one is refused", "6.3") as evidence:
        answer = await kit.drafter.request("POST", "proposals", session.proposal([7], round=2))
        expect(_is_problem(answer, 409, "sdcp-stale-base"), f"answered {answer}")
        evidence.append("409 sdcp-stale-base")
    with report.check("a proposal longer than m_max is refused", "6.5.1, 6.2") as evidence:
        answer = await kit.drafter.request("POST", "proposals", session.proposal([7] * (M_MAX + 1)))
        expect(_is_problem(answer, 422, "sdcp-limit"), f"answered {answer}")
        evidence.append("422 sdcp-limit")
    proposal = session.proposal([7])
    verdict: dict[str, Any] | None = None
    with report.check(
        "a verdict extends the digest chain over exactly the emitted tokens", "6.3, 4.2, 5.2"
    ) as evidence:
        answer = await kit.drafter.request("POST", "proposals", proposal)
        verdict = session.take_verdict(proposal, answer)
        expect(
            len(verdict["emitted"]) == verdict["accepted"] + 1,
            f"{verdict['accepted']} accepted, emitted {verdict['emitted']}",
        )
        evidence.append(f"emitted {verdict['emitted']}, d[{len(session.committed)}] matches")
    if verdict is None:
        return None
    with report.check("a repeated proposal gets the same verdict", "6.3, 6.9") as evidence:
        answer = await kit.drafter.request("POST", "proposals", proposal)
        expect(answer.status == 200 and answer.value() == verdict, f"the repeat answered {answer}")
        evidence.append("identical verdict")
    with report.check("output returns the committed tokens with the epoch", "6.7") as evidence:
        answer = await kit.router.request("GET", f"{session.path}/output", query={"from": 0})
        output = answer.value() if answer.status == 200 else None
        expect(isinstance(output, dict), f"GET output answered {answer}")
        assert isinstance(output, dict)
        got = (output.get("session"), output.get("epoch"), output.get("from"), output.get("tokens"))
        expect(got == (session.id, 1, 0, session.committed), f"output {output!r}")
        evidence.append(f"tokens {session.committed}")
    return session


async def _greedy_agreement(kit: _Kit, report: Report, first: _Session) -> None:
    with report.check("rule 1 commits greedy decoding whatever the drafter proposes", "6.4") as evidence:
        second = _Session(kit, first.contract)
        await second.open_and_assign()
        proposed = first.committed[:M_MAX]
        proposal = second.proposal(proposed)
        verdict = second.take_verdict(proposal, await kit.drafter.request("POST", "proposals", proposal))
        expect(
            verdict["accepted"] == len(proposed) and verdict["emitted"][: len(proposed)] == proposed,
            f"another session's tokens {proposed}: {verdict['accepted']} accepted, emitted {verdict['emitted']}",
        )
        evidence.append(f"{proposed} accepted in a second session")


async def _run_to_the_end(kit: _Kit, report: Report, session: _Session) -> None:
    with report.check("the session finishes at max_new and its output says so", "6.3, 6.5.2, 6.7") as evidence:
        verdict: dict[str, Any] = {"action": 0}
        for _ in range(MAX_NEW):
            if verdict["action"] != 0:
                break
            proposal = session.proposal([7])
            verdict = session.take_verdict(proposal, await kit.drafter.request("POST", "proposals", proposal))
        expect(verdict["action"] == 4, f"last verdict action {verdict['action']}, expected finish (4)")
        expect(len(session.committed) == MAX_NEW, f"{len(session.committed)} tokens committed, max_new is {MAX_NEW}")
        tokens: list[int] = []
        final: dict[str, Any] = {}
        while not final.get("final"):
            answer = await kit.router.request("GET", f"{session.path}/output", query={"from": len(tokens)})
            final = answer.value() if answer.status == 200 else {}
            expect(isinstance(final, dict) and final.get("from") == len(tokens), f"GET output answered {answer}")
            tokens.extend(final.get("tokens", []))
            expect(len(tokens) <= MAX_NEW, f"output holds {len(tokens)} tokens")
        expect(
            tokens == session.committed and final.get("finish") == 4, f"output {tokens} finish {final.get('finish')}"
        )
        evidence.append(f"{MAX_NEW} tokens, finish")
    with report.check("a proposal after the end is refused as closed", "6.5.2, Table 2") as evidence:
        answer = await kit.drafter.request("POST", "proposals", session.proposal([7]))
        expect(_is_problem(answer, 410, "sdcp-session-closed"), f"answered {answer}")
        evidence.append("410 sdcp-session-closed")


async def _rule_2_checks(kit: _Kit, report: Report, greedy_first: int) -> None:
    vocab = kit.target.vocab
    assert vocab is not None
    seed = int.from_bytes(os.urandom(8), "big")
    # Two candidates of nearly equal probability: the acceptance test at the first position is a
    # coin flip, so the verifier's random value decides it and shows whether it is the draft's.
    sampling = {"temperature_milli": 100_000, "top_k": 2, "seed": seed}
    contract = kit.contract(rule=2, sampling=sampling)
    one_hot = [0.0] * vocab
    one_hot[greedy_first] = 1.0
    session = _Session(kit, contract)
    with report.check("draft rows with q(x) = 0 are refused before any draw", "6.4, 6.3") as evidence:
        await session.open_and_assign()
        other = (greedy_first + 1) % vocab
        uri = await kit.put_rows(f"{session.id.hex()}-zero", [one_hot])
        answer = await kit.drafter.request("POST", "proposals", session.proposal([other], q_rows=uri))
        expect(_is_problem(answer, 422, "sdcp-bad-proposal"), f"q(x) = 0 answered {answer}")
        evidence.append("422 sdcp-bad-proposal")
    with report.check("draft rows that cannot be obtained commit nothing", "6.3") as evidence:
        missing = f"mlc://conformance-kit/q/{os.urandom(8).hex()}-never-written"
        answer = await kit.drafter.request("POST", "proposals", session.proposal([greedy_first], q_rows=missing))
        expect(_is_problem(answer, 409, "sdcp-q-unavailable"), f"answered {answer}")
        evidence.append("409 sdcp-q-unavailable")
    with report.check("seeded acceptance follows the HMAC randomness, and the residual excludes x", "6.4") as evidence:
        # With q one-hot at x, x is accepted iff r < p(x); top_k 2 at temperature 100 puts p(x)
        # within 0.4..0.6 for any logit gap under 40. Sessions are picked by the kit's own r at
        # round 1, position 1: those below 0.4 must be accepted, those above 0.6 rejected.
        contradictions: list[str] = []
        for session, r in _sessions_by_randomness(kit, contract, seed):
            await session.open_and_assign()
            uri = await kit.put_rows(session.id.hex(), [one_hot])
            proposal = session.proposal([greedy_first], q_rows=uri)
            verdict = session.take_verdict(proposal, await kit.drafter.request("POST", "proposals", proposal))
            expected = 1 if r < _LOW_R else 0
            if verdict["accepted"] != expected:
                contradictions.append(f"r = {r:.3f} gave {verdict['accepted']} accepted")
            if verdict["accepted"] == 0:
                expect(
                    verdict["emitted"][0] != greedy_first, f"rejected x = {greedy_first} was emitted from the residual"
                )
        expect(
            not contradictions,
            f"{'; '.join(contradictions)}: the verifier's random values are not "
            "HMAC-SHA-256(seed, session, round, i, purpose) (or p(x) lies outside 0.4..0.6)",
        )
        evidence.append(f"{RANDOMNESS_SESSIONS} sessions decided as the kit's r predicts")


def _sessions_by_randomness(kit: _Kit, contract: dict[str, Any], seed: int) -> list[tuple[_Session, float]]:
    """Sessions whose first acceptance draw r is below 0.4 (half of them) or above 0.6."""
    low: list[tuple[_Session, float]] = []
    high: list[tuple[_Session, float]] = []
    while len(low) + len(high) < RANDOMNESS_SESSIONS:
        session = _Session(kit, contract)
        r = formulas.verifier_uniform(seed, session.id, 1, 1, 0)
        bucket = low if r < _LOW_R else high if r > _HIGH_R else None
        if bucket is not None and len(bucket) < RANDOMNESS_SESSIONS // 2:
            bucket.append((session, r))
    return low + high
