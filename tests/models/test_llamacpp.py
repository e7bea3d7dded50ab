"""The llama.cpp target on the bundled GGUF: its passes give llama.cpp's own greedy decoding, whatever
their shape (SDCP 6.4 rule 1), its KV moves between targets, and its digests name the file.

The reference is plain llama-cpp-python's greedy decoding on one thread (tests/llama_greedy.py); the
target runs its passes of two tokens or more on two threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from tests.llama_greedy import llama_cpp_greedy

from sdcp.bench.workloads import load_workloads, tokenize_prompt
from sdcp.models import BatchingScorer, LoadedModel
from sdcp.models.batching import ScoredRun
from sdcp.models.errors import (
    BadTokens,
    DigestMismatch,
    InconsistentCommit,
    KVFormatError,
    ModelError,
    SessionLimit,
)
from sdcp.models.llamacpp.target import (
    PROVISIONAL_CALLS,
    SPLIT_FREE_POSITIONS,
    UBATCH_ROWS,
    LlamaCppTarget,
    _calls,
    _Feed,
    _paced,
)
from sdcp.models.registry import load_target, load_tokenizer
from sdcp.models.weights.digests import tokenizer_digest, weights_digest
from sdcp.models.weights.fetch import FetchResult, smollm2_gguf
from sdcp.protocol.rules import RULES, SecureRandom
from sdcp.threads import CoreGovernor

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 64
SESSIONS = 16
# A prompt this long reaches the contexts where llama.cpp's one-query attention splits over threads.
LONG_PROMPT_TOKENS = 700
CAPACITY = LONG_PROMPT_TOKENS + NEW_TOKENS + 16


@pytest.fixture(scope="module")
def gguf(smollm2_fetch: FetchResult) -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def target(gguf: Path) -> LlamaCppTarget:
    return LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=2, kv_slots=SESSIONS, kv_capacity=CAPACITY)


@pytest.fixture(scope="module")
def prompts(smollm2_fetch: FetchResult) -> list[list[int]]:
    """Every other benchmark prompt through the chat template (each workload's kinds), and one long
    prompt made of all of them in a row: SESSIONS prompts, one batch."""
    tokenizer = load_tokenizer("smollm2")
    chats = [tokenize_prompt(tokenizer, text) for workload in load_workloads() for text in workload.prompts]
    long_prompt = [token for chat in chats for token in chat][:LONG_PROMPT_TOKENS]
    return [*chats[::2][: SESSIONS - 1], long_prompt]


@pytest.fixture(scope="module")
def reference(gguf: Path, prompts: list[list[int]]) -> list[list[int]]:
    return llama_cpp_greedy(gguf, prompts, NEW_TOKENS, CAPACITY)


@pytest.fixture
def sessions(target: LlamaCppTarget, session_ids: Iterator[bytes]) -> Iterator[Iterator[bytes]]:
    """Session ids for one test; whatever it leaves open is closed after it (the target is shared)."""
    opened: list[bytes] = []

    def ids() -> Iterator[bytes]:
        for session in session_ids:
            opened.append(session)
            yield session

    yield ids()
    for session in opened:
        if target.has_session(session):
            target.close_session(session)


def test_one_token_per_pass_equals_llama_cpp_greedy(
    target: LlamaCppTarget, prompts: list[list[int]], reference: list[list[int]], sessions: Iterator[bytes]
) -> None:
    for prompt, expected in zip(prompts, reference, strict=True):
        session = next(sessions)
        target.open_session(session, prompt)
        decoded: list[int] = []
        while len(decoded) < len(expected):
            row = target.score([(session, ())])[0]
            assert row.shape == (1, target.vocab_size) and row.dtype == np.float32
            token = int(row[0].argmax())
            target.commit(session, 0, [token])
            decoded.append(token)
        target.close_session(session)
        assert decoded == expected


def test_sixteen_sessions_in_one_batch_equal_llama_cpp_greedy(
    target: LlamaCppTarget, prompts: list[list[int]], reference: list[list[int]], sessions: Iterator[bytes]
) -> None:
    """Each session proposes its own next reference tokens, of its own length, some with a wrong one,
    and all are scored in one call: rule 1 over these passes gives the reference, token for token."""
    rng = np.random.default_rng(27)
    rounds = {"full": 0, "partial": 0, "abandoned": 0}
    for first in range(0, len(prompts), SESSIONS):
        group = list(range(first, min(first + SESSIONS, len(prompts))))
        ids = {index: next(sessions) for index in group}
        decoded: dict[int, list[int]] = {index: [] for index in group}
        for index in group:
            target.open_session(ids[index], prompts[index])
        while live := [index for index in group if len(decoded[index]) < NEW_TOKENS]:
            proposals = {
                index: _proposal(reference[index], len(decoded[index]), target.vocab_size, rng) for index in live
            }
            rows = target.score([(ids[index], proposals[index]) for index in live])
            for index, p_rows in zip(live, rows, strict=True):
                proposal = proposals[index]
                assert p_rows.shape == (len(proposal) + 1, target.vocab_size)
                if rng.random() < 0.1:
                    target.rollback(ids[index])  # the round was abandoned: nothing is committed
                    rounds["abandoned"] += 1
                    continue
                accepted, extra = _rule1(p_rows, proposal)
                emitted = [*proposal[:accepted], extra][: NEW_TOKENS - len(decoded[index])]
                target.commit(ids[index], accepted, emitted)
                decoded[index].extend(emitted)
                rounds["full" if accepted == len(proposal) else "partial"] += 1
        for index in group:
            target.close_session(ids[index])
            assert decoded[index] == reference[index], f"prompt {index}"
    assert all(count > 0 for count in rounds.values()), rounds


def _rule1(rows: np.ndarray, proposal: tuple[int, ...]) -> tuple[int, int]:
    """Rule 1's verdict (accepted tokens, additional token); an empty proposal is self-decoding."""
    if not proposal:
        return 0, int(rows[0].argmax())
    verdict = RULES[1].accept(rows, None, proposal, SecureRandom())
    return verdict.accepted, verdict.extra_token


def _proposal(expected: list[int], done: int, vocab_size: int, rng: np.random.Generator) -> tuple[int, ...]:
    """The next 0 to 8 reference tokens; half of the time one of them replaced by another."""
    proposal = list(expected[done : done + int(rng.integers(0, 9))])
    if proposal and rng.random() < 0.5:
        wrong = int(rng.integers(len(proposal)))
        proposal[wrong] = (proposal[wrong] + 1 + int(rng.integers(1000))) % vocab_size
    return tuple(proposal)


def test_a_row_is_the_same_whatever_shares_its_pass(gguf: Path, prompts: list[list[int]]) -> None:
    """llama.cpp splits a pass into ubatches of consecutive sequences feeding as many tokens each: a
    long session's second token beside a short session's one runs alone, as a one-token ubatch past
    256 positions, which must run on one thread even where the short session's last one-token pass
    ran on two (docs/models.md, item 3)."""
    pair = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=2, kv_slots=2, kv_capacity=CAPACITY)
    long_session, short_session = b"l" * 16, b"s" * 16
    pair.open_session(long_session, prompts[-1])  # sequence 0
    pair.open_session(short_session, prompts[0])  # sequence 1: the two make one ubatch
    assert len(prompts[-1]) > 2 * SPLIT_FREE_POSITIONS > 2 * len(prompts[0])
    long_alone = pair.score([(long_session, (42,))])[0].copy()
    pair.rollback(long_session)
    short_alone = pair.score([(short_session, ())])[0].copy()  # a one-token pass on both threads
    pair.rollback(short_session)
    long_shared, short_shared = pair.score([(long_session, (42,)), (short_session, ())])
    assert np.array_equal(long_shared, long_alone)
    assert np.array_equal(short_shared, short_alone)


class _Governor(CoreGovernor):
    """A governor whose team alternates between one thread and two at each apply, provisional
    the first ``provisional_for`` times it is asked."""

    def __init__(self, set_threads: Callable[[int], None], provisional_for: int) -> None:
        super().__init__(2, cores=2, set_threads=set_threads)
        self.teams: list[int] = []
        self.provisional_for = provisional_for

    @property
    def provisional(self) -> bool:
        self.provisional_for -= 1
        return self.provisional_for >= 0

    def apply(self) -> int:
        self.teams.append(1 if len(self.teams) % 2 == 0 else 2)
        self._set_threads(self.teams[-1])
        return self.teams[-1]


def test_a_long_prefill_follows_the_load_between_its_calls(gguf: Path, prompts: list[list[int]]) -> None:
    """The core governor is applied before each llama_decode call of a prefill (a group's is
    seconds long on one thread), and on a provisional team the calls are short. A team that
    changes within a prefill, and calls of other lengths, change no row."""
    pair = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=2, kv_slots=2, kv_capacity=CAPACITY)
    prompt = prompts[-1][:150]
    alone, followed = b"a" * 16, b"f" * 16
    pair.open_session(alone, prompt)
    expected = pair.score([(alone, (42,))])[0].copy()
    pair.close_session(alone)
    # Prefilled in steps of 126 tokens: 63 + 63, 23; provisional twice, 8 + 16 + 39 + 63, 23.
    for provisional_for, calls in ((0, 3), (2, 5)):
        governor = _Governor(pair.set_threads, provisional_for)
        pair.follow_load(governor)
        pair.open_session(followed, prompt)
        assert len(governor.teams) == calls
        assert np.array_equal(pair.score([(followed, (42,))])[0], expected)
        pair.close_session(followed)


def test_calls_on_a_provisional_team_are_short_until_it_is_measured() -> None:
    """Sessions in sequence-id order, fewer than 64 tokens of one a call, each call's tokens in
    order; while the team is provisional a call holds 8 tokens a thread in all, whatever the group,
    and at most PROVISIONAL_CALLS calls are cut short."""
    feeds = [_Feed(seq_id=1, start=0, tokens=tuple(range(70))), _Feed(seq_id=0, start=0, tokens=(5,))]
    plain = list(_calls(feeds))
    assert [len(call) for call in plain] == [64, 7]
    assert plain[0][:2] == [(1, 0), (0, 0)]
    governor = _Governor(lambda threads: None, provisional_for=2)
    paced = list(_paced(_calls(feeds), governor))
    # Teams of one thread and two in turn: 8 tokens on one, 16 on two, then measured.
    assert [len(call) for call in paced] == [8, 16, 40, 7]
    assert len(governor.teams) == 4  # applied before each call
    assert [pair for call in paced for pair in call] == [pair for call in plain for pair in call]
    long = [_Feed(seq_id=0, start=0, tokens=tuple(range(300)))]  # calls of 63, 63, 63, 63, 48
    stuck = _Governor(lambda threads: None, provisional_for=1000)
    stuck_calls = [len(call) for call in _paced(_calls(long), stuck)]
    assert sum(stuck_calls) == 300
    cut_short = [length for length, team in zip(stuck_calls, stuck.teams, strict=True) if length == 8 * team]
    assert len(cut_short) == PROVISIONAL_CALLS


def test_a_provisional_team_takes_a_short_rest_in_one_call() -> None:
    """A chat prompt's prefill shorter than two provisional calls is one call: each cut costs a
    pass's fixed cost. Longer, the rest shorter than two calls goes with the last."""
    prompt = [_Feed(seq_id=0, start=0, tokens=tuple(range(18)))]
    on_two = _TeamOf(2)
    assert [len(call) for call in _paced(_calls(prompt), on_two)] == [18]
    on_one = _TeamOf(1)
    assert [len(call) for call in _paced(_calls(prompt), on_one)] == [8, 10]
    longer = [_Feed(seq_id=0, start=0, tokens=tuple(range(40)))]
    assert [len(call) for call in _paced(_calls(longer), _TeamOf(2))] == [16, 24]


class _TeamOf(CoreGovernor):
    """A provisional team of ``threads``, never measured."""

    def __init__(self, threads: int) -> None:
        super().__init__(2, cores=2, set_threads=lambda threads: None)
        self.threads = threads

    @property
    def provisional(self) -> bool:
        return True

    def apply(self) -> int:
        return self.threads


def decoded_tokens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of every llama_decode call from now on, one count a call."""
    fed: list[int] = []
    decode = llama_cpp.llama_decode

    def counted(context: object, batch: llama_cpp.llama_batch) -> int:
        fed.append(batch.n_tokens)
        return int(decode(context, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", counted)
    return fed


def test_a_long_lone_token_beside_an_empty_neighbour_gives_the_one_thread_row(
    gguf: Path,
    prompts: list[list[int]],
    target: LlamaCppTarget,
    sessions: Iterator[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``companion_positions`` a one-token pass runs on both threads beside a token of the free
    sequence next to it, with the row of the one-thread pass, and leaves that sequence empty."""
    pair = LlamaCppTarget(
        gguf,
        gguf.parent / "tokenizer.json",
        threads=2,
        kv_slots=2,
        kv_capacity=CAPACITY,
        companion_positions=SPLIT_FREE_POSITIONS,
    )
    long_session, short_session = b"l" * 16, b"s" * 16
    pair.open_session(long_session, prompts[-1])  # sequence 0; sequence 1 is free
    pair.rollback(long_session)  # the row the prefill kept is dropped: the next pass feeds one token
    fed = decoded_tokens(monkeypatch)
    beside = pair.score([(long_session, ())])[0].copy()
    pair.rollback(long_session)
    pair.open_session(short_session, prompts[0])  # sequence 1, where the companion token went
    prefilled = len(fed)
    alone = pair.score([(long_session, ())])[0]
    assert fed[0] == 2 and fed[prefilled:] == [1]
    assert np.array_equal(beside, alone)
    reference = next(sessions)
    target.open_session(reference, prompts[0])
    assert np.array_equal(pair.score([(short_session, ())])[0], target.score([(reference, ())])[0])


def test_sessions_apart_pass_as_one_ubatch_with_exact_rows(
    gguf: Path,
    prompts: list[list[int]],
    target: LlamaCppTarget,
    sessions: Iterator[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp runs consecutive sequence ids feeding as many tokens each as one ubatch: sessions
    with another sequence between them pass with tokens of it (position 0 of a free one, after the
    last cell of an open session not in the pass) where that costs less than a ubatch; every row
    is the one a session gets alone, and what the pads wrote is gone after the call."""
    eight = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=2, kv_slots=8, kv_capacity=CAPACITY)
    memory = llama_cpp.llama_get_memory(eight._context)
    names = [bytes([letter]) * 16 for letter in b"abcdefgh"]

    def alone(prompt: list[int]) -> np.ndarray:
        reference = next(sessions)
        target.open_session(reference, prompt)
        rows = target.score([(reference, ())])[0]
        target.close_session(reference)
        return rows

    fed = decoded_tokens(monkeypatch)
    lengths = [30, 33, 31, 32, 30, 30, 30, 30]
    for name, prompt, length in zip(names, prompts, lengths, strict=False):
        eight.open_session(name, prompt[:length])  # sequence ids 0, 1, 2, ... in turn
    for name in names:
        eight.score([(name, ())])  # the kept rows used: a pass now feeds each one token
        eight.rollback(name)
    fed.clear()

    def one_token_each(*passing: bytes) -> list[np.ndarray]:
        rows = [row.copy() for row in eight.score([(name, ()) for name in passing])]
        for name in passing:
            eight.rollback(name)
        return rows

    held = one_token_each(names[0], names[2])  # b (sequence 1) is open: a token after its last cell
    assert fed == [3] and llama_cpp.llama_memory_seq_pos_max(memory, 1) == lengths[1] - 2
    assert np.array_equal(one_token_each(names[1])[0][0], alone(prompts[1][: lengths[1]])[0])
    assert np.array_equal(held[1][0], alone(prompts[2][: lengths[2]])[0])
    eight.close_session(names[6])
    fed.clear()
    free = one_token_each(names[5], names[7])  # sequence 6 is free: a token at its position 0
    assert fed == [3] and llama_cpp.llama_memory_seq_pos_max(memory, 6) == -1
    assert np.array_equal(free[1][0], alone(prompts[7][: lengths[7]])[0])
    fed.clear()
    one_token_each(names[0], names[5])  # four sequences between: a ubatch costs less
    assert fed == [2]
    assert UBATCH_ROWS <= 4


@pytest.mark.parametrize("threads", [1, 2])
def test_the_row_a_prefill_keeps_is_the_row_a_pass_gives(
    gguf: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """A prefill feeds the prompt's last token too and keeps its row: the session's first score
    returns it and feeds only its proposal, with the rows a pass feeding the last token again
    gives, bit for bit, short prompts and one past SPLIT_FREE_POSITIONS alike (whose one-token
    passes run on one thread); its PassInfo counts only the rows it computed."""
    target = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=threads, kv_slots=2, kv_capacity=CAPACITY)
    fed = decoded_tokens(monkeypatch)
    for prompt in (prompts[0], prompts[-1]):
        kept, fresh = b"k" * 16, b"f" * 16
        target.open_session(kept, prompt)
        target.open_session(fresh, prompt)
        target.rollback(fresh)
        fed.clear()
        (empty,) = target.score([(kept, ())])
        assert fed == [] and target.scored_tokens == 0
        (again,) = target.score([(fresh, ())])
        assert fed == [1] and target.scored_tokens == 1
        assert np.array_equal(empty, again)
        target.rollback(kept)
        target.rollback(fresh)
        target.close_session(fresh)
        target.open_session(fresh, prompt)
        proposal = (int(again[0].argmax()), 42, 7)
        (with_kept,) = target.score([(fresh, proposal)])
        assert target.scored_tokens == len(proposal)
        (fed_again,) = target.score([(kept, proposal)])
        assert target.scored_tokens == len(proposal) + 1
        assert np.array_equal(with_kept, fed_again)
        target.close_session(kept)
        target.close_session(fresh)


def test_exported_kv_continues_with_identical_logits_in_a_fresh_target(
    target: LlamaCppTarget, gguf: Path, prompts: list[list[int]], sessions: Iterator[bytes]
) -> None:
    session = next(sessions)
    target.open_session(session, prompts[-1])
    for _ in range(5):
        token = int(target.score([(session, ())])[0][0].argmax())
        target.commit(session, 0, [token])
    target.score([(session, (11, 12, 13))])  # a scored proposal is not part of the committed KV
    blob = target.export_kv(session)
    target.rollback(session)
    committed = target.committed_tokens(session)

    fresh = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", threads=1, kv_slots=SESSIONS, kv_capacity=CAPACITY)
    fresh.import_kv(session, blob, committed)
    assert fresh.committed_tokens(session) == committed
    for proposal in [(), (42, 43), ()]:
        mine, theirs = target.score([(session, proposal)])[0], fresh.score([(session, proposal)])[0]
        assert np.array_equal(mine, theirs)
        token = int(mine[-1].argmax())
        target.commit(session, len(proposal), [*proposal, token])
        fresh.commit(session, len(proposal), [*proposal, token])

    with pytest.raises(KVFormatError, match="committed tokens"):
        fresh.import_kv(b"\x07" * 16, blob, (*committed[:-1], committed[-1] + 1))
    with pytest.raises(DigestMismatch):
        fresh.import_kv(b"\x07" * 16, blob.replace(target.weights_digest, b"\x00" * 32), committed)
    # llama.cpp lays a sequence's state out by the number of sequences of its cache.
    other_shape = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=2, kv_capacity=CAPACITY)
    with pytest.raises(KVFormatError, match="2 sequences"):
        other_shape.import_kv(session, blob, committed)
    assert not fresh.has_session(b"\x07" * 16) and not other_shape.has_session(session)


def test_digests_name_the_gguf_file_and_the_tokenizer_beside_it(
    target: LlamaCppTarget, gguf: Path, smollm2_loaded: LoadedModel
) -> None:
    again = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=1, kv_capacity=64)
    assert again.weights_digest == target.weights_digest == hashlib.sha256(gguf.read_bytes()).digest()
    assert target.tokenizer_digest == tokenizer_digest(smollm2_loaded.tokenizer)
    # The torch verifier computes another target from the fp32 conversion: another digest.
    torch_digest = weights_digest(smollm2_loaded.model)
    assert torch_digest != target.weights_digest
    target.check_digests(target.weights_digest, target.tokenizer_digest)
    with pytest.raises(DigestMismatch):
        target.check_digests(torch_digest, target.tokenizer_digest)


def test_a_session_beyond_the_sequences_is_refused(gguf: Path) -> None:
    small = LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=2, kv_capacity=64)
    small.open_session(b"a" * 16, [1, 2, 3])
    small.open_session(b"b" * 16, [4, 5])
    with pytest.raises(SessionLimit):
        small.open_session(b"c" * 16, [6])
    small.close_session(b"a" * 16)
    small.open_session(b"c" * 16, [6])  # a closed session's sequence serves the next one
    assert small.context_length == 64 and 0 < small.kv_usage() < 1


def test_requests_that_do_not_fit_are_refused_and_change_nothing(
    target: LlamaCppTarget, sessions: Iterator[bytes]
) -> None:
    session = next(sessions)
    with pytest.raises(BadTokens):
        target.open_session(session, [])
    with pytest.raises(BadTokens):
        target.open_session(session, [1, target.vocab_size])
    target.open_session(session, [1, 2, 3])
    with pytest.raises(BadTokens):
        target.score([(session, (4,)), (session, (5,))])
    with pytest.raises(InconsistentCommit, match="no scored proposal"):
        target.commit(session, 0, [4])
    rows = target.score([(session, (4, 5))])[0]
    with pytest.raises(InconsistentCommit):
        target.commit(session, 1, [9, 9])
    target.rollback(session)
    assert target.committed_tokens(session) == (1, 2, 3)
    assert np.array_equal(target.score([(session, (4, 5))])[0], rows)


def test_llama_cpp_prints_nothing_unless_asked(gguf: Path, capfd: pytest.CaptureFixture[str]) -> None:
    LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=1, kv_capacity=64)
    assert capfd.readouterr().err == ""
    LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=1, kv_capacity=64, native_log=True)
    assert "llama" in capfd.readouterr().err
    LlamaCppTarget(gguf, gguf.parent / "tokenizer.json", kv_slots=1, kv_capacity=64)  # quiet again
    assert capfd.readouterr().err == ""


def test_the_registry_loads_the_kept_gguf_or_a_gguf_path(gguf: Path, target: LlamaCppTarget) -> None:
    named = load_target("smollm2", backend="llamacpp", kv_slots=1, kv_capacity=64, threads=1)
    by_path = load_target(str(gguf), backend="llamacpp", kv_slots=1, kv_capacity=64, threads=1)
    assert isinstance(named, LlamaCppTarget) and isinstance(by_path, LlamaCppTarget)
    assert named.weights_digest == by_path.weights_digest == target.weights_digest
    assert by_path.tokenizer_digest == target.tokenizer_digest
    with pytest.raises(ModelError, match="cpu"):
        load_target("smollm2", backend="llamacpp", device="cuda")
    with pytest.raises(ModelError, match="gguf"):
        load_target(str(gguf.parent), backend="llamacpp")


def test_a_missing_llama_cpp_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    monkeypatch.delitem(sys.modules, "sdcp.models.llamacpp.target")
    with pytest.raises(ModelError, match=r"sdcp\[verifier\]") as refused:
        load_target("smollm2", backend="llamacpp")
    assert "\n" not in str(refused.value)


def test_greedy_runs_extending_the_proposal_equal_llama_cpp_greedy(
    target: LlamaCppTarget, prompts: list[list[int]], reference: list[list[int]], sessions: Iterator[bytes]
) -> None:
    """A greedy run feeds each most probable token after the scored proposal (`score` extending) and
    the decided token is committed before or after that: rule 1 still gives the reference."""
    rng = np.random.default_rng(29)
    for prompt, expected in zip(prompts[:4], reference[:4], strict=True):
        session = next(sessions)
        target.open_session(session, prompt)
        following = int(target.score([(session, ())])[0][-1].argmax())
        decoded: list[int] = []
        while len(decoded) < len(expected):
            token = following
            if rng.random() < 0.5:
                target.commit(session, 0, [token])
                row = target.score([(session, (token,))], extending={session})[0]
            else:
                row = target.score([(session, (token,))], extending={session})[0]
                target.commit(session, 0, [token])
            assert row.shape == (1, target.vocab_size)
            decoded.append(token)
            following = int(row[-1].argmax())
        # Committed and not fed yet: only that token can go on.
        target.commit(session, 0, [following])
        with pytest.raises(InconsistentCommit, match="no scored proposal"):
            target.score([(session, ((following + 1) % target.vocab_size,))], extending={session})
        target.close_session(session)
        assert decoded == expected


async def test_a_joining_sessions_kept_row_needs_no_pass_and_its_run_joins_the_pass_under_way(
    target: LlamaCppTarget, prompts: list[list[int]], reference: list[list[int]], sessions: Iterator[bytes]
) -> None:
    """A session's first request after its prefill is answered with the row the prefill kept, not
    with the pass it shares with a running session's request; its greedy run's first step is
    computed in that very pass (a step a pass sooner than after a pass of its own), and the run
    still follows llama.cpp's greedy decoding."""
    running, joining = next(sessions), next(sessions)
    target.open_session(running, prompts[0])
    target.score([(running, ())])
    target.open_session(joining, prompts[1])
    # The first pass waits for both requests; the later ones, the run's alone (it has fed a token), for nobody.
    runs: list[ScoredRun] = []

    def active() -> int:
        return 1 if runs and runs[0].fed else 2

    with BatchingScorer(target, window_s=5.0, max_batch=2, active_sessions=active) as scorer:
        run = scorer.score_ahead_async(joining, (), 3, frozenset(), deliver_every=1)
        runs.append(run)
        passing = scorer.score_async(running, (7,))
        kept = await asyncio.wait_for(run.rows, timeout=60)
        first_step = await asyncio.wait_for(run.steps[0], timeout=60)
        # It came with the running session's pass (the scorer may be in the next one by now).
        assert passing.done() and scorer.passes[run.steps[0]] is scorer.passes[passing]
        assert first_step is not None
        steps = [await asyncio.wait_for(step, timeout=60) for step in run.steps[1:]]
    picked = [int(rows[-1].argmax()) for rows in (kept, first_step, *steps) if rows is not None]
    assert picked == reference[1][: len(picked)] and len(picked) == 4
    assert run.fed == reference[1][:3]
