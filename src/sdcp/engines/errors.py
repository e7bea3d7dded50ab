"""What engines raise besides the protocol's own problems (``sdcp.protocol.problems``)."""

from __future__ import annotations

__all__ = ["EngineError", "OverQuota", "SessionNotFound", "Unanswered", "Unavailable", "RequesterGone"]


class EngineError(Exception):
    """An engine cannot serve a request; nothing was changed by it."""


class SessionNotFound(EngineError):
    """The engine holds no session of that id (never opened here, or already forgotten)."""


class Unavailable(EngineError):
    """The engine cannot answer now (its MLC or model failed, it is stopping, or it holds as many
    sessions or waiters as it may); the request may be repeated, after ``retry_after_s`` if set."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unanswered(EngineError):
    """A peer gave no answer (a lost connection, a timeout, its own failure): a request that is
    idempotent may be sent again."""


class OverQuota(EngineError):
    """The caller holds as much as its quota allows (docs/security.md); the request may be
    repeated after ``retry_after_s``, once some of what it holds has ended."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequesterGone(EngineError):
    """The party that asked for the work went away before it was done: the work stopped."""
