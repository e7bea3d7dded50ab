"""Fixtures for the engines' unit tests: the tiny random target, fresh per test over shared weights."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tests.engines.verifier_pair import Pair, verifier_pair

from sdcp.models.hf.target import TargetModel
from sdcp.models.registry import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture
def target(tiny_loaded: LoadedModel) -> TargetModel:
    return TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")


@pytest.fixture
async def pair(tiny_loaded: LoadedModel) -> AsyncIterator[Pair]:
    """Two verifier engines over one MLC (tests.engines.verifier_pair)."""
    async with verifier_pair(tiny_loaded) as made:
        yield made
