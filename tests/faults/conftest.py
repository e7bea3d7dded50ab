"""The fault tests' deployment on test hosts (tests/faults/deployment.py), built once per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tests.faults.deployment import Deployment, deployed
from tests.faults.drive import PROMPT

from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deployed(tmp_path_factory.mktemp("faults")) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """Greedy decoding of the tiny target, memoised by length (SDCP 6.4 rule 1)."""
    model = TargetModel(tiny_model(), tiny_tokenizer(), name="tiny").model
    generated = model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=400,
        do_sample=False,
        pad_token_id=0,
        # The sessions' contracts stop at nothing (stop = []): the tiny model's generation config
        # would end the reference at its EOS, token 0, which it reaches after 356 tokens.
        eos_token_id=None,
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
    )
    tokens = generated[0, len(PROMPT) :].tolist()
    return {count: tokens[:count] for count in (40, 100, 200, 300, 400)}
