"""What engines raise besides the protocol's own problems (``sdcp.protocol.problems``)."""

from __future__ import annotations

__all__ = ["EngineError", "SessionNotFound", "Unanswered", "Unavailable"]


class EngineError(Exception):
    """An engine cannot serve a request; nothing was changed by it."""


class SessionNotFound(EngineError):
    """The engine holds no session of that id (never opened here, or already forgotten)."""


class Unavailable(EngineError):
    """The engine cannot answer now (its MLC or model failed, or it is stopping); the request may
    be repeated."""


class Unanswered(EngineError):
    """A peer gave no answer (a lost connection, a timeout, its own failure): a request that is
    idempotent may be sent again."""
