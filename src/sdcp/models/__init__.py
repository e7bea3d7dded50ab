"""Model backends: the verifier's target model (torch + transformers, or llama.cpp on a GGUF file)
and the drafters (torch + transformers); no HTTP.

Names are loaded on first use (PEP 562) so that `sdcp` commands that never touch a model, and
`sdcp models fetch` before its conversion step, do not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BatchingScorer": "batching",
    "ScorerClosed": "batching",
    "tokenizer_digest": "digests",
    "weights_digest": "digests",
    "DraftResult": "draft",
    "Drafter": "draft",
    "HFDrafter": "draft",
    "NgramDrafter": "draft",
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
    "fetch_smollm2": "fetch",
    "LlamaCppTarget": "llamacpp",
    "LoadedModel": "registry",
    "end_of_text_tokens": "registry",
    "load_drafter": "registry",
    "load_model": "registry",
    "load_tokenizer": "registry",
    "load_target": "registry",
    "target_vocab_size": "registry",
    "Target": "backend",
    "TargetModel": "target",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from sdcp.models.backend import Target
    from sdcp.models.batching import BatchingScorer, ScorerClosed
    from sdcp.models.digests import tokenizer_digest, weights_digest
    from sdcp.models.draft import Drafter, DraftResult, HFDrafter, NgramDrafter
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
    from sdcp.models.fetch import fetch_smollm2
    from sdcp.models.llamacpp import LlamaCppTarget
    from sdcp.models.registry import (
        LoadedModel,
        end_of_text_tokens,
        load_drafter,
        load_model,
        load_target,
        load_tokenizer,
        target_vocab_size,
    )
    from sdcp.models.target import TargetModel


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sdcp.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"sdcp.models.{module}"), name)
    globals()[name] = value
    return value
