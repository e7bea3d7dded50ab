"""Model backends, by runtime: `hf/` (torch + transformers: a Hugging Face directory, the `torch`
target backend and `hf:` drafters), `llamacpp/` (a GGUF file: the `llamacpp` backend and `llamacpp:`
drafters), `lookup/` (the model-free `ngram` and `suffix` drafters) and `weights/` (fetching the
bundled model, digests). At the root: what every target (`backend`) and drafter (`drafter`) is, and
what the verifier runs them with (`worker`, `batching`, `registry`, `choice`); no HTTP.

Names are loaded on first use (PEP 562) so that `sdcp` commands that never touch a model, and
`sdcp models fetch` before its conversion step, do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BatchingScorer": "batching",
    "ScorerClosed": "batching",
    "tokenizer_digest": "weights.digests",
    "weights_digest": "weights.digests",
    "DraftResult": "drafter",
    "Drafter": "drafter",
    "HFDrafter": "hf.drafter",
    "NgramDrafter": "lookup.ngram",
    "BadTokens": "errors",
    "DigestMismatch": "errors",
    "FetchError": "errors",
    "InconsistentCommit": "errors",
    "KVFormatError": "errors",
    "ModelError": "errors",
    "ModelNotFetched": "errors",
    "SessionExists": "errors",
    "SessionLimit": "errors",
    "UnknownModel": "errors",
    "UnknownSession": "errors",
    "fetch_smollm2": "weights.fetch",
    "LlamaCppTarget": "llamacpp.target",
    "LoadedModel": "registry",
    "end_of_text_tokens": "registry",
    "load_drafter": "registry",
    "load_model": "registry",
    "load_tokenizer": "registry",
    "load_target": "registry",
    "target_vocab_size": "registry",
    "Target": "backend",
    "TargetModel": "hf.target",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from sdcp.models.backend import Target
    from sdcp.models.batching import BatchingScorer, ScorerClosed
    from sdcp.models.drafter import Drafter, DraftResult
    from sdcp.models.errors import (
        BadTokens,
        DigestMismatch,
        FetchError,
        InconsistentCommit,
        KVFormatError,
        ModelError,
        ModelNotFetched,
        SessionExists,
        SessionLimit,
        UnknownModel,
        UnknownSession,
    )
    from sdcp.models.hf.drafter import HFDrafter
    from sdcp.models.hf.target import TargetModel
    from sdcp.models.llamacpp.target import LlamaCppTarget
    from sdcp.models.lookup.ngram import NgramDrafter
    from sdcp.models.registry import (
        LoadedModel,
        end_of_text_tokens,
        load_drafter,
        load_model,
        load_target,
        load_tokenizer,
        target_vocab_size,
    )
    from sdcp.models.weights.digests import tokenizer_digest, weights_digest
    from sdcp.models.weights.fetch import fetch_smollm2


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sdcp.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"sdcp.models.{module}"), name)
    globals()[name] = value
    return value
