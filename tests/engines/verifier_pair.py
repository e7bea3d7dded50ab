"""Two verifier engines over one host-memory MLC, and what the router does between them at a
failover (SDCP 6.9), for the tests of a session's target distribution kept across a failover
(constrained and penalised decoding)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from tests.waiting import eventually

from sdcp.cache import MLC, build_uri
from sdcp.cache.uri import LOG_KIND, TOKENS_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.verifier import VerifierEngine
from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel
from sdcp.protocol.messages import SelfDecodeRequest
from sdcp.protocol.records import encode_token_list, replay_commit_log
from sdcp.protocol.router import RouterSession

SESSION = bytes(range(16))
AUTHORITY = "mlc.test"
PROMPT = tuple((11 * i + 5) % 250 + 1 for i in range(24))


@dataclass
class Pair:
    mlc: MLC
    first: VerifierEngine
    second: VerifierEngine
    commit_log: str


@contextlib.asynccontextmanager
async def verifier_pair(tiny_loaded: LoadedModel) -> AsyncIterator[Pair]:
    """Both engines started (the ``pair`` fixture of tests/engines/conftest.py), stopped after."""
    mlc = MLC.from_config(authority=AUTHORITY)
    engines = [
        VerifierEngine(
            uri=f"https://verifier{i}.test",
            settings=VerifierConfig(),
            target=TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny"),
            mlc=mlc,
            ttl_ms=1000,
        )
        for i in (1, 2)
    ]
    for engine in engines:
        await engine.start()
    yield Pair(mlc, engines[0], engines[1], build_uri(AUTHORITY, None, LOG_KIND, SESSION.hex()))
    for engine in engines:
        await engine.stop()
    await mlc.close()


async def decode(engine: VerifierEngine, epoch: int, until: int) -> None:
    """Self-decoding periods at ``engine`` until ``until`` tokens are committed or the session ends."""
    live = engine.sessions[SESSION]
    machine = live.machine
    while machine.committed < until and not machine.ended:
        await engine.self_decode(SelfDecodeRequest(session=SESSION, epoch=epoch))
        await eventually(lambda: not machine.self_decoding)
        decoder = live.self_decoder
        if decoder is not None:
            await eventually(decoder.done)


async def fail_over(pair: Pair, plan: RouterSession) -> None:
    """What the router does at a failover (SDCP 6.9): fence, replay the log, open the session at the
    second verifier from the plan, whose session-open carries the contract (its sampling profile)
    and the constraint again."""
    await pair.mlc.commit_log(pair.commit_log).fence(2)
    snapshot = await pair.mlc.commit_log(pair.commit_log).read()
    replay = replay_commit_log(snapshot.records, plan.contract.digest, plan.prompt)
    tokens = build_uri(AUTHORITY, None, TOKENS_KIND, f"{SESSION.hex()}-{len(replay.tokens)}")
    await pair.mlc.put(tokens, encode_token_list(replay.tokens))
    moved = plan.fail_over(pair.second.uri, replay, tokens)
    await pair.second.open_session(moved.open_message())
