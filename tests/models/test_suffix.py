"""The suffix drafter: its index, the longest match and the frequency of continuations, the length
rule, the shared history's budget and keys, syncs that equal a rebuild, and rule 1 on the tiny target."""

from __future__ import annotations

import numpy as np
import pytest
from tests.models.speculative import reference_greedy, speculative_greedy

from sdcp.models import Drafter, LoadedModel, NgramDrafter, TargetModel, UnknownSession, load_drafter
from sdcp.models.errors import BadTokens
from sdcp.models.lookup.suffix import (
    DraftStep,
    HistorySize,
    Match,
    SharedHistory,
    SharesHistory,
    SuffixDrafter,
    SuffixIndex,
    history_key,
    plan_draft,
)
from sdcp.protocol.messages import Action, Contract, Sampling

pytestmark = pytest.mark.timeout(60)

VOCAB = 257
EVERY_STEP = {"min_probability": 0.0, "spec_factor": 100.0}


def index_of(*texts: list[int], session: list[int] | None = None) -> SuffixIndex:
    index = SuffixIndex()
    if session is not None:
        index.append(session)
    for text in texts:
        index.add_text(text)
    return index


def contract(scope: bytes | None = None) -> Contract:
    return Contract(
        target=bytes(32),
        tokenizer=bytes(range(32)),
        rule=1,
        m_max=16,
        max_new=64,
        stop=(),
        low_rounds=2,
        fallback=(Action.REDUCE,),
        scope=scope,
    )


# -- matches and continuations ---------------------------------------------------------------------


def test_the_longest_suffix_is_matched_with_its_most_recent_occurrences_first() -> None:
    #        positions: 0  1  2  3  4  5  6  7  8  9 10 11 12 13
    index = index_of(session=[5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 7, 2, 3, 8])
    # "1 2 3" ends at 8 and 3; "2 3" at 12 as well, but shorter; "9 1 2 3" nowhere.
    assert index.longest_match([9, 1, 2, 3], 32) == Match(3, (8, 3))
    assert index.longest_match([9, 1, 2, 3], 2) == Match(2, (12, 8, 3))
    # The last token only: its occurrence at the very end has nothing after it.
    assert index.longest_match([0, 8], 32) is None
    assert index.longest_match([42], 32) is None


def test_the_walk_follows_the_most_frequent_continuation_and_multiplies_its_shares() -> None:
    index = index_of(session=[5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 7, 2, 3, 8])
    steps = plan_draft([9, 1, 2, 3], index, None, 5, **EVERY_STEP)
    # 4 followed both occurrences; then 6 and 7 once each: the more recent, 7, at half the estimate.
    assert steps == [
        DraftStep(4, 1.0),
        DraftStep(7, 0.5),
        DraftStep(2, 0.5),
        DraftStep(3, 0.5),
        DraftStep(8, 0.5),
    ]


def test_frequency_outranks_recency() -> None:
    index = index_of(session=[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 4, 0])
    assert plan_draft([1, 2], index, None, 1, **EVERY_STEP) == [DraftStep(3, 0.75)]


def test_session_and_shared_counts_combine_and_ties_go_to_the_session() -> None:
    own = index_of(session=[1, 2, 7, 0])
    once = index_of([1, 2, 8])
    assert plan_draft([5, 1, 2], own, once, 1, **EVERY_STEP) == [DraftStep(7, 0.5)]
    twice = index_of([1, 2, 8], [1, 2, 8, 9])
    assert plan_draft([5, 1, 2], own, twice, 1, **EVERY_STEP) == [DraftStep(8, 2 / 3)]


def test_only_the_longest_match_counts() -> None:
    own = index_of(session=[1, 2, 7, 1, 2, 7, 0])
    shared = index_of([5, 1, 2, 8])
    # "5 1 2" occurs in the shared history only: the session's two "1 2 7" do not count.
    assert plan_draft([5, 1, 2], own, shared, 1, **EVERY_STEP) == [DraftStep(8, 1.0)]


def test_a_match_shorter_than_the_minimum_drafts_nothing() -> None:
    index = index_of(session=[1, 2, 3, 4])
    assert plan_draft([9, 2], index, None, 4, min_match=2, min_probability=0.0) == []
    assert plan_draft([9, 2], index, None, 4, min_match=1, **EVERY_STEP) == [DraftStep(3, 1.0), DraftStep(4, 1.0)]


# -- how long a draft is -------------------------------------------------------------------------------


def test_the_draft_stops_before_a_token_below_the_threshold() -> None:
    index = index_of(session=[5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 7, 2, 3, 8])
    confident = plan_draft([9, 1, 2, 3], index, None, 5, min_probability=0.6, spec_factor=100.0)
    assert [step.token for step in confident] == [4]
    lenient = plan_draft([9, 1, 2, 3], index, None, 5, min_probability=0.4, spec_factor=100.0)
    assert [step.token for step in lenient] == [4, 7, 2, 3, 8]


def test_the_first_token_is_proposed_however_unsure() -> None:
    index = index_of(session=[1, 2, 1, 3, 1, 4, 0])
    assert plan_draft([1], index, None, 4, min_probability=0.9, spec_factor=100.0) == [DraftStep(4, 1 / 3)]


def test_the_draft_stops_at_m_and_grows_with_the_match() -> None:
    text = list(range(10, 60))
    index = index_of(session=[*text, 0])
    assert len(plan_draft([9, *text[:20]], index, None, 6, min_probability=0.0)) == 6
    # A match of two tokens drafts two at the default spec factor, however certain the walk is.
    assert [step.token for step in plan_draft([9, 10, 11], index, None, 16)] == [12, 13]
    assert len(plan_draft([9, *text[:10]], index, None, 16)) == 10


# -- the shared history ------------------------------------------------------------------------------


def test_the_history_evicts_its_oldest_outputs_whole_within_the_budget() -> None:
    history = SharedHistory(max_tokens=10)
    history.learn(b"a", [1, 2, 3, 4])
    history.learn(b"a", [5, 6, 7, 8])
    assert history.size.tokens == 8 and history.size.sessions == 2
    history.learn(b"b", [9, 10, 11])
    assert (history.size.tokens, history.size.sessions) == (7, 2)
    a = history.index(b"a")
    assert a is not None
    assert a.longest_match([1, 2], 32) is None
    assert a.longest_match([5, 6], 32) is not None
    # Longer than the whole budget: not kept, and nothing evicted for it.
    history.learn(b"a", list(range(11)))
    assert history.size.tokens == 7
    history.learn(b"b", [12, 13, 14, 15])
    assert history.index(b"a") is None
    assert (history.size.tokens, history.size.sessions) == (7, 2)
    assert history.size.approx_bytes > 0


def test_an_evicted_history_answers_as_one_built_from_the_kept_outputs() -> None:
    rng = np.random.default_rng(5)
    history = SharedHistory(max_tokens=300)
    outputs = [rng.integers(0, 6, size=int(rng.integers(5, 60))).tolist() for _ in range(40)]
    for output in outputs:
        history.learn(b"k", output)
    kept: list[list[int]] = []
    for output in reversed(outputs):
        if sum(map(len, kept)) + len(output) > 300:
            break
        kept.insert(0, output)
    assert history.size == HistorySize(sum(map(len, kept)), len(kept), history.size.approx_bytes, max_tokens=300)
    evolved = history.index(b"k")
    assert evolved is not None
    rebuilt = index_of(*kept)
    empty = SuffixIndex()
    for _ in range(200):
        context = rng.integers(0, 6, size=int(rng.integers(1, 12))).tolist()
        assert plan_draft(context, empty, evolved, 8, **EVERY_STEP) == plan_draft(
            context, empty, rebuilt, 8, **EVERY_STEP
        )


def test_drafts_are_those_of_lookups_that_walk_every_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup walks no chain below the match it needs (the minimum, or the session's own match
    for the shared index): drafts, from small vocabularies where every order's chain is long, are
    those of lookups that walk every chain."""
    rng = np.random.default_rng(11)
    cases = []
    for vocab in (3, 6, 20):
        session = rng.integers(0, vocab, size=int(rng.integers(10, 200))).tolist()
        shared = index_of(*(rng.integers(0, vocab, size=int(rng.integers(5, 80))).tolist() for _ in range(30)))
        for _ in range(60):
            end = int(rng.integers(1, len(session) + 1))
            own = index_of(session=session[:end])
            context = session[:end] + rng.integers(0, vocab, size=int(rng.integers(0, 4))).tolist()
            own.append(context[end:])
            cases.append((context, own, shared, int(rng.integers(1, 4))))
    drafts = [
        plan_draft(context, own, shared, 8, min_match=least, **EVERY_STEP) for context, own, shared, least in cases
    ]
    every_chain = SuffixIndex.longest_match
    monkeypatch.setattr(
        SuffixIndex, "longest_match", lambda self, context, longest, _least=1: every_chain(self, context, longest)
    )
    walked = [
        plan_draft(context, own, shared, 8, min_match=least, **EVERY_STEP) for context, own, shared, least in cases
    ]
    assert drafts == walked
    assert sum(1 for draft in drafts if draft) > len(cases) // 2


# -- sync ------------------------------------------------------------------------------------------


def test_an_index_kept_by_appends_and_truncations_equals_a_rebuilt_one() -> None:
    rng = np.random.default_rng(7)
    index = SuffixIndex()
    tokens: list[int] = []
    for _ in range(300):
        if tokens and rng.random() < 0.3:
            length = int(rng.integers(0, len(tokens) + 1))
            index.truncate(length)
            del tokens[length:]
        else:
            new = rng.integers(0, 5, size=int(rng.integers(1, 8))).tolist()
            index.append(new)
            tokens.extend(new)
    rebuilt = index_of(session=tokens)
    assert index.end == rebuilt.end == len(tokens)
    for end in range(1, len(tokens) + 1):
        assert index.longest_match(tokens[:end], 32) == rebuilt.longest_match(tokens[:end], 32)
    for _ in range(100):
        context = rng.integers(0, 5, size=int(rng.integers(1, 20))).tolist()
        assert index.longest_match(context, 32) == rebuilt.longest_match(context, 32)


def test_a_drafter_synced_round_after_round_drafts_as_a_fresh_one(session_ids) -> None:
    rng = np.random.default_rng(11)
    drafter = SuffixDrafter(VOCAB, **EVERY_STEP)
    session = next(session_ids)
    committed = rng.integers(0, 4, size=20).tolist()
    drafter.open_session(session, committed)
    prompt_length = len(committed)
    for _ in range(200):
        draft = drafter.draft(session, int(rng.integers(1, 6)), None)
        if rng.random() < 0.1:
            # A resync to a shorter prefix, as after reassignment.
            committed = committed[: int(rng.integers(prompt_length, len(committed) + 1))]
        accepted = int(rng.integers(0, len(draft.tokens) + 1))
        extra = int(rng.integers(0, 4))
        committed = [*committed, *draft.tokens[:accepted], extra]
        drafter.sync(session, committed)
    fresh = SuffixDrafter(VOCAB, **EVERY_STEP)
    other = next(session_ids)
    fresh.open_session(other, committed[:prompt_length])
    fresh.sync(other, committed)
    for m in (1, 3, 8):
        assert drafter.draft(session, m, None).tokens == fresh.draft(other, m, None).tokens
        drafter.sync(session, committed)
        fresh.sync(other, committed)


# -- the drafter -------------------------------------------------------------------------------------


def test_the_drafter_is_a_drafter_that_shares_history() -> None:
    drafter = load_drafter("suffix", vocab_size=VOCAB)
    assert isinstance(drafter, SuffixDrafter)
    assert isinstance(drafter, Drafter) and isinstance(drafter, SharesHistory)
    assert drafter.runs_inline
    assert drafter.weights_digest != NgramDrafter(VOCAB).weights_digest
    assert drafter.weights_digest != SuffixDrafter(VOCAB, min_probability=0.05).weights_digest
    drafter.set_threads(4)
    drafter.prepare()


def test_rows_are_one_hot_whatever_the_sampling(session_ids) -> None:
    drafter = SuffixDrafter(VOCAB)
    session = next(session_ids)
    drafter.open_session(session, [1, 2, 3, 4, 1, 2, 3])
    for sampling in (None, Sampling(temperature_milli=0), Sampling(temperature_milli=900, seed=3)):
        drafter.sync(session, [1, 2, 3, 4, 1, 2, 3])
        draft = drafter.draft(session, 4, sampling)
        assert draft.tokens == (4, 1, 2)  # a three-token match drafts three tokens
        assert draft.q_rows is not None
        assert np.array_equal(draft.q_rows, np.eye(VOCAB, dtype=np.float32)[list(draft.tokens)])


def test_without_a_match_the_last_token_is_repeated(session_ids) -> None:
    drafter = SuffixDrafter(VOCAB)
    session = next(session_ids)
    drafter.open_session(session, [1, 2, 3])
    assert drafter.draft(session, 4, None).tokens == (3,)
    # Drafted tokens are tentative: a pre-draft continues after them.
    assert drafter.draft(session, 4, None).tokens == (3,)


def test_a_finished_sessions_output_helps_later_sessions_of_its_key_only(session_ids) -> None:
    drafter = SuffixDrafter(VOCAB)
    tenant, other_tenant = contract(scope=bytes(16)), contract(scope=bytes([1]) * 16)
    assert history_key(tenant) != history_key(other_tenant)
    output = [20, 21, 22, 23, 24, 25, 26, 27]
    first = next(session_ids)
    drafter.open_session(first, [10, 11, 12])
    drafter.bind_history(first, history_key(tenant))
    drafter.sync(first, [10, 11, 12, *output])
    drafter.close_session(first)
    # The output of a finished session comes by key, from whichever instance saw it finish.
    drafter.learn(history_key(tenant), output)
    assert (drafter.history_size.tokens, drafter.history_size.sessions) == (8, 1)

    prompt = [30, 20, 21, 22]
    drafts = {}
    for name, bound in (("same key", tenant), ("another key", other_tenant), ("no key", None)):
        session = next(session_ids)
        drafter.open_session(session, prompt)
        if bound is not None:
            drafter.bind_history(session, history_key(bound))
        drafts[name] = drafter.draft(session, 8, None).tokens
        drafter.close_session(session)
    # "20 21 22" ended the first output's third token: three more tokens, one per token matched.
    assert drafts == {"same key": (23, 24, 25), "another key": (22,), "no key": (22,)}
    # Closing without learning keeps nothing; an output outside the vocabulary is refused.
    assert drafter.history_size.sessions == 1
    with pytest.raises(BadTokens):
        drafter.learn(history_key(tenant), [VOCAB])


def test_unknown_sessions_are_refused(session_ids) -> None:
    drafter = SuffixDrafter(VOCAB)
    session = next(session_ids)
    for call in (
        lambda: drafter.draft(session, 1, None),
        lambda: drafter.sync(session, [1]),
        lambda: drafter.bind_history(session, history_key(contract())),
        lambda: drafter.close_session(session),
    ):
        with pytest.raises(UnknownSession):
            call()


# -- rule 1 on the tiny target -----------------------------------------------------------------------


def test_rule_1_gives_the_targets_greedy_output_and_a_repeated_task_is_drafted(
    tiny_loaded: LoadedModel, session_ids
) -> None:
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer)
    drafter = SuffixDrafter(target.vocab_size)
    for text in ("The quick brown fox", "hello world, hello world, hello", "a"):
        prompt = tiny_loaded.tokenizer(text).input_ids
        expected = reference_greedy(tiny_loaded.model, prompt, 40)
        runs = []
        for _ in range(2):
            session = next(session_ids)
            run = speculative_greedy(target, drafter, session, prompt, len(expected), m=8)
            drafter.learn(b"", run.tokens)
            drafter.close_session(session)
            runs.append(run)
        assert runs[0].tokens == runs[1].tokens == expected
        # The second run drafts from the first one's output: most of its tokens are the drafter's.
        assert 2 * runs[1].accepted > len(expected)
