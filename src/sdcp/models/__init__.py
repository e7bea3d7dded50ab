"""Model backends: the verifier's target model and the drafters (torch + transformers, no HTTP)."""

from sdcp.models.batching import BatchingScorer, ScorerClosed
from sdcp.models.digests import tokenizer_digest, weights_digest
from sdcp.models.draft import DraftResult, Drafter, HFDrafter, NgramDrafter
from sdcp.models.errors import (
    BadTokens,
    DigestMismatch,
    FetchError,
    InconsistentCommit,
    KVFormatError,
    ModelError,
    ModelNotFetched,
    SessionExists,
    UnknownModel,
    UnknownSession,
)
from sdcp.models.fetch import fetch_smollm2, sdcp_home
from sdcp.models.registry import LoadedModel, load_drafter, load_model, load_target
from sdcp.models.target import TargetModel

__all__ = [
    "BadTokens",
    "BatchingScorer",
    "DigestMismatch",
    "DraftResult",
    "Drafter",
    "FetchError",
    "HFDrafter",
    "InconsistentCommit",
    "KVFormatError",
    "LoadedModel",
    "ModelError",
    "ModelNotFetched",
    "NgramDrafter",
    "ScorerClosed",
    "SessionExists",
    "TargetModel",
    "UnknownModel",
    "UnknownSession",
    "fetch_smollm2",
    "load_drafter",
    "load_model",
    "load_target",
    "sdcp_home",
    "tokenizer_digest",
    "weights_digest",
]
