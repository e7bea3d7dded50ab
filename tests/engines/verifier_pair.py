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
from sdcp.protocol.messages import Action, Contract, Sampling, SelfDecodeRequest
from sdcp.protocol.records import encode_token_list, replay_commit_log
from sdcp.protocol.router import RouterSession

SESSION = bytes(range(16))
AUTHORITY = "mlc.test"
PROMPT = tuple((11 * i + 5) % 250 + 1 for i in range(24))
# The tiny target's end of text: the sessions' one stop token.
EOT = 0


def self_decoding_contract(
    target: TargetModel, rule: int, *, max_new: int, self_max: int, sampling: Sampling | None = None
) -> Contract:
    """A contract whose sessions the verifier decodes alone, in periods of at most ``self_max``
    tokens, under ``rule`` and ``sampling``, until EOT or ``max_new``."""
    obj: dict[str, object] = {
        "target": target.weights_digest,
        "tokenizer": target.tokenizer_digest,
        "rule": rule,
        "m_max": 4,
        "max_new": max_new,
        "stop": [EOT],
        "low_rounds": 1000,
        "fallback": [Action.FAIL],
        "self_load": 100,
        "self_max": self_max,
    }
    if sampling is not None:
        obj["sampling"] = sampling.to_obj()
    return Contract.from_obj(obj)


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


def greedy_decoding(tiny_loaded: LoadedModel, max_new: int) -> tuple[int, ...]:
    """The tiny target's greedy decoding of PROMPT, one token per pass, until EOT or ``max_new``."""
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    target.open_session(SESSION, PROMPT)
    tokens: list[int] = []
    while len(tokens) < max_new and (not tokens or tokens[-1] != EOT):
        (rows,) = target.score([(SESSION, ())])
        tokens.append(int(rows[-1].argmax()))
        target.commit(SESSION, 0, [tokens[-1]])
    return tuple(tokens)


async def decode(engine: VerifierEngine, epoch: int, until: int, session: bytes = SESSION) -> None:
    """Self-decoding periods at ``engine`` until ``until`` tokens are committed or the session ends."""
    live = engine.sessions[session]
    machine = live.machine
    while machine.committed < until and not machine.ended:
        await engine.self_decode(SelfDecodeRequest(session=session, epoch=epoch))
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
