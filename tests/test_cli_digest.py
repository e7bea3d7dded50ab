"""`sdcp models digest` prints the digests a verifier of the model checks (issue #41): for the backend
a default verifier runs it on here (``auto``), or for the one asked for."""

from __future__ import annotations

import json
import subprocess
import sys

from sdcp.models.choice import choose_backend
from sdcp.models.hf.target import TargetModel
from sdcp.models.hf.tiny import tiny_model, tiny_tokenizer
from sdcp.models.weights.digests import gguf_digest
from sdcp.models.weights.fetch import smollm2_gguf
from sdcp.threads import usable_cores


def digest(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "sdcp", "models", "digest", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert isinstance(printed, dict)
    return printed


def test_the_tiny_models_digests_are_its_torch_targets() -> None:
    target = TargetModel(tiny_model(), tiny_tokenizer(), name="tiny")
    printed = digest("tiny")
    assert printed["backend"] == "torch"
    assert printed["target"] == target.weights_digest.hex()
    assert printed["tokenizer"] == target.tokenizer_digest.hex()
    assert printed["vocab"] == target.vocab_size


def test_smollm2_per_backend_and_as_a_default_verifier_would_run_it() -> None:
    on_llamacpp, on_torch, default = digest("--backend", "llamacpp"), digest("--backend", "torch"), digest()
    # llama.cpp checks the GGUF file's SHA-256, torch the weights as loaded: one model, two digests.
    assert on_llamacpp["target"] == gguf_digest(smollm2_gguf()).hex()
    assert on_torch["target"] != on_llamacpp["target"]
    assert on_torch["tokenizer"] == on_llamacpp["tokenizer"]
    chosen = choose_backend("auto", "smollm2", device="cpu", threads=usable_cores()).backend
    assert default["backend"] == chosen
    assert default["target"] == (on_llamacpp if chosen == "llamacpp" else on_torch)["target"]
