"""`backend = "auto"`: the faster backend on this host, measured once (sdcp.models.choice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sdcp.models.backend import Target, TargetBackend
from sdcp.models.choice import CHOICES_FILE, BackendChoice, choose_backend, known_backend
from sdcp.models.weights.fetch import FetchResult, models_dir, smollm2_dir


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, smollm2_fetch: FetchResult) -> Path:
    """A home whose models directory holds the fetched SmolLM2 and no measurement yet."""
    root = tmp_path_factory.mktemp("home")
    (root / "models").mkdir()
    smollm2_dir(root).symlink_to(smollm2_dir(), target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def measured(home: Path) -> BackendChoice:
    return choose_backend("auto", "smollm2", device="cpu", threads=1, home=home)


def never_loads(backend: TargetBackend) -> Target:
    raise AssertionError(f"measured {backend} again")


@pytest.mark.parametrize(
    ("setting", "model", "device", "expected"),
    [
        ("torch", "smollm2", "cpu", "torch"),
        ("llamacpp", "smollm2", "cpu", "llamacpp"),
        ("auto", "tiny", "cpu", "torch"),
        ("auto", "/models/other/model.gguf", "cpu", "llamacpp"),
        ("auto", "smollm2", "cuda", "torch"),
    ],
)
def test_what_needs_no_measurement(setting: str, model: str, device: str, expected: str, tmp_path: Path) -> None:
    choice = choose_backend(setting, model, device=device, threads=2, home=tmp_path, load=never_loads)  # type: ignore[arg-type]
    assert choice.backend == expected and choice.measured_ms == {}
    assert not (models_dir(tmp_path) / CHOICES_FILE).exists()


def test_auto_measures_both_backends_once_and_takes_the_faster(home: Path, measured: BackendChoice) -> None:
    assert measured.reason == "measured"
    assert set(measured.measured_ms) == {"torch", "llamacpp"}
    assert all(one_token > 0 and proposal > 0 for one_token, proposal in measured.measured_ms.values())
    assert measured.backend == min(measured.measured_ms, key=lambda backend: sum(measured.measured_ms[backend]))
    again = choose_backend("auto", "smollm2", device="cpu", threads=1, home=home, load=never_loads)
    assert (again.backend, again.measured_ms) == (measured.backend, measured.measured_ms)
    assert "measured on this host before" in again.reason
    # Another thread count is another measurement.
    with pytest.raises(AssertionError, match="measured torch again"):
        choose_backend("auto", "smollm2", device="cpu", threads=2, home=home, load=never_loads)


@pytest.mark.parametrize("damage", ["an unknown backend", "not JSON"])
def test_a_damaged_measurement_is_measured_again(home: Path, measured: BackendChoice, damage: str) -> None:
    choices = models_dir(home) / CHOICES_FILE
    kept = choices.read_text(encoding="utf-8")
    (key,) = json.loads(kept)
    damaged = json.dumps({key: {"backend": "tpu", "measured_ms": {}}}) if damage == "an unknown backend" else "{"
    choices.write_text(damaged, encoding="utf-8")
    try:
        with pytest.raises(AssertionError, match="measured torch again"):
            choose_backend("auto", "smollm2", device="cpu", threads=1, home=home, load=never_loads)
    finally:
        choices.write_text(kept, encoding="utf-8")


def test_what_is_known_without_measuring(home: Path, measured: BackendChoice, tmp_path: Path) -> None:
    # What a process decides before it imports torch or llama.cpp (its OpenMP wait policy).
    assert known_backend("auto", "smollm2", device="cpu", threads=1, home=tmp_path) is None
    known = known_backend("auto", "smollm2", device="cpu", threads=1, home=home)
    assert known is not None and known.backend == measured.backend
    configured = known_backend("llamacpp", "smollm2", device="cpu", threads=1, home=tmp_path)
    assert configured is not None and configured.backend == "llamacpp"
