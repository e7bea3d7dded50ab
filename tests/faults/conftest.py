"""The fault tests' deployment on test hosts (tests/faults/deployment.py), built once per module."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import torch
from tests.faults.deployment import Deployment
from tests.faults.drive import PROMPT
from tests.faults.testnet import leftover_namespaces

from sdcp.models.target import TargetModel
from sdcp.models.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # Network namespaces need root and iproute2, loss iptables; CI has all three (.ci/run).
    missing = [tool for tool in ("ip", "iptables", "redis-server") if shutil.which(tool) is None]
    assert os.geteuid() == 0 and not missing, f"the fault tests need root and {missing or 'nothing else'}"
    stale = leftover_namespaces()
    assert not stale, f"namespaces left by an earlier run: {stale} (scripts/testnet down)"
    deployment = Deployment(tmp_path_factory.mktemp("faults"))
    try:
        deployment.up()
        yield deployment
    finally:
        deployment.down()


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
