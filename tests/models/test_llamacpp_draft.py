"""The llama.cpp drafter on the bundled GGUF: `llamacpp:` specs, greedy proposals that are llama.cpp's own
greedy decoding, the rows its tokens are drawn from, KV kept across rounds, sequences given back, and
a drafter service whose proposals a llama.cpp verifier accepts (draft-li-sdcp, 6.2, 6.3, 6.4).

The reference is plain llama-cpp-python on one thread (tests/llama_greedy.py), as the drafter here.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tests.llama_greedy import exact_llama, llama_cpp_greedy
from tests.services import drafter_harness

from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.cache import build_uri
from sdcp.config import DrafterConfig
from sdcp.models.drafter import Drafter
from sdcp.models.errors import BadTokens, ModelError, SessionExists, SessionLimit, UnknownModel, UnknownSession
from sdcp.models.llamacpp.drafter import LlamaCppDrafter
from sdcp.models.llamacpp.target import SEQUENCE_TOKENS_PER_CALL, LlamaCppTarget
from sdcp.models.registry import load_drafter, load_tokenizer
from sdcp.models.weights.fetch import FetchResult, smollm2_gguf
from sdcp.protocol.messages import Sampling, SessionOpen, SessionState, session_path_id
from sdcp.protocol.sampling import target_distribution
from sdcp.services.drafter import DrafterNode

pytestmark = pytest.mark.timeout(120)

SMOLLM2_VOCAB = 49152
NEW_TOKENS = 16
CAPACITY = 256
GREEDY = Sampling(temperature_milli=0)
WARM = Sampling(temperature_milli=800, top_k=50, seed=3)

# The drafter service test's mTLS environment: certificates, configurations, the MLC.
env = drafter_harness.env


@pytest.fixture(scope="module")
def gguf(smollm2_fetch: FetchResult) -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def drafter(gguf: Path) -> LlamaCppDrafter:
    return LlamaCppDrafter(gguf, name="llamacpp:smollm2", threads=1, kv_slots=4, kv_capacity=CAPACITY)


@pytest.fixture(scope="module")
def prompts(smollm2_fetch: FetchResult) -> list[list[int]]:
    """Three benchmark prompts through the chat template, one of them longer than a llama_decode call."""
    tokenizer = load_tokenizer("smollm2")
    chats = [tokenize_prompt(tokenizer, text) for workload in load_workloads() for text in workload.prompts]
    chosen = [chats[0], chats[len(chats) // 2], max(chats, key=len)]
    assert max(len(chat) for chat in chosen) > SEQUENCE_TOKENS_PER_CALL
    return chosen


@pytest.fixture(scope="module")
def reference(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    return llama_cpp_greedy(gguf, prompts, NEW_TOKENS, CAPACITY)


@pytest.fixture
def sessions(drafter: LlamaCppDrafter, session_ids: Iterator[bytes]) -> Iterator[Iterator[bytes]]:
    """Session ids for one test; whatever it leaves open is closed after it (the drafter is shared)."""
    opened: list[bytes] = []

    def ids() -> Iterator[bytes]:
        for session in session_ids:
            opened.append(session)
            yield session

    yield ids()
    for session in opened:
        if session in drafter._sessions:
            drafter.close_session(session)


def test_specs_name_the_bundled_gguf_or_a_gguf_file(gguf: Path) -> None:
    loaded = load_drafter("llamacpp:smollm2", vocab_size=SMOLLM2_VOCAB, threads=1, kv_slots=1, kv_capacity=64)
    assert isinstance(loaded, LlamaCppDrafter) and isinstance(loaded, Drafter)
    assert loaded.name == "llamacpp:smollm2" and loaded.vocab_size == SMOLLM2_VOCAB
    assert not loaded.runs_inline and loaded._capacity == 64
    assert loaded.weights_digest == hashlib.sha256(gguf.read_bytes()).digest()
    del loaded
    # The vocabulary is the target's or the drafter is refused, as an hf: drafter is.
    with pytest.raises(UnknownModel, match="vocabulary 49152"):
        load_drafter(f"llamacpp:{gguf}", vocab_size=257, threads=1)
    for spec in ("llamacpp:tiny", "llamacpp:", f"llamacpp:{gguf.parent / 'tokenizer.json'}", "llamacpp:/no/such.gguf"):
        with pytest.raises(UnknownModel):
            load_drafter(spec, vocab_size=SMOLLM2_VOCAB)
    with pytest.raises(ModelError, match="cpu"):
        load_drafter("llamacpp:smollm2", vocab_size=SMOLLM2_VOCAB, device="cuda")


def test_greedy_proposals_are_llama_cpp_greedy_decoding(
    drafter: LlamaCppDrafter, prompts: list[list[int]], reference: list[list[int]], sessions: Iterator[bytes]
) -> None:
    for prompt, expected in zip(prompts, reference, strict=True):
        session = next(sessions)
        drafter.open_session(session, prompt)
        result = drafter.draft(session, NEW_TOKENS, GREEDY)
        assert list(result.tokens) == expected
        # At temperature zero each row is the point mass on the proposed token (SDCP 4.1).
        assert result.q_rows is not None
        np.testing.assert_array_equal(result.q_rows.argmax(axis=1), expected)
        assert np.all(result.q_rows.sum(axis=1) == 1.0)
        drafter.close_session(session)


def test_rounds_that_are_accepted_whole_continue_greedy_decoding(
    drafter: LlamaCppDrafter, prompts: list[list[int]], reference: list[list[int]], sessions: Iterator[bytes]
) -> None:
    """Drafts of 3 tokens, each accepted with the target's next token appended (as a verdict emits it),
    and a pre-draft before the verdict: the KV kept between rounds gives the same tokens."""
    prompt, expected = prompts[2], reference[2]
    session = next(sessions)
    drafter.open_session(session, prompt)
    committed: list[int] = []
    while len(committed) < NEW_TOKENS - 4:
        drafted = drafter.draft(session, 3, GREEDY).tokens
        assert list(drafted) == expected[len(committed) : len(committed) + 3]
        predrafted = drafter.draft(session, 1, GREEDY).tokens
        assert predrafted[0] == expected[len(committed) + 3]
        committed.extend(expected[len(committed) : len(committed) + 4])
        drafter.sync(session, [*prompt, *committed])
        assert drafter.tokens(session) == (*prompt, *committed)


def test_rows_are_the_sampling_profile_over_the_drafters_logits(
    drafter: LlamaCppDrafter, gguf: Path, prompts: list[list[int]], sessions: Iterator[bytes]
) -> None:
    prompt = prompts[0]
    session = next(sessions)
    drafter.open_session(session, prompt)
    result = drafter.draft(session, 5, WARM)
    assert result.q_rows is not None and result.q_rows.dtype == np.float32
    assert result.q_rows.shape == (5, SMOLLM2_VOCAB)
    assert len(result.q_rows_bytes()) == 5 * SMOLLM2_VOCAB * 4
    np.testing.assert_allclose(result.q_rows.sum(axis=1), 1.0, atol=1e-5)
    assert np.all((result.q_rows > 0).sum(axis=1) <= WARM.top_k)
    assert all(result.q_rows[i, token] > 0 for i, token in enumerate(result.tokens))
    # Row j is the profile applied to llama.cpp's logits after the prompt and the first j tokens.
    plain = exact_llama(gguf, CAPACITY, n_batch=SEQUENCE_TOKENS_PER_CALL, logits_all=True)
    plain.eval([*prompt, *result.tokens[:-1]])
    logits = np.asarray(plain.scores[len(prompt) - 1 : len(prompt) + 4], dtype=np.float64)
    expected = target_distribution(logits, WARM).astype(np.float32)
    np.testing.assert_allclose(result.q_rows, expected, atol=1e-6)
    assert drafter.seconds_per_token > 0 and result.seconds > 0


def test_draws_are_reproducible_from_session_and_seed(
    drafter: LlamaCppDrafter, prompts: list[list[int]], sessions: Iterator[bytes]
) -> None:
    session = next(sessions)
    drafts = []
    for _ in range(2):
        drafter.open_session(session, prompts[1])
        drafts.append(drafter.draft(session, 6, WARM).tokens)
        drafter.close_session(session)
    assert drafts[0] == drafts[1]


def test_after_a_partial_acceptance_proposals_equal_a_fresh_sessions(
    drafter: LlamaCppDrafter, prompts: list[list[int]], sessions: Iterator[bytes]
) -> None:
    prompt = prompts[1]
    reused, fresh = next(sessions), next(sessions)
    drafter.open_session(reused, prompt)
    drafted = drafter.draft(reused, 6, GREEDY).tokens
    # The verifier accepts two tokens and emits another third one.
    correction = (drafted[2] + 1) % SMOLLM2_VOCAB
    committed = [*prompt, *drafted[:2], correction]
    drafter.sync(reused, committed)
    drafter.open_session(fresh, committed)
    for sampling in (GREEDY, WARM):
        after_sync = drafter.draft(reused, 5, sampling, np.random.default_rng(8))
        from_scratch = drafter.draft(fresh, 5, sampling, np.random.default_rng(8))
        assert after_sync.tokens == from_scratch.tokens
        assert after_sync.q_rows is not None and from_scratch.q_rows is not None
        np.testing.assert_array_equal(after_sync.q_rows, from_scratch.q_rows)
        drafter.sync(reused, committed)
        drafter.sync(fresh, committed)


def test_closed_sessions_give_their_sequences_back(
    gguf: Path, prompts: list[list[int]], reference: list[list[int]], session_ids: Iterator[bytes]
) -> None:
    small = LlamaCppDrafter(gguf, threads=1, kv_slots=2, kv_capacity=CAPACITY)
    first, second, third = next(session_ids), next(session_ids), next(session_ids)
    small.open_session(first, prompts[0])
    small.draft(first, 4, GREEDY)
    small.open_session(second, prompts[1])
    with pytest.raises(SessionLimit):
        small.open_session(third, prompts[2])
    small.close_session(first)
    with pytest.raises(UnknownSession):
        small.draft(first, 1, GREEDY)
    with pytest.raises(UnknownSession):
        small.close_session(first)
    # The third session takes the first one's sequence, emptied: it drafts as a fresh one.
    small.open_session(third, prompts[2])
    assert list(small.draft(third, NEW_TOKENS, GREEDY).tokens) == reference[2]


def test_bad_requests_are_refused(
    drafter: LlamaCppDrafter, prompts: list[list[int]], sessions: Iterator[bytes]
) -> None:
    session = next(sessions)
    with pytest.raises(BadTokens):
        drafter.open_session(session, [])
    with pytest.raises(BadTokens):
        drafter.open_session(session, [SMOLLM2_VOCAB])
    with pytest.raises(BadTokens):
        drafter.open_session(session, [1] * (CAPACITY + 1))
    drafter.open_session(session, prompts[0])
    with pytest.raises(SessionExists):
        drafter.open_session(session, prompts[0])
    with pytest.raises(BadTokens):
        drafter.draft(session, 0, GREEDY)
    with pytest.raises(BadTokens):
        drafter.sync(session, [-1])
    # A draft must fit the sequence: the session's tokens, then 64 positions more.
    drafter.sync(session, [1] * CAPACITY)
    with pytest.raises(BadTokens):
        drafter.draft(session, 66, GREEDY)


async def test_a_drafter_service_on_llama_cpp_drafts_what_a_llama_cpp_verifier_accepts(
    env: drafter_harness.Env,
    gguf: Path,
    drafter: LlamaCppDrafter,
    prompts: list[list[int]],
    reference: list[list[int]],
) -> None:
    """The drafter engine on the target's own GGUF, under rule 1: every proposed token is accepted and
    the output is llama.cpp's greedy decoding."""
    target = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=1, kv_slots=1, kv_capacity=CAPACITY)
    verifier = await drafter_harness.verifier_node(env, target)  # type: ignore[arg-type]
    node = DrafterNode(
        env.config(env.drafter_uri, drafter=DrafterConfig(model="llamacpp:smollm2", target="smollm2")),
        drafter=drafter,
    )
    await node.start()
    try:
        greedy = {"temperature_milli": 0}
        contract = drafter_harness.make_contract(target, max_new=NEW_TOKENS, sampling=greedy)  # type: ignore[arg-type]
        prompt = tuple(prompts[0])
        session = os.urandom(16)
        router = env.client(env.verifier_uri, drafter_harness.ROUTER)
        log_uri = build_uri("local", None, "log", session.hex())
        opened = SessionOpen(session=session, epoch=1, contract=contract, prompt=prompt, commit_log=log_uri)
        status, body = await router.post_cbor("sessions", opened.to_obj())
        assert status == 201
        assignment = drafter_harness.make_assignment(
            env, contract, session, prompt=prompt, digest=SessionState.from_obj(body).digest
        )
        await router.put_cbor(f"sessions/{session_path_id(session)}/drafter", assignment.to_obj())
        await env.client(env.drafter_uri, drafter_harness.ROUTER).post_cbor("assignments", assignment.to_obj())
        output = await asyncio.wait_for(drafter_harness.read_all_output(env, session), 60)
        assert output == reference[0]
        _, stats = await env.client(env.verifier_uri, drafter_harness.STRANGER).get_cbor(
            f"sessions/{session_path_id(session)}/stats"
        )
        assert isinstance(stats, dict) and stats["accepted"] == stats["proposed"] > 0
    finally:
        await node.stop()
        await verifier.stop()
