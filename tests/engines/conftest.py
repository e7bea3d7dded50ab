"""Fixtures for the engines' unit tests: the tiny random target, fresh per test over shared weights."""

from __future__ import annotations

import pytest

from sdcp.models.registry import LoadedModel, load_model
from sdcp.models.target import TargetModel


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture
def target(tiny_loaded: LoadedModel) -> TargetModel:
    return TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")
