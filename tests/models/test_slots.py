"""Sessions in the slots of a SlotPool score as sessions with caches of their own do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdcp.models import LoadedModel, TargetModel
from sdcp.models.hf.kvcache import GrowableLayer, SlotPool
from sdcp.models.hf.ragged import SlotPass

pytestmark = pytest.mark.timeout(60)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3], [40, 41, 42, 43], [100, 90, 80, 70, 60, 50], [7, 7, 7], [1, 2]]
# Widths 1 (three requests: one batch), 2 (two: one batch), 4 and 6 (one each: alone).
PROPOSALS = [[], [4], [], [9, 8, 7, 6, 5], [2], [30, 31, 32]]


def _twins(loaded: LoadedModel, **slots: int) -> tuple[TargetModel, TargetModel]:
    """A target with a slot pool and one whose sessions all have caches of their own."""
    return TargetModel(loaded.model, name="pooled", **slots), TargetModel(loaded.model, name="own", kv_slots=0)


def _open(targets: tuple[TargetModel, ...], sessions: list[bytes], prompts: list[list[int]]) -> None:
    for target in targets:
        for session, prompt in zip(sessions, prompts, strict=True):
            target.open_session(session, prompt)


def _assert_same_rows(left: list[np.ndarray], right: list[np.ndarray]) -> None:
    for pooled, own in zip(left, right, strict=True):
        np.testing.assert_array_equal(pooled.argmax(-1), own.argmax(-1))
        np.testing.assert_allclose(pooled, own, rtol=1e-4, atol=1e-4)


def _assert_same_kv(left: TargetModel, right: TargetModel, session: bytes) -> None:
    for (k1, v1), (k2, v2) in zip(left.session_kv(session), right.session_kv(session), strict=True):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-5)


def test_a_slot_pass_groups_requests_by_width(tiny_target: TargetModel) -> None:
    pool = SlotPool(tiny_target.model, slots=8, capacity=32)
    plan = SlotPass(pool, slots=[0, 1, 2, 3, 4, 7], starts=[7, 0, 3, 5, 2, 1], widths=[1, 2, 1, 6, 2, 1])
    # Width 1: slots 0, 2 and 7 span 8 slots, more than two per request, so they go alone.
    assert [(group.width, group.first, group.last) for group in plan.groups] == [(2, 1, 4)]
    assert sorted(plan.single) == [(0, 1, 0, 8), (3, 1, 2, 4), (4, 6, 3, 11), (12, 1, 7, 2)]
    assert plan.rows == 13


def test_pooled_passes_score_and_keep_kv_as_own_caches_do(tiny_loaded: LoadedModel, session_ids) -> None:
    targets = _twins(tiny_loaded)
    sessions = [next(session_ids) for _ in PROMPTS]
    _open(targets, sessions, PROMPTS)
    for step in range(3):
        rows = [target.score(list(zip(sessions, PROPOSALS, strict=True))) for target in targets]
        _assert_same_rows(*rows)
        for target, scored in zip(targets, rows, strict=True):
            for session, proposal, logits in zip(sessions, PROPOSALS, scored, strict=True):
                accepted = (len(proposal) + step) // 2 % (len(proposal) + 1)
                target.commit(session, accepted, [*proposal[:accepted], int(logits[accepted].argmax())])
    for session in sessions:
        assert targets[0]._sessions[session].slot is not None
        assert targets[0].committed_tokens(session) == targets[1].committed_tokens(session)
        _assert_same_kv(*targets, session)


def test_sessions_beyond_the_slots_or_their_capacity_have_caches_of_their_own(
    tiny_loaded: LoadedModel, session_ids
) -> None:
    targets = _twins(tiny_loaded, kv_slots=2, kv_capacity=12)
    sessions = [next(session_ids) for _ in range(3)]
    # The third session finds no free slot; the first outgrows its slot in the second pass.
    _open(targets, sessions, [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [40, 41]])
    for proposal in ([1, 2], [3, 4, 5, 6], [7]):
        requests = [(session, proposal) for session in sessions]
        rows = [target.score(requests) for target in targets]
        _assert_same_rows(*rows)
        for target in targets:
            for session in sessions:
                target.commit(session, len(proposal), [*proposal, 17])
    for session in sessions:
        _assert_same_kv(*targets, session)
    pooled = targets[0]
    # The session that outgrew its slot gave it back, and the one that found none moved into it.
    assert pooled._sessions[sessions[0]].slot is None
    assert pooled._sessions[sessions[2]].slot == 0
    newcomer = next(session_ids)
    pooled.open_session(newcomer, [9, 9])
    assert pooled._sessions[newcomer].slot is None
    pooled.close_session(sessions[1])
    later = next(session_ids)
    pooled.open_session(later, [9, 9])
    assert pooled._sessions[later].slot == 1


def test_a_closed_session_frees_its_slot(tiny_loaded: LoadedModel, session_ids) -> None:
    target = TargetModel(tiny_loaded.model, name="pooled", kv_slots=2)
    first, second, third = (next(session_ids) for _ in range(3))
    target.open_session(first, [1, 2, 3])
    target.open_session(second, [4, 5])
    target.close_session(first)
    target.open_session(third, [6])
    assert target._sessions[third].slot == 0


def test_a_layer_on_given_buffers_writes_into_them_until_full() -> None:
    keys_buffer, values_buffer = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)
    layer = GrowableLayer((keys_buffer, values_buffer))
    keys, values = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    layer.update(keys, values)
    assert layer.uses_buffers(keys_buffer)
    torch.testing.assert_close(keys_buffer[:, :, :5], keys, rtol=0, atol=0)
    layer.crop(-2)
    more_keys, more_values = torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    layer.update(more_keys, more_values)
    assert not layer.uses_buffers(keys_buffer)
    torch.testing.assert_close(layer.keys, torch.cat([keys[:, :, :3], more_keys], dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(layer.values, torch.cat([values[:, :, :3], more_values], dim=-2), rtol=0, atol=0)


def test_a_new_pool_reads_as_zeros_and_masked_keys_never_reach_the_rows(tiny_loaded: LoadedModel, session_ids) -> None:
    targets = _twins(tiny_loaded)
    pool = targets[0]._slots
    assert pool is not None
    assert all(not tensor.any() for tensor in [*pool.keys, *pool.values])
    # Stale keys and values of earlier sessions lie beyond every session's columns: huge ones must
    # not change any row.
    for tensor in [*pool.keys, *pool.values]:
        tensor.fill_(1e30)
    sessions = [next(session_ids) for _ in PROMPTS]
    _open(targets, sessions, PROMPTS)
    _assert_same_rows(*(target.score(list(zip(sessions, PROPOSALS, strict=True))) for target in targets))


def test_without_address_space_for_the_pool_every_session_has_its_own_cache(
    tiny_loaded: LoadedModel, session_ids, monkeypatch
) -> None:
    import mmap

    def refused(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr("sdcp.models.hf.kvcache.mmap.mmap", refused)
    target = TargetModel(tiny_loaded.model, name="unpooled")
    assert target._slots is None
    monkeypatch.undo()
    reference = TargetModel(tiny_loaded.model, name="pooled")
    sessions = [next(session_ids) for _ in PROMPTS]
    _open((target, reference), sessions, PROMPTS)
    _assert_same_rows(*(t.score(list(zip(sessions, PROPOSALS, strict=True))) for t in (target, reference)))
