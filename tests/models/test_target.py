"""TargetModel: batched scoring, KV rollback, KV export/import, digests and typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdcp.models import (
    BadTokens,
    DigestMismatch,
    InconsistentCommit,
    KVFormatError,
    LoadedModel,
    SessionExists,
    TargetModel,
    UnknownSession,
)
from sdcp.models.backend import Opening

pytestmark = pytest.mark.timeout(60)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3], [40, 41, 42, 43], [100, 90, 80, 70, 60, 50]]
PROPOSALS = [[1, 2, 3], [4], [], [9, 8, 7, 6, 5, 4]]


def _open_all(target: TargetModel, session_ids, prompts: list[list[int]]) -> list[bytes]:
    sessions = [next(session_ids) for _ in prompts]
    for session, prompt in zip(sessions, prompts, strict=True):
        target.open_session(session, prompt)
    return sessions


def _assert_kv_close(left, right) -> None:
    assert len(left) == len(right)
    for (k1, v1), (k2, v2) in zip(left, right, strict=True):
        assert k1.shape == k2.shape
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)


def _scored_separately(target: TargetModel, sessions, proposals) -> list[np.ndarray]:
    rows = []
    for session, proposal in zip(sessions, proposals, strict=True):
        rows.append(target.score([(session, proposal)])[0])
        target.rollback(session)
    return rows


def test_batched_scoring_matches_unbatched(tiny_target: TargetModel, session_ids) -> None:
    sessions = _open_all(tiny_target, session_ids, PROMPTS)
    separate = _scored_separately(tiny_target, sessions, PROPOSALS)
    batched = tiny_target.score(list(zip(sessions, PROPOSALS, strict=True)))
    for proposal, alone, together in zip(PROPOSALS, separate, batched, strict=True):
        assert together.dtype == np.float32
        assert together.shape == (len(proposal) + 1, tiny_target.vocab_size)
        np.testing.assert_array_equal(together.argmax(-1), alone.argmax(-1))
        np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-4)


def test_batched_scoring_keeps_each_session_cache_exact(tiny_target: TargetModel, session_ids) -> None:
    sessions = _open_all(tiny_target, session_ids, PROMPTS)
    tiny_target.score(list(zip(sessions, PROPOSALS, strict=True)))
    for session, proposal in zip(sessions, PROPOSALS, strict=True):
        accepted = len(proposal) // 2
        tiny_target.commit(session, accepted, [*proposal[:accepted], 17])
    fresh = _open_all(tiny_target, session_ids, [list(tiny_target.committed_tokens(s)) for s in sessions])
    for session, reference in zip(sessions, fresh, strict=True):
        _assert_kv_close(tiny_target.session_kv(session), tiny_target.session_kv(reference))


def test_smollm2_batched_scoring_matches_unbatched(smollm2_loaded: LoadedModel, session_ids) -> None:
    target = TargetModel(smollm2_loaded.model, smollm2_loaded.tokenizer, name="smollm2")
    prompts = [smollm2_loaded.tokenizer(text).input_ids for text in ("Hi", "The sky is blue because", "1 2 3 4")]
    proposals = [[28, 29, 30], [], [216, 33]]
    sessions = _open_all(target, session_ids, prompts)
    separate = _scored_separately(target, sessions, proposals)
    batched = target.score(list(zip(sessions, proposals, strict=True)))
    for alone, together in zip(separate, batched, strict=True):
        np.testing.assert_array_equal(together.argmax(-1), alone.argmax(-1))
        np.testing.assert_allclose(together, alone, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_rollback_after_partial_acceptance_equals_fresh_prefill(
    tiny_target: TargetModel, session_ids, accepted: int
) -> None:
    session, reference = next(session_ids), next(session_ids)
    tiny_target.open_session(session, [10, 20, 30, 40])
    proposal = [50, 60, 70, 80, 90]
    tiny_target.score([(session, proposal)])
    tiny_target.commit(session, accepted, [*proposal[:accepted], 123])
    committed = [10, 20, 30, 40, *proposal[:accepted], 123]
    assert tiny_target.committed_tokens(session) == tuple(committed)
    tiny_target.open_session(reference, committed)
    _assert_kv_close(tiny_target.session_kv(session), tiny_target.session_kv(reference))
    np.testing.assert_allclose(
        tiny_target.score([(session, [1, 2])])[0],
        tiny_target.score([(reference, [1, 2])])[0],
        rtol=1e-4,
        atol=1e-5,
    )


def test_self_decode_request_yields_one_row_and_commits_one_token(tiny_target: TargetModel, session_ids) -> None:
    session = next(session_ids)
    tiny_target.open_session(session, [7])
    rows = tiny_target.score([(session, ())])[0]
    assert rows.shape == (1, tiny_target.vocab_size)
    token = int(rows[0].argmax())
    tiny_target.commit(session, 0, [token])
    assert tiny_target.committed_tokens(session) == (7, token)


def test_export_import_round_trip_continues_identically(
    tiny_loaded: LoadedModel, tiny_target: TargetModel, session_ids
) -> None:
    session = next(session_ids)
    tiny_target.open_session(session, [1, 2, 3, 4, 5])
    tiny_target.score([(session, [6, 7, 8])])
    tiny_target.commit(session, 2, [6, 7, 200])
    blob = tiny_target.export_kv(session)
    other = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny-failover")
    other.import_kv(session, blob, tiny_target.committed_tokens(session))
    _assert_kv_close(other.session_kv(session), tiny_target.session_kv(session))
    for _ in range(5):
        original = tiny_target.score([(session, [9, 10])])[0]
        restored = other.score([(session, [9, 10])])[0]
        np.testing.assert_array_equal(original, restored)
        emitted = [9, int(original[1].argmax())]
        tiny_target.commit(session, 1, emitted)
        other.commit(session, 1, emitted)
    assert other.committed_tokens(session) == tiny_target.committed_tokens(session)


def test_export_of_single_token_prefix_round_trips(tiny_target: TargetModel, session_ids) -> None:
    session, copy = next(session_ids), next(session_ids)
    tiny_target.open_session(session, [42])
    tiny_target.import_kv(copy, tiny_target.export_kv(session), [42])
    np.testing.assert_array_equal(tiny_target.score([(session, [1])])[0], tiny_target.score([(copy, [1])])[0])


def test_import_refuses_other_model_and_other_tokens(
    tiny_target: TargetModel, tiny_draft_loaded: LoadedModel, session_ids
) -> None:
    session = next(session_ids)
    tiny_target.open_session(session, [1, 2, 3])
    blob = tiny_target.export_kv(session)
    other_model = TargetModel(tiny_draft_loaded.model, tiny_draft_loaded.tokenizer)
    with pytest.raises(DigestMismatch):
        other_model.import_kv(session, blob, [1, 2, 3])
    with pytest.raises(KVFormatError, match="committed tokens"):
        tiny_target.import_kv(next(session_ids), blob, [1, 2, 4])
    with pytest.raises(KVFormatError):
        tiny_target.import_kv(next(session_ids), blob[:40], [1, 2, 3])
    with pytest.raises(KVFormatError):
        tiny_target.import_kv(next(session_ids), b"\x00\x00\x00\x02\xa0", [1, 2, 3])
    with pytest.raises(SessionExists):
        tiny_target.import_kv(session, blob, [1, 2, 3])


def test_check_digests(tiny_target: TargetModel, tiny_draft_loaded: LoadedModel) -> None:
    tiny_target.check_digests(tiny_target.weights_digest, tiny_target.tokenizer_digest)
    other = TargetModel(tiny_draft_loaded.model, tiny_draft_loaded.tokenizer)
    assert other.weights_digest != tiny_target.weights_digest
    assert other.tokenizer_digest == tiny_target.tokenizer_digest
    with pytest.raises(DigestMismatch, match="target digest"):
        tiny_target.check_digests(other.weights_digest, tiny_target.tokenizer_digest)
    with pytest.raises(DigestMismatch, match="tokenizer digest"):
        tiny_target.check_digests(tiny_target.weights_digest, bytes(32))


def test_typed_errors(tiny_target: TargetModel, session_ids) -> None:
    session = next(session_ids)
    with pytest.raises(UnknownSession):
        tiny_target.score([(session, [1])])
    with pytest.raises(BadTokens):
        tiny_target.open_session(session, [])
    with pytest.raises(BadTokens):
        tiny_target.open_session(session, [tiny_target.vocab_size])
    tiny_target.open_session(session, [1, 2])
    with pytest.raises(SessionExists):
        tiny_target.open_session(session, [1, 2])
    with pytest.raises(BadTokens):
        tiny_target.score([(session, [-1])])
    with pytest.raises(BadTokens, match="twice"):
        tiny_target.score([(session, [1]), (session, [2])])
    with pytest.raises(InconsistentCommit, match="no scored proposal"):
        tiny_target.commit(session, 0, [1])
    tiny_target.score([(session, [3, 4])])
    with pytest.raises(InconsistentCommit):
        tiny_target.commit(session, 3, [3, 4, 5, 6])
    with pytest.raises(InconsistentCommit):
        tiny_target.commit(session, 1, [9, 9])
    with pytest.raises(InconsistentCommit):
        tiny_target.commit(session, 0, [3, 4])
    tiny_target.close_session(session)
    with pytest.raises(UnknownSession):
        tiny_target.close_session(session)


def test_tokens_extending_a_scored_proposal_get_its_rows(tiny_target: TargetModel, session_ids) -> None:
    """`score` extending feeds tokens after the scored proposal, or after a commit that took it and
    the token after it; the rows are those of scoring the whole proposal at once."""
    whole, parts = _open_all(tiny_target, session_ids, [PROMPTS[0], PROMPTS[0]])
    expected = tiny_target.score([(whole, [1, 2, 3, 4])])[0]
    tiny_target.score([(parts, [1])])
    np.testing.assert_allclose(
        tiny_target.score([(parts, [2, 3])], extending={parts})[0], expected[2:4], rtol=1e-4, atol=1e-4
    )
    tiny_target.commit(parts, 3, [1, 2, 3, 4])  # the proposal and the token after it, not fed yet
    np.testing.assert_allclose(
        tiny_target.score([(parts, [4])], extending={parts})[0], expected[4:], rtol=1e-4, atol=1e-4
    )
    tiny_target.commit(whole, 4, [1, 2, 3, 4])
    assert tiny_target.committed_tokens(parts) == tiny_target.committed_tokens(whole)
    np.testing.assert_allclose(
        tiny_target.score([(parts, [9])])[0], tiny_target.score([(whole, [9])])[0], rtol=1e-4, atol=1e-4
    )
    tiny_target.commit(whole, 0, [5])  # committed, not fed: only 5 can go on
    with pytest.raises(InconsistentCommit, match="no scored proposal"):
        tiny_target.score([(whole, [6])], extending={whole})


def test_a_commit_of_the_first_proposed_tokens_keeps_the_rest_scored(tiny_target: TargetModel, session_ids) -> None:
    (session,) = _open_all(tiny_target, session_ids, [PROMPTS[3]])
    expected = tiny_target.score([(session, [7, 8, 9])])[0]
    tiny_target.commit(session, 1, [7])
    rows = tiny_target.score([(session, [10])], extending={session})[0]
    tiny_target.rollback(session)
    fresh = tiny_target.score([(session, [8, 9, 10])])[0]
    np.testing.assert_allclose(rows, fresh[-1:], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(fresh[:3], expected[1:], rtol=1e-4, atol=1e-4)


def test_openings_together_fail_alone_and_open_as_one_by_one(tiny_target: TargetModel, session_ids) -> None:
    """Target.open_sessions on torch: one prefill after another, each opening's failure its own."""
    good, bad, again = next(session_ids), next(session_ids), next(session_ids)
    failures = tiny_target.open_sessions(
        [
            Opening(good, tuple(PROMPTS[0])),
            Opening(bad, (1, tiny_target.vocab_size)),
            Opening(again, tuple(PROMPTS[2])),
            Opening(good, tuple(PROMPTS[1])),
        ]
    )
    assert failures[0] is None and failures[2] is None
    assert isinstance(failures[1], BadTokens) and isinstance(failures[3], SessionExists)
    assert tiny_target.has_session(good) and tiny_target.has_session(again) and not tiny_target.has_session(bad)
    (reference,) = _open_all(tiny_target, session_ids, [PROMPTS[0]])
    _assert_kv_close(tiny_target.session_kv(good), tiny_target.session_kv(reference))
