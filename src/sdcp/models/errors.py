"""Typed errors of the model backends."""

from __future__ import annotations


class ModelError(Exception):
    """Base class of every error raised by `sdcp.models`."""


class UnknownModel(ModelError):
    """A model or drafter name that the registry cannot resolve."""


class ModelNotFetched(ModelError):
    """A named model whose weights are not in the model cache yet (run `sdcp models fetch`)."""


class FetchError(ModelError):
    """Downloading or converting a bundled model failed."""


class UnknownSession(ModelError):
    """An operation named a session that is not open on this backend."""


class SessionExists(ModelError):
    """`open_session` was called for a session that is already open."""


class SessionLimit(ModelError):
    """`open_session` on a backend whose every session place is held (llama.cpp's sequences)."""


class BadTokens(ModelError):
    """Token ids out of the vocabulary, an empty prompt, or a proposal longer than allowed."""


class InconsistentCommit(ModelError):
    """A commit that does not match the proposal scored for the session."""


class DigestMismatch(ModelError):
    """A contract or KV blob names weights or a tokenizer other than the ones loaded (SDCP 6.1)."""


class KVFormatError(ModelError):
    """A KV blob that is malformed, of an unknown version, or does not fit the session."""
