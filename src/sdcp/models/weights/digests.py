"""SHA-256 digests of model weights and tokenizers, as named in the session contract (SDCP 4.1).

Weights digest: SHA-256 over the model's `state_dict()` as loaded, tensors in ascending order of
their names; for each tensor, the UTF-8 name, 0x00, the dtype name (e.g. `float32`), 0x00, the
number of dimensions and each dimension as uint64 big-endian, then the raw element bytes in
little-endian order, C-contiguous. Tied tensors appear under each of their names.

Tokenizer digest: SHA-256 of the fast tokenizer's definition `backend_tokenizer.to_str()`,
parsed and re-serialised as canonical JSON (sorted keys, no whitespace, UTF-8), so that files
that differ only in formatting give the same digest.

A GGUF target (llama.cpp) is digested as its file: SHA-256 of the GGUF's bytes, and its tokenizer
as the `tokenizer.json` beside it, loaded as the gateway loads it (docs/interpretations.md).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from sdcp.models.errors import ModelError
from sdcp.protocol.contract import tokenizer_definition_digest

if TYPE_CHECKING:
    # Only a torch model has its weights digested here: a llama.cpp verifier, which digests its
    # GGUF file, never imports torch.
    import torch


def weights_digest(model: torch.nn.Module) -> bytes:
    hasher = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        hasher.update(name.encode("utf-8") + b"\x00")
        hasher.update(str(tensor.dtype).removeprefix("torch.").encode("ascii") + b"\x00")
        hasher.update(struct.pack(">Q", tensor.dim()))
        hasher.update(b"".join(struct.pack(">Q", size) for size in tensor.shape))
        hasher.update(_little_endian_bytes(tensor))
    return hasher.digest()


def _little_endian_bytes(tensor: torch.Tensor) -> bytes:
    # torch keeps CPU tensors in host byte order; the digest is defined over little-endian bytes.
    if sys.byteorder != "little":
        raise ModelError("weights digests are only computed on little-endian hosts")
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def tokenizer_digest(tokenizer: object) -> bytes:
    return tokenizer_definition_digest(tokenizer_definition(tokenizer))


def tokenizer_definition(tokenizer: object) -> str:
    """A fast tokenizer's definition, its ``tokenizer.json``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ModelError(f"{type(tokenizer).__name__} is not a fast tokenizer; cannot read its definition")
    return str(backend.to_str())


def gguf_digest(path: Path) -> bytes:
    """SHA-256 of the file's bytes, read in blocks: what `sha256sum` prints."""
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").digest()


def tokenizer_file_digest(path: Path) -> bytes:
    """The digest of a Hugging Face `tokenizer.json`, equal to `tokenizer_digest` of the fast
    tokenizer transformers loads from it and to the gateway's (sdcp.frontend.text)."""
    return tokenizer_definition_digest(Tokenizer.from_file(str(path)).to_str())
