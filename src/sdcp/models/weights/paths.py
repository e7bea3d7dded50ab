"""Where a named or local model lives, without importing torch or transformers (a gateway host
installs neither)."""

from __future__ import annotations

from pathlib import Path

from sdcp.models.errors import ModelNotFetched, UnknownModel
from sdcp.models.weights.fetch import SMOLLM2_NAME, is_fetched, smollm2_dir

__all__ = ["TINY_DRAFT_NAME", "TINY_NAME", "model_dir"]

# Randomly initialised models built in code (sdcp.models.hf.tiny), for tests.
TINY_NAME = "tiny"
TINY_DRAFT_NAME = "tiny-draft"


def model_dir(name_or_path: str, home: Path | None = None) -> Path:
    """The directory of the bundled model or of a local Hugging Face model directory."""
    if name_or_path == SMOLLM2_NAME:
        path = smollm2_dir(home)
        if not is_fetched(path):
            raise ModelNotFetched(f"{SMOLLM2_NAME} is not in {path}; run `sdcp models fetch`")
        return path
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise UnknownModel(
            f"{name_or_path!r} is neither {SMOLLM2_NAME}, {TINY_NAME}, {TINY_DRAFT_NAME} "
            "nor a Hugging Face model directory"
        )
    return path
