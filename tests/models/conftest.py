"""Fixtures for the model backends: tiny seeded models, and SmolLM2 fetched once into the cache."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count

import pytest

from sdcp.home import sdcp_home
from sdcp.models import LoadedModel, TargetModel, fetch_smollm2, load_model
from sdcp.models.weights.fetch import FetchResult


@pytest.fixture(scope="session")
def tiny_loaded() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_draft_loaded() -> LoadedModel:
    return load_model("tiny-draft")


@pytest.fixture
def tiny_target(tiny_loaded: LoadedModel) -> TargetModel:
    # A fresh TargetModel per test over shared weights: sessions never leak between tests.
    return TargetModel(tiny_loaded.model, tiny_loaded.tokenizer, name="tiny")


@pytest.fixture(scope="session")
def smollm2_fetch() -> FetchResult:
    """Runs the `sdcp models fetch` code path into $SDCP_HOME (or ~/.cache/sdcp): converts once."""
    return fetch_smollm2(sdcp_home())


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_fetch: FetchResult) -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture
def session_ids() -> Iterator[bytes]:
    return (index.to_bytes(16, "big") for index in count(1))
