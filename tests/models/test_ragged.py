"""Packed batched passes with per-session attention compute what transformers' own attention does."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from sdcp.models import LoadedModel, ModelError, TargetModel
from sdcp.models.hf.ragged import ATTENTION, ragged_attention

pytestmark = pytest.mark.timeout(60)


def _reference_logits(loaded: LoadedModel, tokens: list[int]) -> np.ndarray:
    """transformers' forward with its own attention (sdpa) over the whole sequence, no cache."""
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([tokens])).logits[0].numpy()


def test_the_attention_is_registered_when_a_model_uses_it_not_at_import() -> None:
    # In a fresh interpreter: this one's earlier tests have registered it already.
    probe = textwrap.dedent(
        """
        from transformers import AttentionInterface
        from sdcp.models import TargetModel
        from sdcp.models.hf import tiny
        from sdcp.models.hf.ragged import ATTENTION
        print(ATTENTION in AttentionInterface())
        TargetModel(tiny.tiny_model(), name="tiny")
        print(ATTENTION in AttentionInterface())
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=50)
    assert out.stdout.split() == ["False", "True"]


def test_the_target_uses_ragged_attention_and_leaves_the_callers_model(tiny_loaded: LoadedModel) -> None:
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    assert target.model.config._attn_implementation == ATTENTION
    assert tiny_loaded.model.config._attn_implementation != ATTENTION


@pytest.mark.parametrize("proposal", [[], [7], [7, 8, 9, 10, 11]])
def test_rows_equal_transformers_attention(tiny_loaded: LoadedModel, session_ids, proposal: list[int]) -> None:
    target = TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
    others = [next(session_ids) for _ in range(3)]
    for index, session in enumerate(others):
        target.open_session(session, list(range(20, 23 + 4 * index)))
    session = next(session_ids)
    prompt = [5, 6, 7, 8, 9, 10]
    target.open_session(session, prompt)
    expected = _reference_logits(tiny_loaded, [*prompt, *proposal])[len(prompt) - 1 :]
    alone = target.score([(session, proposal)])[0]
    target.rollback(session)
    together = target.score([(other, [1] * index) for index, other in enumerate(others)] + [(session, proposal)])[-1]
    for rows in (alone, together):
        np.testing.assert_array_equal(rows.argmax(-1), expected.argmax(-1))
        np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=1e-4)


def test_refuses_masks_and_batches() -> None:
    query, keys = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="mask"):
        ragged_attention(torch.nn.Module(), query, keys, keys, torch.ones(1, 1, 3, 3))
    with pytest.raises(ValueError, match="one"):
        ragged_attention(torch.nn.Module(), torch.zeros(2, 2, 1, 4), keys, keys, None)


def test_a_sliding_window_model_is_refused(tiny_loaded: LoadedModel) -> None:
    model = copy.deepcopy(tiny_loaded.model)
    model.config.sliding_window = 4
    with pytest.raises(ModelError, match="sliding-window"):
        TargetModel(model, tiny_loaded.tokenizer, name="windowed")
